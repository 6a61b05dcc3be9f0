"""The triton backend against the torch_native reference.

Without CUDA the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set here
before Triton is imported) on tiny shapes; with CUDA the same tests run natively, plus a
sampled sweep of realistic shapes (``@pytest.mark.gpu``).

Every test uses fresh random data, poisons the KV pages that no request may read (NaN), and
runs with ``torch.utils.deterministic.fill_uninitialized_memory`` so every ``torch.empty`` the
backend allocates (outputs, split buffers) starts as NaN: a value the kernels fail to write,
or a slot they read but should not, shows up as NaN.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from attngraph.attn_backends.triton_ops import decode_attention, extend_attention  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(decode_attention._decode_stage1_kernel, InterpretedFunction):
        # Another test module imported the kernels before the variable was set: rebuild them.
        import attngraph.attn_backends.triton_backend as _tb
        import attngraph.attn_backends.triton_ops as _ops

        for _mod in (decode_attention, extend_attention, _ops, _tb):
            importlib.reload(_mod)

from attngraph.attn_backends import registry  # noqa: E402
from attngraph.attn_backends.base import AttentionLayer, ModelAttentionSpec  # noqa: E402
from attngraph.attn_backends.torch_native import TorchNativeBackend  # noqa: E402
from attngraph.attn_backends.triton_backend import TritonBackend  # noqa: E402
from attngraph.errors import BackendUnavailableError, InputError  # noqa: E402
from attngraph.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from attngraph.runtime.kv_pool import KVPool  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _poison_empty(poison_empty):
    """``torch.empty`` returns NaN-filled tensors for the duration of a test (conftest)."""


# ----------------------------------------------------------------------------- helpers
def make_step(prefix_lens, extend_lens, *, hq, hkv, d, page_size, dtype, dv=None, mode=None, num_layers=1, seed=0,
              value_in_key=False):  # fmt: skip
    """A pool whose prefix slots hold random K/V (every other slot NaN), a batch, and new q/k/v.

    ``value_in_key``: MLA's latent pool, the values being the keys' first ``dv`` columns."""
    gen = torch.Generator().manual_seed(seed)
    dv = dv or d
    total = [p + e for p, e in zip(prefix_lens, extend_lens)]
    num_pages = sum(math.ceil(t / page_size) for t in total) + 3
    pool = KVPool(num_layers, hkv, d, num_pages, page_size, dtype, DEVICE, max_requests=len(total) + 2,
                  max_context_len=max(total) + page_size, v_head_dim=dv, value_in_key=value_in_key)  # fmt: skip
    for buf in pool.k_buffers + pool.v_buffers:
        buf.fill_(float("nan"))
    # Take a spare row first so request rows are not simply 0..B-1.
    spare = pool.alloc_request()
    rows = [pool.alloc_request() for _ in total]
    pool.free_request(spare)
    pool.reserve(rows, total)
    for layer_id in range(num_layers):
        kflat = pool.k_buffers[layer_id].view(-1, hkv, d)
        vflat = pool.v_buffers[layer_id].view(-1, hkv, dv)
        for row, p in zip(rows, prefix_lens):
            if p == 0:
                continue
            pos = torch.arange(p)
            slots = (pool.req_to_page_cpu[row, pos // page_size].long() * page_size + pos % page_size).to(DEVICE)
            kflat[slots] = torch.randn(p, hkv, d, generator=gen).to(DEVICE, dtype)
            if not value_in_key:
                vflat[slots] = torch.randn(p, hkv, dv, generator=gen).to(DEVICE, dtype)
    n = sum(extend_lens)
    batch = ForwardBatch.build(pool, rows, list(prefix_lens), list(extend_lens), torch.zeros(n, dtype=torch.long), mode=mode)
    q = torch.randn(n, hq, d, generator=gen).to(DEVICE, dtype)
    k = torch.randn(n, hkv, d, generator=gen).to(DEVICE, dtype)
    v = k[..., :dv] if value_in_key else torch.randn(n, hkv, dv, generator=gen).to(DEVICE, dtype)
    return pool, batch, q, k, v


def capture_step(warm_up, step):
    """Run ``warm_up()`` on a side stream (the kernels compile outside the capture), then
    record ``step()`` in a CUDA graph. Returns ``(graph, step's output)``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        warm_up()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def layer_for(hq, hkv, d, *, dv=None, causal=True, window_left=-1, logit_cap=0.0, layer_id=0):
    return AttentionLayer(layer_id, hq, hkv, d, dv or d, d**-0.5, causal, window_left, logit_cap)


def reference(q, layer, batch):
    """torch_native in fp32 over the pool as it is (the new K/V already written)."""
    return TorchNativeBackend().forward(q.float(), None, None, layer, batch, save_kv_cache=False)


def run_and_check(backend, q, k, v, layer, batch):
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, layer, batch)  # appends k/v to the pool first
    ref = reference(q, layer, batch)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any(), "kernel left NaN (unwritten output or a poisoned slot read)"
    tol = TOL[q.dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    return out


# ----------------------------------------------------------------------------- extend (CPU-sized)
# (prefix_lens, extend_lens, hq, hkv, d, page_size, causal, window_left, logit_cap, dtype)
EXTEND_CASES = [
    pytest.param([0], [7], 2, 2, 16, 1, True, -1, 0.0, torch.float32, id="no-prefix-p1-mha"),
    pytest.param([5, 0, 13], [3, 9, 1], 8, 2, 32, 4, True, -1, 0.0, torch.float32, id="prefix-p4-gqa4"),
    pytest.param([11, 2], [21, 6], 4, 4, 16, 4, True, 5, 0.0, torch.float32, id="window-p4"),
    # Windows wider than a key block: some key blocks are seen in full, others partly.
    pytest.param([30, 3], [40, 25], 2, 1, 16, 4, True, 19, 0.0, torch.float32, id="wide-window"),
    pytest.param([22, 0], [37, 41], 2, 2, 16, 16, False, 18, 0.0, torch.float32, id="noncausal-wide-window"),
    pytest.param([20], [19], 4, 1, 32, 16, True, -1, 4.0, torch.float32, id="softcap-p16-mqa"),
    pytest.param([6, 0], [10, 17], 8, 2, 16, 3, True, 4, 2.5, torch.float32, id="window-softcap-p3"),
    pytest.param([3, 9], [14, 5], 4, 2, 16, 4, False, -1, 0.0, torch.float32, id="noncausal"),
    pytest.param([9, 0], [12, 18], 4, 1, 16, 1, False, 3, 3.0, torch.float32, id="noncausal-window-softcap"),
    pytest.param([7], [13], 4, 2, 24, 4, True, -1, 0.0, torch.float32, id="head-dim-24"),
    pytest.param([10, 1], [9, 22], 8, 2, 32, 4, True, -1, 0.0, torch.float16, id="fp16"),
    pytest.param([10, 1], [9, 22], 8, 2, 32, 16, True, 7, 5.0, torch.bfloat16, id="bf16-window-softcap"),
]


@pytest.mark.parametrize("prefix,extend,hq,hkv,d,page_size,causal,window,cap,dtype", EXTEND_CASES)
def test_extend_matches_reference(prefix, extend, hq, hkv, d, page_size, causal, window, cap, dtype):
    pool, batch, q, k, v = make_step(prefix, extend, hq=hq, hkv=hkv, d=d, page_size=page_size, dtype=dtype)
    assert batch.mode is ForwardMode.EXTEND
    layer = layer_for(hq, hkv, d, causal=causal, window_left=window, logit_cap=cap)
    run_and_check(TritonBackend(), q, k, v, layer, batch)


@pytest.mark.parametrize("causal,window", [(True, -1), (True, 17), (False, 16)])
def test_extend_every_alignment(causal, window):
    """Prefixes 0..16 in one batch: the query blocks meet key blocks at every offset."""
    prefix = list(range(17))
    extend = [17 + i % 5 for i in prefix]
    pool, batch, q, k, v = make_step(prefix, extend, hq=1, hkv=1, d=16, page_size=4, dtype=torch.float32)
    run_and_check(TritonBackend(), q, k, v, layer_for(1, 1, 16, causal=causal, window_left=window), batch)


@pytest.mark.parametrize("prefix,extend,bound", [([0], [7], 7), ([5, 0, 13, 2], [3, 33, 1, 17], 64), ([4, 9, 0], [16, 0, 5], 40)])
def test_extend_with_a_static_bound_matches_reference(prefix, extend, bound):
    """A captured graph's bound (``static_max_extend_len``): the packed grid of
    ``bound // BLOCK_M + B`` programs per head, each finding its request by binary search,
    covers every query block of every request, empty requests and slack included."""
    pool, batch, q, k, v = make_step(prefix, extend, hq=4, hkv=2, d=16, page_size=4, dtype=torch.float32)
    batch = dataclasses.replace(batch, static_max_extend_len=bound)
    run_and_check(TritonBackend(), q, k, v, layer_for(4, 2, 16), batch)


def test_extend_reads_new_tokens_back_from_pool():
    """With save_kv_cache=False the kernel must use what is in the pool, not the k/v arguments."""
    pool, batch, q, k, v = make_step([4], [6], hq=2, hkv=1, d=16, page_size=4, dtype=torch.float32)
    layer = layer_for(2, 1, 16)
    pool.write(0, batch.out_cache_loc, k, v)
    backend = TritonBackend()
    backend.init_forward_metadata(batch)
    out = backend.forward(q, torch.zeros_like(k), torch.zeros_like(v), layer, batch, save_kv_cache=False)
    torch.testing.assert_close(out, reference(q, layer, batch), atol=2e-5, rtol=2e-5)


def test_mixed_mode_and_idle():
    pool, batch, q, k, v = make_step([6, 0], [1, 5], hq=4, hkv=2, d=16, page_size=4, dtype=torch.float32,
                                     mode=ForwardMode.MIXED)  # fmt: skip
    run_and_check(TritonBackend(), q, k, v, layer_for(4, 2, 16), batch)
    idle = ForwardBatch.build(pool, [], [], [], torch.zeros(0, dtype=torch.long))
    out = TritonBackend().forward(q[:0], k[:0], v[:0], layer_for(4, 2, 16), idle)
    assert out.shape == (0, 4, 16)


def test_two_layers_share_step_buffers():
    pool, batch, q, k, v = make_step([5, 12], [1, 1], hq=4, hkv=2, d=16, page_size=4, dtype=torch.float32,
                                     num_layers=2)  # fmt: skip
    assert batch.mode is ForwardMode.DECODE
    backend = TritonBackend(min_split_len=4)
    for layer_id in (0, 1):
        layer = layer_for(4, 2, 16, layer_id=layer_id, window_left=3 * layer_id - 1)
        run_and_check(backend, q, k, v, layer, batch)


# ----------------------------------------------------------------------------- decode (CPU-sized)
# (seq_lens, hq, hkv, d, page_size, window_left, logit_cap, dtype, min_split_len, max_kv_splits)
DECODE_CASES = [
    pytest.param([1, 7, 30], 2, 2, 16, 1, -1, 0.0, torch.float32, 64, 16, id="p1-mha-one-split"),
    pytest.param([5, 33, 50], 8, 2, 32, 4, -1, 0.0, torch.float32, 8, 4, id="p4-gqa4-splits"),
    pytest.param([70, 3], 8, 1, 16, 16, -1, 0.0, torch.float32, 16, 16, id="p16-gqa8-splits"),
    pytest.param([45, 9, 2], 4, 4, 16, 4, 6, 0.0, torch.float32, 8, 8, id="window"),
    pytest.param([41, 18], 4, 1, 32, 4, -1, 3.0, torch.float32, 8, 8, id="softcap"),
    pytest.param([57], 8, 2, 24, 3, 20, 2.0, torch.float32, 8, 3, id="head-dim-24-window-softcap"),
    pytest.param([39, 6], 8, 2, 32, 4, -1, 0.0, torch.float16, 8, 4, id="fp16"),
    pytest.param([39, 6], 8, 2, 32, 16, 9, 4.0, torch.bfloat16, 8, 4, id="bf16-window-softcap"),
]


@pytest.mark.parametrize("seq_lens,hq,hkv,d,page_size,window,cap,dtype,min_split,max_splits", DECODE_CASES)
def test_decode_matches_reference(seq_lens, hq, hkv, d, page_size, window, cap, dtype, min_split, max_splits):
    prefix = [s - 1 for s in seq_lens]
    pool, batch, q, k, v = make_step(prefix, [1] * len(seq_lens), hq=hq, hkv=hkv, d=d, page_size=page_size,
                                     dtype=dtype, mode=ForwardMode.DECODE)  # fmt: skip
    backend = TritonBackend(min_split_len=min_split, max_kv_splits=max_splits)
    run_and_check(backend, q, k, v, layer_for(hq, hkv, d, window_left=window, logit_cap=cap), batch)


def test_decode_writes_the_given_out_buffer():
    """With ``out=`` (the padded graph rows' first rows) the decode kernel writes there itself:
    the same buffer comes back, equal to the reference, and the rows past it keep their poison."""
    pool, batch, q, k, v = make_step([17, 4], [1, 1], hq=4, hkv=2, d=16, page_size=4, dtype=torch.float32,
                                     mode=ForwardMode.DECODE)  # fmt: skip
    layer = layer_for(4, 2, 16)
    backend = TritonBackend(min_split_len=4, max_kv_splits=4)
    assert backend.decode_writes_out
    padded = torch.full((3, 4, 16), float("nan"), dtype=q.dtype, device=q.device)
    backend.init_forward_metadata(batch)
    got = backend.forward(q, k, v, layer, batch, out=padded[:2])
    assert got.data_ptr() == padded.data_ptr()
    torch.testing.assert_close(got.float(), reference(q, layer, batch), atol=TOL[q.dtype], rtol=TOL[q.dtype])
    assert torch.isnan(padded[2]).all()


def test_decode_refuses_a_misshapen_out_before_writing_the_pool():
    pool, batch, q, k, v = make_step([9], [1], hq=4, hkv=2, d=16, page_size=4, dtype=torch.float32,
                                     mode=ForwardMode.DECODE)  # fmt: skip
    backend = TritonBackend()
    backend.init_forward_metadata(batch)
    before = pool.k_buffers[0].clone()
    with pytest.raises(InputError, match=r"out= must be a \[1, 4, 16\] tensor"):
        backend.forward_decode(q, k, v, layer_for(4, 2, 16), batch, out=q.new_empty((1, 4, 8)))
    torch.testing.assert_close(pool.k_buffers[0], before, rtol=0, atol=0, equal_nan=True)  # nothing stored


def test_decode_noncausal_equals_causal():
    pool, batch, q, k, v = make_step([12, 30], [1, 1], hq=4, hkv=2, d=16, page_size=4, dtype=torch.float32)
    backend = TritonBackend(min_split_len=8)
    run_and_check(backend, q, k, v, layer_for(4, 2, 16, causal=False, window_left=5), batch)


def test_deterministic_is_batch_invariant():
    """deterministic=True: one request gives bit-identical output alone or among others."""
    hq, hkv, d = 4, 2, 16
    pool, batch, q, k, v = make_step([40, 3, 17], [1, 1, 1], hq=hq, hkv=hkv, d=d, page_size=4, dtype=torch.float32)
    layer = layer_for(hq, hkv, d)
    backend = TritonBackend(deterministic=True, min_split_len=8, max_kv_splits=4)
    assert backend.decode_max_splits(1, hkv, q.device) == backend.decode_max_splits(64, hkv, q.device) == 4
    together = run_and_check(backend, q, k, v, layer, batch)
    rows = batch.req_pool_indices.tolist()
    alone = ForwardBatch.build(pool, rows[:1], [40], [1], torch.zeros(1, dtype=torch.long))
    out = backend.forward(q[:1], k[:1], v[:1], layer, alone, save_kv_cache=False)
    assert torch.equal(out, together[:1])


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU (interpreter) launch")
@pytest.mark.parametrize("deterministic,max_kv_splits,bound,want", [(True, 32, 32, 3), (False, 32, 4, 3), (True, 2, 2, 2)])
def test_cpu_decode_split_axis_stops_at_the_longest_request(monkeypatch, deterministic, max_kv_splits, bound, want):
    """Over CPU tensors the grid's split axis is what the longest request uses (21 + 1 keys in
    splits of 8: 3), not the batch's bound (`decode_max_splits`); a smaller bound still caps it."""
    import attngraph.attn_backends.triton_backend as tb

    hq, hkv, d = 4, 2, 16
    pool, batch, q, k, v = make_step([21, 5], [1, 1], hq=hq, hkv=hkv, d=d, page_size=4, dtype=torch.float32)
    backend = TritonBackend(deterministic=deterministic, min_split_len=8, max_kv_splits=max_kv_splits)
    assert backend.decode_max_splits(2, hkv, q.device) == bound
    seen, launch = [], tb.decode_attention_fwd

    def spy(*args, **kwargs):
        seen.append((kwargs["max_splits"], args[7].shape[2]))  # the grid's axis, partial_out's splits
        return launch(*args, **kwargs)

    monkeypatch.setattr(tb, "decode_attention_fwd", spy)
    run_and_check(backend, q, k, v, layer_for(hq, hkv, d), batch)
    assert seen == [(want, want)]


def test_cuda_graph_state_buffers_are_used():
    hq, hkv, d = 8, 2, 32
    spec = ModelAttentionSpec(num_layers=1, num_q_heads=hq, num_kv_heads=hkv, head_dims=(d,), dtype=torch.float32,
                              device_type=DEVICE, page_size=4)  # fmt: skip
    backend = TritonBackend(spec, min_split_len=8)
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    base_ptr = backend._graph_part_o.data_ptr()
    pool, batch, q, k, v = make_step([30, 9, 21], [1, 1, 1], hq=hq, hkv=hkv, d=d, page_size=4, dtype=torch.float32)
    part_o, _ = backend._partials(3, hq, backend.decode_max_splits(3, hkv, q.device), d, q.device)
    assert part_o.data_ptr() == base_ptr
    run_and_check(backend, q, k, v, layer_for(hq, hkv, d), batch)


# ----------------------------------------------------------------------------- dense (stateless)
@pytest.mark.parametrize(
    "b,sq,sk,causal,window,cap",
    [(2, 9, 9, True, -1, 0.0), (3, 5, 21, True, 6, 0.0), (2, 11, 11, False, -1, 2.0), (1, 4, 17, False, 3, 0.0)],
)
def test_dense_matches_reference(b, sq, sk, causal, window, cap):
    hq, hkv, d = 4, 2, 16
    gen = torch.Generator().manual_seed(b * 100 + sq)
    q = torch.randn(b * sq, hq, d, generator=gen).to(DEVICE)
    k = torch.randn(b * sk, hkv, d, generator=gen).to(DEVICE)
    v = torch.randn(b * sk, hkv, d, generator=gen).to(DEVICE)
    layer = layer_for(hq, hkv, d, causal=causal, window_left=window, logit_cap=cap)
    out = TritonBackend().forward_dense(q, k, v, layer, b)
    ref = TorchNativeBackend().forward_dense(q, k, v, layer, b)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


# ----------------------------------------------------------------------------- attention sinks
def _with_sinks(layer, seed):
    """``layer`` with random per-head sink logits (some far above the scores: they must win)."""
    gen = torch.Generator().manual_seed(seed)
    sinks = torch.randn(layer.num_q_heads, generator=gen) * 3
    sinks[0] = 20.0
    return dataclasses.replace(layer, sinks=sinks.to(DEVICE))


@pytest.mark.parametrize("prefix,extend,window,bound", [([0, 6], [9, 4], -1, None), ([13, 2], [5, 20], 7, None), ([3, 0], [11, 6], -1, 32)])
def test_extend_with_sinks_matches_reference(prefix, extend, window, bound):
    pool, batch, q, k, v = make_step(prefix, extend, hq=4, hkv=2, d=16, page_size=4, dtype=torch.float32, seed=len(prefix) + sum(extend))
    if bound is not None:
        batch = dataclasses.replace(batch, static_max_extend_len=bound)
    run_and_check(TritonBackend(), q, k, v, _with_sinks(layer_for(4, 2, 16, window_left=window), 1), batch)


@pytest.mark.parametrize("window,cap", [(-1, 0.0), (5, 0.0), (-1, 3.0)])
def test_decode_with_sinks_matches_reference(window, cap):
    seq_lens = [1, 19, 40]
    pool, batch, q, k, v = make_step([s - 1 for s in seq_lens], [1] * 3, hq=8, hkv=2, d=16, page_size=4, dtype=torch.float32)
    layer = _with_sinks(layer_for(8, 2, 16, window_left=window, logit_cap=cap), 2)
    run_and_check(TritonBackend(min_split_len=8, max_kv_splits=4), q, k, v, layer, batch)  # several splits


def test_dense_with_sinks_matches_reference():
    b, sq, sk, hq, hkv, d = 2, 7, 7, 4, 2, 16
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(b * n, h, d, generator=gen).to(DEVICE) for n, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    layer = _with_sinks(layer_for(hq, hkv, d, window_left=3), 3)
    out = TritonBackend().forward_dense(q, k, v, layer, b)
    torch.testing.assert_close(out, TorchNativeBackend().forward_dense(q, k, v, layer, b), atol=2e-5, rtol=2e-5)
    without = TorchNativeBackend().forward_dense(q, k, v, dataclasses.replace(layer, sinks=None), b)
    assert (out - without).abs().max() > 1e-2  # the sinks changed the result


# ----------------------------------------------------------------------------- chunked local attention
def test_reference_chunks_match_an_explicit_mask():
    """torch_native's chunks against SDPA with the mask spelled as Llama 4's masking spells it."""
    b, n, hq, hkv, d, c = 2, 21, 4, 2, 16, 8
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(b * n, h, d, generator=gen) for h in (hq, hkv, hkv))
    layer = dataclasses.replace(layer_for(hq, hkv, d), chunk_size=c)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = (j <= i) & (j // c == i // c)
    qs, ks, vs = (x.view(b, n, -1, d).transpose(1, 2) for x in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(qs, ks.repeat_interleave(2, 1), vs.repeat_interleave(2, 1),
                                                            attn_mask=mask, scale=d**-0.5)  # fmt: skip
    got = TorchNativeBackend().forward_dense(q, k, v, layer, b)
    torch.testing.assert_close(got, want.transpose(1, 2).reshape(b * n, hq, d), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prefix,extend,chunk,bound", [
    ([0, 6], [19, 4], 8, None),  # chunks start inside the new tokens and inside the prefix
    ([13, 2], [5, 30], 4, None),
    ([16, 0], [3, 17], 8, 48),  # a captured graph's static bound
    ([3, 9], [9, 1], 1, None),  # chunks of one: each token sees itself only
])  # fmt: skip
def test_extend_with_chunks_matches_reference(prefix, extend, chunk, bound):
    pool, batch, q, k, v = make_step(prefix, extend, hq=4, hkv=2, d=16, page_size=4, dtype=torch.float32, seed=chunk + sum(extend))
    if bound is not None:
        batch = dataclasses.replace(batch, static_max_extend_len=bound)
    layer = dataclasses.replace(layer_for(4, 2, 16), chunk_size=chunk)
    out = run_and_check(TritonBackend(), q, k, v, layer, batch)
    causal = reference(q, layer_for(4, 2, 16), batch)
    assert (out.float() - causal).abs().max() > 1e-2  # the chunks changed the result


@pytest.mark.parametrize("chunk,window", [(8, -1), (16, -1), (8, 3)])
def test_decode_with_chunks_matches_reference(chunk, window):
    seq_lens = [1, 8, 9, 19, 40]  # first key of a chunk, last of one, and deep inside
    pool, batch, q, k, v = make_step([s - 1 for s in seq_lens], [1] * 5, hq=8, hkv=2, d=16, page_size=4, dtype=torch.float32)
    layer = dataclasses.replace(layer_for(8, 2, 16, window_left=window), chunk_size=chunk)
    run_and_check(TritonBackend(min_split_len=8, max_kv_splits=4), q, k, v, layer, batch)  # several splits


def test_dense_with_chunks_matches_reference():
    b, n, hq, hkv, d = 2, 19, 4, 2, 16
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(b * n, h, d, generator=gen).to(DEVICE) for h in (hq, hkv, hkv))
    layer = dataclasses.replace(layer_for(hq, hkv, d), chunk_size=8)
    out = TritonBackend().forward_dense(q, k, v, layer, b)
    torch.testing.assert_close(out, TorchNativeBackend().forward_dense(q, k, v, layer, b), atol=2e-5, rtol=2e-5)


