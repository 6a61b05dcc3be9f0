"""Derive what a mask subgraph computes, element by element, as a sympy formula.

Every tensor of the mask's computation is represented by one expression of its element at
index ``(i0, i1, ...)``: an integer or Boolean expression in the index symbols ``I[k]`` and
the graph's size symbols (the ShapeEnv symbols of its fake tensors), or, for float mask values,
a ``Piecewise`` whose pieces are constants. For example::

    i = torch.arange(s)                  # i[k]  = I0
    m = i[:, None] >= i[None, :]         # m[a, b] = I0 >= I1
    f = torch.where(m, 0.0, -inf)        # f[a, b] = Piecewise((0, I0 >= I1), (-inf, True))

`element_formula` walks the subgraph (graph order) and returns the mask's formula together with
its shape; `mask_analysis` then proves it equal to a causal / sliding-window / full pattern for
every length (`linear_proof`). Anything this module cannot model exactly (an op it does not
know, float arithmetic on positions, data it cannot see) raises `NotProvable` with the reason;
it never approximates.

With ``reals=True`` (`ElementInterpreter`) float arithmetic on positions is modelled in exact
real arithmetic, as kind ``"real"``: what an additive position bias (ALiBi) computes, up to
the rounding of its own float operations. A ``"real"`` value may be computed with, selected
by ``where`` and returned, never compared or used as a condition: a mask's Boolean part is
exact in both modes.

Positions given as a trusted input (``position_ids`` in the ragged form) stand for
consecutive positions ``0, 1, ..., N - 1`` along their last dimension, the layout the runtime
describes to the attention op per request.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

import sympy
import torch
from torch import fx

from . import fx_utils as fu

#: ``I[k]``: the index of an element along dimension ``k``.
I = [sympy.Symbol(f"_idx{k}", integer=True, nonnegative=True) for k in range(16)]


class NotProvable(Exception):
    """The mask (or value) could not be proven to be a pure function of shapes/positions."""


class RoundedToFloat(sympy.Function):
    """``RoundedToFloat(e, p)``: the integer ``e`` converted to a float type with ``p``
    significand bits (rounded to nearest). Only comparisons with constants of magnitude
    below ``2**p`` are modelled: those equal the comparisons of ``e`` itself."""

    is_real = True


_FLOAT_BITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


@dataclass
class Sym:
    """One tensor (or scalar) of the mask's computation: ``expr`` of its element at ``I[:ndim]``."""

    expr: Any  # sympy Expr (int / float / real) or Boolean
    kind: str  # "bool" | "int" | "float" | "real" (exact value of a float op, rounding ignored)
    shape: tuple  # sympy sizes
    dtype: torch.dtype | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)


# --------------------------------------------------------------------------- sympy helpers
def size_expr(s: Any) -> sympy.Expr:
    """A traced size (int or SymInt) as a plain sympy expression over the ShapeEnv symbols."""
    if isinstance(s, (torch.SymInt, torch.SymBool, torch.SymFloat)):
        return to_plain(s.node.expr)
    if isinstance(s, bool):
        return sympy.true if s else sympy.false
    if isinstance(s, int):
        return sympy.Integer(s)
    if isinstance(s, float):
        return sympy.Rational(s) if math.isfinite(s) else (sympy.oo if s > 0 else -sympy.oo)
    if isinstance(s, sympy.Basic):
        return to_plain(s)
    raise NotProvable(f"size {s!r} is not an integer")


def to_plain(e: sympy.Basic) -> sympy.Basic:
    """ShapeEnv's sympy functions (``FloorDiv``, ``PythonMod``, ...) as sympy's own."""
    from torch.utils._sympy import functions as F

    table: dict[Any, Callable] = {}
    for name, fn in (
        ("FloorDiv", lambda a, b: sympy.floor(a / b)),
        ("PythonMod", sympy.Mod),
        ("Mod", sympy.Mod),
        ("CleanDiv", lambda a, b: a / b),
        ("CeilDiv", lambda a, b: sympy.ceiling(a / b)),
        ("IntTrueDiv", lambda a, b: a / b),
        ("Max", sympy.Max),
        ("Min", sympy.Min),
        ("FloorToInt", sympy.floor),
        ("CeilToInt", sympy.ceiling),
    ):
        cls = getattr(F, name, None)
        if cls is not None and cls not in (sympy.Mod, sympy.Max, sympy.Min):
            table[cls] = fn

    def walk(x):
        if not x.args:
            if isinstance(x, sympy.Symbol) and not x.is_integer and not x.is_Boolean:
                return sympy.Symbol(x.name, integer=True)
            if isinstance(x, sympy.Symbol) and x.is_integer:
                return sympy.Symbol(x.name, integer=True)
            return x
        args = [walk(a) for a in x.args]
        if type(x) in table:
            return table[type(x)](*args)
        if isinstance(x, sympy.Function) and type(x).__module__.startswith("torch"):
            raise NotProvable(f"the size expression {x} uses {type(x).__name__}")
        return x.func(*args)

    return walk(e)


def _leaves(expr) -> list:
    """The values a float expression can take (the pieces of a Piecewise, else itself)."""
    if isinstance(expr, sympy.Piecewise):
        out = []
        for v, _ in expr.args:
            out += _leaves(v)
        return out
    return [expr]


def _constant_leaves(expr) -> bool:
    return all(v.is_number or v in (sympy.oo, -sympy.oo, sympy.nan) for v in _leaves(expr))


