"""`torch.ops.attngraph.linear`, `silu_mul_linear`, `rms_norm_linear`, `add_rms_norm_linear`,
`linear_add_rms_norm` and `add_rms_norm_gated_mlp`: projections of a few token rows through the Triton GEMV of
`attngraph.skinny_linear` (with SiLU * up, or a residual add and HF's RMSNorm, folded into its
loads), 3-16 rows through the tensor-core kernel of `attngraph.skinny_dot` (a norm or SiLU * up
runs its own launch first), torch for everything else.

All are `torch.library.custom_op`s with fake implementations (opaque to Dynamo and inductor;
symbolic sizes under dynamic shapes) returning a fresh tensor. The kernel runs when the rows
(the product of the leading dimensions) are at most `KERNEL_MAX_ROWS` and the weight holds at
most `KERNEL_MAX_WEIGHT` elements (where it was measured faster), the dtype is bf16
or fp16, the weight is contiguous, the input is contiguous in its last dimension and the
tensors are on a CUDA device; on the CPU only under Triton's interpreter (``TRITON_INTERPRET=1``
before import) and with `CPU_INTERPRETER` set (tests). The tensor-core kernel, likewise, for
`DOT_MIN_ROWS` to `DOT_MAX_ROWS` rows and weights of at most `DOT_MAX_WEIGHT` elements or
output heads (`DOT_HEADS`; the norm folded in where `DOT_FOLD_NORM` is set). Otherwise
``torch.nn.functional.linear``. `add_rms_norm_gated_mlp` is a gated MLP whole (its norm, the
fused gate/up product, SiLU * up and the down product): the ops above at most row counts, and
at the tensor-core kernel's the activation in the gate/up product's epilogue.

CUDA-graph capture: the only allocation is the output (and split-K partials, ``torch.empty``);
nothing is read back to the host. Triton is imported on first use, so this module imports on a
machine without CUDA or Triton (the ops then always take the torch path).
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F

from .errors import InputError
from .forward_context import get_forward_context
from .rope import check_rope_columns

#: Run the kernels on CPU tensors through Triton's interpreter (needs ``TRITON_INTERPRET=1``
#: set before import and an interpreter that works with this numpy). Off: CPU tensors take
#: the torch path. Also set by ``ATTNGRAPH_LINEAR_INTERPRET=1``.
CPU_INTERPRETER = os.environ.get("ATTNGRAPH_LINEAR_INTERPRET", "0") == "1"

_KERNEL_DTYPES = (torch.bfloat16, torch.float16)

#: Where the GEMV beats cuBLAS (H200, bf16, `benchmarks/bench_skinny_gemm.py`): at 1-2 rows
#: and weights of at most 2**24 elements (Llama-3.2-1B's q/k/v, o and down projections: 4.7-12
#: against 6.1-12.9 us, and no split-K launches around the down projection). At 8 rows it took
#: 1.5-3x cuBLAS's time; the LM heads, the 1B gate/up and every 8B projection but o were slower
#: already at 2 rows. Elsewhere the ops run torch.
KERNEL_MAX_ROWS = 2
KERNEL_MAX_WEIGHT = 1 << 24
#: The SiLU-mul fold pays for the product's own launch too: at 2 rows it beat the product plus
#: cuBLAS on Llama-3.1-8B's down projection as well (4096 x 14336: 35.8 against 38.5 us).
KERNEL_MAX_SILU_MUL_WEIGHT = 1 << 26
#: At one row the GEMV wins on larger weights: Llama-3.1-8B's q/k/v (6144 x 4096 = 3 * 2**23
#: elements: 14.9 against 17.1 us) and o (10.9 against 12.4), and the 1B gate/up (2**25) with
#: the residual add and the MLP's norm folded in and its own tile (`skinny_linear.TUNED_NORM`;
#: H100, one 1B decode step: 1.091 against 1.139 ms, 108 against 124 kernels). Alone, with the
#: heuristic's tile, it had lost (cuBLAS 18.8 us against its 20.5, H200). The 8B gate/up stays
#: cuBLAS's (59.3 against 60.2 us).
KERNEL_MAX_WEIGHT_ONE_ROW = 1 << 25
#: ... and on output heads (``N >= KERNEL_MIN_HEAD_RATIO * K``, vocabulary projections) of any
#: size: the LM heads 128256 x 2048 and x 4096 took 125.6 and 246.9 us against cuBLAS's 135.1
#: and 276.0 (their weight-read floors: 123.1 and 246.2).
KERNEL_MIN_HEAD_RATIO = 16
#: 3-16 rows run on tensor cores (`attngraph.skinny_dot`), bf16 / fp16 weights of at most
#: `DOT_MAX_WEIGHT` elements, and output heads (`DOT_HEADS`). At 4 and 16 rows
#: it beat cuBLAS (with its split-K reduce launches) on the Llama-3.2-1B projections (16 rows:
#: q/k/v 5.76 against 6.51 us, o 4.79 / 6.07, gate/up 18.05 / 18.82, down 11.18 / 13.12) and
#: the 8B o (10.67 / 12.63) and down (31.0 / 31.7); the 8B q/k/v tied and the 8B gate/up
#: (2**26.8 elements) lost (60.3 / 59.5): `benchmarks/bench_skinny_gemm.py --dot`.
DOT_MIN_ROWS = 3
DOT_MAX_ROWS = 16
DOT_MAX_WEIGHT = 1 << 26
#: The gated MLP's fused gate/up (`add_rms_norm_gated_mlp`) runs on tensor cores up to this many
#: weight elements (`passes.skinny_linears` and `fuse_gated_mlp` read it too). Alone, with SiLU *
#: up in its epilogue, the 8B gate/up (28672 x 4096, 2**26.8 elements) took 83.5 us at 16 rows
#: (82.6 at 4) where cuBLAS's product alone took 88.7 (88.2) (H100, `skinny_dot.GATED_CONFIG`;
#: ``benchmarks/bench_skinny_gemm.py --dot --projections gate_up --rows 16,4``); 2**27 lets it
#: in. In the 8B decode step (``benchmarks/bench_generate.py --shapes 8b --batches 1,4,16
#: --variant default --variant gated-weight-limit=134217728``, H100) 2**27 against 2**26:
#: 6.081 / 6.214 ms at 16 requests, 5.770 / 5.907 at 4, 5.661 / 5.713 at 1 (where the op's
#: norm launch and cuBLAS replace inductor's norm and cuBLAS; GPU busy time tied).
DOT_MAX_GATED_WEIGHT = 1 << 27
#: Output heads of any size at 3-16 rows run on tensor cores too (above `DOT_MAX_WEIGHT`): with
#: its default tile the kernel read the LM heads at their weight's floor where cuBLAS did not
#: (H100, bf16, CUDA graphs of calls on distinct weight copies; 128256 x 2048 at 16 / 4 rows:
#: 175.3 / 170.1 us against cuBLAS's 193.0 / 193.0 and cuBLASLt's 181.8 / 178.5, floor 173.2;
#: 128256 x 4096: 340.1 / 333.4 against 404.6 / 387.9 and 362.4 / 353.9, floor 346.4;
#: ``benchmarks/bench_skinny_gemm.py --dot --dot-default --dot-heads --rows 16,4``). In the 1B
#: decode step at 4 and 16 requests the GPU busy time was 3-5 us lower; the steps' spread on
#: that machine start hid it (``benchmarks/bench_generate.py --variant dot-heads=off``).
DOT_HEADS = True
#: Where the tensor-core kernel serves `rms_norm_linear` / `add_rms_norm_linear`, fold the norm
#: into its operand loads (`skinny_dot.skinny_dot_rms_norm_linear`: every program reads all
#: rows of x for the statistics) instead of the norm's own launch before it. Off: on an H200
#: it made the 1B-shaped decode step slower (batch 16: 1.639 against 1.217 ms, every program
#: re-reading all 16 rows; both with the prefetch and the RoPE fold on;
#: ``benchmarks/bench_generate.py --dot-fold-norm on``,
#: ``results/generate_switches_h200_2026-12-05.json``). With `DOT_MIN_ROWS` at 1 the kernel
#: also takes the one- and two-row projections the GEMV leaves to cuBLAS (then the 1B gate/up
#: of one row too): slower too (batch 1: 1.249 against 1.053 ms).
DOT_FOLD_NORM = False

#: What the rows of an op's input are, as `passes.skinny_linears` proved it from the symbolic
#: sizes of the ragged graph (the op's ``rows`` argument): `ANY_ROWS`, every row is computed;
#: `TOKEN_ROWS`, one row per token of the step (``[1, N, K]``, N the token count);
#: `LOGIT_ROWS`, one per logits row (``[1, L, K]``); `TOKEN_OR_LOGIT_ROWS`, N and L are one
#: symbol. Where the step was padded (`ForwardContext`: ``batch.num_tokens`` and
#: ``num_logits``), only the real rows are computed and the padding rows of the output are left
#: unwritten: the token-mixing proof of the ragged graph shows no real row reads them.
ANY_ROWS, TOKEN_ROWS, LOGIT_ROWS, TOKEN_OR_LOGIT_ROWS = 0, 1, 2, 3


@functools.lru_cache(maxsize=1)
def _kernels():
    """The `skinny_linear` module, or None where Triton cannot be imported."""
    try:
        from . import skinny_linear
    except ImportError:
        return None
    return skinny_linear


def _kernel_serves(device: torch.device) -> bool:
    """Whether the kernels run on ``device`` (compiled on CUDA; interpreted on the CPU)."""
    if device.type == "cuda":
        mod = _kernels()
        return mod is not None and not mod.interpreting()
    if device.type == "cpu" and CPU_INTERPRETER:
        mod = _kernels()
        return mod is not None and mod.interpreting() and _interpreter_problem() is None
    return False


@functools.lru_cache(maxsize=1)
def _dot_kernels():
    """The `skinny_dot` module, or None where Triton cannot be imported."""
    try:
        from . import skinny_dot
    except ImportError:
        return None
    return skinny_dot


@functools.lru_cache(maxsize=1)
def _interpreter_problem() -> str | None:
    return _kernels().interpreter_problem()


def real_rows(kind: int, rows: int) -> int:
    """How many leading rows of an op's ``[rows, K]`` input the step reads (see `ANY_ROWS`)."""
    if kind not in (ANY_ROWS, TOKEN_ROWS, LOGIT_ROWS, TOKEN_OR_LOGIT_ROWS):
        raise InputError(f"rows must be one of ANY_ROWS, TOKEN_ROWS, LOGIT_ROWS, TOKEN_OR_LOGIT_ROWS (0-3); got {kind}")
    if kind == ANY_ROWS:
        return rows
    ctx = get_forward_context()
    if ctx is None or ctx.batch is None:
        return rows
    tokens, logits = ctx.batch.num_tokens, ctx.num_logits
    if kind == TOKEN_ROWS:
        real = tokens
    elif kind == LOGIT_ROWS:
        real = logits
    else:
        real = tokens if tokens == logits else None
    return real if real is not None and 0 < real < rows else rows


