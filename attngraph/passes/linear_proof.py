"""Decide, for every integer value of the variables, that a formula of linear integer
arithmetic has no solution: the prover behind `mask_analysis`.

A formula is a sympy Boolean over relations between expressions in integer symbols built from
``+``, ``-``, multiplication by constants, ``floor(e / k)`` and ``Mod(e, k)`` with a constant
``k``, ``Abs``, ``Min``, ``Max`` and ``Piecewise``. `unsatisfiable(formula)` answers True only
when it has proven that no integer assignment satisfies it:

1. ``Piecewise`` / ``Abs`` / ``Min`` / ``Max`` inside a relation are split into cases;
   ``floor(e / k)`` becomes a fresh integer ``t`` with ``k*t <= e <= k*t + k - 1`` and
   ``Mod(e, k)`` becomes ``e - k*floor(e / k)``;
2. the formula goes to disjunctive normal form; ``a != b`` is ``a < b or a > b``;
3. each conjunction of linear inequalities is refuted by Fourier-Motzkin elimination, with the
   integer tightening of each inequality (``2x <= 3`` becomes ``x <= 1``).

Step 3 is sound (a refuted system has no rational solution, so no integer one) but not
complete: a system with rational but no integer solutions may survive it. That only ever
makes the answer "not proven".

Example::

    >>> x, y = sympy.symbols("x y", integer=True)
    >>> unsatisfiable((y <= x) & (sympy.floor((x - y) / 4) < 4) & (x - y >= 16))
    True
"""

from __future__ import annotations

import itertools
from fractions import Fraction
from math import floor as _floor, gcd

import sympy
from sympy.logic.boolalg import Boolean, BooleanFalse, BooleanTrue

#: Give up (answer "not proven") beyond this many inequalities or conjunctions.
MAX_INEQUALITIES = 4000
MAX_CONJUNCTIONS = 512


class Unsupported(Exception):
    """The formula is outside linear integer arithmetic with constant divisors."""


# --------------------------------------------------------------------------- normal forms
def _lift_piecewise(formula: Boolean) -> Boolean:
    """Relations over ``Piecewise`` (also ``Abs``/``Min``/``Max``) as Boolean case splits."""

    def lift(rel):
        expr = rel.rewrite(sympy.Piecewise)
        folded = sympy.piecewise_fold(expr)
        if not isinstance(folded, sympy.Piecewise):
            return folded
        return piecewise_to_bool(folded)

    return formula.replace(
        lambda e: isinstance(e, sympy.core.relational.Relational) and e.has(sympy.Piecewise, sympy.Abs, sympy.Min, sympy.Max),
        lift,
    )


def piecewise_to_bool(pw: sympy.Piecewise) -> Boolean:
    """A Piecewise whose pieces are Booleans, as one Boolean (first true condition wins)."""
    out, earlier = [], []
    for value, cond in pw.args:
        out.append(sympy.And(value, cond, *[sympy.Not(c) for c in earlier]))
        earlier.append(cond)
    return sympy.Or(*out)


class _Aux:
    """Fresh integer variables standing for ``floor(e / k)``, with their defining bounds."""

    def __init__(self):
        self.bounds: list[Boolean] = []
        self._names = (sympy.Dummy(f"t{i}", integer=True) for i in itertools.count())
        self._cache: dict[sympy.Expr, sympy.Symbol] = {}

    def floor_of(self, arg: sympy.Expr) -> sympy.Symbol:
        num, den = sympy.fraction(sympy.together(arg))
        if not den.is_Integer or den <= 0:
            raise Unsupported(f"floor of {arg} (not a division by a constant)")
        key = sympy.expand(num) / den
        if key not in self._cache:
            t = next(self._names)
            self._cache[key] = t
            self.bounds += [den * t <= num, num <= den * t + den - 1]
        return self._cache[key]

    def eliminate(self, expr):
        def repl_mod(e):
            a, k = e.args
            if not k.is_Integer or k <= 0:
                raise Unsupported(f"{e} (a remainder by a non-constant)")
            return a - k * sympy.floor(a / k)

        expr = expr.replace(lambda e: isinstance(e, sympy.Mod), repl_mod)
        while True:
            floors = [f for f in expr.atoms(sympy.floor)]
            if not floors:
                return expr
            # innermost first: its argument has no floor left
            f = next(f for f in floors if not f.args[0].has(sympy.floor))
            expr = expr.xreplace({f: self.floor_of(f.args[0])})


