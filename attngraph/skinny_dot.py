"""3-16 token rows times a weight matrix on tensor cores (Triton): the decode GEMM of small batches.

At 3-16 rows the product is still one read of the weight, but the CUDA-core GEMV of
`attngraph.skinny_linear` is bound by its multiply-adds there, and cuBLAS adds split-K reduce
launches around the long-K projections. This kernel swaps the operands so the weight fills the
tall side of the tensor-core tile:

* ``y^T [BLOCK_N, 16] += W[BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, 16]``: grid
  ``(cdiv(N, BLOCK_N), SPLIT_K)``, a program owns ``BLOCK_N`` weight rows and one K range; the
  ``M <= 16`` rows of ``x`` are padded to the tile's 16 by masked loads, never in memory;
* ``SPLIT_K > 1``: partials in fp32, the column block's last program (an ``acq_rel`` counter,
  shared with `skinny_linear`) sums them in split order (deterministic) in the same launch;
* ``SILU_MUL``: ``x = silu(a) * b`` (fp32, rounded once to the inputs' dtype) formed as each
  chunk is loaded (correct, but slower than the product's own launch plus the plain kernel:
  the ops do not use it);
* ``NORM`` (``RESIDUAL``): HF's RMSNorm of ``x`` (``+ residual``) formed as each chunk is
  loaded, after every program has read all of ``x`` for the rows' statistics: no launch of its
  own (`skinny_dot_rms_norm_linear`; the ops use it where `linear_ops.DOT_FOLD_NORM` is set);
  with ``SS_PARTS`` the statistics are read as partial sums of squares instead (a producer's
  column blocks could write them). Correct, but the norm in the loads is what costs: on an
  H100 at 16 rows the 1B q/k/v took 16.3 us with the sums given, 18.8 with every program's
  pass over x, 8.8 for the norm's own launch followed by the plain kernel (gate/up: 29.6,
  33.7, 26.4; ``benchmarks/bench_skinny_gemm.py --dot --dot-default --norm``), so no op
  uses it. Those timings read the norm weight as a ``[BLOCK_K]`` vector, 2 bytes per thread,
  which the pipeliner cannot prefetch (`cp.async` moves 4-16 bytes): every chunk waited for
  it. It is now read as a ``[16, BLOCK_K]`` tile in x's layout, prefetched with the weight,
  and the pass for the statistics is pipelined 3 deep (sm_90 PTX: no load left in either loop
  that is waited for); not yet timed;
* ``ROPE``: a fused q/k/v projection's first columns leave rotated by HF's rotate-half RoPE
  (`passes.fold_rope_linear`), with `skinny_linear`'s column layout and epilogue;
* ``GATED``: a gated MLP's fused gate/up projection ``W = [W_gate; W_up]`` (``[2I, K]``) leaves
  as ``silu(x W_gate^T) * (x W_up^T)`` (``[M, I]``): a program owns the gate rows of its column
  block and the up rows ``I`` further, two products per chunk, and forms the activation in its
  epilogue from both products rounded to the dtype (what the product followed by
  `skinny_linear.silu_mul` computes): no SiLU-mul launch, half the output written
  (`skinny_dot_gated_linear`, tile `GATED_CONFIG`; the op `linear_ops.add_rms_norm_gated_mlp`);
* launched with programmatic dependent launch where `attngraph.pdl` allows it: a program loads
  its first weight tile, then waits for the kernel before (whose output ``x`` is).

`TUNED` holds the configurations measured fastest on an H200 (``benchmarks/bench_skinny_gemm.py
--dot``); other shapes take `default_config`'s.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import triton
import triton.language as tl

from . import pdl, weight_prefetch
from .attn_backends.triton_ops.decode_attention import interpreting
from .errors import InputError
from .pdl import gdc_launch_dependents, gdc_wait
from .skinny_linear import (
    _output,
    _residual_chunk,
    _rms_norm_scaled,
    _rms_rstd,
    _rope_columns,
    _rope_rows,
    check_norm_operands,
    check_rope_columns,
    refuse_overlap,
    split_plan,
)
from .triton_math import round_to as _round
from .weight_prefetch import prefetch_rows_l2

__all__ = ["GATED_CONFIG", "MAX_ROWS", "MIN_BLOCK_N", "TUNED", "default_config", "rope_fits", "skinny_dot_gated_linear", "skinny_dot_linear",
           "skinny_dot_rms_norm_linear", "skinny_dot_silu_mul_linear"]

#: Rows of ``x`` one launch takes (the tensor-core tile's narrow side).
MAX_ROWS = 16
#: Most partial sums of squares `skinny_dot_rms_norm_linear` adds (an unrolled loop per program).
MAX_SUM_SQUARE_PARTS = 128
#: ``(N, K) -> config``, the fastest at 4 and 16 rows on an H200 (bf16, a CUDA graph of calls
#: on distinct weight copies; `benchmarks/bench_skinny_gemm.py --dot`):
TUNED: dict[tuple[int, int], dict[str, int]] = {
    (3072, 2048): dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=6),  # 1B q/k/v
    (2048, 2048): dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=4),  # 1B o
    (2048, 8192): dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=4),  # 1B down
    (16384, 2048): dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=3),  # 1B gate/up
    (6144, 4096): dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=4),  # 8B q/k/v
    (4096, 4096): dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=3),  # 8B o
    (4096, 14336): dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=3),  # 8B down
    (28672, 4096): dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=4),  # 8B gate/up
}
_CONFIG_KEYS = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")
#: The gated gate/up's tile (`skinny_dot_gated_linear`): 128 rows of the fused weight per
#: program, 64 from each half (a wgmma tile each; at 32 per half the products take mma.sync),
#: K unsplit. Measured fastest of seven tiles at 4 and 16 rows for the 1B and 8B gate/up on an
#: H100 (`benchmarks/bench_skinny_gemm.py --dot --projections gate_up`): 1B 24.9 against 26.1 us
#: with the plain tile halved, 8B 83.5 against 94.7 (a model's 8B gate/up, above
#: `linear_ops.DOT_MAX_WEIGHT`, stays cuBLAS's product).
GATED_CONFIG: dict[str, int] = dict(BLOCK_N=128, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=3)


@triton.jit
def _weight_chunk(w_rows, offs_k, mask_n, K, EVEN_K: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_K]`` weight tile at ``offs_k``: masked along K only where K is no
    multiple of BLOCK_K (a mask along the rows alone keeps the 16-byte loads)."""
    if EVEN_K:
        mask = mask_n[:, None]
    else:
        mask = mask_n[:, None] & (offs_k < K)[None, :]
    # read once per launch: do not let the weight push x (and the next kernels' data) out of L2
    return tl.load(w_rows + offs_k[None, :], mask=mask, other=0.0, eviction_policy="evict_first")


