"""`TokenCountSpecialized`: exact-size compiles for chosen token counts, the dynamic compile
for every other count."""

import pytest
import torch
import torch.nn.functional as F
from torch import fx

from attngraph.compiler.specialize import TokenCountSpecialized, compile_exact, copy_graph_module, free_symbols, token_axis
from attngraph.config import EXACT_INDUCTOR_OPTIONS, CompileConfig
from attngraph.errors import ConfigError


def _dynamo_graph(fn, *args):
    """``fn`` traced by Dynamo with the first argument's rows dynamic: its graph and its
    placeholders' fake values (symbolic sizes, as the runtime's compile hook sees them)."""
    seen = []

    def grab(gm, example_inputs):
        fakes = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
        seen.append((gm, fakes))
        return gm.forward

    torch._dynamo.reset()
    torch._dynamo.mark_dynamic(args[0], 0)  # the token rows
    torch.compile(fn, backend=grab, fullgraph=True)(*args)
    (gm, inputs), = seen
    return gm, inputs


def _token_input(inputs):
    """The fake input whose rows are symbolic (Dynamo orders inputs its own way)."""
    (x,) = [a for a in inputs if isinstance(a, torch.Tensor) and isinstance(a.shape[0], torch.SymInt)]
    return x


def _real_args(inputs, x, wgu, wd):
    """``inputs`` with real values: ``x`` for the token input, its row count for a symbolic
    scalar, the weights by shape."""
    tok = _token_input(inputs)
    out = []
    for a in inputs:
        if isinstance(a, torch.SymInt):
            out.append(x.shape[0])
        elif a is tok:
            out.append(x)
        else:
            out.append(wgu if tuple(a.shape) == tuple(wgu.shape) else wd)
    return out


def _mlp(x, w_gate_up, w_down):
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down) + x


def _weights(k=16, i=24):
    return torch.randn(2 * i, k), torch.randn(k, i)


def test_token_axis_finds_the_symbolic_dim():
    wgu, wd = _weights()
    gm, inputs = _dynamo_graph(_mlp, torch.randn(5, 16), wgu, wd)
    tok = _token_input(inputs)
    symbols = free_symbols([tok])
    assert symbols and token_axis(list(inputs), symbols) == ([i for i, a in enumerate(inputs) if a is tok][0], 0)
    assert token_axis(list(inputs), set()) is None


def test_exact_counts_compile_once_per_size_and_others_run_dynamic():
    wgu, wd = _weights()
    gm, inputs = _dynamo_graph(_mlp, torch.randn(5, 16), wgu, wd)
    axis = token_axis(list(inputs), free_symbols([_token_input(inputs)]))
    compiled, dynamic_calls = [], []

    def compile_exact(g, fakes):
        assert isinstance(g, fx.GraphModule) and g is not spec.graph_module  # a copy per compile
        sizes = [tuple(f.shape) if isinstance(f, torch.Tensor) else f for f in fakes]
        assert all(isinstance(d, int) for s in sizes for d in (s if isinstance(s, tuple) else (s,)))  # static
        compiled.append(sizes)
        return g.forward

    def dynamic(*args):
        dynamic_calls.append(args[axis[0]].shape[axis[1]])
        return gm.forward(*args)

    spec = TokenCountSpecialized(gm, dynamic, axis, (1, 2), compile_exact, devices=("cpu",))
    for rows in (1, 1, 3, 2, 1, 7):
        x = torch.randn(rows, 16)
        out = spec(*_real_args(inputs, x, wgu, wd))
        (ref,) = out if isinstance(out, (tuple, list)) else (out,)
        torch.testing.assert_close(ref, _mlp(x, wgu, wd))
    assert [s[axis[0]][axis[1]] for s in compiled] == [1, 2]  # once per exact size, on first use
    assert dynamic_calls == [3, 7]


def test_other_devices_run_the_dynamic_compile():
    gm = fx.symbolic_trace(lambda x: x * 2)
    spec = TokenCountSpecialized(gm, gm.forward, (0, 0), (1,), lambda g, f: pytest.fail("compiled"))  # CUDA only
    torch.testing.assert_close(spec(torch.ones(1, 3)), torch.full((1, 3), 2.0))


