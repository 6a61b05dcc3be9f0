"""The aliasing analysis finds writes through views that no list of names knows.

Storage decides where nodes carry fake tensors (Dynamo's, or those `find_attention`
propagates itself); where none can be had, an op's aten schema decides by its alias
annotations, and an op without a schema may alias every input. ``aten.numpy_T`` (what ``.T``
and ``.mT`` trace to under newer torch) and a Python function returning a view are the probes.
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx

from attngraph.passes import find_attention
from attngraph.passes import fx_utils as fu

from . import test_pass_edge_cases as E


def _my_view(x):
    """A view op the passes have never heard of (a plain Python function in the graph)."""
    return x.view(-1)


def graph_with_write(view_target, op="call_function") -> tuple[fx.Graph, fx.Node, fx.Node]:
    """``x`` -> ``view_target(x)`` -> ``view[0] = 1``; no node carries a value."""
    g = fx.Graph()
    x = g.placeholder("x")
    if op == "call_method":
        view = g.call_method(view_target, (x,))
    else:
        view = g.call_function(view_target, (x,))
    write = g.call_function(operator.setitem, (view, 0, 1.0))
    g.output(g.call_function(operator.add, (x, 1.0)))
    return g, x, write


@pytest.mark.parametrize(
    "target,op",
    [
        (torch.ops.aten.numpy_T.default, "call_function"),
        (torch.ops.aten.numpy_T, "call_function"),  # the overload packet
        (torch.ops.aten.matrix_H.default, "call_function"),
        ("mT", "call_method"),  # no aten op of that name: unknown, so may alias
        ("unfold_view_we_do_not_know", "call_method"),
        (_my_view, "call_function"),
        (torch.ops.aten.alias.default, "call_function"),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_write_through_a_view_without_values_is_found(target, op):
    g, x, write = graph_with_write(target, op)
    assert fu.first_write(fu.aliases([x])) is write


@pytest.mark.parametrize(
    "target",
    [torch.add, torch.ops.aten.clone.default, torch.ops.aten.mul.Tensor, operator.neg],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_fresh_results_do_not_alias_by_schema(target):
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(target, (x,) if target in (operator.neg, torch.ops.aten.clone.default) else (x, 2.0))
    write = g.call_function(operator.setitem, (y, 0, 1.0))
    g.output(x)
    assert fu.first_write(fu.aliases([x])) is None
    assert fu.first_write(fu.aliases([y])) is write


def test_schema_names_the_aliased_argument():
    g = fx.Graph()
    x, idx = g.placeholder("x"), g.placeholder("idx")
    sel = g.call_function(torch.ops.aten.select.int, (x, 0, 1))
    gathered = g.call_function(torch.ops.aten.index_select.default, (x, 0, idx))
    g.output((sel, gathered))
    assert fu.may_alias_inputs(sel) == [x]
    assert fu.may_alias_inputs(gathered) == []


class NumpyTMask(E.P.Proj):
    """A causal mask written through ``aten.numpy_T`` (the view ``.T`` traces to on newer torch)."""

    def __init__(self, write: bool = True):
        super().__init__(heads_kv=E.P.HQ)
        self.write = write

    def forward(self, x):
        q, k, v = E.P.qkv(self.proj(x), E.P.HQ)
        mask = E.causal_float_mask(x.shape[1], x.device, x.dtype)
        if self.write:
            torch.ops.aten.numpy_T.default(mask[0, 0])[-1] = 0  # the last key is visible to every query
        w = torch.matmul(q, k.transpose(2, 3)) * 0.3 + mask
        return self.finish(torch.matmul(w.softmax(-1), v))


def test_numpy_t_write_through_compile_is_refused():
    module = NumpyTMask()
    assert E.outputs_differ(module, "write", False)
    b = E.compile_check(module)
    E.assert_refused(b, E.MUTATED_MASK)


def _no_fake_propagation(monkeypatch):
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    def fail(*args, **kwargs):
        raise RuntimeError("no fake propagation")

    monkeypatch.setattr(FakeTensorProp, "propagate_dont_convert_inputs", fail)


@pytest.fixture(params=["fake values", "shapes only"])
def propagation(request, monkeypatch):
    """How `find_attention` fills a graph without Dynamo's values: fake tensors (storages), or,
    when fake propagation fails, shapes only (the ops' schemas decide aliasing)."""
    if request.param == "shapes only":
        _no_fake_propagation(monkeypatch)
    return request.param


@pytest.mark.parametrize("write", [True, False])
def test_numpy_t_write_without_example_values(write, propagation):
    gm, inputs = E.captured_graph(NumpyTMask(write))
    (site,) = find_attention(E.without_example_values(gm), example_inputs=inputs)
    if write:
        assert not site.lowerable and E.MUTATED_MASK in site.reason, site.reason
    else:
        assert site.lowerable and site.causal, site.reason
    has_val = any("val" in n.meta for n in gm.graph.nodes)
    assert has_val == (propagation == "fake values")


@pytest.mark.parametrize("form", E.MASK_WRITES_BY_VIEW, ids=[str(f) for f in E.MASK_WRITES_BY_VIEW])
def test_mask_writes_found_with_shapes_only(form, monkeypatch):
    """test_pass_edge_cases' view writes, when only shapes can be propagated."""
    _no_fake_propagation(monkeypatch)
    gm, inputs = E.captured_graph(E.MutatedMask(form))
    (site,) = find_attention(E.without_example_values(gm), example_inputs=inputs)
    if form is None:
        assert site.lowerable and site.causal, site.reason
    else:
        assert not site.lowerable and E.MUTATED_MASK in site.reason, site.reason
