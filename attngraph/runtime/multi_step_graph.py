"""`MultiStepDecodeGraphs`: ``k`` greedy decode steps of a batch replayed as ONE CUDA graph.

A speculative draft proposes ``k`` tokens by ``k`` greedy decode steps, each fed the previous
step's argmax. Replayed one decode graph at a time, every step costs a host round (stage the
batch, replay) between launches; recorded together, the steps cost one replay and the tokens
never leave the device.

Everything a step needs besides its input token is known on the host before the first one
runs: request ``i``'s step ``j`` writes its token at slot ``loc(i, length_i + j)``, at
position ``position_i + j``, over ``length_i + j + 1`` keys. `run` plans all ``k`` steps into
static per-step tensors ``[k, B]`` and replays; inside the graph step ``j`` reads step
``j - 1``'s argmax as its input ids. That needs a backend whose decode attention plans nothing
on the host (``capabilities.decode_metadata_on_device``: Triton's kernels read the lengths and
the page table from the batch's tensors).

Graphs are keyed by (padded batch size, steps) and captured on first use into the model's
graph pool, on its capture stream. Padding requests sit on the pool's ``pad_row`` with the
decode graphs' fill length and write slot 0 of the dummy page, as in `DecodeGraphRunner`.
"""

from __future__ import annotations

import bisect
import logging

import torch

from ..argmax import argmax_last_dim
from ..errors import CaptureError
from ..forward_batch import ForwardBatch, ForwardMode
from ..forward_context import ForwardContext, use_forward_context
from ..host_copy import copy_to_device
from .graph_memory import capture_step
from .ragged_model import graph_rows

logger = logging.getLogger(__name__)

#: Most steps one graph records (a draft proposes at most this many tokens per graph replay).
MAX_STEPS = 32


