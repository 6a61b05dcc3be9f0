"""The greedy token of each row of logits, ``torch.argmax(logits, dim=-1)``, spread over the GPU.

torch's reduction gives each output row to one thread block: a decode step's argmax over a
128256-token vocabulary reads 256 KB (bf16) on one SM, about 30 us on an H100, near 3% of a
1B-model decode step. Here the row is split into chunks of `CHUNK` elements:

1. grid ``(rows, chunks)``: each program finds its chunk's maximum and the first index that
   holds it (or its first NaN), written to ``[rows, chunks]`` partial buffers;
2. grid ``(rows,)``: each program picks, over its row's chunks in order, the first NaN's index
   if there is one, else the first index of the largest value.

That is torch's rule exactly (NaN counts as the largest value; ties, ``-0.0 == 0.0`` included,
go to the first index), so the tokens are the same. Values are compared after widening to
fp32, which is exact for bf16 and fp16 and keeps their order. Both launches use programmatic
dependent launch where `attngraph.pdl` allows it.
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

__all__ = ["CHUNK", "argmax_last_dim"]

#: Pick tokens with the kernels here (False: torch.argmax everywhere, for comparison).
KERNELS = True
#: Run the kernels on CPU tensors through Triton's interpreter (tests; needs ``TRITON_INTERPRET=1``
#: set before import). Off: CPU tensors take torch.argmax.
CPU_INTERPRETER = False
#: Elements per program of the first launch: a 128256-token row is 63 programs of 4 KB (bf16).
CHUNK = 2048
#: Larger than any index (the kernels' "none" in a min over indices).
_NONE = tl.constexpr(2**31 - 1)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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


def _kernel_applies(logits: torch.Tensor) -> bool:
    """Whether the kernels take ``logits`` (else torch.argmax does, with its own errors)."""
    return (
        KERNELS
        and (logits.is_cuda or (logits.device.type == "cpu" and CPU_INTERPRETER and interpreting()))
        and logits.dtype in _DTYPES
        and logits.dim() >= 1
        and logits.shape[-1] > 0
        and logits.stride(-1) == 1
        and logits.shape[-1] < 2**31 - 1
    )


def argmax_last_dim(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)``, the same indices, in two launches over the vocabulary.

    ``logits``: ``[..., V]`` bf16, fp16 or fp32 on CUDA (or the CPU under Triton's
    interpreter, with `CPU_INTERPRETER`), unit stride along V; the leading dims are flattened
    to rows ``[M]`` (any row stride). ``out``: int64 of ``logits.shape[:-1]`` on the same device (written in place and
    returned), or None for a new tensor. Anything else (another device or dtype, V = 0, a
    strided V) is torch.argmax's: the same result, or torch's error. CUDA-graph safe (the
    partials are allocated per call, from the capture's pool inside a capture).
    """
    lead = logits.shape[:-1]
    if out is not None and (out.dtype != torch.int64 or tuple(out.shape) != tuple(lead) or out.device != logits.device):
        raise InputError(f"argmax_last_dim: out must be int64 {tuple(lead)} on {logits.device}; got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")  # fmt: skip
    if not _kernel_applies(logits):
        return torch.argmax(logits, dim=-1, out=out) if out is not None else torch.argmax(logits, dim=-1)
    n = logits.shape[-1]
    x = logits.reshape(-1, n)  # a view where the rows are evenly spaced (always for [M, V])
    m = x.shape[0]
    result = out if out is not None else torch.empty(lead, dtype=torch.int64, device=logits.device)
    if m == 0:
        return result
    try:  # [M] rows of the result, evenly spaced (a 1-D out of any stride is)
        flat = result.view(-1)
    except RuntimeError:
        flat = None
    target = flat if flat is not None else torch.empty(m, dtype=torch.int64, device=logits.device)
    chunks = triton.cdiv(n, CHUNK)
    block = min(CHUNK, triton.next_power_of_2(n))
    part_v = torch.empty((m, chunks), dtype=torch.float32, device=logits.device)
    part_i = torch.empty((m, chunks), dtype=torch.int32, device=logits.device)
    use_pdl = pdl.enabled(logits.device)
    guard = (torch.cuda.device(logits.device) if logits.is_cuda and logits.device.index != torch.cuda.current_device()
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
    if flat is None:
        result.copy_(target.view(lead))
    return result
