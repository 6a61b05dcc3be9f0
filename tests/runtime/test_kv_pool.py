"""KVPool: rows, pages, all-or-nothing `reserve`, slot addressing and K/V writes (CPU)."""

from __future__ import annotations

import math
import random
import re

import pytest
import torch

from attngraph.errors import KVCacheFullError
from attngraph.runtime.kv_pool import DUMMY_PAGE, KVPool


def make_pool(num_pages=16, page_size=4, max_requests=4, max_context_len=64, num_layers=1,
              num_kv_heads=2, head_dim=8, v_head_dim=None) -> KVPool:
    return KVPool(
        num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, num_pages=num_pages,
        page_size=page_size, dtype=torch.float32, device="cpu", max_requests=max_requests,
        max_context_len=max_context_len, v_head_dim=v_head_dim,
    )


def snapshot(pool: KVPool) -> dict:
    """Everything `reserve` / `alloc_request` could change."""
    return dict(
        free=pool.num_free_pages,
        used=pool.num_used_pages,
        active=pool.num_active_requests,
        free_list=list(pool._free_pages),
        free_rows=list(pool._free_rows),
        row_pages=dict(pool._row_pages),
        table=pool.req_to_page.clone(),
        table_cpu=pool.req_to_page_cpu.clone(),
    )


def assert_same_state(pool: KVPool, before: dict) -> None:
    after = snapshot(pool)
    for key in ("free", "used", "active", "free_list", "free_rows", "row_pages"):
        assert after[key] == before[key], key
    assert torch.equal(after["table"], before["table"])
    assert torch.equal(after["table_cpu"], before["table_cpu"])


def held_pages(pool: KVPool, row: int) -> list[int]:
    return pool.req_to_page_cpu[row, : pool.pages_of(row)].tolist()


# ---------------------------------------------------------------------------- alloc / free


def test_alloc_reserve_free_roundtrip():
    pool = make_pool(num_pages=20, page_size=4, max_requests=4, max_context_len=64)
    start = (pool.num_used_pages, pool.num_free_pages, pool.num_active_requests)
    assert start == (0, 20, 0)
    assert pool.capacity_tokens() == 80

    rows = [pool.alloc_request() for _ in range(3)]
    assert len(set(rows)) == 3 and all(0 <= r < 4 for r in rows)
    assert pool.num_active_requests == 3
    assert pool.num_used_pages == 0  # a fresh row holds no pages
    assert all(pool.pages_of(r) == 0 for r in rows)

    pool.reserve(rows, [1, 4, 9])  # 1 + 1 + 3 pages
    assert [pool.pages_of(r) for r in rows] == [1, 1, 3]
    assert pool.num_used_pages == 5 and pool.num_free_pages == 15

    # Growing only adds the missing pages and keeps the old ones in place.
    old = held_pages(pool, rows[2])
    pool.reserve([rows[2]], [13])
    assert pool.pages_of(rows[2]) == 4
    assert held_pages(pool, rows[2])[:3] == old
    assert pool.num_used_pages == 6

    # Reserving fewer tokens than held never shrinks; reserving 0 tokens is a no-op.
    pool.reserve(rows, [0, 2, 5])
    assert [pool.pages_of(r) for r in rows] == [1, 1, 4]
    assert pool.num_used_pages == 6

    for r in rows:
        pool.free_request(r)
    assert (pool.num_used_pages, pool.num_free_pages, pool.num_active_requests) == start
    assert torch.count_nonzero(pool.req_to_page_cpu) == 0
    pool.free_request(rows[0])  # freeing an unknown / already freed row is a no-op
    assert (pool.num_used_pages, pool.num_free_pages, pool.num_active_requests) == start

    # Every row and page can be taken again.
    rows = [pool.alloc_request() for _ in range(4)]
    pool.reserve(rows, [20, 20, 20, 20])
    assert pool.num_free_pages == 0
    assert sorted(p for r in rows for p in held_pages(pool, r)) == list(range(1, 21))
    for r in rows:
        pool.free_request(r)
    assert (pool.num_used_pages, pool.num_free_pages, pool.num_active_requests) == start