class MultiStepDecodeGraphs:
    """Greedy decode steps of a `ModelRunner`, ``steps`` per replay (see the module docstring).

    ``decode``: the runner's `DecodeGraphRunner`, whose batch sizes and backend buffers
    (``init_cuda_graph_state``) these graphs share."""

    def __init__(self, runner, decode) -> None:
        self.runner = runner
        self.backend = runner.backend
        self.pool = runner.pool
        self.sizes = decode.sizes
        self.max_bs = decode.max_bs
        self.fill = decode.fill
        self.pad_row = decode.pad_row
        n, device = graph_rows(self.max_bs), self.pool.device
        self.first_ids = torch.zeros(n, dtype=torch.long, device=device)  # the tokens fed at step 0
        self.tokens = torch.zeros(MAX_STEPS, n, dtype=torch.long, device=device)  # argmax of each step
        self.req_pool_indices = torch.full((n,), self.pad_row, dtype=torch.int32, device=device)
        self.ones = torch.ones(n, dtype=torch.int32, device=device)
        self.qo_indptr = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(n, dtype=torch.long, device=device)
        # Per step [MAX_STEPS, max_bs], packed for one host-to-device copy each:
        # int64: positions | out_cache_loc; int32: seq_lens | extend_prefix_lens
        self._longs_cpu = torch.zeros(2, MAX_STEPS, n, dtype=torch.long)
        self._ints_cpu = torch.zeros(2, MAX_STEPS, n, dtype=torch.int32)
        self._longs = torch.zeros(2, MAX_STEPS, n, dtype=torch.long, device=device)
        self._ints = torch.zeros(2, MAX_STEPS, n, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.batches: dict[tuple[int, int], list[ForwardBatch]] = {}
        self.replays = 0

    def can_run(self, batch_size: int, steps: int) -> bool:
        return 0 < batch_size <= self.max_bs and 0 < steps <= MAX_STEPS

    # ------------------------------------------------------------------ layout
    def _static_batches(self, bs: int, steps: int) -> list[ForwardBatch]:
        """One `ForwardBatch` per step: views of row ``j`` of the per-step tensors."""
        key = (bs, steps)
        if key not in self.batches:
            fill = self.fill
            self.batches[key] = [
                ForwardBatch(
                    mode=ForwardMode.DECODE,
                    input_ids=self.first_ids[:bs] if j == 0 else self.tokens[j - 1, :bs],
                    positions=self._longs[0, j, :bs],
                    req_pool_indices=self.req_pool_indices[:bs],
                    seq_lens=self._ints[0, j, :bs],
                    seq_lens_cpu=torch.full((bs,), fill, dtype=torch.int32),  # not read: no host planning
                    extend_seq_lens=self.ones[:bs],
                    extend_seq_lens_cpu=torch.ones(bs, dtype=torch.int32),
                    extend_prefix_lens=self._ints[1, j, :bs],
                    extend_prefix_lens_cpu=torch.full((bs,), fill - 1, dtype=torch.int32),
                    qo_indptr=self.qo_indptr[: bs + 1],
                    out_cache_loc=self._longs[1, j, :bs],
                    kv_pool=self.pool,
                )
                for j in range(steps)
            ]
        return self.batches[key]

    def _stage(self, bs: int, steps: int, rows: list[int], lengths: list[int], positions: list[int],
               tokens: torch.Tensor | None) -> None:  # fmt: skip
        """Plan ``steps`` steps of the ``b = len(rows)`` real requests (the rest of ``bs``:
        padding) into the static tensors; ``tokens: [b]`` (None: padding only, for capture)."""
        b, ps = len(rows), self.pool.page_size
        longs, ints = self._longs_cpu[:, :steps, :bs], self._ints_cpu[:, :steps, :bs]
        pos, loc = longs[0], longs[1]
        seq, prefix = ints[0], ints[1]
        pos.zero_()
        loc.zero_()  # padding: slot 0 of the dummy page
        seq.fill_(self.fill)
        prefix.fill_(self.fill - 1)
        if b:
            j = torch.arange(steps, dtype=torch.long)[:, None]  # [steps, 1]
            held = torch.tensor(lengths, dtype=torch.long)[None, :] + j  # [steps, b] tokens before step j
            pos[:, :b] = torch.tensor(positions, dtype=torch.long)[None, :] + j
            row_ids = torch.tensor(rows, dtype=torch.long)[None, :].expand(steps, b)
            pages = self.pool.req_to_page_cpu[row_ids, held // ps].long()
            loc[:, :b] = pages * ps + held % ps
            seq[:, :b] = (held + 1).int()
            prefix[:, :b] = held.int()
        copy_to_device(self._longs[:, :steps, :bs], longs)
        copy_to_device(self._ints[:, :steps, :bs], ints)
        self.req_pool_indices[:bs].fill_(self.pad_row)
        if b:
            copy_to_device(self.req_pool_indices[:b], torch.tensor(rows, dtype=torch.int32))
            self.first_ids[:b].copy_(tokens)
        if b < bs:
            self.first_ids[b:bs].zero_()

    def _record(self, batches: list[ForwardBatch]) -> torch.Tensor:
        """The recorded body: each step's forward, its argmax written where the next step reads it."""
        bs = batches[0].batch_size
        rows = graph_rows(bs)  # bs = 1: one padding row, already in the static buffers
        for j, batch in enumerate(batches):
            self.backend.init_forward_metadata_in_graph(batch)
            ids = self.first_ids[:rows] if j == 0 else self.tokens[j - 1, :rows]
            with use_forward_context(ForwardContext(self.backend, batch, num_logits=bs)):
                logits = self.runner.ragged(ids, self._longs[0, j, :rows], self.logits_indices[:rows])[:bs]
            # HF takes the argmax of float32 logits; widening is exact and keeps their order
            # (ties: the first index either way), so the argmax of the logits themselves is the
            # same token without a cast kernel per step; spread over the GPU (torch's reduction
            # reads a row of the vocabulary on one SM)
            argmax_last_dim(logits, out=self.tokens[j, :bs])
        return self.tokens[: len(batches), :bs]

    # ------------------------------------------------------------------ capture / replay
    def _capture(self, bs: int, steps: int) -> None:
        batches = self._static_batches(bs, steps)
        self._stage(bs, steps, [], [], [], None)
        try:
            self.backend.init_forward_metadata_out_graph(batches[0], in_capture=True)
            graph, _ = capture_step(lambda: self._record(batches), self.runner.capture_stream, self.runner.graph_mempool)
        except Exception as exc:
            raise CaptureError(f"capturing {steps} decode steps of batch size {bs} as one graph failed: {exc}") from exc
        self.graphs[(bs, steps)] = graph
        logger.info("captured %d greedy decode steps of batch size %d as one CUDA graph", steps, bs)

    def run(self, rows: list[int], lengths: list[int], positions: list[int], tokens: torch.Tensor,
            steps: int) -> torch.Tensor:  # fmt: skip
        """`ModelRunner.decode_steps` by one replay: argmaxes ``[steps, B]`` (device)."""
        b = len(rows)
        bs = self.sizes[bisect.bisect_left(self.sizes, b)]
        if (bs, steps) not in self.graphs:
            self._capture(bs, steps)
        batches = self._static_batches(bs, steps)
        self._stage(bs, steps, rows, lengths, positions, tokens)
        self.backend.init_forward_metadata_out_graph(batches[0], in_capture=False)
        self.graphs[(bs, steps)].replay()
        self.replays += 1
        return self.tokens[:steps, :b]
