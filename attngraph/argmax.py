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

import functools

import torch

from .errors import InputError

__all__ = ["CHUNK", "argmax_last_dim"]

#: Pick tokens with the kernels here (False: torch.argmax everywhere, for comparison).
KERNELS = True
#: Run the kernels on CPU tensors through Triton's interpreter (tests; needs ``TRITON_INTERPRET=1``
#: set before import). Off: CPU tensors take torch.argmax.
CPU_INTERPRETER = False
#: Elements per program of the first launch: a 128256-token row is 63 programs of 4 KB (bf16).
CHUNK = 2048
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.lru_cache(maxsize=1)
def _kernels():
    """The `argmax_kernels` module, or None where Triton cannot be imported (then torch.argmax)."""
    try:
        from . import argmax_kernels
    except ImportError:
        return None
    return argmax_kernels


def _kernel_applies(logits: torch.Tensor) -> bool:
    """Whether the kernels take ``logits`` (else torch.argmax does, with its own errors)."""
    if not (
        KERNELS
        and logits.dtype in _DTYPES
        and logits.dim() >= 1
        and logits.shape[-1] > 0
        and logits.stride(-1) == 1
        and logits.shape[-1] < 2**31 - 1
    ):
        return False
    if logits.is_cuda:
        mod = _kernels()
        return mod is not None and not mod.interpreting()
    if logits.device.type == "cpu" and CPU_INTERPRETER:
        mod = _kernels()
        return mod is not None and mod.interpreting() and mod.interpreter_problem() is None
    return False


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
    _kernels().launch(x, target, CHUNK)
    if flat is None:
        result.copy_(target.view(lead))
    return result