@triton.jit
def _operand_chunk(x_rows, x2_rows, nw_ptr, rstd, offs_k, mask_m, K, EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr,
                   NORM: tl.constexpr, RESIDUAL: tl.constexpr, UPCAST: tl.constexpr, SOFT_BF16: tl.constexpr):  # fmt: skip
    """The ``[16, BLOCK_K]`` chunk of the GEMM's input (rows past M zero) in its dtype (fp32
    with ``UPCAST``): ``x``; ``silu(x) * x2`` (``SILU_MUL``); or HF's RMSNorm of ``x`` (+ the
    residual ``x2``) given the rows' ``rstd`` (``NORM``, ``RESIDUAL``), each rounded as the
    GEMV rounds it."""
    if EVEN_K:
        mask_x = mask_m[:, None]
    else:
        mask_x = mask_m[:, None] & (offs_k < K)[None, :]
    DTYPE = x_rows.dtype.element_ty
    if NORM:
        h = _residual_chunk(x_rows, x2_rows, offs_k, mask_x, RESIDUAL, DTYPE, SOFT_BF16)  # [16, BLOCK_K] fp32
        # the norm weight read as a [16, BLOCK_K] tile (every row the same [BLOCK_K]): the
        # layout of x's chunk, whose 16-byte loads the pipeliner prefetches with the weight's;
        # a [BLOCK_K] vector of 2 bytes per thread is loaded in the loop and waited for
        nw_offs = tl.zeros([16, 1], dtype=tl.int32) + offs_k[None, :]  # [16, BLOCK_K]
        nw = tl.load(nw_ptr + nw_offs, mask=nw_offs < K, other=0.0).to(tl.float32)
        x = _rms_norm_scaled(h, nw, rstd, DTYPE, SOFT_BF16).to(DTYPE)  # on DTYPE's grid already
    else:
        x = tl.load(x_rows + offs_k[None, :], mask=mask_x, other=0.0)
        if SILU_MUL:
            g = x.to(tl.float32)
            u = tl.load(x2_rows + offs_k[None, :], mask=mask_x, other=0.0).to(tl.float32)
            x = _round(g / (1.0 + tl.exp(-g)) * u, x.dtype, SOFT_BF16)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _store(Y, y_ptrs, y_mask, acc, Cos, Sin, rows, mask_m, offs_n, mask_n, dims, in_rope, stride_ym, stride_cm, stride_sm,
           BLOCK_N: tl.constexpr, ROPE: tl.constexpr, SOFT_BF16: tl.constexpr):  # fmt: skip
    """Store the fp32 ``y^T`` tile ``acc: [BLOCK_N, 16]`` rounded to Y's dtype; with ``ROPE``
    rotated first by `skinny_linear._output` on its ``[16, BLOCK_N]`` transpose (the cos / sin
    rows read here: after any PDL wait)."""
    if ROPE:
        c, s = _rope_rows(Cos, Sin, rows, mask_m, dims, in_rope, stride_cm, stride_sm)  # [16, BLOCK_N]
        y = _output(tl.trans(acc), c, s, in_rope, Y.dtype.element_ty, 16, BLOCK_N, ROPE, SOFT_BF16)
        tl.store(Y + rows[:, None] * stride_ym + offs_n[None, :], y, mask=mask_m[:, None] & mask_n[None, :])
    else:
        tl.store(y_ptrs, _round(acc, Y.dtype.element_ty, SOFT_BF16), mask=y_mask)


