"""Pass `fuse_gated_mlp` on Dynamo graphs, after `fuse_linears`, `skinny_linears` and
`fold_rms_norm`: op counts before and after, the cases it must refuse (with their reasons), and
the rewritten graph's values against the module it was traced from (the CPU runs the op's
fallback, the ops it replaced: equal bits)."""

import operator

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from attngraph import linear_ops
from attngraph.passes.fold_rms_norm import fold_rms_norm
from attngraph.passes.fuse_gated_mlp import fuse_gated_mlp
from attngraph.passes.fuse_linears import LINEAR_TARGETS, fuse_linears
from attngraph.passes.skinny_linears import skinny_linears

from .test_skinny_linears import count, traced

GATED = (torch.ops.attngraph.add_rms_norm_gated_mlp.default,)
ADD_NORM_LINEAR = (torch.ops.attngraph.add_rms_norm_linear.default,)
SILU_MUL = (torch.ops.attngraph.silu_mul_linear.default,)


class Block(torch.nn.Module):
    """``h = r + o``; ``out = mlp(norm(h)) + h``: the second half of a Llama decoder layer."""

    def __init__(self, mlp_bias=False):
        super().__init__()
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=48, intermediate_size=80, hidden_act="silu", num_attention_heads=4,
                                       num_key_value_heads=2, mlp_bias=mlp_bias)  # fmt: skip
        self.mlp, self.norm = LlamaMLP(cfg), LlamaRMSNorm(48, eps=1e-5)
        if mlp_bias:  # biases on gate and up only: the down projection still folds SiLU * up
            self.mlp.down_proj.bias = None
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.1)
        self.eval()

    def forward(self, o, r):
        h = r + o
        return self.mlp(self.norm(h)) + h


def rewritten(module, fuse=True, norm=True):
    """The block traced and rewritten up to `fuse_gated_mlp`; its graph, inputs and result."""
    o, r = torch.randn(3, 48), torch.randn(3, 48)
    gm, _, real = traced(module, o, r)
    fused = fuse_linears(gm, real) if fuse else None
    skinny_linears(gm)
    if norm:
        fold_rms_norm(gm)
    before = (count(gm, ADD_NORM_LINEAR), count(gm, SILU_MUL))
    result = fuse_gated_mlp(gm)
    extra = fused.extra_inputs if fused is not None else []
    return gm, real, extra, before, result


def run(gm, real, extra, o, r):
    args = iter((o, r))
    return gm(*[next(args) if t is None else t for t in real], *extra)[0]


def test_the_mlp_becomes_one_op_with_the_same_values():
    module = Block()
    gm, real, extra, before, result = rewritten(module)
    assert before == (1, 1)
    assert count(gm, GATED) == 1 and count(gm, ADD_NORM_LINEAR) == 0 and count(gm, SILU_MUL) == 0
    assert not any(n.op == "call_method" and n.target == "narrow" for n in gm.graph.nodes)
    assert len(result.fused) == 1 and not result.refused
    (op,) = [n for n in gm.graph.nodes if n.target in GATED]
    assert {u.args[1] for u in op.users if u.target is operator.getitem} == {0, 1}  # output and residual stream
    for m in (1, 4, 9):
        o, r = torch.randn(m, 48), torch.randn(m, 48)
        torch.testing.assert_close(run(gm, real, extra, o, r), module(o, r), rtol=1e-5, atol=1e-5)


def test_bf16_values_are_the_replaced_ops_bits():
    """On the CPU the op runs the two ops it replaced: the rewritten graph's bits are theirs."""
    module = Block().to(torch.bfloat16)
    o, r = torch.randn(5, 48, dtype=torch.bfloat16), torch.randn(5, 48, dtype=torch.bfloat16)
    gm, _, real = traced(module, o, r)
    fused = fuse_linears(gm, real)
    skinny_linears(gm)
    fold_rms_norm(gm)
    reference = run(gm, real, fused.extra_inputs, o, r)
    assert len(fuse_gated_mlp(gm).fused) == 1
    assert torch.equal(run(gm, real, fused.extra_inputs, o, r), reference)


