"""Paged decode attention with split KV (Triton): one new query token per request.

Two kernels:

* stage 1, grid ``(batch, num_kv_heads * head_blocks, max_splits)``: a program takes a block of
  the query heads of one KV head's GQA group (`decode_block_h`: the group padded to a power of
  two, at least 16 for ``tl.dot``, in blocks of at most 64) and one split of the request's
  keys, gathers K/V through the page table and runs an online softmax in fp32. It writes the
  split's normalised output and its log-sum-exp (base 2) to the partial buffers.
* stage 2, grid ``(batch, num_q_heads)``: merges the splits of each request and head.

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

from ...errors import InputError

logger = logging.getLogger(__name__)

#: Stands for "no window": large enough to admit every key, small enough not to overflow int32.
NO_WINDOW = 1 << 30
#: Default shortest split (keys); shorter requests run in one split.
DEFAULT_MIN_SPLIT_LEN = 128

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
def _decode_stage1_kernel(
    Q, K, V, ReqToPage, ReqIdx, SeqLens, PartO, PartLse, Slopes,
    scale, logit_cap, window, chunk, max_splits, min_split_len,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_rtp,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, V_HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_CAP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr, BLOCK_DT: tl.constexpr, HAS_TAIL: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1) // HEAD_BLOCKS  # the KV head, and which BLOCK_H of its group's query heads
    hb = tl.program_id(1) % HEAD_BLOCKS
    sid = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    kv_lo, split_len, num_splits = _split_plan(seq_len, window, chunk, max_splits, min_split_len, BLOCK_N)
    if sid >= num_splits:
        return
    start = kv_lo + sid * split_len
    end = tl.minimum(start + split_len, seq_len)
    row = tl.load(ReqIdx + b).to(tl.int64)

    offs_g = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_g < GROUP
    heads = kvh * GROUP + offs_g  # [BLOCK_H] query heads of this KV head
    # Head dims [0, BLOCK_D) and, when HEAD_DIM is no power of two, the tail [BLOCK_D, HEAD_DIM)
    # in a second block (MLA's latent 512 + RoPE 64; 128 + 64): no padding to the next power.
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_dt = BLOCK_D + tl.arange(0, BLOCK_DT)
    mask_dt = offs_dt < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < V_HEAD_DIM
    q_ptrs = Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if HAS_TAIL:
        qt_ptrs = Q + b * stride_qb + heads[:, None] * stride_qh + offs_dt[None, :]
        q_tail = tl.load(qt_ptrs, mask=mask_h[:, None] & mask_dt[None, :], other=0.0)  # [BLOCK_H, BLOCK_DT]
    if HAS_ALIBI:  # [BLOCK_H] slopes of the group's query heads
        slope = tl.load(Slopes + heads, mask=mask_h, other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        mask_n = pos < end
        page = tl.load(ReqToPage + row * stride_rtp + pos // PAGE_SIZE, mask=mask_n, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE  # [BLOCK_N] rows of the flat pool
        k_ptrs = K + slot[None, :] * stride_ks + kvh * stride_kh + offs_d[:, None]
        kt = tl.load(k_ptrs, mask=mask_d[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
        s = _dot(q, kt.to(q.dtype), UPCAST, PRECISION)  # [BLOCK_H, BLOCK_N]
        if HAS_TAIL:
            kt_ptrs = K + slot[None, :] * stride_ks + kvh * stride_kh + offs_dt[:, None]
            kt_tail = tl.load(kt_ptrs, mask=mask_dt[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_DT, BLOCK_N]
            s += _dot(q_tail, kt_tail.to(q.dtype), UPCAST, PRECISION)
        s = s * scale
        if HAS_CAP:
            s = _softcap(s, logit_cap)
        if HAS_ALIBI:  # slope * (key position - query position); the query sits at seq_len - 1
            s = s + slope[:, None] * (pos - (seq_len - 1)).to(tl.float32)[None, :]
        s = tl.where(mask_n[None, :], s * _LOG2E, float("-inf"))
        # Every block holds >= 1 valid key (n0 < end), so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = V + slot[:, None] * stride_vs + kvh * stride_vh + offs_dv[None, :]
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_dv[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype), UPCAST, PRECISION)
        m_i = m_new

    po_ptrs = PartO + b * stride_pob + heads[:, None] * stride_poh + sid * stride_pos + offs_dv[None, :]
    tl.store(po_ptrs, acc / l_i[:, None], mask=mask_h[:, None] & mask_dv[None, :])
    pl_ptrs = PartLse + b * stride_plb + heads * stride_plh + sid
    tl.store(pl_ptrs, m_i + tl.log2(l_i), mask=mask_h)


@triton.jit
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
    """Keys per block of stage 1 (also the split alignment)."""
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


def decode_num_warps(head_dim: int, v_head_dim: int) -> int:
    """Warps per stage-1 program: 8 for the latent form's wide tiles, else 4."""
    return 4 if max(head_dim, v_head_dim) <= 256 else 8


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
) -> torch.Tensor:
    """Decode attention of one new token per request over its paged keys ``0..seq_len-1``.

    Parameters
    ----------
    q: ``[B, Hq, D]``, the new tokens' queries (the new K/V must already be in the pool).
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

    Returns ``out``.
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
    if bsz == 0:
        return out
    group = hq // hkv
    block_n = decode_block_n(d, dv, q.dtype)
    block_dv = triton.next_power_of_2(dv)
    block_d, block_dt = head_dim_blocks(d)
    block_h = decode_block_h(group, d, dv, q.dtype)
    head_blocks = triton.cdiv(group, block_h)
    upcast, precision = dot_options(q.dtype)
    window = window_arg(window_left)
    cap = float(logit_cap) if logit_cap > 0 else 1.0
    _decode_stage1_kernel[(bsz, hkv * head_blocks, max_splits)](
        q, k_buffer, v_buffer, req_to_page, req_pool_indices, seq_lens, partial_out, partial_lse, slopes,
        float(scale), cap, window, chunk, max_splits, min_split_len,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_page.stride(0),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        GROUP=group, PAGE_SIZE=page_size, HEAD_DIM=d, V_HEAD_DIM=dv,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
        HAS_CAP=logit_cap > 0, UPCAST=upcast, PRECISION=precision, HAS_ALIBI=alibi_slopes is not None,
        HEAD_BLOCKS=head_blocks, BLOCK_DT=max(block_dt, 16), HAS_TAIL=block_dt > 0, num_warps=decode_num_warps(d, dv),
        num_stages=2,
    )  # fmt: skip
    _decode_stage2_kernel[(bsz, hq)](
        partial_out, partial_lse, out, seq_lens, check_sinks(sinks, hq, q),
        window, chunk, max_splits, min_split_len,
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1), out.stride(0), out.stride(1),
        V_HEAD_DIM=dv, BLOCK_DV=block_dv, SPLIT_ALIGN=block_n, HAS_SINKS=sinks is not None,
        num_warps=4 if block_dv <= 128 else 8,
    )  # fmt: skip
    return out
