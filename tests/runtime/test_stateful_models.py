"""Hybrid models keep state besides the KV cache (SSM, short convolutions, linear attention);
the ragged form loses it, so `accelerate` refuses them, naming the layers, and `explain`
lists the same layers. Stateless compile still serves them."""

import pytest
import torch

import attngraph

from ..hybrid_models import HYBRIDS, build_hybrid

OPTIONS = dict(attention_backend="torch_native", page_size=4)


@pytest.mark.parametrize("name", ["lfm2", "bamba", "qwen3_next", "granitemoehybrid"])
def test_hybrid_is_refused_naming_its_stateful_layer(name):
    model = build_hybrid(name)
    with pytest.raises(attngraph.UnsupportedModelError, match="move data between tokens") as err:
        attngraph.accelerate(model, **OPTIONS)
    assert HYBRIDS[name][2] in str(err.value)
    assert "model.layers.1" not in str(err.value)  # the attention layer is fine
    assert not hasattr(model, "_attngraph_state")  # nothing was patched


def test_jamba_is_refused():
    # Its mask or its selective scan may be what stops it; either way a clear error.
    with pytest.raises(attngraph.AttnGraphError):
        attngraph.accelerate(build_hybrid("jamba"), **OPTIONS)


def test_explain_lists_the_stateful_layers():
    model = build_hybrid("lfm2")
    ids = torch.randint(3, model.config.vocab_size, (1, 9))
    report = attngraph.explain(model, ids)
    modules = {op.module for _, op in report.token_mixing}
    assert modules == {"model.layers.0.conv"}, str(report)
    assert "model.layers.0.conv" in str(report) and "convolution over the token axis" in str(report)


# --------------------------------------------------------------------------- synthetic layers
class CausalConvMLP(torch.nn.Module):
    """A depthwise causal convolution over the sequence before the MLP (a short-conv layer)."""

    def __init__(self, mlp, hidden, width=3):
        super().__init__()
        self.mlp = mlp
        self.conv = torch.nn.Conv1d(hidden, hidden, width, groups=hidden, padding=width - 1)

    def forward(self, x):  # [B, S, H]
        y = self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        return self.mlp(x + y)


class HiddenAxisMLP(torch.nn.Module):
    """Token-wise, though built from ops that would mix tokens over the sequence axis: a conv,
    a cumulative sum, a sort, a pad and a roll, all over the hidden axis."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp
        self.conv = torch.nn.Conv1d(1, 1, 3, padding=1)

    def forward(self, x):  # [B, S, H]
        b, s, h = x.shape
        y = self.conv(x.reshape(b * s, 1, h)).reshape(b, s, h)
        y = y + 0.1 * x.cumsum(-1) + torch.sort(x, -1).values + torch.nn.functional.pad(x[..., 1:], (0, 1)) + x.roll(1, -1)
        return self.mlp(y)


class LengthReadMLP(torch.nn.Module):
    """Loops over the sequence length in Python (a graph for that one length only)."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):  # [B, S, H]
        steps = sum(1 for _ in range(x.shape[1]))
        return self.mlp(x) * (1.0 + 0.0 * steps)


def llama_with(wrap):
    from ..hf_models import build_model

    model = build_model("llama", "sdpa")
    for layer in model.model.layers:
        layer.mlp = wrap(layer.mlp, model.config.hidden_size)
    torch.manual_seed(1)
    for p in model.parameters():  # weights large enough that every layer changes the tokens
        p.data.normal_(0, 0.3)
    return model.eval()


def test_causal_conv_over_tokens_is_refused():
    model = llama_with(CausalConvMLP)
    with pytest.raises(attngraph.UnsupportedModelError, match="convolution over the token axis") as err:
        attngraph.accelerate(model, **OPTIONS)
    assert "model.layers.0.mlp.conv" in str(err.value) and "model.layers.1.mlp.conv" in str(err.value)


def test_a_forward_that_fixes_the_length_is_refused():
    model = llama_with(lambda mlp, hidden: LengthReadMLP(mlp))
    # Whichever check meets the fixed length first (a mask proven for one length only, or
    # Dynamo's constraint on the marked-dynamic token count), it is a refusal, not a torch error.
    with pytest.raises(attngraph.UnsupportedModelError, match="cannot run on the paged runtime|fixes the number of tokens"):
        attngraph.accelerate(model, **OPTIONS)
    assert not hasattr(model, "_attngraph_state")


def test_token_wise_layers_are_accepted_and_match_hf():
    import copy

    from .test_generate import GREEDY, left_padded_batch

    model = llama_with(lambda mlp, hidden: HiddenAxisMLP(mlp))
    reference = copy.deepcopy(model)
    attngraph.accelerate(model, **OPTIONS)
    ids, mask = left_padded_batch(model.config.vocab_size, (11, 6))
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, **{**GREEDY, "max_new_tokens": 8})
    assert torch.equal(model.generate(ids, attention_mask=mask, **{**GREEDY, "max_new_tokens": 8}), want)


# --------------------------------------------------------------------------- no false refusals
def _first_impls():
    from ..hf_models import ARCHS

    return [(arch, impls[0]) for arch, (_, _, impls) in ARCHS.items()]


@pytest.mark.parametrize("arch,impl", _first_impls())
def test_matrix_architectures_mix_tokens_only_in_attention(arch, impl):
    from attngraph.runtime.model_runner import ModelRunner

    from ..hf_models import build_model

    runner = ModelRunner(build_model(arch, impl), attngraph.CompileConfig(attention_backend="torch_native"))
    runner.geometry  # compiles in ragged form; the token-mixing check runs inside
    report = runner.ragged.backend.report
    assert report.num_graphs == 1 and report.token_mixing == [], str(report)


# --------------------------------------------------------------------------- uncompiled forward
def test_force_eager_stance_is_refused_not_wrong():
    import copy

    from ..hf_models import build_model
    from .test_generate import GREEDY, left_padded_batch

    model = build_model("llama", "sdpa")
    reference = copy.deepcopy(model)
    attngraph.accelerate(model, **OPTIONS)
    ids, mask = left_padded_batch(model.config.vocab_size, (9, 5))
    want = reference.generate(ids, attention_mask=mask, **GREEDY)
    runner = attngraph.runtime.accelerate.state_of(model).runner
    with torch.compiler.set_stance("force_eager"):
        with pytest.raises(attngraph.UnsupportedGenerationError, match="force_eager"):
            model.generate(ids, attention_mask=mask, **GREEDY)
        with pytest.raises(attngraph.UnsupportedGenerationError, match="force_eager"):
            model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **GREEDY)  # HF's loop
    assert runner.pool.num_used_pages == 0 and runner.pool.num_active_requests == 0
    assert torch.equal(model.generate(ids, attention_mask=mask, **GREEDY), want)  # the stance is gone
