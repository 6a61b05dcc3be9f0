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
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from . import fx_utils as fu

logger = logging.getLogger(__name__)


#: Ops whose result is a new tensor no other graph value aliases.
_FRESH = fu.MATMUL | fu.BMM | {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg,
    torch.add, torch.sub, torch.mul, torch.div, torch.tanh, torch.softmax, F.softmax,
    "add", "sub", "mul", "div", "tanh", "softmax",
}


def _private(node: Any) -> bool:
    """Is ``node``'s tensor reachable only through ``node`` (fresh storage, possibly mutated in
    place along a chain of single-user in-place ops)?"""
    while isinstance(node, fx.Node):
        if fu.is_op(node, _FRESH) and not fu.is_inplace(node):
            return True
        if not fu.is_inplace(node) or not node.args:
            return False
        src = node.args[0]
        if not isinstance(src, fx.Node) or len(src.users) != 1:
            return False
        node = src
    return False


def _is_impure(node: fx.Node) -> bool:
    if node.op in ("placeholder", "output"):
        return True
    if fu.is_inplace(node):
        # ``s /= c`` may go only when nothing else can observe ``s``: it is fresh storage whose
        # sole user is this op (then the mutation is visible only through the dead result).
        src = node.args[0] if node.args else None
        return not (isinstance(src, fx.Node) and len(src.users) == 1 and _private(src))
    if node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return True
        if getattr(node.target, "__module__", "").startswith(("torch._functorch", "torch._C._functorch")):
            return True  # vmap/grad nesting levels (flex attention's mask): state, not values
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
