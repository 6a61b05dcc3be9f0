"""The Triton kernels of `attngraph.argmax` (imported only where Triton is): a row's chunks'
maxima and first indices, then each row's merge. See `attngraph.argmax` for the rule."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import triton
import triton.language as tl

from . import pdl
from .attn_backends.triton_ops.decode_attention import interpreter_problem, interpreting
from .pdl import gdc_launch_dependents, gdc_wait

__all__ = ["interpreter_problem", "interpreting", "launch"]

#: Larger than any index (the kernels' "none" in a min over indices).
_NONE = tl.constexpr(2**31 - 1)


@triton.jit
def _chunk_argmax_kernel(X, PV, PI, N, stride_xm, chunks, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Row ``program_id(0)``, chunk ``program_id(1)`` of ``X: [M, N]`` (rows ``stride_xm``
    apart): ``PV[row, chunk]`` = the chunk's largest value (NaN if it has one) in fp32,
    ``PI[row, chunk]`` = its first index. PV, PI: ``[M, chunks]`` contiguous."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = offs < N
    if USE_PDL:  # X is the output of the kernel before (the LM head): wait for it
        gdc_wait()
        gdc_launch_dependents()
    x = tl.load(X + row * stride_xm + offs, mask=mask, other=float("-inf")).to(tl.float32)
    nan = (x != x) & mask
    first_nan = tl.min(tl.where(nan, offs, _NONE), axis=0)
    top = tl.max(tl.where(nan, float("-inf"), x), axis=0)
    first_top = tl.min(tl.where((x == top) & mask, offs, _NONE), axis=0)
    has_nan = first_nan < _NONE
    tl.store(PV + row * chunks + chunk, tl.where(has_nan, float("nan"), top))
    tl.store(PI + row * chunks + chunk, tl.where(has_nan, first_nan, first_top))


@triton.jit
def _merge_argmax_kernel(PV, PI, Out, chunks, stride_om, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr):
    """Row ``program_id(0)``: ``Out[row]`` (int64, ``stride_om`` apart) = the first NaN's index
    among the row's chunks, else the first index of their largest value. Each chunk's index is
    its own first, and chunks are in order, so the smallest index among the chunks that hold
    the row's maximum (or a NaN) is the row's first."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    mask = c < chunks
    if USE_PDL:  # the partials are the kernel before's output
        gdc_wait()
        gdc_launch_dependents()
    v = tl.load(PV + row * chunks + c, mask=mask, other=float("-inf"))
    i = tl.load(PI + row * chunks + c, mask=mask, other=_NONE)
    nan = (v != v) & mask
    first_nan = tl.min(tl.where(nan, i, _NONE), axis=0)
    top = tl.max(tl.where(nan, float("-inf"), v), axis=0)
    first_top = tl.min(tl.where((v == top) & mask, i, _NONE), axis=0)
    tl.store(Out + row * stride_om, tl.where(first_nan < _NONE, first_nan, first_top).to(tl.int64))


def launch(x: torch.Tensor, target: torch.Tensor, chunk: int) -> None:
    """``target[r] = argmax(x[r])`` for ``x: [M, N]`` (unit stride along N, M >= 1, N >= 1) into
    the int64 ``target: [M]`` (any stride), over chunks of ``chunk`` elements."""
    m, n = x.shape
    chunks = triton.cdiv(n, chunk)
    block = min(chunk, triton.next_power_of_2(n))
    part_v = torch.empty((m, chunks), dtype=torch.float32, device=x.device)
    part_i = torch.empty((m, chunks), dtype=torch.int32, device=x.device)
    use_pdl = pdl.enabled(x.device)
    guard = (torch.cuda.device(x.device) if x.is_cuda and x.device.index != torch.cuda.current_device()
             else nullcontext())  # fmt: skip
    with guard:
        _chunk_argmax_kernel[(m, chunks)](
            x, part_v, part_i, n, x.stride(0), chunks, BLOCK=block, USE_PDL=use_pdl,
            num_warps=max(1, min(8, block // 256)), **pdl.launch_options(use_pdl),
        )  # fmt: skip
        _merge_argmax_kernel[(m,)](
            part_v, part_i, target, chunks, target.stride(0),
            BLOCK_C=max(2, triton.next_power_of_2(chunks)), USE_PDL=use_pdl, num_warps=1, **pdl.launch_options(use_pdl),
        )  # fmt: skip