def _nnf_dnf(f: Boolean) -> list[list[sympy.core.relational.Relational]]:
    """``f`` (negations pushed onto relations) as a list of conjunctions of relations."""
    R = sympy.core.relational
    if isinstance(f, BooleanTrue) or f is True:
        return [[]]
    if isinstance(f, BooleanFalse) or f is False:
        return []
    if isinstance(f, sympy.Not):
        g = f.args[0]
        if isinstance(g, sympy.And):
            return _nnf_dnf(sympy.Or(*[sympy.Not(a) for a in g.args], evaluate=False))
        if isinstance(g, sympy.Or):
            return _nnf_dnf(sympy.And(*[sympy.Not(a) for a in g.args], evaluate=False))
        if isinstance(g, sympy.Not):
            return _nnf_dnf(g.args[0])
        if isinstance(g, R.Relational):
            return _nnf_dnf(g.negated)
        if isinstance(g, (sympy.Xor, sympy.Implies, sympy.Equivalent, sympy.ITE)):
            return _nnf_dnf(f.to_nnf())
        return _bad(f)
    if isinstance(f, sympy.Or):
        out = []
        for a in f.args:
            out += _nnf_dnf(a)
            if len(out) > MAX_CONJUNCTIONS:
                raise Unsupported("too many cases")
        return out
    if isinstance(f, sympy.And):
        out = [[]]
        for a in f.args:
            out = [x + y for x in out for y in _nnf_dnf(a)]
            if len(out) > MAX_CONJUNCTIONS:
                raise Unsupported("too many cases")
        return out
    if isinstance(f, (sympy.Xor, sympy.Implies, sympy.Equivalent, sympy.ITE)):
        return _nnf_dnf(f.to_nnf())
    if isinstance(f, R.Ne):
        return [[R.StrictLessThan(f.lhs, f.rhs)], [R.StrictGreaterThan(f.lhs, f.rhs)]]
    if isinstance(f, R.Relational):
        return [[f]]
    return _bad(f)


def _bad(f):
    raise Unsupported(f"{f} is not a relation of integer expressions")


# --------------------------------------------------------------------------- Fourier-Motzkin
Ineq = tuple[dict, Fraction]  # sum(coef[x] * x) + const <= 0


def _linear(expr: sympy.Expr) -> tuple[dict, Fraction]:
    expr = sympy.expand(expr)
    try:
        poly = sympy.Poly(expr, *sorted(expr.free_symbols, key=str)) if expr.free_symbols else None
    except sympy.PolynomialError as exc:
        raise Unsupported(f"{expr} is not a polynomial") from exc
    if poly is None:
        if not expr.is_Rational:
            raise Unsupported(f"{expr} is not a rational constant")
        return {}, Fraction(int(expr.p), int(expr.q))
    coefs, const = {}, Fraction(0)
    for monom, c in poly.terms():
        if not c.is_Rational:
            raise Unsupported(f"{expr} has a non-rational coefficient")
        c = Fraction(int(c.p), int(c.q))
        deg = sum(monom)
        if deg == 0:
            const += c
        elif deg == 1:
            coefs[poly.gens[monom.index(1)]] = c
        else:
            raise Unsupported(f"{expr} is not linear")
    return coefs, const


def _to_ineqs(rel) -> list[Ineq]:
    """``rel`` over integers as ``<= 0`` inequalities with integer coefficients."""
    R = sympy.core.relational
    diff = rel.lhs - rel.rhs
    if isinstance(rel, R.Equality):
        return _to_ineqs(R.LessThan(diff, 0)) + _to_ineqs(R.GreaterThan(diff, 0))
    if isinstance(rel, R.GreaterThan):
        diff, strict = -diff, False
    elif isinstance(rel, R.StrictGreaterThan):
        diff, strict = -diff, True
    elif isinstance(rel, R.LessThan):
        strict = False
    elif isinstance(rel, R.StrictLessThan):
        strict = True
    else:
        raise Unsupported(f"relation {rel}")
    coefs, const = _linear(diff)
    # scale to integers, then ``a.x + b < 0`` is ``a.x + b + 1 <= 0``
    den = 1
    for v in list(coefs.values()) + [const]:
        den = den * v.denominator // gcd(den, v.denominator)
    coefs = {k: v * den for k, v in coefs.items()}
    const = const * den
    if strict:
        const += 1
    return [_tighten(coefs, const)]


