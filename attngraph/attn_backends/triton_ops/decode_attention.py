"""Paged decode attention with split KV (Triton): one new query token per request.

Two kernels:

* stage 1, grid ``(batch, num_kv_heads * head_blocks, max_splits)``: a program takes a block of
  the query heads of one KV head's GQA group (`decode_block_h`: the group padded to a power of
  two, at least 16 for ``tl.dot``, in blocks of at most 64) and one split of the request's
  keys, gathers K/V through the page table and runs an online softmax in fp32. It writes the
  split's normalised output and its log-sum-exp (base 2) to the partial buffers.
* stage 2, grid ``(batch, num_q_heads)``: merges the splits of each request and head.

Fused forms, each optional (`decode_attention_fwd`'s ``k_new`` and ``counters``), one launch
per layer with both:

* New K/V: stage 1 also stores the new token's K/V row into the pool (the program of split 0
  and head block 0 of each request and KV head), and every program takes key ``seq_len - 1``
  from those rows rather than from the pool, where that store may not have landed yet.
* Merge in stage 1: each program of a (request, KV head, head block) tile stores its partials
  and counts itself on the tile's int32 counter (an ``acq_rel`` atomic); the last to count
  merges the tile's splits in order (stage 2's arithmetic, one split's 2-D tile at a time, the
  loads of `merge_chunk` splits in flight together), writes the output and puts the counter
  back to zero. A request of one split merges at once from registers (no
  partials, no atomic).

How many splits a request uses is decided on the device from its own length
(`_split_plan`), so nothing is read back to the host and the launch is CUDA-graph safe:
``splits = clamp(cdiv(kv_span, min_split_len), 1, max_splits)``; a program whose split lies
past the request's last one returns at once. ``max_splits`` (the grid's third axis) is the
caller's choice; the result depends only on the request itself and ``max_splits``.

The helpers at the top (`interpreting`, `dot_options`, `_dot`, `_softcap`) are shared with
`extend_attention`.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import triton
import triton.language as tl

from ... import kernel_clock, pdl, weight_prefetch
from ...kernel_clock import now, sm_id, store_record
from ...pdl import gdc_launch_dependents, gdc_wait
from ...weight_prefetch import bulk_prefetch_l2
from ...errors import InputError
from ...triton_math import rotate_half_rows, round_to

logger = logging.getLogger(__name__)

#: Stands for "no window": large enough to admit every key, small enough not to overflow int32.
NO_WINDOW = 1 << 30
#: Default shortest split (keys); shorter requests run in one split. Under PDL every program
#: loads its split's first block before waiting for the kernel before it, so splits of one
#: block (64 keys, `decode_block_n`) leave no key load on the path after the wait. Timed
#: interleaved on an H200 (``bench_generate.py --interleave --variant decode-min-split=...``,
#: BENCHMARKS.md): the 1B batch-1 step 0.990-0.992 ms against 1.026 with splits of 128, the
#: 8B one 4.519-4.528 against 4.607; batch 16 did not move. Alone, outside a step, the kernel
#: did not gain from shorter splits: it had no kernel before it to overlap.
DEFAULT_MIN_SPLIT_LEN = 64

_LOG2E = tl.constexpr(1.4426950408889634)  # globals read by @jit code must be constexpr


# ----------------------------------------------------------------------------- shared helpers
# Triton decides at ``@triton.jit`` time (this module's import) whether kernels are interpreted.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """True when this module's kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``
    was set when the module was imported)."""
    return _INTERPRETED


def interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run these kernels here, or None.

    Triton before 3.7 turns a loop bound into an int with ``int(array)`` on a one-element
    array, which numpy 2.4 refuses (``only 0-dimensional arrays can be converted``); later
    Triton squeezes the array first. Probed, not assumed from numpy's version.
    """
    import numpy as np

    version = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())
    if version >= (3, 7):
        return None
    try:
        int(np.zeros(1))
    except TypeError:
        return (
            f"Triton {triton.__version__}'s interpreter cannot run with numpy {np.__version__} "
            "(int() of a one-element array); install triton>=3.7 or numpy<2.4"
        )
    return None


def dot_options(dtype: torch.dtype) -> tuple[bool, str]:
    """``(upcast, input_precision)`` of the kernels' ``tl.dot`` for inputs of ``dtype``.

    fp32 inputs use ``"ieee"`` (not TF32) so fp32 matches the reference. The Triton 3.9
    interpreter multiplies the raw bits of bf16 operands in ``tl.dot``
    (triton-lang/triton#11584), so under the interpreter bf16 operands are upcast to fp32.
    """
    upcast = dtype == torch.bfloat16 and interpreting()
    return upcast, ("ieee" if dtype == torch.float32 or upcast else "tf32")


def window_arg(window_left: int) -> int:
    """The kernels' window argument: ``window_left`` or `NO_WINDOW` for ``-1``."""
    return NO_WINDOW if window_left < 0 else int(window_left)


def chunk_arg(chunk_size: int, causal: bool = True) -> int:
    """The kernels' chunk argument: ``chunk_size`` or `NO_WINDOW` for ``0`` (every position
    then lies in chunk 0). Chunked local attention is causal only."""
    if chunk_size < 0 or (chunk_size > 0 and not causal):
        raise ValueError(f"chunk_size must be >= 0 and needs a causal mask; got {chunk_size} (causal={causal})")
    return NO_WINDOW if chunk_size == 0 else int(chunk_size)


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tuple(t.stride())}")


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``a @ b`` accumulated in fp32 (``[M, K] x [K, N] -> [M, N]``)."""
    if UPCAST:
        res = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
    else:
        res = tl.dot(a, b, input_precision=PRECISION)
    return res


@triton.jit
def _softcap(s, cap):
    """``cap * tanh(s / cap)`` with ``tanh(x) = 1 - 2 / (exp(2x) + 1)``: exact limits at +-inf."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))


