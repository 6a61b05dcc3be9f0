"""Small ``@triton.jit`` helpers the kernels share: rounding to 16 bits, HF's rotate-half RoPE.

Imports Triton and nothing of attngraph, so every kernel module can use it.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["rotate_half_rows", "round_to"]


@triton.jit
def round_to(v, DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr):
    """fp32 ``v`` rounded to ``DTYPE``, to nearest even. ``SOFT_BF16``: by integer arithmetic
    on the bits (Triton's interpreter truncates fp32 to bf16; the GPU rounds to nearest)."""
    if SOFT_BF16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        res = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        res = v.to(DTYPE)
    return res


@triton.jit
def rotate_half_rows(x, x_rot, offs_d, c, s, HALF: tl.constexpr):
    """``x * c + rotate_half(x) * s`` in fp32 for ``x: [ROWS, BLOCK_D]`` given ``x_rot``, x read
    at the partner columns ``(d + HALF) % D``: rotate_half's element at ``d`` is
    ``-x[d + HALF]`` below HALF and ``x[d - HALF]`` above. ``c, s: [BLOCK_D]`` fp32."""
    sign = tl.where(offs_d < HALF, -1.0, 1.0)
    return x.to(tl.float32) * c[None, :] + sign[None, :] * x_rot.to(tl.float32) * s[None, :]
