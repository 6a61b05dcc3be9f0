"""Pass `cleanup`: remove code that lowering left dead, and transpose pairs that cancel.

Before::

    mask = (kv_idx <= q_idx).expand(b, -1, s, s)        # no users after lowering
    key = k[:, :, None].expand(b, 2, 2, s, 16).reshape(b, 4, s, 16)
    out = o.view(b, s, 4, 16).transpose(1, 2)
    y = out.transpose(1, 2).contiguous()

After::

    out = o.view(b, s, 4, 16)
    y = out.contiguous()
"""

from __future__ import annotations

import logging

from torch import fx

from . import fx_utils as fu

logger = logging.getLogger(__name__)


def _is_impure(node: fx.Node) -> bool:
    if node.op in ("placeholder", "output"):
        return True
    if node.op == "call_method" and isinstance(node.target, str) and node.target.endswith("_") and not node.target.endswith("__"):
        return True  # in-place Tensor method
    if node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return True
        name = getattr(node.target, "__name__", "")
        # torch.relu_ and friends mutate; operator.and_ / or_ are plain binary operators.
        in_place = name.endswith("_") and not name.endswith("__")
        if in_place and getattr(node.target, "__module__", "") not in ("_operator", "operator"):
            return True
    return node.is_impure()


def _cancel_transposes(graph: fx.Graph) -> int:
    count = 0
    for node in list(graph.nodes):
        if not fu.is_op(node, fu.TRANSPOSE):
            continue
        inner = node.args[0]
        if not fu.is_op(inner, fu.TRANSPOSE) or len(inner.users) != 1:
            continue
        dims_o = {fu.arg(node, 1, "dim0"), fu.arg(node, 2, "dim1")}
        dims_i = {fu.arg(inner, 1, "dim0"), fu.arg(inner, 2, "dim1")}
        if dims_o == dims_i and all(isinstance(d, int) and d >= 0 for d in dims_o):
            node.replace_all_uses_with(inner.args[0])
            graph.erase_node(node)
            graph.erase_node(inner)
            count += 1
    return count


def cleanup(gm: fx.GraphModule) -> int:
    """Dead-code-eliminate and cancel transpose pairs in place; returns nodes removed."""
    before = len(gm.graph.nodes)
    _cancel_transposes(gm.graph)
    gm.graph.eliminate_dead_code(is_impure_node=_is_impure)
    gm.recompile()
    removed = before - len(gm.graph.nodes)
    logger.debug("cleanup: removed %d nodes", removed)
    return removed
