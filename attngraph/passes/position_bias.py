"""Prove that a float mask is a causal/window/full pattern plus an ALiBi bias, for every length.

ALiBi models add to each logit a bias that grows linearly with the key's position, with one
slope per head. HF writes it into the mask (Falcon's SDPA path:
``masked_fill(alibi / sqrt(d), blocked, min)``) or adds it to the scores (the eager paths).
Either way the bias ``B[b, h, i, j]`` may be replaced by the op's ``slopes[h] * (j - p_i)``
(``p_i``: the query's position) when

    B[b, h, i, j + 1] - B[b, h, i, j] = slope(h)      for every key j, every length,

with ``slope`` depending on the head alone: then ``B = B[.., 0] + slope(h) * j``, and the first
term is the same for every key of a query row, which the softmax cancels. `prove_bias` derives
``B``'s element formula (`symbolic_mask` in ``reals`` mode: float arithmetic in exact reals) and
checks that difference symbolically. The rounding of the bias's own float operations is not
modelled: HF's Falcon rounds ``slope * j`` to bf16 (exact up to 256 keys, as the slopes are
powers of two), the op adds the exact value in fp32.

The mask's Boolean part (which keys a query may see) is proven exactly as for a plain mask
(`mask_analysis.prove_pattern`): it is read off the formula's pieces that hold a blocked value
(``-inf`` or at most ``-1e4``).
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
from torch import fx

from . import symbolic_mask
from .fx_utils import example_value
from .mask_analysis import (
    MaskPattern,
    _concrete,
    _merge,
    _shape_env_ranges,
    candidate_pattern,
    check_positional,
    classify,
    evaluate,
    prove_pattern,
)
from .symbolic_mask import I, NotProvable, size_expr

#: Mask values at or below this are "blocked" (HF uses the dtype's minimum or -inf).
BLOCKED = -1e4


def analyze_biased_mask(
    gm: fx.GraphModule, mask: fx.Node, q: fx.Node, k: fx.Node, num_heads: int, trusted_positions: set[fx.Node] = frozenset()
) -> tuple[MaskPattern, tuple[float, ...]]:
    """The pattern of a float ``mask`` that also adds a position bias, and the bias's per-head
    slopes ``[num_heads]`` (in the mask's units: added to the scaled scores).

    Raises `NotProvable` with the reason when either part is not proven for every length.
    """
    check_positional(mask, trusted_positions)
    q_shape, k_shape = example_value(q).shape, example_value(k).shape
    seen = []
    for assignment, value in evaluate(gm, mask, set(trusted_positions)):
        if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
            raise NotProvable("a position bias needs a float mask")
        k_len = _concrete(k_shape[-2], assignment)
        # the probes only propose the pattern (blocked vs not); the proof below decides
        seen.append((classify(torch.where(value > BLOCKED, 0.0, float("-inf")), _concrete(q_shape[-2], assignment), k_len), k_len))
    _merge(seen)
    return prove_biased_mask(mask, q_shape[-2], k_shape[-2], num_heads, set(trusted_positions))


def prove_biased_mask(
    mask: fx.Node, q_len: Any, k_len: Any, num_heads: int, positions: set[fx.Node] = frozenset()
) -> tuple[MaskPattern, tuple[float, ...]]:
    """``(pattern, slopes)`` of a biased mask, proven for every value of the size symbols."""
    value = symbolic_mask.ElementInterpreter(positions, reals=True).run(mask)
    if value.kind not in ("float", "real"):
        raise NotProvable(f"a position bias needs a float mask, not {value.dtype}")
    allowed, bias = split_bias(value.expr)
    sq, sk = size_expr(q_len), size_expr(k_len)
    ranges = _shape_env_ranges(mask)
    pattern = candidate_pattern(allowed, value.shape, sq, sk, ranges)
    prove_pattern(allowed, value.shape, pattern, sq, sk, ranges)
    return pattern, prove_bias(bias, value.shape, num_heads)


#: A blocked constant plus a bias (``min + alibi``) stays blocked when the constant is at most
#: this: no position bias comes near 1e30 (HF blocks with the dtype's minimum, -3.4e38).
BLOCKED_PLUS_BIAS = -1e30


def _blocked(leaf: Any) -> bool:
    if leaf == -sympy.oo or (leaf.is_number and leaf.is_real and leaf <= BLOCKED):
        return True
    if isinstance(leaf, sympy.Add):
        const, _ = leaf.as_coeff_Add()
        return bool(const.is_number and const.is_real and const <= BLOCKED_PLUS_BIAS)
    return False


def split_bias(expr: Any) -> tuple[Any, Any]:
    """``(allowed, bias)`` of a mask formula: where its pieces are not blocked, and the one
    value they all hold there."""
    leaves = [v for v in symbolic_mask._leaves(expr) if not _blocked(v)]
    if not leaves:
        raise NotProvable("the mask blocks every key")
    bias = leaves[0]
    for other in leaves[1:]:
        if sympy.simplify(other - bias) != 0:
            raise NotProvable("the mask adds different biases in different places")
    if isinstance(expr, sympy.Piecewise):
        allowed = sympy.Piecewise(*[(sympy.false if _blocked(v) else sympy.true, c) for v, c in _flat_pieces(expr)])
    else:
        allowed = sympy.true
    return allowed, bias


def _flat_pieces(expr: sympy.Piecewise) -> list[tuple[Any, Any]]:
    """The (value, condition) pairs of a Piecewise whose values may be Piecewise themselves."""
    out = []
    for v, c in expr.args:
        if isinstance(v, sympy.Piecewise):
            out += [(iv, sympy.And(c, ic)) for iv, ic in _flat_pieces(v)]
        else:
            out.append((v, c))
    return out


def prove_bias(bias: Any, shape: tuple, num_heads: int, merged_heads: bool = False) -> tuple[float, ...]:
    """Per-head slopes of ``bias`` over index symbols of ``shape`` (``[..., H or 1, Sq, Sk]``;
    ``merged_heads``: ``[B * H, Sq, Sk]``): ``bias[.., h, i, j + 1] - bias[.., h, i, j]`` must be
    a number for each head, the same for every key, query, batch row and length.
    `NotProvable` otherwise."""
    n = len(shape)
    if n < 2:
        raise NotProvable(f"a bias of shape {shape} has no query and key dimensions")
    col = I[n - 1]
    if shape[-1] == 1:  # one value per query row: the softmax cancels it
        return (0.0,) * num_heads
    bias = bias.xreplace({I[k]: sympy.Integer(0) for k in range(n) if shape[k] == 1})  # size one: index 0
    step = sympy.simplify(bias.xreplace({col: col + 1}) - bias)
    head = I[n - 3] if n >= 3 and shape[n - 3] != 1 else None
    if merged_heads:
        if n != 3:
            raise NotProvable(f"a [batch*heads] bias of shape {shape}")
        # element (b * H + h, i, j): a fresh batch row b and head h < H
        row, head = sympy.Symbol("_batch_row", integer=True, nonnegative=True), sympy.Symbol("_head", integer=True, nonnegative=True)
        rows = sympy.simplify(shape[0] / num_heads)
        index = sympy.Integer(0) if shape[0] == 1 else head if rows == 1 else row * num_heads + head
        step = sympy.simplify(step.xreplace({I[0]: index}))
        extra = step.free_symbols - {head}
        if extra:
            raise NotProvable("the [batch*heads] bias's step from one key to the next depends on more than the head")
        return tuple(_slope(step.xreplace({head: sympy.Integer(h)}), h) for h in range(num_heads))
    if head is not None and shape[n - 3] != num_heads:
        raise NotProvable(f"a bias over {shape[n - 3]} heads for attention of {num_heads} heads")
    extra = step.free_symbols - ({head} if head is not None else set())
    if extra:
        names = ", ".join(sorted(_name(s, n) for s in extra))
        raise NotProvable(
            f"the bias is not a per-head slope times the key position (its step from one key to the next depends on {names})"
        )
    return tuple(_slope(step.xreplace({head: sympy.Integer(h)}) if head is not None else step, h) for h in range(num_heads))


def _slope(v: Any, h: int) -> float:
    v = sympy.simplify(v)
    if not (v.is_number and v.is_real and v.is_finite):
        raise NotProvable(f"the bias's slope of head {h} is not a finite number ({v})")
    return float(v)


def _name(s: sympy.Symbol, ndim: int) -> str:
    if s in I:
        k = I.index(s)
        return {ndim - 1: "the key index", ndim - 2: "the query index", ndim - 3: "the head", ndim - 4: "the batch row"}.get(k, f"dimension {k}")
    return f"the size {s}"


def analyze_bias(
    gm: fx.GraphModule, bias: fx.Node, num_heads: int, trusted_positions: set[fx.Node] = frozenset(),
    merged_heads: bool = False,
) -> tuple[float, ...]:
    """Per-head slopes ``[num_heads]`` of a bias added to the scores themselves (Falcon's eager
    path: ``(q @ k^T + alibi) * scale``; Bloom's ``baddbmm(alibi, q, k^T)``), in the units of the
    scores it is added to. ``merged_heads``: the bias is ``[B * H, Sq or 1, Sk]`` (Bloom).
    The bias must block nothing (the mask is separate). `NotProvable` otherwise."""
    check_positional(bias, trusted_positions, "the bias")
    value = symbolic_mask.ElementInterpreter(set(trusted_positions), reals=True).run(bias)
    if value.kind not in ("float", "real", "int"):
        raise NotProvable(f"a bias of dtype {value.dtype}")
    allowed, expr = split_bias(symbolic_mask.as_number(value))
    if allowed is not sympy.true:
        raise NotProvable("the bias added to the scores also blocks keys (a mask before the scale)")
    return prove_bias(expr, value.shape, num_heads, merged_heads)
