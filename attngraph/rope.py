"""Rotary position embedding (HF's "rotate half" form) applied to a step's queries and keys.

``x * cos + rotate_half(x) * sin`` over the whole head, ``rotate_half(x) = cat(-x[..., D/2:],
x[..., :D/2])``: what HF's ``apply_rotary_pos_emb`` computes for Llama, Qwen2, Mistral and the
models that copy it, with ``cos`` and ``sin`` rows per token (``[T, D]``, the model's own, in
the queries' dtype). `passes.fold_rope` hands them to the attention op instead of the rotated
tensors; a backend that folds the rotation into its decode kernel applies it there (the Triton
backend), every other call applies it here first.

Rounding: 16-bit inputs are rotated in fp32 and rounded once (the value inductor's fused
kernel of HF's ops gives); fp32 inputs go through HF's own ops (bit-equal to eager).
"""

from __future__ import annotations

import torch

from .errors import InputError

__all__ = ["apply_rope", "check_rope", "check_rope_columns", "rope_columns_", "rope_reference"]


def check_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Refuse what `apply_rope` cannot rotate: ``q: [T, Hq, D]``, ``k: [T, Hkv, D]``, ``cos``,
    ``sin``: ``[T, D]``, ``D`` even, one dtype and device."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise InputError(f"rope: q and k must be [T, H, D] with one T and D; got {tuple(q.shape)} and {tuple(k.shape)}")
    t, d = q.shape[0], q.shape[2]
    for name, c in (("cos", cos), ("sin", sin)):
        if tuple(c.shape) != (t, d) or c.dtype != q.dtype or c.device != q.device:
            raise InputError(f"rope: {name} must be a {q.dtype} [{t}, {d}] tensor on {q.device}; got {c.dtype} "
                             f"{tuple(c.shape)} on {c.device}")  # fmt: skip
    if d % 2 or k.dtype != q.dtype or k.device != q.device:
        raise InputError(f"rope: the head dim must be even and q, k of one dtype and device; got D={d}, {q.dtype} "
                         f"and {k.dtype}")  # fmt: skip


def check_rope_columns(what: str, x: torch.Tensor, n: int, rope_cos: torch.Tensor | None, rope_sin: torch.Tensor | None,
                       rope_cols: int, *, launch: bool = True) -> tuple[torch.Tensor, torch.Tensor, int] | None:  # fmt: skip
    """The rotation of a projection's first ``rope_cols`` output columns, validated against
    ``x: [M, K]`` and ``n`` columns: ``rope_cos``, ``rope_sin`` ``[>= M, D]`` in x's dtype on its
    device, unit stride along an even ``D`` that divides ``rope_cols <= n``. Returns ``(cos,
    sin, rope_cols)``, or None without a rotation (no tensors and ``rope_cols = 0``).

    ``launch=False`` (an op's fake implementation, under a trace): sizes may be symbolic and
    are compared only where they are plain ints; rows and strides are left to the launch."""
    if rope_cos is None and rope_sin is None and not rope_cols:
        return None
    if rope_cos is None or rope_sin is None:
        raise InputError(f"{what}: rope_cos and rope_sin go together")
    d = rope_cos.shape[-1] if rope_cos.dim() == 2 else 0
    for name, t in (("rope_cos", rope_cos), ("rope_sin", rope_sin)):
        if t.dim() != 2 or t.dtype != x.dtype or t.device != x.device or (_static(d, t.shape[1]) and t.shape[1] != d) or (
            launch and (t.shape[0] < x.shape[0] or (d > 1 and t.stride(1) != 1))
        ):
            rows = f">= {x.shape[0]}" if launch else "rows"
            raise InputError(f"{what}: {name} must be a {x.dtype} [{rows}, D] tensor on {x.device} with the other's D"
                             f"{', unit stride along D' if launch else ''}; got {t.dtype} {tuple(t.shape)} on {t.device}")  # fmt: skip
    if not _static(d, n):
        return rope_cos, rope_sin, rope_cols
    if d < 2 or d % 2 or isinstance(rope_cols, bool) or not isinstance(rope_cols, int) or not 0 < rope_cols <= n \
            or rope_cols % d:  # fmt: skip
        raise InputError(f"{what}: rope_cols must be a positive multiple of the even head dim {d} within the {n} "
                         f"output columns; got {rope_cols!r}")  # fmt: skip
    return rope_cos, rope_sin, rope_cols


def _static(*sizes) -> bool:
    """Whether every size is a plain int (symbolic ones, under a trace, are checked when the op runs)."""
    return all(isinstance(s, int) for s in sizes)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x: [T, H, D]`` rotated by ``cos, sin: [T, D]`` with torch's ops: HF's formula in fp32
    for 16-bit inputs, rounded once; HF's ops as they are for fp32."""
    c, s = cos[:, None, :], sin[:, None, :]
    if x.dtype == torch.float32:
        return x * c + _rotate_half(x) * s
    xf = x.float()
    return (xf * c.float() + _rotate_half(xf) * s.float()).to(x.dtype)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, k)`` rotated: ``q: [T, Hq, D]``, ``k: [T, Hkv, D]``, ``cos, sin: [T, D]`` ->
    new ``[T, Hq, D]``, ``[T, Hkv, D]`` tensors (contiguous). One Triton launch for both on CUDA
    (16-bit), torch's ops elsewhere."""
    check_rope(q, k, cos, sin)
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[0]:
        from .rope_kernel import rope_qk

        return rope_qk(q, k, cos, sin)
    return rope_reference(q, cos, sin), rope_reference(k, cos, sin)


def rope_columns_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x: [T, H, D]`` rotated in place by ``cos, sin: [T, D]`` (a view into a projection's
    output, unit stride along D): one Triton launch on CUDA (16-bit), torch's ops elsewhere
    (the values of `rope_reference`). Returns ``x``."""
    check_rope(x, x[:, :0], cos, sin)
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.shape[0] and x.stride(-1) == 1:
        from .rope_kernel import rope_inplace

        return rope_inplace(x, cos, sin)
    x.copy_(rope_reference(x, cos, sin))
    return x
