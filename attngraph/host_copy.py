"""Host-to-device copies that never make the host wait for the device.

``cpu_tensor.to("cuda", non_blocking=True)`` from ordinary (pageable) memory is not
asynchronous in practice: the driver stages pageable memory through its own buffer and the
calling thread waits until the copy, queued behind everything already on the stream, has run.
Without ``non_blocking`` the copy even ends in a stream synchronize. Either way the host cannot
queue the next step while the GPU executes the current one, and the GPU then idles for the host's
whole launch time (a CUDA graph of a thousand kernels takes the host hundreds of microseconds
to launch).

Here the host tensor is first copied into page-locked memory from PyTorch's caching host
allocator (``Tensor.pin_memory()``), then copied with ``non_blocking=True``. The allocator
records an event on the stream for that copy and hands the pinned block out again only once
the event has passed, so the host may overwrite or free its own tensor at once.
"""

from __future__ import annotations

import torch


def _pinned(src: torch.Tensor) -> torch.Tensor:
    return src if src.is_pinned() else src.pin_memory()


def to_device(src: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``src`` (a host tensor) on ``device`` as a new tensor (``dtype``: converted on the
    host first), queued on the current stream without waiting for it. Other devices, or a
    tensor already there: ``Tensor.to``."""
    device = torch.device(device)
    if dtype is not None and src.dtype != dtype:
        src = src.to(dtype)
    if device.type != "cuda" or src.device.type != "cpu":
        return src.to(device)
    return _pinned(src).to(device, non_blocking=True)


def copy_to_device(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` for a host ``src`` and a device ``dst`` (broadcast as ``copy_``),
    queued on the current stream without waiting for it (see the module). Returns ``dst``."""
    if dst.device.type != "cuda" or src.device.type != "cpu":
        return dst.copy_(src)
    return dst.copy_(_pinned(src), non_blocking=True)