@triton.jit
def _rstd_of_parts(SS, stride_ssp, rows, mask_m, K, eps, SS_PARTS: tl.constexpr):
    """``rsqrt(mean(h^2) + eps)`` per row ``[16]`` from ``SS_PARTS`` partial sums of ``h^2``
    (fp32 ``SS: [SS_PARTS, >= M]``, rows ``stride_ssp`` apart), summed in their order: the
    rows' statistics without reading ``h`` (`_rms_rstd`'s formula)."""
    ss = tl.zeros([16], dtype=tl.float32)
    for p in tl.static_range(SS_PARTS):
        ss += tl.load(SS + p * stride_ssp + rows, mask=mask_m, other=0.0)
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def _skinny_dot_kernel(
    X, X2, W, Bias, Y, Part, Counters, NW, H, Cos, Sin, SS,
    M, N, K, k_per_split, eps, rope_cols,
    stride_xm, stride_x2m, stride_wn, stride_ym, stride_hm, stride_cm, stride_sm, stride_ssp,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, SOFT_BF16: tl.constexpr, USE_PDL: tl.constexpr,
    PREFETCH: tl.constexpr, LINE: tl.constexpr, ROPE: tl.constexpr, ROPE_D: tl.constexpr, GATED: tl.constexpr,
    SS_PARTS: tl.constexpr,
):  # fmt: skip
    """``Y[:M] = h @ W^T (+ Bias)``, ``h = X``, ``silu(X) * X2`` or, with ``NORM``, ``NW *
    rmsnorm(X)`` (HF's RMSNorm, ``eps``) or, with ``RESIDUAL`` too, of ``X + X2``, whose rows
    program (0, 0) also stores in H (``[M, K]`` rows ``stride_hm`` apart; every program reads
    all of X for the rows' statistics). X, X2: ``[M, K]`` rows
    ``stride_xm`` / ``stride_x2m`` apart (M <= 16); NW: ``[K]``; W: ``[N, K]``, rows ``stride_wn`` apart;
    Y: ``[M, N]`` rows ``stride_ym`` apart. Part: ``[SPLIT_K, N, 16]`` fp32; Counters:
    ``[>= cdiv(N, BLOCK_N)]`` int32 zeros (both read with ``SPLIT_K > 1`` only). A program's K
    range is ``k_per_split`` long, a multiple of ``BLOCK_K``, so only K's end can cut a chunk
    (``EVEN_K``: K is a multiple of BLOCK_K too, no chunk is cut). ``PREFETCH`` (with
    ``USE_PDL``): the rest of the program's weight range is asked into L2 before the wait
    (`attngraph.weight_prefetch`, ``LINE`` elements per line). ``ROPE``: columns ``[0,
    rope_cols)`` leave rotated, as in `skinny_linear`'s kernel (its column layout and epilogue,
    on the transposed tile). ``GATED`` (``SPLIT_K == 1``, no bias, rotation or prefetch): W is
    ``[2N, K]``, gate rows then up rows, and ``Y[:M] = silu(g) * u`` with ``g``, ``u`` the
    products of the two halves, each rounded to the dtype first. ``SS_PARTS > 0`` (with
    ``NORM``, without ``RESIDUAL``): the rows' statistics are the sum of ``SS_PARTS`` partial
    sums of ``X``'s squares (`_rstd_of_parts`), read instead of all of ``X``."""
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns = weight rows
    rows = tl.arange(0, 16)  # [16] rows of x, the first M real
    mask_m = rows < M
    in_rope = pid_n * BLOCK_N < rope_cols  # rope_cols = 0 without ROPE
    dims = offs_n  # placeholder without ROPE (never read)
    if ROPE:  # a head's rotate-half partners in one program
        offs_n, dims = _rope_columns(pid_n * BLOCK_N, offs_n, in_rope, BLOCK_N, ROPE_D)
    mask_n = offs_n < N
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    wu_rows = w_rows + N * stride_wn  # [BLOCK_N, 1]: the up rows of these columns (read with GATED only)
    x_rows = X + rows.to(tl.int64)[:, None] * stride_xm  # [16, 1]
    x2_rows = X2 + rows.to(tl.int64)[:, None] * stride_x2m  # [16, 1] (read with SILU_MUL or RESIDUAL only)
    h_rows = H + rows.to(tl.int64)[:, None] * stride_hm  # [16, 1] (written with RESIDUAL only)
    DTYPE = X.dtype.element_ty
    h_count = tl.where((pid_n == 0) & (tl.program_id(1) == 0), M, 0)  # rows of H this program stores
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)  # y^T (GATED: the gate product's)
    acc_u = tl.zeros([BLOCK_N, 16], dtype=tl.float32)  # GATED: the up product's
    rstd = tl.zeros([16], dtype=tl.float32)  # read with NORM only
    k_first = k_lo
    if USE_PDL:
        # The weight is no earlier kernel's output: its first tile loads while the kernel
        # before finishes; x only after gdc_wait (see attngraph.pdl).
        offs_k = k_lo + tl.arange(0, BLOCK_K)
        w = _weight_chunk(w_rows, offs_k, mask_n, K, EVEN_K)
        wu = w  # the up rows' tile, loaded with GATED only
        if GATED:
            wu = _weight_chunk(wu_rows, offs_k, mask_n, K, EVEN_K)
        if PREFETCH:
            prefetch_rows_l2(W, offs_n, N, stride_wn, k_lo + BLOCK_K, k_hi, BLOCK_N, BLOCK_K, LINE)
        gdc_wait()
        gdc_launch_dependents()
        if NORM and SS_PARTS > 0:  # the statistics from partial sums: no pass over x
            rstd = _rstd_of_parts(SS, stride_ssp, rows, mask_m, K, eps, SS_PARTS)
        elif NORM:  # the rows' statistics need all of x: every program reads it (from L2)
            rstd = _rms_rstd(x_rows, x2_rows, h_rows, K, eps, mask_m, h_count, 16, BLOCK_K, RESIDUAL, DTYPE, SOFT_BF16, 3)
        x = _operand_chunk(x_rows, x2_rows, NW, rstd, offs_k, mask_m, K, EVEN_K, SILU_MUL, NORM, RESIDUAL, UPCAST, SOFT_BF16)
        acc = tl.dot(w.to(x.dtype), tl.trans(x), acc, input_precision=PRECISION)
        if GATED:
            acc_u = tl.dot(wu.to(x.dtype), tl.trans(x), acc_u, input_precision=PRECISION)
        k_first = k_lo + BLOCK_K
    elif NORM and SS_PARTS > 0:
        rstd = _rstd_of_parts(SS, stride_ssp, rows, mask_m, K, eps, SS_PARTS)
    elif NORM:
        rstd = _rms_rstd(x_rows, x2_rows, h_rows, K, eps, mask_m, h_count, 16, BLOCK_K, RESIDUAL, DTYPE, SOFT_BF16, 3)
    for k0 in range(k_first, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        w = _weight_chunk(w_rows, offs_k, mask_n, K, EVEN_K)
        x = _operand_chunk(x_rows, x2_rows, NW, rstd, offs_k, mask_m, K, EVEN_K, SILU_MUL, NORM, RESIDUAL, UPCAST, SOFT_BF16)
        acc = tl.dot(w.to(x.dtype), tl.trans(x), acc, input_precision=PRECISION)  # [BLOCK_N, 16]
        if GATED:
            wu = _weight_chunk(wu_rows, offs_k, mask_n, K, EVEN_K)
            acc_u = tl.dot(wu.to(x.dtype), tl.trans(x), acc_u, input_precision=PRECISION)
    y_ptrs = Y + rows[None, :] * stride_ym + offs_n[:, None]  # [BLOCK_N, 16]
    y_mask = mask_n[:, None] & mask_m[None, :]
    if GATED:  # both products rounded as the fused product's output would be, then silu(g) * u
        g = _round(acc, DTYPE, SOFT_BF16).to(tl.float32)
        u = _round(acc_u, DTYPE, SOFT_BF16).to(tl.float32)
        acc = g / (1.0 + tl.exp(-g)) * u  # rounded once by the store
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        _store(Y, y_ptrs, y_mask, acc, Cos, Sin, rows, mask_m, offs_n, mask_n, dims, in_rope, stride_ym, stride_cm,
               stride_sm, BLOCK_N, ROPE, SOFT_BF16)  # fmt: skip
    else:
        # This split's partials, then the column block's last program to count sums them (the
        # ordering argument of skinny_linear's split-K).
        part_cols = Part + offs_n.to(tl.int64)[:, None] * 16 + rows[None, :]  # split 0's [BLOCK_N, 16]
        tl.store(part_cols + tl.program_id(1) * N * 16, acc, mask=mask_n[:, None])
        tl.debug_barrier()
        arrived = tl.atomic_add(Counters + pid_n, 1, sem="acq_rel")
        tl.debug_barrier()
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # split order: the same sum whichever came last
                total += tl.load(part_cols + s * N * 16, mask=mask_n[:, None], other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
            _store(Y, y_ptrs, y_mask, total, Cos, Sin, rows, mask_m, offs_n, mask_n, dims, in_rope, stride_ym, stride_cm,
                   stride_sm, BLOCK_N, ROPE, SOFT_BF16)  # fmt: skip
            tl.store(Counters + pid_n, 0)  # every split has counted: ready for the next launch


def default_config(n: int, k: int) -> dict[str, int]:
    """Launch configuration for ``[n, k]`` weights: a `TUNED` entry, else 64 x 128 tiles, four
    warps, four stages, and K split in 2-4 while the column blocks are fewer than about one
    per SM (as long as each split keeps at least four chunks)."""
    tuned = TUNED.get((int(n), int(k)))
    if tuned is not None:
        return dict(tuned)
    blocks, split = triton.cdiv(n, 64), 1
    while split < 4 and blocks * split < 96 and k >= 2 * split * 4 * 128:
        split *= 2
    return dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=split, num_warps=4, num_stages=4)


def _check_config(config: dict) -> dict[str, int]:
    if set(config) != set(_CONFIG_KEYS):
        raise InputError(f"config needs exactly the keys {_CONFIG_KEYS}; got {sorted(config)}")
    cfg = {key: int(config[key]) for key in _CONFIG_KEYS}
    for key in ("BLOCK_N", "BLOCK_K", "num_warps"):
        if cfg[key] < 1 or cfg[key] & (cfg[key] - 1):
            raise InputError(f"config[{key!r}] must be a power of two >= 1, got {cfg[key]}")
    if cfg["BLOCK_N"] < 16 or cfg["BLOCK_K"] < 16 or cfg["SPLIT_K"] < 1 or cfg["num_stages"] < 1:
        raise InputError(f"config: BLOCK_N and BLOCK_K must be >= 16 (tensor-core tiles), SPLIT_K and num_stages >= 1; got {cfg}")
    return cfg


def _check_operands(what: str, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None,
                    n_out: int | None = None) -> torch.Tensor:  # fmt: skip
    """Refuse operands the kernel does not take; returns ``out`` or a new ``[M, n_out]`` one
    (``n_out``: the weight's rows when None)."""
    if x.device.type != "cuda" and not interpreting():
        raise InputError(f"{what}: x is on {x.device}; the kernel needs a CUDA device, or Triton's CPU interpreter "
                         "(TRITON_INTERPRET=1 set before importing attngraph) for CPU tensors")  # fmt: skip
    if x.dim() != 2 or x.shape[0] > MAX_ROWS:
        raise InputError(f"{what}: x must be [M, K] with M <= {MAX_ROWS}; got {tuple(x.shape)} (use F.linear)")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise InputError(f"{what}: x must be bfloat16 or float16 (tensor cores); got {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise InputError(f"{what}: x must be contiguous in its last dimension; got strides {tuple(x.stride())}")
    m, k = x.shape
    if weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous():
        raise InputError(f"{what}: weight must be a contiguous [N, {k}] tensor; got {tuple(weight.shape)} "
                         f"with strides {tuple(weight.stride())}")  # fmt: skip
    if weight.dtype != x.dtype or weight.device != x.device:
        raise InputError(f"{what}: weight is {weight.dtype} on {weight.device}, x {x.dtype} on {x.device}; they must match")
    n = weight.shape[0] if n_out is None else n_out
    if out is None:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (m, n) or out.dtype != x.dtype or out.device != x.device or (m and n > 1 and out.stride(1) != 1):
        raise InputError(f"{what}: out must be a {x.dtype} [{m}, {n}] tensor on {x.device}, contiguous in its last "
                         f"dimension; got {out.dtype} {tuple(out.shape)} with strides {tuple(out.stride())}")  # fmt: skip
    return out


#: The narrowest column block of the tensor-core tile: a rotation needs whole pairs of a head in
#: one block, so heads whose dim has a power-of-two factor below it rotate outside the kernel.
MIN_BLOCK_N = 16


def rope_fits(head_dim: int) -> bool:
    """Whether the kernel rotates heads of ``head_dim`` in its epilogue (a column block of at
    least `MIN_BLOCK_N` dividing the head)."""
    return head_dim >= 2 and head_dim % 2 == 0 and (head_dim & -head_dim) >= MIN_BLOCK_N


def _launch(x, x2, weight, bias, out, config, silu_mul: bool, norm_weight=None, eps: float = 0.0, h_out=None,
            rope=None, gated: bool = False, sum_squares=None) -> torch.Tensor:  # fmt: skip
    """Launch the kernel for validated operands (``x``, ``x2``: ``[M, K]``; ``out``: ``[M, N]``;
    with ``norm_weight`` ``[K]`` the RMSNorm prologue, of ``x + x2`` into ``h_out`` when ``x2``
    is given; with ``rope`` = `rope.check_rope_columns`'s result the rotation of the
    first columns; ``gated``: ``weight`` is ``[2N, K]``, gate rows then up rows, and ``out``
    receives ``silu(gate) * up``; ``sum_squares``: ``[P, M]`` fp32 partial sums of ``x``'s
    squares, the norm's statistics)."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    norm = norm_weight is not None
    residual = norm and x2 is not None
    if residual and m and (n == 0 or k == 0):  # no launch: the residual stream still
        h_out.copy_((x.float() + x2.float()).to(x.dtype))
    if m == 0 or n == 0:
        return out
    if k == 0:  # an empty sum: the bias alone (gated: silu(0) * 0)
        return out.copy_(bias.expand(m, n)) if bias is not None else out.zero_()
    if config is not None:
        cfg = _check_config(config)
    else:
        cfg = dict(GATED_CONFIG) if gated else default_config(weight.shape[0], k)
    block_n, block_k = cfg["BLOCK_N"], cfg["BLOCK_K"]
    if gated:  # a program reads the tuned tile's weight rows, half gate and half up, in one K range
        block_n, cfg["SPLIT_K"] = max(block_n // 2, MIN_BLOCK_N), 1
    rope_cos, rope_sin, rope_cols = rope if rope is not None else (x, x, 0)  # tensors read with ROPE only
    rope_d = rope_cos.shape[1] if rope is not None else 2
    if rope is not None:  # a column block holds whole pairs of one head
        if not rope_fits(rope_d):
            raise InputError(f"the tensor-core kernel rotates heads whose dim has a power-of-two factor >= {MIN_BLOCK_N}; "
                             f"got {rope_d} (rotate after the product: attngraph.rope.rope_columns_)")  # fmt: skip
        block_n = min(block_n, rope_d & -rope_d)
    blocks = triton.cdiv(n, block_n)
    split_k, k_per_split, counters = split_plan(k, cfg["SPLIT_K"], block_k, blocks, x.device)
    part = counters = out if counters is None else counters  # part and counters: read with split-K only
    if split_k > 1:
        part = torch.empty((split_k, n, 16), dtype=torch.float32, device=x.device)
    x2 = x2 if x2 is not None else x  # read with SILU_MUL or RESIDUAL only
    h_out = h_out if h_out is not None else x  # written with RESIDUAL only
    norm_weight = norm_weight if norm else x  # read with NORM only
    ss_parts = 0 if sum_squares is None else sum_squares.shape[0]
    sum_squares = sum_squares if sum_squares is not None else part  # read with SS_PARTS > 0 only
    upcast = x.dtype == torch.bfloat16 and interpreting()  # the interpreter's bf16 tl.dot (decode_attention.dot_options)
    use_pdl = pdl.enabled(x.device)
    prefetch = use_pdl and weight_prefetch.enabled(x.device) and not gated
    guard = torch.cuda.device(x.device) if x.is_cuda and x.device.index != torch.cuda.current_device() else nullcontext()
    with guard:
        _skinny_dot_kernel[(blocks, split_k)](
            x, x2, weight, bias if bias is not None else weight, out, part, counters, norm_weight, h_out, rope_cos, rope_sin,
            sum_squares, m, n, k, k_per_split, float(eps), rope_cols,
            x.stride(0), x2.stride(0), weight.stride(0), out.stride(0), h_out.stride(0), rope_cos.stride(0),
            rope_sin.stride(0), sum_squares.stride(0) if ss_parts else 0,
            BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, EVEN_K=k % block_k == 0,
            HAS_BIAS=bias is not None, SILU_MUL=silu_mul, NORM=norm, RESIDUAL=residual, UPCAST=upcast, PRECISION="ieee" if upcast else "tf32",
            SOFT_BF16=upcast, USE_PDL=use_pdl, PREFETCH=prefetch, LINE=min(weight_prefetch.line_elements(weight), block_k),
            ROPE=rope is not None, ROPE_D=rope_d, GATED=gated, SS_PARTS=ss_parts,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl.launch_options(use_pdl),
        )  # fmt: skip
    return out


def skinny_dot_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                      out: torch.Tensor | None = None, config: dict | None = None, rope_cos: torch.Tensor | None = None,
                      rope_sin: torch.Tensor | None = None, rope_cols: int = 0) -> torch.Tensor:  # fmt: skip
    """``F.linear(x, weight, bias)`` on tensor cores for ``x: [M, K]`` (``M <= 16``; rows any
    stride apart, unit stride along K; bf16 or fp16), ``weight: [N, K]`` contiguous, ``bias:
    [N]`` or None -> ``[M, N]``, accumulated in fp32 and rounded once. ``out``: an ``[M, N]``
    tensor to write (unit stride along N), None: a new one; ``config``: overrides
    `default_config` (benchmark sweeps). ``rope_cos``, ``rope_sin``, ``rope_cols``: the first
    columns rotated in the epilogue, as `skinny_linear.skinny_linear` (heads whose dim
    `rope_fits`)."""
    what = "skinny_dot_linear"
    out = _check_operands(what, x, weight, out)
    n = weight.shape[0]
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype != x.dtype or bias.device != x.device
                             or (n > 1 and bias.stride(0) != 1)):  # fmt: skip
        raise InputError(f"{what}: bias must be a contiguous {x.dtype} [{n}] on {x.device}; got {bias.dtype} {tuple(bias.shape)}")
    rope = check_rope_columns(what, x, n, rope_cos, rope_sin, rope_cols)
    refuse_overlap(what, {"out": out}, {"x": x})
    return _launch(x, None, weight, bias, out, config, silu_mul=False, rope=rope)


def skinny_dot_silu_mul_linear(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, *,
                               out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:  # fmt: skip
    """``F.linear(silu(a) * b, weight)`` on tensor cores (the MLP's down projection over its
    gate and up halves): ``a, b: [M, I]`` (``M <= 16``, rows any stride apart, unit stride
    along I), ``weight: [N, I]`` -> ``[M, N]``. ``silu(a) * b`` is computed in fp32 and rounded
    once to the inputs' dtype, as `attngraph.linear_ops.silu_mul`. ``out``, ``config``: as for
    `skinny_dot_linear`."""
    what = "skinny_dot_silu_mul_linear"
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        raise InputError(f"{what}: a and b must have one shape, dtype and device; got {a.dtype} {tuple(a.shape)} "
                         f"on {a.device} and {b.dtype} {tuple(b.shape)} on {b.device}")  # fmt: skip
    out = _check_operands(what, a, weight, out)
    if b.dim() == 2 and b.shape[1] > 1 and b.stride(1) != 1:
        raise InputError(f"{what}: b must be contiguous in its last dimension; got strides {tuple(b.stride())}")
    refuse_overlap(what, {"out": out}, {"a": a, "b": b})
    return _launch(a, b, weight, None, out, config, silu_mul=True)


def skinny_dot_gated_linear(x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None,
                            config: dict | None = None) -> torch.Tensor:  # fmt: skip
    """A gated MLP's activation from its fused gate/up weight on tensor cores, in one launch:
    ``silu(x @ W[:I]^T) * (x @ W[I:]^T)`` for ``x: [M, K]`` (``M <= 16``; rows any stride
    apart, unit stride along K; bf16 or fp16) and ``weight: [2I, K]`` contiguous -> ``[M, I]``.
    Each product is accumulated in fp32 and rounded to the dtype, then ``silu(g) * u`` is
    computed in fp32 and rounded once: the bits of `skinny_dot_linear` followed by
    `attngraph.skinny_linear.silu_mul` on its halves. ``out``: an ``[M, I]`` tensor to write
    (unit stride along I), None: a new one; ``config``: the tile of the fused weight (a program
    takes half its ``BLOCK_N`` rows from each half, K unsplit; `GATED_CONFIG` when None)."""
    what = "skinny_dot_gated_linear"
    if weight.dim() != 2 or weight.shape[0] % 2:
        raise InputError(f"{what}: weight must be [2I, K], the gate rows then the up rows; got {tuple(weight.shape)}")
    out = _check_operands(what, x, weight, out, n_out=weight.shape[0] // 2)
    refuse_overlap(what, {"out": out}, {"x": x})
    return _launch(x, None, weight, None, out, config, silu_mul=False, gated=True)


def skinny_dot_rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    h_out: torch.Tensor | None = None,
    config: dict | None = None,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
    rope_cols: int = 0,
    sum_squares: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(rms_norm(h), weight, bias)`` on tensor cores with HF's RMSNorm folded into the
    operand's loads (no launch of its own): ``h = x`` or, with ``residual``, ``h = x +
    residual`` (rounded to x's dtype, written to ``h_out``: the residual stream the model reads
    next); ``rms_norm(h) = norm_weight * (h * rsqrt(mean(h^2) + eps)).to(dtype)`` in fp32 with
    HF's two roundings, as `attngraph.skinny_linear.skinny_rms_norm_linear`.

    ``x``, ``residual``: ``[M, K]`` (``M <= 16``; unit stride along K; bf16 or fp16);
    ``norm_weight``: ``[K]`` contiguous; ``weight``: ``[N, K]`` contiguous; ``bias``: ``[N]`` or
    None -> ``[M, N]``. ``h_out``: ``[M, K]`` (a new one when None and ``residual`` is given).
    ``out``, ``config``, ``rope_cos``, ``rope_sin``, ``rope_cols``: as for `skinny_dot_linear`.
    Every program reads all of ``h`` for the rows' statistics (from L2: ``M * K`` elements per
    program), unless ``sum_squares`` gives them: ``[P, M]`` fp32 (``P >= 1``, unit stride along
    M), partial sums of ``x``'s squares over disjoint column ranges (``sum_p sum_squares[p, m]
    = sum_k x[m, k]^2``), added in ``p`` order; only without ``residual``. Its values are
    trusted: the sums a producer wrote for exactly this ``x``.
    """
    what = "skinny_dot_rms_norm_linear"
    out = _check_operands(what, x, weight, out)
    h_out = check_norm_operands(what, x, residual, h_out, norm_weight, bias, weight.shape[0])
    if sum_squares is not None:
        m = x.shape[0]
        if residual is not None:
            raise InputError(f"{what}: sum_squares gives the statistics of x itself; add the residual first "
                             "(or pass residual without sum_squares)")  # fmt: skip
        if (sum_squares.dim() != 2 or not 1 <= sum_squares.shape[0] <= MAX_SUM_SQUARE_PARTS or sum_squares.shape[1] != m
                or sum_squares.dtype != torch.float32 or sum_squares.device != x.device
                or (m > 1 and sum_squares.stride(1) != 1)):  # fmt: skip
            raise InputError(f"{what}: sum_squares must be a float32 [P, {m}] tensor (1 <= P <= {MAX_SUM_SQUARE_PARTS}) on {x.device}, unit stride "
                             f"along the rows; got {sum_squares.dtype} {tuple(sum_squares.shape)} on {sum_squares.device}")  # fmt: skip
    rope = check_rope_columns(what, x, weight.shape[0], rope_cos, rope_sin, rope_cols)
    refuse_overlap(what, {"out": out, "h_out": h_out}, {"x": x, "residual": residual})
    return _launch(x, residual, weight, bias, out, config, silu_mul=False, norm_weight=norm_weight, eps=eps, h_out=h_out,
                   rope=rope, sum_squares=sum_squares)  # fmt: skip