def test_dummy_page_is_never_allocated():
    for page_size in (1, 3, 16):
        pool = make_pool(num_pages=11, page_size=page_size, max_requests=11, max_context_len=11 * page_size)
        rows = [pool.alloc_request() for _ in range(11)]
        pool.reserve(rows, [page_size] * 11)  # one page each: every page handed out
        pages = [p for r in rows for p in held_pages(pool, r)]
        assert DUMMY_PAGE == 0
        assert sorted(pages) == list(range(1, 12))
        assert pool.num_free_pages == 0
        before = snapshot(pool)
        with pytest.raises(KVCacheFullError):
            pool.reserve([rows[0]], [page_size + 1])
        assert_same_state(pool, before)
        # Churn a bit: page 0 still never appears.
        for r in rows[::2]:
            pool.free_request(r)
        rows2 = [pool.alloc_request() for _ in range(6)]
        pool.reserve(rows2, [1] * 6)
        assert all(DUMMY_PAGE not in held_pages(pool, r) for r in rows2 + rows[1::2])
    # The buffers do hold the dummy page, in front of the real ones.
    pool = make_pool(num_pages=5, page_size=3, num_kv_heads=2, head_dim=8, v_head_dim=6)
    assert pool.k_buffers[0].shape == (6, 3, 2, 8)
    assert pool.v_buffers[0].shape == (6, 3, 2, 6)


# ---------------------------------------------------------------------------- errors


def test_reserve_is_all_or_nothing():
    pool = make_pool(num_pages=10, page_size=4, max_requests=4, max_context_len=64)
    a, b, c = (pool.alloc_request() for _ in range(3))
    pool.reserve([a, b], [5, 4])  # 2 + 1 pages, 7 free
    before = snapshot(pool)
    # a: 5 -> 12 tokens (+1 page), b: 4 -> 20 (+4), c: 0 -> 9 (+3): 8 pages needed, 7 free.
    # The first two alone would fit: a half-done reserve would have given them pages.
    with pytest.raises(KVCacheFullError) as info:
        pool.reserve([a, b, c], [12, 20, 9])
    msg = str(info.value)
    # 8 pages / 32 tokens needed, 7 of 10 pages free, page_size 4
    assert {"8", "32", "7", "10", "4"} <= set(re.findall(r"\d+", msg)), msg
    assert "kv_cache_tokens" in msg and "kv_memory_fraction" in msg
    assert_same_state(pool, before)

    # The free list is untouched, so the reserve that fits afterwards gets the same pages it
    # would have got without the failure.
    twin = make_pool(num_pages=10, page_size=4, max_requests=4, max_context_len=64)
    ta, tb, tc = (twin.alloc_request() for _ in range(3))
    twin.reserve([ta, tb], [5, 4])
    pool.reserve([a, b, c], [12, 20, 5])
    twin.reserve([ta, tb, tc], [12, 20, 5])
    assert torch.equal(pool.req_to_page_cpu, twin.req_to_page_cpu)
    assert torch.equal(pool.req_to_page, twin.req_to_page)
    assert pool.num_free_pages == 0


def test_reserve_exactly_full_succeeds():
    pool = make_pool(num_pages=6, page_size=3)
    rows = [pool.alloc_request() for _ in range(2)]
    pool.reserve(rows, [9, 9])  # 3 + 3 pages = all of them
    assert pool.num_free_pages == 0 and pool.num_used_pages == 6


