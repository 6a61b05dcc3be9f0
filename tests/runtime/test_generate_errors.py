"""Bad input and unsupported modes: clear errors, and the pool left consistent."""

import threading

import pytest
import torch
from torch import nn

import attngraph
from attngraph import BackendUnavailableError, KVCacheFullError, UnsupportedGenerationError, UnsupportedModelError
from attngraph.runtime.accelerate import state_of

from ..hf_models import build_model
from .test_generate import GREEDY, PAD, left_padded_batch

pytestmark = pytest.mark.keep_dynamo_cache


@pytest.fixture(scope="module")
def model():
    m = build_model("llama", "sdpa")
    return attngraph.accelerate(m, attention_backend="torch_native", page_size=4, kv_cache_tokens=64)


def pool_of(model):
    return state_of(model).runner.pool


def assert_pool_empty(model):
    pool = pool_of(model)
    assert pool.num_used_pages == 0 and pool.num_active_requests == 0


def test_empty_prompt(model):
    with pytest.raises(ValueError, match="empty prompt"):
        state = state_of(model)  # the cache keyword is `cache` or `past_key_values` by transformers version
        model(input_ids=torch.zeros((1, 0), dtype=torch.long), **{state.cache_kwarg: attngraph.runtime.paged_cache.PagedCache(state.runner)})
    ids, mask = left_padded_batch(model.config.vocab_size, (5, 3))
    mask[1] = 0  # row 1 is all padding
    with pytest.raises(ValueError, match="empty prompt in row 1"):
        model.generate(ids, attention_mask=mask, **GREEDY)
    assert_pool_empty(model)


def test_prompt_longer_than_the_pool(model):
    ids = torch.randint(3, model.config.vocab_size, (1, 80))  # pool holds 64 tokens
    with pytest.raises(KVCacheFullError, match="kv_cache_tokens"):
        model.generate(ids, **GREEDY)
    assert_pool_empty(model)


def test_pool_fills_in_the_middle_of_generation_then_recovers(model):
    ids, mask = left_padded_batch(model.config.vocab_size, (20, 20))  # 40 tokens fit, 64 do not
    with pytest.raises(KVCacheFullError, match="pages"):
        model.generate(ids, attention_mask=mask, **{**GREEDY, "max_new_tokens": 20})
    assert_pool_empty(model)
    out = model.generate(ids[:1], attention_mask=mask[:1], **{**GREEDY, "max_new_tokens": 4})
    assert out.shape == (1, 24)
    assert_pool_empty(model)


@pytest.mark.parametrize(
    "options,needle",
    [
        (dict(num_beams=2), "beam search"),
        (dict(penalty_alpha=0.6, top_k=4), "contrastive"),
        (dict(synced_gpus=True), "synced_gpus"),
    ],
)
def test_unsupported_generation_modes(model, options, needle):
    ids, _ = left_padded_batch(model.config.vocab_size, (5,))
    with pytest.raises(UnsupportedGenerationError, match=needle) as err:
        model.generate(ids, **GREEDY, **options)
    assert "Supported" in str(err.value) and "restore" in str(err.value)
    assert_pool_empty(model)


def test_accelerate_twice_is_an_error(model):
    with pytest.raises(attngraph.AttnGraphError, match="already accelerated"):
        attngraph.accelerate(model)


def test_backend_that_cannot_serve_fails_at_accelerate_time():
    m = build_model("llama", "sdpa")
    with pytest.raises(BackendUnavailableError, match="torch_native"):
        attngraph.accelerate(m, attention_backend="flashinfer")
    assert "generate" not in m.__dict__  # nothing half-applied


def test_model_without_lowerable_attention():
    """Attention with a learned additive bias (data, not a mask) can never be lowered."""
    import transformers.models.llama.modeling_llama as ml

    m = build_model("llama", "eager")
    for layer in m.model.layers:
        layer.self_attn.learned_bias = nn.Parameter(torch.randn(1, 1, 64, 64))
    original = ml.eager_attention_forward

    def biased(module, query, key, value, attention_mask, **kw):
        bias = module.learned_bias[:, :, : query.shape[2], : key.shape[2]]
        return original(module, query, key, value, bias, **kw)

    ml.eager_attention_forward = biased
    try:
        with pytest.raises(UnsupportedModelError, match="every attention site must be lowered") as err:
            attngraph.accelerate(m, attention_backend="torch_native")
        assert "model.layers.0.self_attn" in str(err.value) and "depends on the values" in str(err.value)
    finally:
        ml.eager_attention_forward = original
    assert "generate" not in m.__dict__


def test_two_threads_are_serialized(model):
    ids, mask = left_padded_batch(model.config.vocab_size, (6, 4))
    expected = model.generate(ids, attention_mask=mask, **{**GREEDY, "max_new_tokens": 5})
    results, errors = [], []

    def work():
        try:
            results.append(model.generate(ids, attention_mask=mask, **{**GREEDY, "max_new_tokens": 5}))
        except Exception as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(torch.equal(r, expected) for r in results)
    assert_pool_empty(model)


def test_two_hundred_calls_leave_no_page_in_use(model):
    g = torch.Generator().manual_seed(7)
    for i in range(200):
        bsz = int(torch.randint(1, 4, (1,), generator=g))
        lengths = tuple(int(x) for x in torch.randint(1, 9, (bsz,), generator=g))
        ids, mask = left_padded_batch(model.config.vocab_size, lengths, seed=i)
        new = int(torch.randint(1, 4, (1,), generator=g))
        # No end-of-sequence token: a sampled one would end a row early, and the length would
        # depend on the global RNG's state (on which tests ran before in this process).
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=bool(i % 2), pad_token_id=PAD,
                             eos_token_id=None)
        assert out.shape == (bsz, ids.shape[1] + new)
    assert_pool_empty(model)
    assert state_of(model).runner.num_compilations == 1
