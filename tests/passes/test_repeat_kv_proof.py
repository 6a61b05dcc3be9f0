"""A repeat of the keys/values is taken for grouped-query attention only when it is proven to be
the grouped mapping (query head ``h`` reads key head ``h // n_rep``).

Hand-written repeat_kv variants with an index that permutes the heads or reverses the sequence
must give eager's result (lowered with the repeated tensor as it is, or refused); an index
computed from constants that equals ``arange(h).repeat_interleave(n)`` is the grouped mapping.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attngraph
from attngraph.passes import ATTENTION_OP

from . import patterns as P

N_REP = P.HQ // P.HKV
NOT_PROVEN = "the grouped mapping is not proven"


class RepeatKv(P.Proj):
    """GQA attention (HQ query heads, HKV key heads) with keys/values repeated as ``form`` says."""

    def __init__(self, form: str, sdpa: bool = True):
        super().__init__()
        self.form, self.sdpa = form, sdpa

    def repeat(self, x: torch.Tensor) -> torch.Tensor:
        b, h, s, d = x.shape
        f = self.form
        if f == "hf":
            return P.repeat_kv(x, N_REP)
        if f == "permuted heads":  # the grouped form with the KV heads permuted on the way
            perm = torch.arange(h - 1, -1, -1, device=x.device)
            return x[:, perm, None, :, :].expand(b, h, N_REP, s, d).reshape(b, h * N_REP, s, d)
        if f == "reversed sequence":
            rev = torch.arange(s - 1, -1, -1, device=x.device)
            return x[:, :, None, rev, :].expand(b, h, N_REP, s, d).reshape(b, h * N_REP, s, d)
        if f == "index grouped":  # arange(h).repeat_interleave(n): the grouped mapping
            return x[:, torch.arange(h, device=x.device).repeat_interleave(N_REP)]
        if f == "index interleaved":  # arange(h).repeat(n): query head i reads key head i % h
            return x[:, torch.arange(h, device=x.device).repeat(N_REP)]
        if f == "index permutation":
            return x[:, torch.tensor([1, 0, 0, 1], device=x.device)]
        if f == "flip then repeat":  # the flip is computed before the repeat; the op reads it
            return P.repeat_kv(x.flip(2), N_REP)
        raise ValueError(f)

    def forward(self, x):
        q, k, v = P.qkv(self.proj(x))
        k, v = self.repeat(k), self.repeat(v)
        if self.sdpa:
            return self.finish(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        i = torch.arange(x.shape[1], device=x.device)
        mask = torch.zeros(x.shape[1], x.shape[1]).masked_fill(i[None, :] > i[:, None], torch.finfo(x.dtype).min)
        return self.finish(torch.matmul((q @ k.transpose(-1, -2) * 0.3 + mask).softmax(-1), v))


def compile_check(module):
    torch.manual_seed(0)
    module.eval()
    backend = attngraph.backend(attention_backend="torch_native")
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    with torch.no_grad():
        for s in (P.S, P.S, 13):
            x = torch.randn(P.B, s, P.D * 4)
            torch.testing.assert_close(compiled(x), module(x), atol=1e-5, rtol=1e-5)
    return backend


FORMS = [  # form, expected: "grouped" (lowered, HKV heads), "as is" (lowered, HQ heads), "refused"
    ("hf", "grouped"),
    ("permuted heads", "refused"),
    ("reversed sequence", "refused"),
    ("index grouped", "grouped"),
    ("index interleaved", "as is"),
    ("index permutation", "as is"),
    ("flip then repeat", "grouped"),
]


@pytest.mark.parametrize("sdpa", [True, False], ids=["sdpa", "eager"])
@pytest.mark.parametrize("form,expected", FORMS, ids=[f for f, _ in FORMS])
def test_repeat_kv_is_grouped_only_when_proven(form, expected, sdpa):
    backend = compile_check(RepeatKv(form, sdpa))
    sites = backend.sites
    assert sites and len(sites) == backend.report.num_graphs, str(backend.report)
    n_ops = sum(n.target is ATTENTION_OP for gm in backend.graphs for n in gm.graph.nodes)
    for s in sites:
        if expected == "refused":
            assert not s.lowered and NOT_PROVEN in s.reason, s.reason
        else:
            assert s.lowered, s.reason
            assert s.num_kv_heads == (P.HKV if expected == "grouped" else P.HQ), s.reason
    assert n_ops == (0 if expected == "refused" else len(sites))


@pytest.mark.parametrize("form", ["permuted heads", "reversed sequence", "index interleaved"])
def test_the_index_matters(form):
    """Each non-grouped index changes the eager output: taking it for the grouped mapping would be wrong."""
    torch.manual_seed(0)
    module = RepeatKv(form).eval()
    x = torch.randn(P.B, P.S, P.D * 4)
    with torch.no_grad():
        got = module(x)
        module.form = "hf"
        plain = module(x)
    assert not torch.allclose(got, plain, atol=1e-3)