@pytest.mark.parametrize("case,reason", [
    ("separate_linears", "not two halves of one product"),
    ("norm_unfolded", "not an add_rms_norm_linear op"),
    ("bias", "has a bias"),
    ("above_dot_limit", "never takes the gate/up weight"),
])  # fmt: skip
def test_refused_where_unsafe_or_useless(monkeypatch, case, reason):
    if case == "above_dot_limit":
        monkeypatch.setattr(linear_ops, "DOT_MAX_GATED_WEIGHT", 160 * 48 - 1)
    module = Block(mlp_bias=case == "bias")
    gm, real, extra, before, result = rewritten(module, fuse=case != "separate_linears", norm=case != "norm_unfolded")
    assert count(gm, GATED) == 0 and not result.fused
    assert (count(gm, ADD_NORM_LINEAR), count(gm, SILU_MUL)) == before
    assert [r for _, r in result.refused if reason in r], result.refused
    o, r = torch.randn(4, 48), torch.randn(4, 48)
    torch.testing.assert_close(run(gm, real, extra, o, r), module(o, r), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gated_limit, fused", [(160 * 48, True), (160 * 48 - 1, False)])
def test_gate_up_past_every_plain_limit_is_fused_up_to_the_gated_limit(monkeypatch, gated_limit, fused):
    """The gated op has its own weight limit (`linear_ops.DOT_MAX_GATED_WEIGHT`): a gate/up
    weight above every plain limit (which `skinny_linears` alone would keep as ``F.linear``) is
    still fused through the whole chain of passes; one element past the gated limit it stays
    cuBLAS's, its down projection still folding SiLU * up."""
    for name in ("KERNEL_MAX_WEIGHT", "KERNEL_MAX_WEIGHT_ONE_ROW", "DOT_MAX_WEIGHT"):
        monkeypatch.setattr(linear_ops, name, 160 * 48 - 1)
    monkeypatch.setattr(linear_ops, "DOT_MAX_GATED_WEIGHT", gated_limit)
    module = Block()
    gm, real, extra, before, result = rewritten(module)
    assert count(gm, GATED) == int(fused) and len(result.fused) == int(fused), result.refused
    assert before == ((1, 1) if fused else (0, 1))
    assert count(gm, LINEAR_TARGETS) == int(not fused)
    o, r = torch.randn(4, 48), torch.randn(4, 48)
    torch.testing.assert_close(run(gm, real, extra, o, r), module(o, r), rtol=1e-5, atol=1e-5)


def test_refused_where_a_half_of_the_product_is_read_elsewhere():
    """The gate half read by another node too: the op would not return it."""
    o, r = torch.randn(3, 48), torch.randn(3, 48)
    gm, _, real = traced(Block(), o, r)
    fuse_linears(gm, real)
    skinny_linears(gm)
    fold_rms_norm(gm)
    (down,) = [n for n in gm.graph.nodes if n.target in SILU_MUL]
    gate = down.args[0]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        total = gm.graph.call_function(torch.sum, (gate,))
        result_node = gm.graph.call_function(operator.add, (out.args[0][0], total))
    out.args = ((result_node,),)
    gm.recompile()
    result = fuse_gated_mlp(gm)
    assert count(gm, GATED) == 0 and count(gm, SILU_MUL) == 1
    assert result.refused == [(down.name, "the gate/up product or one of its halves is read elsewhere too")]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_accelerated_generate_with_the_fused_mlp_equals_hf(arch):
    """The paged runtime with every decoder MLP fused (the CPU runs the op's fallback, the
    replaced ops: fp32 tokens equal HF's exactly), one op per layer and graph."""
    from ..runtime.test_generate import greedy_equals_hf

    model, backend = greedy_equals_hf(arch, "sdpa", skinny_linears=True, fuse_gated_mlp=True)
    results = backend.rewrites["fuse_gated_mlp"]
    layers = model.config.num_hidden_layers
    assert results and all(len(r.fused) == layers and not r.refused for r in results)


def test_the_gated_kernel_runs_in_the_paged_runtime(monkeypatch, poison_empty):
    """bf16 on the CPU with the kernels in Triton's interpreter: decode steps of three requests
    run the gated tensor-core launch (and no SiLU-mul kernel), and every step's logits stay
    within bf16 rounding of the same model with the fusion turned off (the same kernels
    otherwise)."""
    import copy

    import attngraph
    from attngraph import skinny_dot, skinny_linear

    from ..hf_models import build_model
    from ..runtime.test_generate import left_padded_batch

    if not skinny_linear.interpreting() or skinny_linear.interpreter_problem() is not None:
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1 before import; tests/conftest.py sets it)")
    monkeypatch.setattr(linear_ops, "CPU_INTERPRETER", True)
    launches = []
    launch, silu_mul = skinny_dot._launch, skinny_linear.silu_mul
    monkeypatch.setattr(skinny_dot, "_launch", lambda x, *a, **kw: launches.append((x.shape[0], kw.get("gated", False))) or launch(x, *a, **kw))
    monkeypatch.setattr(skinny_linear, "silu_mul", lambda a, b: launches.append((a.shape[0], "silu_mul")) or silu_mul(a, b))
    model = build_model("llama", "sdpa", seed=5).to(torch.bfloat16)
    plain = copy.deepcopy(model)
    common = dict(attention_backend="torch_native", page_size=4, skinny_linears=True)
    attngraph.accelerate(model, **common)  # on by default
    attngraph.accelerate(plain, fuse_gated_mlp=False, **common)
    ids, mask = left_padded_batch(model.config.vocab_size)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None,
              return_dict_in_generate=True, output_logits=True)  # fmt: skip
    del launches[:]
    got = model.generate(ids, **kw)
    fused_launches = list(launches)
    del launches[:]
    want = plain.generate(ids, **kw)
    assert (3, True) in fused_launches and (3, "silu_mul") not in fused_launches
    assert (3, "silu_mul") in launches and not any(g is True for _, g in launches)
    layers = model.config.num_hidden_layers
    assert sum(1 for rows, g in fused_launches if rows == 3 and g is True) == layers * 3  # three decode steps
    scale = max(t.abs().max().item() for t in want.logits)
    start, compared = ids.shape[1], 0
    for i, (g, w) in enumerate(zip(got.logits, want.logits)):
        assert not g.isnan().any()
        if not torch.equal(got.sequences[:, : start + i], want.sequences[:, : start + i]):
            break  # a bf16 near-tie chose another token: later steps have other inputs
        assert (g.float() - w.float()).abs().max().item() <= 0.05 * scale
        compared += 1
    assert compared >= 2  # the prefill's logits and at least the first decode step's


