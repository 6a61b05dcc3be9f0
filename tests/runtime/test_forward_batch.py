import random

import pytest
import torch

from attngraph.forward_batch import ForwardBatch, ForwardMode
from attngraph.runtime.kv_pool import KVPool

FIELDS = [
    "input_ids", "positions", "req_pool_indices", "seq_lens", "seq_lens_cpu", "extend_seq_lens",
    "extend_seq_lens_cpu", "extend_prefix_lens", "extend_prefix_lens_cpu", "qo_indptr", "out_cache_loc",
]


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_decode_fast_path_equals_general_build(page_size):
    rng = random.Random(page_size)
    pool = KVPool(1, 1, 8, 400, page_size, torch.float32, "cpu", 16, 512)
    decoy = pool.alloc_request()
    pool.reserve([decoy], [37])  # scatter the pages of the real requests
    rows = [pool.alloc_request() for _ in range(6)]
    lens = [rng.randint(1, 60) for _ in rows]
    pool.reserve(rows, [n + 1 for n in lens])
    pool.free_request(decoy)
    tokens = torch.randint(0, 100, (6,))
    general = ForwardBatch.build(pool, rows, lens, [1] * 6, tokens)
    fast = ForwardBatch.decode(pool, rows, lens, tokens)
    assert general.mode is fast.mode is ForwardMode.DECODE
    for name in FIELDS:
        a, b = getattr(general, name), getattr(fast, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    # Positions other than the cached counts (user position_ids) change only the positions.
    shifted = [n + rng.randint(0, 9) for n in lens]
    moved = ForwardBatch.decode(pool, rows, lens, tokens, shifted)
    assert moved.positions.tolist() == shifted
    assert torch.equal(moved.out_cache_loc, general.out_cache_loc)
