"""`ExtendGraphRunner`: prefill, extend and mixed steps captured whole, attention included.

For a backend whose extend attention can be recorded into a CUDA graph
(``capabilities.graph_support["extend"] == GraphSupport.FULL``), a step of up to ``N`` new
tokens replays ONE graph per token bucket ``N`` (``CompileConfig.cuda_graph_num_tokens``)
instead of a graph per piece with attention run eagerly between them: one launch from the
host instead of ``2 x layers + 1``.

Static layout of a bucket ``N`` with ``S`` request slots (`slots_for_bucket`):

* token rows ``[:n]`` are the real tokens, rows ``[n:N]`` padding (id 0, position 0, K/V
  written to slot 0 of the dummy page);
* slots ``[:b]`` are the real requests; the padding rows belong to *padding requests* on the
  pool's ``pad_row`` (no pages: its table row is the dummy page), each at most one table row
  long, attending causally over the dummy page, so every row of the graph is a real,
  finite computation that touches no request's pages;
* the remaining slots are empty requests (no new tokens; length
  ``cuda_graph_seq_len_fill_value``) that the kernels skip.

The backend sizes any grid by ``ForwardBatch.static_max_extend_len`` (``N``) rather than by
the real lengths, plans on the host before each replay (`init_forward_metadata_out_graph`)
and refreshes its device metadata inside the graph (`init_forward_metadata_in_graph`).
Logits come from the last row of each slot; those of the real requests are returned. With
``all_logits`` (a speculative target's verify steps: every new token is checked) they come
from every token row instead, ``[N, vocab]``, and those of the real tokens are returned.
A step with more requests than its bucket has slots, or above the largest bucket, is not
served here (`can_run` is False).
"""

from __future__ import annotations

import bisect
import logging

import torch

from ..errors import CaptureError
from ..forward_batch import ForwardBatch, ForwardMode
from ..forward_context import ForwardContext, use_forward_context
from ..host_copy import copy_to_device
from .graph_memory import capture_step

logger = logging.getLogger(__name__)

#: Request slots of a bucket, besides the padding requests: more requests in one step are not
#: served by the extend graphs (empty slots cost the attention kernels a program each).
MAX_GRAPH_REQUESTS = 32