def _tighten(coefs: dict, const: Fraction) -> Ineq:
    """Integer rounding: ``g*(a'.x) <= -b`` is ``a'.x <= floor(-b / g)``."""
    coefs = {k: v for k, v in coefs.items() if v != 0}
    if not coefs:
        return coefs, const
    if all(v.denominator == 1 for v in coefs.values()):
        g = 0
        for v in coefs.values():
            g = gcd(g, int(v))
        if g > 1:
            return {k: v / g for k, v in coefs.items()}, Fraction(-_floor(-const / g))
    return coefs, const


def _refuted(ineqs: list[Ineq]) -> bool:
    """Fourier-Motzkin with tightening: True when the system provably has no integer solution."""
    system = list(ineqs)
    while True:
        for coefs, const in system:
            if not coefs and const > 0:
                return True
        variables = {v for coefs, _ in system for v in coefs}
        if not variables:
            return False

        def cost(v):
            pos = sum(1 for c, _ in system if c.get(v, 0) > 0)
            neg = sum(1 for c, _ in system if c.get(v, 0) < 0)
            return pos * neg - pos - neg

        v = min(variables, key=lambda x: (cost(x), str(x)))
        upper = [(c, k) for c, k in system if c.get(v, 0) > 0]
        lower = [(c, k) for c, k in system if c.get(v, 0) < 0]
        rest = [(c, k) for c, k in system if c.get(v, 0) == 0]
        new = set()
        for (cu, ku), (cl, kl) in itertools.product(upper, lower):
            a, b = cu[v], -cl[v]
            coefs = {}
            for x in set(cu) | set(cl):
                if x != v:
                    coefs[x] = cu.get(x, 0) * b + cl.get(x, 0) * a
            c2, k2 = _tighten(coefs, ku * b + kl * a)
            new.add((tuple(sorted(((str(x), x, y) for x, y in c2.items()), key=lambda t: t[0])), k2))
        system = rest + [({x: y for _, x, y in c}, k) for c, k in new]
        if len(system) > MAX_INEQUALITIES:
            raise Unsupported("the proof needs too many inequalities")


# --------------------------------------------------------------------------- entry point
def unsatisfiable(formula: Boolean, assumptions: list[Boolean] = ()) -> bool:
    """True when ``formula`` (with ``assumptions``) holds for no integer values of its symbols.

    Raises `Unsupported` when the formula is not linear integer arithmetic as described in the
    module docstring.
    """
    aux = _Aux()
    f = sympy.And(formula, *assumptions)
    f = _lift_piecewise(f)
    f = f.replace(lambda e: isinstance(e, sympy.core.relational.Relational), lambda r: r.func(aux.eliminate(r.lhs), aux.eliminate(r.rhs)))
    f = sympy.And(f, *aux.bounds)
    # sympy drops ``x >= 0`` for a symbol declared nonnegative: restate the declarations
    signs: list[Ineq] = []
    for x in f.free_symbols:
        if x.is_positive:
            signs.append(({x: Fraction(-1)}, Fraction(1)))
        elif x.is_nonnegative:
            signs.append(({x: Fraction(-1)}, Fraction(0)))
    for conj in _nnf_dnf(f):
        ineqs: list[Ineq] = list(signs)
        for rel in conj:
            if isinstance(rel, (BooleanTrue, BooleanFalse)) or rel in (True, False):
                if rel in (False,) or isinstance(rel, BooleanFalse):
                    ineqs.append(({}, Fraction(1)))
                continue
            ineqs += _to_ineqs(rel)
        if not _refuted(ineqs):
            return False
    return True


def equivalent(a: Boolean, b: Boolean, assumptions: list[Boolean] = ()) -> tuple[bool, str]:
    """``(True, "")`` when ``a`` and ``b`` agree for every integer assignment satisfying
    ``assumptions``; otherwise ``(False, which direction failed)``."""
    if not unsatisfiable(sympy.And(a, sympy.Not(b)), assumptions):
        return False, "allows a pair the candidate blocks"
    if not unsatisfiable(sympy.And(sympy.Not(a), b), assumptions):
        return False, "blocks a pair the candidate allows"
    return True, ""