def gemv_takes(rows: int, n: int, k: int) -> bool:
    """Whether the plain ops' limits give ``rows`` rows of an ``[n, k]`` weight to the GEMV:
    1-`KERNEL_MAX_ROWS` rows and at most `KERNEL_MAX_WEIGHT` elements, or at one row
    `KERNEL_MAX_WEIGHT_ONE_ROW` and output heads of any size (dtype, layout and device aside)."""
    if not 0 < rows <= KERNEL_MAX_ROWS:
        return False
    if rows == 1:
        return n * k <= KERNEL_MAX_WEIGHT_ONE_ROW or n >= KERNEL_MIN_HEAD_RATIO * k
    return n * k <= KERNEL_MAX_WEIGHT


def _use_kernel(rows: int, k: int, lead: torch.Tensor, weight: torch.Tensor, max_weight: int | None = None) -> bool:
    """Kernel or torch for the ``[rows, K]`` input ``lead`` (x, or a) and ``weight`` (at most
    ``max_weight`` elements; None: `gemv_takes`' limits)."""
    if not (0 < rows <= KERNEL_MAX_ROWS and _operands_fit(k, lead, weight)):
        return False
    if max_weight is not None:
        return weight.numel() <= max_weight
    return gemv_takes(rows, weight.shape[0], k)


