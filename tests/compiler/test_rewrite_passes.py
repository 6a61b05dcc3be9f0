"""`compiler.rewrite_passes`: which rewrite passes a config runs, in what order, on one copy of
the graph, and what the manager keeps and reports of each."""

from dataclasses import dataclass, field

import pytest
import torch
from torch import fx

from attngraph.compiler.rewrite_passes import REWRITE_PASSES, RewritePass, RewritePassManager
from attngraph.compiler.report import AttentionReport
from attngraph.config import CompileConfig


def names(config: CompileConfig, device_type: str) -> list[str]:
    return [p.name for p in RewritePassManager(config, AttentionReport()).enabled(device_type)]


@pytest.mark.parametrize(
    "options,device_type,want",
    [
        ({}, "cuda", ["rank_one_products", "skinny_linears", "fold_rms_norm", "fuse_gated_mlp", "fold_rope"]),
        ({}, "cpu", ["rank_one_products", "fold_rope"]),
        (dict(skinny_linears=True), "cpu", ["rank_one_products", "skinny_linears", "fold_rms_norm", "fuse_gated_mlp",
                                            "fold_rope"]),
        (dict(fold_rms_norm=False), "cuda", ["rank_one_products", "skinny_linears", "fold_rope"]),
        (dict(fold_norm_epilogue=True, fuse_gated_mlp=False, fold_rope=True, fold_rope_linear=True), "cuda",
         ["rank_one_products", "skinny_linears", "fold_rms_norm", "fold_norm_epilogue", "fold_rope", "fold_rope_linear"]),
        (dict(fuse_attention_o=True), "cuda", ["rank_one_products", "skinny_linears", "fold_rms_norm", "fuse_gated_mlp",
                                               "fuse_attention_o"]),
        (dict(lower_attention=False), "cuda", ["rank_one_products"]),
        (dict(lower_attention=False, rank_one_products=False), "cuda", []),
    ],
)  # fmt: skip
def test_the_config_picks_the_passes_in_their_order(options, device_type, want):
    assert names(CompileConfig(**options), device_type) == want


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_stateless_graphs_run_only_the_passes_that_need_no_paged_op(device_type):
    manager = RewritePassManager(CompileConfig(skinny_linears=True, fuse_attention_o=True), AttentionReport())
    assert [p.name for p in manager.enabled(device_type, paged=False)] == ["rank_one_products"]


def test_every_pass_has_a_name_of_its_own_and_a_result_field():
    assert len({p.name for p in REWRITE_PASSES}) == len(REWRITE_PASSES)
    assert all(p.applied for p in REWRITE_PASSES)


@dataclass
class _Result:
    marked: list = field(default_factory=list)
    refused: list = field(default_factory=list)


def _marking(name: str, on: bool = True, op=torch.add, operand: float = 1.0) -> RewritePass:
    """A pass that applies ``op(y, operand)`` to the graph's output ``y``."""

    def run(gm, token_inputs, row_index_inputs):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(out):
            node = gm.graph.call_function(op, (out.args[0], operand))
        out.args = (node,)
        gm.recompile()
        return _Result(marked=[node.name], refused=[("x", f"{name} saw {token_inputs}")])

    return RewritePass(name, lambda config, device_type: on, run, "marked")


def _graph() -> fx.GraphModule:
    return fx.symbolic_trace(lambda x: x + 1)


def test_the_enabled_passes_run_in_order_on_one_copy_and_are_recorded():
    report = AttentionReport()
    report.add_graph([], {}, [])
    manager = RewritePassManager(CompileConfig(), report, token_inputs=("input_ids",),
                               passes=(_marking("first"), _marking("off", on=False), _marking("second", op=torch.mul,
                                                                                              operand=3.0)))  # fmt: skip
    copies = []

    def copy(gm):
        copies.append(gm)
        return fx.GraphModule(gm, gm.graph.__deepcopy__())

    gm = _graph()
    x = torch.randn(4)
    rewritten = manager.run(gm, "cuda", copy)
    assert copies == [gm] and rewritten is not gm
    assert torch.equal(rewritten(x), ((x + 1) + 1) * 3) and torch.equal(gm(x), x + 1)  # in order; gm untouched
    assert [len(manager.results[n]) for n in ("first", "off", "second")] == [1, 0, 1]
    assert [(r.name, r.applied, r.refused) for r in report.rewrites] == [
        ("first", ("add_1",), (("x", "first saw ('input_ids',)"),)),
        ("second", ("mul",), (("x", "second saw ('input_ids',)"),)),
    ]


def test_no_enabled_pass_leaves_the_graph_uncopied():
    manager = RewritePassManager(CompileConfig(), AttentionReport(), passes=(_marking("off", on=False),))
    gm = _graph()
    assert manager.run(gm, "cuda", lambda g: pytest.fail("copied")) is gm and manager.results == {"off": []}