def test_chunks_without_a_causal_mask_are_refused():
    pool, batch, q, k, v = make_step([0], [5], hq=4, hkv=2, d=16, page_size=4, dtype=torch.float32)
    with pytest.raises(InputError, match="causal"):  # no such layer exists to write K/V with
        dataclasses.replace(layer_for(4, 2, 16, causal=False), chunk_size=4)
    with pytest.raises(InputError, match="3 slopes for 4 query heads"):
        dataclasses.replace(layer_for(4, 2, 16), alibi_slopes=(0.5, 0.25, 0.125))
    with pytest.raises(InputError, match="finite"):
        dataclasses.replace(layer_for(4, 2, 16), alibi_slopes=(0.5, float("nan"), 0.25, 0.125))
    with pytest.raises(InputError, match="alibi_slopes must be float32"):  # the kernel wrappers check the tensor
        extend_attention.extend_attention_fwd(q, k, v, torch.empty_like(q), batch.kv_pool.req_to_page,
                                              batch.req_pool_indices, batch.seq_lens, batch.qo_indptr, 5, page_size=4,
                                              scale=0.25, alibi_slopes=torch.ones(4, dtype=torch.float64))  # fmt: skip
    with pytest.raises(ValueError, match="causal"):  # the kernel wrappers refuse it too
        extend_attention.extend_attention_fwd(q, k, v, torch.empty_like(q), batch.kv_pool.req_to_page, batch.req_pool_indices,
                             batch.seq_lens, batch.qo_indptr, 5, page_size=4, scale=0.25, causal=False,
                             chunk_size=4)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("bsz", [1, 7, 64])