def _operands_fit(k: int, lead: torch.Tensor, weight: torch.Tensor) -> bool:
    """What both Triton kernels need: K > 0, bf16 / fp16, a contiguous weight, ``lead`` (x, or
    a) contiguous along K, on a device the kernels run on."""
    if k == 0 or lead.dtype not in _KERNEL_DTYPES or not weight.is_contiguous() or (k > 1 and lead.stride(-1) != 1):
        return False
    return _kernel_serves(lead.device)


def _use_dot(rows: int, k: int, lead: torch.Tensor, weight: torch.Tensor, max_weight: int | None = None) -> bool:
    """Whether ``rows`` rows of ``lead`` (x, or a) times ``weight`` run on tensor cores (a
    weight of at most ``max_weight`` elements; None: `DOT_MAX_WEIGHT`; heads: `DOT_HEADS`)."""
    n = weight.shape[0]
    head = n >= KERNEL_MIN_HEAD_RATIO * k
    limit = DOT_MAX_WEIGHT if max_weight is None else max_weight
    if not DOT_MIN_ROWS <= rows <= DOT_MAX_ROWS or (not DOT_HEADS if head else n * k > limit):
        return False
    return _operands_fit(k, lead, weight) and _dot_kernels() is not None


def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int,
             rope: tuple | None = None) -> torch.Tensor:  # fmt: skip
    """``F.linear(x, weight, bias)`` of ``x: [..., K]`` whose first ``rows`` (`real_rows`) rows
    are real, on tensor cores where `_use_dot` allows (padding rows left unwritten); with
    ``rope = (cos, sin, cols)`` the first ``cols`` columns rotated, in the tensor-core kernel's
    epilogue where its blocks hold the head's pairs, else after the product."""
    k = x.shape[-1]
    n = weight.shape[0]
    m = x.numel() // k if k else 0
    if not _use_dot(rows, k, x, weight) or (bias is not None and n > 1 and bias.stride(0) != 1):
        y = F.linear(x, weight, bias)
        return _rotate_columns(y, *rope, rows) if rope is not None else y
    in_kernel = rope is not None and _rope_in_dot(rope)
    y = x.new_empty((m, n))
    extra = dict(rope_cos=rope[0], rope_sin=rope[1], rope_cols=rope[2]) if in_kernel else {}
    _dot_kernels().skinny_dot_linear(x.reshape(m, k)[:rows], weight, bias, out=y[:rows], **extra)
    if rope is not None and not in_kernel:
        _rotate_columns(y, *rope, rows)
    return y.view(*x.shape[:-1], n)


def _rope_in_dot(rope: tuple) -> bool:
    """Whether the tensor-core kernel rotates ``rope = (cos, sin, cols)`` in its epilogue."""
    cos, sin, _ = rope
    return _dot_kernels().rope_fits(cos.shape[-1]) and _rope_fits(True, cos, sin)


