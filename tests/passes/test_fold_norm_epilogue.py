"""Pass `fold_norm_epilogue` on Dynamo graphs, after `skinny_linears` and `fold_rms_norm`: op
counts before and after, the cases it must refuse (with their reasons), and the rewritten
graph's values against the module it was traced from (the CPU runs the ops' torch path:
``F.linear``, the addition and HF's norm op for op: equal bits).

The GEMV's weight limits are lowered here so that the small ``proj`` (32 x 32) is a weight the
GEMV takes and the wide ``up`` (96 x 32) one it never takes, as Llama-3.2-1B's output
projection and fused gate/up are at their real sizes."""

import operator

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from attngraph import linear_ops
from attngraph.passes.fold_norm_epilogue import fold_norm_epilogue
from attngraph.passes.fold_rms_norm import fold_rms_norm
from attngraph.passes.skinny_linears import skinny_linears

from .test_skinny_linears import count, run_graph, traced

LINEAR = (torch.ops.attngraph.linear.default,)
ADD_NORM_LINEAR = (torch.ops.attngraph.add_rms_norm_linear.default,)
LINEAR_ADD_NORM = (torch.ops.attngraph.linear_add_rms_norm.default,)


class Layer(torch.nn.Module):
    """``h = r + proj(a)``; ``out = up(norm(h)) (+ h read after)``: an attention block's output
    projection and residual, the MLP's norm and its wide input projection."""

    def __init__(self, proj_bias=False, up_bias=True, read_product=False, swap=False, up_out=96, dropout=False):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(32, 32, bias=proj_bias)
        self.norm = LlamaRMSNorm(32, eps=1e-5)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.1)
        self.up = torch.nn.Linear(32, up_out, bias=up_bias)
        self.read_product, self.swap = read_product, swap
        self.drop = torch.nn.Dropout(0.1) if dropout else torch.nn.Identity()
        self.eval()

    def forward(self, a, r):
        o = self.drop(self.proj(a))
        h = o + r if self.swap else r + o
        y = self.up(self.norm(h))
        extra = o.sum(-1, keepdim=True) if self.read_product else 0.0
        return y[..., :32] + h + extra


@pytest.fixture
def gemv_limits(monkeypatch):
    """The GEMV takes weights of at most 32 x 32 elements (no output heads at these sizes)."""
    monkeypatch.setattr(linear_ops, "KERNEL_MAX_WEIGHT", 32 * 32)
    monkeypatch.setattr(linear_ops, "KERNEL_MAX_WEIGHT_ONE_ROW", 32 * 32)


def rewritten(module, dtype):
    module = module.to(dtype)
    a, r = torch.randn(1, 3, 32, dtype=dtype), torch.randn(1, 3, 32, dtype=dtype)
    gm, phs, real = traced(module, a, r)
    skinny_linears(gm, max_weight=None)
    assert fold_rms_norm(gm).with_residual
    return module, gm, real, fold_norm_epilogue(gm)


def run(gm, real, *inputs):
    it = iter(inputs)
    return gm(*[next(it) if t is None else t for t in real])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("proj_bias,up_bias,swap,dropout", [(False, True, False, False), (True, False, True, False),
                                                            (False, False, False, True)])
def test_add_and_norm_move_into_the_projection_before(gemv_limits, dtype, proj_bias, up_bias, swap, dropout):
    """Biases on either projection, the sum in either order, an eval-mode dropout (Phi-3's)
    between the projection and the sum (removed with it)."""
    module, gm, real, result = rewritten(Layer(proj_bias=proj_bias, up_bias=up_bias, swap=swap, dropout=dropout), dtype)
    assert not any(n.target is torch.nn.functional.dropout for n in gm.graph.nodes)
    assert count(gm, LINEAR_ADD_NORM) == 1 and count(gm, ADD_NORM_LINEAR) == 0
    assert count(gm, LINEAR) == 1  # up, reading the normed rows
    assert len(result.folded) == 1 and not result.refused
    fused = next(n for n in gm.graph.nodes if n.target in LINEAR_ADD_NORM)
    up = next(n for n in gm.graph.nodes if n.target in LINEAR)
    assert up.args[0].target is operator.getitem and up.args[0].args == (fused, 0)
    for _ in range(2):
        a, r = torch.randn(1, 5, 32, dtype=dtype), torch.randn(1, 5, 32, dtype=dtype)
        assert torch.equal(run(gm, real, a, r)[0], module(a, r))
    assert not fold_norm_epilogue(gm).folded  # a second run finds nothing left


def test_refused_where_the_gemv_folds_the_norm_into_the_consumer():
    """At the default limits both weights are the GEMV's: the norm stays in up's loads."""
    module, gm, real, result = rewritten(Layer(), torch.float32)
    assert count(gm, LINEAR_ADD_NORM) == 0 and count(gm, ADD_NORM_LINEAR) == 1
    assert result.refused and "may take the consumer's weight" in result.refused[0][1]


def test_refused_where_the_product_is_read_elsewhere(gemv_limits):
    module, gm, real, result = rewritten(Layer(read_product=True), torch.float32)
    assert count(gm, LINEAR_ADD_NORM) == 0 and count(gm, ADD_NORM_LINEAR) == 1
    assert "read elsewhere" in result.refused[0][1]
    a, r = torch.randn(1, 4, 32), torch.randn(1, 4, 32)
    assert torch.equal(run(gm, real, a, r)[0], module(a, r))


def test_refused_where_the_gemv_never_takes_the_producer(monkeypatch):
    monkeypatch.setattr(linear_ops, "KERNEL_MAX_WEIGHT", 16 * 32)
    monkeypatch.setattr(linear_ops, "KERNEL_MAX_WEIGHT_ONE_ROW", 16 * 32)
    module, gm, real, result = rewritten(Layer(), torch.float32)
    assert count(gm, LINEAR_ADD_NORM) == 0
    assert "never takes the producer's weight" in result.refused[0][1]
