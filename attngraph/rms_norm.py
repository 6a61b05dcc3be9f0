"""HF's RMSNorm (after an optional residual add) in one Triton launch.

What `linear_ops.rms_norm_linear` runs in front of cuBLAS when its rows are too many for the
GEMV that folds the norm into its loads (`skinny_linear.skinny_rms_norm_linear`): the one
kernel inductor fused for the same graph before the fold, with the same roundings as the
GEMV's prologue, so a step computes the same normed rows whichever path it takes:

* ``h = x + residual`` rounded to the dtype (the model's residual addition), written out;
* ``rstd = rsqrt(mean(h^2) + eps)`` in fp32 over the row;
* ``normed = weight * (h * rstd).to(dtype)``, the product rounded to the dtype.

One program per row (the whole row in registers: ``K <= MAX_K``); launched with programmatic
dependent launch where `attngraph.pdl` allows it (the norm weight loads before the wait).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import triton
import triton.language as tl

from . import pdl
from .attn_backends.triton_ops.decode_attention import interpreting
from .errors import InputError
from .pdl import gdc_launch_dependents, gdc_wait
from .triton_math import round_to as _round

__all__ = ["MAX_K", "add_rms_norm"]

#: Longest row one program holds (Llama-3.1-405B's hidden size is 16384).
MAX_K = 16384


@triton.jit
def _add_rms_norm_kernel(X, R, NW, Y, H, K, eps, stride_xm, stride_rm, stride_ym, stride_hm,
                         BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, SOFT_BF16: tl.constexpr,
                         USE_PDL: tl.constexpr):  # fmt: skip
    """Row ``program_id(0)``: ``Y = NW * rmsnorm(X (+ R))`` and, with ``RESIDUAL``, ``H = X + R``.
    X, R, Y, H: rows ``stride_*m`` apart, unit stride along K; NW: ``[K]``."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    DTYPE = X.dtype.element_ty
    nw = tl.load(NW + offs, mask=mask, other=0.0).to(tl.float32)  # a parameter: no kernel writes it
    if USE_PDL:  # X and R may still be being written by the kernel before (attngraph.pdl)
        gdc_wait()
        gdc_launch_dependents()
    h = tl.load(X + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL:
        r = tl.load(R + row * stride_rm + offs, mask=mask, other=0.0).to(tl.float32)
        h = _round(h + r, DTYPE, SOFT_BF16).to(tl.float32)
        tl.store(H + row * stride_hm + offs, h.to(DTYPE), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / K + eps)
    normed = _round(h * rstd, DTYPE, SOFT_BF16).to(tl.float32)
    tl.store(Y + row * stride_ym + offs, _round(nw * normed, DTYPE, SOFT_BF16), mask=mask)


def add_rms_norm(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(norm_weight * rmsnorm(h), h)`` with ``h = x`` (returned as None) or ``x + residual``.

    ``x``, ``residual``: ``[M, K]`` (rows any stride apart, unit stride along K; ``K <=
    MAX_K``), bf16, fp16 or fp32 on CUDA (or the CPU under Triton's interpreter);
    ``norm_weight``: ``[K]`` contiguous, same dtype. Returns new contiguous ``[M, K]`` tensors.
    """
    what = "add_rms_norm"
    if x.dim() != 2 or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                                   or residual.device != x.device)):  # fmt: skip
        raise InputError(f"{what}: x (and residual) must be [M, K] of one dtype and device; got {tuple(x.shape)}"
                         + ("" if residual is None else f" and {tuple(residual.shape)} {residual.dtype}"))  # fmt: skip
    if x.device.type != "cuda" and not interpreting():
        raise InputError(
            f"{what}: x is on {x.device}; the kernel needs a CUDA device, or Triton's CPU interpreter "
            "(TRITON_INTERPRET=1 set before importing attngraph) for CPU tensors"
        )
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InputError(f"{what}: x must be bfloat16, float16 or float32; got {x.dtype}")
    m, k = x.shape
    if k > MAX_K:
        raise InputError(f"{what}: rows of {k} elements; one program holds at most {MAX_K}")
    if (tuple(norm_weight.shape) != (k,) or norm_weight.dtype != x.dtype or norm_weight.device != x.device
            or (k > 1 and norm_weight.stride(0) != 1)):  # fmt: skip
        raise InputError(f"{what}: norm_weight must be a contiguous {x.dtype} [{k}] on {x.device}; got "
                         f"{norm_weight.dtype} {tuple(norm_weight.shape)} on {norm_weight.device}")  # fmt: skip
    if k > 1 and (x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1)):
        raise InputError(f"{what}: x and residual must be contiguous in their last dimension")
    y = torch.empty((m, k), dtype=x.dtype, device=x.device)
    h = torch.empty((m, k), dtype=x.dtype, device=x.device) if residual is not None else None
    if m == 0 or k == 0:
        return y, h
    r = residual if residual is not None else x
    hh = h if h is not None else y
    use_pdl = pdl.enabled(x.device)
    block = triton.next_power_of_2(k)
    guard = torch.cuda.device(x.device) if x.is_cuda and x.device.index != torch.cuda.current_device() else nullcontext()
    with guard:
        _add_rms_norm_kernel[(m,)](
            x, r, norm_weight, y, hh, k, float(eps), x.stride(0), r.stride(0), y.stride(0), hh.stride(0),
            BLOCK=block, RESIDUAL=residual is not None, SOFT_BF16=x.dtype == torch.bfloat16 and interpreting(),
            USE_PDL=use_pdl, num_warps=max(1, min(16, block // 512)), **pdl.launch_options(use_pdl),
        )  # fmt: skip
    return y, h