def kernel_may_serve(n: int, k: int, silu_mul: bool = False, gated: bool = False) -> bool:
    """Whether some row count runs an ``[n, k]`` weight on the kernel (the pass's test: a
    linear no step would run there stays ``F.linear``, inductor's to schedule). Plain: weights
    of at most `KERNEL_MAX_WEIGHT` elements, `KERNEL_MAX_WEIGHT_ONE_ROW` (one row), or output
    heads (``n >= KERNEL_MIN_HEAD_RATIO * k``, one row); folding SiLU * up:
    `KERNEL_MAX_SILU_MUL_WEIGHT`; on tensor cores (3-16 rows): `DOT_MAX_WEIGHT` and heads;
    ``gated`` (a fused gate/up product whose halves feed SiLU * up, which `add_rms_norm_gated_mlp`
    may take): `DOT_MAX_GATED_WEIGHT`."""
    numel = n * k
    if numel <= (DOT_MAX_GATED_WEIGHT if gated else DOT_MAX_WEIGHT) and n < KERNEL_MIN_HEAD_RATIO * k:
        return True
    if silu_mul:
        return numel <= KERNEL_MAX_SILU_MUL_WEIGHT
    return numel <= max(KERNEL_MAX_WEIGHT, KERNEL_MAX_WEIGHT_ONE_ROW) or n >= KERNEL_MIN_HEAD_RATIO * k


def gemv_may_serve(n: int, k: int) -> bool:
    """Whether the GEMV (1-2 rows) runs an ``[n, k]`` weight at some row count: at most
    `KERNEL_MAX_WEIGHT` elements, at one row `KERNEL_MAX_WEIGHT_ONE_ROW` or an output head."""
    return n * k <= max(KERNEL_MAX_WEIGHT, KERNEL_MAX_WEIGHT_ONE_ROW) or n >= KERNEL_MIN_HEAD_RATIO * k


def _check_linear(what: str, x: torch.Tensor, weight: torch.Tensor, inner: int) -> int:
    """Refuse what no path serves; returns N."""
    if x.dim() < 1:
        raise InputError(f"{what}: the input must have at least one dimension (features last); got a scalar")
    if weight.dim() != 2 or weight.shape[1] != inner:
        raise InputError(f"{what}: weight must be [N, {inner}] (nn.Linear's [out_features, in_features]); got {tuple(weight.shape)}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise InputError(f"{what}: weight is {weight.dtype} on {weight.device}, the input {x.dtype} on {x.device}; they must match")
    return weight.shape[0]


def _check_bias(bias: torch.Tensor | None, n: int, x: torch.Tensor) -> None:
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or bias.dtype != x.dtype or bias.device != x.device):
        raise InputError(f"linear: bias must be a {x.dtype} [{n}] tensor on {x.device}; got {bias.dtype} {tuple(bias.shape)} "
                         f"on {bias.device}")  # fmt: skip


