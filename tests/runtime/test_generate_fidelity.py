"""Each generate option either gives exactly HF's result or an `AttnGraphError` naming it.

The reference is plain HF `generate` on a deep copy of the model taken before `accelerate`.
"""

import copy

import pytest
import torch
import transformers
from transformers.generation.streamers import BaseStreamer

import attngraph
from attngraph import AttnGraphError, KVCacheFullError, UnsupportedGenerationError, UnsupportedModelError
from attngraph.runtime.accelerate import state_of

from ..hf_models import build_model, tiny_config
from .test_generate import GREEDY, PAD, left_padded_batch

pytestmark = pytest.mark.keep_dynamo_cache

OPTIONS = dict(attention_backend="torch_native", page_size=4)


def _pair(arch, **options):
    model = build_model(arch, "sdpa")
    reference = copy.deepcopy(model)
    return attngraph.accelerate(model, **{**OPTIONS, **options}), reference


@pytest.fixture(scope="module")
def llama():
    return _pair("llama")


@pytest.fixture(scope="module")
def mistral():  # sliding window 8 on every layer
    return _pair("mistral")


def assert_pool_empty(model):
    pool = state_of(model).runner.pool
    assert pool.num_used_pages == 0 and pool.num_active_requests == 0


def assert_same(got, want):
    """Sequences equal; scores (when returned) equal to float tolerance."""
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want)
        return
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores or (), want.scores or ()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.clone())

    def end(self):
        pass


# ---------------------------------------------------------------- padding layouts
def test_right_padding_is_refused_with_the_fix(llama):
    model, _ = llama
    ids, mask = left_padded_batch(model.config.vocab_size, (9, 5))
    right_ids, right_mask = torch.full_like(ids, PAD), torch.zeros_like(mask)
    for r in range(2):
        n = int(mask[r].sum())
        right_ids[r, :n], right_mask[r, :n] = ids[r, -n:], 1
    with pytest.raises(UnsupportedGenerationError, match="padding_side = 'left'"):
        model.generate(right_ids, attention_mask=right_mask, **GREEDY)
    # No mask given: transformers derives it from the pad token; still refused.
    with pytest.raises(UnsupportedGenerationError, match="right padding"):
        model.generate(right_ids, **GREEDY)
    assert_pool_empty(model)


def test_holes_without_a_window_match_hf(llama):
    model, reference = llama
    ids, mask = left_padded_batch(model.config.vocab_size, (14, 9), seed=3)
    mask[0, 6], mask[0, 11], mask[1, 12] = 0, 0, 0
    for extra in ({}, dict(return_dict_in_generate=True, output_scores=True)):
        kw = dict(attention_mask=mask, **GREEDY, **extra)
        assert_same(model.generate(ids, **kw), reference.generate(ids, **kw))


def test_holes_with_a_sliding_window_are_refused(mistral):
    model, reference = mistral
    ids, mask = left_padded_batch(model.config.vocab_size, (20, 14), seed=4)
    mask[0, 15] = 0  # inside the last token's window of 8
    with pytest.raises(UnsupportedGenerationError, match="sliding-window"):
        model.generate(ids, attention_mask=mask, **GREEDY)
    assert_pool_empty(model)
    mask[0, 15] = 1  # left padding alone is served
    assert torch.equal(model.generate(ids, attention_mask=mask, **GREEDY), reference.generate(ids, attention_mask=mask, **GREEDY))


def test_prefill_chunks_of_leading_padding(llama):
    """A chunk in which a left-padded row has no token yet (HF's loop, prefill_chunk_size)."""
    model, reference = llama
    ids, mask = left_padded_batch(model.config.vocab_size, (12, 4, 7), seed=5)
    kw = dict(attention_mask=mask, prefill_chunk_size=3, return_dict_in_generate=True, output_scores=True, **GREEDY)
    assert_same(model.generate(ids, **kw), reference.generate(ids, **kw))


