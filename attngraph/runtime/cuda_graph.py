"""`DecodeGraphRunner`: the whole decode step captured as one CUDA graph per padded batch size.

FULL mode: the compiled ragged model *and* its attention are recorded; before each replay the
real batch is copied into static buffers, padded up to the next captured size, the backend
plans on the host (`init_forward_metadata_out_graph`), and the graph replays, which re-runs
the backend's recorded device metadata work (`init_forward_metadata_in_graph`).

Padding requests sit on the pool's ``pad_row``, a request row beyond ``max_requests`` that is
never handed out and owns no pages (its table row is all zeros, the dummy page), have length ``cuda_graph_seq_len_fill_value`` and write their K/V to
slot 0 of the dummy page. Sizes are captured largest first into one shared memory pool.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch

from ..errors import CaptureError
from ..forward_batch import ForwardBatch, ForwardMode
from ..forward_context import ForwardContext, use_forward_context
from .graph_memory import capture_step
from .ragged_model import graph_rows

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphKey:
    """What a captured graph is specialized to."""

    mode: ForwardMode
    batch_size: int


class DecodeGraphRunner:
    """Captures and replays decode steps of a `ModelRunner` (see module docstring)."""

    def __init__(self, runner, capture_sizes: tuple[int, ...], debug: bool = False, mempool=None) -> None:
        self.runner = runner
        self.backend = runner.backend
        pool = runner.pool
        self.sizes = sorted(s for s in capture_sizes if s <= pool.max_requests)
        if not self.sizes:
            raise CaptureError(f"no capture size fits max_requests={pool.max_requests}")
        self.max_bs = self.sizes[-1]
        self.debug = debug
        device = pool.device
        fill = self.backend.cuda_graph_seq_len_fill_value
        self.fill = fill
        self.pad_row = pool.pad_row  # owns no pages: its table row points at the dummy page
        n = graph_rows(self.max_bs)
        # Static inputs: [max(max_bs, MIN_TOKENS)] (views [:bs] per captured size).
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.req_pool_indices = torch.full((n,), self.pad_row, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((n,), fill, dtype=torch.int32, device=device)
        self.extend_seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.extend_prefix_lens = torch.full((n,), fill - 1, dtype=torch.int32, device=device)
        self.qo_indptr = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.out_cache_loc = torch.zeros(n, dtype=torch.long, device=device)  # slot 0: dummy page
        self.logits_indices = torch.arange(n, dtype=torch.long, device=device)
        self.batches: dict[int, ForwardBatch] = {}
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        self.mempool = mempool if mempool is not None else torch.cuda.graph_pool_handle()
        self._addresses: dict[GraphKey, tuple[int, ...]] = {}

    # ------------------------------------------------------------------ capture
    def _static_batch(self, bs: int) -> ForwardBatch:
        if bs not in self.batches:
            fill = self.fill
            self.batches[bs] = ForwardBatch(
                mode=ForwardMode.DECODE,
                input_ids=self.input_ids[:bs],
                positions=self.positions[:bs],
                req_pool_indices=self.req_pool_indices[:bs],
                seq_lens=self.seq_lens[:bs],
                seq_lens_cpu=torch.full((bs,), fill, dtype=torch.int32),
                extend_seq_lens=self.extend_seq_lens[:bs],
                extend_seq_lens_cpu=torch.ones(bs, dtype=torch.int32),
                extend_prefix_lens=self.extend_prefix_lens[:bs],
                extend_prefix_lens_cpu=torch.full((bs,), fill - 1, dtype=torch.int32),
                qo_indptr=self.qo_indptr[: bs + 1],
                out_cache_loc=self.out_cache_loc[:bs],
                kv_pool=self.runner.pool,
            )
        return self.batches[bs]

    def _step(self, batch: ForwardBatch) -> torch.Tensor:
        bs = batch.batch_size
        self.backend.init_forward_metadata_in_graph(batch)
        # bs = 1: one padding row, already in the static buffers; its logits row is not read
        with use_forward_context(ForwardContext(self.backend, batch, num_logits=bs)):
            rows = graph_rows(bs)
            return self.runner.ragged(self.input_ids[:rows], self.positions[:rows], self.logits_indices[:rows])[:bs]

    def capture(self, progress=None, stream: "torch.cuda.Stream | None" = None) -> None:
        """Capture every size, largest first (``progress``: a tqdm bar, updated per size;
        ``stream``: the capture stream the model's runners share)."""
        self.backend.init_cuda_graph_state(self.max_bs, self.max_bs)
        stream = stream if stream is not None else torch.cuda.Stream()
        sizes = sorted(self.sizes, reverse=True)  # largest first: later graphs reuse its pool memory
        for bs in sizes:
            if progress is not None:
                progress.set_postfix_str(f"decode batch {bs}")
            batch = self._static_batch(bs)
            key = GraphKey(ForwardMode.DECODE, bs)
            try:
                self.backend.init_forward_metadata_out_graph(batch, in_capture=True)
                graph, out = capture_step(lambda: self._step(batch), stream, self.mempool)
            except Exception as exc:
                raise CaptureError(f"capturing the decode graph of batch size {bs} failed: {exc}") from exc
            self.graphs[key] = graph
            self.outputs[key] = out  # non-owning: the pool memory stays the graph's; smaller sizes may reuse it
            if progress is not None:
                progress.update(1)
            if self.debug:
                self._addresses[key] = self._input_addresses(batch)
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %s)", len(self.graphs), self.sizes)

    @staticmethod
    def _input_addresses(batch: ForwardBatch) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in (batch.input_ids, batch.positions, batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc))

    # ------------------------------------------------------------------ replay
    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.mode is ForwardMode.DECODE and batch.batch_size <= self.max_bs

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[B, vocab]`` of the decode ``batch`` (B <= max captured size)."""
        b = batch.batch_size
        bs = self.sizes[bisect.bisect_left(self.sizes, b)]
        key = GraphKey(ForwardMode.DECODE, bs)
        static = self._static_batch(bs)
        self.input_ids[:b].copy_(batch.input_ids)
        self.positions[:b].copy_(batch.positions)
        self.req_pool_indices[:b].copy_(batch.req_pool_indices)
        self.seq_lens[:b].copy_(batch.seq_lens)
        self.extend_prefix_lens[:b].copy_(batch.extend_prefix_lens)
        self.out_cache_loc[:b].copy_(batch.out_cache_loc)
        if b < bs:  # padding requests
            self.input_ids[b:bs].zero_()
            self.positions[b:bs].zero_()
            self.req_pool_indices[b:bs].fill_(self.pad_row)
            self.seq_lens[b:bs].fill_(self.fill)
            self.extend_prefix_lens[b:bs].fill_(self.fill - 1)
            self.out_cache_loc[b:bs].zero_()
        static.seq_lens_cpu[:b].copy_(batch.seq_lens_cpu)
        static.seq_lens_cpu[b:].fill_(self.fill)
        static.extend_prefix_lens_cpu[:b].copy_(batch.extend_prefix_lens_cpu)
        static.extend_prefix_lens_cpu[b:].fill_(self.fill - 1)
        if self.debug and self._input_addresses(static) != self._addresses[key]:
            raise CaptureError(f"static inputs of the decode graph {key} moved since capture")
        self.backend.init_forward_metadata_out_graph(static, in_capture=False)
        self.graphs[key].replay()
        return self.outputs[key][:b]
