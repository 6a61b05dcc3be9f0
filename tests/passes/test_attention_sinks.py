"""Attention sinks (GPT-OSS): a learned logit per head joined to each row's softmax.

GPT-OSS's eager attention appends ``sinks[h]`` as one more column of scores, subtracts each
row's maximum, takes the softmax and drops the sink's probability before the values. The
pass lowers it to the op with the ``[Hq]`` parameter as ``sinks`` only when the column is
provably ``sinks[h]`` for every row of head ``h``; anything else is refused with the reason.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attngraph
from attngraph.attn_backends.base import BackendCapabilities, ModelAttentionSpec

from ..hf_models import build_model
from . import patterns as P


@pytest.fixture(scope="module")
def gpt_oss():
    return build_model("gpt_oss", "eager")


def test_gpt_oss_sites_are_lowered_with_their_sinks(gpt_oss):
    report = attngraph.explain(gpt_oss, torch.randint(0, 96, (2, 10)))
    assert [s.name for s in report.sites] == ["model.layers.0.self_attn", "model.layers.1.self_attn"], str(report)
    assert all(s.lowered and "sinks" in s.reason for s in report.sites), str(report)
    assert "window=8" in report.sites[0].reason and "window" not in report.sites[1].reason


def test_gpt_oss_stateless_equals_eager(gpt_oss):
    backend = attngraph.backend(attention_backend="torch_native")
    compiled = torch.compile(gpt_oss, backend=backend)
    with torch.no_grad():
        for shape in ((2, 10), (2, 12), (1, 17)):  # 17 > the window of 8
            ids = torch.randint(0, 96, shape)
            torch.testing.assert_close(compiled(ids).logits, gpt_oss(ids).logits, atol=1e-4, rtol=1e-4)
    assert backend.report.sites and backend.report.num_lowered == len(backend.report.sites), str(backend.report)


def test_sinks_receive_gradients_through_the_op(gpt_oss):
    """The lowered graph stays trainable: the sinks' gradients equal eager's."""
    ids = torch.randint(0, 96, (2, 9))
    compiled = torch.compile(gpt_oss, backend=attngraph.backend(attention_backend="torch_native"))
    grads = []
    for fn in (gpt_oss, compiled):
        gpt_oss.zero_grad()
        fn(ids).logits.square().mean().backward()
        grads.append([layer.self_attn.sinks.grad.clone() for layer in gpt_oss.model.layers])
    for want, got in zip(*grads):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


class _SinkAttention(P.Proj):
    """Causal attention with a sink column built by ``column(self, scores)``."""

    def __init__(self, column, drop_last=True):
        super().__init__(heads_kv=P.HQ)
        self.sinks = nn.Parameter(torch.randn(P.HQ))
        self.column, self.drop_last = column, drop_last

    def forward(self, x):
        q, k, v = P.qkv(self.proj(x), P.HQ)
        s = x.shape[1]
        i = torch.arange(s, device=x.device)
        mask = torch.zeros(s, s).masked_fill(i[None, :] > i[:, None], float("-inf"))
        scores = q @ k.transpose(-1, -2) * 0.3 + mask
        combined = torch.cat([scores, self.column(self, scores)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = combined.softmax(-1)
        probs = probs[..., :-1] if self.drop_last else probs[..., 1:]
        return self.finish(probs @ v)


def _per_head(m, s):
    return m.sinks.reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], -1)


def test_a_per_head_parameter_column_is_lowered():
    (site,) = P.graph_sites(_SinkAttention(_per_head), torch.randn(P.B, P.S, P.D * 4))
    assert site.lowerable and site.sinks is not None, site.reason


@pytest.mark.parametrize(
    "column,why",
    [
        (lambda m, s: s[..., :1] * 0.5, "not a per-head parameter"),  # computed from the scores
        (lambda m, s: m.sinks.reshape(-1, 1, 1, 1)[: s.shape[0]].expand(-1, s.shape[1], s.shape[2], 1),
         "not a per-head parameter"),  # a slice of it, laid out per batch row
        # [B, S, 1, H] reshaped to [B, H, S, 1]: row (h, i) holds sinks[(h * S + i) % H]
        (lambda m, s: m.sinks.reshape(1, 1, 1, -1).expand(s.shape[0], s.shape[2], 1, -1).reshape(s.shape[0], s.shape[1], s.shape[2], 1),
         "laid out as [1, 1, 1, 4]"),
    ],
    ids=["activation", "per-batch-row", "per-position"],
)
def test_other_columns_are_refused(column, why):
    (site,) = P.graph_sites(_SinkAttention(column), torch.randn(P.B, P.S, P.D * 4))
    assert not site.lowerable and why in site.reason, site.reason


def test_dropping_another_column_is_not_a_sink():
    (site,) = P.graph_sites(_SinkAttention(_per_head, drop_last=False), torch.randn(P.B, P.S, P.D * 4))
    assert not site.lowerable and "attention-sink match does not accept" in site.reason, site.reason


def test_backends_without_sinks_are_refused_with_the_reason():
    spec = ModelAttentionSpec(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dims=(64,), dtype=torch.bfloat16,
                              device_type="cuda", page_size=16, uses_sinks=True)  # fmt: skip
    caps = BackendCapabilities(device_types=("cuda",), dtypes=(torch.bfloat16,), sinks=False)
    assert "attention sinks" in caps.why_not(spec)
    assert BackendCapabilities(device_types=("cuda",), dtypes=(torch.bfloat16,)).why_not(spec) is None
    flashinfer = pytest.importorskip("attngraph.attn_backends.flashinfer_backend")
    assert flashinfer.FlashInferBackend.capabilities.sinks  # its attention-sink wrapper
