"""Pass `fuse_attention_o` on Dynamo graphs of the lowered attention op, HF's reshapes and the
output projection (after `skinny_linears`): op counts before and after, the layouts it must
refuse (with their reasons), and the rewritten graph's values against the graph before (the
CPU runs the ops' torch path: the same bits)."""

import math

import pytest
import torch

from attngraph import ops  # noqa: F401  (registers the attention ops)
from attngraph.passes.fuse_attention_o import fuse_attention_o
from attngraph.passes.skinny_linears import skinny_linears

from .test_skinny_linears import count, traced

ATTENTION = (torch.ops.attngraph.attention.default,)
ATTENTION_O = (torch.ops.attngraph.attention_o.default,)
LINEAR = (torch.ops.attngraph.linear.default,)
H, HKV, D, HIDDEN = 4, 2, 16, 32


class AttentionBlock(torch.nn.Module):
    """q/k/v projections, the op as `lower_attention` writes it, then the output as HF's
    sdpa integration and Llama reshape it before ``o_proj``. ``layout`` picks the views between
    the op and the projection; the variants other than ``"hf"`` and ``"flat"`` break the row
    order, ``read_attention`` reads the op's output elsewhere too."""

    def __init__(self, layout="hf", bias=False, read_attention=False):
        super().__init__()
        torch.manual_seed(0)
        self.q = torch.nn.Linear(HIDDEN, H * D, bias=False)
        self.k = torch.nn.Linear(HIDDEN, HKV * D, bias=False)
        self.v = torch.nn.Linear(HIDDEN, HKV * D, bias=False)
        self.o = torch.nn.Linear(H * D, HIDDEN, bias=bias)
        self.layout, self.read_attention = layout, read_attention

    def forward(self, x):
        t = x.shape[1]
        q = self.q(x).view(1, t, H, D).transpose(1, 2)
        k = self.k(x).view(1, t, HKV, D).transpose(1, 2)
        v = self.v(x).view(1, t, HKV, D).transpose(1, 2)
        b = q.size(0)
        a = torch.ops.attngraph.attention.default(
            q.transpose(1, 2).reshape(-1, H, D), k.transpose(1, 2).reshape(-1, HKV, D),
            v.transpose(1, 2).reshape(-1, HKV, D), 0, 1 / math.sqrt(D), True, -1, 0.0, b,
        )  # fmt: skip
        if self.layout == "hf":  # the lowering's view back, sdpa_attention_forward's, Llama's
            y = a.view(b, t, H, D).transpose(1, 2).reshape(b, -1, t, D).transpose(1, 2).contiguous()
            y = y.reshape(b, t, -1).contiguous()
        elif self.layout == "flat":
            y = a.flatten(1)
        elif self.layout == "head_major":  # heads before tokens: row t is not token t
            y = a.transpose(0, 1).reshape(t, H * D)
        elif self.layout == "dim_major":  # head dim before heads within a row
            y = a.transpose(1, 2).reshape(t, H * D)
        elif self.layout == "split_dim":  # the head dim split in halves, swapped (a view the layout does not follow)
            y = a.view(t, H, 2, D // 2).transpose(2, 3).reshape(t, H * D)
        else:
            raise ValueError(self.layout)
        out = self.o(y)
        return (out, a.sum()) if self.read_attention else out


def rewritten(module, t=5):
    x = torch.randn(1, t, HIDDEN)
    gm, phs, real = traced(module, x)
    skinny_linears(gm, max_weight=None)
    assert count(gm, ATTENTION) == 1 and count(gm, LINEAR) == 4
    before = run(gm, real, x)
    return gm, real, x, before, fuse_attention_o(gm)


def run(gm, real, x):
    out = gm(*[x if r is None else r for r in real])
    return out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out


@pytest.mark.parametrize("layout", ["hf", "flat"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_attention_and_output_projection_become_one_op(layout, bias):
    """HF's chain of views (and a plain flatten) keep token t's heads in row t: one op, the
    projection and the attention op gone, the values unchanged, and on fresh inputs equal to
    the module's."""
    gm, real, x, before, result = rewritten(AttentionBlock(layout, bias=bias))
    assert len(result.fused) == 1 and not result.refused
    assert count(gm, ATTENTION) == 0 and count(gm, ATTENTION_O) == 1 and count(gm, LINEAR) == 3
    (node,) = [n for n in gm.graph.nodes if n.target in ATTENTION_O]
    assert (node.args[15] is not None) == bias  # the projection's bias travels with it
    assert not any(n.op == "call_method" and n.target == "transpose" and n.args[0] is node for n in gm.graph.nodes)
    torch.testing.assert_close(run(gm, real, x), before, rtol=0, atol=0)
    x2 = torch.randn(1, 5, HIDDEN)  # fresh input, against the module itself
    want = AttentionBlock(layout, bias=bias)(x2)
    torch.testing.assert_close(run(gm, real, x2), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout,reason", [
    ("head_major", "splits a dimension"),  # no run of [H, T, D] multiplies to T
    ("dim_major", "rows are not the tokens"),
    ("split_dim", "splits a dimension"),
])  # fmt: skip
def test_layouts_that_reorder_the_rows_are_refused(layout, reason):
    gm, real, x, before, result = rewritten(AttentionBlock(layout))
    assert not result.fused and len(result.refused) == 1 and reason in result.refused[0][1], result.refused
    assert count(gm, ATTENTION) == 1 and count(gm, ATTENTION_O) == 0 and count(gm, LINEAR) == 4
    torch.testing.assert_close(run(gm, real, x), before, rtol=0, atol=0)


def test_attention_output_read_elsewhere_is_refused():
    gm, real, x, before, result = rewritten(AttentionBlock(read_attention=True))
    assert not result.fused and "read by 2 nodes" in result.refused[0][1]
    assert count(gm, ATTENTION) == 1 and count(gm, ATTENTION_O) == 0


def test_projection_that_is_not_attngraph_linear_is_refused():
    """Without `skinny_linears` the projection is torch's linear: left alone."""
    x = torch.randn(1, 5, HIDDEN)
    gm, phs, real = traced(AttentionBlock(), x)
    result = fuse_attention_o(gm)
    assert not result.fused and "not an attngraph.linear" in result.refused[0][1]
    assert count(gm, ATTENTION) == 1


def test_folded_rotation_is_refused():
    """An op that rotates q and k itself (`fold_rope`'s rows as its last arguments)."""
    gm, real, x, before, _ = rewritten(AttentionBlock())
    fused = [n for n in gm.graph.nodes if n.target in ATTENTION_O]
    assert fused  # undo: rebuild with a rotating op instead
    x = torch.randn(1, 5, HIDDEN)
    gm, phs, real = traced(AttentionBlock(), x)
    skinny_linears(gm, max_weight=None)
    (op,) = [n for n in gm.graph.nodes if n.target in ATTENTION]
    with gm.graph.inserting_before(op):
        rows = gm.graph.call_function(torch.ones, (5, D))
    op.args = (*op.args, None, 0, None, rows, rows)
    result = fuse_attention_o(gm)
    assert not result.fused and "fold_rope" in result.refused[0][1]


@pytest.mark.parametrize("bad,match", [
    (dict(o_weight=torch.randn(HIDDEN, H * D + 1)), r"weight must be \[N, 64\]"),
    (dict(o_weight=torch.randn(HIDDEN, H * D, dtype=torch.float64)), "must match"),
    (dict(o_weight=torch.randn(HIDDEN, H * D), o_bias=torch.randn(HIDDEN + 1)), r"bias must be a torch.float32 \[32\]"),
    (dict(o_weight=torch.randn(0, H * D).T), r"weight must be \[N, 64\]"),
    (dict(o_weight=torch.randn(HIDDEN, H * D), o_rows=7), "rows must be one of"),
])  # fmt: skip
def test_op_refuses_a_projection_that_does_not_fit_before_attending(bad, match, monkeypatch):
    """`attngraph.attention_o` checks the projection before the attention runs (in the paged form
    that would store K/V first): the attention is never called."""
    from attngraph.errors import InputError

    calls = []
    monkeypatch.setattr(ops, "attention_impl", lambda *a, **k: calls.append(a))
    q, k, v = torch.randn(3, H, D), torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    kwargs = {"o_bias": None, "o_rows": 0, **bad}
    with pytest.raises(InputError, match=match):
        ops.attention_o_impl(q, k, v, 0, 0.25, True, -1, 0.0, 1, None, 0, None, None, None, **kwargs)
    assert not calls
