"""`build_paged_kv_metadata` (Triton; interpreter on CPU) against a plain Python construction."""

import os

import torch

if not torch.cuda.is_available():
    # The kernel module reads this when its @triton.jit runs, so set it before importing it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from attngraph.attn_backends.triton_ops.paged_metadata import (  # noqa: E402
    build_paged_kv_metadata,
    host_paged_kv_lengths,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POISON = -7


def python_metadata(req_to_page: torch.Tensor, rows: list[int], lens: list[int], page_size: int):
    """The three arrays built element by element from their definitions."""
    indptr, indices, last = [0], [], []
    for row, n in zip(rows, lens):
        pages = -(-n // page_size)
        indices += [int(req_to_page[row, j]) for j in range(pages)]
        indptr.append(indptr[-1] + pages)
        last.append(0 if n == 0 else (n - 1) % page_size + 1)
    return indptr, indices, last


def random_case(gen: torch.Generator, page_size: int, bsz: int, max_len: int, max_requests: int = 40):
    max_pages = -(-max_len // page_size)
    # Distinct random page ids per row, so a wrong row or offset shows up as a wrong value.
    req_to_page = torch.randint(1, 10_000, (max_requests, max_pages), generator=gen, dtype=torch.int32)
    rows = torch.randperm(max_requests, generator=gen)[:bsz].tolist()
    lens = torch.randint(1, max_len + 1, (bsz,), generator=gen).tolist()
    return req_to_page, rows, lens


def run_kernel(req_to_page, rows, lens, page_size, total_pages, extra=5):
    """Kernel outputs in poisoned buffers larger than needed; returns full buffers."""
    bsz = len(rows)
    indptr = torch.full((bsz + 1 + extra,), POISON, dtype=torch.int32, device=DEVICE)
    indices = torch.full((total_pages + extra,), POISON, dtype=torch.int32, device=DEVICE)
    last = torch.full((bsz + extra,), POISON, dtype=torch.int32, device=DEVICE)
    build_paged_kv_metadata(
        req_to_page.to(DEVICE),
        torch.tensor(rows, dtype=torch.int32, device=DEVICE),
        torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        page_size,
        kv_indptr=indptr,
        kv_indices=indices,
        kv_last_page_len=last,
    )
    return indptr.cpu(), indices.cpu(), last.cpu()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_python_construction(page_size, seed):
    gen = torch.Generator().manual_seed(1000 * page_size + seed)
    bsz = [1, 7, 130][seed]  # 130 > one 128-request prefix-sum block
    max_len = 300 if page_size == 1 else 1000  # > 128 pages per request at page_size 1
    req_to_page, rows, lens = random_case(gen, page_size, bsz, max_len, max_requests=bsz + 20)
    # Lengths that are not multiples of the page size, plus exact multiples.
    lens[0] = page_size * 3 + (1 if page_size > 1 else 0)
    if bsz > 1:
        lens[1] = page_size * 2
    want_indptr, want_indices, want_last = python_metadata(req_to_page, rows, lens, page_size)
    total = want_indptr[-1]

    indptr, indices, last = run_kernel(req_to_page, rows, lens, page_size, total)

    assert indptr[: bsz + 1].tolist() == want_indptr
    assert indices[:total].tolist() == want_indices
    assert last[:bsz].tolist() == want_last
    # Nothing written past the batch.
    assert (indptr[bsz + 1 :] == POISON).all()
    assert (indices[total:] == POISON).all()
    assert (last[bsz:] == POISON).all()

    h_indptr, h_last, h_total = host_paged_kv_lengths(torch.tensor(lens, dtype=torch.int32), page_size)
    assert h_indptr.tolist() == want_indptr and h_last.tolist() == want_last and h_total == total


def test_empty_request_and_allocation():
    """seq_len 0: no pages, last length 0 (FlashInfer's get_seq_lens gives back 0)."""
    page_size = 4
    req_to_page = torch.arange(1, 1 + 5 * 8, dtype=torch.int32).view(5, 8)
    rows, lens = [3, 1, 4], [5, 0, 4]
    indptr, indices, last = build_paged_kv_metadata(
        req_to_page.to(DEVICE),
        torch.tensor(rows, dtype=torch.int64, device=DEVICE),
        torch.tensor(lens, dtype=torch.int64, device=DEVICE),
        page_size,
        total_pages=3,
    )
    want_indptr, want_indices, want_last = python_metadata(req_to_page, rows, lens, page_size)
    assert indptr.cpu().tolist() == want_indptr == [0, 2, 2, 3]
    assert indices.cpu().tolist() == want_indices
    assert last.cpu().tolist() == want_last == [1, 0, 4]
    assert host_paged_kv_lengths(torch.tensor(lens), page_size)[1].tolist() == [1, 0, 4]


def test_empty_batch_and_bad_args():
    req_to_page = torch.zeros((2, 4), dtype=torch.int32, device=DEVICE)
    empty = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    indptr, indices, last = build_paged_kv_metadata(req_to_page, empty, empty, 16, total_pages=0)
    assert indptr.cpu().tolist() == [0] and last.numel() == 0
    with pytest.raises(ValueError, match="total_pages"):
        build_paged_kv_metadata(req_to_page, empty, empty, 16)
    with pytest.raises(ValueError, match="int32"):
        build_paged_kv_metadata(req_to_page.long(), empty, empty, 16, total_pages=0)


def test_with_kv_pool_table():
    """The real KVPool table: pages reserved in steps, metadata for a subset of rows."""
    from attngraph.runtime.kv_pool import KVPool

    pool = KVPool(
        num_layers=1, num_kv_heads=1, head_dim=8, num_pages=64, page_size=16,
        dtype=torch.float32, device=DEVICE, max_requests=6, max_context_len=256,
    )
    rows = [pool.alloc_request() for _ in range(4)]
    pool.reserve(rows, [17, 1, 40, 16])
    pool.reserve(rows[:2], [100, 33])  # grow after others: pages are no longer contiguous per row
    lens = [100, 33, 40, 16]
    want_indptr, want_indices, want_last = python_metadata(pool.req_to_page_cpu, rows, lens, 16)
    indptr, indices, last = run_kernel(pool.req_to_page, rows, lens, 16, want_indptr[-1])
    assert indptr[:5].tolist() == want_indptr
    assert indices[: want_indptr[-1]].tolist() == want_indices
    assert last[:4].tolist() == want_last
