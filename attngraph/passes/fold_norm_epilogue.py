"""Pass `fold_norm_epilogue`: a residual add and RMSNorm that the projection after them cannot
fold into its loads move back into the epilogue of the projection before them.

After `fold_rms_norm` a decoder layer's MLP input is ``add_rms_norm_linear(residual, o, norm,
eps, w_gate_up)`` with ``o = linear(attn, w_o)``. Where the GEMV serves ``w_gate_up`` the norm
runs in its loads; where it does not (Llama-3.1-8B's fused gate/up, 28672 x 4096, is cuBLAS's
at every row count) the op spends a launch on the norm alone, between the output projection's
GEMV and cuBLAS. This pass rewrites the pair to::

    normed, h = linear_add_rms_norm(attn, w_o, b_o, residual, norm, eps, rows_o)
    y = linear(normed, w_gate_up, b_gate_up, rows)

so a decode step's output-projection GEMV also adds the residual and, in its last program,
normalizes the rows (`skinny_linear.skinny_linear_add_rms_norm`): one launch less per layer.
At row counts the GEMV does not take, `linear_add_rms_norm` runs the projection and one norm
launch: the launches of before. The values are those of the ops it replaces (the addition
is the same rounded sum in either operand order).

Matched: an ``attngraph.linear`` without a rotation read only by one ``add_rms_norm_linear``
(as either addend, directly or through an eval-mode dropout: Phi-3) without a rotation. Refused, with the reason in
`FoldNormEpilogueResult.refused`: a consumer whose weight the GEMV may take at some row count
(the norm stays folded into its loads), a producer the GEMV never takes, a product read
elsewhere too, a norm over more than `rms_norm.MAX_K` columns.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from .. import linear_ops  # registers the ops the pass writes
from . import fx_utils as fu

logger = logging.getLogger(__name__)

_LINEAR = torch.ops.attngraph.linear.default
_ADD_NORM_LINEAR = torch.ops.attngraph.add_rms_norm_linear.default
#: Widest row the epilogue's one program normalizes (`attngraph.rms_norm.MAX_K`, without
#: importing Triton here).
MAX_NORM_COLUMNS = 16384


@dataclass
class FoldNormEpilogueResult:
    """``folded``: (producer linear, consumer op) names rewritten; ``refused``: (consumer op
    name, reason) for the add + norm sites left as they were."""

    folded: list[tuple[str, str]] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)


def _identity_of(node) -> fx.Node | None:
    """``x`` for an eval-mode dropout of it, ``F.dropout(x, p, False, False)`` (Phi-3's
    ``resid_attn_dropout`` between the projection and the sum), else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is torch.nn.functional.dropout):
        return None
    names = ("input", "p", "training", "inplace")
    bound = {**dict(zip(names, node.args)), **node.kwargs}
    if set(bound) - set(names) or bound.get("training", True) is not False or bound.get("inplace", False) is not False:
        return None
    return bound.get("input") if isinstance(bound.get("input"), fx.Node) else None


def _producer(addend) -> tuple[fx.Node, list[fx.Node]] | None:
    """``(linear op, identity nodes between it and the sum)`` behind an addend, else None."""
    between = []
    inner = _identity_of(addend)
    if inner is not None:
        between.append(addend)
        addend = inner
    return (addend, between) if fu.is_op(addend, (_LINEAR,)) else None


def _reason(op: fx.Node) -> str | tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """``(producer linear, residual, identity nodes between)`` for a foldable consumer ``op``;
    a reason where it is an add + norm site that stays; None where there is no producing
    linear op at all."""
    a, b = op.args[0], op.args[1]
    producers = [(*found, r) for p, r in ((a, b), (b, a)) if (found := _producer(p)) is not None]
    if not producers:
        return None
    producer, between, residual = producers[0]
    if producer is residual or residual in between:
        return "the sum adds the product to itself"
    if len(op.args) > 7 or op.kwargs or producer.kwargs or len(producer.args) > 4:
        return "the projection or the consumer rotates columns"
    if any(len(n.users) != 1 for n in (producer, *between)):
        return f"{producer.name}'s product is read elsewhere too"
    consumer_w = fu.matrix_shape(op.args[4])
    producer_w = fu.matrix_shape(producer.args[1])
    if consumer_w is None or producer_w is None:
        return "a weight has no static [N, K] shape"
    if linear_ops.gemv_may_serve(*consumer_w):
        return "the GEMV may take the consumer's weight, which then folds the norm into its loads"
    if not linear_ops.gemv_may_serve(*producer_w):
        return "the GEMV never takes the producer's weight"
    if producer_w[0] > MAX_NORM_COLUMNS:
        return f"a norm over {producer_w[0]} columns (the epilogue takes at most {MAX_NORM_COLUMNS})"
    return producer, residual, between


def _with_defaults(args: tuple, required: int) -> list:
    """A linear op's positional arguments with the trailing ``bias`` and ``rows`` filled in
    (``required`` arguments come before them)."""
    defaults = [None, linear_ops.ANY_ROWS]
    return list(args) + defaults[len(args) - required :]


def fold_norm_epilogue(gm: fx.GraphModule) -> FoldNormEpilogueResult:
    """Move each foldable residual add + RMSNorm into the projection before it (module
    docstring). Mutates ``gm``; returns what it did."""
    result = FoldNormEpilogueResult()
    graph = gm.graph
    for op in list(graph.nodes):
        if not fu.is_op(op, (_ADD_NORM_LINEAR,)):
            continue
        found = _reason(op)
        if found is None:
            continue
        if isinstance(found, str):
            result.refused.append((op.name, found))
            continue
        producer, residual, between = found
        outs = {u.args[1]: u for u in op.users if u.target is operator.getitem}
        if len(outs) != len(op.users):
            result.refused.append((op.name, "its result is read other than by index"))
            continue
        x, w, b, rows = _with_defaults(producer.args, 2)
        _, _, nw, eps, w2, b2, rows2 = _with_defaults(op.args, 5)
        with graph.inserting_before(op):
            fused = graph.call_function(torch.ops.attngraph.linear_add_rms_norm.default, (x, w, b, residual, nw, eps, rows))
            normed = graph.call_function(operator.getitem, (fused, 0))
            h = graph.call_function(operator.getitem, (fused, 1))
            y = graph.call_function(_LINEAR, (normed, w2, b2, rows2))
        for old, new in ((outs.get(0), y), (outs.get(1), h)):
            if old is not None:
                new.meta.update(old.meta)
                old.replace_all_uses_with(new)
                graph.erase_node(old)
        if 1 in outs:
            normed.meta.update(outs[1].meta)  # the normed rows: h's shape and dtype
        graph.erase_node(op)
        for node in (*between, producer):  # readers first
            graph.erase_node(node)
        result.folded.append((producer.name, op.name))
    summary = f"fold_norm_epilogue: {len(result.folded)} residual add + RMSNorm sites moved into the projection before them"
    fu.finish_rewrite(gm, logger, summary if result.folded else None, result.refused,
                      "fold_norm_epilogue: the add + norm of %s stays: %s")  # fmt: skip
    return result
