"""`PiecewiseGraphRunner`: runs prefill, extend and mixed steps through the piecewise graphs.

The step's token count ``n`` is padded up to the next captured bucket ``N``
(``CompileConfig.cuda_graph_num_tokens``): the runner's static ``input_ids`` / ``positions``
buffers take the real tokens in ``[:n]`` and zeros after, the attention op leaves rows past
``n`` out of the KV pool and returns zeros for them, and the logits are taken only at the real
rows (``logits_indices``), so padding never reaches an output. The backend plans for the real
batch before every step; attention runs eagerly between the replayed pieces. A step above
the largest bucket runs the compiled pieces without graphs.

Capture (largest bucket first) runs dummy requests of ``N`` tokens in all on the pool's
``pad_row`` (no pages: its table row is the dummy page; each at most one row long) whose K/V
all go to slot 0 of the dummy page: one warm-up run without graphs (kernels compiled and autotuned for that size),
then one run that records every static piece.
"""

from __future__ import annotations

import bisect
import logging

import torch

from ..forward_batch import ForwardBatch, ForwardMode
from ..forward_context import ForwardContext, use_forward_context
from .piecewise import PiecewiseState

logger = logging.getLogger(__name__)


class PiecewiseGraphRunner:
    """Captures the static pieces of ``runner``'s model per token-count bucket and replays them."""

    def __init__(self, runner, state: PiecewiseState, sizes: tuple[int, ...]) -> None:
        self.runner = runner
        self.state = state
        self.sizes = sorted(sizes)
        self.max_tokens = self.sizes[-1]
        device = runner.device
        state.max_tokens = max(state.max_tokens, self.max_tokens)
        # The backend's metadata made at capture and refreshed before each replay, when it
        # opts in (`use_captured_forward_metadata_for_breakable_cuda_graph`); else None and
        # the backend builds fresh metadata every step.
        self.captured_metadata = None
        self.input_ids = torch.zeros(self.max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_tokens, dtype=torch.long, device=device)

    # ------------------------------------------------------------------ capture
    def _dummy_batch(self, n: int) -> ForwardBatch:
        """``n`` tokens of dummy requests on the pool's ``pad_row``, none longer than the
        table row (``max_context_len``): a bucket may exceed what one request can hold, and
        the backends read a request's pages from its row."""
        pool = self.runner.pool
        device = pool.device
        width = pool.max_pages_per_req * pool.page_size
        lens = [width] * (n // width) + ([n % width] if n % width else [])
        b = len(lens)
        seq = torch.tensor(lens, dtype=torch.int32)
        indptr = torch.zeros(b + 1, dtype=torch.int32)
        torch.cumsum(seq, 0, out=indptr[1:])
        zeros = torch.zeros(b, dtype=torch.int32)
        return ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=self.input_ids[:n],
            positions=self.positions[:n],
            req_pool_indices=torch.full((b,), pool.pad_row, dtype=torch.int32, device=device),
            seq_lens=seq.to(device),
            seq_lens_cpu=seq,
            extend_seq_lens=seq.to(device),
            extend_seq_lens_cpu=seq.clone(),
            extend_prefix_lens=zeros.to(device),
            extend_prefix_lens_cpu=zeros,
            qo_indptr=indptr.to(device),
            out_cache_loc=torch.zeros(n, dtype=torch.long, device=device),  # slot 0 of the dummy page
            kv_pool=pool,
        )

    def capture(self, progress=None, stream: "torch.cuda.Stream | None" = None) -> None:
        """Record every static piece for each bucket, largest first (``progress``: a tqdm bar;
        ``stream``: the capture stream, else the state's)."""
        state = self.state
        if stream is not None:
            state.stream = stream
        backend = self.runner.backend
        self.input_ids.zero_()
        self.positions.zero_()
        for n in sorted(self.sizes, reverse=True):
            if progress is not None:
                progress.set_postfix_str(f"piecewise {n} tokens")
            batch = self._dummy_batch(n)
            last = (batch.qo_indptr[1:] - 1).long()
            self._metadata(batch, capture=True)
            with use_forward_context(ForwardContext(backend, batch)):
                with state.step(None):  # warm-up: per-size kernels compiled outside the capture
                    self.runner.ragged(batch.input_ids, batch.positions, last)
                torch.cuda.synchronize()
                with state.step(n, capturing=True):
                    self.runner.ragged(batch.input_ids, batch.positions, last)
            torch.cuda.synchronize()
            if progress is not None:
                progress.update(1)

    def _metadata(self, batch: ForwardBatch, capture: bool = False):
        """Prepare the backend's metadata for ``batch`` (see ``captured_metadata``); returns the backend."""
        backend = self.runner.backend
        if not backend.use_captured_forward_metadata_for_breakable_cuda_graph:
            backend.init_forward_metadata(batch)
        elif capture and self.captured_metadata is None:
            self.captured_metadata = backend.init_forward_metadata_for_breakable_cuda_graph_capture(batch)
        else:
            backend.prepare_forward_metadata_for_breakable_cuda_graph_replay(self.captured_metadata, batch)
        return backend

    # ------------------------------------------------------------------ replay
    def can_run(self, batch: ForwardBatch) -> bool:
        return 0 < batch.num_tokens <= self.max_tokens and batch.mode is not ForwardMode.IDLE

    def bucket(self, n: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def run(self, batch: ForwardBatch, logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits ``[L, vocab]`` at ``logits_indices: [L]`` (rows of the real tokens)."""
        n = batch.num_tokens
        size = self.bucket(n)
        ids, pos = self.input_ids[:size], self.positions[:size]
        ids[:n].copy_(batch.input_ids)
        pos[:n].copy_(batch.positions)
        if n < size:
            ids[n:].zero_()
            pos[n:].zero_()
        backend = self._metadata(batch)
        with use_forward_context(ForwardContext(backend, batch)), self.state.step(size), frozen():
            return self.runner.ragged(ids, pos, logits_indices.to(self.runner.device))


def frozen():
    """Dynamo's guards are not evaluated again for steps after capture (a few hundred
    microseconds a step for an HF model, whose parameters are all guarded graph inputs): the
    compiled graph was checked at `accelerate()` and its pieces captured, like the decode
    graphs, which replay without Dynamo at all. Only guards that tell two cache entries apart
    still run (`torch.compiler.set_stance`)."""
    return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
