"""Each pass on tiny modules: numerics against eager, op counts before and after, and the
graphs that must NOT be rewritten."""

import pytest
import torch
from torch import fx

from attngraph.passes import ATTENTION_OP, cleanup, find_attention, lower_attention
from attngraph.passes import fx_utils as fu

from . import patterns as P


class PassBackend:
    """A Dynamo backend that runs only the passes, recording counts before and after."""

    def __init__(self, lower: bool = True):
        self.lower = lower
        self.sites = []
        self.before = {}
        self.after = {}

    @staticmethod
    def _count(gm: fx.GraphModule) -> dict:
        return {
            "sdpa": sum(fu.is_op(n, fu.SDPA) for n in gm.graph.nodes),
            "softmax": sum(fu.is_op(n, fu.SOFTMAX) for n in gm.graph.nodes),
            "expand": sum(fu.is_op(n, fu.EXPAND) or fu.is_op(n, fu.REPEAT_INTERLEAVE) for n in gm.graph.nodes),
            "arange": sum(n.target is torch.arange for n in gm.graph.nodes),
            "op": sum(n.target is ATTENTION_OP for n in gm.graph.nodes),
        }

    def __call__(self, gm, example_inputs):
        self.before = self._count(gm)
        self.sites = find_attention(gm)
        if self.lower:
            lower_attention(gm, self.sites)
            cleanup(gm)
        self.after = self._count(gm)
        return gm.forward


def run(module, *inputs, lower=True):
    torch.manual_seed(0)
    backend = PassBackend(lower)
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    with torch.no_grad():
        expected = module(*inputs)
        got = compiled(*inputs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    return backend


def x_input(s=P.S):
    return torch.randn(P.B, s, P.D * 4)


@pytest.mark.parametrize(
    "cls,kind,causal,window,cap",
    [
        (P.SdpaCausal, "sdpa", True, -1, 0.0),
        (P.SdpaGqa, "sdpa", True, -1, 0.0),
        (P.SdpaRepeatKvCausalMask, "sdpa", True, -1, 0.0),
        (P.SdpaWindowMask, "sdpa", True, 2, 0.0),
        (P.EagerHF, "eager", True, -1, 0.0),
        (P.EagerDivNoMask, "eager", False, -1, 0.0),
        (P.EagerPrescaledSoftcap, "eager", True, 3, 3.0),
    ],
)
def test_lowered_patterns(cls, kind, causal, window, cap):
    torch.manual_seed(1)
    module = cls().eval()
    b = run(module, x_input())
    (site,) = b.sites
    assert site.kind == kind and site.lowerable and site.lowered, site.reason
    assert (site.causal, site.window_left) == (causal, window)
    assert site.logit_cap == cap
    hkv = module.heads_kv
    assert (site.num_q_heads, site.num_kv_heads, site.head_dim) == (P.HQ, hkv, P.D)
    assert b.after["op"] == 1 and b.after["sdpa"] == 0 and b.after["softmax"] == 0
    # cleanup removed repeat_kv and the mask construction
    assert b.after["expand"] == 0 and b.after["arange"] == 0, b.after


def test_scale_is_read_from_the_graph():
    b = run(P.SdpaGqa().eval(), x_input())
    assert b.sites[0].scale.constant == pytest.approx(0.3)
    b = run(P.EagerDivNoMask().eval(), x_input())
    assert b.sites[0].scale.constant == pytest.approx(P.D ** -0.5)
    b = run(P.EagerPrescaledSoftcap().eval(), x_input())
    assert b.sites[0].scale.constant == pytest.approx(0.5)


def test_dynamic_sequence_length_window_mask():
    module = P.SdpaWindowMask().eval()
    backend = PassBackend()
    compiled = torch.compile(module, backend=backend, dynamic=True)
    with torch.no_grad():
        for s in (5, 9, 17):
            x = x_input(s)
            torch.testing.assert_close(compiled(x), module(x), atol=1e-5, rtol=1e-5)
    assert backend.sites[0].window_left == 2 and backend.after["op"] == 1


@pytest.mark.parametrize(
    "cls,extra,reason",
    [
        (P.UserMask, "attention_mask", "attention_mask"),
        (P.Custom4DMask, "mask4d", "mask4d"),
        (P.AntiCausalMask, None, "not causal"),
        (P.PositionBias, None, "bias"),
    ],
)
def test_masks_that_must_not_be_lowered(cls, extra, reason):
    torch.manual_seed(2)
    module = cls().eval()
    x = x_input()
    inputs = [x]
    if extra == "attention_mask":
        m = torch.ones(P.B, P.S, dtype=torch.long)
        m[0, :4] = 0
        inputs.append(m)
    elif extra == "mask4d":
        inputs.append(torch.randn(P.B, 1, P.S, P.S))
    b = run(module, *inputs)
    (site,) = b.sites
    assert not site.lowered and reason in site.reason, site.reason
    assert b.after["op"] == 0 and b.before == {**b.after, "op": 0}


def test_train_mode_dropout_is_not_lowered():
    for cls in (P.TrainDropout, P.SdpaTrainDropout):
        module = cls().train()
        backend = PassBackend()
        compiled = torch.compile(module, backend=backend, fullgraph=True)
        compiled(x_input())  # random dropout: only the graph is checked
        (site,) = backend.sites
        assert not site.lowered and "dropout" in site.reason, site.reason
        assert backend.after["op"] == 0


def test_eval_mode_dropout_is_lowered():
    b = run(P.EagerHF().eval(), x_input())
    assert b.sites[0].lowered


def test_matmul_softmax_matmul_that_is_not_attention():
    module = P.NotAttention()
    b = run(module, torch.randn(P.B, P.HQ, P.S, P.D))
    assert b.sites == [] and b.after["op"] == 0 and b.after["softmax"] == 2


def test_used_attention_probabilities_are_not_lowered():
    module = P.OutputAttentions().eval()
    b = run(module, x_input())
    assert b.after["op"] == 0 and b.after["softmax"] == 1


def test_find_attention_alone_does_not_modify_the_graph():
    module = P.EagerHF().eval()
    b = run(module, x_input(), lower=False)
    assert b.sites[0].lowerable and not b.sites[0].lowered
    assert b.before == b.after


def test_find_attention_on_a_symbolically_traced_module():
    """Passes run on any GraphModule given example inputs (shapes are propagated)."""
    module = P.SdpaGqa().eval()
    gm = fx.symbolic_trace(module)
    x = x_input()
    sites = find_attention(gm, example_inputs=[x])
    assert len(sites) == 1 and sites[0].lowerable, sites[0].reason
    lower_attention(gm, sites)
    cleanup(gm)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), module(x), atol=1e-5, rtol=1e-5)
