"""`AttentionReport.rewrites`: what each rewrite pass of the paged runtime did to a graph, and
where it refused (with the reason), in the report, its text and the log."""

import logging

import torch

import attngraph
from attngraph.compiler.report import AttentionReport
from attngraph.runtime.accelerate import state_of

from ..hf_models import build_model


def test_entries_count_and_group_refusals_by_reason():
    report = AttentionReport()
    report.add_graph([])
    report.add_rewrite("fuse_gated_mlp", [("linear_1", "linear_2")], [("linear_5", "a bias"), ("linear_9", "a bias"),
                                                                      ("linear_12", "a bias"), ("linear_20", "a bias"),
                                                                      ("linear_7", "read elsewhere")])  # fmt: skip
    report.add_graph([])
    report.add_rewrite("fold_rope", ["attention", "attention_1"], [])
    (gated,) = report.rewrites_of("fuse_gated_mlp")
    assert gated.graph_index == 0 and gated.applied == ("linear_1+linear_2",) and len(gated.refused) == 5
    assert report.rewrites_of("fold_rope")[0].graph_index == 1
    text = str(report)
    assert "fuse_gated_mlp: 1 rewritten, 5 refused" in text
    assert "a bias (linear_5, linear_9, linear_12 and 1 more)" in text and "read elsewhere (linear_7)" in text
    assert "graph 1:" in text and "fold_rope: 2 rewritten" in text


def test_accelerated_model_reports_its_decode_step_rewrites(caplog):
    """A Llama on the paged runtime with attngraph's linear ops: every layer's q/k/v and gate/up
    fused, the norms folded, each gated MLP one op, each rotation folded into attention."""
    model = build_model("llama", "sdpa", seed=1)
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, model.config.vocab_size, (2, 7))
    with caplog.at_level(logging.INFO, logger="attngraph"):  # graphs compile in accelerate or later
        attngraph.accelerate(model, attention_backend="torch_native", page_size=4, skinny_linears=True)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=0)
    report = state_of(model).runner.ragged.backend.report
    for name, per_graph in (("fuse_linears", 2 * layers), ("fuse_gated_mlp", layers), ("fold_rope", layers)):
        entries = report.rewrites_of(name)
        assert entries and all(len(e.applied) == per_graph for e in entries), (name, entries)
    assert all(len(e.applied) == 2 * layers for e in report.rewrites_of("fold_rms_norm"))
    assert f"fuse_gated_mlp: {layers} rewritten" in str(report)
    assert any("fuse_gated_mlp" in r.getMessage() and f"{layers} rewritten" in r.getMessage() for r in caplog.records)
    # at INFO one line per pass and graph, from the backend; the passes' own lines are DEBUG's
    passes = [r.getMessage() for r in caplog.records if r.name.startswith("attngraph.passes") and r.levelno >= logging.INFO]
    assert passes == [], passes[:3]