def as_bool(s: Sym) -> Any:
    if s.kind == "bool":
        return s.expr
    if s.kind == "real":
        raise NotProvable("a float computed from positions is used as a condition")
    if s.kind == "float" and not _constant_leaves(s.expr):
        raise NotProvable("a float computed from positions is used as a condition")
    return _rel(sympy.Ne, s.expr, sympy.Integer(0))


def as_number(s: Sym) -> Any:
    if s.kind == "bool":
        return sympy.Piecewise((sympy.Integer(1), s.expr), (sympy.Integer(0), True))
    return s.expr


def _rel(fn, a, b):
    """A relation, pushed into Piecewise pieces so that relations never hold a Piecewise."""
    if isinstance(a, sympy.Piecewise) or isinstance(b, sympy.Piecewise):
        folded = sympy.piecewise_fold(fn(a, b, evaluate=False))
        if isinstance(folded, sympy.Piecewise):
            out, earlier = [], []
            for v, c in folded.args:
                v = v if isinstance(v, sympy.logic.boolalg.Boolean) else _rel(v.func, *v.args)
                out.append(sympy.And(v, c, *[sympy.Not(x) for x in earlier]))
                earlier.append(c)
            return sympy.Or(*out)
        return _rel(folded.func, *folded.args) if isinstance(folded, sympy.core.relational.Relational) else folded
    return fn(a, b)


def _clamp(expr, dtype: torch.dtype):
    """Float leaves beyond the dtype's range become infinities (as the float result would)."""
    if dtype is None or not dtype.is_floating_point:
        return expr
    big = sympy.Rational(torch.finfo(dtype).max)

    def fix(v):
        if v.is_number and v.is_finite is not False and v.is_real:
            if v > big:
                return sympy.oo
            if v < -big:
                return -sympy.oo
        return v

    if isinstance(expr, sympy.Piecewise):
        return sympy.Piecewise(*[(fix(v), c) for v, c in expr.args])
    return fix(expr)


# --------------------------------------------------------------------------- the walk
class ElementInterpreter:
    """Symbolic evaluation of a mask subgraph (see the module docstring)."""

    def __init__(self, positions: set[fx.Node] = frozenset(), reals: bool = False):
        self.positions = set(positions)
        self.reals = reals  # model float arithmetic on positions exactly (kind "real")
        self.env: dict[fx.Node, Any] = {}

    # ---- values
    def value(self, a: Any) -> Any:
        if isinstance(a, fx.Node):
            if a not in self.env:
                self.env[a] = self.node(a)
            return self.env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(self.value(x) for x in a)
        if isinstance(a, bool):
            return Sym(sympy.true if a else sympy.false, "bool", ())
        if isinstance(a, int):
            return Sym(sympy.Integer(a), "int", ())
        if isinstance(a, float):
            return Sym(size_expr(a), "float", ())
        if isinstance(a, (torch.SymInt, torch.SymBool, torch.SymFloat)):
            kind = "int" if isinstance(a, torch.SymInt) else "bool" if isinstance(a, torch.SymBool) else "float"
            return Sym(size_expr(a), kind, ())
        return a  # dtypes, devices, slices, None, Ellipsis ...

    def run(self, node: fx.Node) -> Sym:
        order = {n: i for i, n in enumerate(node.graph.nodes)}
        need = sorted(_ancestors(node), key=order.__getitem__)
        for n in need:  # graph order: no deep recursion
            self.value(n)
        out = self.value(node)
        if not isinstance(out, Sym):
            raise NotProvable(f"{node.name} is not a tensor")
        return out

    def node(self, n: fx.Node) -> Any:
        val = fu.example_value(n)
        if isinstance(val, (torch.SymInt, torch.SymBool, torch.SymFloat, int, float, bool)) and not isinstance(val, torch.Tensor):
            return self.value(val)  # a size: ShapeEnv knows its expression exactly
        if isinstance(val, torch.Size):
            return tuple(self.value(s) for s in val)
        if n.op == "placeholder":
            return self.placeholder(n, val)
        if n.op not in ("call_function", "call_method"):
            raise NotProvable(f"{n.name} ({n.op}) is not modelled")
        target = n.target
        name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
        if n.op == "call_function" and target is getattr:
            return self.getattr(n)
        if n.op == "call_function" and target in (torch.ops.aten.sym_size.int,) or name in ("size", "dim"):
            return self.size_query(n, name)
        handler = _HANDLERS.get(target) or (_METHOD_HANDLERS.get(name) if n.op == "call_method" else None)
        if handler is None:
            raise NotProvable(f"the mask uses {name} ({n.name}), which the prover does not model")
        args = [self.value(a) for a in n.args]
        kwargs = {k: self.value(v) for k, v in n.kwargs.items()}
        out = handler(self, n, *args, **kwargs)
        if isinstance(out, Sym):
            out.expr = _clamp(out.expr, out.dtype) if out.kind == "float" else out.expr
        return out

    def shape(self, n: fx.Node) -> tuple:
        val = fu.example_value(n)
        if isinstance(val, torch.Tensor):
            return tuple(size_expr(s) for s in val.shape)
        if val is None and n.op != "placeholder" and not any(
            isinstance(self.env.get(a), Sym) and self.env[a].ndim for a in n.all_input_nodes
        ):
            return ()  # a Python scalar computed without a traced value (shape-propagated graphs)
        raise NotProvable(f"{n.name} has no traced shape")

    def dtype(self, n: fx.Node) -> torch.dtype | None:
        val = fu.example_value(n)
        return val.dtype if isinstance(val, torch.Tensor) else None

    def placeholder(self, n: fx.Node, val: Any) -> Sym:
        if not isinstance(val, torch.Tensor):
            raise NotProvable(f"input {n.name} has no traced value")
        shape = self.shape(n)
        if n in self.positions and not val.dtype.is_floating_point and val.dtype != torch.bool:
            return Sym(I[len(shape) - 1] if shape else sympy.Integer(0), "int", shape, val.dtype)
        raise NotProvable(f"the mask reads the values of input {n.name}")

    def getattr(self, n: fx.Node) -> Any:
        base, attr = n.args
        if attr in ("shape",):
            return tuple(Sym(s, "int", ()) for s in self.shape(base))
        if attr in ("device", "dtype"):
            return fu.example_value(n)
        if attr in ("T", "mT") and isinstance(self.value(base), Sym):
            x = self.value(base)
            return _permute(x, list(range(x.ndim - 2)) + [x.ndim - 1, x.ndim - 2])
        raise NotProvable(f"attribute {attr} of a tensor in the mask is not modelled")

    def size_query(self, n: fx.Node, name: str) -> Any:
        base = n.args[0]
        shape = self.shape(base)
        if name == "dim":
            return Sym(sympy.Integer(len(shape)), "int", ())
        d = fu.arg(n, 1, "dim")
        if d is None:
            return tuple(Sym(s, "int", ()) for s in shape)
        return Sym(shape[d], "int", ())


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        val = fu.example_value(n)
        # a size's expression is known from its traced value: its inputs are not needed
        if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool) and n.op != "placeholder":
            continue
        stack.extend(n.all_input_nodes)
    return seen


