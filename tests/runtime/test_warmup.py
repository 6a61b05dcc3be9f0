"""`ModelRunner.warmup` runs its eager dummy steps only for the paths no CUDA-graph capture
covers (each capture runs its step once before recording), and the capture plan follows the
mode and what the backend can capture."""

import dataclasses

import pytest

from attngraph.attn_backends.base import GraphSupport
from attngraph.config import CompileConfig
from attngraph.errors import ConfigError
from attngraph.runtime.model_runner import ModelRunner

from ..hf_models import build_model

FULL, NEVER = GraphSupport.FULL, GraphSupport.NEVER


@pytest.fixture(scope="module")
def runner():
    r = ModelRunner(build_model("llama", "sdpa"), CompileConfig(attention_backend="torch_native", cuda_graph="none"))
    r.pool  # noqa: B018 - the trace, which creates the backend
    return r


@pytest.mark.parametrize(
    "mode, decode, extend, num_tokens, capture_sizes, steps",
    [
        ("none", FULL, FULL, (8, 16), (1, 2), ["extend", "decode"]),
        ("full_and_piecewise", FULL, FULL, (8, 16), (1, 2), []),
        ("full_and_piecewise", FULL, NEVER, (8, 16), (1, 2), []),  # prefill by the pieces' captures
        ("full_and_piecewise", FULL, FULL, (64,), (1, 2), ["extend"]),  # above the step limit: no prefill graphs
        ("full_and_piecewise", NEVER, FULL, (8,), (1, 2), ["extend", "decode"]),  # decode needs its prefill's K/V
        ("full", FULL, NEVER, (8, 16), (1, 2), ["extend"]),  # no pieces in "full"
        ("piecewise", FULL, FULL, (8, 16), (1, 2), ["extend", "decode"]),  # decode runs between pieces
    ],
)
def test_warmup_runs_only_the_steps_no_capture_covers(runner, monkeypatch, mode, decode, extend, num_tokens,
                                                      capture_sizes, steps):  # fmt: skip
    backend = runner.backend
    caps = dataclasses.replace(type(backend).capabilities, graph_support={"decode": decode, "extend": extend})
    monkeypatch.setattr(type(backend), "capabilities", caps)
    monkeypatch.setattr(runner, "graph_mode", mode)
    monkeypatch.setattr(runner, "max_step_tokens", 32)  # (as a model whose own code bounds the length)
    monkeypatch.setattr(runner, "config", dataclasses.replace(
        runner.config, cuda_graph_num_tokens=num_tokens, cuda_graph_capture_sizes=capture_sizes))  # fmt: skip
    ran, captured = [], []
    forward = runner.forward
    monkeypatch.setattr(runner, "forward", lambda batch, *a: ran.append(batch.mode.value) or forward(batch, *a))
    monkeypatch.setattr(runner, "_capture_graphs", lambda: captured.append(runner._capture_plan()))
    runner.warmup()
    assert ran == steps
    plan = captured[0]
    assert plan.prefill_captured == (mode != "none" and min(num_tokens) <= 32 and (extend == FULL or mode != "full"))
    assert plan.decode_captured == (mode in ("full", "full_and_piecewise") and decode == FULL)
    assert runner.pool.num_used_pages == 0  # the dummy request's pages are back


def test_full_mode_without_decode_graphs_is_a_config_error(runner, monkeypatch):
    caps = dataclasses.replace(type(runner.backend).capabilities, graph_support={"decode": NEVER, "extend": NEVER})
    monkeypatch.setattr(type(runner.backend), "capabilities", caps)
    monkeypatch.setattr(runner, "graph_mode", "full")
    with pytest.raises(ConfigError, match="cuda_graph='piecewise'"):
        runner.warmup()
