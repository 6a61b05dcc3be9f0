"""Pass `check_token_mixing`: in ragged form, only the lowered attention may move data between tokens.

The paged runtime traces a model as ``input_ids[1, N]``, ``position_ids[1, N]``: the N new
tokens of every request of a step, side by side, with no cache. The lowered attention op takes
each request's history from the KV pool; every other op sees only this step's tokens, all
requests mixed. So an op that reads other rows of the token axis (a convolution or a scan over
the sequence, an SSM, linear attention, a shift, a pool, a reduction over tokens) is wrong in
ragged form: at a decode step it sees one token of its request and N - 1 of others, and it has
lost the state the previous steps built. This pass proves that no such op is left, or lists
each one with its module path and reason. It only reads the graph.

Level. The check runs on the ATen re-trace of the lowered Dynamo graph (`aten_graph.to_aten`):
ATen is a closed op set whose ops have schemas (the ``dim`` of a reduction is an argument with
a name) and tags (``torch.Tag.pointwise``), where a Dynamo graph spells the same operation as
a torch function, a Tensor method, an operator or an einsum string. Unknown ops are refused,
so a closed set keeps the check both conservative and free of false refusals.

The token axis. Every dimension whose symbolic size (the fake tensor's ``SymInt``) contains the
token count N of ``input_ids`` / ``position_ids`` (or the logits count L of
``logits_indices``) is a token dimension: reshapes, transposes and broadcasts move it and the
symbol moves with it (``[1, N, 64] -> [N, 4, 16]``, ``[N, 2] -> [2N]``). A token dimension
holds whole tokens in order ("token-major": size ``c*N``, token ``t`` at ``[c*t, c*t + c)``);
a reshape that would break that is refused.

Rows may also be permuted: MoE dispatch sorts (token, expert) pairs by expert
(``sort -> x[perm // k]``), runs a grouped matmul over the sorted rows, and restores the order
(``x[inv_perm]`` with ``inv_perm[perm] = arange``, or ``index_add`` by ``perm``). Each tensor
carries its row order (natural, or sorted by one ``sort``); ops combining rows of different
orders are refused and the output must be in natural order. The group offsets of a grouped
matmul (``cumsum(histc(sorted_ids))``) count tokens across the axis but only choose which weight
each row is multiplied with, so a cross-token reduction whose every use is such an offset is
routing metadata, not mixing.

Allowed besides: the lowered attention op, the gather of the logits rows by
``logits_indices``, and any op on tensors without a token dimension.

Example finding (LFM2's short convolution)::

    model.layers.0.conv: aten.convolution: convolution over the token axis
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any, Iterable

import sympy
import torch
from torch import fx

from . import fx_utils as fu
from .aten_graph import AtenTraceError, to_aten

logger = logging.getLogger(__name__)

aten = torch.ops.aten


@dataclass(frozen=True)
class TokenMixingOp:
    """One op that moves data across the token axis: ``module`` (path), ``op``, ``reason``."""

    module: str
    op: str
    reason: str

    def __str__(self) -> str:
        return f"{self.module or '(top level)'}: {self.op}: {self.reason}"


# Row orders: natural, or sorted by one sort node (``("perm", node)``).
NATURAL = ("natural",)
# What an integer tensor's values index: the rows a sort put in order, divided by d
# (``("root", sort, d)``: ``perm // k`` maps a (token, choice) pair to its token), the inverse
# of that sort (``("inv", sort)``), the logits rows (``("logits",)``), or positions along the
# flattened token axis (``("arange",)``).
LOGITS = ("logits",)
ARANGE = ("arange",)


@dataclass
class _Info:
    order: tuple | None = None  # row order of the token dims (None: no token dim)
    index_of: tuple | None = None


class _Refuse(Exception):
    pass


def _name(target: Any) -> str:
    """``aten.convolution``, ``transformers.grouped_mm_fallback``."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target.overloadpacket)
    return getattr(target, "__name__", str(target))


