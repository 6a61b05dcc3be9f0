"""Pass `fold_rms_norm` on Dynamo graphs: op counts before and after, the cases it must leave
alone (with their reasons), and the rewritten graph's values against the module it was traced
from (the CPU runs the ops' torch path, HF's norm op for op: equal bits)."""

import operator

import pytest
import torch
import torch.nn.functional as F
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from attngraph import linear_ops  # noqa: F401  (the ops the passes call)
from attngraph.passes.fold_rms_norm import fold_rms_norm
from attngraph.passes.skinny_linears import skinny_linears

from .test_skinny_linears import count, run_graph, traced

NORM_LINEAR = (torch.ops.attngraph.rms_norm_linear.default,)
ADD_NORM_LINEAR = (torch.ops.attngraph.add_rms_norm_linear.default,)
LINEAR = (torch.ops.attngraph.linear.default,)
RSQRT = (torch.rsqrt,)


class Block(torch.nn.Module):
    """``h = x + proj(x)``; ``out = head(norm(h)) + h`` (the residual read after the head),
    optionally with extra readers of the pattern's pieces."""

    def __init__(self, norm_cls=LlamaRMSNorm, read_normed: bool = False, read_h_before: bool = False, two_heads: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(32, 32, bias=False)
        self.norm = norm_cls(32, eps=1e-5)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.1) if norm_cls is LlamaRMSNorm else self.norm.weight.normal_(0.0, 0.1)
        self.head = torch.nn.Linear(32, 24, bias=True)
        self.head2 = torch.nn.Linear(32, 24, bias=False)
        self.read_normed, self.read_h_before, self.two_heads = read_normed, read_h_before, two_heads

    def forward(self, x):
        h = x + self.proj(x)
        early = h.sum(-1, keepdim=True) if self.read_h_before else 0.0
        n = self.norm(h)
        y = self.head(n)
        if self.two_heads:
            y = y + self.head2(n)
        if self.read_normed:
            y = y + n[..., :24]
        return y + h[..., :24] + early


def rewritten(module, x):
    gm, phs, real = traced(module, x)
    skinny_linears(gm, max_weight=None)
    assert count(gm, RSQRT) == 1
    return gm, phs, real, fold_rms_norm(gm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_norm_and_residual_add_fold_into_the_linear(dtype):
    module = Block().to(dtype)
    x = torch.randn(1, 3, 32, dtype=dtype)
    gm, phs, real, result = rewritten(module, x)
    assert count(gm, ADD_NORM_LINEAR) == 1 and count(gm, NORM_LINEAR) == 0 and count(gm, LINEAR) == 1  # proj stays
    assert count(gm, RSQRT) == 0 and count(gm, (torch.mean,)) == 0
    assert not any(n.op == "call_method" and n.target in ("mean", "pow", "rsqrt") for n in gm.graph.nodes)
    assert result.folded == result.with_residual and len(result.folded) == 1 and not result.refused
    x = torch.randn(1, 5, 32, dtype=dtype)
    assert torch.equal(run_graph(gm, phs, real, x)[0], module(x))


def test_a_residual_read_before_the_linear_stays_an_add():
    """``h`` read before the linear (a sum computed first): the norm folds, the add stays."""
    module = Block(read_h_before=True)
    gm, phs, real, result = rewritten(module, torch.randn(1, 3, 32))
    assert count(gm, NORM_LINEAR) == 1 and count(gm, ADD_NORM_LINEAR) == 0
    assert len(result.folded) == 1 and not result.with_residual
    x = torch.randn(1, 4, 32)
    assert torch.equal(run_graph(gm, phs, real, x)[0], module(x))


@pytest.mark.parametrize("case, reason", [("read_normed", "read by more than this linear"),
                                          ("two_heads", "read by more than this linear")])
def test_a_norm_read_elsewhere_is_left_alone(case, reason):
    module = Block(**{case: True})
    gm, phs, real, result = rewritten(module, torch.randn(1, 3, 32))
    assert not result.folded and count(gm, RSQRT) == 1 and count(gm, NORM_LINEAR + ADD_NORM_LINEAR) == 0
    assert len(result.refused) >= 1 and all(reason in why for _, why in result.refused)
    x = torch.randn(1, 4, 32)
    assert torch.equal(run_graph(gm, phs, real, x)[0], module(x))


def test_other_norms_are_not_matched():
    """Gemma's norm (``1 + weight``, the product in fp32) is not HF's Llama norm."""
    module = Block(norm_cls=GemmaRMSNorm)
    gm, phs, real = traced(module, torch.randn(1, 3, 32))
    skinny_linears(gm, max_weight=None)
    result = fold_rms_norm(gm)
    assert not result.folded and not result.refused and count(gm, LINEAR) == 2


class HandNorm(torch.nn.Module):
    """HF's RMSNorm written out, then a linear; ``norm_width``: the norm weight's size (1
    broadcasts); ``read_fp32``: the fp32 row is also summed and returned."""

    def __init__(self, norm_width: int = 16, read_fp32: bool = False):
        super().__init__()
        self.nw = torch.nn.Parameter(torch.randn(norm_width))
        self.w = torch.nn.Parameter(torch.randn(8, 16))
        self.read_fp32 = read_fp32

    def forward(self, h):
        hf = h.to(torch.float32)
        y = F.linear(self.nw * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype), self.w)
        return (y, hf.sum()) if self.read_fp32 else y


def test_the_fp32_input_read_elsewhere_is_refused():
    gm, phs, real = traced(HandNorm(read_fp32=True), torch.randn(2, 16))
    skinny_linears(gm, max_weight=None)
    result = fold_rms_norm(gm)
    assert not result.folded and result.refused and "fp32 input is read elsewhere" in result.refused[0][1]


def test_a_norm_weight_of_another_dtype_is_refused():
    module = Block()
    module.norm.weight.data = module.norm.weight.data.bfloat16()  # fp32 rows times a bf16 weight: fp32
    gm, phs, real = traced(module, torch.randn(1, 3, 32))
    skinny_linears(gm, max_weight=None)
    result = fold_rms_norm(gm)
    assert not result.folded and result.refused and "dtypes" in result.refused[0][1]


def test_getitems_carry_the_outputs():
    module = Block()
    gm, phs, real, result = rewritten(module, torch.randn(1, 3, 32))
    (op,) = [n for n in gm.graph.nodes if n.target in ADD_NORM_LINEAR]
    assert sorted(u.args[1] for u in op.users if u.target is operator.getitem) == [0, 1]


def test_a_broadcast_norm_weight_is_refused():
    """A one-element norm weight broadcasts over the row: not the ``[K]`` weight the op takes."""
    module = HandNorm(norm_width=1)
    gm, phs, real = traced(module, torch.randn(2, 16))
    skinny_linears(gm, max_weight=None)
    result = fold_rms_norm(gm)
    assert not result.folded and "does not match the input's last dimension" in result.refused[0][1]
    x = torch.randn(3, 16)
    assert torch.equal(run_graph(gm, phs, real, x)[0], module(x))
