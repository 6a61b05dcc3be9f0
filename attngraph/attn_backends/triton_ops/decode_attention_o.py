"""Decode attention of one request and the output projection after it, in one launch (Triton).

In a batch-1 decode step the attention kernel is latency-bound and the output projection's
GEMV after it waits for it to end: one kernel boundary per layer on the step's critical path.
This kernel holds both. Its programs take a role in the order they start, from a ticket
(an atomic counter), so that a program never waits for one that has not started:

* the first ``Hkv * max_splits`` tickets are attention programs, one per (KV head, split), as
  stage 1 of `decode_attention` with the new K/V stored and the splits merged in the launch;
  the program merging a KV head's splits writes the head group's output (rounded to q's dtype,
  as the attention op's output) to ``attn_out`` and counts the group done;
* the other tickets are output-projection programs of ``BLOCK_O`` weight rows each: a program
  loads its whole ``[BLOCK_O, Hq * Dv]`` weight tile (before the PDL wait with
  ``preload_weight``), waits until every KV head's group is done, reads ``attn_out`` and writes
  its ``BLOCK_O`` outputs. The last of them puts the counters back to zero for the next launch.

The attention arithmetic is `decode_attention_fwd`'s (same blocks, splits and merge order):
``attn_out`` holds its output bit for bit; the projection sums in fp32 and rounds once, as the
GEMV does (in another order: equal within rounding, not bit for bit).

One request (a batch of one), heads of a power-of-two dim, K and V dims equal, no logit cap,
ALiBi, sinks, chunks or rotation in the kernel (`decode_attention_fwd` serves those); a sliding
window is honoured. The model runs it with `CompileConfig.fuse_attention_o`
(`TritonBackend.forward_decode_o`), off by default: on an H100 it made the 1B-shaped batch-1
step slower (``benchmarks/BENCHMARKS.md``); ``benchmarks/bench_gemv_chain.py --fuse-o`` times it
against the two launches.

Both roles live in one kernel, so the attention role's registers set every program's: compiled
for sm_90, 167 a thread at the 1B shape (heads of 64, 4 warps: about 3 programs an SM) and 255
at the 8B shape (heads of 128), without spills. Fewer splits (``max_splits``) and more weight
rows per program (``block_o``) keep more of the launch resident at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import pdl
from ...pdl import gdc_launch_dependents, gdc_wait
from ...errors import InputError
from ...triton_math import round_to
from .decode_attention import (
    DEFAULT_MIN_SPLIT_LEN,
    NO_WINDOW,
    _attend_block,
    _load_block,
    _merge_split,
    _merge_stored_splits,
    _split_plan,
    check_last_dim_contiguous,
    decode_block_h,
    decode_block_n,
    dot_options,
    interpreting,
    merge_chunk,
    window_arg,
)

__all__ = ["SYNC_SLOTS", "decode_attention_o_fwd", "new_sync"]

_NO_CHUNK = tl.constexpr(NO_WINDOW)  # every key in chunk 0 (globals read by @jit code must be constexpr)

#: int32 counters of a launch (`new_sync`): tickets, KV-head groups merged, projection programs
#: done, and waits that gave up (a group never counted: a fault, never reset).
SYNC_SLOTS = 4
#: Polls of the merged-group count after which a projection program gives up (seconds on a GPU,
#: where a wait takes microseconds): a fault then shows in ``sync[3]`` and wrong outputs
#: instead of a hang. Triton's interpreter, whose programs run one after another, polls 100 times.
MAX_SPINS = 1 << 22
#: Widest attention output (``Hq * D``) a projection program's weight rows may span: they are
#: held in registers (the 8B shape's 4096 already sets 255 registers a thread).
MAX_ROW = 4096


@triton.jit
def _attention_role(ticket, Q, K, V, ReqToPage, ReqIdx, SeqLens, PartO, PartLse, KNew, VNew, NewLoc, Counters, AttnOut,
                    Sync, scale, window, max_splits, min_split_len,
                    stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_rtp, stride_poh, stride_pos,
                    stride_plh, stride_knh, stride_vnh,
                    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
                    MERGE_CHUNK: tl.constexpr):  # fmt: skip
    """Split ``ticket % max_splits`` of KV head ``ticket // max_splits``: stage 1 of
    `decode_attention` for request 0 (new K/V stored by split 0, the splits merged by the last
    to count); the merging program writes the group's heads to AttnOut (``[Hq * D]``) and
    counts the group on ``Sync[1]`` (release)."""
    kvh = ticket // max_splits
    sid = ticket % max_splits
    seq_len = tl.load(SeqLens)
    kv_lo, split_len, num_splits = _split_plan(seq_len, window, _NO_CHUNK, max_splits, min_split_len, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_d = offs_d < HEAD_DIM
    start = kv_lo + sid * split_len
    end = tl.minimum(start + split_len, seq_len)
    row = tl.load(ReqIdx).to(tl.int64)
    loc = tl.load(NewLoc).to(tl.int64)
    # the pool's first block of this split: written by kernels before the one just before (attngraph.pdl)
    pos0 = start + tl.arange(0, BLOCK_N)
    mask0 = (pos0 < end) & (pos0 != seq_len - 1)
    kt0, kt0_tail, v0 = _load_block(K, V, ReqToPage, row, stride_rtp, stride_ks, stride_kh, stride_vs, stride_vh, kvh,
                                    pos0, mask0, offs_d, mask_d, offs_d, mask_d, offs_d, mask_d, PAGE_SIZE, False)  # fmt: skip
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    k_new = tl.load(KNew + kvh * stride_knh + offs_d).to(K.dtype.element_ty)
    v_new = tl.load(VNew + kvh * stride_vnh + offs_d).to(V.dtype.element_ty)
    offs_g = tl.arange(0, BLOCK_H)
    mask_h = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    q = tl.load(Q + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_h[:, None], other=0.0)  # [BLOCK_H, D]
    if sid == 0:
        tl.store(K + loc * stride_ks + kvh * stride_kh + offs_d, k_new)
        tl.store(V + loc * stride_vs + kvh * stride_vh + offs_d, v_new)
    if sid < tl.maximum(num_splits, 1):
        slope = tl.zeros([BLOCK_H], tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        if start < end:
            m_i, l_i, acc = _attend_block(q, q, kt0, kt0_tail, v0, k_new, k_new, v_new, m_i, l_i, acc, pos0, pos0 < end,
                                          seq_len, slope, scale, 1.0, UPCAST, PRECISION, False, False, False, True)  # fmt: skip
        for n0 in range(start + BLOCK_N, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            mask_n = pos < end
            kt, kt_tail, v = _load_block(K, V, ReqToPage, row, stride_rtp, stride_ks, stride_kh, stride_vs, stride_vh,
                                         kvh, pos, mask_n & (pos != seq_len - 1), offs_d, mask_d, offs_d, mask_d, offs_d,
                                         mask_d, PAGE_SIZE, False)  # fmt: skip
            m_i, l_i, acc = _attend_block(q, q, kt, kt_tail, v, k_new, k_new, v_new, m_i, l_i, acc, pos, mask_n, seq_len,
                                          slope, scale, 1.0, UPCAST, PRECISION, False, False, False, True)  # fmt: skip
        part_o = acc / l_i[:, None]
        part_lse = m_i + tl.log2(l_i)
        mask_o = mask_h[:, None] & mask_d[None, :]
        po_ptrs = PartO + heads[:, None] * stride_poh + offs_d[None, :]  # split 0's
        pl_ptrs = PartLse + heads * stride_plh
        counter = Counters + kvh
        last = num_splits <= 1
        if num_splits > 1:
            tl.store(po_ptrs + sid * stride_pos, part_o, mask=mask_o)
            tl.store(pl_ptrs + sid, part_lse, mask=mask_h)
            tl.debug_barrier()  # every thread's partials before the release (as decode_attention's merge)
            done = tl.atomic_add(counter, 1, sem="acq_rel")
            tl.debug_barrier()
            last = done == num_splits - 1
        if last:
            m = tl.full([BLOCK_H], float("-inf"), tl.float32)
            l = tl.zeros([BLOCK_H], tl.float32)
            res = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
            if num_splits == 1:
                m, l, res = _merge_split(m, l, res, part_lse, part_o)
            else:
                m, l, res = _merge_stored_splits(m, l, res, pl_ptrs, po_ptrs, stride_pos, num_splits, mask_h, mask_o,
                                                 MERGE_CHUNK)  # fmt: skip
                tl.store(counter, 0)
            res = tl.where(l[:, None] > 0, res / tl.where(l > 0, l, 1.0)[:, None], 0.0)
            tl.store(AttnOut + heads[:, None] * HEAD_DIM + offs_d[None, :], res.to(AttnOut.dtype.element_ty), mask=mask_o)
            # the group's outputs before the count that publishes them (release, gpu scope)
            tl.debug_barrier()
            tl.atomic_add(Sync + 1, 1, sem="release")


@triton.jit
def _projection_role(o_block, o_programs, AttnOut, W, Bias, Y, Sync, N, stride_wn, HKV: tl.constexpr, KW: tl.constexpr,
                     BLOCK_O: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr, PRELOAD_W: tl.constexpr,
                     SOFT_BF16: tl.constexpr, MAX_SPINS: tl.constexpr):  # fmt: skip
    """Rows ``[o_block * BLOCK_O, ...)`` of ``Y = AttnOut @ W^T (+ Bias)`` (W ``[N, KW]``) once
    every KV head's group is in AttnOut (``Sync[1] == HKV``); the last of the ``o_programs``
    to finish puts ``Sync[1]`` and ``Sync[2]`` back to zero. ``MAX_SPINS`` (0: no limit) bounds
    the wait: a group never counted then leaves ``Sync[3]`` non-zero rather than a hang."""
    offs_o = o_block * BLOCK_O + tl.arange(0, BLOCK_O)
    mask_o = offs_o < N
    offs_k = tl.arange(0, KW)
    w_ptrs = W + tl.minimum(offs_o, N - 1).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_O, KW]
    w = tl.zeros([BLOCK_O, KW], dtype=W.dtype.element_ty)
    if PRELOAD_W:  # the weight is no kernel's output: its whole tile loads while the kernel before ends
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    if not PRELOAD_W:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    # every group merged; the acquire makes their outputs visible to this program's threads
    merged = tl.atomic_add(Sync + 1, 0, sem="acquire")
    spins = 0
    while (merged < HKV) & ((MAX_SPINS == 0) | (spins < MAX_SPINS)):
        merged = tl.atomic_add(Sync + 1, 0, sem="acquire")
        spins += 1
    if merged < HKV:  # gave up (a fault): left for the caller to see, never reset
        tl.atomic_add(Sync + 3, 1, sem="relaxed")
    tl.debug_barrier()
    x = tl.load(AttnOut + offs_k, cache_modifier=".cg").to(tl.float32)  # [KW]
    y = tl.sum(w.to(tl.float32) * x[None, :], 1)  # [BLOCK_O]
    if HAS_BIAS:
        y += tl.load(Bias + offs_o, mask=mask_o, other=0.0).to(tl.float32)
    tl.store(Y + offs_o, round_to(y, Y.dtype.element_ty, SOFT_BF16), mask=mask_o)
    tl.debug_barrier()
    finished = tl.atomic_add(Sync + 2, 1, sem="acq_rel")  # after this program's reads of Sync[1]
    if finished == o_programs - 1:  # every projection program has seen the groups: ready for the next launch
        tl.store(Sync + 1, 0)
        tl.store(Sync + 2, 0)


@triton.jit(do_not_specialize=["max_splits"])
def _decode_attention_o_kernel(
    Q, K, V, ReqToPage, ReqIdx, SeqLens, PartO, PartLse, KNew, VNew, NewLoc, Counters, AttnOut, W, Bias, Y, Sync,
    scale, window, max_splits, min_split_len, N,
    stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_rtp, stride_poh, stride_pos, stride_plh,
    stride_knh, stride_vnh, stride_wn,
    GROUP: tl.constexpr, HKV: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    MERGE_CHUNK: tl.constexpr, KW: tl.constexpr, BLOCK_O: tl.constexpr, HAS_BIAS: tl.constexpr,
    PRELOAD_W: tl.constexpr, SOFT_BF16: tl.constexpr, MAX_SPINS: tl.constexpr,
):  # fmt: skip
    # The role by ticket: tickets are taken in the order programs start, so every attention
    # program a projection program waits for has started (and needs nothing of the launch).
    ticket = tl.atomic_add(Sync, 1, sem="relaxed")
    if ticket == tl.num_programs(0) - 1:  # the last ticket: every program holds one
        tl.store(Sync, 0)
    attention = HKV * max_splits
    if ticket < attention:
        _attention_role(ticket, Q, K, V, ReqToPage, ReqIdx, SeqLens, PartO, PartLse, KNew, VNew, NewLoc, Counters, AttnOut,
                        Sync, scale, window, max_splits, min_split_len, stride_qh, stride_ks, stride_kh, stride_vs,
                        stride_vh, stride_rtp, stride_poh, stride_pos, stride_plh, stride_knh, stride_vnh, GROUP,
                        PAGE_SIZE, HEAD_DIM, BLOCK_H, BLOCK_N, UPCAST, PRECISION, USE_PDL, MERGE_CHUNK)  # fmt: skip
    else:
        _projection_role(ticket - attention, tl.num_programs(0) - attention, AttnOut, W, Bias, Y, Sync, N, stride_wn, HKV,
                         KW, BLOCK_O, HAS_BIAS, USE_PDL, PRELOAD_W, SOFT_BF16, MAX_SPINS)  # fmt: skip


def new_sync(device: torch.device | str) -> torch.Tensor:
    """The launch's int32 counters (`SYNC_SLOTS` zeros); every launch leaves them zero, so one
    serves every launch and CUDA-graph replay on a stream (made outside a capture)."""
    return torch.zeros(SYNC_SLOTS, dtype=torch.int32, device=device)


def decode_attention_o_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_page: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    *,
    page_size: int,
    scale: float,
    max_splits: int,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    new_loc: torch.Tensor,
    counters: torch.Tensor,
    weight: torch.Tensor,
    sync: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    attn_out: torch.Tensor | None = None,
    min_split_len: int = DEFAULT_MIN_SPLIT_LEN,
    window_left: int = -1,
    block_o: int = 4,
    preload_weight: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(attention(q) @ weight^T + bias, attention(q))`` for one request in one launch.

    q: ``[1, Hq, D]``; k_buffer, v_buffer: ``[num_slots, Hkv, D]`` (the layer's pool); req_to_page,
    req_pool_indices, seq_lens, partial_out (``[1, Hq, >= max_splits, D]`` fp32), partial_lse,
    page_size, scale, max_splits, min_split_len, window_left, k_new, v_new (``[1, Hkv, D]``),
    new_loc (``[1]``), counters (int32 zeros, ``>= Hkv``): as for `decode_attention_fwd` (the
    new K/V are stored; the splits merge in the launch). A non-zero ``sync[3]`` after a launch
    reports a projection program that stopped waiting for the attention (`MAX_SPINS`): a fault. weight: ``[N, Hq * D]`` contiguous (the
    output projection), bias: ``[N]`` or None. sync: `new_sync`'s counters. out: ``[1, N]``
    (a new one when None); attn_out: ``[Hq * D]`` (the attention output; new when None).
    block_o: weight rows per projection program (a power of two); preload_weight: a projection
    program loads its weight tile before the PDL wait (else after it).

    Raises `InputError` (a ``ValueError``) for what the kernel does not serve (see the module's
    docstring) and for operands of another dtype or device; nothing is written then.
    """
    bsz, hq, d = q.shape
    hkv = k_buffer.shape[1]
    if bsz != 1:
        raise InputError(f"decode_attention_o_fwd serves one request; got a batch of {bsz} (use decode_attention_fwd)")
    if d & (d - 1) or v_buffer.shape[2] != d or hq % hkv:
        raise InputError(f"heads of a power-of-two dim, K and V dims equal, Hq a multiple of Hkv; got q {tuple(q.shape)}, "
                         f"pools {tuple(k_buffer.shape)} / {tuple(v_buffer.shape)}")  # fmt: skip
    operands = dict(k_buffer=k_buffer, v_buffer=v_buffer, k_new=k_new, v_new=v_new, new_loc=new_loc, counters=counters,
                    sync=sync, weight=weight, bias=bias, out=out, attn_out=attn_out, partial_out=partial_out,
                    partial_lse=partial_lse, req_to_page=req_to_page, seq_lens=seq_lens)  # fmt: skip
    if away := [name for name, t in operands.items() if t is not None and t.device != q.device]:
        raise InputError(f"{', '.join(away)} must be on q's device {q.device}")
    if k_buffer.dtype != q.dtype or v_buffer.dtype != q.dtype:
        raise InputError(f"the pools must be {q.dtype} like q; got {k_buffer.dtype} / {v_buffer.dtype}")
    kw = hq * d
    n = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != kw or not weight.is_contiguous() or weight.dtype != q.dtype or n == 0:
        raise InputError(f"weight must be a contiguous {q.dtype} [N >= 1, {kw}]; got {weight.dtype} {tuple(weight.shape)}")
    if kw > MAX_ROW:
        raise InputError(f"a projection program holds a whole weight row of Hq * D = {kw} > {MAX_ROW} values in registers "
                         "(use decode_attention_fwd and the linear after it)")  # fmt: skip
    if bias is not None and (tuple(bias.shape) != (n,) or not bias.is_contiguous() or bias.dtype != q.dtype):
        raise InputError(f"bias must be a contiguous {q.dtype} [{n}]; got {bias.dtype} {tuple(bias.shape)}")
    if tuple(k_new.shape) != (1, hkv, d) or tuple(v_new.shape) != (1, hkv, d) or new_loc.numel() != 1:
        raise InputError(f"k_new, v_new must be [1, {hkv}, {d}] and new_loc [1]; got {tuple(k_new.shape)}, "
                         f"{tuple(v_new.shape)}, {tuple(new_loc.shape)}")  # fmt: skip
    if counters.dtype != torch.int32 or counters.numel() < hkv or sync.dtype != torch.int32 or sync.numel() < SYNC_SLOTS:
        raise InputError(f"counters (int32, >= {hkv}) and sync (int32, >= {SYNC_SLOTS}; new_sync) must be zeroed int32 tensors")
    if partial_out.shape[2] < max_splits or partial_lse.shape[2] < max_splits:
        raise InputError(f"partial buffers hold {partial_out.shape[2]} splits, need {max_splits}")
    if block_o < 1 or block_o & (block_o - 1) or kw & (kw - 1):
        raise InputError(f"block_o ({block_o}) and Hq * D ({kw}) must be powers of two")
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("k_new", k_new), ("v_new", v_new),
                    ("partial_out", partial_out), ("partial_lse", partial_lse)):  # fmt: skip
        check_last_dim_contiguous(name, t)
    out = torch.empty((1, n), dtype=q.dtype, device=q.device) if out is None else out
    attn_out = torch.empty(kw, dtype=q.dtype, device=q.device) if attn_out is None else attn_out
    if tuple(out.shape) != (1, n) or not out.is_contiguous() or tuple(attn_out.shape) != (kw,) or not attn_out.is_contiguous():
        raise InputError(f"out must be a contiguous [1, {n}] and attn_out a contiguous [{kw}] tensor")
    group = hq // hkv
    block_h = decode_block_h(group, d, d, q.dtype)
    if group > block_h:
        raise InputError(f"a GQA group of {group} query heads needs several head blocks (use decode_attention_fwd)")
    upcast, precision = dot_options(q.dtype)
    use_pdl = pdl.enabled(q.device)
    o_programs = triton.cdiv(n, block_o)
    _decode_attention_o_kernel[(hkv * max_splits + o_programs,)](
        q, k_buffer, v_buffer, req_to_page, req_pool_indices, seq_lens, partial_out, partial_lse, k_new, v_new, new_loc,
        counters, attn_out, weight, bias if bias is not None else weight, out, sync,
        float(scale), window_arg(window_left), max_splits, min_split_len, n,
        q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1), req_to_page.stride(0),
        partial_out.stride(1), partial_out.stride(2), partial_lse.stride(1), k_new.stride(1), v_new.stride(1),
        weight.stride(0),
        GROUP=group, HKV=hkv, PAGE_SIZE=page_size, HEAD_DIM=d, BLOCK_H=block_h, BLOCK_N=decode_block_n(d, d, q.dtype),
        UPCAST=upcast, PRECISION=precision, USE_PDL=use_pdl, MERGE_CHUNK=merge_chunk(block_h, d), KW=kw, BLOCK_O=block_o,
        HAS_BIAS=bias is not None, PRELOAD_W=preload_weight, SOFT_BF16=q.dtype == torch.bfloat16 and interpreting(),
        MAX_SPINS=100 if interpreting() else MAX_SPINS,
        num_warps=4, num_stages=2, **pdl.launch_options(use_pdl),
    )  # fmt: skip
    return out, attn_out
