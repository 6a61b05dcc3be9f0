"""Pass `fuse_gated_mlp`: a decoder layer's gated MLP becomes one op, whose tensor-core path
forms SiLU * up in the gate/up product's epilogue.

After `fuse_linears`, `skinny_linears` and `fold_rms_norm` a Llama-style MLP reads::

    t = add_rms_norm_linear(x, residual, norm, eps, w_gate_up, None, rows)   # [g | u], h
    y = t[0]; h = t[1]
    d = silu_mul_linear(y.narrow(-1, 0, I), y.narrow(-1, I, I), w_down, rows)

At one or two rows the GEMV folds the norm into the gate/up product and SiLU * up into the
down product's loads: two launches. At 3-16 rows the tensor-core kernel cannot fold either
into its operand loads without losing its pipelining, so the step runs four: the norm, the
product, SiLU * up, the down product. This pass rewrites the pattern to::

    d, h = add_rms_norm_gated_mlp(x, residual, norm, eps, w_gate_up, w_down, rows)

whose tensor-core path computes SiLU * up in the gate/up product's epilogue (a program owns
matching gate and up rows of the fused weight): one launch less per layer, and half the
product's output written. At other row counts the op runs the two ops it replaces, kernel for
kernel; every path rounds as they do (`linear_ops.add_rms_norm_gated_mlp`).

Refused, with the reason in `FuseGatedMlpResult.refused`: a down projection whose halves are
not the two halves of one ``add_rms_norm_linear`` product (separate gate and up linears, a
norm left unfolded), a product or half read elsewhere, a bias or a rotation on the gate/up
product, different row kinds on the two products, weights without a static shape, a gate/up
weight the tensor-core kernel never takes (above `linear_ops.DOT_MAX_GATED_WEIGHT` elements: the op
would only ever run the ops it replaces), a down weight computed after the gate/up product.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from .. import linear_ops  # registers the ops the pass reads and writes
from . import fx_utils as fu

logger = logging.getLogger(__name__)

_ADD_NORM_LINEAR = torch.ops.attngraph.add_rms_norm_linear.default
_SILU_MUL_LINEAR = torch.ops.attngraph.silu_mul_linear.default
_GATED_MLP = torch.ops.attngraph.add_rms_norm_gated_mlp.default


@dataclass
class FuseGatedMlpResult:
    """``fused``: (gate/up op, down op) names rewritten into one op; ``refused``: (down op
    name, reason) for the gated MLPs left as they were."""

    fused: list[tuple[str, str]] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)


def _match(down: fx.Node, order: dict) -> tuple[fx.Node, list[fx.Node]] | str:
    """``(gate/up op, the nodes between it and ``down``)`` for a fusable down projection, else
    the reason it stays. ``order``: the graph's nodes by position (the fused op takes the
    gate/up op's place, so the down weight must come before it)."""
    a, b = down.args[0], down.args[1]
    halves = fu.last_dim_narrow(a), fu.last_dim_narrow(b)
    if halves[0] is None or halves[1] is None or halves[0][0] is not halves[1][0]:
        return "its gate and up operands are not two halves of one product"
    y, (_, a_start, a_len), (_, b_start, b_len) = halves[0][0], halves[0], halves[1]
    if not (a_start == 0 and b_start == a_len == b_len):
        return "its operands are not the product's first and second halves"
    if not (y.op == "call_function" and y.target is operator.getitem and y.args[1] == 0 and fu.is_op(y.args[0], (_ADD_NORM_LINEAR,))):
        return "the gate/up product is not an add_rms_norm_linear op (separate linears, or a norm left unfolded)"
    gate_up = y.args[0]
    if len(y.users) != 2 or any(len(n.users) != 1 for n in (a, b)) or a is b:
        return "the gate/up product or one of its halves is read elsewhere too"
    if gate_up.kwargs or len(gate_up.args) > 7 or (len(gate_up.args) > 5 and gate_up.args[5] is not None):
        return "the gate/up product has a bias or rotates columns"
    if any(not (u.target is operator.getitem and u.args[1] in (0, 1)) for u in gate_up.users):
        return "the gate/up op's result is read other than by index"
    rows_gate_up = gate_up.args[6] if len(gate_up.args) > 6 else linear_ops.ANY_ROWS
    rows_down = down.args[3] if len(down.args) > 3 else linear_ops.ANY_ROWS
    if rows_gate_up != rows_down or down.kwargs:
        return "the two products compute different rows"
    w_gate_up, w_down = fu.matrix_shape(gate_up.args[4]), fu.matrix_shape(down.args[2])
    if w_gate_up is None or w_down is None:
        return "a weight has no static [N, K] shape"
    if w_gate_up[0] != 2 * a_len or w_down[1] != a_len:
        return "the halves do not split the gate/up weight in two"
    n, k = w_gate_up
    if n * k > linear_ops.DOT_MAX_GATED_WEIGHT or n >= linear_ops.KERNEL_MIN_HEAD_RATIO * k:
        return "the tensor-core kernel never takes the gate/up weight (the op would run the ops it replaces)"
    if order[down.args[2]] > order[gate_up]:
        return "the down weight is computed after the gate/up product"
    return gate_up, [a, b, y]


def fuse_gated_mlp(gm: fx.GraphModule) -> FuseGatedMlpResult:
    """Rewrite each fusable gated MLP into one ``add_rms_norm_gated_mlp`` op (module
    docstring). Mutates ``gm``; returns what it did."""
    result = FuseGatedMlpResult()
    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    for down in list(graph.nodes):
        if not fu.is_op(down, (_SILU_MUL_LINEAR,)):
            continue
        found = _match(down, order)
        if isinstance(found, str):
            result.refused.append((down.name, found))
            continue
        gate_up, between = found
        x, residual, norm, eps, w_gate_up = gate_up.args[:5]
        rows = gate_up.args[6] if len(gate_up.args) > 6 else linear_ops.ANY_ROWS
        h_old = next((u for u in gate_up.users if u.args[1] == 1), None)
        with graph.inserting_before(gate_up):
            fused = graph.call_function(_GATED_MLP, (x, residual, norm, eps, w_gate_up, down.args[2], rows))
            out = graph.call_function(operator.getitem, (fused, 0))
            h = graph.call_function(operator.getitem, (fused, 1))
        out.meta.update(down.meta)
        down.replace_all_uses_with(out)
        if h_old is not None:
            h.meta.update(h_old.meta)
            h_old.replace_all_uses_with(h)
        for node in (down, *between, *([h_old] if h_old is not None else []), gate_up):  # readers first
            graph.erase_node(node)
        if not h.users:
            graph.erase_node(h)
        result.fused.append((gate_up.name, down.name))
    summary = f"fuse_gated_mlp: {len(result.fused)} gated MLPs run as one op"
    fu.finish_rewrite(gm, logger, summary if result.fused else None, result.refused,
                      "fuse_gated_mlp: the MLP of %s stays as it was: %s")  # fmt: skip
    return result
