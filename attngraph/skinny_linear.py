"""A few token rows times a weight matrix (Triton): the bandwidth-bound GEMV of decode steps.

A decode step of a small batch multiplies 1-8 rows by each projection. At that size the work is
reading the weight once; cuBLAS reaches 50-80% of the copy bandwidth there and, for a long K
(the MLP's down projection), picks split-K with extra launches. This kernel streams the weight
in one launch and uses each weight tile for every row:

* grid ``(cdiv(N, BLOCK_N), SPLIT_K)``; a program owns ``BLOCK_N`` weight rows (output columns)
  and one K range, loops over it in ``BLOCK_K`` chunks, loads the ``[BLOCK_N, BLOCK_K]`` weight
  tile once (coalesced along K, 16-byte vectors) and the ``[ROWS, BLOCK_K]`` chunk of ``x``;
  with ``num_stages = S > 1`` the loop is software-pipelined (``tl.range(num_stages=S)``):
  the next ``S - 1`` chunks stream into shared memory (``cp.async``) while one is multiplied,
  where a plain loop keeps one chunk per program in flight and waits out the memory latency
  at every step (Triton pipelines only loads that feed ``tl.dot`` unless asked);
* products go into a ``[ROWS, BLOCK_N, BLOCK_K]`` fp32 accumulator, elementwise, so the loop has
  no cross-thread traffic; one reduction over K at the end gives the ``[ROWS, BLOCK_N]`` outputs
  (no tensor cores: ROWS is at most 8);
* ``SPLIT_K > 1``: each program stores its fp32 partials, counts itself on its column block's
  int32 counter (an ``acq_rel`` atomic), and the last to count sums the block's partials in
  split order (deterministic), writes the output and puts the counter back to zero: one launch.

``ROWS`` is ``M`` padded to a power of two (a constexpr: 1, 2, 4 and 8 compile separately).
Launched with programmatic dependent launch where `attngraph.pdl` allows it: a program loads
its first weight chunk, then waits for the kernel before (whose output ``x`` is) to finish. `skinny_silu_mul_linear` fuses the MLP's
``silu(gate) * up`` into the loads of ``x``; `skinny_rms_norm_linear` a residual add and HF's
RMSNorm (each program first reads all of ``x`` for the rows' statistics). Both plain launchers
also rotate a fused q/k/v projection's first columns by HF's rotate-half RoPE in the epilogue
(``rope_cos``, ``rope_sin``, ``rope_cols``; `passes.fold_rope_linear`): a program then owns
``BLOCK_N / 2`` dims of a head and their partners half a head away, so each rotation's pair is
in its registers.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import triton
import triton.language as tl

from . import kernel_clock, pdl, weight_prefetch
from .kernel_clock import now, sm_id, store_record
from .pdl import gdc_launch_dependents, gdc_wait
from .triton_math import round_to as _round
from .weight_prefetch import prefetch_rows_l2
from .attn_backends.triton_ops.decode_attention import interpreter_problem, interpreting
from .errors import InputError
from .rope import check_rope_columns

__all__ = [
    "MAX_ROWS",
    "NUM_SMS",
    "TUNED",
    "TUNED_NORM",
    "TUNED_SILU_MUL",
    "default_config",
    "interpreter_problem",
    "interpreting",
    "rows_padded",
    "skinny_linear",
    "skinny_linear_add_rms_norm",
    "skinny_rms_norm_linear",
    "skinny_silu_mul_linear",
]

#: Most rows of ``x`` one launch takes (the kernel's ``ROWS``: M padded to a power of two).
MAX_ROWS = 8
#: SMs the heuristic plans for (an H200); a CUDA launch's configuration does not depend on the
#: device. Triton's CPU interpreter runs a launch's programs one after another, so its launches
#: (tests) skip the wave rule that fills the SMs: it would only multiply their Python work.
NUM_SMS = 132
#: The heuristic's ``BLOCK_K`` for one row where K is a multiple of it and the weight is no
#: output head: the measured one-row winners below use it at 8 of those 9 shapes (all but the
#: 8B q/k/v), with ``BLOCK_N`` then set by the heuristic's accumulator and wave rules. Two rows'
#: winners were split between 512 and 1024, output heads' were 512 and 256: those keep 512.
ONE_ROW_BLOCK_K = 1024
#: Measured winners, ``(rows_padded, N, K) -> config`` (keys of `default_config`'s result),
#: consulted before the heuristic. ``benchmarks/bench_skinny_gemm.py`` prints this literal.
#: ``num_stages`` is 1 throughout (one weight chunk in flight per program, the loop these
#: configurations were timed with): the pipelined loop measured the same in a 1B decode step
#: and in `bench_gemv_chain.py`'s chain of projections on an H100, and was not timed on the
#: H200 or at the 8B shape (BENCHMARKS.md).
TUNED: dict[tuple[int, int, int], dict[str, int]] = {
    # H200, bf16, `bench_skinny_gemm.py --quick --rows 1,2,8 --shapes 1b,8b`: the Llama-3.2-1B
    # projections the ops give the kernel (weights of at most 2**24 elements, 1-2 rows)
    (1, 2048, 2048): dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=1, SPLIT_K=1),
    (1, 2048, 8192): dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=1, SPLIT_K=1),
    (1, 3072, 2048): dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=1, SPLIT_K=1),
    (1, 4096, 4096): dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=1, SPLIT_K=1),
    (2, 2048, 2048): dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=1, SPLIT_K=1),
    (2, 2048, 8192): dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=1, SPLIT_K=1),
    (2, 3072, 2048): dict(BLOCK_N=4, BLOCK_K=512, num_warps=2, num_stages=1, SPLIT_K=1),
    (2, 4096, 4096): dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=1, SPLIT_K=1),
    # one row (a captured batch of one computes its real row only): Llama-3.1-8B's q/k/v and
    # the LM heads of both, `bench_skinny_gemm.py --quick --rows 1,2,8 --shapes 1b,8b`
    (1, 6144, 4096): dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=1, SPLIT_K=1),
    (1, 128256, 2048): dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=1, SPLIT_K=1),
    (1, 128256, 4096): dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=1, SPLIT_K=1),
}
#: The same for `skinny_silu_mul_linear` (``K`` is the intermediate size).
TUNED_SILU_MUL: dict[tuple[int, int, int], dict[str, int]] = {
    (1, 2048, 8192): dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=1, SPLIT_K=1),
    (2, 2048, 8192): dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=1, SPLIT_K=1),
    (1, 4096, 14336): dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=1, SPLIT_K=1),
}

#: The same for `skinny_rms_norm_linear` (every program also reads all of ``x`` for the norm).
TUNED_NORM: dict[tuple[int, int, int], dict[str, int]] = {
    # H200, bf16, `bench_skinny_gemm.py --quick --norm --rows 1,2 --shapes 1b,8b`: where the fold
    # runs and its winner differs from `TUNED`'s (the 1B q/k/v at two rows: 6.88 against 7.54 us)
    (2, 3072, 2048): dict(BLOCK_N=4, BLOCK_K=512, num_warps=4, num_stages=1, SPLIT_K=1),
    # the 1B q/k/v of one row: `TUNED`'s tile with every weight load after the PDL wait, so its
    # loads do not compete with the kernel before (the MLP's down projection). H100, one 1B
    # decode step: 1.163 against 1.170 ms (bench_generate.py --interleave --variant
    # gemv-table=benchmarks/gemv_tables/qkv_after_wait.json), 0.8% of a chain of 1B layers
    (1, 3072, 2048): dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=1, SPLIT_K=1, PRELOAD=0),
    # the 1B gate/up of one row (the residual add and the MLP's norm folded in): the heuristic's
    # 16 x 512 tile (144 registers, 3 programs per SM) tied cuBLAS; 8 x 1024 (124 registers, 4
    # programs per SM, half the K iterations) beat it (sm_90 compile, no spills). H100, a
    # chain of 1B layers: 0.967 of cuBLAS's (`bench_gemv_chain.py --attention --sweep gate_up`);
    # one 1B decode step: 1.091 against 1.139 ms (`bench_generate.py --interleave`)
    (1, 16384, 2048): dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=1, SPLIT_K=1),
}

_CONFIG_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "SPLIT_K")
#: Keys a configuration may add, with their defaults. ``PRELOAD``: under PDL, load the first
#: weight chunk before waiting for the kernel before (1), or wait first and load every chunk
#: after (0): a chunk loaded early overlaps that kernel, and also competes with its loads.
#: ``NORM_STAGES`` (with the norm folded in): the software-pipelining depth of the pass over x
#: for the rows' statistics (1: each chunk's load waited for in turn; K = 2048 at BLOCK_K =
#: 1024 is two chunks). In the chain of 1B batch-1 layers (H100) 2 tied 1 at the q/k/v and
#: lost 6% at the gate/up, so no tuned entry sets it.
_OPTIONAL_KEYS = {"PRELOAD": 1, "NORM_STAGES": 1}
#: The values each optional key takes.
_OPTIONAL_RANGES = {"PRELOAD": (0, 1), "NORM_STAGES": (1, 2, 3, 4)}
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------- kernel
@triton.jit
def _residual_chunk(x_rows, r_rows, offs_k, mask_x, RESIDUAL: tl.constexpr, DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr):
    """The ``[ROWS, BLOCK_K]`` chunk of ``x`` (+ the residual ``r``, the sum rounded to
    ``DTYPE`` as the model's own addition rounds it) in fp32."""
    x = tl.load(x_rows + offs_k[None, :], mask=mask_x, other=0.0).to(tl.float32)  # [ROWS, BLOCK_K]
    if RESIDUAL:
        r = tl.load(r_rows + offs_k[None, :], mask=mask_x, other=0.0).to(tl.float32)
        x = _round(x + r, DTYPE, SOFT_BF16).to(tl.float32)
    return x


@triton.jit
def _rms_norm_chunk(h, nw_ptr, rstd, offs_k, mask_k, DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr):
    """HF's RMSNorm of the fp32 chunk ``h`` ``[ROWS, BLOCK_K]`` given its rows' ``rstd``
    ``[ROWS]``: ``weight * (h * rstd).to(dtype)``, both products rounded to ``DTYPE``."""
    nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)  # [BLOCK_K]
    return _rms_norm_scaled(h, nw[None, :], rstd, DTYPE, SOFT_BF16)


