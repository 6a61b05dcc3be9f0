"""`PagedCache.crop`: dropping the newest columns (rejected speculative tokens) gives the pages
back, and decoding the same tokens again after the crop gives the logits they had before."""

import pytest
import torch

from attngraph.errors import InputError
from attngraph.runtime.accelerate import state_of
from attngraph.runtime.paged_cache import PagedCache

from .test_generate import accelerated_pair, left_padded_batch


def _decode(cache: PagedCache, tokens: torch.Tensor) -> torch.Tensor:
    """Decode ``tokens: [B, k]`` one column at a time; logits ``[B, k, vocab]``."""
    return torch.cat([cache.decode_step(tokens[:, i]) for i in range(tokens.shape[1])], 1)


@pytest.mark.parametrize("page_size", [1, 4])
def test_crop_then_redecode_gives_the_same_logits(page_size):
    model, _ = accelerated_pair("llama", "sdpa", page_size=page_size)
    runner = state_of(model).runner
    pool = runner.pool
    g = torch.Generator().manual_seed(3)
    ids, mask = left_padded_batch(model.config.vocab_size, lengths=(9, 6, 11), seed=5)
    drafts = torch.randint(3, model.config.vocab_size, (3, 5), generator=g)
    redo = torch.randint(3, model.config.vocab_size, (3, 3), generator=g)
    cache = PagedCache(runner)
    try:
        with torch.no_grad():
            cache.step(ids, mask, 1)
            want = _decode(cache, drafts[:, :2])
            lengths, positions, columns = list(cache.lengths), list(cache.next_positions), cache.columns
            pages = [pool.pages_of(r) for r in cache.rows]
            _decode(cache, drafts[:, 2:])  # three more tokens, then rejected
            assert cache.columns == columns + 3
            cache.crop(columns)
            assert (cache.lengths, cache.next_positions, cache.columns) == (lengths, positions, columns)
            assert [pool.pages_of(r) for r in cache.rows] == pages  # the pages of the dropped tokens are back
            assert pool.num_used_pages == sum(pages)
            again = _decode(cache, redo)  # other tokens where the rejected ones were
            cache.crop(-3)  # negative: drop the last three columns
            assert cache.columns == columns
            fresh = PagedCache(runner)
            try:  # the same prefix never cropped: the logits after it agree
                fresh.step(ids, mask, 1)
                _decode(fresh, drafts[:, :2])
                torch.testing.assert_close(_decode(fresh, redo), again, rtol=1e-5, atol=1e-5)
            finally:
                fresh.free()
            cache.crop(ids.shape[1])  # back to the prompt
            torch.testing.assert_close(_decode(cache, drafts[:, :2]), want, rtol=1e-5, atol=1e-5)
    finally:
        cache.free()
    assert pool.num_used_pages == 0


def test_crop_into_padding_is_refused_and_changes_nothing():
    model, _ = accelerated_pair("llama", "sdpa")
    runner = state_of(model).runner
    ids, mask = left_padded_batch(model.config.vocab_size, lengths=(9, 4), seed=2)
    cache = PagedCache(runner)
    try:
        with torch.no_grad():
            cache.step(ids, mask, 1)
        state = (list(cache.lengths), list(cache.next_positions), cache.columns, runner.pool.num_used_pages)
        with pytest.raises(InputError, match="sequence 1 holds only 4 tokens"):
            cache.crop(4)  # drops 5 columns; the second sequence holds 4 tokens
        assert (list(cache.lengths), list(cache.next_positions), cache.columns, runner.pool.num_used_pages) == state
        for bad in (2.0, True, torch.tensor([3]), torch.tensor(3.0)):
            with pytest.raises(InputError, match="int number of columns"):
                cache.crop(bad)
        assert (list(cache.lengths), list(cache.next_positions), cache.columns, runner.pool.num_used_pages) == state
        cache.crop(cache.columns + 2)  # longer than the cache: nothing to drop
        cache.crop(0)  # transformers' "remove 0 tokens" (after a fully accepted draft)
        cache.crop(torch.tensor(0))  # transformers 5.17 passes the count as a 0-d tensor
        assert (list(cache.lengths), list(cache.next_positions), cache.columns, runner.pool.num_used_pages) == state
    finally:
        cache.free()
    assert runner.pool.num_used_pages == 0
