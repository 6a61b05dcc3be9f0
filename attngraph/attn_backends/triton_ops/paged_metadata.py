"""Paged-KV metadata in FlashInfer's CSR form, built on the device from the request-to-page table.

FlashInfer's paged kernels read a batch's KV through three arrays (B = batch size):

* ``kv_indptr: [B + 1]`` int32, ``kv_indptr[i] = sum_{j < i} ceil(seq_lens[j] / page_size)``;
* ``kv_indices: [kv_indptr[B]]`` int32, the pages of request ``i`` in order at
  ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]`` (a gather of its ``req_to_page`` row);
* ``kv_last_page_len: [B]`` int32, ``(seq_len - 1) % page_size + 1`` (0 for an empty request,
  so that FlashInfer's ``(num_pages - 1) * page_size + last_page_len`` gives back ``seq_len``).

`build_paged_kv_metadata` fills all three with ONE Triton launch (grid ``(B,)``): each program
computes its own ``kv_indptr`` entry as a prefix sum over the earlier requests (B is at most a
few hundred, so the O(B^2 / BLOCK) loads are negligible next to a launch), then copies its page
row. No host sync, static grid for a given B, no allocation when the outputs are given: it can
be recorded into a CUDA graph and replayed with new ``seq_lens`` / ``req_pool_indices``.

`host_paged_kv_lengths` is the host-side twin for the planner (FlashInfer's ``plan()`` wants
indptr and last-page lengths on the host; computing them from ``seq_lens_cpu`` avoids a
device-to-host copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Pages copied per loop iteration of one program; prefix-sum block over earlier requests.
_BLOCK_PAGES = 128
_BLOCK_REQS = 128


@triton.jit
def _paged_kv_metadata_kernel(
    req_to_page_ptr,  # [max_requests, max_pages_per_req] int32
    req_to_page_stride,  # row stride of req_to_page, in elements
    req_pool_indices_ptr,  # [B] int32/int64: row of each request
    seq_lens_ptr,  # [B] int32/int64: KV length of each request
    kv_indptr_ptr,  # out [B + 1] int32
    kv_indices_ptr,  # out [>= total pages] int32
    kv_last_page_len_ptr,  # out [B] int32
    page_size,
    BLOCK_PAGES: tl.constexpr,
    BLOCK_REQS: tl.constexpr,
):
    pid = tl.program_id(0)

    # Start of this request's pages = sum of ceil(seq_len / page_size) over requests 0..pid-1.
    start = (pid * 0).to(tl.int64)
    for off in range(0, pid, BLOCK_REQS):
        idx = off + tl.arange(0, BLOCK_REQS)
        lens = tl.load(seq_lens_ptr + idx, mask=idx < pid, other=0).to(tl.int64)
        start += tl.sum((lens + page_size - 1) // page_size, axis=0)

    seq_len = tl.load(seq_lens_ptr + pid).to(tl.int64)
    num_pages = (seq_len + page_size - 1) // page_size
    row = tl.load(req_pool_indices_ptr + pid).to(tl.int64)
    src = req_to_page_ptr + row * req_to_page_stride
    dst = kv_indices_ptr + start
    for off in range(0, num_pages, BLOCK_PAGES):
        idx = off + tl.arange(0, BLOCK_PAGES)
        m = idx < num_pages
        pages = tl.load(src + idx, mask=m, other=0)
        tl.store(dst + idx, pages.to(tl.int32), mask=m)

    tl.store(kv_indptr_ptr + pid + 1, (start + num_pages).to(tl.int32))
    if pid == 0:
        tl.store(kv_indptr_ptr, (pid * 0).to(tl.int32))
    last = tl.where(seq_len > 0, (seq_len - 1) % page_size + 1, 0)
    tl.store(kv_last_page_len_ptr + pid, last.to(tl.int32))


def build_paged_kv_metadata(
    req_to_page: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    kv_indptr: torch.Tensor | None = None,
    kv_indices: torch.Tensor | None = None,
    kv_last_page_len: torch.Tensor | None = None,
    total_pages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fill FlashInfer's paged metadata for a batch on ``req_to_page``'s device.

    Parameters
    ----------
    req_to_page: ``[max_requests, max_pages_per_req]`` int32, page ids of each request row.
    req_pool_indices: ``[B]`` int, row of each request in ``req_to_page``.
    seq_lens: ``[B]`` int, KV length of each request (0 allowed: no pages, last length 0).
    page_size: tokens per page.
    kv_indptr: out ``[>= B + 1]`` int32 (its first ``B + 1`` entries are written).
    kv_indices: out ``[>= total pages]`` int32 (only the first ``kv_indptr[B]`` are written).
    kv_last_page_len: out ``[>= B]`` int32.
    total_pages: size to allocate ``kv_indices`` with when it is not given (the caller knows it
        from the host copy of the lengths; this function never reads lengths back to the host).

    Returns
    -------
    ``(kv_indptr[:B + 1], kv_indices, kv_last_page_len[:B])``.
    """
    bsz = int(req_pool_indices.shape[0])
    device = req_to_page.device
    if seq_lens.shape[0] != bsz:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries, req_pool_indices {bsz}")
    if req_to_page.dtype != torch.int32 or req_to_page.stride(1) != 1:
        raise ValueError("req_to_page must be a row-contiguous int32 tensor")
    if kv_indices is None:
        if total_pages is None:
            raise ValueError("give kv_indices or total_pages (the size is not read back from the device)")
        kv_indices = torch.empty(max(int(total_pages), 1), dtype=torch.int32, device=device)
    if kv_indptr is None:
        kv_indptr = torch.empty(bsz + 1, dtype=torch.int32, device=device)
    if kv_last_page_len is None:
        kv_last_page_len = torch.empty(max(bsz, 1), dtype=torch.int32, device=device)
    for name, t, need in (("kv_indptr", kv_indptr, bsz + 1), ("kv_last_page_len", kv_last_page_len, bsz)):
        if t.dtype != torch.int32 or t.shape[0] < need or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32 tensor with >= {need} entries")
    if kv_indices.dtype != torch.int32 or not kv_indices.is_contiguous():
        raise ValueError("kv_indices must be a contiguous int32 tensor")
    if bsz == 0:
        kv_indptr[:1].zero_()
        return kv_indptr[:1], kv_indices, kv_last_page_len[:0]
    _paged_kv_metadata_kernel[(bsz,)](
        req_to_page,
        req_to_page.stride(0),
        req_pool_indices,
        seq_lens,
        kv_indptr,
        kv_indices,
        kv_last_page_len,
        page_size,
        BLOCK_PAGES=_BLOCK_PAGES,
        BLOCK_REQS=_BLOCK_REQS,
    )
    return kv_indptr[: bsz + 1], kv_indices, kv_last_page_len[:bsz]


def host_paged_kv_lengths(seq_lens_cpu: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Host twin of the kernel's lengths: ``(kv_indptr [B + 1], kv_last_page_len [B], total_pages)``.

    ``seq_lens_cpu: [B]`` host ints. Both outputs are int32 host tensors, equal to what
    `build_paged_kv_metadata` writes on the device for the same lengths.
    """
    lens = seq_lens_cpu.to(torch.int64)
    pages = (lens + page_size - 1) // page_size
    indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(pages, 0, out=indptr[1:])
    last = torch.where(lens > 0, (lens - 1) % page_size + 1, torch.zeros_like(lens))
    return indptr.to(torch.int32), last.to(torch.int32), int(indptr[-1])
