"""The graphs the paged compiler hands to inductor are ones AOTAutograd's cache accepts.

AOTAutograd refuses to cache a graph with a method call on a node that has no traced example
value; the passes add such nodes (the lowered op's reshapes, `fuse_linears`' narrow views,
`absorb_mla`'s projections). A refused graph is traced to ATen again in every process that
compiles it, which is seconds of start-up per process; `fill_example_values` gives the new
nodes their values.
"""

import pytest
import torch

import attngraph
from attngraph.compiler import backend as backend_module
from attngraph.compiler.ragged_check import ROW_INDEX_INPUTS
from attngraph.compiler.split import STATIC, split_at_attention
from attngraph.passes import fx_utils as fu
from tests.hf_models import build_model

autograd_cache = pytest.importorskip("torch._functorch._aot_autograd.autograd_cache")


def _compiled_graphs(monkeypatch, arch: str) -> list[torch.fx.GraphModule]:
    """The lowered graphs `accelerate` passes to the piece compiler (run eagerly here)."""
    seen = []

    def record(gm, example_inputs, piece_compiler, inductor_options=None):
        seen.append(gm)
        return gm.forward

    monkeypatch.setattr(backend_module, "compile_graph", record)
    model = build_model(arch, "sdpa", seed=3)
    attngraph.accelerate(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 10)
    return seen


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])  # fused q/k/v and gate/up; MLA absorbed
def test_lowered_graph_is_cacheable(monkeypatch, arch):
    (gm,) = _compiled_graphs(monkeypatch, arch)
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    missing = [n.format_node() for n in calls if "example_value" not in n.meta]
    assert not missing, "nodes without an example value:\n" + "\n".join(missing[:10])
    # The passes did add nodes (else this test would not test the fill).
    assert any(n.op == "call_function" and "fused_linear" in str(n.args) for n in calls) or arch == "deepseek_v3"
    autograd_cache.check_cacheable(gm)  # raises BypassAOTAutogradCache with the reason
    split = split_at_attention(gm, ROW_INDEX_INPUTS)
    for piece in split.pieces:
        if piece.kind == STATIC:
            autograd_cache.check_cacheable(getattr(split.module, piece.name))


def test_fill_example_values_computes_in_the_graphs_mode():
    """A node added without a value gets one of the right shape, in the mode of the graph's own
    values, also with a symbolic size (which needs the Python dispatcher on older torch)."""
    from torch._subclasses.fake_tensor import FakeTensor

    def f(x, w):
        return torch.nn.functional.linear(x, w).relu()

    seen = []

    def capture(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    x, w = torch.randn(5, 4), torch.randn(6, 4)
    torch._dynamo.mark_dynamic(x, 0)
    torch.compile(f, backend=capture, fullgraph=True)(x, w)
    (gm,) = seen
    graph = gm.graph
    relu = next(n for n in graph.nodes if n.op in ("call_function", "call_method") and "relu" in str(n.target))
    with graph.inserting_after(relu):
        narrow = graph.call_method("narrow", (relu, -1, 1, 3))
    with graph.inserting_after(narrow):
        double = graph.call_function(torch.mul, (narrow, 2))
    assert fu.fill_example_values(gm) == 2
    value = double.meta["example_value"]
    assert isinstance(value, FakeTensor) and value.fake_mode is fu.graph_fake_mode(graph)
    assert value.shape[1] == 3 and isinstance(value.shape[0], torch.SymInt)
    assert fu.fill_example_values(gm) == 0  # nothing left to fill