def test_max_context_len():
    pool = make_pool(num_pages=40, page_size=4, max_requests=4, max_context_len=30)
    assert pool.max_pages_per_req == 8
    assert pool.req_to_page.shape == (5, 8)  # + the padding row of CUDA-graph batches
    assert pool.pad_row == 4
    a, b = pool.alloc_request(), pool.alloc_request()
    pool.reserve([a], [30])  # exactly max_context_len is fine
    assert pool.pages_of(a) == 8
    before = snapshot(pool)
    with pytest.raises(KVCacheFullError) as info:
        pool.reserve([b, a], [3, 31])  # b alone would fit; nothing may happen
    assert "max_context_len" in str(info.value)
    assert {"31", "30"} <= set(re.findall(r"\d+", str(info.value))), str(info.value)
    assert_same_state(pool, before)


def test_max_requests():
    pool = make_pool(num_pages=8, page_size=4, max_requests=3)
    rows = [pool.alloc_request() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2]
    before = snapshot(pool)
    with pytest.raises(KVCacheFullError) as info:
        pool.alloc_request()
    assert "max_requests" in str(info.value)
    assert "3" in re.findall(r"\d+", str(info.value)), str(info.value)
    assert_same_state(pool, before)
    pool.free_request(rows[1])
    assert pool.alloc_request() == rows[1]


def test_reserve_unknown_row_changes_nothing():
    pool = make_pool(num_pages=8, page_size=4, max_requests=3)
    a = pool.alloc_request()
    before = snapshot(pool)
    with pytest.raises(ValueError):
        pool.reserve([a, 2], [4, 4])
    assert_same_state(pool, before)


def test_device_table_mirrors_host_table_after_free():
    pool = make_pool(num_pages=8, page_size=4, max_requests=2, max_context_len=32)
    r = pool.alloc_request()
    pool.reserve([r], [9])  # pages 1, 2, 3
    pool.free_request(r)
    r2 = pool.alloc_request()  # the same row, holding no pages yet
    assert r2 == r
    assert torch.equal(pool.req_to_page_cpu[r], torch.zeros(pool.max_pages_per_req, dtype=torch.int32))
    assert torch.equal(pool.req_to_page.cpu(), pool.req_to_page_cpu)  # device row still [1, 2, 3, 0...]