@triton.jit
def _rms_norm_scaled(h, nw, rstd, DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr):
    """`_rms_norm_chunk` given the norm weight ``nw`` already loaded (fp32, broadcastable to
    ``h``'s ``[ROWS, BLOCK_K]``): ``nw * (h * rstd).to(dtype)``, both products rounded."""
    normed = _round(h * rstd[:, None], DTYPE, SOFT_BF16).to(tl.float32)
    return _round(nw * normed, DTYPE, SOFT_BF16).to(tl.float32)


@triton.jit
def _rows_chunk(x_rows, x2_rows, nw_ptr, rstd, offs_k, mask_x, mask_k, SILU_MUL: tl.constexpr, NORM: tl.constexpr,
                RESIDUAL: tl.constexpr, DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr):  # fmt: skip
    """The ``[ROWS, BLOCK_K]`` chunk of the GEMV's input in fp32: ``x``; ``silu(x) * x2``
    rounded to ``DTYPE`` (``SILU_MUL``); or the RMSNorm of ``x`` (+ the residual ``x2``)
    (``NORM``, ``RESIDUAL``)."""
    if SILU_MUL:
        g = tl.load(x_rows + offs_k[None, :], mask=mask_x, other=0.0).to(tl.float32)
        u = tl.load(x2_rows + offs_k[None, :], mask=mask_x, other=0.0).to(tl.float32)
        # rounded once to the inputs' dtype, as an inductor-fused silu(g) * u feeding a GEMM
        h = _round(g / (1.0 + tl.exp(-g)) * u, DTYPE, SOFT_BF16).to(tl.float32)
    else:
        h = _residual_chunk(x_rows, x2_rows, offs_k, mask_x, RESIDUAL, DTYPE, SOFT_BF16)
        if NORM:
            h = _rms_norm_chunk(h, nw_ptr, rstd, offs_k, mask_k, DTYPE, SOFT_BF16)
    return h


@triton.jit
def _rms_rstd(x_rows, x2_rows, h_rows, K, eps, mask_m, h_count, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
              RESIDUAL: tl.constexpr, DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr, STAGES: tl.constexpr = 1):  # fmt: skip
    """``rsqrt(mean(h^2) + eps)`` per row ``[ROWS]`` of ``h = x (+ x2)`` over all ``K``; the
    first ``h_count`` rows of ``h`` (the residual stream) are also stored (M rows by one
    program of the launch, 0 by the others). ``STAGES > 1``: the loop software-pipelined that
    deep (the next chunks' loads in flight while one is summed; a loop of many short chunks
    otherwise waits for each load in turn)."""
    ss = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
    mask_h = tl.arange(0, ROWS) < h_count  # [ROWS]
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_x = mask_m[:, None] & (offs_k < K)[None, :]
        h = _residual_chunk(x_rows, x2_rows, offs_k, mask_x, RESIDUAL, DTYPE, SOFT_BF16)
        if RESIDUAL:
            tl.store(h_rows + offs_k[None, :], h.to(DTYPE), mask=mask_h[:, None] & (offs_k < K)[None, :])
        ss += h * h
    return 1.0 / tl.sqrt(tl.sum(ss, axis=1) / K + eps)


