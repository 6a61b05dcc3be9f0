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