def _packet(target: Any) -> str:
    """``aten.sum.dim_IntList`` -> ``sum``; ``aten._softmax.default`` -> ``_softmax``."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


REDUCTIONS = {
    "sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "prod", "var", "std", "var_mean",
    "std_mean", "logsumexp", "norm", "linalg_vector_norm", "all", "any", "count_nonzero", "nansum",
    "aminmax", "median", "nanmedian", "mode", "kthvalue",
}
SOFTMAXES = {"_softmax", "_log_softmax", "softmax", "log_softmax", "_safe_softmax"}
SCANS = {"cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "_logcumsumexp"}
HISTOGRAMS = {"histc", "bincount", "histogram"}
VIEWS = {"view", "_unsafe_view", "reshape", "view_as", "_reshape_alias", "unflatten", "flatten"}
DIM_MOVES = {
    "transpose", "t", "permute", "unsqueeze", "squeeze", "movedim", "alias", "detach", "clone",
    "contiguous", "_to_copy", "to", "lift_fresh_copy", "_conj", "resolve_conj", "resolve_neg",
    "expand", "expand_as", "type_as", "numpy_T", "swapaxes",
    # complex views: the trailing (re, im) pair of size 2 is never a token dimension
    "view_as_complex", "view_as_real", "real", "imag",
}
FACTORIES = {
    "empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like", "full_like", "new_empty",
    "new_zeros", "new_ones", "new_full", "scalar_tensor", "empty_strided", "new_empty_strided", "rand",
    "randn", "rand_like", "randn_like",
}
# Tensor-parallel collectives (`torch.distributed._functional_collectives`) whose output row t
# depends on row t of the input on every rank.
COLLECTIVES_SAME_ROWS = {"all_reduce", "all_reduce_", "wait_tensor"}
# Elementwise ops that lack the pointwise tag.
ELEMENTWISE = {"floor_divide", "remainder", "copy_", "copy", "fill_", "fill", "zero_", "masked_fill_", "_to_copy"}


def check_token_mixing(
    gm: fx.GraphModule,
    token_inputs: Iterable[str] = ("input_ids", "position_ids"),
    row_index_inputs: Iterable[str] = ("logits_indices",),
    allowed: Iterable[Any] = (),
) -> list[TokenMixingOp]:
    """The ops of ``gm`` (a lowered ragged Dynamo graph) that move data across the token axis.

    Parameters
    ----------
    gm:
        Dynamo graph whose placeholders carry fake values; ``input_ids: [1, N]`` and
        ``position_ids: [1, N]`` with N symbolic (``mark_dynamic``).
    token_inputs:
        Substrings of the placeholder names whose symbolic sizes define the token axis.
    row_index_inputs:
        Placeholders holding row indices into the token axis (``logits_indices: [L]``);
        gathering by them is allowed and their L axis is checked like the token axis.
    allowed:
        Extra op targets that may mix tokens (the lowered attention op is always allowed).

    Returns
    -------
    list[TokenMixingOp], empty when the graph is token-wise outside the allowed ops. A graph
    that cannot be re-traced to ATen gives one finding saying so (it cannot be proven safe).
    """
    from .lower_attention import ATTENTION_OP

    token_names, index_names = tuple(token_inputs), tuple(row_index_inputs)

    def role_of(ph: fx.Node) -> str | None:
        return "token" if any(t in ph.name for t in token_names) else "index" if any(t in ph.name for t in index_names) else None

    def axis_symbols() -> set[sympy.Symbol]:
        out: set[sympy.Symbol] = set()
        for ph in gm.graph.find_nodes(op="placeholder"):
            val = fu.example_value(ph)
            if role_of(ph) and isinstance(val, torch.Tensor):
                for s in val.shape:
                    out |= _free(s)
        return out

    before = axis_symbols()
    try:
        ag, placeholders = to_aten(gm)
    except AtenTraceError as exc:  # not proven token-wise: say where the analysis stopped
        module = fu.attention_module_path(exc.node)[0] if exc.node is not None else ""
        op = _name(exc.node.target) if exc.node is not None and exc.node.op != "placeholder" else "(graph)"
        return [TokenMixingOp(module, op, f"could not be analysed for token mixing ({exc})")]
    # A size is read through the shape environment's replacements: a kernel that read the token
    # count as an int while re-tracing fixed it to a constant, and a proof over a fixed count
    # would follow no token axis at all (an empty, vacuous answer).
    symbols = axis_symbols()
    if before - symbols:
        fixed = ", ".join(sorted(str(s) for s in before - symbols))
        return [TokenMixingOp("", "(graph)", f"could not be analysed for token mixing: re-tracing to ATen fixed the token count ({fixed}) to a constant")]
    roles = [role_of(ph) for ph in placeholders]
    if not symbols:
        return []  # static token count: nothing symbolic to follow (not a ragged graph)
    checker = _Checker(symbols, {ATTENTION_OP, *allowed})
    found = checker.run(ag, roles)
    logger.debug("check_token_mixing: %d token-mixing ops", len(found))
    return found


def _free(size: Any) -> set:
    if isinstance(size, torch.SymInt):
        return set(size.node.expr.free_symbols)
    return set()


class _Checker:
    def __init__(self, symbols: set, allowed: set) -> None:
        self.symbols = symbols
        self.allowed = allowed
        self.info: dict[fx.Node, _Info] = {}

    # ------------------------------------------------------------------ shapes
    def token_dims(self, value: Any) -> list[int]:
        if not isinstance(value, torch.Tensor):
            return []
        return [d for d, s in enumerate(value.shape) if _free(s) & self.symbols]

    def per_token(self, size: Any) -> sympy.Expr | None:
        """``c`` for a token dimension of size ``c * N`` (None unless c is a positive integer)."""
        expr = size.node.expr
        syms = expr.free_symbols & self.symbols
        if len(syms) != 1:
            return None
        c = sympy.simplify(expr / next(iter(syms)))
        return c if c.is_Integer and c > 0 else None

    # ------------------------------------------------------------------ walk
    def run(self, ag: fx.GraphModule, roles: list[str | None]) -> list[TokenMixingOp]:
        users_only_offsets = self._routing_only(ag)
        found: list[TokenMixingOp] = []
        seen: set[tuple[str, str]] = set()
        ph_index = 0
        for node in ag.graph.nodes:
            if node.op == "placeholder":
                role = roles[ph_index] if ph_index < len(roles) else None
                ph_index += 1
                has = bool(self.token_dims(node.meta.get("val")))
                self.info[node] = _Info(NATURAL if has else None, LOGITS if role == "index" else None)
                continue
            if node.op == "output":
                bad = [n for n in node.all_input_nodes if self.get(n).order not in (None, NATURAL)]
                if bad:
                    self._add(found, seen, node, "output", "the output's rows are left permuted")
                continue
            if node.op != "call_function":
                self.info[node] = _Info()
                continue
            try:
                self.info[node] = self.visit(node)
            except _Refuse as exc:
                self.info[node] = _Info(self._order_of_inputs(node))
                if node not in users_only_offsets:
                    self._add(found, seen, node, _name(node.target), str(exc))
        return found

    def _add(self, found: list, seen: set, node: fx.Node, op: str, reason: str) -> None:
        module, _ = fu.attention_module_path(node)
        key = (module, op, reason)
        if key not in seen:
            seen.add(key)
            found.append(TokenMixingOp(module, op, reason))

    def get(self, node: Any) -> _Info:
        return self.info.get(node, _Info()) if isinstance(node, fx.Node) else _Info()

    def _order_of_inputs(self, node: fx.Node) -> tuple | None:
        orders = {self.get(n).order for n in node.all_input_nodes} - {None}
        return next(iter(orders)) if len(orders) == 1 else (NATURAL if orders else None)

    def _routing_only(self, ag: fx.GraphModule) -> set[fx.Node]:
        """Nodes whose every use ends as the group offsets of a grouped matmul."""
        result: set[fx.Node] = set()
        for node in reversed(ag.graph.nodes):
            if node.op != "call_function" or not node.users:
                continue
            ok = True
            for user in node.users:
                if user in result:
                    continue
                if "grouped_mm" in _packet(user.target) and _offsets_arg(user) is node and node not in user.args[:2]:
                    continue
                ok = False
                break
            if ok:
                result.add(node)
        return result

    # ------------------------------------------------------------------ rules
    def visit(self, node: fx.Node) -> _Info:
        target = node.target
        val = node.meta.get("val")
        inputs = [n for n in node.all_input_nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        carrying = [n for n in inputs if self.token_dims(n.meta["val"])]
        if target is operator.getitem:
            return self._getitem(node)
        if not isinstance(val, (torch.Tensor, tuple, list)):
            if carrying and _packet(target) == "_local_scalar_dense":
                raise _Refuse("reads a value of a tensor with the token axis into a scalar")
            return _Info()  # SymInt arithmetic, shape queries
        if target in self.allowed:
            if any(self.get(n).order not in (None, NATURAL) for n in carrying):
                raise _Refuse("attention reads rows in a permuted order")
            return _Info(NATURAL if self.token_dims(val) else None)
        name = _packet(target)
        if any(self.get(n).index_of == ARANGE for n in carrying) and name not in ("index_put", "index_put_"):
            raise _Refuse("uses the index along the flattened token axis (an arange over tokens) as data; "
                          "in ragged form that axis holds every request's tokens")
        if name in FACTORIES or (not carrying and name != "arange"):
            return _Info(NATURAL if self.token_dims(val) else None)
        if name == "arange":
            return _Info(NATURAL, ARANGE) if self.token_dims(val) else _Info()
        if isinstance(target, torch._ops.OpOverload) and (torch.Tag.pointwise in target.tags or name in ELEMENTWISE):
            return self._pointwise(node, carrying)
        if name in VIEWS:
            return self._view(node)
        if name in DIM_MOVES:
            info = self.get(node.args[0])
            return _Info(info.order, info.index_of)
        handler = _RULES.get(name)
        if handler is not None:
            return handler(self, node, carrying)
        if "grouped_mm" in name:
            return _grouped_mm(self, node, carrying)
        raise _Refuse(f"op {_name(target)} is not known to be token-wise and takes a tensor with the token axis")

    def _getitem(self, node: fx.Node) -> _Info:
        parent, idx = node.args
        info = self.get(parent)
        if info.index_of and info.index_of[0] == "sorted":  # (values, indices) of a sort
            root = info.index_of[1]
            return _Info(("perm", root), ("root", root, 1) if idx == 1 else None)
        return _Info(info.order if self.token_dims(node.meta.get("val")) else None, info.index_of)

    def _pointwise(self, node: fx.Node, carrying: list[fx.Node]) -> _Info:
        out = node.meta.get("val")
        rank = out.dim() if isinstance(out, torch.Tensor) else 0
        placed: set[tuple[int, ...]] = set()
        for n in carrying:
            v = n.meta["val"]
            placed.add(tuple(d + rank - v.dim() for d in self.token_dims(v)))
        if len(placed) > 1:
            raise _Refuse("combines different tokens elementwise (the token axes are broadcast against each other)")
        orders = {self.get(n).order for n in carrying} - {None}
        if len(orders) > 1:
            raise _Refuse("combines rows that are in different orders")
        return _Info(next(iter(orders)) if orders else NATURAL, self._index_after(node, carrying))

    def _index_after(self, node: fx.Node, carrying: list[fx.Node]) -> tuple | None:
        """What an index still indexes after an elementwise op: the same rows after a cast or
        copy; after ``// k`` (k > 0) the pair-to-token map of a sort's rows; else nothing."""
        if len(carrying) != 1 or node.args[0] is not carrying[0]:
            return None
        index_of = self.get(carrying[0]).index_of
        name = _packet(node.target)
        if name in ("_to_copy", "clone", "alias", "detach"):
            return index_of
        if name == "floor_divide" and index_of and index_of[0] == "root":
            k = node.args[1]
            if isinstance(k, int) and not isinstance(k, bool) and k > 0:
                return ("root", index_of[1], index_of[2] * k)
        return None

    def _view(self, node: fx.Node) -> _Info:
        src = node.args[0]
        before, after = src.meta["val"].shape, node.meta["val"].shape
        info = self.get(src)
        if not self._token_major(before, after):
            raise _Refuse("reshapes the token axis so that a dimension holds parts of different tokens")
        return _Info(info.order, info.index_of)

    def _token_major(self, before, after) -> bool:
        """Does the reshape keep each token's elements together, in token order?"""
        tb = [d for d, s in enumerate(before) if _free(s) & self.symbols]
        ta = [d for d, s in enumerate(after) if _free(s) & self.symbols]
        if not tb and not ta:
            return True
        if len(tb) != 1 or len(ta) != 1:
            return [before[d] for d in tb] == [after[d] for d in ta] and _prod(before[: tb[0]] if tb else []) == _prod(after[: ta[0]] if ta else [])
        if self.per_token(before[tb[0]]) is None or self.per_token(after[ta[0]]) is None:
            return False
        return sympy.simplify(_prod(before[: tb[0]]) - _prod(after[: ta[0]])) == 0