# --------------------------------------------------------------------------- shape algebra
def _rename(expr, mapping: dict) -> Any:
    return expr.xreplace(mapping) if mapping and hasattr(expr, "xreplace") else expr


def broadcast_to(x: Sym, shape: tuple) -> Any:
    """``x``'s element expression in the index symbols of ``shape`` (numpy broadcasting)."""
    off = len(shape) - x.ndim
    if off < 0:
        raise NotProvable("broadcast to fewer dimensions")
    mapping = {}
    for k, s in enumerate(x.shape):
        if s == 1 and shape[k + off] != 1:
            mapping[I[k]] = sympy.Integer(0)
        else:
            mapping[I[k]] = I[k + off]
    return _rename(x.expr, mapping)


def _permute(x: Sym, dims: list[int]) -> Sym:
    """out[..., k, ...] = x[..., dims[k], ...]"""
    dims = [d % x.ndim for d in dims]
    mapping = {I[d]: I[k] for k, d in enumerate(dims)}
    return Sym(_rename(x.expr, mapping), x.kind, tuple(x.shape[d] for d in dims), x.dtype)


def _kind(dtype: torch.dtype | None) -> str:
    if dtype is None:
        return "int"
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "int"


def _cast(x: Sym, dtype: torch.dtype, reals: bool = False) -> Sym:
    kind = _kind(dtype)
    if x.kind == "real":
        if kind != "float":
            raise NotProvable(f"a float computed from positions is converted to {dtype}")
        return Sym(x.expr, "real", x.shape, dtype)
    if reals and kind == "float" and not _constant_leaves(as_number(x)):
        return Sym(as_number(x), "real", x.shape, dtype)  # exact: rounding is not modelled
    if kind == x.kind:
        if kind == "float" and _is_rounded(x.expr) and _FLOAT_BITS.get(dtype, 0) < _FLOAT_BITS.get(x.dtype, 0):
            raise NotProvable(f"a position converted to {x.dtype} and then to {dtype}")
        return Sym(x.expr, kind, x.shape, dtype)
    if kind == "bool":
        return Sym(as_bool(x), kind, x.shape, dtype)
    if kind == "int":
        if x.kind == "float":
            if not _constant_leaves(x.expr):
                raise NotProvable("a float computed from positions is converted to an integer")
            e = x.expr.replace(lambda v: v.is_number and v.is_finite, lambda v: sympy.Integer(int(v)))
            return Sym(e, kind, x.shape, dtype)
        return Sym(as_number(x), kind, x.shape, dtype)
    # to float
    e = as_number(x)
    if _constant_leaves(e):
        bits = _FLOAT_BITS.get(dtype)
        if bits is None or any(v.is_number and abs(v) >= 2 ** bits for v in _leaves(e)):
            raise NotProvable(f"an integer converted to {dtype} may not be exact")
        return Sym(e, kind, x.shape, dtype)
    bits = _FLOAT_BITS.get(dtype)
    if bits is None:
        raise NotProvable(f"conversion to {dtype}")
    return Sym(RoundedToFloat(e, bits), kind, x.shape, dtype)


def _is_rounded(e) -> bool:
    return hasattr(e, "has") and e.has(RoundedToFloat)


# --------------------------------------------------------------------------- handlers
def _out(interp, n, expr, kind=None) -> Sym:
    shape = interp.shape(n)
    dtype = interp.dtype(n)
    if kind is None and dtype is None and isinstance(expr, sympy.logic.boolalg.Boolean):
        kind = "bool"
    return Sym(expr, kind or _kind(dtype), shape, dtype)


