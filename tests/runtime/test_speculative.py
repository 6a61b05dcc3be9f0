"""attngraph's speculative loop for prompt lookup (`runtime/speculative.py`): batched, ragged
verify steps, per-request rollback. Greedy tokens must equal plain greedy generate (HF's, on a
deep copy) whatever the candidates: found by lookup, always right, always wrong."""

import copy
import random

import pytest
import torch

import attngraph
from attngraph.errors import InputError
from attngraph.runtime import speculative
from attngraph.runtime.accelerate import state_of
from attngraph.runtime.paged_cache import PagedCache

from ..hf_models import build_model

PAD = 0


def repetitive_batch(vocab: int, seed: int, lengths=(13, 9, 16)):
    """Left-padded prompts that repeat random phrases (prompt lookup finds candidates in them)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        phrase = torch.randint(3, vocab, (4,), generator=g)
        noise = torch.randint(3, vocab, (n,), generator=g)
        rows.append(torch.cat([phrase, noise[: n // 3], phrase, noise, phrase])[:n])
    width = max(lengths)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :] = r
        mask[b, width - len(r) :] = 1
    return ids, mask


def accelerated_pair(arch: str, seed: int = 0):
    model = build_model(arch, "sdpa", seed=seed)
    reference = copy.deepcopy(model)
    return attngraph.accelerate(model, attention_backend="torch_native", page_size=4), reference


def count_rounds(monkeypatch):
    """Spy on the loop's verify steps: the fed token counts of every round."""
    rounds = []
    verify = speculative._verify

    def spy(cache, live, pending, proposal):
        rounds.append([1 + c for c in proposal.counts])
        return verify(cache, live, pending, proposal)

    monkeypatch.setattr(speculative, "_verify", spy)
    return rounds


# ------------------------------------------------------------------------------ lookup rule
def test_lookup_candidates_follow_transformers_rule():
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    rng = random.Random(7)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 14))]
        k, n = rng.randint(1, 5), rng.randint(1, 3)
        hf = PromptLookupCandidateGenerator(num_output_tokens=k, max_matching_ngram_size=n, max_length=1000)
        ids = torch.tensor([tokens])
        out, _ = hf.get_candidates(ids)
        want = out[0, len(tokens) :].tolist()
        assert speculative.lookup_candidates(tokens, k, n) == want, (tokens, k, n)


# ------------------------------------------------------------------------------ greedy = plain greedy
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "mistral"])  # mistral: sliding window
@pytest.mark.parametrize("k", [1, 4])
def test_lookup_batch_matches_plain_greedy(arch, k, monkeypatch):
    model, reference = accelerated_pair(arch)
    ids, mask = repetitive_batch(model.config.vocab_size, seed=k)
    kw = dict(max_new_tokens=14, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, **kw)
    rounds = count_rounds(monkeypatch)
    got = model.generate(ids, attention_mask=mask, prompt_lookup_num_tokens=k, **kw)
    assert torch.equal(got, want)
    assert rounds and max(max(r) for r in rounds) > 1  # candidates were verified
    runner = state_of(model).runner
    assert runner.pool.num_used_pages == 0 and runner.pool.num_active_requests == 0
    assert runner.num_compilations == 1


def test_sequences_stop_at_eos_and_pad_like_plain_greedy(monkeypatch):
    """EOS is one of each request's plain-greedy tokens: it ends there (maybe inside an accepted
    run of candidates) and pads follow, as in plain greedy's output."""
    model, reference = accelerated_pair("llama", seed=2)
    ids, mask = repetitive_batch(model.config.vocab_size, seed=11)
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=PAD)
    with torch.no_grad():
        free = reference.generate(ids, attention_mask=mask, eos_token_id=None, **kw)
    eos = int(free[0, ids.shape[1] + 5])  # request 0's sixth new token
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, eos_token_id=eos, **kw)
    count_rounds(monkeypatch)
    got = model.generate(ids, attention_mask=mask, eos_token_id=eos, prompt_lookup_num_tokens=4, **kw)
    assert torch.equal(got, want)
    assert state_of(model).runner.pool.num_used_pages == 0


