"""generate's decode steps reach the runner as "last token of each request" steps, the form the
decode CUDA graphs serve; prefill asks only for the last position's logits too."""

import inspect

import pytest

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


def test_own_decoding_loop_matches_hf_and_stops_at_eos():
    """attngraph's loop (custom_generate) runs plain greedy/sampling calls: same tokens as HF,
    including a batch where sequences hit EOS at different steps."""
    import copy

    from attngraph.runtime import decode_loop

    model = build_model("qwen2", "sdpa")
    reference = copy.deepcopy(model)
    attngraph.accelerate(model, attention_backend="torch_native")
    calls = []
    original = decode_loop.paged_sample

    def spy(self, input_ids, *args, **kwargs):
        calls.append(input_ids.shape)
        return original(self, input_ids, *args, **kwargs)

    import attngraph.runtime.accelerate as acc

    acc.paged_sample = spy
    try:
        ids, mask = left_padded_batch(model.config.vocab_size)
        want = reference.generate(ids, attention_mask=mask, **GREEDY)
        got = model.generate(ids, attention_mask=mask, **GREEDY)
        assert torch.equal(got, want) and calls
        # EOS: the token row 1 produces at step 5 ends it early; the others go on (pad after).
        eos = int(want[1, ids.shape[1] + 5])
        kw = dict(max_new_tokens=30, do_sample=False, pad_token_id=0, eos_token_id=eos)
        assert torch.equal(model.generate(ids, attention_mask=mask, **kw), reference.generate(ids, attention_mask=mask, **kw))
        # Every row hits EOS early: the output stops where HF's does, not at max_new_tokens.
        eos_all = [int(want[r, ids.shape[1] + 2]) for r in range(3)]
        kw = dict(max_new_tokens=30, do_sample=False, pad_token_id=0, eos_token_id=eos_all)
        got, want2 = model.generate(ids, attention_mask=mask, **kw), reference.generate(ids, attention_mask=mask, **kw)
        assert torch.equal(got, want2) and got.shape[1] < ids.shape[1] + 30
        for seed in (1, 2):
            kw = dict(max_new_tokens=20, do_sample=True, top_k=10, top_p=0.8, temperature=0.7, pad_token_id=0, eos_token_id=eos)
            torch.manual_seed(seed)
            got = model.generate(ids, attention_mask=mask, **kw)
            torch.manual_seed(seed)
            assert torch.equal(got, reference.generate(ids, attention_mask=mask, **kw))
    finally:
        acc.paged_sample = original
    assert len(calls) == 5


def test_checkpoint_cache_implementation_is_replaced_by_the_paged_cache():
    """Gemma checkpoints ship generation_config.cache_implementation="hybrid"."""
    import copy

    model = build_model("gemma2", "eager")
    model.generation_config.cache_implementation = "hybrid"
    reference = copy.deepcopy(model)
    reference.generation_config.cache_implementation = None
    attngraph.accelerate(model, attention_backend="torch_native")
    ids, mask = left_padded_batch(model.config.vocab_size)
    assert torch.equal(model.generate(ids, attention_mask=mask, **GREEDY), reference.generate(ids, attention_mask=mask, **GREEDY))
    assert model.generation_config.cache_implementation == "hybrid"  # the user's config is untouched


@pytest.mark.keep_dynamo_cache
def test_many_accelerated_models_in_one_process():
    """Each model gets its own compiled code object: no shared recompile budget (8 by default)."""
    import copy

    for seed in range(10):
        model = build_model("llama", "sdpa", seed=seed)
        reference = copy.deepcopy(model)
        attngraph.accelerate(model, attention_backend="torch_native")
        ids, mask = left_padded_batch(model.config.vocab_size, (7, 3))
        kw = {**GREEDY, "max_new_tokens": 3}
        assert torch.equal(model.generate(ids, attention_mask=mask, **kw), reference.generate(ids, attention_mask=mask, **kw))