def _operands(interp, n, *xs):
    """Each operand broadcast to ``n``'s shape (scalars as they are)."""
    shape = interp.shape(n)
    return [broadcast_to(x, shape) if x.ndim else x.expr for x in xs], shape


def _arith(op: str):
    def handler(interp, n, a, b=None, *rest, **kwargs):
        if rest or set(kwargs) - {"alpha"}:
            raise NotProvable(f"{n.name}: {op} with extra arguments")
        if op == "neg":
            xs = [a]
        else:
            xs = [a, b]
        if not all(isinstance(x, Sym) for x in xs):
            raise NotProvable(f"{n.name}: {op} of a non-tensor")
        out_dtype = interp.dtype(n)
        kind = _kind(out_dtype)
        if out_dtype is None and any(x.kind == "float" for x in xs):
            kind = "float"
        if kind == "bool":
            raise NotProvable(f"{n.name}: {op} of Booleans")
        if interp.reals and kind == "float" and (
            any(x.kind == "real" for x in xs) or not all(_constant_leaves(as_number(x)) for x in xs)
        ):
            return _real_arith(interp, n, op, xs, kwargs.get("alpha"))
        if any(x.kind == "float" and _is_rounded(x.expr) for x in xs):
            raise NotProvable(f"{n.name}: arithmetic on a position converted to float (rounding)")
        if kind == "float" and not all(_constant_leaves(as_number(x)) for x in xs):
            raise NotProvable(f"{n.name}: float arithmetic on positions")
        vals, _ = _operands(interp, n, *xs)
        vals = [as_number(Sym(v, x.kind, ())) for v, x in zip(vals, xs)]
        alpha = kwargs.get("alpha")
        if alpha is not None:
            vals[1] = vals[1] * alpha.expr
        if op == "add":
            e = vals[0] + vals[1]
        elif op == "sub":
            e = vals[0] - vals[1]
        elif op == "rsub":
            e = vals[1] - vals[0]
        elif op == "mul":
            e = vals[0] * vals[1]
        elif op == "neg":
            e = -vals[0]
        elif op == "floordiv":
            if kind == "float":
                raise NotProvable(f"{n.name}: float floor division")
            e = sympy.floor(vals[0] / vals[1])
        elif op == "mod":
            if kind == "float":
                raise NotProvable(f"{n.name}: float remainder")
            e = sympy.Mod(vals[0], vals[1])
        elif op == "truediv":
            raise NotProvable(f"{n.name}: division of positions (a float result)")
        else:
            raise NotProvable(op)
        e = sympy.piecewise_fold(e) if e.has(sympy.Piecewise) else e
        return _out(interp, n, e)

    return handler


def _real_arith(interp, n, op: str, xs: list, alpha) -> Sym:
    """Float arithmetic in exact reals (``reals`` mode): the value the op would compute
    without rounding."""
    vals, _ = _operands(interp, n, *xs)
    vals = [as_number(Sym(v, x.kind, ())) for v, x in zip(vals, xs)]
    if alpha is not None:
        vals[1] = vals[1] * alpha.expr
    ops = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "rsub": lambda a, b: b - a,
           "mul": lambda a, b: a * b, "truediv": lambda a, b: a / b, "neg": lambda a: -a}  # fmt: skip
    if op not in ops:
        raise NotProvable(f"{n.name}: {op} of a float computed from positions")
    e = ops[op](*vals)
    return _out(interp, n, sympy.piecewise_fold(e) if e.has(sympy.Piecewise) else e, "real")


def _pow(interp, n, a, b, **kwargs):
    """``a ** b`` elementwise, in exact reals (``reals`` mode only: ALiBi's slopes are
    ``base ** arange(1, H + 1)``)."""
    if not interp.reals or not isinstance(a, Sym) or not isinstance(b, Sym) or kwargs:
        raise NotProvable(f"{n.name}: pow outside a position bias")
    if a.kind == "bool" or b.kind == "bool":
        raise NotProvable(f"{n.name}: pow of Booleans")
    (x, y), _ = _operands(interp, n, a, b)
    return _out(interp, n, sympy.Pow(as_number(Sym(x, a.kind, ())), as_number(Sym(y, b.kind, ()))), "real")


def _cat(interp, n, tensors, dim=None, **kwargs):
    """``cat(tensors, dim)``: piece ``t`` holds the indices from its offset on."""
    dim = kwargs.get("dim", dim)
    if not isinstance(tensors, (list, tuple)) or not all(isinstance(t, Sym) for t in tensors):
        raise NotProvable(f"{n.name}: cat of non-tensors")
    shape = interp.shape(n)
    d = int(dim.expr) % len(shape) if dim is not None else 0
    t_sym = I[d]
    kinds = {t.kind for t in tensors}
    if "bool" in kinds and kinds != {"bool"}:
        raise NotProvable(f"{n.name}: cat of Booleans with numbers")
    kind = "real" if "real" in kinds else _kind(interp.dtype(n))
    pieces, offset = [], sympy.Integer(0)
    for t in tensors:
        if t.ndim != len(shape):
            raise NotProvable(f"{n.name}: cat of tensors of different ranks")
        e = t.expr.xreplace({t_sym: t_sym - offset})
        e = e if kind == "bool" else as_number(Sym(e, t.kind, ()))
        offset = offset + t.shape[d]
        pieces.append((e, t_sym < offset))
    if kind == "bool":
        return _out(interp, n, sympy.Or(*[sympy.And(e, c) for e, c in pieces]), "bool")
    pieces[-1] = (pieces[-1][0], True)
    return _out(interp, n, sympy.piecewise_fold(sympy.Piecewise(*pieces)), kind)


