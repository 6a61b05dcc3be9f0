"""The element formulas behind the ALiBi proof, checked against the tensors they describe.

`symbolic_mask.ElementInterpreter` derives one expression per tensor; here every expression is
evaluated at every index of small traced programs (regrouping reshapes, ``repeat``, ``cat``,
``pow`` and float arithmetic in exact reals) and compared with what torch computes. Then
`position_bias.prove_bias` must accept per-head linear biases, return their slopes, and refuse
biases whose step from one key to the next is not a per-head constant.
"""

from __future__ import annotations

import itertools

import pytest
import sympy
import torch

from attngraph.passes.position_bias import prove_bias, split_bias
from attngraph.passes.symbolic_mask import I, ElementInterpreter, NotProvable


def formula(fn, *shapes, reals: bool = True):
    """``fn`` traced with symbolic sizes (Dynamo), its output's element formula and shape, and
    the traced graph's example inputs."""
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    args = [torch.zeros(s) for s in shapes]
    torch._dynamo.reset()
    torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)(*args)
    gm = graphs[0]
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    out = out[0] if isinstance(out, (tuple, list)) else out
    return ElementInterpreter(reals=reals).run(out)


def check_everywhere(sym, want: torch.Tensor) -> None:
    shape = [int(s) for s in sym.shape]
    assert list(want.shape) == shape
    f = sympy.lambdify(I[: len(shape)], sympy.sympify(sym.expr), "math")
    for idx in itertools.product(*(range(s) for s in shape)):
        got = float(f(*idx)) if len(shape) else float(sympy.sympify(sym.expr))
        assert got == pytest.approx(float(want[idx]), rel=1e-6, abs=1e-9), (idx, got, float(want[idx]))


def test_regrouping_reshape_repeat_and_cat_match_torch():
    def fn(x):
        b, s = 3, x.shape[-1]
        slopes = torch.cat([torch.pow(torch.full((), 0.5), torch.arange(1, 4)), torch.full((1,), 0.3)])  # [4]
        pos = torch.arange(s)
        t = slopes[None, :, None] * pos[None, None, :] + torch.arange(b)[:, None, None]  # [B, 4, S]
        grouped = t.reshape(b * 4, 1, s)  # the batch and head dimensions merged
        back = grouped.reshape(b, -1, 1, s)
        return back.repeat(1, 1, 2, 1)  # [B, 4, 2, S]

    sym = formula(fn, (5,))
    slopes = torch.cat([0.5 ** torch.arange(1, 4), torch.tensor([0.3])])
    want = (slopes[None, :, None] * torch.arange(5)[None, None, :] + torch.arange(3)[:, None, None]).reshape(3, 4, 1, 5)
    check_everywhere(sym, want.repeat(1, 1, 2, 1))


def test_float_arithmetic_on_positions_needs_reals():
    def fn(x):
        return torch.arange(x.shape[0]).float() * 0.25

    with pytest.raises(NotProvable):
        formula(fn, (6,), reals=False)
    sym = formula(fn, (6,))
    assert sym.kind == "real"
    check_everywhere(sym, torch.arange(6) * 0.25)


def test_a_float_computed_from_positions_is_never_a_condition():
    def fn(x):
        pos = torch.arange(x.shape[0]).float() * 0.5
        return torch.where(pos > 1.0, 0.0, float("-inf"))

    with pytest.raises(NotProvable, match="comparison|condition"):
        formula(fn, (6,))


S = sympy.Symbol("s", integer=True, positive=True)  # a traced length


@pytest.mark.parametrize("bias,shape,slopes", [
    (sympy.Rational(1, 4) ** (I[0] + 1) * I[2], (4, 1, S), [0.25, 0.0625, 0.015625, 0.00390625]),  # Falcon / Bloom
    (-(I[0] + 1) * sympy.Rational(1, 8) * (S - 1 - I[2]), (4, 1, S), [0.125, 0.25, 0.375, 0.5]),  # MPT: j - (S - 1)
    (0.5 * (I[2] - I[1]), (2, S, S), [0.5, 0.5]),  # one slope for every head, relative to the query
])  # fmt: skip
def test_prove_bias_reads_per_head_slopes(bias, shape, slopes):
    assert prove_bias(bias, shape, len(slopes)) == pytest.approx(slopes, rel=1e-12)


def test_prove_bias_on_merged_heads():
    # Bloom: dimension 0 is b * H + h
    bias = sympy.Rational(1, 4) ** (sympy.Mod(I[0], 4) + 1) * I[2]
    assert prove_bias(bias, (4 * S, 1, S), 4, merged_heads=True) == pytest.approx([0.25, 0.0625, 0.015625, 0.00390625])
    heads_major = sympy.Rational(1, 4) ** (sympy.floor(I[0] / 3) + 1) * I[2]  # h * B + b with B = 3: not the layout
    with pytest.raises(NotProvable):
        prove_bias(heads_major, (12, 1, S), 4, merged_heads=True)


@pytest.mark.parametrize("bias,why", [
    (I[2] ** 2 * sympy.Rational(1, 8), "key index"),  # not linear in the key
    (I[2] * I[1] * sympy.Rational(1, 8), "query index"),  # a slope that changes with the query
    (I[2] / S, "size"),  # a slope that changes with the length
    (I[3] * (I[0] + 1), "the batch row"),  # a slope per batch row
])  # fmt: skip
def test_prove_bias_refuses_what_is_not_alibi(bias, why):
    with pytest.raises(NotProvable, match=why):
        prove_bias(bias, (2, 4, S, S) if bias.has(I[3]) else (4, S, S), 4)


def test_split_bias_separates_blocked_pieces():
    bias = sympy.Rational(1, 2) * I[1]
    minimum = sympy.Float(torch.finfo(torch.float32).min)
    allowed, got = split_bias(sympy.Piecewise((minimum + bias, I[1] > I[0]), (bias, True)))
    assert got == bias and allowed.subs({I[0]: 3, I[1]: 5}) in (False, sympy.false)
    with pytest.raises(NotProvable, match="different biases"):
        split_bias(sympy.Piecewise((2 * bias, I[1] > I[0]), (bias, True)))