def _check_halves(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        raise InputError(f"silu_mul_linear: a and b must have one shape, dtype and device; got {a.dtype} {tuple(a.shape)} "
                         f"on {a.device} and {b.dtype} {tuple(b.shape)} on {b.device}")  # fmt: skip
    if a.dim() < 1:
        raise InputError("silu_mul_linear: a and b must have at least one dimension (features last); got scalars")


def _check_rope(what: str, x: torch.Tensor, n: int, rope_cos: torch.Tensor | None, rope_sin: torch.Tensor | None,
                rope_cols: int) -> bool:  # fmt: skip
    """Refuse a rotation no path applies; True when one is asked for (`check_rope_columns`
    without the launch's row and stride checks: safe under symbolic sizes)."""
    return check_rope_columns(what, x, n, rope_cos, rope_sin, rope_cols, launch=False) is not None


def _check_rope_rows(what: str, rope_cos: torch.Tensor, rope_sin: torch.Tensor, m: int) -> None:
    """The rotation's rows against the ``m`` rows of x (when the op runs)."""
    if rope_cos.shape[0] != m or rope_sin.shape[0] != m:
        raise InputError(f"{what}: rope_cos / rope_sin hold {rope_cos.shape[0]} / {rope_sin.shape[0]} rows for {m} rows of x")


def _rotate_columns(y: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, rope_cols: int, real: int) -> torch.Tensor:
    """``y: [..., N]`` (a fresh output) with the first ``real`` rows' first ``rope_cols`` columns,
    heads of ``D``, rotated in place by HF's rotate-half RoPE (row ``r`` by ``rope_cos[r]``,
    ``rope_sin[r]``; `attngraph.rope`: fp32, rounded once). Returns ``y``."""
    n, d = y.shape[-1], rope_cos.shape[-1]
    m = y.numel() // n if n else 0
    if not real:
        return y
    heads = y.view(m, n)[:real, :rope_cols].unflatten(1, (rope_cols // d, d))  # [real, H, D] view
    from .rope import rope_columns_

    rope_columns_(heads, rope_cos[:real], rope_sin[:real])
    return y


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` computed in fp32 and rounded once to ``a``'s dtype (the kernel's and an
    inductor-fused producer's rounding; eager rounds twice): one Triton launch where the
    kernels serve (the product inductor fused into one kernel before the fold), else torch."""
    k = a.shape[-1] if a.dim() else 0
    if k and a.numel() and a.dtype in _KERNEL_DTYPES and _kernel_serves(a.device) and a.stride(-1) == 1 and b.stride(-1) == 1:
        rows = a.numel() // k
        return _kernels().silu_mul(a.reshape(rows, k), b.reshape(rows, k)).view(a.shape)
    return (F.silu(a.float()) * b.float()).to(a.dtype)


def _rope_fits(rope: bool, rope_cos: torch.Tensor | None, rope_sin: torch.Tensor | None) -> bool:
    """Whether the GEMV can rotate in its epilogue (unit stride along D)."""
    return not rope or (rope_cos.stride(-1) == 1 and rope_sin.stride(-1) == 1) or rope_cos.shape[-1] <= 1


def linear_impl(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, rows: int = ANY_ROWS,
                rope_cos: Optional[torch.Tensor] = None, rope_sin: Optional[torch.Tensor] = None,
                rope_cols: int = 0) -> torch.Tensor:  # fmt: skip
    """``F.linear(x, weight, bias)``: ``x: [..., K]``, ``weight: [N, K]``, ``bias: [N]`` or None
    -> ``[..., N]`` (a new tensor), by the skinny Triton kernel where it serves (see the module).
    ``rows``: what x's rows are (`ANY_ROWS`...); on the kernel's path a padded step's padding
    rows of the output are left unwritten.

    ``rope_cos``, ``rope_sin``: ``[rows of x, D]``; with them the first ``rope_cols`` output
    columns (heads of ``D``: q and k of a fused projection) leave rotated by HF's rotate-half
    RoPE (`passes.fold_rope_linear`): in the GEMV's or the tensor-core kernel's epilogue,
    else by one more launch after the product (`attngraph.rope.rope_columns_`)."""
    k = x.shape[-1] if x.dim() else 0
    n = _check_linear("linear", x, weight, k)
    _check_bias(bias, n, x)
    rope = _check_rope("linear", x, n, rope_cos, rope_sin, rope_cols)
    m = x.numel() // k if k else 0
    if rope:
        _check_rope_rows("linear", rope_cos, rope_sin, m)
    real = real_rows(rows, m)
    if not _use_kernel(real, k, x, weight) or (bias is not None and bias.stride(0) != 1 and n > 1) \
            or not _rope_fits(rope, rope_cos, rope_sin):  # fmt: skip
        return _project(x, weight, bias, real, (rope_cos, rope_sin, rope_cols) if rope else None)
    # [m, K]: a view of a row-strided x (unit stride along K kept), a copy when none exists
    y = x.new_empty((m, n))
    _kernels().skinny_linear(x.reshape(m, k)[:real], weight, bias, out=y[:real], rope_cos=rope_cos, rope_sin=rope_sin,
                             rope_cols=rope_cols)  # fmt: skip
    return y.view(*x.shape[:-1], n)


def silu_mul_linear_impl(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, rows: int = ANY_ROWS) -> torch.Tensor:
    """``F.linear(silu(a) * b, weight)``: ``a, b: [..., I]`` (e.g. the halves of a fused gate/up
    output), ``weight: [N, I]`` -> ``[..., N]`` (a new tensor). ``silu(a) * b`` is rounded once
    to the inputs' dtype (`silu_mul`), on both paths. ``rows``: as for `linear_impl`."""
    _check_halves(a, b)
    k = a.shape[-1]
    n = _check_linear("silu_mul_linear", a, weight, k)
    m = a.numel() // k if k else 0
    real = real_rows(rows, m)
    if not (k == 1 or b.stride(-1) == 1):
        return F.linear(silu_mul(a, b), weight)
    if not _use_kernel(real, k, a, weight, KERNEL_MAX_SILU_MUL_WEIGHT):
        # the product in one launch, then tensor cores or cuBLAS (the tensor-core kernel with
        # the product folded in lost its pipelining: 1B down 22.4 against 19.9 us at 16 rows)
        return _project(silu_mul(a, b), weight, None, real)
    y = a.new_empty((m, n))
    _kernels().skinny_silu_mul_linear(a.reshape(m, k)[:real], b.reshape(m, k)[:real], weight, out=y[:real])
    return y.view(*a.shape[:-1], n)


def _rms_norm_torch(h: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm, op for op (``LlamaRMSNorm.forward``): the CPU path, bit-equal to eager."""
    hf = h.to(torch.float32)
    return norm_weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


@functools.lru_cache(maxsize=1)
def _norm_kernel():
    """The `rms_norm` module (imported on first use, with Triton)."""
    from . import rms_norm

    return rms_norm


def _norm_kernel_serves(x: torch.Tensor, norm_weight: torch.Tensor) -> bool:
    """Whether the standalone RMSNorm kernel (`attngraph.rms_norm`) runs these rows."""
    k = x.shape[-1]
    return (x.dtype in _KERNEL_DTYPES and _kernel_serves(x.device) and 0 < k <= _norm_kernel().MAX_K
            and norm_weight.is_contiguous() and (k == 1 or x.stride(-1) == 1))  # fmt: skip


def _check_norm(what: str, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor) -> None:
    if x.dim() < 1:
        raise InputError(f"{what}: the input must have at least one dimension (features last); got a scalar")
    k = x.shape[-1]
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device):
        raise InputError(f"{what}: residual must match x ({x.dtype} {tuple(x.shape)} on {x.device}); got "
                         f"{residual.dtype} {tuple(residual.shape)} on {residual.device}")  # fmt: skip
    if norm_weight.dim() != 1 or norm_weight.shape[0] != k or norm_weight.dtype != x.dtype or norm_weight.device != x.device:
        raise InputError(f"{what}: norm_weight must be a {x.dtype} [{k}] tensor on {x.device}; got "
                         f"{norm_weight.dtype} {tuple(norm_weight.shape)} on {norm_weight.device}")  # fmt: skip


def _norm_linear(x, residual, norm_weight, eps, weight, bias, rows, rope_cos=None, rope_sin=None,
                 rope_cols=0) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``(F.linear(rms_norm(h), weight, bias), h)``, ``h = x (+ residual)`` (None without one),
    the first ``rope_cols`` columns rotated where ``rope_cos`` is given (`linear_impl`)."""
    what = "rms_norm_linear" if residual is None else "add_rms_norm_linear"
    _check_norm(what, x, residual, norm_weight)
    k = x.shape[-1]
    n = _check_linear(what, x, weight, k)
    _check_bias(bias, n, x)
    rope = _check_rope(what, x, n, rope_cos, rope_sin, rope_cols)
    m = x.numel() // k if k else 0
    if rope:
        _check_rope_rows(what, rope_cos, rope_sin, m)
    real = real_rows(rows, m)
    plain = (residual is None or k <= 1 or residual.stride(-1) == 1) and (bias is None or n <= 1 or bias.stride(0) == 1)
    fold = None  # a kernel with the norm folded into its loads: the GEMV, or on tensor cores
    if plain and norm_weight.is_contiguous():
        if _use_kernel(real, k, x, weight) and _rope_fits(rope, rope_cos, rope_sin):
            fold = _kernels().skinny_rms_norm_linear
        elif DOT_FOLD_NORM and _use_dot(real, k, x, weight):
            fold = _dot_kernels().skinny_dot_rms_norm_linear
    if fold is not None:
        y = x.new_empty((m, n))
        h = x.new_empty((m, k)) if residual is not None else None
        # the GEMV rotates in its epilogue; the tensor-core kernel where its blocks hold a head's pairs
        in_kernel = rope and (fold is _kernels().skinny_rms_norm_linear or _rope_in_dot((rope_cos, rope_sin, rope_cols)))
        extra = dict(rope_cos=rope_cos, rope_sin=rope_sin, rope_cols=rope_cols) if in_kernel else {}
        fold(
            x.reshape(m, k)[:real], norm_weight, eps, weight, bias,
            residual=None if residual is None else residual.reshape(m, k)[:real],
            out=y[:real], h_out=None if h is None else h[:real], **extra,
        )  # fmt: skip
        if rope and not in_kernel:
            _rotate_columns(y, rope_cos, rope_sin, rope_cols, real)
        return y.view(*x.shape[:-1], n), None if h is None else h.view(x.shape)
    normed, h = _add_rms_norm(x, residual, norm_weight, eps)
    return _project(normed, weight, bias, real, (rope_cos, rope_sin, rope_cols) if rope else None), h


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``(norm_weight * rmsnorm(h), h)``, ``h = x (+ residual)`` (None without one), ``[..., K]``:
    one launch of `attngraph.rms_norm` where it serves, else HF's ops."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if m and _norm_kernel_serves(x, norm_weight) and (residual is None or residual.stride(-1) == 1 or k == 1):
        normed, h = _norm_kernel().add_rms_norm(x.reshape(m, k), norm_weight, eps, None if residual is None else residual.reshape(m, k))
        return normed.view(x.shape), None if h is None else h.view(x.shape)
    h = x + residual if residual is not None else None
    return _rms_norm_torch(x if h is None else h, norm_weight, eps), h


def rms_norm_linear_impl(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, rows: int = ANY_ROWS,
                         rope_cos: Optional[torch.Tensor] = None, rope_sin: Optional[torch.Tensor] = None,
                         rope_cols: int = 0) -> torch.Tensor:  # fmt: skip
    """``F.linear(norm_weight * rmsnorm(x), weight, bias)`` with HF's RMSNorm (``eps``; fp32
    statistics, the normed row and its product with ``norm_weight`` rounded to x's dtype):
    ``x: [..., K]``, ``norm_weight: [K]``, ``weight: [N, K]``, ``bias: [N]`` or None ->
    ``[..., N]``. The GEMV folds the norm into its loads where it serves; elsewhere one
    RMSNorm launch (`attngraph.rms_norm`, on CUDA) or torch's ops, then ``F.linear``.
    ``rows``, ``rope_cos``, ``rope_sin``, ``rope_cols``: as for `linear_impl`."""
    return _norm_linear(x, None, norm_weight, eps, weight, bias, rows, rope_cos, rope_sin, rope_cols)[0]


def add_rms_norm_linear_impl(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                             weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                             rows: int = ANY_ROWS, rope_cos: Optional[torch.Tensor] = None,
                             rope_sin: Optional[torch.Tensor] = None,
                             rope_cols: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(F.linear(norm_weight * rmsnorm(h), weight, bias), h)`` with ``h = x + residual``
    (rounded to x's dtype: the model's residual stream, which it reads again). ``x, residual:
    [..., K]``; otherwise as `rms_norm_linear_impl`. On the GEMV's path one program writes
    ``h`` (the real rows; a padded step's padding rows of both outputs are left unwritten)."""
    y, h = _norm_linear(x, residual, norm_weight, eps, weight, bias, rows, rope_cos, rope_sin, rope_cols)
    return y, h


def _check_norm_after(what: str, x: torch.Tensor, n: int, residual: torch.Tensor, norm_weight: torch.Tensor) -> None:
    """The residual and norm weight of a norm over a projection's ``[..., n]`` output."""
    shape = (*x.shape[:-1], n)
    if tuple(residual.shape) != shape or residual.dtype != x.dtype or residual.device != x.device:
        raise InputError(f"{what}: residual must be a {x.dtype} {list(shape)} tensor on {x.device} like the product; got "
                         f"{residual.dtype} {tuple(residual.shape)} on {residual.device}")  # fmt: skip
    if norm_weight.dim() != 1 or norm_weight.shape[0] != n or norm_weight.dtype != x.dtype or norm_weight.device != x.device:
        raise InputError(f"{what}: norm_weight must be a {x.dtype} [{n}] tensor on {x.device}; got "
                         f"{norm_weight.dtype} {tuple(norm_weight.shape)} on {norm_weight.device}")  # fmt: skip


def linear_add_rms_norm_impl(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                             norm_weight: torch.Tensor, eps: float,
                             rows: int = ANY_ROWS) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(norm_weight * rmsnorm(h), h)`` with ``h = F.linear(x, weight, bias) + residual``: a
    projection, the residual add after it and HF's RMSNorm of the sum (`passes.fold_norm_epilogue`:
    a decoder layer's output projection and the norm in front of an MLP whose gate/up product
    runs on cuBLAS). ``x: [..., K]``, ``weight: [N, K]``, ``bias: [N]`` or None, ``residual:
    [..., N]``, ``norm_weight: [N]`` -> two ``[..., N]`` tensors.

    Where the GEMV serves the projection (1-2 rows) one launch computes all three, the norm in
    its epilogue (`skinny_linear.skinny_linear_add_rms_norm`); elsewhere the projection as
    `linear_impl` runs it, then one RMSNorm launch (`attngraph.rms_norm`) or HF's ops: the
    launches of before. The values are those of the separate ops either way. ``rows``: as for
    `linear_impl` (a padded step's padding rows are left unwritten on the GEMV's path)."""
    what = "linear_add_rms_norm"
    k = x.shape[-1] if x.dim() else 0
    n = _check_linear(what, x, weight, k)
    _check_bias(bias, n, x)
    _check_norm_after(what, x, n, residual, norm_weight)
    m = x.numel() // k if k else 0
    real = real_rows(rows, m)
    plain = (n <= 1 or residual.stride(-1) == 1) and (bias is None or n <= 1 or bias.stride(0) == 1)
    if plain and norm_weight.is_contiguous() and _use_kernel(real, k, x, weight) and n <= _norm_kernel().MAX_K:
        normed, h = x.new_empty((m, n)), x.new_empty((m, n))
        _kernels().skinny_linear_add_rms_norm(
            x.reshape(m, k)[:real], weight, bias, residual.reshape(m, n)[:real], norm_weight, eps,
            out=normed[:real], h_out=h[:real],
        )  # fmt: skip
        return normed.view(residual.shape), h.view(residual.shape)
    y = linear_impl(x, weight, bias, rows)
    normed, h = _add_rms_norm(y, residual, norm_weight, eps)
    return normed, h


def _gated_dot_serves(rows: int, k: int, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether ``rows`` rows of a gated MLP run its gate/up product with the activation in the
    tensor-core kernel's epilogue: where the kernel takes both products and the GEMV neither
    (its own folds serve one and two rows), and `DOT_FOLD_NORM` does not ask for the norm in
    the product's loads (which the gated launch does not fold: the ops it replaces run then)."""
    inter = w_gate_up.shape[0] // 2
    head = w_gate_up.shape[0] >= KERNEL_MIN_HEAD_RATIO * k  # no gated MLP's: the op runs the ops it replaces
    return (not DOT_FOLD_NORM and not head and _use_dot(rows, k, x, w_gate_up, DOT_MAX_GATED_WEIGHT)
            and not _use_kernel(rows, k, x, w_gate_up)
            and not _use_kernel(rows, inter, x, w_down, KERNEL_MAX_SILU_MUL_WEIGHT))  # fmt: skip


def _check_gated_mlp(what: str, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> int:
    """Refuse what no path serves; returns the intermediate size I."""
    k = x.shape[-1]
    _check_linear(what, x, w_gate_up, k)
    if w_gate_up.shape[0] % 2:
        raise InputError(f"{what}: w_gate_up must be [2I, K], the gate rows then the up rows; got {tuple(w_gate_up.shape)}")
    inter = w_gate_up.shape[0] // 2
    _check_linear(what, x, w_down, inter)
    return inter


def add_rms_norm_gated_mlp_impl(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                w_gate_up: torch.Tensor, w_down: torch.Tensor,
                                rows: int = ANY_ROWS) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A decoder layer's gated MLP with the residual add and HF's RMSNorm before it:
    ``(F.linear(silu(g) * u, w_down), h)`` with ``[g | u] = F.linear(norm_weight *
    rmsnorm(h), w_gate_up)`` and ``h = x + residual`` (the residual stream, rounded to x's
    dtype). ``x, residual: [..., K]``, ``norm_weight: [K]``, ``w_gate_up: [2I, K]`` (gate rows,
    then up rows), ``w_down: [N, I]`` -> ``([..., N], [..., K])``. ``rows``: as for `linear_impl`.

    Where the tensor-core kernel takes the rows (`_gated_dot_serves`): the norm's launch
    (`attngraph.rms_norm`), the gate/up product with ``silu(g) * u`` in its epilogue
    (`skinny_dot.skinny_dot_gated_linear`: no SiLU-mul launch) and the down product. Elsewhere
    exactly `add_rms_norm_linear_impl` then `silu_mul_linear_impl` on the product's halves (the
    GEMV's folds at one and two rows). Each product is rounded to the dtype and ``silu(g) * u``
    computed in fp32 and rounded once on every path."""
    what = "add_rms_norm_gated_mlp"
    _check_norm(what, x, residual, norm_weight)
    inter = _check_gated_mlp(what, x, w_gate_up, w_down)
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    real = real_rows(rows, m)
    if (norm_weight.is_contiguous() and residual.stride(-1) == 1 and k > 1 and w_down.is_contiguous()
            and _gated_dot_serves(real, k, x, w_gate_up, w_down)):  # fmt: skip
        normed, h = _add_rms_norm(x, residual, norm_weight, eps)
        act = x.new_empty((m, inter))
        _dot_kernels().skinny_dot_gated_linear(normed.reshape(m, k)[:real], w_gate_up, out=act[:real])
        return _project(act, w_down, None, real).view(*x.shape[:-1], w_down.shape[0]), h
    y, h = add_rms_norm_linear_impl(x, residual, norm_weight, eps, w_gate_up, None, rows)
    return silu_mul_linear_impl(y[..., :inter], y[..., inter:], w_down, rows), h


linear = torch.library.custom_op("attngraph::linear", mutates_args=())(linear_impl)
linear.__doc__ = linear_impl.__doc__
silu_mul_linear = torch.library.custom_op("attngraph::silu_mul_linear", mutates_args=())(silu_mul_linear_impl)
silu_mul_linear.__doc__ = silu_mul_linear_impl.__doc__


rms_norm_linear = torch.library.custom_op("attngraph::rms_norm_linear", mutates_args=())(rms_norm_linear_impl)
rms_norm_linear.__doc__ = rms_norm_linear_impl.__doc__
add_rms_norm_linear = torch.library.custom_op("attngraph::add_rms_norm_linear", mutates_args=())(add_rms_norm_linear_impl)
add_rms_norm_linear.__doc__ = add_rms_norm_linear_impl.__doc__


linear_add_rms_norm = torch.library.custom_op("attngraph::linear_add_rms_norm", mutates_args=())(linear_add_rms_norm_impl)
linear_add_rms_norm.__doc__ = linear_add_rms_norm_impl.__doc__
add_rms_norm_gated_mlp = torch.library.custom_op("attngraph::add_rms_norm_gated_mlp",
                                                 mutates_args=())(add_rms_norm_gated_mlp_impl)  # fmt: skip
add_rms_norm_gated_mlp.__doc__ = add_rms_norm_gated_mlp_impl.__doc__


@add_rms_norm_gated_mlp.register_fake
def _(x, residual, norm_weight, eps, w_gate_up, w_down, rows=ANY_ROWS):
    _check_norm("add_rms_norm_gated_mlp", x, residual, norm_weight)
    _check_gated_mlp("add_rms_norm_gated_mlp", x, w_gate_up, w_down)
    return x.new_empty((*x.shape[:-1], w_down.shape[0])), x.new_empty(x.shape)


@linear_add_rms_norm.register_fake
def _(x, weight, bias, residual, norm_weight, eps, rows=ANY_ROWS):
    n = _check_linear("linear_add_rms_norm", x, weight, x.shape[-1] if x.dim() else 0)
    _check_bias(bias, n, x)
    _check_norm_after("linear_add_rms_norm", x, n, residual, norm_weight)
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape)


@rms_norm_linear.register_fake
def _(x, norm_weight, eps, weight, bias=None, rows=ANY_ROWS, rope_cos=None, rope_sin=None, rope_cols=0):
    _check_norm("rms_norm_linear", x, None, norm_weight)
    n = _check_linear("rms_norm_linear", x, weight, x.shape[-1])
    _check_bias(bias, n, x)
    _check_rope("rms_norm_linear", x, n, rope_cos, rope_sin, rope_cols)
    return x.new_empty((*x.shape[:-1], n))


@add_rms_norm_linear.register_fake
def _(x, residual, norm_weight, eps, weight, bias=None, rows=ANY_ROWS, rope_cos=None, rope_sin=None, rope_cols=0):
    _check_norm("add_rms_norm_linear", x, residual, norm_weight)
    n = _check_linear("add_rms_norm_linear", x, weight, x.shape[-1])
    _check_bias(bias, n, x)
    _check_rope("add_rms_norm_linear", x, n, rope_cos, rope_sin, rope_cols)
    return x.new_empty((*x.shape[:-1], n)), x.new_empty(x.shape)


@linear.register_fake
def _(x, weight, bias=None, rows=ANY_ROWS, rope_cos=None, rope_sin=None, rope_cols=0):
    n = _check_linear("linear", x, weight, x.shape[-1] if x.dim() else 0)
    _check_bias(bias, n, x)
    _check_rope("linear", x, n, rope_cos, rope_sin, rope_cols)
    return x.new_empty((*x.shape[:-1], n))


@silu_mul_linear.register_fake
def _(a, b, weight, rows=ANY_ROWS):
    _check_halves(a, b)
    n = _check_linear("silu_mul_linear", a, weight, a.shape[-1])
    return a.new_empty((*a.shape[:-1], n))
