"""Greedy search without logits processors: `PagedCache.decode_greedy` chunks in attngraph's loop.

The chunk rule (`_finish_chunk`) is checked against HF's per-step EOS rule on random tokens;
`decode_greedy` against as many `decode_step` calls; whole `generate` calls against HF eager
generate where EOS ends sequences inside a chunk, at a chunk's edge, and all of them early.
"""

import copy

import pytest
import torch

import attngraph
from attngraph.errors import InputError
from attngraph.runtime.accelerate import state_of
from attngraph.runtime.decode_loop import GREEDY_CHUNK, _chunk_sizes, _finish_chunk
from attngraph.runtime.paged_cache import PagedCache

from ..hf_models import build_model
from .test_generate import PAD, left_padded_batch


@pytest.mark.parametrize("steps", range(0, 3 * GREEDY_CHUNK + 2))
def test_chunk_sizes_cover_the_steps_with_few_distinct_sizes(steps):
    sizes = _chunk_sizes(steps)
    assert sum(sizes) == steps
    assert all(s == GREEDY_CHUNK or (s & (s - 1) == 0 and s < GREEDY_CHUNK) for s in sizes)
    assert len(sizes) == steps // GREEDY_CHUNK + bin(steps % GREEDY_CHUNK).count("1")


def _hf_rule(tokens: torch.Tensor, unfinished: torch.Tensor, eos: torch.Tensor, pad: int):
    """HF's `_sample`, one step at a time: pad after finishing, finished at an EOS."""
    unfinished = unfinished.long()
    emitted, done = [], []
    for tok in tokens:
        nxt = tok * unfinished + pad * (1 - unfinished)
        emitted.append(nxt)
        unfinished = unfinished & ~torch.isin(nxt, eos).long()
        done.append(bool(unfinished.max() == 0))
    return torch.stack(emitted), torch.tensor(done), unfinished.bool()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_finish_chunk_is_hfs_rule_step_by_step(seed, pad_is_eos):
    g = torch.Generator().manual_seed(seed)
    k, bsz = int(torch.randint(1, 12, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
    tokens = torch.randint(0, 8, (k, bsz), generator=g)  # EOS frequent among 8 ids
    eos = torch.tensor([2, 5])
    pad = 2 if pad_is_eos else 7
    unfinished = torch.rand(bsz, generator=g) < 0.8
    emitted, done, after = _finish_chunk(tokens, unfinished, eos, pad)
    want_emitted, want_done, want_after = _hf_rule(tokens, unfinished, eos, pad)
    assert torch.equal(emitted, want_emitted)
    assert torch.equal(done, want_done)
    assert torch.equal(after, want_after)


def test_finish_chunk_without_eos_emits_a_copy_of_the_argmaxes():
    tokens = torch.randint(0, 50, (5, 3))
    unfinished = torch.ones(3, dtype=torch.bool)
    emitted, done, after = _finish_chunk(tokens, unfinished, None, 0)
    assert torch.equal(emitted, tokens) and not done.any() and torch.equal(after, unfinished)
    assert emitted.data_ptr() != tokens.data_ptr()


@pytest.mark.parametrize("eos", [None, "mid"])
def test_chunks_returned_in_a_reused_buffer_are_consumed_before_the_next(llama_pair, monkeypatch, eos):
    """A multi-step graph returns its argmaxes in one static buffer that each replay rewrites
    (and pre-fills here with junk): the loop's output must not keep views of it."""
    model, reference = llama_pair
    ids, mask = left_padded_batch(model.config.vocab_size, (8, 5), seed=9)
    eos = None if eos is None else _eos_from_reference(reference, ids, mask, 1, 6)
    buffer = torch.empty(GREEDY_CHUNK, 2, dtype=torch.long)
    original = PagedCache.decode_greedy

    def into_buffer(self, tokens, k):
        out = original(self, tokens, k)
        buffer.fill_(-7)
        buffer[:k].copy_(out)
        return buffer[:k]

    monkeypatch.setattr(PagedCache, "decode_greedy", into_buffer)
    kw = dict(attention_mask=mask, max_new_tokens=2 * GREEDY_CHUNK + 5, do_sample=False, pad_token_id=PAD, eos_token_id=eos)
    got = model.generate(ids, **kw)
    with torch.no_grad():
        want = reference.generate(ids, **kw)
    assert torch.equal(got, want)


@pytest.fixture(scope="module")
def llama_pair():
    model = build_model("llama", "sdpa")
    reference = copy.deepcopy(model)
    return attngraph.accelerate(model, attention_backend="torch_native", page_size=4), reference


def _prefilled_cache(model, ids, mask):
    cache = PagedCache(state_of(model).runner)
    cache._allocate(ids.shape[0])
    logits = cache.step(ids, mask, 1)
    return cache, torch.argmax(logits[:, -1].float(), dim=-1)


def test_decode_greedy_equals_decode_steps_one_at_a_time(llama_pair):
    model, _ = llama_pair
    ids, mask = left_padded_batch(model.config.vocab_size, (9, 4, 6), seed=3)
    with torch.no_grad():
        a, first = _prefilled_cache(model, ids, mask)
        b, _ = _prefilled_cache(model, ids, mask)
        try:
            got = a.decode_greedy(first, 5).clone()
            tok, want = first, []
            for _ in range(5):
                tok = torch.argmax(b.decode_step(tok)[:, -1].float(), dim=-1)
                want.append(tok)
            assert torch.equal(got, torch.stack(want))
            assert (a.columns, a.lengths, a.next_positions) == (b.columns, b.lengths, b.next_positions)
            assert not a.ragged  # every sequence moved alike: transformers' crop still applies
            a.crop(-2)
            assert a.lengths == [n - 2 for n in b.lengths]
        finally:
            a.free()
            b.free()


def test_decode_greedy_refusals_change_nothing(llama_pair):
    model, _ = llama_pair
    ids, mask = left_padded_batch(model.config.vocab_size, (5, 3), seed=4)
    with torch.no_grad():
        cache, first = _prefilled_cache(model, ids, mask)
        try:
            state = (cache.columns, list(cache.lengths), state_of(model).runner.pool.num_used_pages)
            for tokens, steps, match in [
                (first, 0, "steps >= 1"),
                (first, True, "steps >= 1"),
                (first[:1], 2, "one token per sequence"),
                (first.float(), 2, "integer token ids"),
            ]:
                with pytest.raises(InputError, match=match):
                    cache.decode_greedy(tokens, steps)
                assert (cache.columns, cache.lengths, state_of(model).runner.pool.num_used_pages) == state
        finally:
            cache.free()


def _eos_from_reference(reference, ids, mask, seq: int, step: int) -> int:
    with torch.no_grad():
        out = reference.generate(ids, attention_mask=mask, max_new_tokens=step + 1, do_sample=False, pad_token_id=PAD,
                                 eos_token_id=None)  # fmt: skip
    return int(out[seq, ids.shape[1] + step])


@pytest.mark.parametrize("seq,step", [(0, 3), (1, GREEDY_CHUNK), (2, GREEDY_CHUNK + 1), (0, 0)])
def test_generate_with_eos_inside_and_at_the_edge_of_chunks_matches_hf(llama_pair, monkeypatch, seq, step):
    model, reference = llama_pair
    ids, mask = left_padded_batch(model.config.vocab_size, (11, 6, 8), seed=5)
    eos = _eos_from_reference(reference, ids, mask, seq, step)
    calls = []
    original = PagedCache.decode_greedy
    monkeypatch.setattr(PagedCache, "decode_greedy", lambda self, t, k: calls.append(k) or original(self, t, k))
    kw = dict(attention_mask=mask, max_new_tokens=3 * GREEDY_CHUNK + 3, do_sample=False, pad_token_id=PAD, eos_token_id=eos)
    got = model.generate(ids, **kw)
    with torch.no_grad():
        want = reference.generate(ids, **kw)
    assert torch.equal(got, want), (got, want)
    assert calls and set(calls) <= {GREEDY_CHUNK, 4, 2, 1}
    assert state_of(model).runner.pool.num_used_pages == 0


def test_generate_where_every_sequence_stops_early_is_cut_like_hf(llama_pair, monkeypatch):
    model, reference = llama_pair
    ids, mask = left_padded_batch(model.config.vocab_size, (7,), seed=6)
    eos = _eos_from_reference(reference, ids, mask, 0, 5)
    kw = dict(attention_mask=mask, max_new_tokens=4 * GREEDY_CHUNK, do_sample=False, pad_token_id=PAD, eos_token_id=eos)
    got = model.generate(ids, **kw)
    with torch.no_grad():
        want = reference.generate(ids, **kw)
    assert torch.equal(got, want) and got.shape[1] < ids.shape[1] + 4 * GREEDY_CHUNK


def test_a_logits_processor_keeps_the_step_at_a_time_loop(llama_pair, monkeypatch):
    model, reference = llama_pair
    ids, mask = left_padded_batch(model.config.vocab_size, (6, 9), seed=7)
    monkeypatch.setattr(PagedCache, "decode_greedy", lambda *a: pytest.fail("greedy chunks with a processor"))
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=PAD, repetition_penalty=1.5)
    got = model.generate(ids, **kw)
    with torch.no_grad():
        want = reference.generate(ids, **kw)
    assert torch.equal(got, want)
