"""The one-launch decode of the triton backend: the new K/V stored by the attention kernel
(``k_new``) and the splits merged in the same launch (``counters``), against the two-launch
path over a pool with the new K/V written first, and against a torch reference.

Without CUDA the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``), which runs
the programs of a grid one after another, splits in increasing order: the merge is then done by
the program of the last split, and the memory ordering between programs is not exercised (the
``gpu`` tests do that, with NaN-filled partial buffers and repeated runs). A variant runs the
splits last to first (`splits_last_to_first`): split 0 then merges, and the program that stores
the new K/V runs after the one that attends to them.
"""

from __future__ import annotations

import dataclasses
import math
import random
import warnings

import pytest
import torch

pytest.importorskip("triton")

# Imported first: without CUDA it sets TRITON_INTERPRET and (re)builds the kernels for the interpreter.
from .test_triton_backend import capture_step, layer_for, make_step, reference  # noqa: E402, I001

from attngraph.attn_backends.base import ModelAttentionSpec  # noqa: E402
from attngraph.attn_backends.triton_backend import TritonBackend  # noqa: E402
from attngraph.attn_backends.triton_ops import decode_attention  # noqa: E402
from attngraph.forward_batch import ForwardMode  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAN = float("nan")


@pytest.fixture(autouse=True)
def _runnable():
    """The kernels on CUDA, or in Triton's interpreter where it runs them (see
    `decode_attention.interpreter_problem`)."""
    if DEVICE == "cpu" and (not decode_attention.interpreting() or decode_attention.interpreter_problem()):
        pytest.skip(decode_attention.interpreter_problem() or "needs CUDA or Triton's interpreter")


# ----------------------------------------------------------------------------- one decode step
@dataclasses.dataclass
class Opts:
    """The attention variant: window, softcap, sinks ``[Hq]``, chunk, ALiBi slopes ``[Hq]``."""

    window: int = -1
    cap: float = 0.0
    sinks: torch.Tensor | None = None
    chunk: int = 0
    slopes: torch.Tensor | None = None

    def kernel_kwargs(self) -> dict:
        return dict(window_left=self.window, logit_cap=self.cap, sinks=self.sinks, chunk_size=self.chunk,
                    alibi_slopes=self.slopes)  # fmt: skip


@dataclasses.dataclass
class Step:
    """Kernel-level inputs of one decode step over a random paged pool.

    ``k_buf: [slots, Hkv, D]``, ``v_buf: [slots, Hkv, Dv]`` (a view of ``k_buf``'s first
    columns for a pool with the values in its keys): random, the new tokens' slots NaN.
    ``expected_k/v``: the same pool with the new K/V written at ``new_loc: [B]``.
    ``k_new: [B, Hkv, D]``, ``v_new: [B, Hkv, Dv]``: strided views of one fused projection.
    """

    q: torch.Tensor
    k_buf: torch.Tensor
    v_buf: torch.Tensor
    expected_k: torch.Tensor
    expected_v: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    new_loc: torch.Tensor
    req_to_page: torch.Tensor
    rows: torch.Tensor
    seq_lens: torch.Tensor
    page_size: int


def _value_view(k: torch.Tensor, dv: int) -> torch.Tensor:
    return k[..., :dv]