# ---------------------------------------------------------------- use_cache=False
class Record:
    """A logits processor that keeps the logits each step starts from."""

    def __init__(self):
        self.seen = []

    def __call__(self, input_ids, scores):
        self.seen.append(scores.clone())
        return scores


@pytest.mark.parametrize("how", ["return_dict", "streamer", "generation_config"])
def test_use_cache_false_matches_hf(llama, how):
    model, reference = llama
    ids, mask = left_padded_batch(model.config.vocab_size, (10, 6), seed=6)
    common = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    outs, records = [], []
    for m in (model, reference):
        if how == "return_dict":
            kw = dict(use_cache=False, return_dict_in_generate=True, output_scores=True)
        elif how == "streamer":
            kw = dict(use_cache=False, streamer=Collect())
        else:
            cfg = copy.deepcopy(m.generation_config)
            cfg.use_cache, cfg.return_dict_in_generate, cfg.output_scores = False, True, True
            kw = dict(generation_config=cfg)
        records.append(Record())
        outs.append(m.generate(ids, **common, **kw, logits_processor=transformers.LogitsProcessorList([records[-1]])))
    assert_same(*outs)
    assert len(records[0].seen) == len(records[1].seen) == 6
    for a, b in zip(records[0].seen, records[1].seen):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert_pool_empty(model)


# ---------------------------------------------------------------- forward keywords
def test_position_ids_reach_the_model(llama):
    model, reference = llama
    ids, mask = left_padded_batch(model.config.vocab_size, (10, 7), seed=7)
    g = torch.Generator().manual_seed(0)
    # Increasing, irregular positions (a constant offset would cancel in RoPE).
    pos = torch.cumsum(torch.randint(1, 6, ids.shape, generator=g), dim=1)
    for extra in (dict(return_dict_in_generate=True, output_scores=True), {}):
        kw = dict(attention_mask=mask, position_ids=pos, **GREEDY, **extra)
        assert_same(model.generate(ids, **kw), reference.generate(ids, **kw))
    # [1, seq] positions broadcast over the batch, as in HF.
    kw = dict(attention_mask=mask, position_ids=pos[:1], return_dict_in_generate=True, output_scores=True, **GREEDY)
    assert_same(model.generate(ids, **kw), reference.generate(ids, **kw))


def test_token_type_ids_are_refused_by_name():
    model, _ = _pair("gpt2")  # GPT-2's forward takes token_type_ids (added embeddings)
    ids, mask = left_padded_batch(model.config.vocab_size, (6, 4))
    with pytest.raises(UnsupportedGenerationError, match="token_type_ids"):
        model.generate(ids, attention_mask=mask, token_type_ids=torch.ones_like(ids), **GREEDY)
    assert_pool_empty(model)


def test_unserved_forward_keyword_is_refused_on_direct_forward(llama):
    model, _ = llama
    from attngraph.runtime.paged_cache import PagedCache

    cache = PagedCache(state_of(model).runner)
    ids = torch.randint(3, model.config.vocab_size, (1, 5))
    with pytest.raises(UnsupportedGenerationError, match="position_bias"):
        model(input_ids=ids, cache=cache, position_bias=torch.zeros(1))
    cache.free()


@pytest.mark.parametrize("flag", ["output_hidden_states", "output_attentions"])
def test_per_layer_outputs_are_refused(llama, flag):
    model, _ = llama
    ids, mask = left_padded_batch(model.config.vocab_size, (6, 4))
    with pytest.raises(UnsupportedGenerationError, match=flag):
        model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **{flag: True}, **GREEDY)
    assert_pool_empty(model)


