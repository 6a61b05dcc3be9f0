"""Pass `fuse_attention_o`: an attention op and the output projection after it become one op.

In a decode step of one request the attention kernel is latency-bound and the output
projection's GEMV waits for it to end: a kernel boundary per layer on the step's critical
path. After this pass a site's

    a = attngraph.attention(q, k, v, ...)                        # [T, Hq, Dv]
    x = a.view(B, S, Hq, Dv).transpose(1, 2) ... .reshape(B, S, Hq * Dv)   # HF's reshapes
    o = attngraph.linear(x, w_o, b_o, rows)                      # [B, S, N]

reads ``o = attngraph.attention_o(q, k, v, ..., w_o, b_o, rows).view(B, S, N)``: the same
values by the two ops' own path (`ops.attention_o_impl`), or one launch where the backend
serves it (Triton, one request's decode step: `triton_ops.decode_attention_o`, which sums the
projection in another order than the GEMV: equal within rounding).

Proof, not pattern: the views between the two ops are followed as a layout of the op's three
axes (tokens, heads, head dim). ``transpose`` and ``permute`` reorder the axes a dimension
holds, ``view`` / ``reshape`` / ``flatten`` may only merge adjacent dimensions or add and drop
ones of size 1 (their output sizes, symbolic or not, must be the products of the runs they
merge), ``contiguous`` changes nothing. The projection's input must then hold the heads and
the head dim, in that order, in its last dimension and the tokens in the others: row ``t`` of
the projection is token ``t``'s heads, concatenated. Anything else is refused, with the reason
in `FuseAttentionOResult.refused`: a view the layout cannot follow, an intermediate read
elsewhere, a projection other than ``attngraph.linear`` (`skinny_linears` writes it; one that
`fold_norm_epilogue` gave the MLP's norm, or with rotary columns), an attention op whose
rotation was folded into it (`fold_rope`: the fused kernel does not rotate).

Runs in paged mode on a Dynamo graph, after `skinny_linears` and the folds
(`CompileConfig.fuse_attention_o`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import sympy
import torch
from torch import fx

from .. import linear_ops  # registers the ops this pass matches
from .. import ops  # registers attngraph::attention_o
from . import fx_utils as fu
from .lower_attention import ATTENTION_OP

logger = logging.getLogger(__name__)

ATTENTION_O_OP = torch.ops.attngraph.attention_o.default
_LINEAR = torch.ops.attngraph.linear.default
_VIEWS = ("view", "reshape", "flatten")
_PERMUTES = ("transpose", "permute")
_FUNCTIONS = {torch.reshape: "reshape", torch.flatten: "flatten", torch.transpose: "transpose", torch.permute: "permute"}

#: The attention op's arguments, in order (`ops.attention_impl`), and their defaults.
_ATTENTION_ARGS = tuple(a.name for a in ATTENTION_OP._schema.arguments)
_ATTENTION_DEFAULTS = {a.name: a.default_value for a in ATTENTION_OP._schema.arguments if a.has_default_value()}
_LINEAR_ARGS = tuple(a.name for a in _LINEAR._schema.arguments)
_LINEAR_DEFAULTS = {a.name: a.default_value for a in _LINEAR._schema.arguments if a.has_default_value()}


@dataclass
class FuseAttentionOResult:
    """``fused``: (attention op, projection) names now one ``attngraph.attention_o``;
    ``refused``: (attention op name, reason) for the sites left as they were."""

    fused: list[tuple[str, str]] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)


def _bound(node: fx.Node, names: tuple[str, ...], defaults: dict) -> list | None:
    """The op call's arguments in schema order (keywords and defaults filled in), or None."""
    bound = dict(zip(names, node.args))
    for key, value in node.kwargs.items():
        if key not in names or key in bound:
            return None
        bound[key] = value
    if any(n not in bound and n not in defaults for n in names):
        return None
    return [bound[n] if n in bound else defaults[n] for n in names]


