"""Attention-shaped sites that the matchers do not accept are reported, never skipped.

A softmax over the last dimension of scores computed from a product of two activations
(``q @ k^T``) is attention whatever surrounds it: a form the matchers do not accept appears in
`explain` as a refused site with what was seen. (GPT-OSS's sink logits: `test_attention_sinks`.)
"""

from __future__ import annotations

import torch

from . import patterns as P

UNRECOGNIZED = "that the matchers do not recognize"


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


def test_unrecognized_form_is_refused_with_what_was_seen():
    (site,) = P.graph_sites(SlicedProbabilities(), torch.randn(P.B, P.S, P.D * 4))
    assert not site.lowerable and UNRECOGNIZED in site.reason, site.reason
    assert "getitem" in site.reason  # where the probabilities go


def test_softmax_over_a_weight_product_is_not_attention():
    """A router-like softmax over ``x @ W`` (a parameter) and a softmax over queries stay unreported."""
    assert P.graph_sites(P.NotAttention(), torch.randn(P.B, P.HQ, P.S, P.D)) == []
