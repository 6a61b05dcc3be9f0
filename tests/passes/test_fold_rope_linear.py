"""Pass `fold_rope_linear` on Dynamo graphs of a fused q/k/v projection feeding HF's rotary
embedding and the lowered attention op, after `fuse_linears`, `skinny_linears`,
`fold_rms_norm` and `fold_rope`: op arguments before and after, the cases it must refuse (with
their reasons), and the rewritten graph's outputs against the graph before the pass (equal
bits: the projection op rotates on torch's path as the attention op did)."""

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from attngraph import ops  # noqa: F401  (registers torch.ops.attngraph.attention)
from attngraph.passes.fold_rms_norm import fold_rms_norm
from attngraph.passes.fold_rope import fold_rope
from attngraph.passes.fold_rope_linear import fold_rope_linear
from attngraph.passes.fuse_linears import fuse_linears
from attngraph.passes.skinny_linears import skinny_linears

from .test_fold_rope import D, H, HKV, RopeAttention, as_tuple, rope_rows
from .test_skinny_linears import traced

ATTENTION = torch.ops.attngraph.attention.default
PROJECTIONS = (torch.ops.attngraph.linear.default, torch.ops.attngraph.rms_norm_linear.default,
               torch.ops.attngraph.add_rms_norm_linear.default)  # fmt: skip


class NormedRopeAttention(RopeAttention):
    """The decoder layer's order: a residual add and HF's RMSNorm in front of q/k/v."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = LlamaRMSNorm(32, eps=1e-6)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)

    def forward(self, x, r, cos, sin):
        return super().forward(self.norm(x + r), cos, sin)


class Ordered(RopeAttention):
    """HF's rotation of q and k, with v's projection computed first (the fused weight's rows
    are then v, q, k) or the unrotated q returned as well (its view must keep its values:
    `fold_rope` keeps `fuse_linears`' copy of q's columns, which this pass does not look
    through)."""

    def __init__(self, v_first=False, return_q=False):
        super().__init__()
        self.v_first, self.return_q = v_first, return_q

    def forward(self, x, cos, sin):
        t = x.shape[1]
        v = self.v(x).view(1, t, HKV, D).transpose(1, 2) if self.v_first else None
        q = self.q(x).view(1, t, H, D).transpose(1, 2)
        k = self.k(x).view(1, t, HKV, D).transpose(1, 2)
        v = self.v(x).view(1, t, HKV, D).transpose(1, 2) if v is None else v
        q_embed, k_embed = apply_rotary_pos_emb(q, k, cos, sin)
        out = torch.ops.attngraph.attention.default(
            q_embed.transpose(1, 2).reshape(-1, H, D), k_embed.transpose(1, 2).reshape(-1, HKV, D),
            v.transpose(1, 2).reshape(-1, HKV, D), 0, 1 / math.sqrt(D), True, -1, 0.0, q_embed.size(0),
        )  # fmt: skip
        return (out, q) if self.return_q else out


def prepared(module, *inputs, fuse=True, norm=False):
    """``(gm, call)``: the module's graph through the passes before this one, and a function
    running it on fresh inputs of the traced shapes."""
    gm, phs, real = traced(module, *inputs)
    given = iter(inputs)
    extra = fuse_linears(gm, [next(given) if r is None else r for r in real]).extra_inputs if fuse else []
    skinny_linears(gm)
    if norm:
        assert fold_rms_norm(gm).folded
    assert fold_rope(gm).folded

    def call(*fresh):
        it = iter(fresh)
        return as_tuple(gm(*[next(it) if r is None else r for r in real], *extra))

    return gm, call


def nodes(gm, targets):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("norm", [False, True], ids=["linear", "add_rms_norm_linear"])
def test_rotation_moves_into_the_fused_projection(dtype, norm):
    torch.manual_seed(0)
    cos, sin = rope_rows(5, dtype)
    x = torch.randn(1, 5, 32, dtype=dtype)
    r = torch.randn(1, 5, 32, dtype=dtype)
    module = (NormedRopeAttention() if norm else RopeAttention()).to(dtype)
    inputs = (x, r, cos, sin) if norm else (x, cos, sin)
    gm, call = prepared(module, *inputs, norm=norm)
    fresh = (torch.randn_like(x), torch.randn_like(r), cos, sin) if norm else (torch.randn_like(x), cos, sin)
    before = call(*fresh)
    result = fold_rope_linear(gm)
    (op,) = nodes(gm, (ATTENTION,))
    (proj,) = nodes(gm, PROJECTIONS)
    assert result.folded == [(op.name, proj.name)] and not result.refused
    assert len(op.args) == 12  # no rotary rows left on the op
    assert proj.args[-1] == (H + HKV) * D and all(isinstance(a, torch.fx.Node) for a in proj.args[-3:-1])
    assert proj.target is (torch.ops.attngraph.add_rms_norm_linear.default if norm else torch.ops.attngraph.linear.default)
    after = call(*fresh)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
    again = fold_rope_linear(gm)
    assert not again.folded and not again.refused


def test_v_columns_read_elsewhere_do_not_matter():
    """v's columns (past the rotated ones) returned as well: still folded, v unrotated."""
    cos, sin = rope_rows(5)
    gm, call = prepared(RopeAttention(return_v=True), torch.randn(1, 5, 32), cos, sin)
    fresh = (torch.randn(1, 5, 32), cos, sin)
    before = call(*fresh)
    assert len(fold_rope_linear(gm).folded) == 1
    after = call(*fresh)
    assert all(torch.equal(a, b) for a, b in zip(after, before))


@pytest.mark.parametrize(
    "make,fuse,reason",
    [
        (RopeAttention, False, "two projections"),
        (lambda: Ordered(v_first=True), True, "are not the projection's first ones"),
        (lambda: Ordered(return_q=True), True, "a copy or another op between"),
    ],
    ids=["unfused", "v first", "q returned"],
)
def test_refusals_keep_the_rotation_on_the_op(make, fuse, reason):
    cos, sin = rope_rows(5)
    gm, call = prepared(make(), torch.randn(1, 5, 32), cos, sin, fuse=fuse)
    fresh = (torch.randn(1, 5, 32), cos, sin)
    before = call(*fresh)
    result = fold_rope_linear(gm)
    assert not result.folded and len(result.refused) == 1 and reason in result.refused[0][1], result.refused
    (op,) = nodes(gm, (ATTENTION,))
    assert len(op.args) == 14 and all(len(p.args) <= 6 for p in nodes(gm, PROJECTIONS))
    after = call(*fresh)
    assert all(torch.equal(a, b) for a, b in zip(after, before))


def test_nothing_to_do_without_fold_rope():
    cos, sin = rope_rows(5)
    gm, phs, real = traced(RopeAttention(), torch.randn(1, 5, 32), cos, sin)
    skinny_linears(gm)
    before = len(gm.graph.nodes)
    result = fold_rope_linear(gm)
    assert not result.folded and not result.refused and len(gm.graph.nodes) == before