def _expr(size) -> sympy.Expr | None:
    if isinstance(size, int):
        return sympy.Integer(size)
    if isinstance(size, torch.SymInt):
        return size.node.expr
    return None


def _is_one(size) -> bool:
    return isinstance(size, int) and size == 1


class _Layout:
    """The tensor between the ops as dimensions of the attention output's axes: ``dims[i]`` is
    the list of axes (0 tokens, 1 heads, 2 head dim; row-major within the dimension) that
    dimension ``i`` holds. Axes of size 1 are left out: they index nothing."""

    def __init__(self, sizes) -> None:
        self.sizes = [_expr(s) for s in sizes]
        self.dims = [[i] if not _is_one(s) else [] for i, s in enumerate(sizes)]
        self.axes = [i for i, s in enumerate(sizes) if not _is_one(s)]  # the axes that index something

    def rows_are_tokens(self) -> bool:
        """The last dimension holds heads then head dim, the others together the tokens."""
        *lead, last = self.dims
        return last == [a for a in (1, 2) if a in self.axes] and sum(lead, []) == [a for a in (0,) if a in self.axes]

    def size(self, dim: list[int]) -> sympy.Expr:
        return sympy.Mul(*(self.sizes[a] for a in dim)) if dim else sympy.Integer(1)

    def permute(self, order: list[int]) -> str | None:
        n = len(self.dims)
        order = [o + n if isinstance(o, int) and o < 0 else o for o in order]
        if sorted(order) != list(range(n)):
            return f"a permutation {order} of {n} dimensions"
        self.dims = [self.dims[o] for o in order]
        return None

    def reshape(self, new_sizes) -> str | None:
        """Merge adjacent dimensions into ``new_sizes`` (sizes of 1 added or dropped)."""
        exprs = [_expr(s) for s in new_sizes]
        if any(e is None for e in exprs):
            return f"a reshape to sizes {tuple(new_sizes)} of unknown kind"
        source = [d for d in self.dims if d]  # dimensions of size 1 hold no axis
        new_dims = []
        for size, expr in zip(new_sizes, exprs):
            if _is_one(size):
                new_dims.append([])
                continue
            run: list[int] = []
            while source and sympy.simplify(self.size(run) - expr) != 0:
                run = run + source.pop(0)
            if sympy.simplify(self.size(run) - expr) != 0:
                return f"a reshape to {tuple(new_sizes)} splits a dimension"
            new_dims.append(run)
        if source:
            return f"a reshape to {tuple(new_sizes)} leaves dimensions over"
        self.dims = new_dims
        return None


def _step(node: fx.Node, layout: _Layout) -> str | None:
    """Apply one view node to ``layout``; a reason where it cannot be followed."""
    kind = node.target if node.op == "call_method" else _FUNCTIONS.get(node.target) if node.op == "call_function" else None
    if kind == "contiguous":
        return None if len(node.args) == 1 and not node.kwargs else "contiguous() with a memory format"
    if kind in _VIEWS:
        shape = fu.shape_of(node)
        return layout.reshape(list(shape)) if shape is not None else f"{node.name} has no known shape"
    if kind == "transpose":
        dims = list(node.args[1:]) + [node.kwargs[k] for k in ("dim0", "dim1") if k in node.kwargs]
        if len(dims) != 2 or not all(isinstance(d, int) for d in dims):
            return f"{node.name}: a transpose of non-constant dimensions"
        n = len(layout.dims)
        i, j = (d % n for d in dims)
        order = list(range(n))
        order[i], order[j] = j, i
        return layout.permute(order)
    if kind == "permute":
        order = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        if node.kwargs or not all(isinstance(d, int) for d in order):
            return f"{node.name}: a permute of non-constant dimensions"
        return layout.permute(list(order))
    return f"{node.name} ({node.target}) is not a view the layout follows"