def _prod(sizes) -> sympy.Expr:
    out = sympy.Integer(1)
    for s in sizes:
        out = out * (s.node.expr if isinstance(s, torch.SymInt) else sympy.Integer(int(s)))
    return out


def _dims_arg(node: fx.Node, rank: int) -> list[int] | None:
    """The ``dim`` argument of a reduction / softmax / scan, normalized (None: every dim)."""
    schema = node.target._schema
    names = [a.name for a in schema.arguments]
    if "dim" not in names:
        return None
    i = names.index("dim")
    dim = node.kwargs.get("dim", node.args[i] if i < len(node.args) else schema.arguments[i].default_value)
    if dim is None:
        return None
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims and schema.arguments[i].type.kind() != "IntType":  # sum(x, []) reduces every dim
        return None
    return [d % max(rank, 1) for d in dims]


def _offsets_arg(node: fx.Node) -> Any:
    if "offs" in node.kwargs:
        return node.kwargs["offs"]
    return node.args[2] if len(node.args) > 2 else None


def _reduce(c: _Checker, node: fx.Node, carrying: list[fx.Node]) -> _Info:
    src = node.args[0]
    v = src.meta["val"]
    dims = _dims_arg(node, v.dim())
    name = _packet(node.target)
    tok = set(c.token_dims(v))
    if dims is None or tok & set(dims):
        if name in ("sort", "argsort") and dims is not None:
            return _Info(("perm", node), ("sorted", node) if name == "sort" else ("root", node, 1))
        what = (
            "softmax over the token axis" if name in SOFTMAXES
            else "cumulative scan over the token axis" if name in SCANS
            else "selects tokens by value (top-k over the token axis)" if name == "topk"
            else "reduces over the token axis"
        )
        raise _Refuse(what)
    info = c.get(src)
    if name == "sort":
        return _Info(info.order, None)  # sorted along another dim: rows stay
    return _Info(info.order if c.token_dims(node.meta.get("val") if not isinstance(node.meta.get("val"), tuple) else node.meta["val"][0]) else None)