def test_gpu_chunks_and_sinks_fp32(page_size, bsz):
    """fp32, lengths to 4096: chunked decode and extend, and sinks, against torch_native."""
    rng = random.Random(page_size * 100 + bsz)
    lens = [rng.randint(1, 4096) for _ in range(bsz)]
    lens[0] = 4096
    pool, batch, q, k, v = make_step([n - 1 for n in lens], [1] * bsz, hq=8, hkv=2, d=64, page_size=page_size,
                                     dtype=torch.float32, mode=ForwardMode.DECODE, seed=bsz)  # fmt: skip
    run_and_check(TritonBackend(), q, k, v, dataclasses.replace(layer_for(8, 2, 64), chunk_size=1024), batch)
    run_and_check(TritonBackend(), q, k, v, _with_sinks(layer_for(8, 2, 64, window_left=511), 4), batch)
    budget = max(1, 8192 // bsz)
    extend = [rng.randint(1, min(n, budget)) for n in lens]
    pool, batch, q, k, v = make_step([n - e for n, e in zip(lens, extend)], extend, hq=8, hkv=2, d=64,
                                     page_size=page_size, dtype=torch.float32, seed=bsz + 1)  # fmt: skip
    run_and_check(TritonBackend(), q, k, v, dataclasses.replace(layer_for(8, 2, 64), chunk_size=1024), batch)
    run_and_check(TritonBackend(), q, k, v, _with_sinks(layer_for(8, 2, 64), 5), batch)


# ----------------------------------------------------------------------------- ALiBi
def _with_alibi(layer, seed):
    """Slopes drawn at random (any positive slopes; not only ALiBi's powers of two)."""
    gen = torch.Generator().manual_seed(seed)
    slopes = (torch.rand(layer.num_q_heads, generator=gen) * 0.5 + 0.01).tolist()
    return dataclasses.replace(layer, alibi_slopes=tuple(slopes))


def test_reference_alibi_matches_an_explicit_bias():
    """torch_native's ALiBi against SDPA with the bias spelled out: slope * (j - i) on the
    scaled scores, bottom-right aligned queries (a KV prefix before them)."""
    b, sq, sk, hq, hkv, d = 2, 7, 19, 4, 2, 16
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(b * sq, hq, d, generator=gen)
    k, v = (torch.randn(b * sk, hkv, d, generator=gen) for _ in range(2))
    layer = _with_alibi(layer_for(hq, hkv, d), 3)
    i, j = torch.arange(sk - sq, sk)[:, None], torch.arange(sk)[None, :]
    slopes = torch.tensor(layer.alibi_slopes)[:, None, None]
    bias = torch.where(j <= i, slopes * (j - i).float(), float("-inf"))  # [Hq, Sq, Sk]
    qs = q.view(b, sq, hq, d).transpose(1, 2)
    ks, vs = (x.view(b, sk, hkv, d).transpose(1, 2).repeat_interleave(2, 1) for x in (k, v))
    want = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias, scale=d**-0.5)
    got = TorchNativeBackend().forward_dense(q, k, v, layer, b)
    torch.testing.assert_close(got, want.transpose(1, 2).reshape(b * sq, hq, d), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prefix,extend,window,cap,bound", [
    ([0, 6], [19, 4], -1, 0.0, None),
    ([13, 2], [5, 30], 5, 0.0, None),  # with a window
    ([16, 0], [3, 17], -1, 7.0, 48),  # with a softcap, under a captured graph's static bound
])  # fmt: skip
def test_extend_with_alibi_matches_reference(prefix, extend, window, cap, bound):
    pool, batch, q, k, v = make_step(prefix, extend, hq=4, hkv=2, d=16, page_size=4, dtype=torch.float32, seed=sum(extend))
    if bound is not None:
        batch = dataclasses.replace(batch, static_max_extend_len=bound)
    plain = layer_for(4, 2, 16, window_left=window, logit_cap=cap)
    out = run_and_check(TritonBackend(), q, k, v, _with_alibi(plain, len(prefix) + window), batch)
    assert (out.float() - reference(q, plain, batch)).abs().max() > 1e-2  # the bias changed the result