def _projection_of(attn: fx.Node) -> tuple[fx.Node, list[fx.Node], _Layout] | str:
    """``(projection, view nodes between, layout of its input)`` or a reason."""
    shape = fu.shape_of(attn)
    if shape is None or len(shape) != 3:
        return "the attention output has no known [T, Hq, Dv] shape"
    layout, chain, node = _Layout(shape), [], attn
    while True:
        users = list(node.users)
        if len(users) != 1:
            return f"{node.name} is read by {len(users)} nodes" + (f" ({', '.join(u.name for u in users)})" if users else "")
        (user,) = users
        if user.op == "call_function" and user.target is _LINEAR:
            if user.args[0] is not node or node in user.args[1:] or node in user.kwargs.values():
                return f"{node.name} reaches {user.name} other than as its input"
            return user, chain, layout
        kind = user.target if user.op == "call_method" else _FUNCTIONS.get(user.target) if user.op == "call_function" else None
        if kind not in (*_VIEWS, *_PERMUTES, "contiguous") or not user.args or user.args[0] is not node:
            return f"{user.name} ({user.target}) reads the attention output: not an attngraph.linear after views"
        reason = _step(user, layout)
        if reason is not None:
            return reason
        chain.append(user)
        node = user


def fuse_attention_o(gm: fx.GraphModule) -> FuseAttentionOResult:
    """Replace each attention op whose output reaches only an output projection, through views
    that keep token ``t``'s heads in row ``t``, by ``attngraph.attention_o`` (module
    docstring). Mutates ``gm``; returns what it did."""
    result = FuseAttentionOResult()
    graph = gm.graph
    fu.fill_example_values(gm)  # the earlier passes' nodes: the layout reads every view's shape
    for attn in list(graph.nodes):
        if not (attn.op == "call_function" and attn.target is ATTENTION_OP):
            continue
        args = _bound(attn, _ATTENTION_ARGS, _ATTENTION_DEFAULTS)
        if args is None:
            result.refused.append((attn.name, "the attention op's arguments do not bind to its schema"))
            continue
        if args[12] is not None or args[13] is not None:
            result.refused.append((attn.name, "the rotation is folded into the attention op (fold_rope); the fused kernel does not rotate"))
            continue
        found = _projection_of(attn)
        if isinstance(found, str):
            result.refused.append((attn.name, found))
            continue
        linear, chain, layout = found
        largs = _bound(linear, _LINEAR_ARGS, _LINEAR_DEFAULTS)
        if largs is None or any(a is not None for a in largs[4:6]):
            result.refused.append((attn.name, f"{linear.name} rotates columns or has arguments of unknown form"))
            continue
        x, weight, bias, rows = largs[:4]
        if not layout.dims or not layout.rows_are_tokens():
            result.refused.append((attn.name, f"{linear.name}'s rows are not the tokens with their heads in order "
                                              f"(axes per dimension {layout.dims})"))  # fmt: skip
            continue
        wshape = fu.shape_of(weight)
        if wshape is None or len(wshape) != 2 or not isinstance(wshape[0], int):
            result.refused.append((attn.name, f"{linear.name}'s weight has no known [N, K] shape"))
            continue
        with graph.inserting_before(linear):
            fused = graph.call_function(ATTENTION_O_OP, (*args, weight, bias, rows))
            tokens = graph.call_method("size", (fused, 0))
            sizes = [tokens if dim else 1 for dim in layout.dims[:-1]]
            out = graph.call_method("view", (fused, *sizes, wshape[0]))
        fused.meta.update({k: v for k, v in attn.meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack")})
        linear.replace_all_uses_with(out)
        for node in [linear, *reversed(chain), attn]:
            graph.erase_node(node)
        if not tokens.users:  # tokens were never read
            graph.erase_node(tokens)
        result.fused.append((fused.name, linear.name))
    summary = f"fuse_attention_o: {len(result.fused)} attention ops fused with their output projection"
    fu.finish_rewrite(gm, logger, summary if result.fused else None, result.refused,
                      "fuse_attention_o: %s keeps its projection apart: %s")  # fmt: skip
    return result