def _compare(fn):
    def handler(interp, n, a, b, **kwargs):
        if not isinstance(a, Sym) or not isinstance(b, Sym) or kwargs:
            raise NotProvable(f"{n.name}: comparison of non-tensors")
        if a.kind == "real" or b.kind == "real":
            raise NotProvable(f"{n.name}: a comparison of a float computed from positions")
        (x, y), _ = _operands(interp, n, a, b)
        x, y = as_number(Sym(x, a.kind, ())), as_number(Sym(y, b.kind, ()))
        x, y = _unround(n, x, y)
        return _out(interp, n, _rel(fn, x, y), "bool")

    return handler


def _unround(n, x, y):
    """``RoundedToFloat(e, p) < c`` with a constant ``|c| < 2**p`` is ``e < c``: rounding to
    nearest is monotone and keeps every integer below ``2**p`` (and ``c``) exact."""
    for a, b in ((x, y), (y, x)):
        if isinstance(a, RoundedToFloat):
            e, p = a.args
            if _is_rounded(b) or not b.is_number or not abs(b) < 2 ** int(p):
                raise NotProvable(f"{n.name}: a comparison of positions converted to float")
            return (e, b) if a is x else (b, e)
    if _is_rounded(x) or _is_rounded(y):
        raise NotProvable(f"{n.name}: a comparison of positions converted to float")
    return x, y


def _logic(op: str):
    def handler(interp, n, a, b=None, **kwargs):
        xs = [a] if op == "not" else [a, b]
        if not all(isinstance(x, Sym) for x in xs) or kwargs:
            raise NotProvable(f"{n.name}: {op} of non-tensors")
        if any(x.kind != "bool" for x in xs):
            raise NotProvable(f"{n.name}: bitwise {op} of non-Boolean tensors")
        vals, _ = _operands(interp, n, *xs)
        e = {"and": lambda: sympy.And(*vals), "or": lambda: sympy.Or(*vals), "xor": lambda: sympy.Xor(*vals),
             "not": lambda: sympy.Not(vals[0])}[op]()
        return _out(interp, n, e, "bool")

    return handler


def _arange(interp, n, *args, **kwargs):
    ends = [a.expr for a in args if isinstance(a, Sym)]
    for k in ("start", "end", "step"):
        if k in kwargs and isinstance(kwargs[k], Sym):
            ends.append(kwargs[k].expr)
    real = interp.dtype(n).is_floating_point
    if real and not interp.reals:
        raise NotProvable(f"{n.name}: a float arange")
    if len(ends) == 1:
        start, step = sympy.Integer(0), sympy.Integer(1)
    elif len(ends) == 2:
        start, step = ends[0], sympy.Integer(1)
    elif len(ends) == 3:
        start, step = ends[0], ends[2]
    else:
        raise NotProvable(f"{n.name}: arange arguments")
    return _out(interp, n, start + step * I[0], "real" if real else "int")


def _fill(value_index: int | None, value=None):
    def handler(interp, n, *args, **kwargs):
        v = value
        if v is None:
            fill = args[value_index] if len(args) > value_index else kwargs.get("fill_value")
            if not isinstance(fill, Sym) or fill.ndim:
                raise NotProvable(f"{n.name}: fill value")
            v = fill.expr
        dtype = interp.dtype(n)
        kind = _kind(dtype)
        v = sympy.sympify(v)
        if kind == "bool":
            e = sympy.true if (v is sympy.true or v == 1) else sympy.false
        else:
            e = sympy.Integer(int(v)) if kind == "int" else v
            if kind == "float" and not _constant_leaves(e):
                raise NotProvable(f"{n.name}: filled with a position")
        return _out(interp, n, e, kind)

    return handler


def _identity(interp, n, x, *args, **kwargs):
    if not isinstance(x, Sym):
        raise NotProvable(f"{n.name}: not a tensor")
    shape, dtype = interp.shape(n), interp.dtype(n)
    if dtype != x.dtype and x.dtype is not None:
        x = _cast(x, dtype, interp.reals)
    if tuple(shape) != tuple(x.shape):
        raise NotProvable(f"{n.name}: changes the shape")
    return Sym(x.expr, x.kind, shape, dtype)


def _to(interp, n, x, *args, **kwargs):
    return _identity(interp, n, x)


def _expand(interp, n, x, *args, **kwargs):
    shape = interp.shape(n)
    return Sym(broadcast_to(x, shape), x.kind, shape, x.dtype)


def _reshape(interp, n, x, *args, **kwargs):
    """A view or reshape: one that inserts or removes dimensions of size one, or one that
    regroups leading dimensions of constant sizes (``[B, H, S] -> [B * H, 1, S]``)."""
    shape = interp.shape(n)
    src = [(k, s) for k, s in enumerate(x.shape) if s != 1]
    dst = [(k, s) for k, s in enumerate(shape) if s != 1]
    if len(src) != len(dst) or any(sympy.simplify(a - b) != 0 for (_, a), (_, b) in zip(src, dst)):
        return _regroup(n, x, shape)
    mapping = {I[k]: sympy.Integer(0) for k, s in enumerate(x.shape) if s == 1}
    mapping.update({I[ks]: I[kd] for (ks, _), (kd, _) in zip(src, dst)})
    return Sym(_rename(x.expr, mapping), x.kind, shape, x.dtype)


