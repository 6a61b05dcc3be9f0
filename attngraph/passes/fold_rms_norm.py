"""Pass `fold_rms_norm`: an RMSNorm (and the residual add before it) read only by a linear op
moves into that op, so a decode step's GEMV computes the norm as it loads its input.

A decoder layer spends two launches per norm site without this: inductor's fused
add + RMSNorm kernel, then the projection. After the pass one launch remains where the GEMV
serves (`linear_ops.rms_norm_linear`); where it does not (too many rows, a weight cuBLAS
reads faster), the op runs one RMSNorm kernel and cuBLAS: the count of before.

Runs after `skinny_linears`, on a Dynamo graph (torch-level calls). It matches HF's
``LlamaRMSNorm.forward`` (Mistral, Qwen2/3, Phi-3 and others share it) feeding
``attngraph.linear(x, w, b, rows)``::

    hf = h.to(float32)
    x  = norm_weight * (hf * rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)

with ``norm_weight`` a ``[K]`` tensor of ``h``'s dtype, ``eps`` a number, and every node
between ``hf`` and ``x`` read only inside the pattern (``x`` only by the linear). It becomes
``attngraph.rms_norm_linear(h, norm_weight, eps, w, b, rows)``. Where ``h = a + b`` (two
tensors of ``h``'s shape and dtype) and every other reader of ``h`` comes after the linear,
the addition moves in too: ``attngraph.add_rms_norm_linear(a, b, ...)`` returns ``(y, h)``
and those readers take its ``h``.

Not folded: other norms (Gemma's ``1 + weight`` in fp32, LayerNorm), a norm read by anything
but one linear op (the model's final norm, whose rows are gathered before the LM head), and
patterns whose pieces are read elsewhere. Each partial match is reported in
`FoldNormResult.refused` with the reason.
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

# function targets and method names (`fx_utils.is_op` matches either)
MUL = (operator.mul, torch.mul, torch.ops.aten.mul.Tensor)
ADD = (operator.add, torch.add, torch.ops.aten.add.Tensor)
RSQRT = (torch.rsqrt, torch.ops.aten.rsqrt.default, "rsqrt")
POW = (operator.pow, torch.pow, "pow")
MEAN = (torch.mean, "mean")
LINEAR_OP = (torch.ops.attngraph.linear.default,)


@dataclass
class FoldNormResult:
    """``folded``: names of the linear ops that took a norm; ``with_residual``: of those, the
    ones that took the residual add too; ``refused``: (linear name, reason) for partial
    matches."""

    folded: list[str] = field(default_factory=list)
    with_residual: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)


def _val(node):
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _to_dtype(node) -> tuple[fx.Node, torch.dtype] | None:
    """``(src, dtype)`` for ``src.to(dtype)`` / ``src.float()``, else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_method" and isinstance(node.args[0], fx.Node)):
        return None
    if node.target == "float" and len(node.args) == 1 and not node.kwargs:
        return node.args[0], torch.float32
    if node.target != "to":
        return None
    if len(node.args) == 2 and isinstance(node.args[1], torch.dtype) and not node.kwargs:
        return node.args[0], node.args[1]
    if len(node.args) == 1 and set(node.kwargs) == {"dtype"} and isinstance(node.kwargs["dtype"], torch.dtype):
        return node.args[0], node.kwargs["dtype"]
    return None


def _pair(node, targets) -> tuple | None:
    """The two operands of a binary call (function or method form), else None."""
    if not fu.is_op(node, targets) or node.kwargs:
        return None
    return tuple(node.args) if len(node.args) == 2 else None  # a method's receiver is args[0]


def _last_dim_mean(node, ndim: int) -> fx.Node | None:
    """``p`` for ``p.mean(-1, keepdim=True)`` (or ``torch.mean``, dim as int or [int])."""
    if not fu.is_op(node, MEAN):
        return None
    args, kwargs = list(node.args), dict(node.kwargs)
    names = ["input", "dim", "keepdim"]
    for name, value in zip(names, args):
        if name in kwargs:
            return None
        kwargs[name] = value
    if set(kwargs) - set(names) or kwargs.get("keepdim") is not True:
        return None
    dim = kwargs.get("dim")
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    if not isinstance(dim, int) or dim not in (-1, ndim - 1):
        return None
    return kwargs["input"] if isinstance(kwargs["input"], fx.Node) else None