def _norm(c: _Checker, node: fx.Node, carrying: list[fx.Node]) -> _Info:
    src = node.args[0]
    v = src.meta["val"]
    shape = node.args[1]
    n = len(shape) if isinstance(shape, (list, tuple)) else 1
    if set(c.token_dims(v)) & set(range(v.dim() - n, v.dim())):
        raise _Refuse("normalizes over the token axis")
    return _Info(c.get(src).order)


def _topk(c: _Checker, node: fx.Node, carrying: list[fx.Node]) -> _Info:
    v = node.args[0].meta["val"]
    dim = fu.arg(node, 2, "dim", -1) % v.dim()
    if dim in c.token_dims(v):
        raise _Refuse("selects tokens by value (top-k over the token axis)")
    return _Info(c.get(node.args[0]).order)


def _mm(c: _Checker, node: fx.Node, carrying: list[fx.Node]) -> _Info:
    name = _packet(node.target)
    a, b = (node.args[1], node.args[2]) if name in ("addmm", "baddbmm", "addbmm") else (node.args[0], node.args[1])
    va, vb = a.meta["val"], b.meta["val"]
    ta, tb = set(c.token_dims(va)), set(c.token_dims(vb))
    if va.dim() - 1 in ta or vb.dim() - 2 in tb:
        raise _Refuse("matrix product contracting the token axis")
    if va.dim() - 2 in ta and vb.dim() - 1 in tb:
        raise _Refuse("matrix product of tokens with tokens (an attention-like score not lowered)")
    orders = {c.get(n).order for n in (a, b) if c.token_dims(n.meta["val"])} - {None}
    if len(orders) > 1:
        raise _Refuse("combines rows that are in different orders")
    return _Info(next(iter(orders)) if orders else NATURAL)