def _regroup(n, x: Sym, shape: tuple) -> Sym:
    """A reshape whose trailing dimensions agree and whose leading ones have constant sizes:
    element ``(o_0, .., o_k, rest)`` is the source element at the same row-major offset."""
    src, dst = list(x.shape), list(shape)
    tail = 0
    while tail < min(len(src), len(dst)) and sympy.simplify(src[-1 - tail] - dst[-1 - tail]) == 0:
        tail += 1
    head_src, head_dst = src[: len(src) - tail], dst[: len(dst) - tail]
    # the first dimension of each side may be symbolic (a batch), the others give the strides
    if (
        not head_src or not head_dst
        or not all(getattr(v, "is_Integer", False) for v in head_src[1:] + head_dst[1:])
        or sympy.simplify(sympy.Mul(*head_src) - sympy.Mul(*head_dst)) != 0
    ):  # fmt: skip
        raise NotProvable(f"{n.name}: a reshape that moves elements between dimensions of symbolic sizes")
    offset = sympy.Integer(0)
    for k, size in enumerate(head_dst):
        offset = offset * size + (I[k] if size != 1 else 0)  # a dimension of size one has index 0
    mapping, stride = {}, 1
    for k in range(len(head_src) - 1, -1, -1):
        mapping[I[k]] = sympy.Mod(sympy.floor(offset / stride), head_src[k]) if k else sympy.floor(offset / stride)
        stride *= int(head_src[k]) if k else 1
    mapping.update({I[len(head_src) + t]: I[len(head_dst) + t] for t in range(tail)})
    return Sym(_rename(x.expr, mapping), x.kind, tuple(shape), x.dtype)  # xreplace: all at once


def _repeat(interp, n, x, *sizes, **kwargs):
    """``x.repeat(*sizes)``: element ``i_k`` of a repeated dimension is ``x``'s ``i_k mod size_k``."""
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
        sizes = sizes[0]
    if kwargs or not isinstance(x, Sym):
        raise NotProvable(f"{n.name}: repeat arguments")
    shape = interp.shape(n)
    off = len(shape) - x.ndim
    if off < 0:
        raise NotProvable(f"{n.name}: repeat to fewer dimensions")
    mapping = {}
    for k, size in enumerate(x.shape):
        mapping[I[k]] = I[k + off] if sympy.simplify(shape[k + off] - size) == 0 else sympy.Mod(I[k + off], size)
    return Sym(_rename(x.expr, mapping), x.kind, shape, x.dtype)  # xreplace: all at once


def _transpose(interp, n, x, d0, d1):
    dims = list(range(x.ndim))
    a, b = d0.expr % x.ndim, d1.expr % x.ndim
    dims[int(a)], dims[int(b)] = dims[int(b)], dims[int(a)]
    return _permute(x, dims)


def _permute_h(interp, n, x, *dims, **kwargs):
    if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
        dims = dims[0]
    if "dims" in kwargs:
        dims = kwargs["dims"]
    return _permute(x, [int(d.expr) for d in dims])


def _where(interp, n, cond, a, b):
    shape = interp.shape(n)
    xs = [cond, a, b]
    if not all(isinstance(x, Sym) for x in xs):
        raise NotProvable(f"{n.name}: where of non-tensors")
    c, va, vb = [broadcast_to(x, shape) if x.ndim else x.expr for x in xs]
    c = as_bool(Sym(c, cond.kind, ()))
    kind = _kind(interp.dtype(n))
    if kind == "bool":
        e = sympy.Or(sympy.And(c, as_bool(Sym(va, a.kind, ()))), sympy.And(sympy.Not(c), as_bool(Sym(vb, b.kind, ()))))
    else:
        va, vb = as_number(Sym(va, a.kind, ())), as_number(Sym(vb, b.kind, ()))
        if kind == "float" and interp.reals and not (_constant_leaves(va) and _constant_leaves(vb)):
            kind = "real"  # a position bias under a mask: the condition stays exact
        elif kind == "float" and not (_constant_leaves(va) and _constant_leaves(vb)):
            raise NotProvable(f"{n.name}: where with float positions")
        e = sympy.piecewise_fold(sympy.Piecewise((va, c), (vb, True)))
    return _out(interp, n, e, kind)


def _masked_fill(interp, n, x, mask, value):
    return _where(interp, n, mask, value, x)


def _tri(upper: bool):
    def handler(interp, n, x, diagonal=None, **kwargs):
        d = kwargs.get("diagonal", diagonal)
        d = d.expr if isinstance(d, Sym) else sympy.Integer(0)
        shape = interp.shape(n)
        r, c = I[len(shape) - 2], I[len(shape) - 1]
        keep = (c - r >= d) if upper else (c - r <= d)
        zero = sympy.false if x.kind == "bool" else sympy.Integer(0)
        if x.kind == "bool":
            e = sympy.And(keep, x.expr)
        else:
            e = sympy.piecewise_fold(sympy.Piecewise((x.expr, keep), (zero, True)))
        return Sym(e, x.kind, shape, x.dtype)

    return handler