def _match_norm(x: fx.Node) -> tuple[fx.Node, fx.Node, float, list[fx.Node]] | str | None:
    """``(h, norm_weight, eps, pattern nodes from x up)`` for HF's RMSNorm ending in ``x``;
    a reason where the shape matches but a piece may not move; None for anything else."""
    pair = _pair(x, MUL)
    if pair is None:
        return None
    h_val = _val(x)
    for nw, t in (pair, pair[::-1]):
        cast = _to_dtype(t)
        nw_val = _val(nw)
        if cast is None or not isinstance(nw_val, torch.Tensor) or nw_val.dim() != 1:
            continue
        normed, dtype = cast
        scaled = _pair(normed, MUL)
        if scaled is None:
            continue
        for hf, r in (scaled, scaled[::-1]):
            up = _to_dtype(hf)
            if up is None or up[1] != torch.float32 or not fu.is_op(r, RSQRT) or len(r.args) != 1 or r.kwargs:
                continue
            h = up[0]
            h_t = _val(h)
            eps_add = _pair(r.args[0], ADD)
            if eps_add is None or not isinstance(h_t, torch.Tensor):
                continue
            var, eps = eps_add if isinstance(eps_add[1], (int, float)) else eps_add[::-1]
            if not isinstance(eps, (int, float)) or isinstance(eps, bool):
                continue
            sq = _last_dim_mean(var, h_t.dim())
            powed = _pair(sq, POW) if sq is not None else None
            if powed is None or powed[0] is not hf or powed[1] not in (2, 2.0):
                continue
            # HF's RMSNorm, shape for shape; the fold computes it in h's dtype
            if h_t.dtype != dtype or nw_val.dtype != dtype or not isinstance(h_val, torch.Tensor) or h_val.dtype != dtype:
                return "the norm's dtypes differ from its input's"
            if nw_val.shape[0] != h_t.shape[-1]:
                return "the norm weight does not match the input's last dimension"
            chain = [x, t, normed, r, r.args[0], var, sq, hf]
            inner = {id(n) for n in chain}
            for node in chain[1:]:
                readers = set(node.users)
                if node is hf:
                    if readers != {normed, sq}:
                        return "the norm's fp32 input is read elsewhere"
                elif any(id(u) not in inner for u in readers):
                    return f"{node.name} is read outside the norm"
            return h, nw, float(eps), chain
    return None


def _foldable_residual(h: fx.Node, hf: fx.Node, linear: fx.Node, order: dict) -> tuple[fx.Node, fx.Node] | None:
    """``(a, b)`` for ``h = a + b`` whose other readers all come after ``linear``."""
    pair = _pair(h, ADD)
    if pair is None or not all(isinstance(v, fx.Node) for v in pair) or pair[0] is pair[1]:
        return None
    h_val = _val(h)
    for v in pair:
        t = _val(v)
        if not isinstance(t, torch.Tensor) or t.shape != h_val.shape or t.dtype != h_val.dtype:
            return None
    if any(u is not hf and order.get(u, -1) <= order[linear] for u in h.users):
        return None
    return pair


def fold_rms_norm(gm: fx.GraphModule, fold_residual: bool = True) -> FoldNormResult:
    """Fold RMSNorms (and their residual adds) into ``attngraph.linear`` ops (module
    docstring). Mutates ``gm``; returns what it did."""
    result = FoldNormResult()
    graph = gm.graph
    # positions of the graph as it came: a fold's new nodes have none, and a residual read by
    # one of them is not folded (`_foldable_residual`)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for linear in list(graph.nodes):
        if not fu.is_op(linear, LINEAR_OP):
            continue
        x, w, b, rows = (list(linear.args) + [None, None, linear_ops.ANY_ROWS])[:4]
        if linear.kwargs or not isinstance(x, fx.Node):
            continue
        match = _match_norm(x)
        if match is None:
            continue
        if isinstance(match, str) or len(x.users) != 1:
            result.refused.append((linear.name, match if isinstance(match, str) else "the norm is read by more than this linear"))
            continue
        h, nw, eps, chain = match
        operands = _foldable_residual(h, chain[-1], linear, order) if fold_residual else None
        with graph.inserting_before(linear):
            if operands is None:
                new = graph.call_function(torch.ops.attngraph.rms_norm_linear.default, (h, nw, eps, w, b, rows))
                new.meta.update(linear.meta)
                linear.replace_all_uses_with(new)
            else:
                a, r = operands
                new = graph.call_function(torch.ops.attngraph.add_rms_norm_linear.default, (a, r, nw, eps, w, b, rows))
                y = graph.call_function(operator.getitem, (new, 0))
                h_new = graph.call_function(operator.getitem, (new, 1))
                y.meta.update(linear.meta)
                h_new.meta.update(h.meta)
                linear.replace_all_uses_with(y)
        graph.erase_node(linear)
        for dead in chain:  # readers first: each is unread once the ones before it are gone
            graph.erase_node(dead)
        if operands is not None:
            h.replace_all_uses_with(h_new)
            graph.erase_node(h)
            result.with_residual.append(linear.name)
        result.folded.append(linear.name)
    summary = f"fold_rms_norm: {len(result.folded)} norms folded into linear ops ({len(result.with_residual)} with their residual add)"
    fu.finish_rewrite(gm, logger, summary if result.folded else None, result.refused, "fold_rms_norm: the norm before %s stays: %s")
    return result
