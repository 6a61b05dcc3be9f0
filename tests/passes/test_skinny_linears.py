"""Pass `skinny_linears` on Dynamo graphs: op counts before and after, the folds it must refuse,
and the rewritten graph's values against the module it was traced from (fp32 on the CPU, where
the ops run ``torch.nn.functional.linear``)."""

import operator

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.llama.modeling_llama import LlamaMLP

from attngraph import linear_ops  # the ops the pass calls
from attngraph.passes.fuse_linears import LINEAR_TARGETS, fuse_linears
from attngraph.passes.skinny_linears import skinny_linears


def traced(module: torch.nn.Module, *inputs: torch.Tensor):
    """Dynamo's graph of ``module(*inputs)``, its placeholders, and the real tensors behind
    them (None for the module's own inputs, given per call)."""
    captured = []

    def capture(gm, example_inputs):
        captured.append((gm, list(example_inputs)))
        return gm

    torch._dynamo.reset()
    torch.compile(module, backend=capture, fullgraph=True)(*inputs)
    gm, example = captured[0]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    real = [t if isinstance(t, torch.nn.Parameter) else None for t in example]
    return gm, placeholders, real


def count(gm, targets) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in targets)


def run_graph(gm, placeholders, real, x):
    return gm(*[x if r is None else r for r in real])


def mlp(hidden=48, inter=80, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, hidden_act="silu", num_attention_heads=4,
                                   num_key_value_heads=2)
    return LlamaMLP(cfg).eval()


SILU_MUL = (torch.ops.attngraph.silu_mul_linear.default,)
LINEAR = (torch.ops.attngraph.linear.default,)


def test_gated_mlp_down_projection_folds_silu_and_product():
    module = mlp()
    x = torch.randn(3, 48)
    gm, phs, real = traced(module, x)
    assert count(gm, LINEAR_TARGETS) == 3 and count(gm, (torch.nn.functional.silu,)) == 1
    result = skinny_linears(gm)
    assert count(gm, LINEAR_TARGETS) == 0
    assert count(gm, LINEAR) == 2 and count(gm, SILU_MUL) == 1
    assert count(gm, (torch.nn.functional.silu, operator.mul)) == 0
    assert len(result.linears) == 3 and len(result.silu_mul) == 1 and not result.refused
    x = torch.randn(5, 48)
    torch.testing.assert_close(run_graph(gm, phs, real, x)[0], module(x), rtol=1e-5, atol=1e-5)


def test_after_fuse_linears_the_fold_reads_the_fused_halves_without_copies():
    module = mlp(seed=1)
    x = torch.randn(2, 48)
    gm, phs, real = traced(module, x)
    fused = fuse_linears(gm, real)
    assert len(fused.groups) == 1
    copies = sum(1 for n in gm.graph.nodes if n.op == "call_method" and n.target == "contiguous")
    assert copies == 2
    skinny_linears(gm)
    assert count(gm, LINEAR) == 1 and count(gm, SILU_MUL) == 1
    assert not any(n.op == "call_method" and n.target == "contiguous" for n in gm.graph.nodes)
    (call,) = [n for n in gm.graph.nodes if n.target in SILU_MUL]
    assert all(a.op == "call_method" and a.target == "narrow" for a in call.args[:2])
    x = torch.randn(4, 48)
    got = gm(*[x if r is None else r for r in real], *fused.extra_inputs)[0]
    torch.testing.assert_close(got, module(x), rtol=1e-5, atol=1e-5)