def slots_for_bucket(num_tokens: int, max_requests: int, row_tokens: int) -> int:
    """Request slots of the graph of ``num_tokens`` tokens: real requests (at most
    ``min(num_tokens, max_requests, MAX_GRAPH_REQUESTS)``) plus padding requests of at most
    ``row_tokens`` tokens each, enough to cover the bucket."""
    return min(num_tokens, max_requests, MAX_GRAPH_REQUESTS) + -(-num_tokens // row_tokens)


class ExtendGraphRunner:
    """Captures and replays non-decode steps of a `ModelRunner` (see the module docstring)."""

    def __init__(self, runner, sizes: tuple[int, ...], mempool=None, debug: bool = False, all_logits: bool = False,
                 backend=None) -> None:  # fmt: skip
        self.runner = runner
        self.all_logits = all_logits
        self.backend = backend if backend is not None else runner.backend
        pool = runner.pool
        self.pool = pool
        self.sizes = sorted(sizes)
        self.max_tokens = self.sizes[-1]
        self.row_tokens = pool.max_pages_per_req * pool.page_size
        self.real_slots = {n: min(n, pool.max_requests, MAX_GRAPH_REQUESTS) for n in self.sizes}
        self.slots = {n: slots_for_bucket(n, pool.max_requests, self.row_tokens) for n in self.sizes}
        self.fill = self.backend.cuda_graph_seq_len_fill_value
        self.debug = debug
        device = pool.device
        t, s = self.max_tokens, max(self.slots.values())
        self.max_slots = s
        # Per token [max_tokens] and per slot [max_slots]; a bucket views their heads.
        self.input_ids = torch.zeros(t, dtype=torch.long, device=device)
        self.positions = torch.zeros(t, dtype=torch.long, device=device)
        self.out_cache_loc = torch.zeros(t, dtype=torch.long, device=device)
        # int32 slot tables packed for one host-to-device copy per step:
        # req_pool_indices | seq_lens | extend_seq_lens | extend_prefix_lens | qo_indptr (s + 1)
        # (pageable host memory: the copy has read it when `copy_` returns, so the next step
        # may rewrite it while this one still runs)
        self._ints_cpu = torch.zeros(5 * s + 1, dtype=torch.int32)
        self._ints = torch.zeros(5 * s + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.zeros(s, dtype=torch.long, device=device)
        self.token_rows = torch.arange(t, dtype=torch.long, device=device)  # all_logits: every row
        self.batches: dict[int, ForwardBatch] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.mempool = mempool
        self.replays = 0

    # ------------------------------------------------------------------ layout
    def _tables(self, ints: torch.Tensor, size: int) -> tuple[torch.Tensor, ...]:
        """Views ``(rows, seq, ext, prefix, qo_indptr)`` of the bucket ``size``'s slots."""
        s, ms = self.slots[size], self.max_slots
        return (ints[:s], ints[ms : ms + s], ints[2 * ms : 2 * ms + s], ints[3 * ms : 3 * ms + s], ints[4 * ms : 4 * ms + s + 1])

    def static_batch(self, size: int) -> ForwardBatch:
        """The bucket's `ForwardBatch`: views of the static buffers, filled by `stage`."""
        if size not in self.batches:
            rows, seq, ext, prefix, indptr = self._tables(self._ints, size)
            _, seq_c, ext_c, prefix_c, _ = self._tables(self._ints_cpu, size)
            self.batches[size] = ForwardBatch(
                mode=ForwardMode.EXTEND,
                input_ids=self.input_ids[:size],
                positions=self.positions[:size],
                req_pool_indices=rows,
                seq_lens=seq,
                seq_lens_cpu=seq_c,
                extend_seq_lens=ext,
                extend_seq_lens_cpu=ext_c,
                extend_prefix_lens=prefix,
                extend_prefix_lens_cpu=prefix_c,
                qo_indptr=indptr,
                out_cache_loc=self.out_cache_loc[:size],
                kv_pool=self.pool,
                static_max_extend_len=size,
            )
        return self.batches[size]

    def _fill_tables(self, size: int, batch: ForwardBatch | None) -> None:
        """Write the slot tables of ``size`` for ``batch`` (None: padding only) on the host,
        then copy them to the device in one transfer."""
        rows, seq, ext, prefix, indptr = self._tables(self._ints_cpu, size)
        b = 0 if batch is None else batch.batch_size
        n = 0 if batch is None else batch.num_tokens
        if batch is not None:  # the real rows are copied on the device below (no host copy exists)
            seq[:b].copy_(batch.seq_lens_cpu)
            ext[:b].copy_(batch.extend_seq_lens_cpu)
            prefix[:b].copy_(batch.extend_prefix_lens_cpu)
        # Padding requests cover rows [n, size), each at most one table row long.
        pad = size - n
        k = -(-pad // self.row_tokens)
        lens = torch.full((k,), self.row_tokens, dtype=torch.int32)
        if k:
            lens[-1] = pad - (k - 1) * self.row_tokens
        rows[b:].fill_(self.pool.pad_row)
        seq[b : b + k] = lens
        ext[b : b + k] = lens
        prefix[b : b + k] = 0
        seq[b + k :] = self.fill  # empty slots: no new tokens over `fill` dummy keys
        ext[b + k :] = 0
        prefix[b + k :] = self.fill
        indptr[0] = 0
        torch.cumsum(ext, 0, out=indptr[1:])
        copy_to_device(self._ints, self._ints_cpu)
        if b:
            self._ints[:b].copy_(batch.req_pool_indices)

    def stage(self, batch: ForwardBatch | None, size: int) -> ForwardBatch:
        """Copy ``batch`` (None: padding only) into the static buffers of bucket ``size``
        and return the bucket's static batch."""
        n = 0 if batch is None else batch.num_tokens
        if n > size or (batch is not None and batch.batch_size > self.real_slots[size]):
            raise CaptureError(f"a step of {n} tokens and {batch.batch_size} requests does not fit bucket {size}")
        self._fill_tables(size, batch)
        if batch is not None:
            self.input_ids[:n].copy_(batch.input_ids)
            self.positions[:n].copy_(batch.positions)
            self.out_cache_loc[:n].copy_(batch.out_cache_loc)
        if n < size:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.out_cache_loc[n:size].zero_()  # slot 0 of the dummy page
        return self.static_batch(size)

    def step(self, static: ForwardBatch) -> torch.Tensor:
        """Run the model on a staged bucket (recorded at capture): device metadata, the
        forward, logits ``[S, vocab]`` at the last row of every slot (``all_logits``:
        ``[N, vocab]`` at every row)."""
        s = static.batch_size
        self.backend.init_forward_metadata_in_graph(static)
        if self.all_logits:
            rows = self.token_rows[: static.num_tokens]
        else:
            rows = self.logits_indices[:s]
            torch.sub(static.qo_indptr[1:], 1, out=rows)  # empty slots: row N - 1
        with use_forward_context(ForwardContext(self.backend, static)):
            return self.runner.ragged(static.input_ids, static.positions, rows)

    # ------------------------------------------------------------------ capture
    def capture(self, progress=None, stream: "torch.cuda.Stream | None" = None) -> None:
        """Capture every bucket, largest first, into the shared pool (``progress``: a tqdm bar;
        ``stream``: the capture stream the model's runners share)."""
        stream = stream if stream is not None else torch.cuda.Stream()
        for size in sorted(self.sizes, reverse=True):
            if progress is not None:
                progress.set_postfix_str(f"{self.kind} {size} tokens")
            self.capture_size(size, stream)
            if progress is not None:
                progress.update(1)
        torch.cuda.synchronize()
        logger.info("captured %d %s CUDA graphs (token counts %s)", len(self.graphs), self.kind, self.sizes)

    @property
    def kind(self) -> str:
        return "verify" if self.all_logits else "prefill"

    def capture_size(self, size: int, stream: torch.cuda.Stream) -> None:
        """Capture bucket ``size`` (staged with padding only: it touches no request's pages)."""
        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
        static = self.stage(None, size)
        try:
            self.backend.init_forward_metadata_out_graph(static, in_capture=True)
            graph, out = capture_step(lambda: self.step(static), stream, self.mempool)
        except Exception as exc:
            raise CaptureError(f"capturing the {self.kind} graph of {size} tokens failed: {exc}") from exc
        self.graphs[size] = graph
        self.outputs[size] = out

    # ------------------------------------------------------------------ replay
    def bucket(self, n: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def can_run(self, batch: ForwardBatch) -> bool:
        n = batch.num_tokens
        if not batch.mode.is_extend or not 0 < n <= self.max_tokens:
            return False
        return batch.batch_size <= self.real_slots[self.bucket(n)]

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[B, vocab]`` at the last new token of each request of ``batch``
        (``all_logits``: ``[T, vocab]`` at each of its ``T`` new tokens). A bucket not captured
        yet is captured first (`capture_size`), on the runner's capture stream."""
        size = self.bucket(batch.num_tokens)
        if size not in self.graphs:
            self.capture_size(size, self.runner.capture_stream)
        static = self.stage(batch, size)
        self.backend.init_forward_metadata_out_graph(static, in_capture=False)
        self.graphs[size].replay()
        self.replays += 1
        return self.outputs[size][: batch.num_tokens if self.all_logits else batch.batch_size]