def _diff(interp, n, x, n_=None, dim=None, prepend=None, append=None, **kwargs):
    order = kwargs.get("n", n_)
    dim = kwargs.get("dim", dim)
    prepend = kwargs.get("prepend", prepend)
    if (order is not None and int(order.expr) != 1) or kwargs.get("append", append) is not None:
        raise NotProvable(f"{n.name}: diff with n != 1 or append")
    d = int(dim.expr) % x.ndim if dim is not None else x.ndim - 1
    t = I[d]
    cur = x.expr
    prev = x.expr.xreplace({t: t - 1})
    if prepend is None:
        e = cur.xreplace({t: t + 1}) - cur
    else:
        if prepend.shape[d] != 1:
            raise NotProvable(f"{n.name}: diff with a prepend longer than one")
        first = cur.xreplace({t: sympy.Integer(0)}) - prepend.expr.xreplace({t: sympy.Integer(0)})
        e = sympy.Piecewise((as_number(Sym(cur, x.kind, ())) - as_number(Sym(prev, x.kind, ())), t >= 1), (first, True))
    if x.kind != "int":
        raise NotProvable(f"{n.name}: diff of a non-integer tensor")
    return _out(interp, n, sympy.piecewise_fold(sympy.simplify(e)) if isinstance(e, sympy.Piecewise) else e, "int")


def _cumsum(interp, n, x, dim=None, **kwargs):
    dim = kwargs.get("dim", dim)
    d = int(dim.expr) % x.ndim
    t = I[d]
    if x.kind == "real":
        raise NotProvable(f"{n.name}: cumsum of a float computed from positions")
    e = as_number(x)
    if t not in e.free_symbols:
        s = (t + 1) * e
    else:
        u = sympy.Dummy("u", integer=True, nonnegative=True)
        s = sympy.summation(e.xreplace({t: u}), (u, 0, t))
        if s.has(sympy.Sum):
            raise NotProvable(f"{n.name}: cumsum of a position-dependent value")
    return _out(interp, n, sympy.piecewise_fold(s) if s.has(sympy.Piecewise) else s, "int")


def _getitem(interp, n, x, index):
    """Basic indexing (ints, slices, None, Ellipsis) and adjacent advanced (tensor) indices."""
    if isinstance(x, tuple):  # a shape tuple
        if isinstance(index, Sym):
            return x[int(index.expr)]
        raise NotProvable(f"{n.name}: slicing a shape")
    if not isinstance(x, Sym):
        raise NotProvable(f"{n.name}: indexing a non-tensor")
    idx = list(index) if isinstance(index, tuple) else [index]
    n_real = sum(1 for a in idx if a is not None and a is not Ellipsis)
    if Ellipsis in idx:
        k = idx.index(Ellipsis)
        idx = idx[:k] + [slice(None)] * (x.ndim - n_real) + idx[k + 1:]
    idx += [slice(None)] * (x.ndim - sum(1 for a in idx if a is not None))
    out_shape = interp.shape(n)
    tensors = [k for k, a in enumerate(idx) if isinstance(a, Sym) and a.ndim > 0 or (isinstance(a, Sym) and a.kind == "bool")]
    adv_shape: tuple = ()
    if tensors:
        if any(a is None for a in idx) or tensors != list(range(tensors[0], tensors[-1] + 1)):
            raise NotProvable(f"{n.name}: advanced indexing with None or non-adjacent index tensors")
        if any(idx[k].kind != "int" for k in tensors):
            raise NotProvable(f"{n.name}: indexing with a Boolean mask")
        adv_ndim = max(idx[k].ndim for k in tensors)
    mapping: dict = {}
    out_dim = 0
    src_dim = 0
    adv_done = False
    for k, a in enumerate(idx):
        if a is None:
            out_dim += 1
            continue
        if k in tensors:
            if not adv_done:
                adv_shape = tuple(out_shape[out_dim:out_dim + adv_ndim])
                adv_start = out_dim
                out_dim += adv_ndim
                adv_done = True
            t = idx[k]
            e = t.expr.xreplace({I[j]: I[j + adv_ndim - t.ndim] for j in range(t.ndim)})
            e = e.xreplace({I[j]: (sympy.Integer(0) if _broadcast_one(t, j, adv_ndim, adv_shape) else I[j]) for j in range(adv_ndim)})
            e = e.xreplace({I[j]: I[adv_start + j] for j in range(adv_ndim)}) if adv_start else e
            _check_nonneg(n, e)
            mapping[I[src_dim]] = e
            src_dim += 1
            continue
        if isinstance(a, Sym):  # integer index
            e = a.expr
            if not (e.is_number and e >= 0):
                raise NotProvable(f"{n.name}: a negative or symbolic integer index")
            mapping[I[src_dim]] = e
            src_dim += 1
            continue
        if isinstance(a, slice):
            start, step = (_slice_bound(interp, x_, default) for x_, default in ((a.start, 0), (a.step, 1)))
            start, step = sympy.sympify(start), sympy.sympify(step)
            # a symbolic start is fine when it is never negative (MPT: ``max(0, S_max - S)``)
            if not ((start.is_number and start >= 0) or (not start.is_number and start.is_nonnegative)) or not (
                step.is_number and step >= 1
            ):
                raise NotProvable(f"{n.name}: a slice with a negative or symbolic start or step")
            mapping[I[src_dim]] = start + step * I[out_dim]
            out_dim += 1
            src_dim += 1
            continue
        raise NotProvable(f"{n.name}: index {a!r}")
    return Sym(x.expr.xreplace(mapping), x.kind, out_shape, interp.dtype(n))