def test_speculative_verify_steps_run_the_gated_kernel(monkeypatch, poison_empty):
    """Prompt-lookup decoding in bf16 with the kernels in Triton's interpreter, four candidates
    proposed every round (the last token repeated, so the rounds do not depend on what the
    random model generates): the verify steps (three requests of five tokens: 15 rows) run the
    gated tensor-core launch, and the tokens equal those of the same model with the fusion off
    (the product followed by the SiLU-mul kernel, whose bits the gated epilogue reproduces)."""
    import copy

    import attngraph
    from attngraph import skinny_dot, skinny_linear

    from ..hf_models import build_model
    from attngraph.runtime import speculative

    from ..runtime.test_speculative import PAD, count_rounds, repetitive_batch

    if not skinny_linear.interpreting() or skinny_linear.interpreter_problem() is not None:
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1 before import; tests/conftest.py sets it)")
    monkeypatch.setattr(linear_ops, "CPU_INTERPRETER", True)
    gated_rows = []
    launch = skinny_dot._launch
    monkeypatch.setattr(skinny_dot, "_launch",
                        lambda x, *a, **kw: (kw.get("gated") and gated_rows.append(x.shape[0])) or launch(x, *a, **kw))  # fmt: skip
    model = build_model("llama", "sdpa", seed=3).to(torch.bfloat16)
    plain = copy.deepcopy(model)
    common = dict(attention_backend="torch_native", page_size=4, skinny_linears=True)
    attngraph.accelerate(model, **common)
    attngraph.accelerate(plain, fuse_gated_mlp=False, **common)
    ids, mask = repetitive_batch(model.config.vocab_size, seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD, eos_token_id=None,
              prompt_lookup_num_tokens=4)  # fmt: skip
    monkeypatch.setattr(speculative, "lookup_candidates", lambda tokens, num, max_ngram: [tokens[-1]] * num)
    rounds = count_rounds(monkeypatch)
    del gated_rows[:]
    got = model.generate(ids, **kw)
    assert rounds and max(max(r) for r in rounds) == 5  # four candidates verified per request
    verify_rows = {sum(r) for r in rounds if max(r) > 1}
    assert verify_rows & set(gated_rows), (verify_rows, gated_rows)  # a verify step took the gated launch
    fused_launches = len(gated_rows)
    del gated_rows[:]
    want = plain.generate(ids, **kw)
    assert fused_launches and not gated_rows
    assert torch.equal(got, want)