@pytest.mark.parametrize("window", [-1, 6])
def test_decode_with_alibi_matches_reference(window):
    seq_lens = [1, 8, 9, 19, 40]
    pool, batch, q, k, v = make_step([s - 1 for s in seq_lens], [1] * 5, hq=8, hkv=2, d=16, page_size=4, dtype=torch.float32)
    layer = _with_alibi(layer_for(8, 2, 16, window_left=window), 5)
    run_and_check(TritonBackend(min_split_len=8, max_kv_splits=4), q, k, v, layer, batch)  # several splits


def test_dense_with_alibi_matches_reference():
    b, n, hq, hkv, d = 2, 19, 4, 2, 16
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(b * n, h, d, generator=gen).to(DEVICE) for h in (hq, hkv, hkv))
    layer = _with_alibi(layer_for(hq, hkv, d), 9)
    out = TritonBackend().forward_dense(q, k, v, layer, b)
    torch.testing.assert_close(out, TorchNativeBackend().forward_dense(q, k, v, layer, b), atol=2e-5, rtol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("bsz", [1, 7, 64])
def test_gpu_alibi_fp32(page_size, bsz):
    """fp32, lengths to 4096: ALiBi decode and extend against torch_native (ALiBi's own slopes
    for 8 heads, 2^-(h+1), scaled as Falcon's SDPA path scales them)."""
    rng = random.Random(page_size * 10 + bsz)
    lens = [rng.randint(1, 4096) for _ in range(bsz)]
    lens[0] = 4096
    layer = dataclasses.replace(layer_for(8, 2, 64), alibi_slopes=tuple(2.0 ** -(h + 1) / 8 for h in range(8)))
    pool, batch, q, k, v = make_step([n - 1 for n in lens], [1] * bsz, hq=8, hkv=2, d=64, page_size=page_size,
                                     dtype=torch.float32, mode=ForwardMode.DECODE, seed=bsz)  # fmt: skip
    run_and_check(TritonBackend(), q, k, v, layer, batch)
    budget = max(1, 8192 // bsz)
    extend = [rng.randint(1, min(n, budget)) for n in lens]
    pool, batch, q, k, v = make_step([n - e for n, e in zip(lens, extend)], extend, hq=8, hkv=2, d=64,
                                     page_size=page_size, dtype=torch.float32, seed=bsz + 1)  # fmt: skip
    run_and_check(TritonBackend(), q, k, v, layer, batch)


# ----------------------------------------------------------------------------- MLA's latent pool
@pytest.mark.parametrize("d,dv,hq", [(40, 32, 20), (288, 256, 20)])  # 288 > 256: query heads in blocks of 16
@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_and_extend_over_a_latent_pool_match_reference(d, dv, hq, page_size):
    """One KV head whose first ``dv`` columns are the values (`KVPool(value_in_key=True)`);
    head dims that are no power of two run as a power of two plus a tail block."""
    seq_lens = [3, 29, 41]
    pool, batch, q, k, v = make_step([n - 1 for n in seq_lens], [1, 1, 1], hq=hq, hkv=1, d=d, dv=dv,
                                     page_size=page_size, dtype=torch.float32, mode=ForwardMode.DECODE,
                                     value_in_key=True)  # fmt: skip
    assert pool.v_buffers[0].data_ptr() == pool.k_buffers[0].data_ptr()
    run_and_check(TritonBackend(min_split_len=8, max_kv_splits=4), q, k, v, layer_for(hq, 1, d, dv=dv), batch)
    pool, batch, q, k, v = make_step([0, 7, 12], [9, 3, 18], hq=4, hkv=1, d=d, dv=dv, page_size=page_size,
                                     dtype=torch.float32, value_in_key=True, seed=3)  # fmt: skip
    run_and_check(TritonBackend(), q, k, v, layer_for(4, 1, d, dv=dv), batch)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("bsz,hq", [(1, 128), (7, 16), (64, 16)])
def test_gpu_latent_pool_fp32(page_size, bsz, hq):
    """fp32, lengths to 4096, DeepSeek-V3's latent dims (576 = 512 latent + 64 RoPE, values
    the first 512): decode and extend against torch_native."""
    rng = random.Random(page_size * 10 + bsz)
    lens = [rng.randint(1, 4096) for _ in range(bsz)]
    lens[0] = 4096
    layer = layer_for(hq, 1, 576, dv=512)
    pool, batch, q, k, v = make_step([n - 1 for n in lens], [1] * bsz, hq=hq, hkv=1, d=576, dv=512, page_size=page_size,
                                     dtype=torch.float32, mode=ForwardMode.DECODE, seed=bsz, value_in_key=True)  # fmt: skip
    run_and_check(TritonBackend(), q, k, v, layer, batch)
    budget = max(1, 4096 // bsz)
    extend = [rng.randint(1, min(n, budget)) for n in lens]
    pool, batch, q, k, v = make_step([n - e for n, e in zip(lens, extend)], extend, hq=hq, hkv=1, d=576, dv=512,
                                     page_size=page_size, dtype=torch.float32, seed=bsz + 1, value_in_key=True)  # fmt: skip
    run_and_check(TritonBackend(), q, k, v, layer, batch)


# ----------------------------------------------------------------------------- contract
def test_registry_and_capabilities():
    assert registry.get_backend_class("triton") is TritonBackend
    spec = ModelAttentionSpec(num_layers=2, num_q_heads=32, num_kv_heads=8, head_dims=(128,), dtype=torch.bfloat16,
                              device_type="cuda", page_size=16, uses_window=True, uses_logit_cap=True)  # fmt: skip
    assert TritonBackend.capabilities.why_not(spec) is None
    from attngraph.attn_backends.triton_ops import interpreting

    on_cpu = TritonBackend.capabilities.why_not(dataclasses.replace(spec, device_type="cpu"))
    # The CPU is served exactly when the kernels run in Triton's interpreter.
    assert (on_cpu is None) == interpreting(), on_cpu


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(importlib.import_module(TritonBackend.__module__), "interpreting", lambda: False)
    q = torch.zeros(2, 2, 16)
    with pytest.raises(BackendUnavailableError, match="torch_native"):
        TritonBackend().forward_dense(q, q, q, layer_for(2, 2, 16), 1)


# ----------------------------------------------------------------------------- GPU sweep
def _sweep_configs(n, seed):
    """``n`` configurations sampled from the grid; the first two are batch 1 and batch 64."""
    rng = random.Random(seed)
    for i in range(n):
        bsz = (1, 64)[i] if i < 2 else rng.choice([2, 5, 16, 33, 64])
        max_len = rng.choice([64, 700, 4096]) if bsz <= 16 else rng.choice([64, 700])
        hkv = rng.choice([1, 2, 8])
        group = rng.choice([1, 4, 8])
        yield dict(
            bsz=bsz, hq=hkv * group, hkv=hkv, d=rng.choice([64, 128]), page_size=rng.choice([1, 16]),
            dtype=rng.choice([torch.bfloat16, torch.float16]),
            window=rng.choice([-1, -1, rng.randint(0, max_len // 2)]), cap=rng.choice([0.0, 0.0, 2.0, 30.0]),
            max_len=max_len, seed=seed * 1000 + i,
        )  # fmt: skip


def _cfg_id(c):
    return "b{bsz}-h{hq}/{hkv}-d{d}-p{page_size}-L{max_len}-w{window}-c{cap:g}".format(**c)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", list(_sweep_configs(10, 1)), ids=_cfg_id)
def test_gpu_decode_sweep(cfg):
    rng = random.Random(cfg["seed"])
    seq_lens = [rng.randint(1, cfg["max_len"]) for _ in range(cfg["bsz"])]
    seq_lens[0] = cfg["max_len"] - 1 if cfg["max_len"] > 1 else 1  # one long, non page-aligned
    pool, batch, q, k, v = make_step([s - 1 for s in seq_lens], [1] * cfg["bsz"], hq=cfg["hq"], hkv=cfg["hkv"],
                                     d=cfg["d"], page_size=cfg["page_size"], dtype=cfg["dtype"],
                                     mode=ForwardMode.DECODE, seed=cfg["seed"])  # fmt: skip
    layer = layer_for(cfg["hq"], cfg["hkv"], cfg["d"], window_left=cfg["window"], logit_cap=cfg["cap"])
    run_and_check(TritonBackend(), q, k, v, layer, batch)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", list(_sweep_configs(10, 2)), ids=_cfg_id)
def test_gpu_extend_sweep(cfg):
    rng = random.Random(cfg["seed"])
    budget = 16384 // cfg["bsz"]  # new tokens per request, to bound the reference's cost
    total = [rng.randint(1, min(cfg["max_len"], budget)) for _ in range(cfg["bsz"])]
    extend = [rng.randint(1, t) for t in total]
    prefix = [t - e for t, e in zip(total, extend)]
    pool, batch, q, k, v = make_step(prefix, extend, hq=cfg["hq"], hkv=cfg["hkv"], d=cfg["d"],
                                     page_size=cfg["page_size"], dtype=cfg["dtype"], seed=cfg["seed"])  # fmt: skip
    causal = rng.random() < 0.8
    layer = layer_for(cfg["hq"], cfg["hkv"], cfg["d"], causal=causal, window_left=cfg["window"], logit_cap=cfg["cap"])
    run_and_check(TritonBackend(), q, k, v, layer, batch)


@pytest.mark.gpu
@pytest.mark.parametrize("d,dtype", [(256, torch.bfloat16), (80, torch.float16), (128, torch.float32)])
def test_gpu_other_head_dims_and_fp32(d, dtype):
    pool, batch, q, k, v = make_step([300, 0, 1000], [17, 260, 1], hq=8, hkv=2, d=d, page_size=16, dtype=dtype)
    run_and_check(TritonBackend(), q, k, v, layer_for(8, 2, d, window_left=256, logit_cap=20.0), batch)
    pool, batch, q, k, v = make_step([300, 2047, 5], [1, 1, 1], hq=8, hkv=2, d=d, page_size=16, dtype=dtype)
    run_and_check(TritonBackend(), q, k, v, layer_for(8, 2, d), batch)


@pytest.mark.gpu
def test_gpu_decode_cuda_graph_replay():
    """Decode captured once, replayed with other lengths after refreshing the batch in place."""
    hq, hkv, d, bsz = 32, 8, 128, 8
    spec = ModelAttentionSpec(num_layers=1, num_q_heads=hq, num_kv_heads=hkv, head_dims=(d,), dtype=torch.bfloat16,
                              device_type="cuda", page_size=16)  # fmt: skip
    backend = TritonBackend(spec)
    backend.init_cuda_graph_state(max_bs=bsz, max_num_tokens=bsz)
    layer = layer_for(hq, hkv, d)
    lens_a = [100, 2000, 7, 513, 64, 1, 3000, 40]
    pool, batch, q, k, v = make_step([s - 1 for s in lens_a], [1] * bsz, hq=hq, hkv=hkv, d=d, page_size=16,
                                     dtype=torch.bfloat16, mode=ForwardMode.DECODE)  # fmt: skip
    backend.init_forward_metadata(batch)
    graph, out = capture_step(lambda: backend.forward(q, k, v, layer, batch),
                              lambda: backend.forward(q, k, v, layer, batch, save_kv_cache=False))  # fmt: skip
    # Shorter lengths over the same pages, written in place into the captured tensors.
    lens_b = [s // 2 + 1 for s in lens_a]
    batch.seq_lens.copy_(torch.tensor(lens_b, dtype=torch.int32))
    batch.seq_lens_cpu.copy_(torch.tensor(lens_b, dtype=torch.int32))
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), reference(q, layer, batch), atol=2e-2, rtol=2e-2)