@pytest.mark.parametrize("agree", [True, False])
@pytest.mark.parametrize("k", [1, 3])
def test_candidates_always_right_or_always_wrong(agree, k, monkeypatch):
    """A proposer that knows plain greedy's tokens (every candidate accepted: rounds of k + 1
    tokens) or proposes a wrong token every time (all rejected: one new token per round)."""
    model, reference = accelerated_pair("qwen2", seed=3)
    ids, mask = repetitive_batch(model.config.vocab_size, seed=5, lengths=(7, 12))
    new = 11
    kw = dict(max_new_tokens=new, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, **kw)
    vocab = model.config.vocab_size
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    futures = [prompts[b] + want[b, ids.shape[1] :].tolist() for b in range(len(prompts))]

    def propose(tokens, num, max_ngram):
        b = next(i for i, p in enumerate(futures) if p[: len(tokens)] == tokens)
        right = futures[b][len(tokens) : len(tokens) + num]
        return right if agree else [(t + 1) % vocab for t in right]

    monkeypatch.setattr(speculative, "lookup_candidates", propose)
    rounds = count_rounds(monkeypatch)
    got = model.generate(ids, attention_mask=mask, prompt_lookup_num_tokens=k, **kw)
    assert torch.equal(got, want)
    if agree:  # the prefill gives 1 token, each round k + 1 (the last round what is left)
        assert len(rounds) == -(-(new - 1) // (k + 1))
    else:
        assert len(rounds) == new - 1
    assert state_of(model).runner.pool.num_used_pages == 0


def test_sampling_and_processors_run_transformers_loop(monkeypatch):
    """What the loop does not reproduce goes to transformers' assisted loop (batch 1)."""
    model, reference = accelerated_pair("llama", seed=1)
    ids, _ = repetitive_batch(model.config.vocab_size, seed=2, lengths=(12,))
    rounds = count_rounds(monkeypatch)
    kw = dict(max_new_tokens=8, pad_token_id=PAD, prompt_lookup_num_tokens=3, repetition_penalty=1.3, do_sample=False)
    with torch.no_grad():
        want = reference.generate(ids, **kw)
    assert torch.equal(model.generate(ids, **kw), want)
    assert rounds == []
    assert state_of(model).runner.pool.num_used_pages == 0


# ------------------------------------------------------------------------------ cache API
def test_extend_each_and_truncate_each_roll_back_one_sequence():
    model, reference = accelerated_pair("llama", seed=4)
    runner = state_of(model).runner
    ids, mask = repetitive_batch(model.config.vocab_size, seed=6, lengths=(6, 9))
    cache = PagedCache(runner)
    try:
        cache.step(ids, mask, 1)
        before = list(cache.lengths)
        extra = torch.randint(3, model.config.vocab_size, (5,))
        logits = cache.extend_each([1, 0], extra, [3, 2])  # sequence 1 gets 3 tokens, 0 gets 2
        assert logits.shape == (5, model.config.vocab_size)
        assert cache.lengths == [before[0] + 2, before[1] + 3]
        # sequence 1's logits equal the reference's on its prompt + 3 tokens
        seq1 = torch.cat([ids[1][mask[1].bool()], extra[:3]])[None]
        with torch.no_grad():
            want = reference(input_ids=seq1).logits[0, -3:]
        torch.testing.assert_close(logits[:3], want, atol=1e-4, rtol=1e-4)
        with pytest.raises(InputError, match="one count >= 1"):
            cache.extend_each([0, 1], extra[:2], [2, 0])
        assert cache.lengths == [before[0] + 2, before[1] + 3]  # nothing written
        with pytest.raises(InputError, match="truncate_each"):
            cache.crop(-1)
        with pytest.raises(InputError, match="holds"):
            cache.truncate_each([0], [before[0] + 3])
        assert cache.lengths == [before[0] + 2, before[1] + 3]  # unchanged by the refusal
        cache.truncate_each([1], [before[1] + 1])  # drop two of sequence 1's tokens
        assert cache.next_positions[1] == before[1] + 1
        # extending again after the rollback attends over the kept tokens only
        again = cache.extend_each([1], extra[3:5], [2])
        seq1 = torch.cat([ids[1][mask[1].bool()], extra[:1], extra[3:5]])[None]
        with torch.no_grad():
            want = reference(input_ids=seq1).logits[0, -2:]
        torch.testing.assert_close(again, want, atol=1e-4, rtol=1e-4)
    finally:
        cache.free()
    assert runner.pool.num_used_pages == 0


# ------------------------------------------------------------------------------ assistant model
def accelerated_draft(model, seed: int | None, k: int, schedule: str = "constant"):
    """An accelerated draft: a copy of ``model``'s weights (``seed=None``: agrees always) or a
    model of the same shape with other random weights (disagrees nearly always)."""
    draft = copy.deepcopy(model) if seed is None else build_model(model.config.model_type, "sdpa", seed=seed)
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = schedule
    return attngraph.accelerate(draft, attention_backend="torch_native", page_size=4)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("agree", [True, False])
@pytest.mark.parametrize("k", [1, 4])
def test_accelerated_draft_batch_matches_plain_greedy(arch, agree, k, monkeypatch):
    model = build_model(arch, "sdpa", seed=0)
    reference, twin = copy.deepcopy(model), copy.deepcopy(model)
    attngraph.accelerate(model, attention_backend="torch_native", page_size=4)
    draft = accelerated_draft(twin, None if agree else 9, k)
    ids, mask = repetitive_batch(model.config.vocab_size, seed=k, lengths=(10, 6, 13))
    new = 12
    kw = dict(max_new_tokens=new, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, **kw)
    rounds = count_rounds(monkeypatch)
    got = model.generate(ids, attention_mask=mask, assistant_model=draft, **kw)
    assert torch.equal(got, want)
    if agree:  # every candidate kept: rounds of k + 1 tokens after the prefill's one
        assert len(rounds) == -(-(new - 1) // (k + 1))
        assert max(max(r) for r in rounds) == k + 1
    else:
        assert len(rounds) > (new - 1) // (k + 1)
    for m in (model, draft):
        runner = state_of(m).runner
        assert runner.pool.num_used_pages == 0 and runner.pool.num_active_requests == 0
        assert runner.num_compilations == 1


def test_adaptive_draft_length_and_eos(monkeypatch):
    """transformers' "heuristic" schedule (k + 2 after a round of all-kept candidates, k - 1
    otherwise) and EOS inside a kept run: the tokens stay plain greedy's."""
    model = build_model("llama", "sdpa", seed=2)
    reference, twin = copy.deepcopy(model), copy.deepcopy(model)
    attngraph.accelerate(model, attention_backend="torch_native", page_size=4)
    draft = accelerated_draft(twin, None, 2, schedule="heuristic")
    ids, mask = repetitive_batch(model.config.vocab_size, seed=11)
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=PAD)
    with torch.no_grad():
        free = reference.generate(ids, attention_mask=mask, eos_token_id=None, **kw)
    eos = int(free[1, ids.shape[1] + 9])  # request 1's tenth new token
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, eos_token_id=eos, **kw)
    rounds = count_rounds(monkeypatch)
    got = model.generate(ids, attention_mask=mask, eos_token_id=eos, assistant_model=draft, **kw)
    assert torch.equal(got, want)
    assert [max(r) for r in rounds[:3]] == [3, 5, 7]  # k = 2, 4, 6: all kept, so k grows
    assert state_of(draft).runner.pool.num_used_pages == 0 and state_of(model).runner.pool.num_used_pages == 0