class SharedSilu(torch.nn.Module):
    """The SiLU output is read twice: folding it into the GEMV would lose the other reader."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(16, 24, bias=False)
        self.up = torch.nn.Linear(16, 24, bias=False)
        self.down = torch.nn.Linear(24, 16, bias=True)

    def forward(self, x):
        s = torch.nn.functional.silu(self.gate(x))
        return self.down(s * self.up(x)) + s.sum(-1, keepdim=True)


class GeluMlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


@pytest.mark.parametrize("module_cls", [SharedSilu, GeluMlp])
def test_no_fold_where_it_is_unsafe_or_not_a_silu_product(module_cls):
    torch.manual_seed(2)
    module = module_cls().eval()
    x = torch.randn(3, 16)
    gm, phs, real = traced(module, x)
    n_linears = count(gm, LINEAR_TARGETS)
    silus = count(gm, (torch.nn.functional.silu,))
    result = skinny_linears(gm)
    assert count(gm, SILU_MUL) == 0 and not result.silu_mul
    assert count(gm, LINEAR) == n_linears and count(gm, LINEAR_TARGETS) == 0
    assert count(gm, (torch.nn.functional.silu,)) == silus  # kept: still read
    x = torch.randn(6, 16)
    torch.testing.assert_close(run_graph(gm, phs, real, x)[0], module(x), rtol=1e-5, atol=1e-5)


def test_a_linear_with_keyword_arguments_is_left_alone():
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    out = graph.call_function(torch._C._nn.linear, (x,), {"weight": w})
    graph.output(out)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    result = skinny_linears(gm)
    assert result.refused == [(out.name, "keyword arguments")] and count(gm, LINEAR_TARGETS) == 1


@pytest.mark.parametrize("arch,impl", [("llama", "sdpa"), ("qwen2", "eager"), ("gpt_oss", "eager")])
def test_accelerated_generate_with_the_rewrite_equals_hf(arch, impl):
    """The whole paged runtime with every linear rewritten (the CPU runs the ops' torch
    fallback, so fp32 tokens must equal HF's exactly) and the graphs' rewrites counted."""
    from ..runtime.test_generate import greedy_equals_hf

    model, backend = greedy_equals_hf(arch, impl, skinny_linears=True)
    results = backend.rewrites["skinny_linears"]
    assert results and sum(len(r.linears) for r in results) >= 2 * model.config.num_hidden_layers
    for r in results:  # the LM head reads logits rows, every other linear token rows
        kinds = {name: kind for name, kind in r.rows.items() if name != "logits"}
        assert r.rows["logits"] == linear_ops.LOGIT_ROWS and set(kinds.values()) == {linear_ops.TOKEN_ROWS}
    if arch != "gpt_oss":  # its experts are batched matmuls, not linears
        assert sum(len(r.silu_mul) for r in results) == model.config.num_hidden_layers
    # every norm in front of a projection (two per layer; not the final one, gathered first)
    # folds into it, each but the first with the residual add before it; gpt_oss's norm
    # multiplies in fp32 before rounding: another norm, left alone
    folded = backend.rewrites["fold_rms_norm"]
    layers = model.config.num_hidden_layers
    want = (0, 0) if arch == "gpt_oss" else (2 * layers, 2 * layers - 1)
    assert (sum(len(r.folded) for r in folded), sum(len(r.with_residual) for r in folded)) == (want[0] * len(folded), want[1] * len(folded))


def test_linears_above_the_weight_limit_stay_cublas_and_keep_inductors_product():
    module = mlp(seed=3)  # gate/up/down: 48 x 80 = 3840 elements each
    x = torch.randn(3, 48)
    gm, phs, real = traced(module, x)
    result = skinny_linears(gm, max_weight=3839)
    assert len(result.kept) == 3 and not result.linears and not result.silu_mul
    assert count(gm, LINEAR_TARGETS) == 3 and count(gm, (torch.nn.functional.silu, operator.mul)) == 2
    gm, phs, real = traced(module, x)
    assert len(skinny_linears(gm, max_weight=3840).silu_mul) == 1


def test_the_default_limits_let_a_folding_down_projection_past_the_plain_limit(monkeypatch):
    """With the default limits, a down projection that folds SiLU * up may hold more weight
    (`KERNEL_MAX_SILU_MUL_WEIGHT`) than a plain linear (`KERNEL_MAX_WEIGHT`)."""
    from attngraph import linear_ops

    module = mlp(seed=4)  # gate/up/down: 3840 elements each
    monkeypatch.setattr(linear_ops, "KERNEL_MAX_WEIGHT", 3839)
    monkeypatch.setattr(linear_ops, "KERNEL_MAX_WEIGHT_ONE_ROW", 3839)
    monkeypatch.setattr(linear_ops, "KERNEL_MAX_SILU_MUL_WEIGHT", 3840)
    monkeypatch.setattr(linear_ops, "DOT_MAX_WEIGHT", 3839)
    gm, phs, real = traced(module, torch.randn(3, 48))
    result = skinny_linears(gm)
    assert len(result.kept) == 2 and len(result.silu_mul) == 1 and len(result.linears) == 1
    assert count(gm, LINEAR_TARGETS) == 2 and count(gm, (torch.nn.functional.silu, operator.mul)) == 0
    assert count(gm, (torch.ops.attngraph.silu_mul_linear.default,)) == 1
    monkeypatch.setattr(linear_ops, "KERNEL_MAX_SILU_MUL_WEIGHT", 3839)
    gm, phs, real = traced(module, torch.randn(3, 48))
    assert len(skinny_linears(gm).kept) == 3


@pytest.mark.parametrize("fuse, gated_limit, taken", [(True, 7680, True), (True, 7679, False), (False, 10**6, False)])
def test_a_gated_mlps_fused_gate_up_has_the_gated_limit(monkeypatch, fuse, gated_limit, taken):
    """A fused gate/up product (160 x 48 = 7680 elements) whose halves feed the down
    projection's SiLU * up becomes ``attngraph.linear`` up to `DOT_MAX_GATED_WEIGHT`, past
    every plain limit (the gated MLP op may run it on tensor cores); separate gate and up
    linears of 3840 elements each do not (no fused product to fuse): they stay ``F.linear``."""
    module = mlp(seed=8)
    for name in ("KERNEL_MAX_WEIGHT", "KERNEL_MAX_WEIGHT_ONE_ROW", "DOT_MAX_WEIGHT"):
        monkeypatch.setattr(linear_ops, name, 3839)
    monkeypatch.setattr(linear_ops, "DOT_MAX_GATED_WEIGHT", gated_limit)
    x = torch.randn(3, 48)
    gm, phs, real = traced(module, x)
    extra = fuse_linears(gm, real).extra_inputs if fuse else []
    result = skinny_linears(gm)
    assert len(result.silu_mul) == 1
    assert (len(result.linears), len(result.kept)) == ((2, 0) if taken else (1, 2 - fuse))
    assert count(gm, LINEAR) == int(taken) and count(gm, LINEAR_TARGETS) == (0 if taken else 2 - fuse)
    x = torch.randn(5, 48)
    out = gm(*[x if r is None else r for r in real], *extra)[0]
    torch.testing.assert_close(out, module(x), rtol=1e-5, atol=1e-5)


def test_a_fused_product_read_elsewhere_keeps_the_plain_limit(monkeypatch):
    """The gate/up output read by a third node besides its two halves is not a gated MLP's
    product alone: the plain limits apply (it stays ``F.linear``)."""

    class Leaky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up = torch.nn.Linear(48, 160, bias=False)
            self.down = torch.nn.Linear(80, 48, bias=False)

        def forward(self, x):
            y = self.gate_up(x)
            return self.down(F.silu(y.narrow(-1, 0, 80)) * y.narrow(-1, 80, 80)), y.sum()

    torch.manual_seed(9)
    module = Leaky().eval()
    for name in ("KERNEL_MAX_WEIGHT", "KERNEL_MAX_WEIGHT_ONE_ROW", "DOT_MAX_WEIGHT"):
        monkeypatch.setattr(linear_ops, name, 3839)
    monkeypatch.setattr(linear_ops, "DOT_MAX_GATED_WEIGHT", 10**6)
    gm, phs, real = traced(module, torch.randn(3, 48))
    result = skinny_linears(gm)
    assert len(result.kept) == 1 and len(result.silu_mul) == 1 and count(gm, LINEAR_TARGETS) == 1


class _ProjAndHead(torch.nn.Module):
    """A 64 x 48 projection (3072 elements) and a 768 x 48 output head (``N = 16 K``)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(48, 64, bias=False)
        self.head = torch.nn.Linear(48, 16 * 48, bias=False)

    def forward(self, x):
        return self.head(self.proj(x)[..., :48].relu())


@pytest.mark.parametrize("one_row, head_ratio, ops", [(3072, 16, 2), (3071, 16, 1), (3071, 17, 0), (3072, 17, 1)])
def test_the_default_limits_take_what_one_row_runs_on_the_kernel(monkeypatch, one_row, head_ratio, ops):
    """A weight above `KERNEL_MAX_WEIGHT` that a one-row step runs on the GEMV (at most
    `KERNEL_MAX_WEIGHT_ONE_ROW` elements), and an output head (``N >= KERNEL_MIN_HEAD_RATIO *
    K``) of any size, become ``attngraph.linear``: the op picks per step. Past both a linear
    stays ``F.linear``."""
    torch.manual_seed(6)
    module = _ProjAndHead().eval()
    monkeypatch.setattr(linear_ops, "KERNEL_MAX_WEIGHT", 3071)
    monkeypatch.setattr(linear_ops, "KERNEL_MAX_WEIGHT_ONE_ROW", one_row)
    monkeypatch.setattr(linear_ops, "KERNEL_MIN_HEAD_RATIO", head_ratio)
    monkeypatch.setattr(linear_ops, "DOT_MAX_WEIGHT", 3071)
    gm, phs, real = traced(module, torch.randn(2, 48))
    result = skinny_linears(gm)
    assert (len(result.linears), len(result.kept)) == (ops, 2 - ops)
    assert count(gm, LINEAR) == ops and count(gm, LINEAR_TARGETS) == 2 - ops
    x = torch.randn(3, 48)
    torch.testing.assert_close(run_graph(gm, phs, real, x)[0], module(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dot_max, ops", [(3072, 1), (3071, 0), (36864, 1)])
def test_the_tensor_core_limit_takes_weights_past_the_gemv_limits(monkeypatch, dot_max, ops):
    """A weight above every GEMV limit still becomes ``attngraph.linear`` when 3-16 rows run it
    on tensor cores (at most `DOT_MAX_WEIGHT` elements). The 768 x 48 output head is taken by
    the one-row head rule either way (the op keeps heads off tensor cores: test_skinny_dot)."""
    torch.manual_seed(7)
    module = _ProjAndHead().eval()
    monkeypatch.setattr(linear_ops, "KERNEL_MAX_WEIGHT", 3071)
    monkeypatch.setattr(linear_ops, "KERNEL_MAX_WEIGHT_ONE_ROW", 3071)
    monkeypatch.setattr(linear_ops, "DOT_MAX_WEIGHT", dot_max)
    gm, phs, real = traced(module, torch.randn(2, 48))
    result = skinny_linears(gm)
    assert (len(result.linears), len(result.kept)) == (ops + 1, 1 - ops)
    assert count(gm, LINEAR) == ops + 1 and count(gm, LINEAR_TARGETS) == 1 - ops
    x = torch.randn(3, 48)
    torch.testing.assert_close(run_graph(gm, phs, real, x)[0], module(x), rtol=1e-5, atol=1e-5)


def _rows_graph(n_tokens: int, n_logits: int):
    """Dynamo's graph of linears over token rows, logits rows, twice the token rows, an
    expert's gathered rows and a constant slice, with N, L and the expert's count dynamic."""
    torch.manual_seed(5)
    emb, w = torch.randn(50, 16), torch.randn(8, 16)

    def f(input_ids, logits_indices, expert_rows):
        h = emb[input_ids]  # [1, N, 16]
        return (
            F.linear(h, w),  # [1, N, 8]: token rows
            F.linear(h[:, logits_indices], w),  # [1, L, 8]: logits rows
            F.linear(torch.cat([h, h], 1), w),  # [1, 2N, 8]
            F.linear(h[0, expert_rows], w),  # [E, 8]: another count
            F.linear(h[0, :1], w),  # [1, 8]: a constant
        )

    captured = []

    def capture(gm, example_inputs):
        captured.append((gm, list(example_inputs)))
        return gm

    ids = torch.randint(0, 50, (1, n_tokens))
    logits, expert = torch.arange(n_logits), torch.tensor([0, 1, 1, 0, 1, 0, 1][: n_tokens + 2]) % n_tokens
    torch._dynamo.reset()
    for t, dim in ((ids, 1), (logits, 0), (expert, 0)):
        torch._dynamo.mark_dynamic(t, dim)
    torch.compile(f, backend=capture, fullgraph=True)(ids, logits, expert)
    gm, example = captured[0]
    return gm, example, f(ids, logits, expert)


@pytest.mark.parametrize("n_tokens,n_logits", [(5, 2), (4, 4)])
def test_rows_kind_follows_the_token_and_logits_symbols(n_tokens, n_logits):
    """Token and logits rows are told by their sizes' symbols (distinct ones also for equal
    sizes); every other row count computes every row."""
    gm, example, want = _rows_graph(n_tokens, n_logits)
    result = skinny_linears(gm, max_weight=None, token_inputs=("input_ids",), row_index_inputs=("logits_indices",))
    kinds = [n.args[3] for n in gm.graph.nodes if n.op == "call_function" and n.target in LINEAR]
    assert kinds == [linear_ops.TOKEN_ROWS, linear_ops.LOGIT_ROWS] + [linear_ops.ANY_ROWS] * 3
    assert list(result.rows.values()) == kinds
    for got, expected in zip(gm(*example), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_without_the_input_names_every_linear_computes_every_row():
    gm, _, _ = _rows_graph(5, 2)
    result = skinny_linears(gm, max_weight=None)
    assert set(result.rows.values()) == {linear_ops.ANY_ROWS} and len(result.rows) == 5
