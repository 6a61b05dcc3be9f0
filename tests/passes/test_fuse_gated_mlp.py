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
from attngraph.passes.fuse_linears import fuse_linears
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
        monkeypatch.setattr(linear_ops, "DOT_MAX_WEIGHT", 160 * 48 - 1)
    module = Block(mlp_bias=case == "bias")
    gm, real, extra, before, result = rewritten(module, fuse=case != "separate_linears", norm=case != "norm_unfolded")
    assert count(gm, GATED) == 0 and not result.fused
    assert (count(gm, ADD_NORM_LINEAR), count(gm, SILU_MUL)) == before
    assert [r for _, r in result.refused if reason in r], result.refused
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
    import copy

    import attngraph
    from attngraph.runtime.accelerate import state_of

    from ..hf_models import build_model
    from ..runtime.test_generate import GREEDY, left_padded_batch

    model = build_model(arch, "sdpa")
    reference = copy.deepcopy(model)
    attngraph.accelerate(model, attention_backend="torch_native", page_size=4, skinny_linears=True, fuse_gated_mlp=True)
    ids, mask = left_padded_batch(model.config.vocab_size)
    got = model.generate(ids, attention_mask=mask, **GREEDY)
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(got, want)
    results = state_of(model).runner.ragged.backend.gated_mlp_results
    layers = model.config.num_hidden_layers
    assert results and all(len(r.fused) == layers and not r.refused for r in results)
