"""Pass `fold_rope_linear`: the rotary embedding `fold_rope` gave an attention op moves on into
the projection whose output columns are that op's q and k.

After `fold_rope` a decode step's Triton kernel rotates q and the new key itself, on the
attention's latency path. After this pass the projection's GEMV rotates them in its epilogue
(`skinny_linear`: a head's rotate-half partners computed by one program; at 3-16 rows the
tensor-core kernel's, `skinny_dot`), the attention op receives q and k already rotated, and no
launch of the step is spent on the rotation; where neither kernel serves (a prefill's rows),
the op rotates the columns in place in one launch after the GEMM
(`attngraph.rope.rope_columns_`), as many launches as the rotation took before.

Runs in paged mode after `fold_rope` (and `skinny_linears` / `fold_rms_norm`, whose ops it
extends). It matches an attention op carrying ``rope_cos``, ``rope_sin`` whose q and k inputs
are the lowering's views of one projection's output ``y: [B, T, N]``::

    q = narrow(y, -1, s, H * D).view(B, T, H, D).transpose(1, 2)       # or y itself: s = 0
    op(q.transpose(1, 2).reshape(-1, H, D), k..., v, ..., cos.reshape(-1, D), sin.reshape(-1, D))

so the op's ``q[b * T + t, h, d]`` is ``y[b, t, s + h * D + d]``, rotated with row ``b * T + t``
of ``cos``: the projection's op gets ``rope_cos``, ``rope_sin`` and ``rope_cols`` and rotates
its columns ``[0, rope_cols)`` head by head, the same value (`attngraph.rope`: fp32, rounded
once) at the same place. ``y`` comes from ``attngraph.linear``, ``rms_norm_linear`` or
``add_rms_norm_linear``.

Refused (the op keeps its rotation, the reason in `FoldRopeLinearResult.refused`): q and k
not views of such an op's output, their columns not the projection's first ``rope_cols`` (in
either order, head aligned), other readers of those columns or of a view on the way, the
``cos`` / ``sin`` rows computed after the projection.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from .. import linear_ops  # registers the ops the pass extends
from . import fx_utils as fu
from .lower_attention import ATTENTION_OP

logger = logging.getLogger(__name__)

#: The projection ops the pass extends, with their positional arguments before the rotation's
#: (the defaults of the trailing ``bias`` and ``rows`` filled in).
_PROJECTIONS = {
    torch.ops.attngraph.linear.default: ("x", "weight", "bias", "rows"),
    torch.ops.attngraph.rms_norm_linear.default: ("x", "norm_weight", "eps", "weight", "bias", "rows"),
    torch.ops.attngraph.add_rms_norm_linear.default: ("x", "residual", "norm_weight", "eps", "weight", "bias", "rows"),
}
_DEFAULTS = {"bias": None, "rows": linear_ops.ANY_ROWS}
_SIZE_READ = ("size",)


@dataclass
class FoldRopeLinearResult:
    """``folded``: (attention op, projection op) names whose rotation moved; ``refused``:
    (attention op name, reason) for ops that keep it."""

    folded: list[tuple[str, str]] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)


def _projection_output(y) -> fx.Node | None:
    """The projection op behind ``y`` (its output, or output 0 of ``add_rms_norm_linear``)."""
    if not isinstance(y, fx.Node) or y.op != "call_function":
        return None
    if y.target in _PROJECTIONS and y.target is not torch.ops.attngraph.add_rms_norm_linear.default:
        return y
    src = y.args[0] if y.target is operator.getitem and y.args[1] == 0 else None
    if isinstance(src, fx.Node) and src.op == "call_function" and src.target is torch.ops.attngraph.add_rms_norm_linear.default:
        return src
    return None


def _columns(arg, d: int) -> tuple[fx.Node, int, int, list[fx.Node]] | str:
    """``(y, first column, columns, path nodes from arg down)`` for the op input ``arg`` =
    ``reshape(transpose(transpose(view(narrow(y, -1, s, n)), 1, 2), 1, 2), -1, H, D)`` (or without
    the narrow), whose row ``b * T + t``, head ``h``, dim ``e`` is ``y[b, t, s + h * D + e]``;
    else why not."""
    path = []
    node = arg
    for _ in range(2):  # the lowering's transpose(1, 2).reshape(...), then q's own transpose(1, 2)
        if fu.is_op(node, ("reshape",)) and not path:
            path.append(node)
            node = node.args[0]
        if not (fu.is_op(node, ("transpose",)) and not node.kwargs and tuple(node.args[1:]) in ((1, 2), (2, 1))):
            return "q / k are not the lowering's transposed views of a projection"
        path.append(node)
        node = node.args[0]
    if not fu.is_op(node, ("view",)) or node.kwargs or not isinstance(node.args[0], fx.Node):
        return "q / k are not views of a projection's output"
    view = node
    path.append(view)
    src = view.args[0]
    start, cols = 0, None
    if fu.is_op(src, ("narrow",)) and not src.kwargs and len(src.args) == 4 and all(isinstance(a, int) for a in src.args[1:]):
        y_val = fu.example_value(src.args[0])
        if not isinstance(y_val, torch.Tensor) or src.args[1] not in (-1, y_val.dim() - 1):
            return "q / k narrow another dimension than the columns"
        start, cols = src.args[2], src.args[3]
        path.append(src)
        src = src.args[0]
    y_val, v_shape = fu.example_value(src), fu.shape_of(view)
    if not isinstance(y_val, torch.Tensor) or v_shape is None or y_val.dim() != 3 or len(v_shape) != 4:
        return "q / k are not [B, T, H, D] views of a [B, T, N] projection"
    cols = y_val.shape[-1] if cols is None else cols
    # the view only splits the columns into heads of D
    if not (fu.same_size(v_shape[0], y_val.shape[0]) and fu.same_size(v_shape[1], y_val.shape[1])) or v_shape[3] != d \
            or not isinstance(v_shape[2], int) or v_shape[2] * d != cols:  # fmt: skip
        return f"the view {v_shape} is not the projection's columns split into heads of {d}"
    return src, start, cols, path


def _read_only_along(path: list[fx.Node], op: fx.Node) -> bool:
    """Every node of ``path`` (from the op's input down) is read only by the next one up, the
    op, or for its size."""
    allowed = {op, *path}
    return all(u in allowed or (fu.is_op(u, _SIZE_READ) and u.args[0] is n) for n in path for u in n.users)


def _before(a: fx.Node, b: fx.Node) -> bool:
    for node in a.graph.nodes:
        if node is a:
            return True
        if node is b:
            return False
    return False


def fold_rope_linear(gm: fx.GraphModule) -> FoldRopeLinearResult:
    """Move each rotating attention op's rotation into the projection of its q and k (module
    docstring). Mutates ``gm``; returns what it did."""
    result = FoldRopeLinearResult()
    graph = gm.graph
    fu.fill_example_values(gm)  # `fold_rope` left the views it changed without values
    for op in list(graph.nodes):
        if not (op.op == "call_function" and op.target is ATTENTION_OP) or op.kwargs or len(op.args) != 14:
            continue
        cos2, sin2 = op.args[12], op.args[13]
        if not (isinstance(cos2, fx.Node) and isinstance(sin2, fx.Node)):
            continue
        why = _fold_one(graph, op, cos2, sin2, result)
        if why is not None:
            result.refused.append((op.name, why))
    summary = f"fold_rope_linear: {len(result.folded)} rotary embeddings moved into projections"
    fu.finish_rewrite(gm, logger, summary if result.folded else None, result.refused,
                      "fold_rope_linear: %s keeps its rotation: %s")  # fmt: skip
    return result


def _fold_one(graph: fx.Graph, op: fx.Node, cos2: fx.Node, sin2: fx.Node, result: FoldRopeLinearResult) -> str | None:
    """Rewrite one op; None when done, else the reason it was not."""
    cos_val = fu.example_value(cos2)
    if not isinstance(cos_val, torch.Tensor) or cos_val.dim() != 2 or not isinstance(cos_val.shape[1], int):
        return "cos has no [rows, D] value"
    d = cos_val.shape[1]
    found = [_columns(a, d) for a in op.args[:2]]
    if any(isinstance(f, str) for f in found):
        return next(f for f in found if isinstance(f, str))
    (qy, qs, qn, qpath), (ky, ks, kn, kpath) = found
    if _projection_output(qy) is None or _projection_output(ky) is None:
        return "q / k are not views of an attngraph projection op's output (a copy or another op between)"
    if qy is not ky:
        return "q and k come from two projections"
    proj = _projection_output(qy)
    names = _PROJECTIONS[proj.target]
    if len(proj.args) > len(names) or proj.kwargs:
        return "the projection rotates already"
    # the rotated columns: q's and k's, together [0, rope_cols)
    (a0, a1), (b0, b1) = sorted([(qs, qs + qn), (ks, ks + kn)])
    if a0 != 0 or a1 != b0 or a1 % d:
        return f"q's and k's columns ({qs}+{qn}, {ks}+{kn}) are not the projection's first ones, head aligned"
    rope_cols = b1
    if not (_read_only_along(qpath, op) and _read_only_along(kpath, op)):
        return "a view of q or k is read elsewhere"
    for user in qy.users:  # the rotated columns are read through q and k alone
        if user in (qpath[-1], kpath[-1]):
            continue
        if not (fu.is_op(user, ("narrow",)) and len(user.args) == 4 and isinstance(user.args[2], int)
                and user.args[2] >= rope_cols):  # fmt: skip
            return f"{user.name} reads the projection's rotated columns"
    sources = []
    for node in (cos2, sin2):  # rebuilt before the projection from what they reshape
        if not (fu.is_op(node, ("reshape",)) and not node.kwargs and tuple(node.args[1:]) == (-1, d)):
            return "cos / sin are not the rotation's reshaped rows"
        src = node.args[0]
        if isinstance(src, fx.Node) and not _before(src, proj):
            return "cos / sin are computed after the projection"
        sources.append(src)
    args = list(proj.args) + [_DEFAULTS[name] for name in names[len(proj.args) :]]
    with graph.inserting_before(proj):
        new_cos = graph.call_method("reshape", (sources[0], -1, d))
        new_sin = graph.call_method("reshape", (sources[1], -1, d))
    proj.args = (*args, new_cos, new_sin, rope_cols)
    op.args = op.args[:12]
    for node in (cos2, sin2):
        if not node.users:
            graph.erase_node(node)
    result.folded.append((op.name, proj.name))
    return None
