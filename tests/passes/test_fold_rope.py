"""Pass `fold_rope` on Dynamo graphs of HF's rotary embedding feeding the lowered attention op:
op counts before and after, the cases it must leave alone (with their reasons), and the
rewritten graph's values against the module it was traced from (fp32: HF's ops, equal bits)."""

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, rotate_half

from attngraph import ops  # noqa: F401  (registers torch.ops.attngraph.attention)
from attngraph.passes.fold_rope import fold_rope
from attngraph.passes.fuse_linears import fuse_linears

from .test_skinny_linears import count, run_graph, traced

ATTENTION = (torch.ops.attngraph.attention.default,)
H, HKV, D = 4, 2, 16


class RopeAttention(torch.nn.Module):
    """Projections, HF's ``apply_rotary_pos_emb`` and the op as `lower_attention` writes it
    (``e.transpose(1, 2).reshape(-1, H, D)``, the batch size read off ``e``). Variants break
    one condition of the fold each."""

    def __init__(self, *, rotate_k=True, partial=False, return_k_embed=False, k_cos_scale=1.0, return_v=False,
                 v_rows=False):
        super().__init__()
        torch.manual_seed(0)
        self.q = torch.nn.Linear(32, H * D, bias=False)
        self.k = torch.nn.Linear(32, HKV * D, bias=False)
        self.v = torch.nn.Linear(32, HKV * D, bias=False)
        self.rotate_k, self.partial, self.return_k_embed, self.k_cos_scale = rotate_k, partial, return_k_embed, k_cos_scale
        self.return_v, self.v_rows = return_v, v_rows

    def forward(self, x, cos, sin):
        t = x.shape[1]
        q = self.q(x).view(1, t, H, D).transpose(1, 2)
        k = self.k(x).view(1, t, HKV, D).transpose(1, 2)
        v_cols = self.v(x)
        if self.v_rows:  # a view across the token rows: not valid on the fused GEMM's columns
            v = v_cols.view(t * HKV, D).reshape(1, t, HKV, D).transpose(1, 2)
        else:
            v = v_cols.view(1, t, HKV, D).transpose(1, 2)
        if self.partial:  # rotary_dim = D / 2 (GPT-NeoX, Phi): rotate a slice, keep the rest
            r = D // 2
            q_rot, k_rot = apply_rotary_pos_emb(q[..., :r], k[..., :r], cos[..., :r], sin[..., :r])
            q_embed, k_embed = torch.cat((q_rot, q[..., r:]), -1), torch.cat((k_rot, k[..., r:]), -1)
        elif self.k_cos_scale != 1.0:  # HF's formula, k with rows of its own
            q_embed = q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)
            k_embed = k * (cos * self.k_cos_scale).unsqueeze(1) + rotate_half(k) * sin.unsqueeze(1)
        elif not self.rotate_k:
            q_embed, k_embed = q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1), k
        else:
            q_embed, k_embed = apply_rotary_pos_emb(q, k, cos, sin)
        b = q_embed.size(0)
        out = torch.ops.attngraph.attention.default(
            q_embed.transpose(1, 2).reshape(-1, H, D), k_embed.transpose(1, 2).reshape(-1, HKV, D),
            v.transpose(1, 2).reshape(-1, HKV, D), 0, 1 / math.sqrt(D), True, -1, 0.0, b,
        )  # fmt: skip
        if self.return_v:  # the projection's columns read by something besides the op
            return out, v_cols
        return (out, k_embed) if self.return_k_embed else out


def rope_rows(t: int, dtype=torch.float32):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.arange(t).float()[:, None] * inv[None]
    emb = torch.cat((freqs, freqs), -1)[None]  # [1, T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def traced_module(module, t=5, dtype=torch.float32):
    x = torch.randn(1, t, 32, dtype=dtype)
    cos, sin = rope_rows(t, dtype)
    gm, phs, real = traced(module.to(dtype), x, cos, sin)
    return gm, real


def run(gm, real, *inputs) -> tuple:
    """The graph's outputs (a tuple) on ``inputs`` (the module's own inputs, in order)."""
    it = iter(inputs)
    return tuple(gm(*[next(it) if r is None else r for r in real]))