@triton.jit
def _split_plan(seq_len, window, chunk, max_splits, min_split_len, SPLIT_ALIGN: tl.constexpr):
    """Keys ``[kv_lo, seq_len)`` of a decode query at ``seq_len - 1``, cut into splits.

    Returns ``(kv_lo, split_len, num_splits)``: split ``s`` covers
    ``[kv_lo + s * split_len, min(kv_lo + (s + 1) * split_len, seq_len))``; every one of the
    ``num_splits`` splits is non-empty (``num_splits = 0`` only when ``seq_len = 0``).
    ``split_len`` is a multiple of ``SPLIT_ALIGN`` (the key block) so no block straddles splits.
    """
    # from the window's start or the query's chunk's start, whichever is later
    kv_lo = tl.maximum(tl.maximum(seq_len - 1 - window, (seq_len - 1) // chunk * chunk), 0)
    span = seq_len - kv_lo
    want = tl.minimum(tl.maximum(tl.cdiv(span, min_split_len), 1), max_splits)
    split_len = tl.maximum(tl.cdiv(tl.cdiv(span, want), SPLIT_ALIGN) * SPLIT_ALIGN, SPLIT_ALIGN)
    return kv_lo, split_len, tl.cdiv(span, split_len)


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _merge_split(m, l, acc, lse, o):
    """One split's partials merged into the running ``(m, l, acc)``: ``lse: [BLOCK_H]`` (log2
    units; ``-inf`` for no split, but never for the first merged), ``o: [BLOCK_H, BLOCK_DV]``;
    ``m, l: [BLOCK_H]``, ``acc: [BLOCK_H, BLOCK_DV]``. Stage 2's arithmetic, all of it
    elementwise on the tile's own layout (no cross-thread reduction, no layout conversion)."""
    m_new = tl.maximum(m, lse)  # finite: the first split merged holds keys
    alpha = tl.exp2(m - m_new)
    w = tl.exp2(lse - m_new)  # zero for no split
    return m_new, l * alpha + w, acc * alpha[:, None] + o * w[:, None]


@triton.jit
def _merge_stored_splits(m, l, acc, pl_ptrs, po_ptrs, stride_pos, num_splits, mask_h, mask_o, MERGE_CHUNK: tl.constexpr):
    """The ``num_splits`` stored partials of a tile merged into ``(m, l, acc)`` in split order,
    read past L1 (other programs wrote them). The loop body is unrolled ``MERGE_CHUNK`` times:
    each split's tile is loaded and merged on its own (2-D, as `_merge_split`), and the loads
    of a chunk do not wait on each other's merges, so they are in flight together. (Loading a
    chunk as one ``[MERGE_CHUNK, BLOCK_H, BLOCK_DV]`` tile and reducing over its first axis, a
    sum through shared memory, cost 3.8 us for 3 splits in chunks of 8 against 1.0 us one split
    at a time, on an H100.)
    ``pl_ptrs: [BLOCK_H]`` and ``po_ptrs: [BLOCK_H, BLOCK_DV]`` point at split 0's LSE and
    output, splits 1 and ``stride_pos`` apart; ``mask_h``, ``mask_o`` their valid lanes."""
    for s0 in range(0, num_splits, MERGE_CHUNK):
        for i in tl.static_range(MERGE_CHUNK):
            sid = s0 + i  # the chunk's first split exists
            # [BLOCK_H]: lanes of a valid head of an existing split (a tensor: the interpreter
            # refuses a mask of a tensor and a scalar condition)
            ok_h = tl.where(mask_h, sid, num_splits) < num_splits
            lse = tl.load(pl_ptrs + sid, mask=ok_h, other=0.0, cache_modifier=".cg")
            lse = tl.where(sid < num_splits, lse, float("-inf"))  # [BLOCK_H]
            o = tl.load(po_ptrs + sid * stride_pos, mask=mask_o & ok_h[:, None], other=0.0, cache_modifier=".cg")
            m, l, acc = _merge_split(m, l, acc, lse, o)
    return m, l, acc


@triton.jit
def _load_block(K, V, ReqToPage, row, stride_rtp, stride_ks, stride_kh, stride_vs, stride_vh, kvh,
                pos, mask_kv, offs_d, mask_d, offs_dt, mask_dt, offs_dv, mask_dv,
                PAGE_SIZE: tl.constexpr, HAS_TAIL: tl.constexpr):  # fmt: skip
    """The pool's keys ``kt: [BLOCK_D, BLOCK_N]`` (and ``kt_tail: [BLOCK_DT, BLOCK_N]``) and values
    ``v: [BLOCK_N, BLOCK_DV]`` of KV head ``kvh`` at key positions ``pos`` (zeros off ``mask_kv``)."""
    page = tl.load(ReqToPage + row * stride_rtp + pos // PAGE_SIZE, mask=mask_kv, other=0)
    slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE  # [BLOCK_N] rows of the flat pool
    k_ptrs = K + slot[None, :] * stride_ks + kvh * stride_kh + offs_d[:, None]
    kt = tl.load(k_ptrs, mask=mask_d[:, None] & mask_kv[None, :], other=0.0)
    kt_tail = kt
    if HAS_TAIL:
        kt_ptrs = K + slot[None, :] * stride_ks + kvh * stride_kh + offs_dt[:, None]
        kt_tail = tl.load(kt_ptrs, mask=mask_dt[:, None] & mask_kv[None, :], other=0.0)
    v_ptrs = V + slot[:, None] * stride_vs + kvh * stride_vh + offs_dv[None, :]
    v = tl.load(v_ptrs, mask=mask_kv[:, None] & mask_dv[None, :], other=0.0)
    return kt, kt_tail, v


@triton.jit
def _attend_block(q, q_tail, kt, kt_tail, v, k_new, k_new_tail, v_new, m_i, l_i, acc, pos, mask_n, seq_len,
                  slope, scale, logit_cap, UPCAST: tl.constexpr, PRECISION: tl.constexpr, HAS_TAIL: tl.constexpr,
                  HAS_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr, NEW_KV: tl.constexpr):  # fmt: skip
    """One block of keys folded into the running softmax ``m_i, l_i: [BLOCK_H]`` (log2 units) and
    ``acc: [BLOCK_H, BLOCK_DV]``; with ``NEW_KV`` the new token's K/V stand at ``seq_len - 1``.
    Needs at least one valid key in the block (``m_new`` is then finite)."""
    if NEW_KV:
        is_new = pos == seq_len - 1
        kt = tl.where(is_new[None, :], k_new[:, None], kt)
        v = tl.where(is_new[:, None], v_new[None, :], v)
    s = _dot(q, kt.to(q.dtype), UPCAST, PRECISION)  # [BLOCK_H, BLOCK_N]
    if HAS_TAIL:
        if NEW_KV:
            kt_tail = tl.where(is_new[None, :], k_new_tail[:, None], kt_tail)
        s += _dot(q_tail, kt_tail.to(q.dtype), UPCAST, PRECISION)
    s = s * scale
    if HAS_CAP:
        s = _softcap(s, logit_cap)
    if HAS_ALIBI:  # slope * (key position - query position); the query sits at seq_len - 1
        s = s + slope[:, None] * (pos - (seq_len - 1)).to(tl.float32)[None, :]
    s = tl.where(mask_n[None, :], s * _LOG2E, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype), UPCAST, PRECISION)
    return m_new, l_i, acc


# Values that change with the batch size (``max_splits`` and the partial LSE's head stride) are
# not specialized: Triton would compile a variant per divisibility class (1, multiple of 16,
# other), paid again by every fresh process for the captures of the decode graphs.
@triton.jit(do_not_specialize=["max_splits", "stride_plh"])
def _decode_stage1_kernel(
    Q, K, V, ReqToPage, ReqIdx, SeqLens, PartO, PartLse, Slopes,
    KNew, VNew, NewLoc, Out, Sinks, Counters, RopeCos, RopeSin, Trace, L2Next,
    scale, logit_cap, window, chunk, max_splits, min_split_len, l2_pieces,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_rtp,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
    stride_knb, stride_knh, stride_vnb, stride_vnh, stride_ob, stride_oh, stride_rcb, stride_rsb,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, V_HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_CAP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr, BLOCK_DT: tl.constexpr, HAS_TAIL: tl.constexpr,
    NEW_KV: tl.constexpr, MERGE: tl.constexpr, HAS_SINKS: tl.constexpr, USE_PDL: tl.constexpr,
    PREFETCH: tl.constexpr, ROPE: tl.constexpr, SOFT_BF16: tl.constexpr, MERGE_CHUNK: tl.constexpr,
    TRACE: tl.constexpr, L2_LANES: tl.constexpr, L2_PIECE: tl.constexpr,
):  # fmt: skip
    # TRACE (attngraph.kernel_clock): each program's record in Trace, points 0 entry, 1 past the
    # wait, 2 its split attended, 3 counted on the tile's counter, 4 merged, 5 done.
    t0 = tl.full([], 0, tl.int64)
    c0 = t0
    t1, c1, t2, c2, t3, c3, t4, c4, t5, c5 = t0, t0, t0, t0, t0, t0, t0, t0, t0, t0
    if TRACE:
        t0, c0 = now(tl.program_id(0))
        t1, c1 = t0, c0  # without PDL no wait: "past the wait" is the entry
    # PDL (attngraph.pdl): the kernel may start before the one producing q (and k_new / v_new)
    # has finished. Only that kernel's outputs are unsafe before gdc_wait: the page table, the
    # lengths, the new token's slot and the pool's keys before seq_len - 1 were written by
    # earlier kernels (or copies), and with NEW_KV no kernel but this one writes the pool, so
    # (PREFETCH = USE_PDL and NEW_KV) the first block of keys loads first.
    if USE_PDL and not PREFETCH:
        gdc_wait()
        gdc_launch_dependents()
        if TRACE:
            t1, c1 = now(tl.program_id(0))
    b = tl.program_id(0)
    kvh = tl.program_id(1) // HEAD_BLOCKS  # the KV head, and which BLOCK_H of its group's query heads
    hb = tl.program_id(1) % HEAD_BLOCKS
    sid = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    kv_lo, split_len, num_splits = _split_plan(seq_len, window, chunk, max_splits, min_split_len, BLOCK_N)

    # Head dims [0, BLOCK_D) and, when HEAD_DIM is no power of two, the tail [BLOCK_D, HEAD_DIM)
    # in a second block (MLA's latent 512 + RoPE 64; 128 + 64): no padding to the next power.
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_dt = BLOCK_D + tl.arange(0, BLOCK_DT)
    mask_dt = offs_dt < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < V_HEAD_DIM
    start = kv_lo + sid * split_len
    end = tl.minimum(start + split_len, seq_len)
    row = tl.load(ReqIdx + b).to(tl.int64)
    loc = row  # placeholder without NEW_KV; else the new K/V's pool slot, before the wait like the lengths
    if NEW_KV:
        loc = tl.load(NewLoc + b).to(tl.int64)
    if PREFETCH:  # the first block's pool keys and values (none past end: a split without keys)
        pos0 = start + tl.arange(0, BLOCK_N)
        mask0 = (pos0 < end) & (pos0 != seq_len - 1)
        kt0, kt0_tail, v0 = _load_block(K, V, ReqToPage, row, stride_rtp, stride_ks, stride_kh, stride_vs, stride_vh,
                                        kvh, pos0, mask0, offs_d, mask_d, offs_dt, mask_dt, offs_dv, mask_dv,
                                        PAGE_SIZE, HAS_TAIL)  # fmt: skip
        gdc_wait()
        gdc_launch_dependents()
        if TRACE:
            t1, c1 = now(tl.program_id(0))
    program = (b * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + sid  # the record's row (TRACE)
    if L2_LANES > 0:
        # Past the wait the kernel before (the q/k/v projection) has finished streaming its
        # weight, and this launch reads little: ask L2 for the next projection's weight
        # (`l2_pieces` pieces of L2_PIECE bytes from L2Next), piece i by lane i // programs of
        # program i % programs, so every program issues a few. Before any early return.
        programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        piece = tl.arange(0, L2_LANES).to(tl.int64) * programs + program
        bulk_prefetch_l2(L2Next.to(tl.pointer_type(tl.int8)) + tl.minimum(piece, l2_pieces - 1) * L2_PIECE,
                         piece < l2_pieces, L2_PIECE)  # fmt: skip
    k_new = offs_d  # placeholders without NEW_KV (never read)
    k_new_tail = offs_dt
    v_new = offs_dv
    # ROPE (NEW_KV, no tail): HF's rotate-half RoPE of q and the new key with the token's rows
    # of cos / sin ([BLOCK_D] fp32), rounded once to their dtypes (the rotated tensors a fused
    # elementwise kernel would have written); read after gdc_wait like q.
    rot_d = (offs_d + HEAD_DIM // 2) % HEAD_DIM
    rc = offs_d.to(tl.float32)  # placeholders without ROPE (never read)
    rs = rc
    if ROPE:
        rc = tl.load(RopeCos + b * stride_rcb + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        rs = tl.load(RopeSin + b * stride_rsb + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if NEW_KV:
        # The new token's K/V rows of this KV head in the pool's dtype ([BLOCK_D], [BLOCK_DT],
        # [BLOCK_DV]). One program per (request, KV head) stores them; every program uses them
        # for key position seq_len - 1, since that store is not visible to other programs in time.
        kn_ptrs = KNew + b * stride_knb + kvh * stride_knh
        if ROPE:
            kn = tl.load(kn_ptrs + offs_d, mask=mask_d, other=0.0)[None, :]
            kn_rot = tl.load(kn_ptrs + rot_d, mask=mask_d, other=0.0)[None, :]
            k_new = tl.reshape(round_to(rotate_half_rows(kn, kn_rot, offs_d, rc, rs, HEAD_DIM // 2), KNew.dtype.element_ty,
                                        SOFT_BF16), (BLOCK_D,)).to(K.dtype.element_ty)  # fmt: skip
        else:
            k_new = tl.load(kn_ptrs + offs_d, mask=mask_d, other=0.0).to(K.dtype.element_ty)
        if HAS_TAIL:
            k_new_tail = tl.load(kn_ptrs + offs_dt, mask=mask_dt, other=0.0).to(K.dtype.element_ty)
        v_new = tl.load(VNew + b * stride_vnb + kvh * stride_vnh + offs_dv, mask=mask_dv, other=0.0)
        v_new = v_new.to(V.dtype.element_ty)

    # q (and its rotation) loads with the new K/V rows, before the store below: loads and stores
    # keep their program order, so a load after the store would cost the storing program
    # another round trip to memory on its way to the merge. Programs past the request's last
    # split load q too (a few hundred bytes) and return after the store.
    offs_g = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_g < GROUP
    heads = kvh * GROUP + offs_g  # [BLOCK_H] query heads of this KV head
    q_ptrs = Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if ROPE:
        q_rot = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + rot_d[None, :], mask=mask_h[:, None] & mask_d[None, :],
                        other=0.0)  # fmt: skip
        q = round_to(rotate_half_rows(q, q_rot, offs_d, rc, rs, HEAD_DIM // 2), Q.dtype.element_ty, SOFT_BF16)
    q_tail = q
    if HAS_TAIL:
        qt_ptrs = Q + b * stride_qb + heads[:, None] * stride_qh + offs_dt[None, :]
        q_tail = tl.load(qt_ptrs, mask=mask_h[:, None] & mask_dt[None, :], other=0.0)  # [BLOCK_H, BLOCK_DT]
    slope = tl.zeros([BLOCK_H], tl.float32)
    if HAS_ALIBI:  # [BLOCK_H] slopes of the group's query heads
        slope = tl.load(Slopes + heads, mask=mask_h, other=0.0).to(tl.float32)
    if NEW_KV:
        if (sid == 0) & (hb == 0):  # before any early return: stored even for seq_len = 0, as save_kv does
            tl.store(K + loc * stride_ks + kvh * stride_kh + offs_d, k_new, mask=mask_d)
            if HAS_TAIL:
                tl.store(K + loc * stride_ks + kvh * stride_kh + offs_dt, k_new_tail, mask=mask_dt)
            tl.store(V + loc * stride_vs + kvh * stride_vh + offs_dv, v_new, mask=mask_dv)

    runs = num_splits
    if MERGE:  # split 0 of a request without keys still runs: it writes the request's zeros
        runs = tl.maximum(num_splits, 1)
    if sid >= runs:
        if TRACE:
            t5, c5 = now(runs)
            store_record(Trace, program, t0, c0, t1, c1, t2, c2, t3, c3, t4, c4, t5, c5, sm_id(runs))
        return

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    first = start
    if PREFETCH:
        if start < end:
            m_i, l_i, acc = _attend_block(q, q_tail, kt0, kt0_tail, v0, k_new, k_new_tail, v_new, m_i, l_i, acc,
                                          pos0, pos0 < end, seq_len, slope, scale, logit_cap, UPCAST, PRECISION,
                                          HAS_TAIL, HAS_CAP, HAS_ALIBI, NEW_KV)  # fmt: skip
        first = start + BLOCK_N
    for n0 in range(first, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        mask_n = pos < end
        mask_kv = mask_n  # positions read from the pool
        if NEW_KV:
            mask_kv = mask_n & (pos != seq_len - 1)
        kt, kt_tail, v = _load_block(K, V, ReqToPage, row, stride_rtp, stride_ks, stride_kh, stride_vs, stride_vh,
                                     kvh, pos, mask_kv, offs_d, mask_d, offs_dt, mask_dt, offs_dv, mask_dv,
                                     PAGE_SIZE, HAS_TAIL)  # fmt: skip
        m_i, l_i, acc = _attend_block(q, q_tail, kt, kt_tail, v, k_new, k_new_tail, v_new, m_i, l_i, acc, pos, mask_n,
                                      seq_len, slope, scale, logit_cap, UPCAST, PRECISION, HAS_TAIL, HAS_CAP,
                                      HAS_ALIBI, NEW_KV)  # fmt: skip

    # This split's normalised output and log-sum-exp (base 2): [BLOCK_H, BLOCK_DV], [BLOCK_H].
    part_o = acc / l_i[:, None]
    part_lse = m_i + tl.log2(l_i)
    if TRACE:
        t2, c2 = now(tl.sum(part_lse, 0).to(tl.int32, bitcast=True))
    mask_o = mask_h[:, None] & mask_dv[None, :]
    po_ptrs = PartO + b * stride_pob + heads[:, None] * stride_poh + offs_dv[None, :]  # split 0's
    pl_ptrs = PartLse + b * stride_plb + heads * stride_plh
    if not MERGE:
        tl.store(po_ptrs + sid * stride_pos, part_o, mask=mask_o)
        tl.store(pl_ptrs + sid, part_lse, mask=mask_h)
    else:
        # Stage 2 in this launch: the tile's (request, KV head, head block) last program to finish
        # merges its splits. A request of one split (or none) merges here, from registers.
        counter = Counters + b * tl.num_programs(1) + tl.program_id(1)
        last = num_splits <= 1
        if num_splits > 1:
            tl.store(po_ptrs + sid * stride_pos, part_o, mask=mask_o)
            tl.store(pl_ptrs + sid, part_lse, mask=mask_h)
            # The barrier orders every thread's partial stores before the atomic, whose release
            # (gpu scope) publishes them; its acquire makes the other programs' partials visible
            # to the merging program, whose threads all read after the second barrier.
            tl.debug_barrier()
            done = tl.atomic_add(counter, 1, sem="acq_rel")
            tl.debug_barrier()
            last = done == num_splits - 1
            if TRACE:
                t3, c3 = now(done)
        if last:
            m = tl.full([BLOCK_H], float("-inf"), tl.float32)
            l = tl.zeros([BLOCK_H], tl.float32)
            res = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
            if num_splits == 1:
                m, l, res = _merge_split(m, l, res, part_lse, part_o)
            else:  # the splits in order, MERGE_CHUNK loads in flight at a time, read past L1 (".cg")
                m, l, res = _merge_stored_splits(m, l, res, pl_ptrs, po_ptrs, stride_pos, num_splits, mask_h, mask_o,
                                                 MERGE_CHUNK)  # fmt: skip
                tl.store(counter, 0)  # every program of the tile has counted: ready for the next launch
            if HAS_SINKS:  # the head's sink logit joins the denominator only (it has no value)
                sink = tl.load(Sinks + heads, mask=mask_h, other=0.0).to(tl.float32) * _LOG2E
                m_new = tl.maximum(m, sink)
                alpha = tl.exp2(m - m_new)
                res = res * alpha[:, None]
                l = l * alpha + tl.exp2(sink - m_new)
            res = tl.where(l[:, None] > 0, res / tl.where(l > 0, l, 1.0)[:, None], 0.0)  # seq_len = 0: zeros
            if TRACE:
                t4, c4 = now(tl.sum(l, 0).to(tl.int32, bitcast=True))
            o_ptrs = Out + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :]
            tl.store(o_ptrs, res.to(Out.dtype.element_ty), mask=mask_o)
    if TRACE:
        t5, c5 = now(sid)
        store_record(Trace, program, t0, c0, t1, c1, t2, c2, t3, c3, t4, c4, t5, c5, sm_id(sid))


@triton.jit(do_not_specialize=["max_splits", "stride_plh"])
def _decode_stage2_kernel(
    PartO, PartLse, Out, SeqLens, Sinks,
    window, chunk, max_splits, min_split_len,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_ob, stride_oh,
    V_HEAD_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, SPLIT_ALIGN: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(SeqLens + b)
    _, _, num_splits = _split_plan(seq_len, window, chunk, max_splits, min_split_len, SPLIT_ALIGN)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < V_HEAD_DIM
    # Kept as [BLOCK_DV] vectors (all lanes equal) so the loop carries one type.
    m = tl.full([BLOCK_DV], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_DV], tl.float32)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for sid in range(0, num_splits):
        lse = tl.load(PartLse + b * stride_plb + h * stride_plh + sid)
        o = tl.load(PartO + b * stride_pob + h * stride_poh + sid * stride_pos + offs_dv, mask=mask_dv, other=0.0)
        m_new = tl.maximum(m, lse)  # finite: every split holds keys
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha + o * w
        l = l * alpha + w
        m = m_new
    if HAS_SINKS:  # the head's sink logit joins the denominator only (it has no value)
        sink = tl.load(Sinks + h).to(tl.float32) * _LOG2E
        m_new = tl.maximum(m, sink)
        alpha = tl.exp2(m - m_new)
        acc = acc * alpha
        l = l * alpha + tl.exp2(sink - m_new)
    out = tl.where(l > 0, acc / tl.where(l > 0, l, 1.0), 0.0)  # seq_len = 0: zeros
    tl.store(Out + b * stride_ob + h * stride_oh + offs_dv, out.to(Out.dtype.element_ty), mask=mask_dv)


# ----------------------------------------------------------------------------- launch
def check_sinks(sinks: torch.Tensor | None, num_q_heads: int, like: torch.Tensor) -> torch.Tensor:
    """The pointer argument for ``Sinks``: ``sinks`` (``[Hq]``, contiguous, on ``like``'s
    device) or, without sinks, any tensor (the kernels do not read it)."""
    if sinks is None:
        return like
    if sinks.shape != (num_q_heads,) or sinks.device != like.device:
        raise InputError(f"sinks must be [{num_q_heads}] on {like.device}; got {tuple(sinks.shape)} on {sinks.device}")
    return sinks.contiguous()


@functools.lru_cache(maxsize=256)
def slopes_tensor(slopes: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """ALiBi slopes as an fp32 ``[Hq]`` tensor on ``device``, made once per (slopes, device)
    (so a CUDA graph never captures its creation: backends ask for it before capturing)."""
    return torch.tensor(slopes, dtype=torch.float32, device=device)


def check_slopes(slopes: torch.Tensor | None, num_q_heads: int, like: torch.Tensor) -> torch.Tensor:
    """The pointer argument for ``Slopes``: ``slopes`` (fp32 ``[Hq]`` on ``like``'s device) or,
    without ALiBi, any tensor (the kernels do not read it)."""
    if slopes is None:
        return like
    if slopes.shape != (num_q_heads,) or slopes.device != like.device or slopes.dtype != torch.float32:
        raise InputError(
            f"alibi_slopes must be float32 [{num_q_heads}] on {like.device}; got {slopes.dtype} "
            f"{tuple(slopes.shape)} on {slopes.device}"
        )
    return slopes.contiguous()


def decode_block_n(head_dim: int, v_head_dim: int, dtype: torch.dtype) -> int:
    """Keys per block of stage 1 (also the split alignment: a split holds whole blocks).

    Blocks of 256 keys for heads of 64 (8 warps, `decode_num_warps`) make a split of up to 256
    keys one block, loaded whole before the PDL wait. Timed interleaved on an H200 against
    splits of 128 keys, the 1B step took 0.967 ms at batch 1 against 0.979-0.984 but 1.160 at
    batch 16 against 1.079-1.082 (a program holds an SM's registers alone); splits of one
    64-key block (`DEFAULT_MIN_SPLIT_LEN`) gained more at batch 1 (0.956) without that loss,
    so the default stays at 64 (``bench_generate.py --decode-block-n`` times others;
    BENCHMARKS.md).
    """
    if interpreting():
        return 16  # small blocks: the CPU tests' short sequences still span several blocks
    # fp32 dots run without tensor cores ("ieee"): small tiles keep compile time and registers down.
    return 32 if max(head_dim, v_head_dim) > 128 or dtype == torch.float32 else 64


def head_dim_blocks(head_dim: int) -> tuple[int, int]:
    """``(BLOCK_D, BLOCK_DT)``: a power of two covering ``head_dim``, or, when ``head_dim`` is
    none, the largest power of two below it plus a tail block (>= 16, ``tl.dot``'s smallest K)
    for the rest; ``BLOCK_DT = 0``: no tail. 576 -> (512, 64), 192 -> (128, 64), 40 -> (32, 16)."""
    full = triton.next_power_of_2(head_dim)
    if full == head_dim or head_dim < 16:
        return max(full, 16), 0
    main = full // 2
    return main, max(16, triton.next_power_of_2(head_dim - main))


def decode_block_h(group: int, head_dim: int, v_head_dim: int, dtype: torch.dtype) -> int:
    """Query heads per stage-1 program: the GQA group padded to a power of two >= 16
    (``tl.dot``'s smallest M), in blocks of at most 64 (MLA's latent form serves all 16-128
    query heads from one KV head); fp32 tiles of head dims above 256 take 16 (register and
    shared-memory bound). Latent form on an H200 (bf16, 128 heads, 576 / 512): blocks of 64 with
    32 keys and 8 warps ran 2.1-2.4x faster than blocks of 16 at batch 16-64."""
    cap = 16 if max(head_dim, v_head_dim) > 256 and dtype == torch.float32 else 64
    return min(max(16, triton.next_power_of_2(group)), cap)


#: fp32 partial values the fused merge keeps in flight at once (`merge_chunk`): 64 registers a
#: thread on 4 warps.
MERGE_CHUNK_VALUES = 8192
#: Most splits the fused merge loads at once. The merge of a 1B decode step's 3 splits (16 x 64
#: tiles, one 1B layer chained on an H100, per-program cycle counters: bench_gemv_chain.py
#: --attention --trace --decode merge_chunk=N): 0.74 us with 4, 1.0 us with 8 or 1. Unrolled 8
#: times, the merge also runs the arithmetic of the splits a short request does not have.
MAX_MERGE_CHUNK = 4


def merge_chunk(block_h: int, block_dv: int) -> int:
    """Splits whose partials the fused merge loads together (a power of two, 1 to
    `MAX_MERGE_CHUNK`): as many ``[BLOCK_H, BLOCK_DV]`` fp32 tiles as `MERGE_CHUNK_VALUES` holds.
    The merging program is the last of its tile to finish, on the launch's critical path: a
    request of up to that many splits merges after one round trip to memory, where one split
    at a time took one each. 16 x 64 (the 1B shape's heads) and 16 x 128 -> 4; 16 x 256 -> 2;
    MLA's latent 64 x 512 -> 1."""
    fit = MERGE_CHUNK_VALUES // max(block_h * block_dv, 1)
    return min(MAX_MERGE_CHUNK, 1 << (max(fit, 1).bit_length() - 1))


def decode_programs(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int,
                    dtype: torch.dtype, max_splits: int) -> int:  # fmt: skip
    """Stage-1 programs of one `decode_attention_fwd` launch (rows of its ``trace``)."""
    group = num_q_heads // num_kv_heads
    return batch * num_kv_heads * triton.cdiv(group, decode_block_h(group, head_dim, v_head_dim, dtype)) * max_splits


def decode_num_warps(head_dim: int, v_head_dim: int, block_n: int = 64) -> int:
    """Warps per stage-1 program: 8 for the latent form's wide tiles and blocks of 256 keys
    (their K and V tiles held in registers across the wait), else 4."""
    return 4 if max(head_dim, v_head_dim) <= 256 and block_n < 256 else 8


def _check_new_kv(k_new, v_new, new_loc, k_buffer, v_buffer, bsz: int) -> None:
    """Refuse new K/V rows the kernel cannot store (see `decode_attention_fwd`)."""
    if k_new is None or v_new is None or new_loc is None:
        raise ValueError("k_new, v_new and new_loc go together")
    hkv, d, dv = k_buffer.shape[1], k_buffer.shape[2], v_buffer.shape[2]
    if tuple(k_new.shape) != (bsz, hkv, d) or tuple(v_new.shape) != (bsz, hkv, dv) or tuple(new_loc.shape) != (bsz,):
        raise ValueError(
            f"k_new {tuple(k_new.shape)}, v_new {tuple(v_new.shape)}, new_loc {tuple(new_loc.shape)} must be "
            f"[{bsz}, {hkv}, {d}], [{bsz}, {hkv}, {dv}], [{bsz}]"
        )
    if k_buffer.untyped_storage().data_ptr() == v_buffer.untyped_storage().data_ptr():
        raise ValueError("k_new/v_new need separate K and V buffers (a pool with the values in its keys is written by KVPool.write)")
    check_last_dim_contiguous("k_new", k_new)
    check_last_dim_contiguous("v_new", v_new)


def l2_next_pieces(l2_next: tuple[torch.Tensor, int] | None, like: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(tensor, pieces)``: the `weight_prefetch.BULK_BYTES` pieces of ``l2_next`` (``(tensor,
    nbytes)``) that stage 1 asks L2 for; ``(like, 0)`` for none: no ``l2_next``, one on another
    device than ``like``, or fewer bytes than a piece."""
    if l2_next is None or l2_next[0].device != like.device:
        return like, 0
    pieces = weight_prefetch.prefetchable_bytes(*l2_next) // weight_prefetch.BULK_BYTES
    return (l2_next[0], pieces) if pieces else (like, 0)


def l2_lanes(pieces: int, programs: int, num_warps: int) -> int:
    """Prefetch lanes per stage-1 program for ``pieces`` pieces over ``programs`` programs: 0 for
    none, else one per thread (each issues at most one piece per lane, `bulk_prefetch_l2`) times
    the power of two that covers them all."""
    if pieces <= 0:
        return 0
    threads = 32 * num_warps
    return threads * triton.next_power_of_2(triton.cdiv(pieces, threads * programs))


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,
    req_to_page: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    *,
    page_size: int,
    scale: float,
    max_splits: int,
    min_split_len: int = DEFAULT_MIN_SPLIT_LEN,
    logit_cap: float = 0.0,
    window_left: int = -1,
    sinks: torch.Tensor | None = None,
    chunk_size: int = 0,
    alibi_slopes: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    new_loc: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
    trace: torch.Tensor | None = None,
    l2_next: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """Decode attention of one new token per request over its paged keys ``0..seq_len-1``.

    Parameters
    ----------
    q: ``[B, Hq, D]``, the new tokens' queries.
    k_buffer: ``[num_slots, Hkv, D]``, the layer's pool flattened over pages
        (``KVPool.k_buffers[layer].view(-1, Hkv, D)``). v_buffer: ``[num_slots, Hkv, Dv]``.
    out: ``[B, Hq, Dv]``, written (dtype of its own).
    req_to_page: ``[max_requests, max_pages_per_req]`` int32 page table.
    req_pool_indices: ``[B]`` int32 row of each request. seq_lens: ``[B]`` int32 KV lengths
        after this step (the query sits at ``seq_len - 1``).
    partial_out: ``[B, Hq, >= max_splits, Dv]`` fp32 scratch; partial_lse: ``[B, Hq, >= max_splits]``
        fp32 scratch (base-2 log-sum-exp). Only the slots of used splits are written and read.
    page_size, scale: the pool's page size; the softmax scale.
    max_splits: grid size along the split axis (static per batch size for CUDA graphs).
    min_split_len: shortest split; a request uses ``clamp(cdiv(span, min_split_len), 1, max_splits)``.
    logit_cap: ``cap * tanh(s / cap)`` on the scaled scores when > 0.
    window_left: keys ``j >= seq_len - 1 - window_left`` only, when >= 0.
    sinks: ``[Hq]`` attention-sink logits (GPT-OSS), in the units of the scaled scores: each
        joins its head's softmax denominator as a key without a value. None: no sinks.
    chunk_size: chunked local attention (Llama 4): keys ``j >= (seq_len - 1) - (seq_len - 1) %
        chunk_size`` only, when > 0.
    alibi_slopes: fp32 ``[Hq]`` ALiBi slopes: ``slope * (j - (seq_len - 1))`` is added to the
        scaled (and capped) score of key ``j``. None: no bias.
    k_new, v_new, new_loc: the new tokens' ``[B, Hkv, D]`` keys and ``[B, Hkv, Dv]`` values
        (unit stride in the last dimension; rows may be strided views of a fused projection) and
        their ``[B]`` integer pool slots (``ForwardBatch.out_cache_loc``). Given, the kernel
        stores them at ``new_loc`` (converted to the pool's dtype, as ``KVPool.write`` does) and
        uses them for key ``seq_len - 1``; None: the new K/V must already be in the pool.
        Needs separate K and V buffers (not a pool with the values in its keys).
    counters: int32 scratch of at least ``B * Hkv * cdiv(group, BLOCK_H)`` elements (``B * Hq``
        always suffices), all zero; the launch leaves them zero again, so one zero-initialised
        buffer serves every launch and CUDA-graph replay. Given, the splits are merged in the
        same launch by the last program to finish of each (request, KV head, head block), which
        reads the tile's ``splits x group x Dv`` partials alone: small for GQA groups, a serial
        tail for MLA's latent tiles of 64 heads x 512 values (the backend keeps stage 2 there).
        None: a second kernel merges them.
    rope_cos, rope_sin: ``[B, D]`` rows of HF's rotary embedding (q's dtype, unit stride in D;
        `attngraph.rope`): q and ``k_new`` are given before the rotation and the kernel applies
        it (the pool stores the rotated key). Needs ``k_new`` and a power-of-two head dim.
    trace: int64 ``[programs, kernel_clock.RECORD]`` (``programs = B * Hkv * head blocks *
        max_splits``, `decode_programs`): stage 1 records timestamps of each program into it
        (`attngraph.kernel_clock`; entry, past the PDL wait, split attended, counted, merged,
        done). NVIDIA GPUs only; the values computed do not change.
    l2_next: ``(tensor, nbytes)``: once the kernel before has finished (past the PDL wait), the
        programs ask L2 for the first ``nbytes`` bytes of memory from ``tensor``'s start (within
        its storage, `weight_prefetch.prefetchable_bytes`) with bulk prefetches, so the weight
        of the projection after attention streams while attention leaves the memory idle. A
        hint: no value changes. Issued only where the launch uses programmatic dependent launch
        (`attngraph.pdl`: compute capability 9.0 or later, where the bulk prefetch exists).

    Returns ``out``. Launches: one with ``counters``, else two; the new K/V cost no launch of
    their own.
    """
    bsz, hq, d = q.shape
    chunk = chunk_arg(chunk_size)
    slopes = check_slopes(alibi_slopes, hq, q)
    hkv, dv = k_buffer.shape[1], v_buffer.shape[2]
    if hq % hkv:
        raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv}")
    if partial_out.shape[2] < max_splits or partial_lse.shape[2] < max_splits:
        raise ValueError(f"partial buffers hold {partial_out.shape[2]} splits, need {max_splits}")
    if 1 != q.stride(-1) or 1 != k_buffer.stride(-1) or 1 != v_buffer.stride(-1) or 1 != out.stride(-1) \
            or 1 != partial_out.stride(-1) or 1 != partial_lse.stride(-1):  # fmt: skip
        for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("out", out),
                        ("partial_out", partial_out), ("partial_lse", partial_lse)):  # fmt: skip
            check_last_dim_contiguous(name, t)
    new_kv = k_new is not None or v_new is not None or new_loc is not None
    if new_kv:
        _check_new_kv(k_new, v_new, new_loc, k_buffer, v_buffer, bsz)
    else:  # the kernel does not read them: any tensors
        k_new, v_new, new_loc = q, q, seq_lens
    rope = rope_cos is not None or rope_sin is not None
    if rope:
        if not new_kv or d & (d - 1) or rope_cos is None or rope_sin is None:
            raise ValueError("rope_cos and rope_sin need each other, k_new and a power-of-two head dim")
        for name, t in (("rope_cos", rope_cos), ("rope_sin", rope_sin)):
            if tuple(t.shape) != (bsz, d) or t.dtype != q.dtype or t.device != q.device or (d > 1 and t.stride(1) != 1):
                raise ValueError(f"{name} must be a {q.dtype} [{bsz}, {d}] tensor on {q.device}, unit stride in D; got "
                                 f"{t.dtype} {tuple(t.shape)}")  # fmt: skip
    else:  # the kernel does not read them
        rope_cos = rope_sin = q[:, 0]
    if bsz == 0:
        return out
    group = hq // hkv
    block_n = decode_block_n(d, dv, q.dtype)
    block_dv = triton.next_power_of_2(dv)
    block_d, block_dt = head_dim_blocks(d)
    block_h = decode_block_h(group, d, dv, q.dtype)
    head_blocks = triton.cdiv(group, block_h)
    if counters is not None and (
        counters.dtype != torch.int32 or not counters.is_contiguous() or counters.numel() < bsz * hkv * head_blocks
    ):
        raise ValueError(f"counters must be a contiguous int32 tensor of >= {bsz * hkv * head_blocks} elements")
    upcast, precision = dot_options(q.dtype)
    window = window_arg(window_left)
    cap = float(logit_cap) if logit_cap > 0 else 1.0
    sinks_arg = check_sinks(sinks, hq, q)
    use_pdl = pdl.enabled(q.device)
    if trace is not None:
        programs = bsz * hkv * head_blocks * max_splits
        if trace.dtype != torch.int64 or not trace.is_contiguous() or trace.dim() != 2 or trace.shape[0] < programs \
                or trace.shape[1] != kernel_clock.RECORD or trace.device != q.device or interpreting():  # fmt: skip
            raise InputError(f"trace must be a contiguous int64 [>= {programs}, {kernel_clock.RECORD}] tensor on "
                             f"{q.device} (a GPU: the interpreter has no timers); got {trace.dtype} {tuple(trace.shape)}")  # fmt: skip
    l2_tensor, l2_pieces = l2_next_pieces(l2_next, q) if use_pdl else (q, 0)
    _decode_stage1_kernel[(bsz, hkv * head_blocks, max_splits)](
        q, k_buffer, v_buffer, req_to_page, req_pool_indices, seq_lens, partial_out, partial_lse, slopes,
        k_new, v_new, new_loc, out, sinks_arg, seq_lens if counters is None else counters, rope_cos, rope_sin,
        seq_lens if trace is None else trace, l2_tensor, float(scale), cap, window, chunk, max_splits, min_split_len,
        l2_pieces,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_page.stride(0),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), out.stride(0), out.stride(1),
        rope_cos.stride(0), rope_sin.stride(0),
        GROUP=group, PAGE_SIZE=page_size, HEAD_DIM=d, V_HEAD_DIM=dv,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
        HAS_CAP=logit_cap > 0, UPCAST=upcast, PRECISION=precision, HAS_ALIBI=alibi_slopes is not None,
        HEAD_BLOCKS=head_blocks, BLOCK_DT=max(block_dt, 16), HAS_TAIL=block_dt > 0,
        NEW_KV=new_kv, MERGE=counters is not None, HAS_SINKS=sinks is not None, USE_PDL=use_pdl,
        PREFETCH=use_pdl and new_kv, ROPE=rope, SOFT_BF16=q.dtype == torch.bfloat16 and interpreting(),
        MERGE_CHUNK=merge_chunk(block_h, block_dv), TRACE=trace is not None,
        L2_LANES=l2_lanes(l2_pieces, bsz * hkv * head_blocks * max_splits, decode_num_warps(d, dv, block_n)),
        L2_PIECE=weight_prefetch.BULK_BYTES,
        num_warps=decode_num_warps(d, dv, block_n), num_stages=2, **pdl.launch_options(use_pdl),
    )  # fmt: skip
    if counters is not None:
        return out
    _decode_stage2_kernel[(bsz, hq)](
        partial_out, partial_lse, out, seq_lens, sinks_arg,
        window, chunk, max_splits, min_split_len,
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1), out.stride(0), out.stride(1),
        V_HEAD_DIM=dv, BLOCK_DV=block_dv, SPLIT_ALIGN=block_n, HAS_SINKS=sinks is not None,
        num_warps=4 if block_dv <= 128 else 8,
    )  # fmt: skip
    return out
