"""Attention-shaped sites that the matchers do not accept are reported, never skipped.

A softmax over the last dimension of scores computed from a product of two activations
(``q @ k^T``) is attention whatever surrounds it. GPT-OSS's eager attention concatenates its
sink logits to the scores and slices the probabilities back: each layer must appear in
`explain` as a refused site with that reason, `accelerate` must raise, and stateless compile
must still give eager's logits.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import attngraph
from attngraph import UnsupportedModelError
from attngraph.passes import find_attention

from . import patterns as P

SINKS = "sink logits concatenated to the scores before the softmax"
UNRECOGNIZED = "that the matchers do not recognize"


def gpt_oss():
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=256,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # sinks start at zero: make them matter
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
    return model


@pytest.fixture(scope="module")
def model():
    return gpt_oss()


def test_gpt_oss_sites_are_reported_refused(model):
    report = attngraph.explain(model, torch.randint(0, 96, (2, 10)))
    assert [s.name for s in report.sites] == ["model.layers.0.self_attn", "model.layers.1.self_attn"], str(report)
    assert all(not s.lowered and SINKS in s.reason for s in report.sites), str(report)
    assert SINKS in str(report)


def test_gpt_oss_stateless_equals_eager(model):
    backend = attngraph.backend(attention_backend="torch_native")
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for shape in ((2, 10), (2, 12), (1, 17)):
            ids = torch.randint(0, 96, shape)
            torch.testing.assert_close(compiled(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
    assert backend.report.num_lowered == 0 and backend.report.sites, str(backend.report)


def test_gpt_oss_accelerate_raises(model):
    with pytest.raises(UnsupportedModelError, match="every attention site must be lowered") as err:
        attngraph.accelerate(model, attention_backend="torch_native", page_size=4, kv_cache_tokens=64)
    text = str(err.value)
    assert text.count(SINKS) == 2 and "model.layers.1.self_attn" in text, text
    assert "generate" not in model.__dict__


class SlicedProbabilities(P.Proj):
    """Causal attention whose probabilities are sliced (one key dropped) before the values."""

    def __init__(self):
        super().__init__(heads_kv=P.HQ)

    def forward(self, x):
        q, k, v = P.qkv(self.proj(x), P.HQ)
        s = x.shape[1]
        i = torch.arange(s, device=x.device)
        mask = torch.zeros(s, s).masked_fill(i[None, :] > i[:, None], float("-inf"))
        p = (q @ k.transpose(-1, -2) * 0.3 + mask).softmax(-1)
        return self.finish(p[..., 1:] @ v[:, :, 1:])


def _graph_sites(module, *inputs):
    sites = []

    def backend(gm, example_inputs):
        sites.extend(find_attention(gm))
        return gm.forward

    with torch.no_grad():
        torch.compile(module.eval(), backend=backend, fullgraph=True)(*inputs)
    return sites


def test_unrecognized_form_is_refused_with_what_was_seen():
    (site,) = _graph_sites(SlicedProbabilities(), torch.randn(P.B, P.S, P.D * 4))
    assert not site.lowerable and UNRECOGNIZED in site.reason, site.reason
    assert "getitem" in site.reason  # where the probabilities go


def test_softmax_over_a_weight_product_is_not_attention():
    """A router-like softmax over ``x @ W`` (a parameter) and a softmax over queries stay unreported."""
    assert _graph_sites(P.NotAttention(), torch.randn(P.B, P.HQ, P.S, P.D)) == []