# ------------------------------------------------------------------------------ backend per role
def test_verify_attention_backend_serves_the_verify_steps(monkeypatch):
    """``verify_attention_backend`` names the backend of the target's verify steps; prefill and
    decode stay on ``attention_backend``. The tokens are plain greedy's either way."""
    from attngraph.attn_backends.triton_backend import TritonBackend

    from .test_soak import cpu_triton

    if not cpu_triton():
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1 before import (tests/conftest.py)")
    model = build_model("llama", "sdpa", seed=0)
    reference = copy.deepcopy(model)
    attngraph.accelerate(model, attention_backend="torch_native", verify_attention_backend="triton", page_size=4)
    runner = state_of(model).runner
    assert isinstance(runner.verify_backend, TritonBackend) and not isinstance(runner.backend, TritonBackend)
    calls = {"verify": 0, "other": 0}
    for name, backend in (("verify", runner.verify_backend), ("other", runner.backend)):
        real = backend.forward_extend

        def spy(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(backend, "forward_extend", spy)
    ids, mask = repetitive_batch(model.config.vocab_size, seed=2, lengths=(13, 9))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, **kw)
    rounds = count_rounds(monkeypatch)
    got = model.generate(ids, attention_mask=mask, prompt_lookup_num_tokens=3, **kw)
    assert torch.equal(got, want)
    verify_rounds = sum(1 for r in rounds if max(r) > 1)  # rounds with candidates: extend steps
    assert verify_rounds > 0
    layers = runner.geometry.num_layers
    assert calls["verify"] == verify_rounds * layers
    assert calls["other"] == layers  # the prefill only
    assert runner.pool.num_used_pages == 0