def _grouped_mm(c: _Checker, node: fx.Node, carrying: list[fx.Node]) -> _Info:
    """``[S, K] x [E, K, O]`` by row groups: each row times its group's weight (MoE experts)."""
    x, w = node.args[0], node.args[1]
    vx = x.meta["val"]
    if c.token_dims(w.meta["val"]) or vx.dim() - 1 in c.token_dims(vx):
        raise _Refuse("grouped matrix product contracting the token axis")
    return _Info(c.get(x).order)


def _conv(c: _Checker, node: fx.Node, carrying: list[fx.Node]) -> _Info:
    x, w = node.args[0], node.args[1]
    if c.token_dims(w.meta["val"]) or set(c.token_dims(x.meta["val"])) - {0}:
        raise _Refuse("convolution over the token axis")
    return _Info(c.get(x).order)


def _pad(c: _Checker, node: fx.Node, carrying: list[fx.Node]) -> _Info:
    x, pad = node.args[0], node.args[1]
    v = x.meta["val"]
    padded = {v.dim() - 1 - i // 2 for i, p in enumerate(pad) if not (isinstance(p, int) and p == 0)}
    if padded & set(c.token_dims(v)):
        raise _Refuse("pads the token axis (a shift of the sequence)")
    return _Info(c.get(x).order)


def _along_dim(reason: str):
    """Rule of an op that cuts, joins or moves along its ``dim`` / ``dims`` argument."""

    def rule(c: _Checker, node: fx.Node, carrying: list[fx.Node]) -> _Info:
        x = node.args[0]
        v = x.meta["val"] if isinstance(x, fx.Node) else x[0].meta["val"]
        args = node.target._schema.arguments
        i = next(k for k, a in enumerate(args) if a.name in ("dim", "dims"))
        dim = node.kwargs.get(args[i].name, node.args[i] if len(node.args) > i else args[i].default_value)
        dim = 0 if dim is None else dim
        dims = [dim] if isinstance(dim, int) else list(dim)
        if {d % v.dim() for d in dims} & set(c.token_dims(v)):
            raise _Refuse(reason)
        srcs = [x] if isinstance(x, fx.Node) else list(x)
        orders = {c.get(n).order for n in srcs if isinstance(n, fx.Node) and c.token_dims(n.meta["val"])} - {None}
        if len(orders) > 1:
            raise _Refuse("combines rows that are in different orders")
        return _Info(next(iter(orders)) if orders else None)

    return rule


def _slice(c: _Checker, node: fx.Node, carrying: list[fx.Node]) -> _Info:
    x = node.args[0]
    v = x.meta["val"]
    dim = fu.arg(node, 1, "dim", 0) % v.dim()
    if dim in c.token_dims(v):
        before, after = v.shape[dim], node.meta["val"].shape[dim]
        if not (isinstance(before, torch.SymInt) and isinstance(after, torch.SymInt) and sympy.simplify(before.node.expr - after.node.expr) == 0):
            raise _Refuse("slices the token axis (drops or shifts tokens)")
    info = c.get(x)
    return _Info(info.order, info.index_of)


def _index(c: _Checker, node: fx.Node, carrying: list[fx.Node]) -> _Info:
    src, indices = node.args[0], node.args[1]
    v = src.meta["val"]
    tok = set(c.token_dims(v))
    src_info = c.get(src)
    order = src_info.order if tok else None
    for dim, idx in enumerate(indices):
        if idx is None:
            continue
        iv, ii = idx.meta["val"], c.get(idx)
        if dim in tok:
            order = _gathered_order(c, src_info.order, c.per_token(v.shape[dim]), ii)
        elif c.token_dims(iv):
            if tok:
                raise _Refuse("indexes one token's values by another token's indices")
            order = ii.order  # a per-row lookup (an expert's bias by the row's expert id)
    return _Info(order if c.token_dims(node.meta["val"]) else None, src_info.index_of if not tok else None)


def _gathered_order(c: _Checker, src_order: tuple | None, src_per_token: Any, index: _Info) -> tuple:
    """Row order of ``src[index]`` gathered along a token dimension holding ``src_per_token``
    rows per token; refuses unless it is the logits rows, a sort's rows, or their inverse."""
    kind = index.index_of[0] if index.index_of else None
    if kind == "logits" and src_order in (None, NATURAL):
        return NATURAL
    if kind == "root" and src_order in (None, NATURAL) and _fits(c, index.index_of, src_per_token):
        return ("perm", index.index_of[1])
    if kind == "inv" and src_order == ("perm", index.index_of[1]) and _fits(c, ("root", index.index_of[1], 1), src_per_token):
        return NATURAL
    if src_order not in (None, NATURAL):
        raise _Refuse("reads rows that were permuted and never put back in token order")
    raise _Refuse("gathers along the token axis with indices computed in the graph")


def _fits(c: _Checker, root: tuple, per_token: Any) -> bool:
    """Does ``sorted_rows // d`` index whole tokens of a dimension with ``per_token`` rows each?
    The sort ran over ``k * N`` token-major rows; ``// d`` leaves ``k / d`` rows per token."""
    sort, d = root[1], root[2]
    src = sort.args[0].meta["val"]
    dim = fu.arg(sort, 1, "dim", -1) % src.dim()
    k = c.per_token(src.shape[dim]) if isinstance(src.shape[dim], torch.SymInt) else None
    return k is not None and per_token is not None and k == d * per_token


def _index_select(c: _Checker, node: fx.Node, carrying: list[fx.Node]) -> _Info:
    src, dim, idx = node.args[0], node.args[1], node.args[2]
    v = src.meta["val"]
    if dim % v.dim() in c.token_dims(v):
        return _Info(_gathered_order(c, c.get(src).order, c.per_token(v.shape[dim % v.dim()]), c.get(idx)))
    return _Info(c.get(idx).order or c.get(src).order)


def _embedding(c: _Checker, node: fx.Node, carrying: list[fx.Node]) -> _Info:
    weight, ids = node.args[0], node.args[1]
    if c.token_dims(weight.meta["val"]):
        raise _Refuse("looks up rows of a tensor that has the token axis")
    return _Info(c.get(ids).order)


def _index_put(c: _Checker, node: fx.Node, carrying: list[fx.Node]) -> _Info:
    dst, indices, values = node.args[0], node.args[1], node.args[2]
    accumulate = fu.arg(node, 3, "accumulate", False)
    v = dst.meta["val"]
    tok = set(c.token_dims(v))
    vi = c.get(values) if isinstance(values, fx.Node) else _Info()
    for dim, idx in enumerate(indices):
        if idx is None or dim not in tok:
            continue
        ii = c.get(idx)
        root = ii.index_of if ii.index_of and ii.index_of[0] == "root" else None
        fits = root is not None and _fits(c, root, c.per_token(v.shape[dim]))
        if fits and root[2] == 1 and vi.index_of == ARANGE and not accumulate:
            return _Info(NATURAL, ("inv", root[1]))  # inv[perm] = arange(S): the inverse permutation
        if fits and accumulate and vi.order == ("perm", root[1]):
            return _Info(NATURAL)  # out[perm // k] += rows: restores the natural order
        raise _Refuse("writes along the token axis at indices computed in the graph")
    if vi.index_of == ARANGE:
        raise _Refuse("uses the index along the flattened token axis (an arange over tokens) as data")
    orders = {c.get(n).order for n in (dst, values) if isinstance(n, fx.Node) and c.token_dims(n.meta["val"])} - {None}
    if len(orders) > 1:
        raise _Refuse("combines rows that are in different orders")
    return _Info(next(iter(orders)) if orders else None)


def _index_add(c: _Checker, node: fx.Node, carrying: list[fx.Node]) -> _Info:
    dst, dim, idx, src = node.args[:4]
    v = dst.meta["val"]
    if dim % v.dim() in c.token_dims(v):
        ii = c.get(idx)
        root = ii.index_of if ii.index_of and ii.index_of[0] == "root" else None
        if root and c.get(src).order == ("perm", root[1]) and _fits(c, root, c.per_token(v.shape[dim % v.dim()])):
            return _Info(NATURAL)
        raise _Refuse("accumulates along the token axis at indices computed in the graph")
    return _Info(c.get(dst).order)


def _scatter_gather(c: _Checker, node: fx.Node, carrying: list[fx.Node]) -> _Info:
    x = node.args[0]
    v = x.meta["val"]
    dim = node.args[1] % v.dim()
    if dim in c.token_dims(v):
        raise _Refuse("gathers or scatters along the token axis")
    orders = {c.get(n).order for n in carrying} - {None}
    if len(orders) > 1:
        raise _Refuse("combines rows that are in different orders")
    return _Info(next(iter(orders)) if orders else None)


def _count(c: _Checker, node: fx.Node, carrying: list[fx.Node]) -> _Info:
    raise _Refuse("counts values across the token axis")


def _refuse(reason: str):
    def rule(c: _Checker, node: fx.Node, carrying: list[fx.Node]) -> _Info:
        raise _Refuse(reason)

    return rule


def _same_rows(c: _Checker, node: fx.Node, carrying: list[fx.Node]) -> _Info:
    """An op whose output row t is a function of input row t on every rank (an all-reduce, or
    the wait for one): token-wise, because every rank runs the same schedule of steps, so row
    t is the same token on each."""
    if len(carrying) != 1 or node.args[0] is not carrying[0]:
        raise _Refuse(f"collective {_name(node.target)} with an unexpected argument layout")
    return _Info(c.get(carrying[0]).order)


def _gather_dim0(c: _Checker, node: fx.Node, carrying: list[fx.Node]) -> _Info:
    """``all_gather_into_tensor`` / ``reduce_scatter_tensor``: ranks' tensors concatenated (or
    reduced and split) along dim 0. Token-wise when dim 0 is not a token dim (transformers'
    tensor-parallel ``lm_head`` gathers ``[1, N, V / R]`` into ``[R, N, V / R]``): the token
    dims keep their rows, and every rank's row t is the same token."""
    if len(carrying) != 1 or node.args[0] is not carrying[0]:
        raise _Refuse(f"collective {_name(node.target)} with an unexpected argument layout")
    if 0 in c.token_dims(carrying[0].meta["val"]):
        raise _Refuse("gathers or scatters the ranks' tensors along the token axis")
    return _Info(c.get(carrying[0]).order)


_RULES = {
    **{n: _same_rows for n in COLLECTIVES_SAME_ROWS},
    "all_gather_into_tensor": _gather_dim0,
    "reduce_scatter_tensor": _gather_dim0,
    **{n: _reduce for n in REDUCTIONS | SOFTMAXES | SCANS | {"sort", "argsort"}},
    **{n: _count for n in HISTOGRAMS},
    "native_layer_norm": _norm,
    "layer_norm": _norm,
    "rms_norm": _norm,
    "_fused_rms_norm": _norm,
    "topk": _topk,
    "mm": _mm,
    "addmm": _mm,
    "bmm": _mm,
    "baddbmm": _mm,
    "convolution": _conv,
    "_convolution": _conv,
    "constant_pad_nd": _pad,
    "cat": _along_dim("concatenates along the token axis"),
    "stack": _along_dim("stacks along the token axis"),
    "split": _along_dim("splits the token axis"),
    "split_with_sizes": _along_dim("splits the token axis"),
    "chunk": _along_dim("splits the token axis"),
    "unbind": _along_dim("splits the token axis into single tokens"),
    "roll": _along_dim("rolls the token axis (a shift)"),
    "flip": _along_dim("reverses the token axis"),
    "select": _along_dim("selects single tokens"),
    "narrow": _along_dim("narrows the token axis"),
    "repeat_interleave": _refuse("repeats elements across the token axis"),
    "slice": _slice,
    "index": _index,
    "_unsafe_index": _index,
    "index_select": _index_select,
    "embedding": _embedding,
    "index_put": _index_put,
    "index_put_": _index_put,
    "_unsafe_index_put": _index_put,
    "index_add": _index_add,
    "index_add_": _index_add,
    "gather": _scatter_gather,
    "scatter": _scatter_gather,
    "scatter_": _scatter_gather,
    "scatter_add": _scatter_gather,
    "scatter_add_": _scatter_gather,
    "scatter_reduce": _scatter_gather,
    "scatter_reduce_": _scatter_gather,
}
