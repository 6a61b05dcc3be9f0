"""`rope_qk`: a step's queries and keys rotated in one Triton launch (`attngraph.rope`).

Grid ``(T, cdiv(Hq, BLOCK_H) + cdiv(Hkv, BLOCK_H))``: a program rotates ``BLOCK_H`` heads of
one token, of q or of k, reading the token's ``cos`` and ``sin`` rows once; fp32, rounded once
to the inputs' dtype. Launched with programmatic dependent launch where `attngraph.pdl` allows
it (the program waits before its first read: q and k come from the kernel before).
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
from .triton_math import rotate_half_rows, round_to

__all__ = ["rope_inplace", "rope_qk"]


@triton.jit
def _rotate_block(X, O, t, h0, H, stride_t, stride_h, stride_ot, stride_oh, c, s, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_H: tl.constexpr, SOFT_BF16: tl.constexpr):  # fmt: skip
    """Heads ``[h0, h0 + BLOCK_H)`` (of ``H``) of token ``t`` of ``X`` rotated into ``O``
    (``[T, H, D]``, rows ``stride_ot`` / heads ``stride_oh`` apart; ``O`` may be ``X``: a
    program loads its heads whole before it stores them)."""
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    heads = h0 + tl.arange(0, BLOCK_H)
    mask = (heads < H)[:, None] & mask_d[None, :]
    rows = X + t * stride_t + heads[:, None].to(tl.int64) * stride_h
    x = tl.load(rows + offs_d[None, :], mask=mask, other=0.0)
    x_rot = tl.load(rows + ((offs_d + D // 2) % D)[None, :], mask=mask, other=0.0)
    y = rotate_half_rows(x, x_rot, offs_d, c, s, D // 2)
    out = O + t * stride_ot + heads[:, None].to(tl.int64) * stride_oh + offs_d[None, :]
    tl.store(out, round_to(y, O.dtype.element_ty, SOFT_BF16), mask=mask)


@triton.jit
def _rope_kernel(Q, K, Cos, Sin, QO, KO, HQ, HK, stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
                 stride_qot, stride_qoh, stride_kot, stride_koh, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_H: tl.constexpr, SOFT_BF16: tl.constexpr,
                 USE_PDL: tl.constexpr):  # fmt: skip
    """``QO[t] = rope(Q[t])``, ``KO[t] = rope(K[t])`` for token ``t = program_id(0)``; QO, KO
    ``[T, H, D]`` with their own strides (unit stride along D)."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    q_blocks = tl.cdiv(HQ, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    c = tl.load(Cos + t * stride_ct + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    s = tl.load(Sin + t * stride_st + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    if hb < q_blocks:
        _rotate_block(Q, QO, t, hb * BLOCK_H, HQ, stride_qt, stride_qh, stride_qot, stride_qoh, c, s, D, BLOCK_D, BLOCK_H,
                      SOFT_BF16)  # fmt: skip
    else:
        _rotate_block(K, KO, t, (hb - q_blocks) * BLOCK_H, HK, stride_kt, stride_kh, stride_kot, stride_koh, c, s, D,
                      BLOCK_D, BLOCK_H, SOFT_BF16)  # fmt: skip


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q: [T, Hq, D]``, ``k: [T, Hkv, D]`` (unit stride along D), ``cos, sin: [T, D]`` (unit
    stride along D), validated by `attngraph.rope.check_rope` -> rotated contiguous copies."""
    t, hq, d = q.shape
    hk = k.shape[1]
    q = q if d <= 1 or q.stride(2) == 1 else q.contiguous()
    k = k if d <= 1 or k.stride(2) == 1 else k.contiguous()
    qo = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((t, hk, d), dtype=k.dtype, device=k.device)
    _launch(q, k, cos, sin, qo, ko)
    return qo, ko


def rope_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x: [T, H, D]`` (unit stride along D, any other strides: columns of a projection's
    output) rotated in place by ``cos, sin: [T, D]`` in one launch. Returns ``x``."""
    if x.shape[2] > 1 and x.stride(2) != 1:
        raise InputError(f"rope_inplace: x needs unit stride along D; got strides {tuple(x.stride())} "
                         "(rotate a contiguous copy, or use attngraph.rope.rope_columns_)")
    _launch(x, x[:, :0], cos, sin, x, x[:, :0])
    return x


def _launch(q, k, cos, sin, qo, ko) -> None:
    """One launch rotating ``q`` into ``qo`` and ``k`` into ``ko`` (``[T, H, D]``, unit stride
    along D)."""
    t, hq, d = q.shape
    hk = k.shape[1]
    cos = cos if d <= 1 or cos.stride(1) == 1 else cos.contiguous()
    sin = sin if d <= 1 or sin.stride(1) == 1 else sin.contiguous()
    if t == 0 or hq + hk == 0:
        return
    block_d = triton.next_power_of_2(d)
    block_h = max(1, min(16, 2048 // block_d))
    grid = (t, triton.cdiv(hq, block_h) + triton.cdiv(hk, block_h))
    use_pdl = pdl.enabled(q.device)
    guard = torch.cuda.device(q.device) if q.is_cuda and q.device.index != torch.cuda.current_device() else nullcontext()
    with guard:
        _rope_kernel[grid](
            q, k, cos, sin, qo, ko, hq, hk, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
            qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1),
            D=d, BLOCK_D=block_d, BLOCK_H=block_h, SOFT_BF16=q.dtype == torch.bfloat16 and interpreting(),
            USE_PDL=use_pdl, num_warps=4, **pdl.launch_options(use_pdl),
        )  # fmt: skip