def _slice_bound(interp, x: Any, default: int) -> Any:
    """A slice's start or step as a sympy expression (a number, a Sym, a traced size)."""
    if x is None:
        return sympy.Integer(default)
    if isinstance(x, fx.Node):
        x = interp.value(x)
    if isinstance(x, Sym):
        return x.expr
    return size_expr(x)


def _broadcast_one(t: Sym, j: int, adv_ndim: int, adv_shape: tuple) -> bool:
    k = j - (adv_ndim - t.ndim)
    return k >= 0 and t.shape[k] == 1 and adv_shape[j] != 1


def _check_nonneg(n, e):
    if not (e.is_nonnegative or (e.free_symbols <= set(I) and sympy.simplify(e).is_nonnegative)):
        raise NotProvable(f"{n.name}: an index tensor that may be negative")


def _scalar_tensor(interp, n, value, *args, **kwargs):
    if not isinstance(value, Sym) or value.ndim:
        raise NotProvable(f"{n.name}: tensor() of a non-scalar")
    return _out(interp, n, value.expr)


_arith_ops = {
    "add": [operator.add, torch.add, "add", "__add__", "__radd__"],
    "sub": [operator.sub, torch.sub, torch.subtract, "sub", "subtract", "__sub__"],
    "rsub": [torch.rsub, "__rsub__"],
    "mul": [operator.mul, torch.mul, "mul", "__mul__", "__rmul__"],
    "floordiv": [operator.floordiv, torch.floor_divide, "floor_divide", "__floordiv__"],
    "mod": [operator.mod, torch.remainder, "remainder", "__mod__"],
    "truediv": [operator.truediv, torch.div, torch.true_divide, "div", "true_divide", "__truediv__"],
    "neg": [operator.neg, torch.neg, "neg", "__neg__"],
}
_cmp_ops = {
    sympy.Lt: [operator.lt, torch.lt, "lt", "__lt__", torch.less, "less"],
    sympy.Le: [operator.le, torch.le, "le", "__le__", torch.less_equal, "less_equal"],
    sympy.Gt: [operator.gt, torch.gt, "gt", "__gt__", torch.greater, "greater"],
    sympy.Ge: [operator.ge, torch.ge, "ge", "__ge__", torch.greater_equal, "greater_equal"],
    sympy.Eq: [operator.eq, torch.eq, "eq", "__eq__"],
    sympy.Ne: [operator.ne, torch.ne, "ne", "__ne__", torch.not_equal, "not_equal"],
}
_logic_ops = {
    "and": [operator.and_, torch.logical_and, torch.bitwise_and, "logical_and", "bitwise_and", "__and__", "__rand__"],
    "or": [operator.or_, torch.logical_or, torch.bitwise_or, "logical_or", "bitwise_or", "__or__", "__ror__"],
    "xor": [operator.xor, torch.logical_xor, torch.bitwise_xor, "logical_xor", "bitwise_xor", "__xor__"],
    "not": [operator.invert, torch.logical_not, torch.bitwise_not, "logical_not", "bitwise_not", "__invert__"],
}

_HANDLERS: dict[Any, Callable] = {}
_METHOD_HANDLERS: dict[str, Callable] = {}


def _register(spellings, handler):
    for s in spellings:
        if isinstance(s, str):
            _METHOD_HANDLERS[s] = handler
        else:
            _HANDLERS[s] = handler


for _op, _sp in _arith_ops.items():
    _register(_sp, _arith(_op))
for _fn, _sp in _cmp_ops.items():
    _register(_sp, _compare(_fn))
for _op, _sp in _logic_ops.items():
    _register(_sp, _logic(_op))
_register([torch.arange], _arange)
_register([torch.full], _fill(1))
_register(["new_full"], _fill(2))
_register([torch.full_like], _fill(1))
_register([torch.zeros, torch.zeros_like, "new_zeros"], _fill(None, 0))
_register([torch.ones, torch.ones_like, "new_ones"], _fill(None, 1))
_register([torch.where], _where)
_register([torch.masked_fill, "masked_fill"], _masked_fill)
_register([torch.triu, "triu"], _tri(True))
_register([torch.tril, "tril"], _tri(False))
_register([torch.diff, "diff"], _diff)
_register([torch.cumsum, "cumsum"], _cumsum)
_register([operator.getitem], _getitem)
_register(["to", "type", "type_as", "contiguous", "clone", "detach", torch.clone, "bool", "long", "int", "float",
           "double", "half", "bfloat16", "short"], _to)
_register(["expand", "expand_as", "broadcast_to", torch.broadcast_to], _expand)
_register([torch.reshape, "reshape", "view", "squeeze", torch.squeeze, "unsqueeze", torch.unsqueeze], _reshape)
_register([torch.transpose, "transpose", "swapaxes", torch.swapaxes], _transpose)
_register([torch.permute, "permute"], _permute_h)
_register([torch.tensor, torch.scalar_tensor, torch.as_tensor], _scalar_tensor)
_register([torch.pow, "pow", "__pow__"], _pow)
_register([torch.cat, torch.concat, torch.concatenate], _cat)
_register(["repeat"], _repeat)