# ---------------------------------------------------------------------------- addressing


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_slots_for_matches_table(page_size):
    rng = random.Random(100 + page_size)
    max_ctx = 70
    pool = make_pool(num_pages=math.ceil(6 * max_ctx / page_size) + 4, page_size=page_size,
                     max_requests=8, max_context_len=max_ctx)
    for trial in range(6):
        rows = [pool.alloc_request() for _ in range(rng.randint(1, 6))]
        rng.shuffle(rows)
        prefix = [rng.choice([0, rng.randint(0, max_ctx // 2)]) for _ in rows]
        extend = [rng.choice([0, 1, rng.randint(1, max_ctx // 2)]) for _ in rows]
        # Grow in a few interleaved steps so pages of a request are scattered in the pool.
        for frac in (0.3, 0.7, 1.0):
            pool.reserve(rows, [int(frac * (p + e)) for p, e in zip(prefix, extend)])
        pool.reserve(rows, [p + e for p, e in zip(prefix, extend)])

        slots = pool.slots_for(torch.tensor(rows, dtype=torch.int32), torch.tensor(prefix, dtype=torch.int32),
                               torch.tensor(extend, dtype=torch.int32))
        table = pool.req_to_page_cpu.tolist()
        expected = [
            table[r][pos // page_size] * page_size + pos % page_size
            for r, p, e in zip(rows, prefix, extend)
            for pos in range(p, p + e)
        ]
        assert slots.dtype == torch.int64
        assert slots.tolist() == expected
        assert len(set(expected)) == len(expected)
        assert all(s // page_size != DUMMY_PAGE for s in expected)
        dev = pool.req_to_page.tolist()
        assert expected == [
            dev[r][pos // page_size] * page_size + pos % page_size
            for r, p, e in zip(rows, prefix, extend)
            for pos in range(p, p + e)
        ]
        for r in rows:
            pool.free_request(r)
    assert pool.num_used_pages == 0 and pool.num_active_requests == 0


def test_slots_for_empty_batch():
    pool = make_pool()
    empty = torch.zeros(0, dtype=torch.int32)
    slots = pool.slots_for(empty, empty, empty)
    assert slots.shape == (0,) and slots.dtype == torch.int64


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_write_stores_where_slots_for_says(page_size):
    torch.manual_seed(page_size)
    rng = random.Random(page_size)
    hkv, d, dv = 2, 8, 5
    pool = make_pool(num_pages=math.ceil(200 / page_size) + 2, page_size=page_size, max_requests=4,
                     max_context_len=50, num_layers=3, num_kv_heads=hkv, head_dim=d, v_head_dim=dv)
    for buf in pool.k_buffers + pool.v_buffers:
        buf.copy_(torch.randn_like(buf) * 100)
    k_before = [b.clone() for b in pool.k_buffers]
    v_before = [b.clone() for b in pool.v_buffers]

    rows = [pool.alloc_request() for _ in range(3)]
    prefix = [rng.randint(0, 20) for _ in rows]
    extend = [rng.randint(1, 25) for _ in rows]
    pool.reserve(rows[::-1], [(p + e) // 2 for p, e in zip(prefix, extend)][::-1])  # scatter pages
    pool.reserve(rows, [p + e for p, e in zip(prefix, extend)])
    slots = pool.slots_for(torch.tensor(rows), torch.tensor(prefix), torch.tensor(extend))
    t = sum(extend)
    k = torch.randn(t, hkv, d)
    v = torch.randn(t, hkv, dv)
    pool.write(1, slots, k, v)

    # Read back through the table, not through slots.
    i = 0
    written = set()
    for r, p, e in zip(rows, prefix, extend):
        for pos in range(p, p + e):
            page = int(pool.req_to_page_cpu[r, pos // page_size])
            off = pos % page_size
            assert torch.equal(pool.k_buffers[1][page, off], k[i])
            assert torch.equal(pool.v_buffers[1][page, off], v[i])
            written.add((page, off))
            i += 1
    # Nothing else changed: other slots of layer 1, and layers 0 and 2 entirely.
    mask = torch.ones(pool.num_pages + 1, page_size, dtype=torch.bool)
    for page, off in written:
        mask[page, off] = False
    assert torch.equal(pool.k_buffers[1][mask], k_before[1][mask])
    assert torch.equal(pool.v_buffers[1][mask], v_before[1][mask])
    for layer in (0, 2):
        assert torch.equal(pool.k_buffers[layer], k_before[layer])
        assert torch.equal(pool.v_buffers[layer], v_before[layer])


# ---------------------------------------------------------------------------- churn


def check_invariants(pool: KVPool, model: dict[int, int]) -> None:
    """``model``: row -> tokens reserved (max over its reserves), built without the pool."""
    ps = pool.page_size
    assert pool.num_active_requests == len(model)
    owner: dict[int, int] = {}
    total = 0
    for row, tokens in model.items():
        held = pool.pages_of(row)
        assert held == math.ceil(tokens / ps), (row, tokens, held)
        total += held
        pages = pool.req_to_page_cpu[row].tolist()
        for p in pages[:held]:
            assert 1 <= p <= pool.num_pages, p  # never the dummy page, never out of range
            assert p not in owner, f"page {p} held by rows {owner[p]} and {row}"
            owner[p] = row
        assert all(p == 0 for p in pages[held:])
        assert pool.req_to_page[row, :held].tolist() == pages[:held]
    assert pool.num_used_pages == total
    assert pool.num_free_pages == pool.num_pages - total
    assert len(set(pool._free_pages)) == len(pool._free_pages)
    assert set(pool._free_pages).isdisjoint(owner)
    assert set(pool._free_pages) | set(owner) == set(range(1, pool.num_pages + 1))
    # Free rows are exactly the rows not in use, and hold nothing on the host.
    assert set(pool._free_rows) == set(range(pool.max_requests)) - set(model)
    for row in pool._free_rows:
        assert torch.count_nonzero(pool.req_to_page_cpu[row]) == 0


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_random_churn(page_size):
    rng = random.Random(7 * page_size)
    max_ctx = 60
    num_pages = max(4, (2 * max_ctx) // page_size)  # about 2 full requests: the pool fills up often
    pool = make_pool(num_pages=num_pages, page_size=page_size, max_requests=6, max_context_len=max_ctx)
    model: dict[int, int] = {}
    raised = {"rows": 0, "pages": 0, "ctx": 0}
    for _ in range(300):
        op = rng.random()
        before = snapshot(pool)
        if op < 0.25:
            if len(model) == pool.max_requests:
                with pytest.raises(KVCacheFullError, match="max_requests"):
                    pool.alloc_request()
                assert_same_state(pool, before)
                raised["rows"] += 1
            else:
                row = pool.alloc_request()
                assert row not in model
                model[row] = 0
        elif op < 0.8 and model:
            rows = rng.sample(sorted(model), rng.randint(1, len(model)))
            # Mostly growth, sometimes a smaller (no-op) length, sometimes past max_context_len.
            lens = [min(max_ctx + 3, max(0, model[r] + rng.choice([-5, 0, 1, rng.randint(1, 30)]))) for r in rows]
            need = sum(max(0, math.ceil(n / page_size) - math.ceil(model[r] / page_size)) for r, n in zip(rows, lens))
            if any(n > max_ctx for n in lens):
                with pytest.raises(KVCacheFullError, match="max_context_len"):
                    pool.reserve(rows, lens)
                assert_same_state(pool, before)
                raised["ctx"] += 1
            elif need > pool.num_free_pages:
                with pytest.raises(KVCacheFullError, match="kv_cache_tokens"):
                    pool.reserve(rows, lens)
                assert_same_state(pool, before)
                raised["pages"] += 1
            else:
                pool.reserve(rows, lens)
                for r, n in zip(rows, lens):
                    model[r] = max(model[r], n)
        elif model:
            row = rng.choice(sorted(model))
            pool.free_request(row)
            del model[row]
        check_invariants(pool, model)
    assert all(raised.values()), raised  # every failure path was exercised
    for row in list(model):
        pool.free_request(row)
        del model[row]
        check_invariants(pool, model)
    assert pool.num_used_pages == 0 and pool.num_free_pages == num_pages and pool.num_active_requests == 0
    assert torch.count_nonzero(pool.req_to_page_cpu) == 0


# ---------------------------------------------------------------------------- truncate
def test_truncate_returns_the_pages_past_the_kept_tokens():
    pool = make_pool(num_pages=20, page_size=4, max_requests=4, max_context_len=64)
    a, b = pool.alloc_request(), pool.alloc_request()
    pool.reserve([a, b], [19, 6])  # 5 and 2 pages
    pages_a = held_pages(pool, a)
    pool.truncate(a, 9)  # keeps ceil(9 / 4) = 3 pages
    assert held_pages(pool, a) == pages_a[:3] and pool.pages_of(b) == 2
    assert pool.num_used_pages == 5
    assert not pool.req_to_page_cpu[a, 3:].any() and torch.equal(pool.req_to_page, pool.req_to_page_cpu)
    before = snapshot(pool)
    pool.truncate(a, 12)  # already within its pages: nothing changes
    assert_same_state(pool, before)
    pool.reserve([a], [20])  # grows again from the pool
    assert pool.pages_of(a) == 5
    pool.truncate(a, 0)
    assert pool.pages_of(a) == 0 and pool.num_used_pages == 2
    with pytest.raises(ValueError, match="not allocated"):
        pool.truncate(3, 1)
    with pytest.raises(ValueError, match=">= 0"):
        pool.truncate(b, -1)
    pool.free_request(a)
    pool.free_request(b)
    assert pool.num_used_pages == 0 and pool.num_free_pages == 20