# ---------------------------------------------------------------- RNG
def test_sampling_that_stops_early_leaves_the_generator_where_hf_does(llama):
    model, reference = llama
    ids, mask = left_padded_batch(model.config.vocab_size, (8, 5), seed=8)
    # Half the vocabulary ends a sequence: every row stops within a few steps, long before 24.
    kw = dict(attention_mask=mask, max_new_tokens=24, do_sample=True, pad_token_id=PAD, eos_token_id=list(range(3, 50)))
    results = {}
    for name, m in (("ours", model), ("hf", reference)):
        torch.manual_seed(11)
        results[name] = (m.generate(ids, **kw), m.generate(ids, **kw), torch.get_rng_state())
    (a1, a2, sa), (b1, b2, sb) = results["ours"], results["hf"]
    assert a1.shape[1] < ids.shape[1] + 8  # stopped early, inside the first stop-check window
    assert torch.equal(a1, b1) and torch.equal(a2, b2) and torch.equal(sa, sb)


# ---------------------------------------------------------------- crashes made clear
def test_dynamic_rope_is_refused_at_accelerate():
    cfg = tiny_config("llama")
    cfg.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with pytest.raises(UnsupportedModelError, match="rope_type='dynamic'"):
        attngraph.accelerate(model, **OPTIONS)
    assert "generate" not in model.__dict__


def test_deepcopy_gives_an_unaccelerated_copy(llama):
    model, reference = llama
    twin = copy.deepcopy(model)
    assert not any(k in twin.__dict__ for k in ("forward", "generate", "_attngraph_state", "__deepcopy__"))
    ids, mask = left_padded_batch(model.config.vocab_size, (7, 5))
    want = reference.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(twin.generate(ids, attention_mask=mask, **GREEDY), want)
    assert torch.equal(model.generate(ids, attention_mask=mask, **GREEDY), want)  # the original still serves
    assert "_attngraph_state" in model.__dict__


def test_dtype_device_or_train_mode_changes_are_refused_before_compiling(llama):
    """Each such change would add a Dynamo graph (and silently mismatch the pool's dtype)."""
    model, reference = llama
    runner = state_of(model).runner
    graphs = runner.num_compilations
    ids, mask = left_padded_batch(model.config.vocab_size, (6, 4))
    try:
        model.to(torch.float64)
        with pytest.raises(AttnGraphError, match="restore"):
            model.generate(ids, attention_mask=mask, **GREEDY)
        model.to(torch.float32).train()
        with pytest.raises(UnsupportedGenerationError, match="model.eval"):
            model.generate(ids, attention_mask=mask, **GREEDY)
    finally:
        model.to(torch.float32).eval()
    assert torch.equal(model.generate(ids, attention_mask=mask, **GREEDY), reference.generate(ids, attention_mask=mask, **GREEDY))
    assert runner.num_compilations == graphs


def test_recompile_limit_becomes_an_attngraph_error(llama, monkeypatch):
    model, _ = llama
    runner = state_of(model).runner

    def hit(*args, **kwargs):
        raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile_limit reached")

    monkeypatch.setattr(runner, "forward", hit)
    ids, mask = left_padded_batch(model.config.vocab_size, (6, 4))
    with pytest.raises(UnsupportedModelError, match="recompile_limit"):
        model.generate(ids, attention_mask=mask, **GREEDY)
    monkeypatch.undo()
    assert_pool_empty(model)


# ---------------------------------------------------------------- lengths
def test_length_is_checked_before_the_first_step():
    model, _ = _pair("llama", max_context_len=32, kv_cache_tokens=48)
    runner = state_of(model).runner
    calls = []
    forward = runner.forward
    runner.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    ids, mask = left_padded_batch(model.config.vocab_size, (10, 6))
    with pytest.raises(KVCacheFullError, match=r"row 0 needs 39 .*max_context_len is 32.*CompileConfig.max_context_len"):
        model.generate(ids, attention_mask=mask, **{**GREEDY, "max_new_tokens": 30})
    with pytest.raises(KVCacheFullError, match=r"needs 15 KV pages.*12 free pages.*kv_cache_tokens"):
        model.generate(ids, attention_mask=mask, **{**GREEDY, "max_new_tokens": 20})
    assert not calls
    assert_pool_empty(model)
    out = model.generate(ids, attention_mask=mask, **{**GREEDY, "max_new_tokens": 8})
    assert out.shape == (2, 18) and calls
