"""Assisted generation on an accelerated model: HF's own assisted loop (an assistant model;
prompt lookup with sampling or logits processors), whose verify steps (k + 1 candidate tokens,
logits at every one) run on the paged runtime and whose rejected tokens are dropped with
`PagedCache.crop`; greedy prompt lookup runs attngraph's own loop. Compared token for token
with HF on a deep copy."""

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


@pytest.mark.parametrize("assistant_seed", [0, 7])  # seed 0: the target's weights (always agrees)
def test_an_unaccelerated_assistant_drafts_for_the_accelerated_target(assistant_seed):
    model, reference = accelerated_pair("llama")
    assistant = build_model("llama", "sdpa", seed=assistant_seed)
    assistant.generation_config.num_assistant_tokens = 4
    ids = repetitive_prompt(model.config.vocab_size, seed=3)
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    with torch.no_grad():
        want = reference.generate(ids, **kw)
    draft = copy.deepcopy(assistant)
    got = model.generate(ids, assistant_model=draft, **kw)
    assert torch.equal(got, want)
    assert state_of(model).runner.pool.num_used_pages == 0
    # accelerated on its first use, with the target's config and a pool as large as the target's
    draft_runner = state_of(draft).runner
    assert draft_runner.config.attention_backend == "torch_native"
    assert draft_runner.pool.capacity_tokens() == state_of(model).runner.pool.capacity_tokens()
    assert draft_runner.pool.num_used_pages == 0
    assert torch.equal(model.generate(ids, assistant_model=draft, **kw), want)  # the second call reuses it
    assert draft_runner.num_compilations == 1


def test_an_assistant_that_cannot_be_accelerated_runs_as_it_is(monkeypatch, caplog):
    from attngraph.errors import UnsupportedModelError
    from attngraph.runtime import accelerate as accelerate_module

    def refuse(model, config=None, **options):
        raise UnsupportedModelError("not this one")

    model, reference = accelerated_pair("llama")
    monkeypatch.setattr(accelerate_module, "accelerate", refuse)
    assistant = build_model("llama", "sdpa", seed=7)
    assistant.generation_config.num_assistant_tokens = 3
    ids = repetitive_prompt(model.config.vocab_size, seed=4)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    with torch.no_grad():
        want = reference.generate(ids, **kw)
    with caplog.at_level("WARNING", logger="attngraph.runtime.accelerate"):
        got = model.generate(ids, assistant_model=assistant, **kw)
    assert torch.equal(got, want)
    assert "could not be accelerated (not this one)" in caplog.text
    assert getattr(assistant, "_attngraph_state", None) is None and state_of(model).runner.pool.num_used_pages == 0


@pytest.mark.parametrize("accelerate_target", [True, False])
@pytest.mark.parametrize("do_sample", [False, True])
def test_an_accelerated_assistant_drafts_on_its_own_pool(accelerate_target, do_sample):
    """The assistant's paged cache lives across the rounds (transformers passes it back and
    crops it) and its pages return to the pool once the call is over."""
    target = build_model("llama", "sdpa", seed=0)
    reference = copy.deepcopy(target)
    if accelerate_target:
        attngraph.accelerate(target, attention_backend="torch_native", page_size=4)
    draft = build_model("llama", "sdpa", seed=6)
    draft.generation_config.num_assistant_tokens = 3
    draft_reference = copy.deepcopy(draft)
    attngraph.accelerate(draft, attention_backend="torch_native", page_size=4)
    ids = repetitive_prompt(target.config.vocab_size, seed=5)
    kw = dict(max_new_tokens=12, do_sample=do_sample, temperature=0.8, pad_token_id=PAD, eos_token_id=None)
    torch.manual_seed(8)
    with torch.no_grad():
        want = reference.generate(ids, assistant_model=draft_reference, **kw)
    torch.manual_seed(8)
    got = target.generate(ids, assistant_model=draft, **kw)
    assert torch.equal(got, want)
    draft_pool = state_of(draft).runner.pool
    assert draft_pool.num_used_pages == 0 and draft_pool.num_active_requests == 0
    assert state_of(draft).runner.num_compilations == 1


def test_a_foreign_or_freed_cache_is_refused():
    model, _ = accelerated_pair("llama")
    other, _ = accelerated_pair("llama", seed=1)
    ids = repetitive_prompt(model.config.vocab_size, seed=3)
    foreign = attngraph.runtime.paged_cache.PagedCache(state_of(other).runner)
    with pytest.raises(UnsupportedGenerationError, match="user-supplied"):
        model.generate(ids, max_new_tokens=3, pad_token_id=PAD, **{state_of(model).cache_kwarg: foreign})
    with pytest.raises(UnsupportedGenerationError, match="own assistant_model"):
        model.generate(ids, assistant_model=model, max_new_tokens=3, pad_token_id=PAD)
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


def test_a_sampled_batch_is_refused_by_hf_and_leaves_the_pool_empty():
    """Greedy prompt lookup serves batches (attngraph's loop, tests/runtime/test_speculative.py);
    sampling runs transformers' assisted loop, which takes one sequence."""
    model, _ = accelerated_pair("llama")
    ids = torch.cat([repetitive_prompt(model.config.vocab_size, seed=s) for s in (1, 2)])
    with pytest.raises(ValueError, match="batch_size = 1"):
        model.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=4, pad_token_id=PAD, do_sample=True)
    runner = state_of(model).runner
    assert runner.pool.num_used_pages == 0 and runner.pool.num_active_requests == 0


@pytest.mark.parametrize("accelerate_draft", [False, True])
def test_a_draft_with_another_vocabulary_is_refused_and_leaves_the_pools_empty(accelerate_draft):
    """transformers refuses an assistant of another vocabulary (without both tokenizers) before
    any step; the accelerated target (and an accelerated draft) keep no pages."""
    import transformers

    from ..hf_models import tiny_config

    model, _ = accelerated_pair("llama")
    cfg = tiny_config("llama")
    cfg.vocab_size = model.config.vocab_size // 2
    torch.manual_seed(5)
    draft = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    if accelerate_draft:
        attngraph.accelerate(draft, attention_backend="torch_native", page_size=4)
    ids = repetitive_prompt(cfg.vocab_size, seed=4)
    with pytest.raises(ValueError, match="tokenizer"):
        model.generate(ids, assistant_model=draft, max_new_tokens=4, pad_token_id=PAD)
    for m in (model, draft) if accelerate_draft else (model,):
        runner = state_of(m).runner
        assert runner.pool.num_used_pages == 0 and runner.pool.num_active_requests == 0