@triton.jit
def _rope_columns(base, offs_n, in_rope, BLOCK_N: tl.constexpr, ROPE_D: tl.constexpr):
    """A rotated column block's ``(columns, dims)`` ``[BLOCK_N]``: the program starting at column
    ``base`` (a multiple of ``BLOCK_N``, which divides ``ROPE_D``) of a head of ``ROPE_D``
    columns takes ``BLOCK_N / 2`` dims of the head's first half and their partners ``ROPE_D / 2``
    further: ``dims`` ``[i0, i0 + BLOCK_N/2)`` then ``[i0 + ROPE_D/2, ...)``, ``i0 =
    (base % ROPE_D) / 2``, so a column's rotate-half partner sits in the same program, half a
    block away. Outside the rotated columns (``in_rope`` false) the block is ``offs_n``."""
    idx = tl.arange(0, BLOCK_N)
    half = BLOCK_N // 2
    dims = (idx // half) * (ROPE_D // 2) + (base % ROPE_D) // 2 + idx % half
    return tl.where(in_rope, base - base % ROPE_D + dims, offs_n), dims


@triton.jit
def _rope_rows(Cos, Sin, rows, mask_m, dims, in_rope, stride_cm, stride_sm):
    """The rows' ``cos`` and ``sin`` at a block's ``dims`` as fp32 ``[ROWS, BLOCK_N]`` (zeros
    outside the rotated columns)."""
    # [ROWS, BLOCK_N], built at full shape from the scalar (Triton's interpreter takes no broadcast mask)
    mask = mask_m[:, None] & ((dims * 0 + in_rope.to(tl.int32)) != 0)[None, :]
    c = tl.load(Cos + rows.to(tl.int64)[:, None] * stride_cm + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(Sin + rows.to(tl.int64)[:, None] * stride_sm + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    return c, s


@triton.jit
def _output(res, c, s, in_rope, DTYPE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
            ROPE: tl.constexpr, SOFT_BF16: tl.constexpr):  # fmt: skip
    """The ``[ROWS, BLOCK_N]`` fp32 sums as stored: rounded to ``DTYPE``; in a rotated block
    (``ROPE`` and ``in_rope``, columns laid out by `_rope_columns`) then rotated by HF's
    ``x * cos + rotate_half(x) * sin`` in fp32 and rounded once more (the projection's output
    as the model would have written it, rotated as `attngraph.rope` rotates it)."""
    y = _round(res, DTYPE, SOFT_BF16)
    if ROPE:
        x = y.to(tl.float32)
        partner = tl.reshape(tl.flip(tl.reshape(x, [ROWS, 2, BLOCK_N // 2]), 1), [ROWS, BLOCK_N])
        sign = tl.where(tl.arange(0, BLOCK_N) < BLOCK_N // 2, -1.0, 1.0)
        y = tl.where(in_rope, _round(x * c + sign[None, :] * partner * s, DTYPE, SOFT_BF16), y)
    return y


@triton.jit
def _add_norm_out(y, r_rows, h_rows, H, Z, NW, Counters, offs_n, mask_m, y_mask, M, N, eps, stride_hm, stride_zm,
                  DTYPE: tl.constexpr, ROWS: tl.constexpr, BLOCK_NO: tl.constexpr, SOFT_BF16: tl.constexpr):  # fmt: skip
    """The epilogue of ``NORM_OUT``: this block's ``h = y + r`` (``[ROWS, BLOCK_N]``, rounded to
    ``DTYPE`` as the model's residual addition rounds it) into H; then the launch's last program
    to count itself (an ``acq_rel`` atomic on ``Counters[0]``) reads the whole rows of ``h``
    back and writes HF's RMSNorm of them, ``NW * (h * rstd).to(DTYPE)``, into Z (``[M, N]``),
    by `attngraph.rms_norm`'s arithmetic (the row in one block of ``BLOCK_NO``), and puts the
    counter back to zero for the next launch."""
    r = tl.load(r_rows + offs_n[None, :], mask=y_mask, other=0.0).to(tl.float32)
    tl.store(h_rows + offs_n[None, :], _round(y.to(tl.float32) + r, DTYPE, SOFT_BF16), mask=y_mask)
    # as split-K's sum: the barrier orders every thread's stores before the atomic's release;
    # its acquire makes the other programs' blocks visible to the last one's threads
    tl.debug_barrier()
    arrived = tl.atomic_add(Counters, 1, sem="acq_rel")
    tl.debug_barrier()
    if arrived == tl.num_programs(0) - 1:
        offs = tl.arange(0, BLOCK_NO)
        mask = offs < N
        nw = tl.load(NW + offs, mask=mask, other=0.0).to(tl.float32)
        for i in tl.static_range(ROWS):
            if i < M:
                h = tl.load(H + i * stride_hm + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
                rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / N + eps)
                normed = _round(h * rstd, DTYPE, SOFT_BF16).to(tl.float32)
                tl.store(Z + i * stride_zm + offs, _round(nw * normed, DTYPE, SOFT_BF16), mask=mask)
        tl.store(Counters, 0)  # every program has counted: ready for the next launch


@triton.jit
def _skinny_linear_kernel(
    X, X2, W, Bias, Y, Part, Counters, NW, H, Cos, Sin, Trace,
    M, N, K, k_per_split, eps, rope_cols,
    stride_xm, stride_x2m, stride_wn, stride_ym, stride_hm, stride_cm, stride_sm,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
    SOFT_BF16: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr,
    ROPE: tl.constexpr, ROPE_D: tl.constexpr, NORM_OUT: tl.constexpr, BLOCK_NO: tl.constexpr,
    STAGES: tl.constexpr, PRELOAD: tl.constexpr, NORM_STAGES: tl.constexpr, TRACE: tl.constexpr,
):  # fmt: skip
    """``Y[:M] = h @ W^T (+ Bias)`` with ``h = X``; with ``SILU_MUL``, ``h = silu(X) * X2``
    (fp32, rounded to X's dtype); with ``NORM``, ``h = NW * rmsnorm(X)`` (HF's RMSNorm, ``eps``)
    or, with ``RESIDUAL`` too, of ``X + X2``, whose rows program (0, 0) also stores in H
    (``[M, K]`` rows ``stride_hm`` apart). X, X2: ``[M, K]`` rows ``stride_xm`` / ``stride_x2m``
    apart; NW: ``[K]``; W: ``[N, K]`` rows ``stride_wn`` apart; Y: ``[M, N]`` rows ``stride_ym`` apart.
    Part: ``[SPLIT_K, ROWS, N]`` fp32 partials; Counters: ``[>= cdiv(N, BLOCK_N)]`` int32 zeros
    (read only when ``SPLIT_K > 1``). A program's K range is ``k_per_split`` long, a multiple
    of ``BLOCK_K``, so no chunk straddles two splits. ``SOFT_BF16``: round to bf16 by integer
    arithmetic (under Triton's interpreter, whose own conversion truncates). ``PREFETCH`` (with
    ``USE_PDL``): the rest of the program's weight range is asked into L2 before the wait
    (`attngraph.weight_prefetch`, ``LINE`` elements per line). ``ROPE``: columns
    ``[0, rope_cols)`` are heads of ``ROPE_D`` that leave rotated by HF's rotate-half RoPE with
    row ``r``'s ``Cos[r]``, ``Sin[r]`` (``[ROPE_D]``, rows ``stride_cm`` / ``stride_sm`` apart).
    ``NORM_OUT`` (``SPLIT_K = 1``, not with ``NORM`` or ``SILU_MUL``): the product ``y`` is not
    stored; H (``[M, N]``) takes ``h = y + X2`` (X2 the ``[M, N]`` residual) and Y takes
    ``NW * rmsnorm(h)`` (NW ``[N]``, ``eps``), in the launch's last program (`_add_norm_out`).
    ``PRELOAD`` (with ``USE_PDL``): the first weight chunk loads before the wait; without it a
    program waits first (the loop then starts at ``k_lo``). ``NORM_STAGES``: the pipelining
    depth of ``NORM``'s pass over the rows for their statistics (`_rms_rstd`). ``TRACE``: each program's
    `attngraph.kernel_clock` record in Trace (points 0 entry, 1 past the wait, 2 its sums
    reduced, 5 done)."""
    pid_n = tl.program_id(0)
    t0 = tl.full([], 0, tl.int64)
    c0 = t0
    t1, c1, t2, c2, t5, c5 = t0, t0, t0, t0, t0, t0
    if TRACE:
        t0, c0 = now(pid_n)
        t1, c1 = t0, c0  # without PDL no wait: "past the wait" is the entry
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns = weight rows
    rows = tl.arange(0, ROWS)  # [ROWS], the first M real
    mask_m = rows < M
    in_rope = pid_n * BLOCK_N < rope_cols  # rope_cols = 0 without ROPE
    dims = offs_n  # placeholder without ROPE (never read)
    if ROPE:  # a head's rotate-half partners in one program
        offs_n, dims = _rope_columns(pid_n * BLOCK_N, offs_n, in_rope, BLOCK_N, ROPE_D)
    mask_n = offs_n < N
    rope_c = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)  # the rows' cos / sin (ROPE only)
    rope_s = rope_c
    if ROPE and not USE_PDL:
        rope_c, rope_s = _rope_rows(Cos, Sin, rows, mask_m, dims, in_rope, stride_cm, stride_sm)
    # int64 row offsets: the LM heads here (128256 x 4096: 5.3e8 elements) stay below 2^31, a
    # larger vocabulary or hidden size (256K x 8192) does not
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    x_rows = X + rows.to(tl.int64)[:, None] * stride_xm  # [ROWS, 1]
    x2_rows = X2 + rows.to(tl.int64)[:, None] * stride_x2m  # [ROWS, 1] (read with SILU_MUL, RESIDUAL, NORM_OUT)
    if SPLIT_K == 1:
        k_lo = 0
        k_hi = K
    else:
        k_lo = tl.program_id(1) * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
    h_rows = H + rows.to(tl.int64)[:, None] * stride_hm  # [ROWS, 1] (written with RESIDUAL or NORM_OUT)
    DTYPE = X.dtype.element_ty
    acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K], dtype=tl.float32)
    rstd = tl.zeros([ROWS], dtype=tl.float32)  # read with NORM only
    k_first = k_lo
    if USE_PDL and not PRELOAD:  # every load after the wait: nothing competes with the kernel before
        gdc_wait()
        gdc_launch_dependents()
        if TRACE:
            t1, c1 = now(pid_n)
        if ROPE:
            rope_c, rope_s = _rope_rows(Cos, Sin, rows, mask_m, dims, in_rope, stride_cm, stride_sm)
    if USE_PDL and PRELOAD:
        # The weight is no earlier kernel's output: its first chunk loads while the kernel
        # before finishes; x only after gdc_wait (see attngraph.pdl).
        offs_k = k_lo + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_hi
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                    eviction_policy="evict_first")  # fmt: skip
        if PREFETCH:
            prefetch_rows_l2(W, offs_n, N, stride_wn, k_lo + BLOCK_K, k_hi, BLOCK_N, BLOCK_K, LINE)
        gdc_wait()
        gdc_launch_dependents()
        if TRACE:
            t1, c1 = now(pid_n)
        if ROPE:  # cos and sin come from a kernel of this step: read after the wait
            rope_c, rope_s = _rope_rows(Cos, Sin, rows, mask_m, dims, in_rope, stride_cm, stride_sm)
        if NORM:  # the row statistics need all of x: every program reads it once (from L2)
            h_count = tl.where((pid_n == 0) & (tl.program_id(1) == 0), M, 0)
            rstd = _rms_rstd(x_rows, x2_rows, h_rows, K, eps, mask_m, h_count, ROWS, BLOCK_K, RESIDUAL, DTYPE, SOFT_BF16,
                             NORM_STAGES)  # fmt: skip
        mask_x = mask_m[:, None] & mask_k[None, :]
        h = _rows_chunk(x_rows, x2_rows, NW, rstd, offs_k, mask_x, mask_k, SILU_MUL, NORM, RESIDUAL, DTYPE, SOFT_BF16)
        acc += h[:, None, :] * w.to(tl.float32)[None, :, :]
        k_first = k_lo + BLOCK_K
    elif NORM:  # after the wait (USE_PDL without PRELOAD) or without PDL
        h_count = tl.where((pid_n == 0) & (tl.program_id(1) == 0), M, 0)
        rstd = _rms_rstd(x_rows, x2_rows, h_rows, K, eps, mask_m, h_count, ROWS, BLOCK_K, RESIDUAL, DTYPE, SOFT_BF16,
                         NORM_STAGES)  # fmt: skip
    # STAGES > 1: Triton's pipeliner streams the next STAGES - 1 chunks of the weight (and of x)
    # into shared memory (cp.async) while this one is multiplied. A plain loop has one chunk in
    # flight per program and waits out the memory latency at every step.
    for k0 in tl.range(k_first, k_hi, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        mask_k = offs_k < K
        # read once per launch: do not let the weight push x (and the next kernels' data) out of L2
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                    eviction_policy="evict_first")  # fmt: skip
        mask_x = mask_m[:, None] & mask_k[None, :]
        h = _rows_chunk(x_rows, x2_rows, NW, rstd, offs_k, mask_x, mask_k, SILU_MUL, NORM, RESIDUAL, DTYPE, SOFT_BF16)
        acc += h[:, None, :] * w.to(tl.float32)[None, :, :]  # [ROWS, BLOCK_N, BLOCK_K]
    res = tl.sum(acc, axis=2)  # [ROWS, BLOCK_N]
    if TRACE:
        t2, c2 = now(tl.sum(tl.sum(res, 1), 0).to(tl.int32, bitcast=True))
    y_ptrs = Y + rows[:, None] * stride_ym + offs_n[None, :]
    y_mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            res += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        y = _output(res, rope_c, rope_s, in_rope, Y.dtype.element_ty, ROWS, BLOCK_N, ROPE, SOFT_BF16)
        if NORM_OUT:
            _add_norm_out(y, x2_rows, h_rows, H, Y, NW, Counters, offs_n, mask_m, y_mask, M, N, eps, stride_hm, stride_ym,
                          DTYPE, ROWS, BLOCK_NO, SOFT_BF16)  # fmt: skip
        else:
            tl.store(y_ptrs, y, mask=y_mask)
    else:
        # This split's partials, then the column block's last program to count sums them.
        part_cols = Part + rows[:, None] * N + offs_n[None, :]  # split 0's [ROWS, BLOCK_N]
        tl.store(part_cols + tl.program_id(1) * ROWS * N, res, mask=y_mask)
        # The barrier orders every thread's partial stores before the atomic, whose release (gpu
        # scope) publishes them; its acquire makes the other programs' partials visible to the
        # summing program, whose threads all read after the second barrier.
        tl.debug_barrier()
        arrived = tl.atomic_add(Counters + pid_n, 1, sem="acq_rel")
        tl.debug_barrier()
        if arrived == SPLIT_K - 1:
            total = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # split order: the same sum whichever came last
                total += tl.load(part_cols + s * ROWS * N, mask=y_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, _output(total, rope_c, rope_s, in_rope, Y.dtype.element_ty, ROWS, BLOCK_N, ROPE, SOFT_BF16),
                     mask=y_mask)  # fmt: skip
            tl.store(Counters + pid_n, 0)  # every split has counted: ready for the next launch
    if TRACE:
        t5, c5 = now(pid_n)
        program = pid_n * tl.num_programs(1) + tl.program_id(1)
        store_record(Trace, program, t0, c0, t1, c1, t2, c2, t0 * 0, t0 * 0, t0 * 0, t0 * 0, t5, c5, sm_id(pid_n))


# ----------------------------------------------------------------------------- configuration
def rows_padded(m: int) -> int:
    """The kernel's ``ROWS`` for ``m`` rows: ``m`` rounded up to a power of two (1, 2, 4, 8)."""
    return triton.next_power_of_2(max(int(m), 1))


def _pow2_floor(v: int) -> int:
    return 1 << (max(int(v), 1).bit_length() - 1)


def default_config(m: int, n: int, k: int, *, silu_mul: bool = False, norm: bool = False,
                   num_sms: int = NUM_SMS) -> dict[str, int]:
    """Launch configuration for ``m`` rows of ``[n, k]`` weights (16-bit, H200-sized; ``num_sms``
    = 0 for the CPU interpreter: no wave rule).

    A `TUNED` (or `TUNED_SILU_MUL`, `TUNED_NORM`) entry for ``(rows_padded(m), n, k)`` wins
    (``norm`` without an entry of its own: `TUNED`'s). Otherwise:

    * ``BLOCK_K``: 512 up to 4 rows, 256 for 8 (a thread's 16-byte vectors of bf16 along K),
      no wider than ``k`` rounded up to a power of two (at least 64); 1024 for one row where
      ``k`` is a multiple of it and the weight no output head (`ONE_ROW_BLOCK_K`);
    * ``BLOCK_N``: the widest of 2-16 that keeps the fp32 accumulator
      (``ROWS x BLOCK_N x BLOCK_K``) at 64 values per thread over 4 warps, halved while the
      column blocks are fewer than 3 per SM (1B's 2048-column projections: 512 programs);
    * ``num_warps``: 4, fewer when the weight tile gives a thread less than 8 elements;
    * ``num_stages``: 1 (see `TUNED`; above 1 the next chunks stream in while one is multiplied);
    * ``SPLIT_K``: 1 (a ``config`` or `TUNED` entry may ask for more).

    ``benchmarks/bench_skinny_gemm.py`` times these against a sweep and prints the winners
    for `TUNED`.
    """
    rows = rows_padded(m)
    key = (rows, int(n), int(k))
    tuned = TUNED_SILU_MUL.get(key) if silu_mul else TUNED_NORM.get(key, TUNED.get(key)) if norm else TUNED.get(key)
    if tuned is not None:
        return dict(tuned)
    block_k = 512 if rows <= 4 else 256
    if rows == 1 and k % ONE_ROW_BLOCK_K == 0 and n < 16 * k:  # N >= 16 K: an output head (linear_ops)
        block_k = ONE_ROW_BLOCK_K
    block_k = min(block_k, max(64, triton.next_power_of_2(max(int(k), 1))))
    num_warps = 4
    # accumulator values per thread: rows * BLOCK_N * BLOCK_K / (32 * num_warps) <= 64
    block_n = max(2, min(16, _pow2_floor(64 * 32 * num_warps // (rows * block_k))))
    while block_n > 2 and triton.cdiv(n, block_n) < 3 * num_sms:
        block_n //= 2
    # at least one 16-byte vector (8 bf16 elements) of the weight tile per thread
    num_warps = max(1, min(num_warps, _pow2_floor(block_n * block_k // (8 * 32))))
    # SPLIT_K stays 1: a split launch's counters cannot be made inside a CUDA-graph capture,
    # so a graph captured before the first eager split launch would sum in another order
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=1, SPLIT_K=1)


def _check_config(config: dict) -> dict[str, int]:
    """``config`` checked, as ints: every key of `_CONFIG_KEYS`, and those of `_OPTIONAL_KEYS`
    it names (the others are left out: their defaults apply)."""
    missing = [key for key in _CONFIG_KEYS if key not in config]
    unknown = [key for key in config if key not in _CONFIG_KEYS and key not in _OPTIONAL_KEYS]
    if missing or unknown:
        raise InputError(f"config needs exactly the keys {_CONFIG_KEYS} (optionally {tuple(_OPTIONAL_KEYS)}); "
                         f"missing {missing}, unknown {unknown}")  # fmt: skip
    cfg = {key: int(config[key]) for key in _CONFIG_KEYS}
    for key in _OPTIONAL_KEYS:
        if key in config:
            cfg[key] = int(config[key])
            if cfg[key] not in _OPTIONAL_RANGES[key]:
                raise InputError(f"config[{key!r}] must be one of {_OPTIONAL_RANGES[key]}, got {config[key]!r}")
    for key in ("BLOCK_N", "BLOCK_K", "num_warps", "SPLIT_K"):
        if cfg[key] < 1 or cfg[key] & (cfg[key] - 1):
            raise InputError(f"config[{key!r}] must be a power of two >= 1, got {cfg[key]}")
    if cfg["num_stages"] < 1:
        raise InputError(f"config['num_stages'] must be >= 1, got {cfg['num_stages']}")
    return cfg


# ----------------------------------------------------------------------------- split-K counters
class _SplitCounters:
    """Per-device int32 arrival counters of split-K launches, all zero between launches (the
    program that sums a column block puts its counter back), shared by every launch on a device
    (launches on one stream run one after another; concurrent split-K launches on two streams
    of one device would share counters and are not supported).

    Made outside CUDA-graph capture only: counters made during a capture would be zeroed by the
    graph's replays alone. A buffer that grows keeps its predecessor alive (captured graphs may
    still use it)."""

    def __init__(self) -> None:
        self._by_device: dict[torch.device, torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []

    def get(self, device: torch.device, blocks: int) -> torch.Tensor | None:
        """``[>= blocks]`` int32 zeros on ``device``, or None while capturing without them."""
        have = self._by_device.get(device)
        if have is not None and have.numel() >= blocks:
            return have
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if have is not None:
            self._retired.append(have)
        made = self._by_device[device] = torch.zeros(max(blocks, 1 << 16), dtype=torch.int32, device=device)
        return made


_COUNTERS = _SplitCounters()


def split_plan(k: int, split: int, block_k: int, blocks: int, device: torch.device) -> tuple[int, int, torch.Tensor | None]:
    """``(split_k, k_per_split, counters)`` of a launch asking for ``split`` K ranges over
    ``blocks`` column blocks: each range a multiple of ``block_k`` (no chunk straddles two),
    only the non-empty ones kept; ``counters`` (`_COUNTERS`) with more than one, else None.
    Inside a CUDA-graph capture before any eager split launch made the counters, one range."""
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k if k else block_k
    split_k = triton.cdiv(k, k_per_split) if k else 1
    if split_k == 1:
        return 1, k_per_split, None
    counters = _COUNTERS.get(device, blocks)
    if counters is None:
        return 1, triton.cdiv(k, block_k) * block_k, None
    return split_k, k_per_split, counters


# ----------------------------------------------------------------------------- launchers
def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last + 1)`` byte addresses ``t``'s elements span (empty for no elements)."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def refuse_overlap(what: str, written: dict, read: dict) -> None:
    """Refuse an output (``written``: name -> tensor or None) whose bytes overlap an input
    (``read``): a launch's programs write their outputs while others still read the inputs
    (the norm's statistics read whole rows of x in every program), so an in-place call would
    read values already overwritten. Spans are compared, so interleaved strided views are
    refused too (pass copies)."""
    for out_name, out in written.items():
        if out is None:
            continue
        lo, hi = _byte_span(out)
        for in_name, t in read.items():
            if t is None or t.numel() == 0 or out.numel() == 0:
                continue
            t_lo, t_hi = _byte_span(t)
            if lo < t_hi and t_lo < hi:
                raise InputError(f"{what}: {out_name} overlaps {in_name} in memory; the kernel's programs write it while "
                                 f"others still read {in_name} (pass a separate tensor)")  # fmt: skip


def _check_out(out: torch.Tensor | None, like: torch.Tensor, m: int, n: int, name: str = "out") -> torch.Tensor:
    if out is None:
        return torch.empty((m, n), dtype=like.dtype, device=like.device)
    if tuple(out.shape) != (m, n) or out.dtype != like.dtype or out.device != like.device or (m and n and out.stride(1) != 1):
        raise InputError(
            f"{name} must be a {like.dtype} [{m}, {n}] tensor on {like.device}, contiguous in its last dimension; got "
            f"{out.dtype} {tuple(out.shape)} with strides {tuple(out.stride())} on {out.device}"
        )
    return out


def check_norm_operands(what: str, x: torch.Tensor, residual: torch.Tensor | None, h_out: torch.Tensor | None,
                        norm_weight: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor | None:  # fmt: skip
    """The norm fold's operands against a validated ``x: [M, K]`` and ``n`` output columns (both
    kernels' launchers): ``residual`` like x (unit stride along K), ``h_out`` ``[M, K]`` only
    with a residual, ``norm_weight`` ``[K]`` and ``bias`` ``[n]`` contiguous in x's dtype.
    Returns ``h_out`` (a new one when None and a residual is given)."""
    m, k = x.shape
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device or (
            k > 1 and residual.stride(1) != 1
        ):
            raise InputError(f"{what}: residual must match x ({x.dtype} {tuple(x.shape)} on {x.device}), contiguous in its "
                             f"last dimension; got {residual.dtype} {tuple(residual.shape)} on {residual.device}")  # fmt: skip
        h_out = _check_out(h_out, x, m, k, "h_out")
    elif h_out is not None:
        raise InputError(f"{what}: h_out is written only with a residual")
    if tuple(norm_weight.shape) != (k,) or norm_weight.dtype != x.dtype or norm_weight.device != x.device or (
        k > 1 and norm_weight.stride(0) != 1
    ):
        raise InputError(f"{what}: norm_weight must be a contiguous {x.dtype} [{k}] on {x.device}; got "
                         f"{norm_weight.dtype} {tuple(norm_weight.shape)}")  # fmt: skip
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype != x.dtype or bias.device != x.device
                             or (n > 1 and bias.stride(0) != 1)):  # fmt: skip
        raise InputError(f"{what}: bias must be a contiguous {x.dtype} [{n}] on {x.device}; got {bias.dtype} {tuple(bias.shape)}")
    return h_out


def _check_weight(weight: torch.Tensor, k: int, like: torch.Tensor, what: str) -> int:
    if weight.dim() != 2 or weight.shape[1] != k:
        raise InputError(f"{what}: weight must be [N, {k}] (nn.Linear's [out_features, in_features]); got {tuple(weight.shape)}")
    if not weight.is_contiguous():
        raise InputError(f"{what}: weight must be contiguous; got strides {tuple(weight.stride())} (call .contiguous() once)")
    if weight.dtype != like.dtype or weight.device != like.device:
        raise InputError(f"{what}: weight is {weight.dtype} on {weight.device}, the input {like.dtype} on {like.device}; they must match")
    return weight.shape[0]


def _check_rows(name: str, t: torch.Tensor, what: str) -> None:
    if t.device.type != "cuda" and not interpreting():
        raise InputError(
            f"{what}: {name} is on {t.device}; the kernel needs a CUDA device, or Triton's CPU interpreter "
            "(TRITON_INTERPRET=1 set before importing attngraph) for CPU tensors"
        )
    if t.dim() != 2:
        raise InputError(f"{what}: {name} must be [M, K]; got {tuple(t.shape)}")
    if t.shape[0] > MAX_ROWS:
        raise InputError(f"{what}: {name} has {t.shape[0]} rows; the kernel takes at most {MAX_ROWS} (use F.linear)")
    if t.dtype not in _DTYPES:
        raise InputError(f"{what}: {name} must be bfloat16, float16 or float32; got {t.dtype}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise InputError(f"{what}: {name} must be contiguous in its last dimension; got strides {tuple(t.stride())}")


def _launch(x, x2, weight, bias, out, config, silu_mul: bool, norm_weight=None, eps: float = 0.0, h_out=None,
            rope=None, norm_out=None, trace=None) -> torch.Tensor | None:  # fmt: skip
    """Launch the kernel for validated operands (``x``, ``x2``: ``[M, K]``; ``out``: ``[M, N]``;
    with ``norm_weight`` ``[K]`` the RMSNorm prologue, of ``x + x2`` into ``h_out`` when ``x2``
    is given; with ``rope`` = `check_rope_columns`'s result the rotation of the first columns;
    with ``norm_out = (residual, norm_weight, h_out)`` (``[M, N]``, ``[N]``, ``[M, N]``) the
    residual add and RMSNorm epilogue into ``h_out`` and ``out``). Returns ``out``, or None
    when ``norm_out`` needs the arrival counter and a CUDA-graph capture is under way before
    any launch made it (the caller then takes two launches)."""
    m, k = x.shape
    n = weight.shape[0]
    norm = norm_weight is not None
    residual = norm and x2 is not None
    if m == 0 or n == 0:
        if residual and m:
            h_out.copy_((x.float() + x2.float()).to(x.dtype))
        return out
    if config is None:  # (the interpreter's programs run one after another: no wave rule on the CPU)
        cfg = default_config(m, n, k, silu_mul=silu_mul, norm=norm, num_sms=NUM_SMS if x.is_cuda else 0)
    else:
        cfg = _check_config(config)
    norm_counter = None
    if norm_out is not None:  # one K range: the epilogue needs each column's finished sum
        cfg["SPLIT_K"] = 1
        norm_counter = _COUNTERS.get(x.device, 1)
        if norm_counter is None:
            return None
        x2, norm_weight, h_out = norm_out
    block_n, block_k = cfg["BLOCK_N"], cfg["BLOCK_K"]
    rope_cos, rope_sin, rope_cols = rope if rope is not None else (x, x, 0)  # tensors read with ROPE only
    rope_d = rope_cos.shape[1] if rope is not None else 2
    if rope is not None:  # a column block holds whole pairs of one head: 2 <= BLOCK_N, dividing D
        block_n = max(2, min(block_n, rope_d & -rope_d))
    blocks = triton.cdiv(n, block_n)
    split_k, k_per_split, counters = split_plan(k, cfg["SPLIT_K"], block_k, blocks, x.device)
    part = counters = out if counters is None else counters  # part and counters: read with split-K only
    if split_k > 1:
        part = torch.empty((split_k, rows_padded(m), n), dtype=torch.float32, device=x.device)
    if norm_counter is not None:
        counters = norm_counter
    x2 = x2 if x2 is not None else x  # the kernel reads it with SILU_MUL, RESIDUAL or NORM_OUT only
    h_out = h_out if h_out is not None else x  # written with RESIDUAL or NORM_OUT only
    norm_weight = norm_weight if norm or norm_out is not None else x  # read with NORM or NORM_OUT only
    use_pdl = pdl.enabled(x.device)
    prefetch = use_pdl and weight_prefetch.enabled(x.device)
    if trace is not None:
        check_trace(trace, blocks * split_k, x.device)
    # Triton launches on the current device
    guard = torch.cuda.device(x.device) if x.is_cuda and x.device.index != torch.cuda.current_device() else nullcontext()
    with guard:
        _skinny_linear_kernel[(blocks, split_k)](
            x, x2, weight, bias if bias is not None else weight, out, part, counters, norm_weight, h_out, rope_cos, rope_sin,
            trace if trace is not None else counters, m, n, k, k_per_split, float(eps), rope_cols,
            x.stride(0), x2.stride(0), weight.stride(0), out.stride(0), h_out.stride(0), rope_cos.stride(0),
            rope_sin.stride(0),
            ROWS=rows_padded(m), BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
            HAS_BIAS=bias is not None, SILU_MUL=silu_mul, NORM=norm, RESIDUAL=residual,
            SOFT_BF16=x.dtype == torch.bfloat16 and interpreting(),
            USE_PDL=use_pdl, PREFETCH=prefetch, LINE=min(weight_prefetch.line_elements(weight), block_k),
            ROPE=rope is not None, ROPE_D=rope_d,
            NORM_OUT=norm_out is not None, BLOCK_NO=triton.next_power_of_2(n) if norm_out is not None else 1,
            STAGES=cfg["num_stages"], PRELOAD=bool(cfg.get("PRELOAD", _OPTIONAL_KEYS["PRELOAD"])),
            NORM_STAGES=cfg.get("NORM_STAGES", _OPTIONAL_KEYS["NORM_STAGES"]) if norm else 1, TRACE=trace is not None,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl.launch_options(use_pdl),
        )  # fmt: skip
    return out


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
    rope_cols: int = 0,
    trace: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a few rows: ``x: [M, K]`` (``M <= MAX_ROWS``; rows any
    stride apart, unit stride along K), ``weight: [N, K]`` contiguous, ``bias: [N]`` or None
    -> ``[M, N]`` in ``x``'s dtype (bf16, fp16 or fp32; weight and bias of the same),
    accumulated in fp32.

    ``out``: an ``[M, N]`` tensor to write (unit stride along N); None: a new one.
    ``config``: a `default_config`-style dict overriding the heuristic (benchmark sweeps;
    optional keys ``PRELOAD`` and ``NORM_STAGES``, `_OPTIONAL_KEYS`).
    ``rope_cos``, ``rope_sin``: ``[>= M, D]``; with them the first ``rope_cols`` output
    columns (heads of ``D``: a fused projection's q and k) leave rotated by HF's rotate-half
    RoPE, row ``r`` by ``cos[r]``, ``sin[r]``: ``y * cos + rotate_half(y) * sin`` on the
    rounded output ``y``, in fp32, rounded once (`attngraph.rope.rope_reference`).
    ``trace``: int64 ``[>= programs, kernel_clock.RECORD]`` (a program per ``BLOCK_N`` columns
    and K range): each program records timestamps into it (`attngraph.kernel_clock`; entry,
    past the PDL wait, sums reduced, done). NVIDIA GPUs only; the values do not change.
    """
    what = "skinny_linear"
    _check_rows("x", x, what)
    n = _check_weight(weight, x.shape[1], x, what)
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype != x.dtype or bias.device != x.device
                             or (n > 1 and bias.stride(0) != 1)):  # fmt: skip
        raise InputError(f"{what}: bias must be a contiguous {x.dtype} [{n}] on {x.device}; got {bias.dtype} {tuple(bias.shape)}")
    rope = check_rope_columns(what, x, n, rope_cos, rope_sin, rope_cols)
    out = _check_out(out, x, x.shape[0], n)
    refuse_overlap(what, {"out": out}, {"x": x})
    return _launch(x, None, weight, bias, out, config, silu_mul=False, rope=rope, trace=trace)


def check_trace(trace: torch.Tensor, programs: int, device: torch.device) -> None:
    """Refuse a trace buffer that cannot hold ``programs`` `attngraph.kernel_clock` records on
    ``device`` (a GPU: Triton's interpreter has no timers)."""
    if (trace.dtype != torch.int64 or not trace.is_contiguous() or trace.dim() != 2 or trace.shape[0] < programs
            or trace.shape[1] != kernel_clock.RECORD or trace.device != device or interpreting()):  # fmt: skip
        raise InputError(f"trace must be a contiguous int64 [>= {programs}, {kernel_clock.RECORD}] tensor on {device} "
                         f"(a GPU: the interpreter has no timers); got {trace.dtype} {tuple(trace.shape)} on {trace.device}")


def skinny_silu_mul_linear(
    a: torch.Tensor,
    b: torch.Tensor,
    weight: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """``F.linear(silu(a) * b, weight)`` for a few rows (the MLP's down projection over its
    gate and up): ``a, b: [M, I]`` (``M <= MAX_ROWS``; rows any stride apart, e.g. the halves
    ``gu[:, :I]``, ``gu[:, I:]`` of a fused gate/up output), ``weight: [N, I]`` contiguous ->
    ``[M, N]`` in ``a``'s dtype.

    ``silu(a) * b`` is computed in fp32 and rounded once to the inputs' dtype (what an
    inductor-fused producer of the GEMM gives), then multiplied with the weight in fp32.
    ``out``, ``config``: as for `skinny_linear`.
    """
    what = "skinny_silu_mul_linear"
    _check_rows("a", a, what)
    _check_rows("b", b, what)
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        raise InputError(f"{what}: a and b must have one shape, dtype and device; got {a.dtype} {tuple(a.shape)} "
                         f"on {a.device} and {b.dtype} {tuple(b.shape)} on {b.device}")  # fmt: skip
    n = _check_weight(weight, a.shape[1], a, what)
    out = _check_out(out, a, a.shape[0], n)
    refuse_overlap(what, {"out": out}, {"a": a, "b": b})
    return _launch(a, b, weight, None, out, config, silu_mul=True)


def skinny_rms_norm_linear(
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
) -> torch.Tensor:
    """``F.linear(rms_norm(h), weight, bias)`` for a few rows, HF's RMSNorm folded into the
    loads: ``h = x`` or, with ``residual``, ``h = x + residual`` (rounded to x's dtype, written
    to ``h_out``: the residual stream the model reads next); ``rms_norm(h) = norm_weight *
    (h * rsqrt(mean(h^2) + eps)).to(dtype)`` in fp32 with HF's two roundings.

    ``x``, ``residual``: ``[M, K]`` (``M <= MAX_ROWS``; unit stride along K); ``norm_weight``:
    ``[K]`` contiguous; ``weight``: ``[N, K]`` contiguous; ``bias``: ``[N]`` or None ->
    ``[M, N]``. ``h_out``: ``[M, K]`` (a new one when None and ``residual`` is given).
    ``out``, ``config``, ``rope_cos``, ``rope_sin``, ``rope_cols``: as for `skinny_linear`.
    """
    what = "skinny_rms_norm_linear"
    _check_rows("x", x, what)
    n = _check_weight(weight, x.shape[1], x, what)
    h_out = check_norm_operands(what, x, residual, h_out, norm_weight, bias, n)
    rope = check_rope_columns(what, x, n, rope_cos, rope_sin, rope_cols)
    out = _check_out(out, x, x.shape[0], n)
    refuse_overlap(what, {"out": out, "h_out": h_out}, {"x": x, "residual": residual})
    return _launch(x, residual, weight, bias, out, config, silu_mul=False, norm_weight=norm_weight, eps=eps, h_out=h_out,
                   rope=rope)  # fmt: skip


def skinny_linear_add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    h_out: torch.Tensor | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm_weight * rmsnorm(h), h)`` with ``h = F.linear(x, weight, bias) + residual``, in
    one launch: the product (rounded to x's dtype, as the model's projection writes it), the
    residual add (rounded) and HF's RMSNorm (``eps``; fp32 statistics, two roundings) in the
    GEMV's epilogue, the norm by the launch's last program (a decoder layer's output projection
    and the norm in front of its MLP, whose gate/up product then runs on its own).

    ``x``: ``[M, K]`` (``M <= MAX_ROWS``; unit stride along K); ``weight``: ``[N, K]``
    contiguous; ``bias``: ``[N]`` or None; ``residual``: ``[M, N]`` (unit stride along N);
    ``norm_weight``: ``[N]`` contiguous, ``N <= rms_norm.MAX_K`` -> two ``[M, N]`` tensors
    (``out``, ``h_out`` when given). ``config``: as for `skinny_linear` (``SPLIT_K`` is 1).
    """
    from .rms_norm import MAX_K, add_rms_norm

    what = "skinny_linear_add_rms_norm"
    _check_rows("x", x, what)
    m = x.shape[0]
    n = _check_weight(weight, x.shape[1], x, what)
    if n > MAX_K:
        raise InputError(f"{what}: rows of {n} output columns; the norm's one program holds at most {MAX_K}")
    if tuple(residual.shape) != (m, n) or residual.dtype != x.dtype or residual.device != x.device:
        raise InputError(f"{what}: residual must be a {x.dtype} [{m}, {n}] tensor on {x.device} like the product; got "
                         f"{residual.dtype} {tuple(residual.shape)} on {residual.device}")  # fmt: skip
    # the norm's operands, checked as those of a norm over the [M, N] rows
    h_out = check_norm_operands(what, residual, residual, h_out, norm_weight, bias, n)
    out = _check_out(out, x, m, n)
    # each program reads its own columns of the residual before writing them to h_out, so
    # h_out may be the residual; the last program reads h_out whole to write out
    refuse_overlap(what, {"out": out}, {"x": x, "residual": residual, "h_out": h_out})
    refuse_overlap(what, {"h_out": h_out}, {"x": x})
    if _launch(x, None, weight, bias, out, config, silu_mul=False, eps=eps, norm_out=(residual, norm_weight, h_out)) is None:
        y = _launch(x, None, weight, bias, torch.empty((m, n), dtype=x.dtype, device=x.device), config, silu_mul=False)
        normed, h = add_rms_norm(y, norm_weight, eps, residual)
        out.copy_(normed)
        h_out.copy_(h)
    return out, h_out


# ----------------------------------------------------------------------------- silu(a) * b alone
@triton.jit
def _silu_mul_kernel(A, B, Y, I, stride_am, stride_bm, BLOCK: tl.constexpr, SOFT_BF16: tl.constexpr,
                     USE_PDL: tl.constexpr):  # fmt: skip
    """``Y[r] = silu(A[r]) * B[r]`` for row ``r = program_id(0)``, fp32, rounded once; A, B:
    rows ``stride_am`` / ``stride_bm`` apart, Y: ``[rows, I]`` contiguous."""
    if USE_PDL:  # A and B may still be being written by the kernel before (attngraph.pdl)
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(A + row * stride_am + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(B + row * stride_bm + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * I + offs, _round(g / (1.0 + tl.exp(-g)) * u, Y.dtype.element_ty, SOFT_BF16), mask=mask)


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` in one launch: ``a, b: [M, I]`` (rows any stride apart, unit stride
    along I) -> ``[M, I]`` contiguous, computed in fp32 and rounded once to ``a``'s dtype (the
    operand `skinny_silu_mul_linear` forms; what rows above the GEMV's take into cuBLAS)."""
    what = "silu_mul"
    if a.dim() != 2 or a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        raise InputError(f"{what}: a and b must be [M, I] of one shape, dtype and device; got {a.dtype} {tuple(a.shape)} "
                         f"on {a.device} and {b.dtype} {tuple(b.shape)} on {b.device}")  # fmt: skip
    if a.shape[1] > 1 and (a.stride(1) != 1 or b.stride(1) != 1):
        raise InputError(f"{what}: a and b must be contiguous in their last dimension")
    m, i = a.shape
    out = torch.empty((m, i), dtype=a.dtype, device=a.device)
    if m == 0 or i == 0:
        return out
    block = 1024
    use_pdl = pdl.enabled(a.device)
    guard = torch.cuda.device(a.device) if a.is_cuda and a.device.index != torch.cuda.current_device() else nullcontext()
    with guard:
        _silu_mul_kernel[(m, triton.cdiv(i, block))](
            a, b, out, i, a.stride(0), b.stride(0), BLOCK=block,
            SOFT_BF16=a.dtype == torch.bfloat16 and interpreting(), USE_PDL=use_pdl, num_warps=4,
            **pdl.launch_options(use_pdl),
        )  # fmt: skip
    return out