def as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def rope_muls(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.cat)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rotation_of_q_and_k_moves_into_the_op(dtype):
    module = RopeAttention()
    gm, real = traced_module(module, dtype=dtype)
    assert count(gm, ATTENTION) == 1 and rope_muls(gm) == 2  # rotate_half's cat, once for q and once for k
    result = fold_rope(gm)
    assert len(result.folded) == 1 and not result.refused
    assert count(gm, ATTENTION) == 1 and rope_muls(gm) == 0
    assert not any(n.op == "call_method" and n.target == "unsqueeze" for n in gm.graph.nodes)
    (op,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ATTENTION]
    assert len(op.args) == 14 and all(isinstance(a, torch.fx.Node) for a in op.args[12:]) and not op.kwargs
    x = torch.randn(1, 5, 32, dtype=dtype)  # fresh values, the traced length
    cos, sin = rope_rows(5, dtype)
    (got,), (want,) = run(gm, real, x, cos, sin), as_tuple(module(x, cos, sin))
    if dtype == torch.float32:
        assert torch.equal(got, want)  # HF's ops on the same values
    else:  # rotated in fp32 and rounded once (eager rounds each product and the sum)
        torch.testing.assert_close(got.float(), want.float(), atol=0.03, rtol=0.03)


@pytest.mark.parametrize(
    "variant,reason",
    [
        (dict(rotate_k=False), "only one of q and k is rotated"),
        (dict(return_k_embed=True), "read elsewhere"),
        (dict(k_cos_scale=2.0), "different cos / sin"),
    ],
    ids=["q only", "k_embed returned", "k's own cos"],
)
def test_refusals_keep_the_rotation(variant, reason):
    module = RopeAttention(**variant)
    gm, real = traced_module(module)
    before = rope_muls(gm)
    result = fold_rope(gm)
    assert not result.folded and len(result.refused) == 1 and reason in result.refused[0][1]
    assert rope_muls(gm) == before and count(gm, ATTENTION) == 1
    x = torch.randn(1, 5, 32)
    cos, sin = rope_rows(5)
    got, want = run(gm, real, x, cos, sin), as_tuple(module(x, cos, sin))
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_partial_rotary_is_not_a_match():
    """``rotary_dim < head_dim``: the op reads a concatenation, not the rotation: untouched."""
    gm, real = traced_module(RopeAttention(partial=True))
    before = len(gm.graph.nodes)
    result = fold_rope(gm)
    assert not result.folded and not result.refused and len(gm.graph.nodes) == before


def test_a_second_run_finds_nothing_to_fold():
    gm, real = traced_module(RopeAttention())
    assert len(fold_rope(gm).folded) == 1
    again = fold_rope(gm)
    assert not again.folded and not again.refused


def contiguous_calls(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_method" and n.target == "contiguous")


@pytest.mark.parametrize("variant", [{}, dict(return_v=True), dict(v_rows=True)],
                         ids=["op reads all", "v's columns returned", "v viewed across rows"])
def test_folded_op_reads_the_fused_projection_in_place(variant):
    """After `fuse_linears` (q, k, v as ``narrow(...).contiguous()`` of one GEMM) a folded op
    reads the columns in place: no copy takes the rotation's kernel's place. A copy whose
    columns something else reads, or whose view spans more than the last dimension, stays."""
    module = RopeAttention(**variant)
    x = torch.randn(1, 5, 32)
    cos, sin = rope_rows(5)
    gm, phs, real = traced(module, x, cos, sin)
    given = iter([x, cos, sin])
    fused = fuse_linears(gm, [next(given) if r is None else r for r in real])
    assert len(fused.groups) == 1 and contiguous_calls(gm) == 3
    result = fold_rope(gm)
    assert len(result.folded) == 1 and rope_muls(gm) == 0
    assert result.copies_dropped == (2 if variant else 3) and contiguous_calls(gm) == 3 - result.copies_dropped
    x = torch.randn(1, 5, 32)  # fresh values
    given = iter([x, cos, sin])
    got = as_tuple(gm(*[next(given) if r is None else r for r in real], *fused.extra_inputs))
    want = as_tuple(module(x, cos, sin))
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
