"""`ForwardBatch`: everything one model step needs to know about the requests in it.

The token axis is ragged: the new tokens of all requests are concatenated,
request ``i`` owning ``qo_indptr[i]:qo_indptr[i+1]``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .host_copy import to_device

if TYPE_CHECKING:
    from .runtime.kv_pool import KVPool


class ForwardMode(enum.Enum):
    """What a step does. EXTEND: every request adds >= 1 new tokens after a (possibly empty)
    cached prefix. DECODE: every request adds exactly one token. MIXED: both kinds in one
    batch (handled as EXTEND by the kernels). IDLE: no tokens."""

    EXTEND = "extend"
    DECODE = "decode"
    MIXED = "mixed"
    IDLE = "idle"

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    @property
    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)


@dataclass
class ForwardBatch:
    """One step's batch.

    Attributes (B = batch_size requests, T = num_tokens new tokens)
    ----------
    mode: ForwardMode.
    input_ids: ``[T]`` int64, device.
    positions: ``[T]`` int64, device; position of each new token in its request.
    req_pool_indices: ``[B]`` int32, device; row of each request in ``kv_pool.req_to_page``.
    seq_lens: ``[B]`` int32, device; KV length of each request *after* this step
        (cached prefix + new tokens).
    seq_lens_cpu: ``[B]`` int32, host copy of ``seq_lens``.
    extend_seq_lens: ``[B]`` int32, device; new tokens per request (1 for DECODE).
    extend_seq_lens_cpu: host copy.
    extend_prefix_lens: ``[B]`` int32, device; cached tokens before this step.
    extend_prefix_lens_cpu: host copy.
    qo_indptr: ``[B + 1]`` int32, device; exclusive prefix sum of ``extend_seq_lens``.
    out_cache_loc: ``[T]`` int64, device; KV slot of each new token,
        ``slot = page * page_size + offset`` into the pool's flattened ``[num_pages * page_size]``.
    kv_pool: the `KVPool` holding K/V of every layer and the request-to-page table.
    static_max_extend_len: set on the static batch of a captured extend graph: an upper bound
        on every request's new tokens that stays fixed for the graph's life (its token count),
        by which kernels size grids that would otherwise follow ``max_extend_len``.
    """

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    extend_seq_lens: torch.Tensor
    extend_seq_lens_cpu: torch.Tensor
    extend_prefix_lens: torch.Tensor
    extend_prefix_lens_cpu: torch.Tensor
    qo_indptr: torch.Tensor
    out_cache_loc: torch.Tensor
    kv_pool: "KVPool"
    static_max_extend_len: int | None = None

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens_cpu.max()) if self.batch_size else 0

    @property
    def max_extend_len(self) -> int:
        return int(self.extend_seq_lens_cpu.max()) if self.batch_size else 0

    @classmethod
    def build(
        cls,
        kv_pool: "KVPool",
        req_pool_indices: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        mode: ForwardMode | None = None,
    ) -> "ForwardBatch":
        """Build a batch for requests whose pages already cover ``prefix + extend`` tokens.

        ``input_ids``: ``[sum(extend_lens)]``. ``positions`` defaults to
        ``prefix_len + arange(extend_len)`` per request. ``mode`` defaults to DECODE when every
        request adds one token to a non-empty prefix, else EXTEND (IDLE for no requests).
        """
        device = kv_pool.device
        bsz = len(req_pool_indices)
        if not (len(prefix_lens) == len(extend_lens) == bsz):
            raise ValueError("req_pool_indices, prefix_lens and extend_lens must have one entry per request")
        if mode is None:
            if bsz == 0:
                mode = ForwardMode.IDLE
            elif all(e == 1 for e in extend_lens) and all(p > 0 for p in prefix_lens):
                mode = ForwardMode.DECODE
            else:
                mode = ForwardMode.EXTEND
        prefix_cpu = torch.tensor(prefix_lens, dtype=torch.int32)
        extend_cpu = torch.tensor(extend_lens, dtype=torch.int32)
        seq_cpu = prefix_cpu + extend_cpu
        qo_indptr_cpu = torch.zeros(bsz + 1, dtype=torch.int32)
        qo_indptr_cpu[1:] = torch.cumsum(extend_cpu, 0)
        if positions is None:
            positions = torch.cat(
                [torch.arange(p, p + e, dtype=torch.int64) for p, e in zip(prefix_lens, extend_lens)]
            ) if bsz else torch.zeros(0, dtype=torch.int64)
        rows = torch.tensor(req_pool_indices, dtype=torch.int32)
        out_cache_loc = kv_pool.slots_for(rows, prefix_cpu, extend_cpu)
        return cls(
            mode=mode,
            input_ids=to_device(input_ids, device),
            positions=to_device(positions, device, torch.int64),
            req_pool_indices=to_device(rows, device),
            seq_lens=to_device(seq_cpu, device),
            seq_lens_cpu=seq_cpu,
            extend_seq_lens=to_device(extend_cpu, device),
            extend_seq_lens_cpu=extend_cpu,
            extend_prefix_lens=to_device(prefix_cpu, device),
            extend_prefix_lens_cpu=prefix_cpu,
            qo_indptr=to_device(qo_indptr_cpu, device),
            out_cache_loc=out_cache_loc,
            kv_pool=kv_pool,
        )

    @classmethod
    def decode(
        cls,
        kv_pool: "KVPool",
        req_pool_indices: list[int],
        prefix_lens: list[int],
        input_ids: torch.Tensor,
        positions: list[int] | None = None,
    ) -> "ForwardBatch":
        """A DECODE batch (one new token per request after ``prefix_lens`` cached ones), built
        with plain host arithmetic and two host-to-device copies: the per-step hot path.

        ``input_ids: [B]`` may stay on the device (it is never read on the host).
        ``positions`` (host ints, default ``prefix_lens``): the tokens' RoPE / learned positions
        when they differ from the count of cached tokens (user ``position_ids``).
        """
        ps = kv_pool.page_size
        b = len(req_pool_indices)
        seq = [n + 1 for n in prefix_lens]
        # int32 fields packed: req_pool_indices | seq_lens | extend (ones) | prefix | qo_indptr
        ints = torch.tensor(
            list(req_pool_indices) + seq + [1] * b + list(prefix_lens) + list(range(b + 1)), dtype=torch.int32
        )
        # int64 fields packed: positions | out_cache_loc (the new token's slot: its page from
        # the host copy of the page table, gathered for all requests at once)
        longs = torch.empty(2 * b, dtype=torch.int64)
        prefix = ints[3 * b : 4 * b].long()
        longs[:b] = prefix if positions is None else torch.tensor(positions, dtype=torch.int64)
        pages = kv_pool.req_to_page_cpu[ints[:b].long(), prefix // ps]
        torch.add(prefix % ps, pages.long(), alpha=ps, out=longs[b:])
        ints_d = to_device(ints, kv_pool.device)
        longs_d = to_device(longs, kv_pool.device)
        return cls(
            mode=ForwardMode.DECODE,
            input_ids=to_device(input_ids, kv_pool.device),
            positions=longs_d[:b],
            req_pool_indices=ints_d[:b],
            seq_lens=ints_d[b : 2 * b],
            seq_lens_cpu=ints[b : 2 * b],
            extend_seq_lens=ints_d[2 * b : 3 * b],
            extend_seq_lens_cpu=ints[2 * b : 3 * b],
            extend_prefix_lens=ints_d[3 * b : 4 * b],
            extend_prefix_lens_cpu=ints[3 * b : 4 * b],
            qo_indptr=ints_d[4 * b :],
            out_cache_loc=longs_d[b:],
            kv_pool=kv_pool,
        )
