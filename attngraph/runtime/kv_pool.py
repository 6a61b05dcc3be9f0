"""`KVPool`: paged K/V storage of every layer, its page allocator and request-to-page table."""

from __future__ import annotations

import logging
import math

import torch

from ..errors import KVCacheFullError
from ..host_copy import to_device

logger = logging.getLogger(__name__)

_STORE_KV: list = []  # [triton_ops.store_kv or None], resolved at the first CUDA write


def _cuda_store_kv():
    """The Triton K/V store kernel's launcher, or None where Triton cannot be imported."""
    if not _STORE_KV:
        try:
            from ..attn_backends.triton_ops.kv_store import store_kv
        except ImportError as exc:  # a CUDA build of torch without Triton
            logger.info("K/V writes use index_copy_ (Triton unavailable: %s)", exc)
            store_kv = None
        _STORE_KV.append(store_kv)
    return _STORE_KV[0]


#: Physical page 0 is never handed out: CUDA-graph padding tokens write their K/V there.
DUMMY_PAGE = 0


class KVPool:
    """Per-layer paged K/V buffers plus the bookkeeping that maps requests to pages.

    Layout
    ------
    ``k_buffers[layer]``: ``[num_pages + 1, page_size, num_kv_heads, head_dim]`` (page 0 is the
    dummy page); ``v_buffers[layer]``: same with ``v_head_dim``. With ``value_in_key`` (MLA's
    latent cache) ``v_buffers[layer]`` is the view ``k_buffers[layer][..., :v_head_dim]``: the
    values are stored once, as the keys' first columns.
    ``req_to_page``: ``[max_requests, max_pages_per_req]`` int32 on the device; row ``r`` lists
    the pages of request ``r`` in order (unused entries hold 0). ``req_to_page_cpu`` mirrors it.
    A token at position ``p`` of request ``r`` lives at slot
    ``req_to_page[r, p // page_size] * page_size + p % page_size``.

    Allocation never half-happens: `reserve` checks the whole need first and raises
    `KVCacheFullError` before touching any state.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_requests: int,
        max_context_len: int,
        v_head_dim: int | None = None,
        value_in_key: bool = False,
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"KVPool needs num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        if value_in_key and self.v_head_dim > head_dim:
            raise ValueError(f"values in the keys need v_head_dim <= head_dim, got {self.v_head_dim} > {head_dim}")
        self.value_in_key = value_in_key
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_requests = max_requests
        self.max_context_len = max_context_len
        self.max_pages_per_req = math.ceil(max_context_len / page_size)
        shape_k = (num_pages + 1, page_size, num_kv_heads, head_dim)
        shape_v = (num_pages + 1, page_size, num_kv_heads, self.v_head_dim)
        self.k_buffers = [torch.zeros(shape_k, dtype=dtype, device=self.device) for _ in range(num_layers)]
        if value_in_key:
            self.v_buffers = [k[..., : self.v_head_dim] for k in self.k_buffers]
        else:
            self.v_buffers = [torch.zeros(shape_v, dtype=dtype, device=self.device) for _ in range(num_layers)]
        # One row more than ``max_requests``: row ``pad_row`` is never handed out and stays all
        # zeros (the dummy page), for the padding requests of CUDA-graph batches.
        self.pad_row = max_requests
        self.req_to_page = torch.zeros(
            (max_requests + 1, self.max_pages_per_req), dtype=torch.int32, device=self.device
        )
        self.req_to_page_cpu = torch.zeros((max_requests + 1, self.max_pages_per_req), dtype=torch.int32)
        # Free lists, popped from the end: lowest ids first.
        self._free_pages: list[int] = list(range(num_pages, 0, -1))
        self._free_rows: list[int] = list(range(max_requests - 1, -1, -1))
        self._row_pages: dict[int, int] = {}  # row -> pages held

    # ------------------------------------------------------------------ sizing
    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, v_head_dim: int, dtype: torch.dtype,
                        value_in_key: bool = False) -> int:  # fmt: skip
        elt = torch.empty((), dtype=dtype).element_size()
        return num_layers * num_kv_heads * (head_dim + (0 if value_in_key else v_head_dim)) * elt

    # ------------------------------------------------------------------ state
    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free_pages)

    @property
    def num_active_requests(self) -> int:
        return len(self._row_pages)

    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def pages_of(self, row: int) -> int:
        return self._row_pages[row]

    # ------------------------------------------------------------------ allocation
    def alloc_request(self) -> int:
        """A free row of the request table (holding no pages yet)."""
        if not self._free_rows:
            raise KVCacheFullError(
                f"all {self.max_requests} request slots of the KV pool are in use; "
                "raise CompileConfig.max_requests or run fewer requests at once"
            )
        row = self._free_rows.pop()
        self._row_pages[row] = 0
        return row

    def pages_needed(self, rows: list[int], new_lens: list[int]) -> int:
        need = 0
        for row, n in zip(rows, new_lens):
            need += max(0, math.ceil(n / self.page_size) - self._row_pages[row])
        return need

    def reserve(self, rows: list[int], new_lens: list[int]) -> None:
        """Grow each request ``rows[i]`` to hold ``new_lens[i]`` tokens, all or nothing.

        One pass of host arithmetic over the rows (this runs before every decode step): only
        rows that cross a page boundary touch the page table.
        """
        ps = self.page_size
        have = self._row_pages
        grow: list[tuple[int, int, int]] = []  # (row, pages held, pages wanted)
        need = 0
        for row, n in zip(rows, new_lens):
            held = have.get(row)
            if held is None:
                raise ValueError(f"request row {row} is not allocated")
            want = -(-n // ps)
            if want > held:
                grow.append((row, held, want))
                need += want - held
        longest = max(new_lens, default=0)
        if longest > self.max_context_len:
            raise KVCacheFullError(
                f"a request needs {longest} tokens of KV cache but max_context_len is "
                f"{self.max_context_len}; raise CompileConfig.max_context_len"
            )
        if not grow:
            return
        if need > len(self._free_pages):
            raise KVCacheFullError(
                f"the KV pool needs {need} more pages ({need * ps} tokens) but only "
                f"{len(self._free_pages)} of {self.num_pages} are free (page_size={ps}); "
                "raise CompileConfig.kv_cache_tokens or kv_memory_fraction, or shorten the requests"
            )
        for row, held, want in grow:
            pages = [self._free_pages.pop() for _ in range(want - held)]
            self.req_to_page_cpu[row, held:want] = torch.tensor(pages, dtype=torch.int32)
            have[row] = want
        idx = torch.tensor([row for row, _, _ in grow], dtype=torch.long)
        self.req_to_page[to_device(idx, self.device)] = to_device(self.req_to_page_cpu[idx], self.device)

    def truncate(self, row: int, num_tokens: int) -> None:
        """Keep the pages of the first ``num_tokens`` tokens of request ``row`` and return the
        rest to the pool (rejected speculative tokens, a cropped cache). The slots past
        ``num_tokens`` in the last kept page are stale until written again; attention never
        reads beyond a request's length."""
        if row not in self._row_pages:
            raise ValueError(f"request row {row} is not allocated")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        held = self._row_pages[row]
        keep = math.ceil(num_tokens / self.page_size)
        if keep >= held:
            return
        pages = self.req_to_page_cpu[row, keep:held].tolist()
        self.req_to_page_cpu[row, keep:held] = 0
        self.req_to_page[row, keep:held] = 0  # the row must not point at pages it gave back
        self._free_pages.extend(reversed(pages))
        self._row_pages[row] = keep

    def free_request(self, row: int) -> None:
        """Return the row and all its pages. Freeing an unknown row is a no-op."""
        held = self._row_pages.pop(row, None)
        if held is None:
            return
        pages = self.req_to_page_cpu[row, :held].tolist()
        self.req_to_page_cpu[row, :held] = 0
        self.req_to_page[row, :held] = 0  # a reused row must not point at pages it no longer owns
        self._free_pages.extend(reversed(pages))
        self._free_rows.append(row)

    def release(self) -> None:
        """Drop every buffer (the pool is unusable afterwards)."""
        self.k_buffers, self.v_buffers = [], []
        self.req_to_page = self.req_to_page[:0]
        self._free_pages, self._free_rows, self._row_pages = [], [], {}

    # ------------------------------------------------------------------ addressing
    def slots_for(self, rows: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor) -> torch.Tensor:
        """KV slots ``[sum(extend_lens)]`` int64 (device) of the new tokens of each request.

        ``rows``, ``prefix_lens``, ``extend_lens``: ``[B]`` host int tensors.
        """
        if rows.numel() == 0:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        row_ids = torch.repeat_interleave(rows.long(), extend_lens.long())
        starts = torch.repeat_interleave(prefix_lens.long(), extend_lens.long())
        offsets = torch.arange(row_ids.numel()) - torch.repeat_interleave(
            torch.cumsum(extend_lens.long(), 0) - extend_lens.long(), extend_lens.long()
        )
        pos = starts + offsets
        pages = self.req_to_page_cpu[row_ids, pos // self.page_size].long()
        return to_device(pages * self.page_size + pos % self.page_size, self.device)

    def write(self, layer_id: int, out_cache_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new K/V: ``k: [T, num_kv_heads, head_dim]`` at slots ``out_cache_loc: [T]``."""
        kb = self.k_buffers[layer_id].view(-1, self.num_kv_heads, self.head_dim)
        if self.value_in_key:  # v is k's first columns (the caller's contract): one write
            kb.index_copy_(0, out_cache_loc, k.to(kb.dtype))
            return
        vb = self.v_buffers[layer_id].view(-1, self.num_kv_heads, self.v_head_dim)
        if kb.is_cuda and torch.cuda.is_current_stream_capturing():
            # In a captured graph one launch for both buffers saves a kernel per layer and
            # step; run eagerly (between graph pieces) Triton's Python launcher costs more
            # host time than the two index_copy_ dispatches it replaces.
            store = _cuda_store_kv()
            if store is not None:
                store(kb, vb, out_cache_loc, k, v)
                return
        # index_copy_: one kernel per buffer with less host work than advanced-index assignment
        kb.index_copy_(0, out_cache_loc, k.to(kb.dtype))
        vb.index_copy_(0, out_cache_loc, v.to(vb.dtype))
