"""`attngraph.host_copy`: host-to-device copies equal ``Tensor.to`` and, on a GPU, return while
the stream is still busy, with the host tensor free to change at once."""

from __future__ import annotations

import pytest
import torch

from attngraph.host_copy import copy_to_device, to_device


def test_on_the_cpu_they_are_plain_copies():
    src = torch.randint(-1000, 1000, (5, 7), dtype=torch.int32)
    out = to_device(src, torch.device("cpu"), torch.int64)
    assert out.dtype == torch.int64 and torch.equal(out, src.long())
    dst = torch.full((5, 7), -1, dtype=torch.int32)
    assert copy_to_device(dst, src) is dst and torch.equal(dst, src)
    dst2 = torch.full((3, 5, 7), -1, dtype=torch.int32)
    copy_to_device(dst2, src)  # broadcast, as copy_
    assert torch.equal(dst2, src.expand(3, 5, 7))


@pytest.mark.gpu
def test_on_the_gpu_the_host_does_not_wait_and_may_reuse_its_tensor():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.current_stream(device)
    for trial in range(3):
        src = torch.randint(-(2**40), 2**40, (4, 1000), dtype=torch.int64)
        want = src.clone()
        dst = torch.full((4, 1000), -7, dtype=torch.int64, device=device)
        torch.cuda._sleep(50_000_000)  # tens of milliseconds of device work ahead of the copies
        got = to_device(src, device)
        copy_to_device(dst, src)
        host_waited = stream.query()  # a blocking copy would have waited for the sleep
        src.fill_(trial)  # the host reuses its tensor while the copies are still queued
        torch.cuda.synchronize(device)
        assert not host_waited
        assert torch.equal(got.cpu(), want) and torch.equal(dst.cpu(), want)
