"""Stateless ``torch.compile(model, backend="attngraph")`` on the trained copy models
(``tests/copy_task.py``), fp32 on the CPU: exact greedy choices, not a tolerance.

The compiled forward over prompt + HF's greedy continuation, with every attention site
lowered, must pick HF's token at every generated position. Every choice of the checkpoint is
the copy (checked), so teacher forcing gives the free-running greedy sequence here. The batch
of 3 has equal lengths: a padding mask is a user input, and sites under one stay unlowered.
"""

from __future__ import annotations

import pytest
import torch

import attngraph

from ..copy_task import GREEDY, MODELS, Prompt, expected, left_padded, load, periodic, random_span

NEW = 64


pytestmark = pytest.mark.usefixtures("one_thread")


def _equal_length_batch(name: str, count: int) -> list[Prompt]:
    """``count`` prompts of one length (no padding): spans of different lengths, each followed
    by enough of its repeat to fill the same width."""
    spec = MODELS[name]
    gen = torch.Generator().manual_seed(8)
    width = spec.max_span + 5
    spans = torch.linspace(spec.max_span, max(spec.min_span, 8), count).round().long().tolist()
    return [Prompt(periodic(random_span(gen, n), width).tolist(), n) for n in spans]


@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize("name", list(MODELS))
def test_stateless_compile_picks_hf_tokens(name, count):
    model = load(name)
    batch = _equal_length_batch(name, count)
    ids, _ = left_padded(batch)
    width = ids.shape[1]
    with torch.no_grad():
        hf = model.generate(ids, max_new_tokens=NEW, **GREEDY)
    assert torch.equal(hf, expected(batch, NEW)), f"{name}: HF's greedy output is not the copy; retrain the checkpoint"
    backend = attngraph.backend(attention_backend="torch_native")
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        logits = compiled(hf, use_cache=False).logits[:, width - 1 : -1]
    assert backend.report.num_lowered == model.config.num_hidden_layers, str(backend.report)
    got = logits.argmax(-1)
    diff = (got != hf[:, width:]).nonzero().tolist()
    assert not diff, f"{name}: {len(diff)} choices differ from HF's, first at [row, step] {diff[0]}"
