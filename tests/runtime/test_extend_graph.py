"""The extend-graph layout on the CPU: a step staged into a token bucket (real requests, padding
requests on the pad row, empty slots) gives the logits of the unpadded step, and writes no
K/V outside the real requests' slots and the dummy page.

Capture itself needs CUDA (`test_piecewise_gpu.py` runs the graphs); the staged step here is
the exact code the graph records, run eagerly.
"""

import pytest
import torch

from attngraph import CompileConfig
from attngraph.errors import CaptureError
from attngraph.forward_batch import ForwardBatch
from attngraph.runtime.extend_graph import MAX_GRAPH_REQUESTS, ExtendGraphRunner, slots_for_bucket
from attngraph.runtime.model_runner import ModelRunner

from ..hf_models import build_model
from .test_soak import cpu_triton


def test_slots_cover_the_bucket():
    assert slots_for_bucket(16, 256, 64) == 16 + 1
    assert slots_for_bucket(512, 256, 128) == MAX_GRAPH_REQUESTS + 4
    assert slots_for_bucket(8, 4, 8) == 4 + 1
    assert slots_for_bucket(9, 4, 8) == 4 + 2


def _prefill(runner: ModelRunner, lens: list[int], prefix: list[int], g: torch.Generator):
    pool = runner.pool
    vocab = runner.model.config.vocab_size
    rows = [pool.alloc_request() for _ in lens]
    pool.reserve(rows, [p + n for p, n in zip(prefix, lens)])
    if any(prefix):  # cache the prefixes first, through the plain path
        ids = torch.randint(0, vocab, (sum(prefix),), generator=g)
        runner.forward(ForwardBatch.build(pool, rows, [0] * len(rows), prefix, ids))
    ids = torch.randint(0, vocab, (sum(lens),), generator=g)
    return rows, ForwardBatch.build(pool, rows, prefix, lens, ids)


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_staged_bucket_gives_the_unpadded_logits(arch, backend):
    if backend == "triton" and not cpu_triton():
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1 before import (tests/conftest.py)")
    g = torch.Generator().manual_seed(7)
    model = build_model(arch, "sdpa", seed=3)
    # 8-token table rows: a 16-token bucket needs two padding requests for 7 real tokens.
    config = CompileConfig(attention_backend=backend, page_size=4, kv_cache_tokens=256, max_requests=4, max_context_len=8)
    runner = ModelRunner(model, config)
    runner.warmup()
    extend = ExtendGraphRunner(runner, (16, 32))
    assert extend.real_slots == {16: 4, 32: 4} and extend.slots == {16: 6, 32: 8}
    pool = runner.pool
    for lens, prefix in (([3, 4], [0, 0]), ([1, 2, 3], [4, 0, 2]), ([8], [0]), ([5], [3]), ([8, 8, 8, 8], [0, 0, 0, 0])):
        rows, batch = _prefill(runner, lens, prefix, g)
        snapshot = [k.clone() for k in pool.k_buffers]
        want = runner.forward(batch)  # unpadded, writes the new K/V
        written = [k.clone() for k in pool.k_buffers]
        for k, s in zip(pool.k_buffers, snapshot):  # the staged step writes them again
            k.copy_(s)
        assert extend.can_run(batch)
        size = extend.bucket(batch.num_tokens)
        static = extend.stage(batch, size)
        assert static.batch_size == extend.slots[size] and static.num_tokens == size
        assert int(static.qo_indptr[-1]) == size  # padding rows all belong to padding requests
        runner.backend.init_forward_metadata_out_graph(static)
        got = extend.step(static)[: len(lens)]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for k, w in zip(pool.k_buffers, written):  # real slots as unpadded; pages other than
            torch.testing.assert_close(k[1:], w[1:])  # the dummy page (0) untouched by padding
        for r in rows:
            pool.free_request(r)


def test_too_many_requests_for_a_bucket_are_not_served():
    g = torch.Generator().manual_seed(1)
    model = build_model("llama", "sdpa", seed=3)
    config = CompileConfig(attention_backend="torch_native", page_size=4, kv_cache_tokens=256, max_requests=8)
    runner = ModelRunner(model, config)
    runner.warmup()
    extend = ExtendGraphRunner(runner, (4, 8))
    rows, batch = _prefill(runner, [1] * 5, [0] * 5, g)  # 5 requests, bucket 8 holds min(8, 8, 32)
    assert extend.can_run(batch)
    for r in rows:
        runner.pool.free_request(r)
    rows, batch = _prefill(runner, [1] * 5 + [3], [0] * 6, g)  # 8 tokens: fits bucket 8
    assert extend.can_run(batch)
    with pytest.raises(CaptureError, match="does not fit bucket 4"):
        extend.stage(batch, 4)
    for r in rows:
        runner.pool.free_request(r)
    rows, batch = _prefill(runner, [2, 3, 4], [0, 0, 0], g)  # 9 tokens: above the largest bucket
    assert not extend.can_run(batch)
    for r in rows:
        runner.pool.free_request(r)


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_staged_verify_bucket_gives_logits_at_every_token(backend):
    """The verify graphs' layout (``all_logits``): the staged step's rows ``[:n]`` are the
    unpadded step's logits at every new token."""
    if backend == "triton" and not cpu_triton():
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1 before import (tests/conftest.py)")
    g = torch.Generator().manual_seed(11)
    model = build_model("llama", "sdpa", seed=5)
    config = CompileConfig(attention_backend=backend, page_size=4, kv_cache_tokens=256, max_requests=4, max_context_len=16)
    runner = ModelRunner(model, config)
    runner.warmup()
    verify = ExtendGraphRunner(runner, (8, 16), all_logits=True)
    pool = runner.pool
    for lens, prefix in (([5], [6]), ([2, 4, 3], [3, 1, 7]), ([1, 1], [2, 9])):
        rows, batch = _prefill(runner, lens, prefix, g)
        snapshot = [k.clone() for k in pool.k_buffers]
        want = runner.forward(batch, torch.arange(batch.num_tokens))  # unpadded, every token
        for k, s in zip(pool.k_buffers, snapshot):
            k.copy_(s)
        size = verify.bucket(batch.num_tokens)
        static = verify.stage(batch, size)
        runner.backend.init_forward_metadata_out_graph(static)
        got = verify.step(static)
        assert got.shape[0] == size  # one row per token of the bucket
        assert not torch.equal(got[: batch.num_tokens], torch.zeros_like(want))
        torch.testing.assert_close(got[: batch.num_tokens], want, rtol=1e-5, atol=1e-5)
        for r in rows:
            pool.free_request(r)
