"""Assisted generation on an accelerated model: HF's own assisted loop, whose verify steps
(k + 1 candidate tokens, logits at every one) run on the paged runtime and whose rejected
tokens are dropped with `PagedCache.crop`. Compared token for token with HF on a deep copy."""

import copy

import pytest
import torch

import attngraph
from attngraph.errors import UnsupportedGenerationError
from attngraph.runtime.accelerate import state_of

from ..hf_models import build_model

PAD = 0


def repetitive_prompt(vocab: int, seed: int) -> torch.Tensor:
    """A prompt that repeats a random phrase, so prompt lookup finds candidates (some right,
    some wrong: the model's random weights decide)."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(3, vocab, (5,), generator=g)
    noise = torch.randint(3, vocab, (3,), generator=g)
    return torch.cat([phrase, noise, phrase, phrase[:3]])[None]


def accelerated_pair(arch: str, seed: int = 0):
    model = build_model(arch, "sdpa", seed=seed)
    reference = copy.deepcopy(model)
    return attngraph.accelerate(model, attention_backend="torch_native", page_size=4), reference


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_prompt_lookup_greedy_matches_hf_and_plain_greedy(arch, k):
    model, reference = accelerated_pair(arch)
    ids = repetitive_prompt(model.config.vocab_size, seed=k)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    with torch.no_grad():
        want = reference.generate(ids, prompt_lookup_num_tokens=k, **kw)
        plain = reference.generate(ids, **kw)
    got = model.generate(ids, prompt_lookup_num_tokens=k, **kw)
    assert torch.equal(got, want) and torch.equal(got, plain)
    runner = state_of(model).runner
    assert runner.pool.num_used_pages == 0 and runner.num_compilations == 1


def test_prompt_lookup_sampling_draws_what_hf_draws():
    model, reference = accelerated_pair("llama", seed=1)
    ids = repetitive_prompt(model.config.vocab_size, seed=9)
    kw = dict(max_new_tokens=12, do_sample=True, temperature=0.7, top_k=10, pad_token_id=PAD, prompt_lookup_num_tokens=3)
    torch.manual_seed(4)
    got = model.generate(ids, **kw)
    torch.manual_seed(4)
    with torch.no_grad():
        want = reference.generate(ids, **kw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("assistant_seed", [0, 7])  # seed 0: the target itself (always agrees)
def test_an_unaccelerated_assistant_drafts_for_the_accelerated_target(assistant_seed):
    model, reference = accelerated_pair("llama")
    assistant = build_model("llama", "sdpa", seed=assistant_seed)
    assistant.generation_config.num_assistant_tokens = 4
    ids = repetitive_prompt(model.config.vocab_size, seed=3)
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    with torch.no_grad():
        want = reference.generate(ids, **kw)
    got = model.generate(ids, assistant_model=copy.deepcopy(assistant), **kw)
    assert torch.equal(got, want)
    assert state_of(model).runner.pool.num_used_pages == 0


def test_an_accelerated_assistant_is_refused_before_any_step():
    model, _ = accelerated_pair("llama")
    assistant = attngraph.accelerate(build_model("llama", "sdpa", seed=3), attention_backend="torch_native")
    ids = repetitive_prompt(model.config.vocab_size, seed=3)
    with pytest.raises(UnsupportedGenerationError, match="accelerated assistant_model"):
        model.generate(ids, assistant_model=assistant, max_new_tokens=4, pad_token_id=PAD)
    assert state_of(model).runner.pool.num_used_pages == 0


def test_assisted_without_a_cache_is_refused_as_hf_refuses_it():
    model, reference = accelerated_pair("llama")
    ids = repetitive_prompt(model.config.vocab_size, seed=3)
    kw = dict(prompt_lookup_num_tokens=3, max_new_tokens=4, pad_token_id=PAD, use_cache=False)
    with pytest.raises(Exception, match="cache"):
        reference.generate(ids, **kw)
    with pytest.raises(UnsupportedGenerationError, match="use_cache=False"):
        model.generate(ids, **kw)
    assert state_of(model).runner.pool.num_used_pages == 0


def test_a_batch_is_refused_by_hf_and_leaves_the_pool_empty():
    model, _ = accelerated_pair("llama")
    ids = torch.cat([repetitive_prompt(model.config.vocab_size, seed=s) for s in (1, 2)])
    with pytest.raises(ValueError, match="batch_size = 1"):
        model.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=4, pad_token_id=PAD)
    runner = state_of(model).runner
    assert runner.pool.num_used_pages == 0 and runner.pool.num_active_requests == 0