def test_graph_copy_is_independent():
    gm = fx.symbolic_trace(lambda x: torch.relu(x) + 1)
    copy = copy_graph_module(gm)
    for node in list(copy.graph.nodes):
        if node.op == "call_function" and node.target is torch.relu:
            node.target = torch.tanh
    copy.recompile()
    x = torch.randn(4)
    assert torch.equal(gm(x), torch.relu(x) + 1)
    assert torch.equal(copy(x), torch.tanh(x) + 1)


@pytest.mark.parametrize("rows", [1, 2])
def test_inductor_compiles_the_exact_size_as_reductions(rows):
    """The real compile path on the CPU: a Dynamo graph with symbolic sizes, compiled by
    inductor for ``rows`` token rows with the skinny-product decompositions: no GEMM call is
    left in the generated code, and the result matches eager in fp32."""
    from torch._inductor.utils import run_and_get_code

    wgu, wd = _weights()
    gm, inputs = _dynamo_graph(_mlp, torch.randn(5, 16), wgu, wd)
    axis = token_axis(list(inputs), free_symbols([_token_input(inputs)]))
    calls = []

    def compile_fn(g, fakes):
        calls.append(1)
        return compile_exact(g, fakes, EXACT_INDUCTOR_OPTIONS)

    spec = TokenCountSpecialized(gm, gm.forward, axis, (rows,), compile_fn, devices=("cpu",))
    x = torch.randn(rows, 16)
    out, code = run_and_get_code(spec, *_real_args(inputs, x, wgu, wd))
    (got,) = out if isinstance(out, (tuple, list)) else (out,)
    torch.testing.assert_close(got, _mlp(x, wgu, wd), rtol=1e-5, atol=1e-5)
    assert calls == [1] and code
    assert not any("extern_kernels.mm" in c or "extern_kernels.addmm" in c for c in code)


def test_skinny_decomposition_keeps_wide_products_and_bias():
    from attngraph.compiler.specialize import _skinny_addmm, _skinny_mm

    a, b, bias = torch.randn(3, 8), torch.randn(8, 5), torch.randn(5)
    assert _skinny_mm(a, b, max_rows=2) is NotImplemented  # 3 rows: the usual GEMM
    torch.testing.assert_close(_skinny_mm(a[:2], b, max_rows=2), a[:2] @ b)
    torch.testing.assert_close(_skinny_addmm(bias, a[:1], b, max_rows=2), torch.addmm(bias, a[:1], b))
    assert _skinny_addmm(bias, a[:1], b, beta=2, max_rows=2) is NotImplemented
    half = _skinny_mm(a[:2].bfloat16(), b.bfloat16(), max_rows=2)
    assert half.dtype == torch.bfloat16 and half.shape == (2, 5)


def test_config_resolution_and_validation():
    assert CompileConfig().resolved_exact_token_counts("cuda") == ()  # off by default
    on = CompileConfig(exact_token_counts=(2,))
    assert on.resolved_exact_token_counts("cuda") == (2,)
    assert on.resolved_exact_token_counts("cpu") == ()  # CPU pieces run eager
    assert on.replace(piece_compiler="eager").resolved_exact_token_counts("cuda") == ()
    assert on.replace(piece_compiler="inductor").resolved_exact_token_counts("cpu") == (2,)
    assert CompileConfig(exact_token_counts=(4, 1, 1)).exact_token_counts == (1, 4)
    assert CompileConfig(exact_token_counts=()).resolved_exact_token_counts("cuda") == ()
    opts = CompileConfig(inductor_options={"combo_kernels": False}).resolved_exact_inductor_options("cuda")
    assert opts == {"combo_kernels": False, **EXACT_INDUCTOR_OPTIONS}
    for bad in ((0,), (1.0,), (True,), 3):
        with pytest.raises(ConfigError, match="exact_token_counts"):
            CompileConfig(exact_token_counts=bad)