def make_decode_step(seq_lens, *, hq, hkv, d, dv, page_size, dtype, seed, value_in_key=False) -> Step:
    """Requests at rows drawn at random from a larger page table, with shuffled pages of a pool
    holding spare pages; the new token of each request (position ``seq_len - 1``) has its own
    slot, also for ``seq_len = 0`` (a page of its own, written as ``KVPool.write`` would)."""
    gen = torch.Generator().manual_seed(seed)
    bsz = len(seq_lens)
    pages_of = [max(1, math.ceil(n / page_size)) for n in seq_lens]
    num_pages = sum(pages_of) + 3
    perm = (torch.randperm(num_pages, generator=gen) + 1).tolist()  # pages 1..num_pages, shuffled
    req_to_page = torch.zeros(bsz + 4, max(pages_of) + 1, dtype=torch.int32)
    rows = torch.randperm(bsz + 4, generator=gen)[:bsz]
    new_loc = []
    for row, n, count in zip(rows.tolist(), seq_lens, pages_of):
        pages = [perm.pop() for _ in range(count)]
        req_to_page[row, :count] = torch.tensor(pages, dtype=torch.int32)
        pos = max(n - 1, 0)
        new_loc.append(pages[pos // page_size] * page_size + pos % page_size)
    new_loc = torch.tensor(new_loc, dtype=torch.int64, device=DEVICE)

    def randn(*shape):  # drawn on the CPU: the same numbers on every device
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    slots = (num_pages + 1) * page_size
    k_buf = randn(slots, hkv, d)
    v_buf = _value_view(k_buf, dv) if value_in_key else randn(slots, hkv, dv)
    qkv = randn(bsz, hq * d + hkv * d + hkv * dv)
    k_new = qkv[:, hq * d : hq * d + hkv * d].view(bsz, hkv, d)
    v_new = _value_view(k_new, dv) if value_in_key else qkv[:, hq * d + hkv * d :].view(bsz, hkv, dv)
    q = randn(bsz, hq, d)
    exp_k, exp_v = pool_copy(k_buf, v_buf)
    exp_k[new_loc] = k_new
    if not value_in_key:
        exp_v[new_loc] = v_new
        v_buf[new_loc] = NAN
    k_buf[new_loc] = NAN
    return Step(q, k_buf, v_buf, exp_k, exp_v, k_new, v_new, new_loc, req_to_page.to(DEVICE),
                rows.to(DEVICE, torch.int32), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), page_size)  # fmt: skip


def pool_copy(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of a pool's K and V buffers; V stays a view of K's first columns where it was."""
    k2 = k.clone()
    shared = v.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    return k2, (_value_view(k2, v.shape[-1]) if shared else v.clone())


def torch_reference(step: Step, opts: Opts, scale: float) -> torch.Tensor:
    """Decode attention in fp64 over ``step.expected_k/v``: ``[B, Hq, Dv]`` (zeros for
    ``seq_len = 0``)."""
    q, k_buf, v_buf = step.q, step.expected_k, step.expected_v
    bsz, hq, _ = q.shape
    group = hq // k_buf.shape[1]
    out = torch.zeros(bsz, hq, v_buf.shape[2], dtype=torch.float64, device=q.device)
    for b, (row, n) in enumerate(zip(step.rows.tolist(), step.seq_lens.tolist())):
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        slots = step.req_to_page[row, pos // step.page_size].long() * step.page_size + pos % step.page_size
        k = k_buf[slots].double().repeat_interleave(group, 1)  # [n, Hq, D]
        v = v_buf[slots].double().repeat_interleave(group, 1)  # [n, Hq, Dv]
        s = torch.einsum("hd,nhd->hn", q[b].double(), k) * scale
        if opts.cap > 0:
            s = opts.cap * torch.tanh(s / opts.cap)
        if opts.slopes is not None:
            s = s + opts.slopes.double()[:, None] * (pos - (n - 1)).double()[None, :]
        lo = max(n - 1 - opts.window if opts.window >= 0 else 0, (n - 1) - (n - 1) % opts.chunk if opts.chunk else 0)
        s[:, pos < lo] = -math.inf
        if opts.sinks is not None:  # one more logit per head, without a value
            s = torch.cat([s, opts.sinks.double()[:, None]], 1)
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, 1)[:, :n], v)
    return out


def run(step: Step, k_buf, v_buf, *, new_kv: bool, counters, max_splits: int, **kwargs) -> torch.Tensor:
    """One `decode_attention_fwd` into a NaN-filled ``out`` with NaN-filled partial buffers."""
    bsz, hq, _ = step.q.shape
    dv = v_buf.shape[2]
    out = torch.full((bsz, hq, dv), NAN, dtype=step.q.dtype, device=DEVICE)
    part_o = torch.full((bsz, hq, max_splits, dv), NAN, device=DEVICE)
    part_lse = torch.full((bsz, hq, max_splits), NAN, device=DEVICE)
    new = dict(k_new=step.k_new, v_new=step.v_new, new_loc=step.new_loc) if new_kv else {}
    return decode_attention.decode_attention_fwd(
        step.q, k_buf, v_buf, out, step.req_to_page, step.rows, step.seq_lens, part_o, part_lse,
        page_size=step.page_size, max_splits=max_splits, counters=counters, **new, **kwargs,
    )  # fmt: skip


def check_fused(step: Step, opts: Opts, mode: str, *, max_splits=4, min_split_len=16, tol=1e-5, ref_tol=2e-5):
    """The fused path (``mode``: "new_kv", "merge" or "both") against the two-launch path over
    the pool with the new K/V written, and against `torch_reference`; afterwards the pool holds
    the new K/V at their slots and is unchanged elsewhere, the counters are zero, and a second
    call gives the same bits. Returns ``(fused, two_launch)`` outputs."""
    scale = step.q.shape[2] ** -0.5
    kw = dict(scale=scale, max_splits=max_splits, min_split_len=min_split_len, **opts.kernel_kwargs())
    two = run(step, *pool_copy(step.expected_k, step.expected_v), new_kv=False, counters=None, **kw)
    new_kv = mode in ("new_kv", "both")
    # new_kv: the kernel writes the poisoned slots; else save_kv has written them before
    k_buf, v_buf = (step.k_buf, step.v_buf) if new_kv else pool_copy(step.expected_k, step.expected_v)
    bsz, hq, _ = step.q.shape
    counters = torch.zeros(bsz * hq, dtype=torch.int32, device=DEVICE) if mode in ("merge", "both") else None
    fused = run(step, k_buf, v_buf, new_kv=new_kv, counters=counters, **kw)

    assert not torch.isnan(fused).any(), "NaN: a poisoned slot or an unwritten partial was read"
    torch.testing.assert_close(fused, two, atol=tol, rtol=tol)
    torch.testing.assert_close(fused.double(), torch_reference(step, opts, scale), atol=ref_tol, rtol=ref_tol)
    assert torch.equal(k_buf, step.expected_k), "K pool != the pool with the new K written"
    assert torch.equal(v_buf, step.expected_v), "V pool != the pool with the new V written"
    if counters is not None:
        assert not counters.any(), f"counters left non-zero: {counters.tolist()}"
    again = run(step, k_buf, v_buf, new_kv=new_kv, counters=counters, **kw)
    assert torch.equal(again, fused), "a second call gave other bits"
    assert torch.equal(k_buf, step.expected_k) and torch.equal(v_buf, step.expected_v)
    if counters is not None:
        assert not counters.any()
    return fused, two


def make_opts(hq: int, *, window=-1, cap=0.0, sinks=None, chunk=0, slopes=None) -> Opts:
    """`Opts` with random sinks / ALiBi slopes drawn from the seeds ``sinks`` / ``slopes``."""
    sink_t = slope_t = None
    if sinks is not None:
        gen = torch.Generator().manual_seed(sinks)
        sink_t = torch.randn(hq, generator=gen) * 2
        sink_t[0] = 8.0  # far above the scores: the sink takes most of head 0's weight
        sink_t = sink_t.to(DEVICE)
    if slopes is not None:
        gen = torch.Generator().manual_seed(slopes)
        slope_t = (torch.rand(hq, generator=gen) * 0.3 + 0.01).to(DEVICE)
    return Opts(window, cap, sink_t, chunk, slope_t)


# ----------------------------------------------------------------------------- kernel (CPU-sized)
# A key block is 16 keys in the interpreter; min_split_len 16 and max_splits 4 give requests of 1
# to 4 splits. (seq_lens, hq, hkv, d, dv, page_size, options)
CASES = [
    pytest.param([50], 2, 2, 64, 64, 4, {}, id="b1-mha"),
    pytest.param([64], 8, 2, 64, 64, 16, {}, id="b1-gqa4-page-aligned"),
    pytest.param([1], 8, 2, 64, 64, 4, {"sinks": 1}, id="b1-len1-sinks"),
    pytest.param([1, 40, 63], 8, 2, 64, 64, 16, {}, id="b3-gqa4"),
    pytest.param([2, 49, 30], 3, 3, 64, 64, 1, {"cap": 5.0}, id="b3-mha-softcap-p1"),
    pytest.param([60, 1, 20], 4, 1, 64, 64, 4, {"sinks": 3, "window": 9, "cap": 3.0}, id="b3-gqa4-sinks-window-softcap"),
    # The program of a request without keys divides 0 by 0 (the result is unused): numpy warns.
    pytest.param([0, 20, 1], 4, 1, 64, 64, 4, {"sinks": 5}, id="b3-seq-len-0-sinks",
                 marks=pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning",
                                                  "ignore:divide by zero:RuntimeWarning")),
    pytest.param([1, 17, 33, 50, 64], 4, 1, 64, 64, 4, {"window": 20}, id="b5-gqa4-window"),
    pytest.param([1, 33, 64, 7, 45], 8, 2, 64, 64, 4, {"sinks": 2}, id="b5-gqa4-sinks"),
    pytest.param([19, 1, 42, 36, 8], 8, 2, 64, 64, 4, {"chunk": 16, "slopes": 4}, id="b5-gqa4-chunk-alibi"),
    # 576 = 512 + a tail block of 64; 20 query heads in two head blocks (fp32, dims > 256: 16)
    pytest.param([1, 30, 49], 20, 1, 576, 512, 4, {}, id="b3-mla-dims-576-512-two-head-blocks"),
]


@pytest.mark.parametrize("mode", ["both", "new_kv", "merge"])
@pytest.mark.parametrize("seq_lens,hq,hkv,d,dv,page_size,opts", CASES)
def test_fused_decode_matches_two_launches(seq_lens, hq, hkv, d, dv, page_size, opts, mode):
    step = make_decode_step(seq_lens, hq=hq, hkv=hkv, d=d, dv=dv, page_size=page_size, dtype=torch.float32,
                            seed=sum(seq_lens) * 7 + hq)  # fmt: skip
    check_fused(step, make_opts(hq, **opts), mode)


@pytest.fixture
def splits_last_to_first(monkeypatch):
    """The interpreter runs each grid's programs with the split axis (the third) reversed."""
    if not decode_attention.interpreting():
        pytest.skip("orders the programs of Triton's interpreter")
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    set_grid_idx = builder.set_grid_idx
    monkeypatch.setattr(builder, "set_grid_idx", lambda x, y, z: set_grid_idx(x, y, builder.grid_dim[2] - 1 - z))


@pytest.mark.parametrize("mode", ["both", "merge"])
@pytest.mark.parametrize("case", [0, 5, 6, 8, 9, 10], ids=lambda i: CASES[i].id)
def test_fused_decode_with_splits_last_to_first(splits_last_to_first, case, mode):
    """Split 0's program counts last and merges; the last split's program attends to the new
    token before split 0's program has stored it."""
    seq_lens, hq, hkv, d, dv, page_size, opts = CASES[case].values
    step = make_decode_step(seq_lens, hq=hq, hkv=hkv, d=d, dv=dv, page_size=page_size, dtype=torch.float32, seed=case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # 0 / 0 of a request without keys, unused
        check_fused(step, make_opts(hq, **opts), mode)


@pytest.mark.parametrize("hq", [16, 20])  # 20 > 16: two head blocks per KV head (fp32, dims > 256)
def test_fused_merge_over_a_latent_pool(hq):
    """MLA's latent pool (values = the keys' first 512 columns): the kernel's merge is right
    there too (the backend keeps two launches over it); the new K/V are not the kernel's to
    write there (`KVPool.write` writes the keys once)."""
    step = make_decode_step([1, 30, 64], hq=hq, hkv=1, d=576, dv=512, page_size=4, dtype=torch.float32, seed=hq,
                            value_in_key=True)  # fmt: skip
    check_fused(step, Opts(), "merge")
    with pytest.raises(ValueError, match="separate K and V buffers"):
        run(step, step.k_buf, step.v_buf, new_kv=True, counters=None, max_splits=4, scale=1.0)


def test_bad_counters_and_new_kv_are_refused():
    step = make_decode_step([5, 9], hq=4, hkv=2, d=64, dv=64, page_size=4, dtype=torch.float32, seed=0)
    kw = dict(max_splits=4, scale=0.125)
    with pytest.raises(ValueError, match="counters"):
        run(step, step.k_buf, step.v_buf, new_kv=False, counters=torch.zeros(3, dtype=torch.int32, device=DEVICE), **kw)
    with pytest.raises(ValueError, match="counters"):
        run(step, step.k_buf, step.v_buf, new_kv=False, counters=torch.zeros(8, device=DEVICE), **kw)
    with pytest.raises(ValueError, match="go together"):
        run(step, step.k_buf, step.v_buf, new_kv=False, counters=None, k_new=step.k_new, **kw)
    step.k_new = step.k_new[:1]
    with pytest.raises(ValueError, match="k_new"):
        run(step, step.k_buf, step.v_buf, new_kv=True, counters=None, **kw)


# ----------------------------------------------------------------------------- backend (CPU-sized)
class _CountLaunches:
    """Stands for a ``@triton.jit`` kernel in `decode_attention`: counts ``kernel[grid](...)``."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def _count(monkeypatch, backend):
    """Counters of stage 1 / stage 2 launches and of the backend's separate K/V stores."""
    stage1 = _CountLaunches(decode_attention._decode_stage1_kernel)
    stage2 = _CountLaunches(decode_attention._decode_stage2_kernel)
    monkeypatch.setattr(decode_attention, "_decode_stage1_kernel", stage1)
    monkeypatch.setattr(decode_attention, "_decode_stage2_kernel", stage2)
    stores = []
    save_kv = backend.save_kv
    monkeypatch.setattr(backend, "save_kv", lambda *a: (stores.append(1), save_kv(*a)))
    return lambda: (stage1.launches, stage2.launches, len(stores))


def _same_pools(a, b):
    for x, y in zip(a.k_buffers + a.v_buffers, b.k_buffers + b.v_buffers):
        torch.testing.assert_close(x, y, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("sinks", [False, True])
def test_backend_decode_is_one_launch_per_layer(monkeypatch, sinks):
    """forward_decode: one kernel launch per layer (no separate K/V store, no stage 2), and the
    same outputs and pool contents as the three-launch path."""
    seq_lens, hq, hkv, d = [1, 37, 20, 64, 9], 8, 2, 32
    kw = dict(hq=hq, hkv=hkv, d=d, page_size=4, dtype=torch.float32, mode=ForwardMode.DECODE, num_layers=2, seed=3)
    pool_a, batch_a, q, k, v = make_step([n - 1 for n in seq_lens], [1] * 5, **kw)
    pool_b, batch_b, *_ = make_step([n - 1 for n in seq_lens], [1] * 5, **kw)
    fused, plain = TritonBackend(min_split_len=8, max_kv_splits=4), TritonBackend(min_split_len=8, max_kv_splits=4, fused_decode=False)
    for layer_id in (0, 1):
        layer = layer_for(hq, hkv, d, layer_id=layer_id, window_left=15 * layer_id - 1)
        if sinks:
            layer = dataclasses.replace(layer, sinks=torch.randn(hq).to(DEVICE))
        counts = _count(monkeypatch, fused)
        fused.init_forward_metadata(batch_a)
        out_a = fused.forward(q, k, v, layer, batch_a)
        assert counts() == (1, 0, 0), "stage-1 launches, stage-2 launches, K/V stores"
        monkeypatch.undo()
        counts = _count(monkeypatch, plain)
        plain.init_forward_metadata(batch_b)
        out_b = plain.forward(q, k, v, layer, batch_b)
        assert counts() == (1, 1, 1)
        monkeypatch.undo()
        torch.testing.assert_close(out_a, out_b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out_a.float(), reference(q, layer, batch_a), atol=2e-5, rtol=2e-5)
        _same_pools(pool_a, pool_b)
        assert not fused._counters(5 * hq, q.device).any()


def test_backend_falls_back_to_save_kv(monkeypatch):
    """A K/V dtype other than the pool's, or save_kv_cache=False: the kernel stores nothing
    (save_kv does, or nothing does) and still merges in the same launch. MLA's latent pool:
    save_kv, stage 1 and stage 2."""
    seq_lens = [3, 29]
    pool, batch, q, k, v = make_step([n - 1 for n in seq_lens], [1, 1], hq=4, hkv=2, d=16, page_size=4,
                                     dtype=torch.bfloat16, mode=ForwardMode.DECODE)  # fmt: skip
    backend = TritonBackend(min_split_len=8)
    counts = _count(monkeypatch, backend)
    backend.init_forward_metadata(batch)
    backend.forward(q, k.float(), v.float(), layer_for(4, 2, 16), batch)  # converted by KVPool.write
    assert counts() == (1, 0, 1)
    backend.forward(q, k, v, layer_for(4, 2, 16), batch, save_kv_cache=False)
    assert counts() == (2, 0, 1)
    monkeypatch.undo()

    pool, batch, q, k, v = make_step([n - 1 for n in seq_lens], [1, 1], hq=4, hkv=1, d=40, dv=32, page_size=4,
                                     dtype=torch.float32, mode=ForwardMode.DECODE, value_in_key=True)  # fmt: skip
    counts = _count(monkeypatch, backend)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, layer_for(4, 1, 40, dv=32), batch)
    assert counts() == (1, 1, 1)
    torch.testing.assert_close(out, reference(q, layer_for(4, 1, 40, dv=32), batch), atol=2e-5, rtol=2e-5)


def test_cuda_graph_state_counters_are_used_and_stay_zero():
    hq, hkv, d = 8, 2, 32
    spec = ModelAttentionSpec(num_layers=1, num_q_heads=hq, num_kv_heads=hkv, head_dims=(d,), dtype=torch.float32,
                              device_type=DEVICE, page_size=4)  # fmt: skip
    backend = TritonBackend(spec, min_split_len=8)
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    graph_counters = backend._graph_counters
    assert graph_counters.numel() == 4 * hq and not graph_counters.any()
    assert backend._counters(3 * hq, graph_counters.device).data_ptr() == graph_counters.data_ptr()
    pool, batch, q, k, v = make_step([30, 9, 21], [1, 1, 1], hq=hq, hkv=hkv, d=d, page_size=4, dtype=torch.float32)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, layer_for(hq, hkv, d), batch)
    torch.testing.assert_close(out, reference(q, layer_for(hq, hkv, d), batch), atol=2e-5, rtol=2e-5)
    assert not graph_counters.any() and not backend._eager_counters  # no eager buffer was needed


# ----------------------------------------------------------------------------- GPU (bf16)
def _gpu_configs():
    rng = random.Random(5)
    for bsz in (1, 3, 5, 64):
        for group in (1, 4):
            opts = rng.choice([{}, {"window": 700}, {"cap": 30.0}, {"sinks": bsz}, {"chunk": 1024, "slopes": bsz}])
            yield pytest.param(bsz, group, 128, 128, opts, id=f"b{bsz}-g{group}-d128-{'-'.join(opts) or 'plain'}")
    for bsz in (1, 5):
        yield pytest.param(bsz, 16, 576, 512, {}, id=f"b{bsz}-mla-dims")


@pytest.mark.gpu
@pytest.mark.parametrize("bsz,group,d,dv,opts", list(_gpu_configs()))
@pytest.mark.parametrize("mode", ["both", "merge"])
def test_gpu_fused_decode_bf16(bsz, group, d, dv, opts, mode):
    """bf16 on CUDA, lengths to 4096 (1 and a long one always), up to 32 splits: the fused
    path against the two-launch path and the reference, then 20 more runs (partials refilled
    with NaN each time) that must give the same bits: a merge that read a partial before it
    was visible would show NaN or differ."""
    rng = random.Random(bsz * 100 + group + d)
    seq_lens = [rng.randint(1, 4096) for _ in range(bsz)]
    seq_lens[0] = 4095
    seq_lens[-1] = 1 if bsz > 1 else seq_lens[-1]
    hkv = 1 if d == 576 else 8 // group
    step = make_decode_step(seq_lens, hq=hkv * group, hkv=hkv, d=d, dv=dv, page_size=16, dtype=torch.bfloat16,
                            seed=bsz + group)  # fmt: skip
    opts = make_opts(hkv * group, **opts)
    fused, _ = check_fused(step, opts, mode, max_splits=32, min_split_len=128, tol=1e-2, ref_tol=2e-2)
    counters = torch.zeros(bsz * hkv * group, dtype=torch.int32, device=DEVICE)
    k_buf, v_buf = pool_copy(step.expected_k, step.expected_v)
    for _ in range(20):
        out = run(step, k_buf, v_buf, new_kv=mode == "both", counters=counters, max_splits=32, min_split_len=128,
                  scale=d**-0.5, **opts.kernel_kwargs())  # fmt: skip
        assert torch.equal(out, fused)
    torch.cuda.synchronize()
    assert not counters.any()


@pytest.mark.gpu
def test_gpu_fused_decode_cuda_graph_replay():
    """The one-launch decode captured with its K/V store, replayed with new q/k/v and lengths:
    matches the three-launch path run eagerly on a copy, counters zero after every replay."""
    hq, hkv, d, bsz = 32, 8, 128, 8
    spec = ModelAttentionSpec(num_layers=1, num_q_heads=hq, num_kv_heads=hkv, head_dims=(d,), dtype=torch.bfloat16,
                              device_type="cuda", page_size=16)  # fmt: skip
    backend = TritonBackend(spec)
    backend.init_cuda_graph_state(max_bs=bsz, max_num_tokens=bsz)
    layer = layer_for(hq, hkv, d)
    lens = [100, 2000, 7, 513, 64, 1, 3000, 40]
    kw = dict(hq=hq, hkv=hkv, d=d, page_size=16, dtype=torch.bfloat16, mode=ForwardMode.DECODE)
    pool, batch, q, k, v = make_step([s - 1 for s in lens], [1] * bsz, **kw)
    pool_b, batch_b, *_ = make_step([s - 1 for s in lens], [1] * bsz, **kw)
    backend.init_forward_metadata(batch)
    step = lambda: backend.forward(q, k, v, layer, batch)  # noqa: E731
    graph, out = capture_step(step, step)
    plain = TritonBackend(spec, fused_decode=False)
    for _ in range(3):
        q.copy_(torch.randn_like(q))
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
        graph.replay()
        plain.init_forward_metadata(batch_b)
        want = plain.forward(q, k, v, layer, batch_b)
        torch.cuda.synchronize()
        torch.testing.assert_close(out, want, atol=1e-2, rtol=1e-2)
        _same_pools(pool, pool_b)
        assert not backend._graph_counters.any()


def test_merge_chunk_sizes():
    """`merge_chunk`: as many [BLOCK_H, BLOCK_DV] fp32 tiles as the budget holds, a power of two
    from 1 to MAX_MERGE_CHUNK."""
    assert decode_attention.merge_chunk(16, 64) == 4 == decode_attention.MAX_MERGE_CHUNK
    assert decode_attention.merge_chunk(16, 128) == 4
    assert decode_attention.merge_chunk(16, 256) == 2
    assert decode_attention.merge_chunk(64, 512) == 1
    assert decode_attention.merge_chunk(16, 16) == decode_attention.MAX_MERGE_CHUNK


@pytest.mark.parametrize("reverse", [False, True], ids=["in-order", "splits-last-to-first"])
def test_fused_merge_in_chunks_with_a_partial_last_chunk(monkeypatch, request, reverse):
    """The fused merge loads 2 splits' partials at a time here (the budget cut down): requests of
    1, 4 and 7 splits merge over 0, 2 and 4 chunks, the last of 7 half empty; each matches the
    two-launch path and the float64 reference, in either program order."""
    if reverse:
        request.getfixturevalue("splits_last_to_first")
    monkeypatch.setattr(decode_attention, "MERGE_CHUNK_VALUES", 16 * 64 * 2)
    assert decode_attention.merge_chunk(16, 64) == 2
    step = make_decode_step([1, 50, 112], hq=8, hkv=2, d=64, dv=64, page_size=4, dtype=torch.float32, seed=11)
    check_fused(step, make_opts(8, sinks=6), "both", max_splits=7)
