"""generate's decode steps reach the runner as "last token of each request" steps, the form the
decode CUDA graphs serve; prefill asks only for the last position's logits too."""

import inspect

import torch

import attngraph
from attngraph.runtime.accelerate import state_of

from ..hf_models import build_model
from .test_generate import GREEDY, left_padded_batch


def test_decode_steps_take_the_graph_path():
    model = attngraph.accelerate(build_model("llama", "sdpa"), attention_backend="torch_native")
    params = inspect.signature(model.forward).parameters
    assert "logits_to_keep" in params  # transformers passes logits_to_keep=1 only when it sees it
    runner = state_of(model).runner
    calls = []
    forward = runner.forward

    def spy(batch, logits_indices=None):
        calls.append((batch.mode.value, batch.batch_size, logits_indices is None))
        return forward(batch, logits_indices)

    runner.forward = spy
    ids, mask = left_padded_batch(model.config.vocab_size)
    model.generate(ids, attention_mask=mask, **GREEDY)
    assert calls[0] == ("extend", 3, True)
    assert calls[1:] == [("decode", 3, True)] * (GREEDY["max_new_tokens"] - 1)
