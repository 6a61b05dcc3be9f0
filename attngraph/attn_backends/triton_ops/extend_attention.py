"""Extend (prefill) attention (Triton): ragged new tokens over paged or dense keys.

One kernel, grid ``(num_q_heads, cdiv(max_extend_len, BLOCK_M), batch)`` (or, for a fixed
token count, ``(num_q_heads, num_tokens // BLOCK_M + batch)`` with each program finding its
request by binary search: `extend_attention_fwd`'s ``static_num_tokens``). A program takes
``BLOCK_M`` new tokens of one request and one query head and runs ONE online softmax over the
request's keys ``0..seq_len-1``. In the paged form the new tokens' K/V must already be in the
pool (the backend appends them first), so the kernel reads the cached prefix and the new
tokens alike from the pool through the page table: no separate ragged pass and no merge.
Query ``i`` of request ``b`` sits at position ``seq_len_b - extend_len_b + i`` (its prefix
length plus ``i``).

Masking mirrors ``torch_native.allowed_keys``: causal ``p - window_left <= j <= p``;
non-causal ``|j - p| <= window_left`` (every key without a window). Key blocks that every query
of the program sees in full are processed without masks; only the edges (diagonal, window
start, sequence end) pay for them.

The dense form (``PAGED=False``, `dense_attention_fwd`) reads contiguous ``[B * Sk, Hkv, D]``
keys instead: request ``b``'s keys are rows ``b * Sk .. b * Sk + Sk - 1`` and queries are
aligned bottom-right (``seq_len = Sk``, ``extend_len = Sq``).
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from .decode_attention import (
    _dot,
    _softcap,
    check_last_dim_contiguous,
    check_sinks,
    check_slopes,
    chunk_arg,
    dot_options,
    head_dim_blocks,
    interpreting,
    window_arg,
)

logger = logging.getLogger(__name__)

_LOG2E = tl.constexpr(1.4426950408889634)  # globals read by @jit code must be constexpr


@triton.jit
def _attend(
    q, m_i, l_i, acc, K, V, ReqToPage, row, kv_base, kvh, q_pos, q_lo, start, end,
    scale, logit_cap, window, slope, stride_ks, stride_kh, stride_vs, stride_vh, stride_rtp,
    offs_d, mask_d, offs_dv, mask_dv, q_tail, offs_dt, mask_dt,
    MASKED: tl.constexpr, PAGED: tl.constexpr, CAUSAL: tl.constexpr, HAS_CAP: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_TAIL: tl.constexpr,
):  # fmt: skip
    """Online-softmax update of ``(m_i, l_i, acc)`` (``[BLOCK_M]``, ``[BLOCK_M]``,
    ``[BLOCK_M, BLOCK_DV]``) with the keys ``[start, end)``.

    ``MASKED=False`` is for key ranges every query of the block may fully see (``end - start`` a
    multiple of ``BLOCK_N``): no bounds, causal or window masks there. ``q_lo``: ``[BLOCK_M]``
    the first key each query may see (its window's or its chunk's start). ``slope``: the
    head's ALiBi slope in log2 units (read when ``HAS_ALIBI``). ``HAS_TAIL``: the head dims
    ``offs_dt`` past ``BLOCK_D`` (``q_tail``: the queries' part there) join the scores.
    """
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        if MASKED:
            mask_n = pos < end
        else:
            mask_n = pos >= 0  # all true
        if PAGED:
            page = tl.load(ReqToPage + row * stride_rtp + pos // PAGE_SIZE, mask=mask_n, other=0)
            slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
        else:
            slot = kv_base + pos
        kt = tl.load(K + slot[None, :] * stride_ks + kvh * stride_kh + offs_d[:, None],
                     mask=mask_d[:, None] & mask_n[None, :], other=0.0)  # fmt: skip  # [BLOCK_D, BLOCK_N]
        s = _dot(q, kt.to(q.dtype), UPCAST, PRECISION)  # [BLOCK_M, BLOCK_N]
        if HAS_TAIL:
            kt_tail = tl.load(K + slot[None, :] * stride_ks + kvh * stride_kh + offs_dt[:, None],
                              mask=mask_dt[:, None] & mask_n[None, :], other=0.0)  # fmt: skip  # [BLOCK_DT, BLOCK_N]
            s += _dot(q_tail, kt_tail.to(q.dtype), UPCAST, PRECISION)
        if HAS_CAP:
            s = _softcap(s * scale, logit_cap) * _LOG2E
        else:
            s = s * (scale * _LOG2E)
        if HAS_ALIBI:  # slope * (key position - query position)
            s = s + slope * (pos[None, :] - q_pos[:, None]).to(tl.float32)
        if MASKED:
            ok = mask_n[None, :] & (pos[None, :] >= q_lo[:, None])
            if CAUSAL:
                ok = ok & (pos[None, :] <= q_pos[:, None])
            else:
                ok = ok & (pos[None, :] <= q_pos[:, None] + window)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may have seen no key yet: keep exp2 away from (-inf) - (-inf).
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slot[:, None] * stride_vs + kvh * stride_vh + offs_dv[None, :],
                    mask=mask_n[:, None] & mask_dv[None, :], other=0.0)  # fmt: skip  # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype), UPCAST, PRECISION)
        m_i = m_new
    return m_i, l_i, acc


# The request count, the binary search's length and the dense lengths change with the step and
# the captured size; not specializing them keeps one compiled variant per block shape (each
# variant costs a fresh process a second or more of Triton compile during the captures).
@triton.jit(do_not_specialize=["dense_q_len", "dense_kv_len", "last_slot", "packed_steps"])
def _extend_kernel(
    Q, K, V, Out, ReqToPage, ReqIdx, SeqLens, QoIndptr, Sinks, Slopes,
    scale, logit_cap, window, chunk, dense_q_len, dense_kv_len, last_slot, packed_steps,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_rtp,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, V_HEAD_DIM: tl.constexpr,
    PAGED: tl.constexpr, CAUSAL: tl.constexpr, HAS_CAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, PACKED: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_ALIBI: tl.constexpr, BLOCK_DT: tl.constexpr, HAS_TAIL: tl.constexpr,
):  # fmt: skip
    # Grid axis 0 is the query head (the heads of one KV head run side by side and share its
    # K/V in L2); axis 1 runs the query blocks last first: under a causal mask the last blocks
    # see the most keys, and starting them first keeps the tail of the launch short.
    h = tl.program_id(0)
    if PACKED:
        # Grid (Hq, total // BLOCK_M + B): request b's query blocks are programs
        # qo_indptr[b] // BLOCK_M + b onward (room for cdiv(ext_len, BLOCK_M) of them); the
        # request of a program is found by binary search over the B starts (packed_steps =
        # ceil(log2(B)) halvings).
        t = tl.num_programs(1) - 1 - tl.program_id(1)
        lo = t * 0
        hi = lo + last_slot
        for _ in range(packed_steps):
            mid = (lo + hi + 1) // 2
            start = tl.load(QoIndptr + mid) // BLOCK_M + mid
            lo = tl.where(start <= t, mid, lo)
            hi = tl.where(start <= t, hi, mid - 1)
        b = lo
        mblk = t - (tl.load(QoIndptr + b) // BLOCK_M + b)
    else:  # grid (Hq, cdiv(max_extend_len, BLOCK_M), B)
        mblk = tl.num_programs(1) - 1 - tl.program_id(1)
        b = tl.program_id(2)
    kvh = h // GROUP
    if PAGED:
        q_start = tl.load(QoIndptr + b)
        ext_len = tl.load(QoIndptr + b + 1) - q_start
        seq_len = tl.load(SeqLens + b)
        row = tl.load(ReqIdx + b).to(tl.int64)
        kv_base = row * 0  # unused
    else:
        q_start = b * dense_q_len
        ext_len = dense_q_len
        seq_len = dense_kv_len
        kv_base = b.to(tl.int64) * dense_kv_len
        row = kv_base * 0  # unused
    m0 = mblk * BLOCK_M
    if m0 >= ext_len:
        return
    prefix = seq_len - ext_len

    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < ext_len
    q_pos = prefix + offs_m  # [BLOCK_M] absolute positions of the queries
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < V_HEAD_DIM
    tok = (q_start + offs_m).to(tl.int64)  # [BLOCK_M] rows of q / out
    q = tl.load(Q + tok[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # fmt: skip  # [BLOCK_M, BLOCK_D]
    # MLA's latent form: head dims [BLOCK_D, HEAD_DIM) (the RoPE part) in a tail block
    offs_dt = BLOCK_D + tl.arange(0, BLOCK_DT)
    mask_dt = offs_dt < HEAD_DIM
    if HAS_TAIL:
        q_tail = tl.load(Q + tok[:, None] * stride_qt + h * stride_qh + offs_dt[None, :],
                         mask=mask_m[:, None] & mask_dt[None, :], other=0.0)  # fmt: skip  # [BLOCK_M, BLOCK_DT]
    else:
        q_tail = q

    # Keys [lo, hi): what any query of the block may see. Inside it, [mid_lo, mid_hi) is what
    # every query of the block sees in full (whole key blocks): that part skips the masks.
    # A query at p sees keys from max(p - window, the start of its chunk): both bounds grow with
    # p, so the block's first query has the lowest and its last query the highest.
    q_lo = tl.maximum(q_pos - window, q_pos // chunk * chunk)  # [BLOCK_M]
    first_pos = prefix + m0
    last_pos = prefix + tl.minimum(m0 + BLOCK_M, ext_len) - 1
    lo = tl.maximum(tl.maximum(first_pos - window, first_pos // chunk * chunk), 0)
    if CAUSAL:
        hi = tl.minimum(last_pos + 1, seq_len)
        full_hi = tl.minimum(first_pos + 1, hi)
    else:
        hi = tl.minimum(last_pos + window + 1, seq_len)
        full_hi = tl.minimum(first_pos + window + 1, hi)
    mid_lo = tl.minimum(tl.maximum(tl.maximum(last_pos - window, last_pos // chunk * chunk), lo), hi)
    mid_hi = mid_lo + tl.maximum(full_hi - mid_lo, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if HAS_ALIBI:
        slope = tl.load(Slopes + h).to(tl.float32) * _LOG2E
    else:
        slope = 0.0
    m_i, l_i, acc = _attend(
        q, m_i, l_i, acc, K, V, ReqToPage, row, kv_base, kvh, q_pos, q_lo, mid_lo, mid_hi,
        scale, logit_cap, window, slope, stride_ks, stride_kh, stride_vs, stride_vh, stride_rtp,
        offs_d, mask_d, offs_dv, mask_dv, q_tail, offs_dt, mask_dt,
        False, PAGED, CAUSAL, HAS_CAP, PAGE_SIZE, BLOCK_N, UPCAST, PRECISION, HAS_ALIBI, HAS_TAIL,
    )  # fmt: skip
    m_i, l_i, acc = _attend(
        q, m_i, l_i, acc, K, V, ReqToPage, row, kv_base, kvh, q_pos, q_lo, lo, mid_lo,
        scale, logit_cap, window, slope, stride_ks, stride_kh, stride_vs, stride_vh, stride_rtp,
        offs_d, mask_d, offs_dv, mask_dv, q_tail, offs_dt, mask_dt,
        True, PAGED, CAUSAL, HAS_CAP, PAGE_SIZE, BLOCK_N, UPCAST, PRECISION, HAS_ALIBI, HAS_TAIL,
    )  # fmt: skip
    m_i, l_i, acc = _attend(
        q, m_i, l_i, acc, K, V, ReqToPage, row, kv_base, kvh, q_pos, q_lo, mid_hi, hi,
        scale, logit_cap, window, slope, stride_ks, stride_kh, stride_vs, stride_vh, stride_rtp,
        offs_d, mask_d, offs_dv, mask_dv, q_tail, offs_dt, mask_dt,
        True, PAGED, CAUSAL, HAS_CAP, PAGE_SIZE, BLOCK_N, UPCAST, PRECISION, HAS_ALIBI, HAS_TAIL,
    )  # fmt: skip

    if HAS_SINKS:  # the head's sink logit joins the denominator only (it has no value)
        sink = tl.load(Sinks + h).to(tl.float32) * _LOG2E
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp2(sink - m_new)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a query that sees no key: zeros
    tl.store(Out + tok[:, None] * stride_ot + h * stride_oh + offs_dv[None, :],
             out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_dv[None, :])  # fmt: skip


@functools.lru_cache(maxsize=None)
def _shared_memory_bytes(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 0)


def extend_blocks(head_dim: int, v_head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for the extend kernel.

    Picked on an H200 (bf16, 32 query / 8 KV heads, 4096 causal tokens, page size 16): about
    240-270 TFLOP/s at head dims 64, 128 and 256.
    """
    if interpreting() or device.type != "cuda":
        return 16, 16, 4, 1  # the CPU tests' short sequences still span several blocks
    dmax = max(head_dim, v_head_dim)
    if triton.next_power_of_2(dmax) > 256:  # MLA's latent form: 576 (512 + a tail of 64) x 512
        # small tiles: 32 x 576 queries + 2 stages of 16 x 576 K and 16 x 512 V (bf16), ~110 KB
        return (16, 16, 4, 1) if dtype == torch.float32 else (32, 16, 8, 2)
    if dtype == torch.float32:  # "ieee" dots without tensor cores, twice the shared memory per tile
        return 32, 32, 4, 2
    if dmax <= 64:
        return 128, 64, 8, 2
    if dmax <= 128:
        return 64, 64, 4, 2
    # 128 x 256 queries + 3 stages of 32 x 256 K and V: ~160 KB of shared memory (Hopper has 227 KB).
    if _shared_memory_bytes(device.index if device.index is not None else torch.cuda.current_device()) >= 200 * 1024:
        return 128, 32, 8, 3
    return 64, 32, 8, 2


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


#: Smallest query block the shrinking below goes to (tensor-core dots want 16+ rows; 32 keeps
#: each program's K/V reads shared by enough queries).
_MIN_BLOCK_M = 32


def _fill_the_gpu(block_m: int, num_warps: int, num_tokens: int, num_heads: int, device: torch.device) -> tuple[int, int]:
    """Halve ``BLOCK_M`` while the step's query blocks (``cdiv(T, BLOCK_M) * Hq``) are fewer
    than the SMs (a 128-token prefill of 32 heads in 128-row blocks runs 32 programs on 132
    SMs), and blocks above 64 rows while they are fewer than two per SM: under a causal mask
    the programs' work differs by up to ``T / BLOCK_M`` times, and smaller blocks even out the
    tail (H200, head dim 64, 1 x 1024 tokens: 26 us per layer in 128-row blocks, 23.5 in 64).
    Long steps keep the blocks picked for throughput."""
    if interpreting() or device.type != "cuda" or block_m <= _MIN_BLOCK_M:
        return block_m, num_warps
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())

    def blocks(bm: int) -> int:
        return -(-num_tokens // bm) * num_heads

    while block_m > _MIN_BLOCK_M and (blocks(block_m) < sms or (block_m > 64 and blocks(block_m) < 2 * sms)):
        block_m //= 2
        num_warps = min(num_warps, 4)
    return block_m, num_warps


def _launch(q, k, v, out, req_to_page, req_pool_indices, seq_lens, qo_indptr, grid_m, bsz,
            scale, logit_cap, window_left, causal, page_size, paged, dense_q_len, dense_kv_len,
            packed=False, sinks=None, chunk_size=0, alibi_slopes=None):  # fmt: skip
    """Shared launch of `_extend_kernel`; ``grid_m``: longest run of queries of one request
    (``packed``: the total of the new tokens, and the grid packs every request's blocks)."""
    t, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    chunk = chunk_arg(chunk_size, causal)  # a chunk without a causal mask is refused before any work
    if hq % hkv:
        raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv}")
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        check_last_dim_contiguous(name, x)
    if t == 0 or bsz == 0 or grid_m == 0:
        return out
    # Head dims above 256 (MLA's latent + RoPE, 576) as a power of two plus a tail block, not
    # padded to the next power (1024); smaller ones keep the padded block their tiles were tuned with.
    block_d, block_dt = head_dim_blocks(d) if d > 256 else (triton.next_power_of_2(d), 0)
    block_m, block_n, num_warps, num_stages = extend_blocks(d, dv, q.dtype, q.device)
    block_m, num_warps = _fill_the_gpu(block_m, num_warps, t, hq, q.device)
    upcast, precision = dot_options(q.dtype)
    if packed:  # cdiv(ext_b, BLOCK_M) <= qo_indptr[b+1] // BLOCK_M - qo_indptr[b] // BLOCK_M + 1
        grid = (hq, grid_m // block_m + bsz, 1)
        steps = max(1, (bsz - 1).bit_length())  # binary search over bsz request starts
    else:
        grid = (hq, triton.cdiv(grid_m, block_m), bsz)
        steps = 0
    _extend_kernel[grid](
        q, k, v, out, req_to_page, req_pool_indices, seq_lens, qo_indptr, check_sinks(sinks, hq, q),
        check_slopes(alibi_slopes, hq, q),
        float(scale), float(logit_cap) if logit_cap > 0 else 1.0, window_arg(window_left), chunk,
        dense_q_len, dense_kv_len, bsz - 1, steps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), req_to_page.stride(0),
        GROUP=hq // hkv, PAGE_SIZE=page_size, HEAD_DIM=d, V_HEAD_DIM=dv,
        PAGED=paged, CAUSAL=bool(causal), HAS_CAP=logit_cap > 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=triton.next_power_of_2(dv),
        UPCAST=upcast, PRECISION=precision, PACKED=packed, HAS_SINKS=sinks is not None,
        HAS_ALIBI=alibi_slopes is not None, BLOCK_DT=max(block_dt, 16), HAS_TAIL=block_dt > 0,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def extend_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,
    req_to_page: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    max_extend_len: int,
    *,
    page_size: int,
    scale: float,
    causal: bool = True,
    window_left: int = -1,
    logit_cap: float = 0.0,
    static_num_tokens: int | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int = 0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the new tokens of every request over its paged keys ``0..seq_len-1``.

    The new tokens' K/V must already be in the pool: the kernel reads them back from it
    together with the cached prefix.

    Parameters
    ----------
    q: ``[T, Hq, D]``, ragged: request ``b`` owns rows ``qo_indptr[b]:qo_indptr[b+1]``.
    k_buffer: ``[num_slots, Hkv, D]``, the layer's pool flattened over pages.
        v_buffer: ``[num_slots, Hkv, Dv]``.
    out: ``[T, Hq, Dv]``, written.
    req_to_page: ``[max_requests, max_pages_per_req]`` int32. req_pool_indices: ``[B]`` int32.
    seq_lens: ``[B]`` int32, KV lengths after this step. qo_indptr: ``[B + 1]`` int32.
    max_extend_len: host int >= the largest ``qo_indptr[b+1] - qo_indptr[b]`` (sizes the grid).
    page_size, scale, causal, window_left, logit_cap: as in ``AttentionLayer``.
    static_num_tokens: a fixed bound on ``qo_indptr[-1]`` (a captured graph's token count):
        the grid is then ``static_num_tokens // BLOCK_M + B`` programs per head, each finding
        its request by binary search over ``qo_indptr``, whatever the lengths (no program per
        (request, block) pair: empty requests of a graph cost one program, not a column).
    sinks: ``[Hq]`` attention-sink logits in the units of the scaled scores (GPT-OSS): each
        joins its head's softmax denominator as a key without a value. None: no sinks.
    chunk_size: chunked local attention (Llama 4), causal only: a query at position ``p`` sees
        keys ``j >= p - p % chunk_size`` only, when > 0.
    alibi_slopes: fp32 ``[Hq]`` ALiBi slopes: ``slope * (j - p)`` is added to the scaled (and
        capped) score of key ``j`` for the query at position ``p``. None: no bias.

    Returns ``out``.
    """
    if static_num_tokens is not None:
        return _launch(q, k_buffer, v_buffer, out, req_to_page, req_pool_indices, seq_lens, qo_indptr,
                       int(static_num_tokens), int(req_pool_indices.shape[0]), scale, logit_cap, window_left,
                       causal, page_size, True, 0, 0, packed=True, sinks=sinks, chunk_size=chunk_size,
                       alibi_slopes=alibi_slopes)  # fmt: skip
    return _launch(q, k_buffer, v_buffer, out, req_to_page, req_pool_indices, seq_lens, qo_indptr,
                   int(max_extend_len), int(req_pool_indices.shape[0]), scale, logit_cap, window_left,
                   causal, page_size, True, 0, 0, sinks=sinks, chunk_size=chunk_size,
                   alibi_slopes=alibi_slopes)  # fmt: skip


def dense_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    batch_size: int,
    *,
    scale: float,
    causal: bool = True,
    window_left: int = -1,
    logit_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    chunk_size: int = 0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over ``batch_size`` equal-length sequences (the stateless form).

    ``q: [B * Sq, Hq, D]``, ``k: [B * Sk, Hkv, D]``, ``v: [B * Sk, Hkv, Dv]``,
    ``out: [B * Sq, Hq, Dv]`` (written). Causal queries are aligned bottom-right: query ``i``
    sits at key position ``Sk - Sq + i``. Returns ``out``.
    """
    b = int(batch_size)
    if b <= 0:
        return out
    sq, sk = q.shape[0] // b, k.shape[0] // b
    # The paged-only pointer arguments are never read when PAGED=False: any tensor will do.
    return _launch(q, k, v, out, q, q, q, q, sq, b, scale, logit_cap, window_left, causal, 1, False, sq, sk, sinks=sinks,
                   chunk_size=chunk_size, alibi_slopes=alibi_slopes)
