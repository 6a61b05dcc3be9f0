"""`PagedCache`: the transformers `Cache` that one accelerated `generate` call runs with.

It holds no tensors of its own: the K/V live in the runner's `KVPool`; the cache owns the
pool rows (and their pages) of its batch and frees them when the call ends or the object is
dropped. Each forward of the model with a PagedCache is one paged step (`step`).
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache

from ..errors import AttnGraphError, InputError
from ..forward_batch import ForwardBatch
from ..host_copy import to_device
from .kv_pool import KVPool


def check_token_ids(t: torch.Tensor, device: torch.device, name: str, integer_only: bool = True) -> None:
    """Raise `InputError` before anything is allocated when ``t`` is empty or has the wrong dtype or device."""
    if t.numel() == 0:
        raise InputError(
            f"empty prompt: {name} has shape {tuple(t.shape)}; give at least one prompt of at least one "
            "token, as a [batch, seq] tensor with batch >= 1 and seq >= 1"
        )
    ok_dtype = not (t.dtype.is_floating_point or t.dtype.is_complex) if integer_only else t.dtype != torch.complex64
    if not ok_dtype or (integer_only and t.dtype == torch.bool):
        raise InputError(f"{name} must hold integer token ids, got dtype {t.dtype}; pass a torch.long tensor")
    if t.device.type != device.type or (device.index is not None and t.device.index not in (None, device.index)):
        raise InputError(f"{name} is on device {t.device} but the model and its KV pool are on {device}; move it with .to({str(device)!r})")


class _PagedLayer:
    """Per-layer placeholder so transformers' cache introspection sees attention (not linear) layers."""

    is_sliding = False
    is_compileable = False
    is_croppable = True  # PagedCache.crop rolls back every layer at once


def _free_rows(pool: KVPool, rows: list[int]) -> None:
    for row in rows:
        pool.free_request(row)
    rows.clear()


class PagedCache(Cache):
    """Pages of one batch of requests in a `ModelRunner`'s pool.

    ``lengths[b]``: tokens of request ``b`` stored in the pool (pads are never stored).
    ``get_seq_length()``: columns of the batch processed so far (pads included), which is what
    transformers' generate expects.
    """

    def __init__(self, runner) -> None:
        super().__init__(layers=[_PagedLayer() for _ in range(runner.geometry.num_layers)])
        self.runner = runner
        self.pool: KVPool = runner.pool
        self.rows: list[int] = []
        self.lengths: list[int] = []
        self.columns = 0
        #: Position of each request's next token (HF's rule: the last column's position + 1).
        self.next_positions: list[int] = []
        #: The caller checked the whole prompt's padding layout (`generate_checks.check_prompt_layout`).
        self.layout_checked = False
        #: Sequences were extended or truncated one by one (`extend_each`, `truncate_each`).
        self.ragged = False
        self._finalizer = weakref.finalize(self, _free_rows, self.pool, self.rows)

    # ------------------------------------------------------------------ transformers' Cache API
    @property
    def is_compileable(self) -> bool:
        return False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.columns

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.pool.max_context_len

    def crop(self, max_length: int) -> None:
        """Drop the last ``-max_length`` columns when negative (transformers' ``crop(-n)``, what
        assisted decoding calls after each verify step); ``0`` drops nothing; a positive value
        keeps the first ``max_length`` columns (transformers' older absolute form). Each
        request gives back the pages past its kept tokens.

        The dropped columns are the newest tokens of every request (pads only lead a prompt),
        so each request loses as many tokens as columns are dropped and its next position
        moves back by as many. Raises `InputError`, changing nothing, when a request holds
        fewer tokens than that (the crop would reach into its padding).
        """
        if isinstance(max_length, torch.Tensor) and max_length.dim() == 0 and not max_length.is_floating_point() and max_length.dtype != torch.bool:
            max_length = int(max_length)  # transformers 5.17's assisted loop passes a 0-d count
        if isinstance(max_length, bool) or not isinstance(max_length, int):
            raise InputError(f"crop takes an int number of columns to keep (negative: to drop), got {max_length!r}")
        if self.ragged:
            raise InputError(
                "crop drops columns of every sequence alike, but this cache's sequences were extended one by one "
                "(extend_each / truncate_each); roll them back with truncate_each"
            )
        if max_length == 0:
            return
        if max_length < 0:
            max_length = self.columns + max_length
        if max_length >= self.columns:
            return
        drop = self.columns - max(0, max_length)
        short = [b for b, n in enumerate(self.lengths) if n < drop]
        if short:
            raise InputError(
                f"cannot crop {drop} columns: sequence {short[0]} holds only {self.lengths[short[0]]} tokens "
                "(the rest of its columns are padding)"
            )
        for b, row in enumerate(self.rows):
            self.lengths[b] -= drop
            self.next_positions[b] -= drop
            self.pool.truncate(row, self.lengths[b])
        self.columns -= drop

    def update(self, *args, **kwargs):
        raise AttnGraphError(
            "PagedCache stores K/V in attngraph's pool; it is only used through the accelerated model's forward"
        )

    # ------------------------------------------------------------------ ownership
    def free(self) -> None:
        """Return every page of this batch to the pool (idempotent)."""
        _free_rows(self.pool, self.rows)
        self.lengths = []
        self.next_positions = []

    def _allocate(self, batch_size: int) -> None:
        try:
            for _ in range(batch_size):
                self.rows.append(self.pool.alloc_request())
        except Exception:
            _free_rows(self.pool, self.rows)
            raise
        self.lengths = [0] * batch_size
        self.next_positions = [0] * batch_size

    # ------------------------------------------------------------------ one step
    def decode_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One new token per sequence, ``tokens: [B]`` on the device (never read on the host).

        Lengths are known on the host, so the batch is built without a device sync.
        Returns logits ``[B, 1, vocab]``.
        """
        self._check_decode_tokens(tokens, "decode_step")
        new_lens = [n + 1 for n in self.lengths]
        self.pool.reserve(self.rows, new_lens)
        batch = ForwardBatch.decode(self.pool, self.rows, self.lengths, tokens.long(), self.next_positions)
        logits = self.runner.forward(batch)[:, None]
        self.lengths = new_lens
        self.next_positions = [p + 1 for p in self.next_positions]
        self.columns += 1
        return logits

    def decode_greedy(self, tokens: torch.Tensor, steps: int) -> torch.Tensor:
        """``steps`` greedy decode steps of every sequence: feed ``tokens: [B]`` (device), then
        each step's argmax (`ModelRunner.decode_steps`: one CUDA graph for all steps where the
        backend allows). Returns the argmaxes ``[steps, B]`` on the device, a view that the
        next call may overwrite (consume it first: stream order keeps that safe). Every
        sequence then holds ``steps`` more tokens, the last argmax not fed: the cache moves
        ``steps`` columns, as ``steps`` calls of `decode_step` would."""
        self._check_decode_tokens(tokens, "decode_greedy")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise InputError(f"decode_greedy needs an int steps >= 1, got {steps!r}")
        if any(n < 1 for n in self.lengths):
            raise InputError("decode_greedy decodes after a prompt: every sequence must hold a token first")
        self.pool.reserve(self.rows, [n + steps for n in self.lengths])  # all or nothing
        out = self.runner.decode_steps(self.rows, self.lengths, self.next_positions, tokens.long(), steps)
        self.lengths = [n + steps for n in self.lengths]
        self.next_positions = [p + steps for p in self.next_positions]
        self.columns += steps
        return out

    def _check_decode_tokens(self, tokens: torch.Tensor, what: str) -> None:
        bsz = len(self.rows)
        if tokens.shape != (bsz,):
            raise InputError(f"{what} needs one token per sequence ({bsz}), got shape {tuple(tokens.shape)}")
        check_token_ids(tokens, self.pool.device, "tokens")
        limit = self.runner.max_step_tokens
        if limit is not None and bsz > limit:
            raise InputError(
                f"a decode step of {bsz} sequences: {type(self.runner.model).__name__}'s traced forward holds at most "
                f"{limit} tokens per step; generate fewer sequences per call"
            )

    def extend_each(self, seqs: list[int], tokens: torch.Tensor, counts: list[int], all_logits: bool = True) -> torch.Tensor:
        """Append ``counts[i]`` tokens to sequence ``seqs[i]`` of the batch in one ragged step
        (``tokens: [sum(counts)]`` on the device, sequence-major; each at the sequence's next
        positions). Returns logits ``[sum(counts), vocab]`` at every new token, or with
        ``all_logits=False`` ``[len(seqs), vocab]`` at each sequence's last one (the step the
        captured decode and prefill graphs serve).

        The sequences then hold different numbers of new tokens: the cache's columns no longer
        describe them, and transformers' column-wise `crop` is refused from here on
        (`truncate_each` rolls back per sequence)."""
        if not (len(seqs) == len(counts) and tokens.shape == (sum(counts),)) or any(c < 1 for c in counts):
            raise InputError(f"extend_each needs one count >= 1 per sequence and sum(counts) tokens, got {counts} and {tuple(tokens.shape)}")
        check_token_ids(tokens, self.pool.device, "tokens")
        limit = self.runner.max_step_tokens
        if limit is not None and sum(counts) > limit:
            raise InputError(f"a step of {sum(counts)} tokens: the traced forward holds at most {limit} per step")
        rows = [self.rows[b] for b in seqs]
        prefix = [self.lengths[b] for b in seqs]
        new_lens = [n + c for n, c in zip(prefix, counts)]
        self.pool.reserve(rows, new_lens)  # all or nothing: raises before anything is written
        positions = to_device(torch.tensor(
            [self.next_positions[b] + i for b, c in zip(seqs, counts) for i in range(c)], dtype=torch.long
        ), self.pool.device)
        batch = ForwardBatch.build(self.pool, rows, prefix, counts, tokens.long(), positions)
        logits = self.runner.forward_all(batch) if all_logits else self.runner.forward(batch)
        for b, n, c in zip(seqs, new_lens, counts):
            self.lengths[b] = n
            self.next_positions[b] += c
        self.ragged = True
        return logits

    def greedy_steps(self, seqs: list[int], tokens: torch.Tensor, steps: int) -> torch.Tensor:
        """Feed ``tokens: [len(seqs)]`` (device) to sequences ``seqs``, then ``steps - 1`` more
        tokens, each sequence's argmax after the previous one: ``steps`` greedy decode steps
        (`ModelRunner.decode_steps`: one CUDA graph where the backend allows). Returns the
        argmaxes ``[steps, len(seqs)]`` on the device; each sequence then holds ``steps`` more
        tokens (the last argmax is not fed). Like `extend_each`, a column-wise `crop` is
        refused afterwards."""
        if not seqs:
            raise InputError("greedy_steps needs at least one sequence")
        if steps < 1 or tokens.shape != (len(seqs),):
            raise InputError(f"greedy_steps needs steps >= 1 and one token per sequence, got {steps} and {tuple(tokens.shape)}")
        check_token_ids(tokens, self.pool.device, "tokens")
        if any(self.lengths[b] < 1 for b in seqs):
            raise InputError("greedy_steps decodes after a prompt: every sequence must hold a token first")
        rows = [self.rows[b] for b in seqs]
        lengths = [self.lengths[b] for b in seqs]
        self.pool.reserve(rows, [n + steps for n in lengths])  # all or nothing: raises before any write
        out = self.runner.decode_steps(rows, lengths, [self.next_positions[b] for b in seqs], tokens.long(), steps)
        for b in seqs:
            self.lengths[b] += steps
            self.next_positions[b] += steps
        self.ragged = True
        return out

    def truncate_each(self, seqs: list[int], lengths: list[int]) -> None:
        """Keep the first ``lengths[i]`` tokens of sequence ``seqs[i]`` (its newest ones are
        dropped, its pages past them given back, its next position moved back as many).
        Raises `InputError`, changing nothing, for a length above what a sequence holds."""
        bad = [(b, n) for b, n in zip(seqs, lengths) if not 0 <= n <= self.lengths[b]]
        if bad:
            b, n = bad[0]
            raise InputError(f"cannot keep {n} tokens of sequence {b}: it holds {self.lengths[b]}")
        for b, n in zip(seqs, lengths):
            self.next_positions[b] -= self.lengths[b] - n
            self.lengths[b] = n
            self.pool.truncate(self.rows[b], n)
        self.ragged = True

    def step(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        logits_to_keep: int | torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the new tokens ``input_ids: [B, S]`` (``attention_mask: [B, past + S]``, 0 = pad;
        ``position_ids: [B or 1, S]``, the RoPE / learned positions of the new columns, default:
        count of real tokens before each one, which is what HF derives from the mask).

        Returns logits ``[B, S', vocab]``: ``S' = 1`` (each request's last new token) when
        ``logits_to_keep == 1``, else all ``S`` columns with zeros at pad positions. A row with
        no real token in this step (a prefill chunk of leading padding) gets zero logits.
        Nothing is written when this raises (too few pages, bad input).
        """
        if input_ids.dim() != 2:
            raise InputError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        check_token_ids(input_ids, self.pool.device, "input_ids")
        if attention_mask is not None:
            check_token_ids(attention_mask, self.pool.device, "attention_mask", integer_only=False)
        bsz, seq = input_ids.shape
        if seq == 0:
            raise InputError("empty prompt: input_ids has no tokens; give at least one token per sequence")
        if self.rows and len(self.rows) != bsz:
            raise ValueError(f"this PagedCache holds {len(self.rows)} sequences, the step has {bsz}")
        if attention_mask is not None and not self.layout_checked:
            # Called outside generate's up-front check: the mask so far must be a served layout.
            from .generate_checks import check_prompt_layout

            spec = self.runner.spec
            check_prompt_layout(attention_mask, spec is not None and (spec.uses_window or spec.uses_chunks))
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask[:, -seq:].bool()
        counts = valid.sum(1).tolist()
        positions = None
        if position_ids is not None:
            if position_ids.dim() != 2 or position_ids.shape[0] not in (1, bsz) or position_ids.shape[1] < seq:
                raise ValueError(f"position_ids must be [batch or 1, seq] for input_ids {tuple(input_ids.shape)}, got {tuple(position_ids.shape)}")
            pos = position_ids[:, -seq:].expand(bsz, seq)
            positions = pos[valid].long()
            next_positions = (pos[:, -1] + 1).tolist()
        self._check_step_limit([b for b in range(bsz) if counts[b] > 0], counts)
        if not self.rows:
            self._allocate(bsz)
        new_lens = [n + c for n, c in zip(self.lengths, counts)]
        self.pool.reserve(self.rows, new_lens)  # all or nothing: raises KVCacheFullError before writing
        # Only rows with new tokens enter the batch (an empty row is no request for the backends).
        live = [b for b in range(bsz) if counts[b] > 0]
        flat_ids = input_ids[valid].long()  # [T], request-major (int64: one compiled graph)
        if (isinstance(logits_to_keep, int) and logits_to_keep == 1) or (seq == 1 and len(live) == bsz):
            # Each request's last new token (a decode step: every row one token): [B, 1, V].
            if len(live) == bsz:
                logits = self._forward(live, counts, flat_ids, positions, all_rows=False)[:, None]
            else:
                logits = self._zero_logits(bsz, 1)
                if live:
                    part = self._forward(live, counts, flat_ids, positions, all_rows=False)  # [len(live), V]
                    logits = logits.to(part.dtype)
                    logits[torch.tensor(live, device=self.pool.device), 0] = part
        else:
            logits = self._zero_logits(bsz, seq)
            if live:
                flat = self._forward(live, counts, flat_ids, positions, all_rows=True)  # [T, V]
                logits = logits.to(flat.dtype)
                logits[valid] = flat
            if isinstance(logits_to_keep, int) and logits_to_keep > 0:
                logits = logits[:, -logits_to_keep:]
            elif isinstance(logits_to_keep, torch.Tensor):
                logits = logits[:, logits_to_keep]
        self.lengths = new_lens
        self.columns += seq
        if position_ids is not None:
            self.next_positions = next_positions
        else:
            self.next_positions = list(new_lens)
        return logits

    def _check_step_limit(self, live: list[int], counts: list[int]) -> None:
        """Before anything is written: every request's new tokens fit one step of the traced
        forward (`ModelRunner.max_step_tokens`)."""
        limit = self.runner.max_step_tokens
        if limit is not None and any(counts[b] > limit for b in live):
            raise InputError(
                f"a sequence of {max(counts[b] for b in live)} new tokens: {type(self.runner.model).__name__}'s traced "
                f"forward holds at most {limit} tokens per step (its own code limits the sequence length)"
            )

    def _forward(self, live: list[int], counts: list[int], flat_ids: torch.Tensor, positions: torch.Tensor | None,
                 all_rows: bool) -> torch.Tensor:  # fmt: skip
        """Logits of the requests ``live`` (their new tokens ``flat_ids: [T]``, request-major):
        ``[len(live), V]`` (each one's last token) or, ``all_rows``, ``[T, V]``. One step, or
        consecutive groups of requests when the step would exceed `ModelRunner.max_step_tokens`."""
        limit = self.runner.max_step_tokens or sum(counts[b] for b in live)
        groups, current, size = [], [], 0
        for b in live:
            if current and size + counts[b] > limit:
                groups.append(current)
                current, size = [], 0
            current.append(b)
            size += counts[b]
        groups.append(current)
        outs, start = [], 0
        for group in groups:
            n = sum(counts[b] for b in group)
            batch = ForwardBatch.build(
                self.pool, [self.rows[b] for b in group], [self.lengths[b] for b in group], [counts[b] for b in group],
                flat_ids[start : start + n], None if positions is None else positions[start : start + n],
            )
            rows = torch.arange(n, device=flat_ids.device) if all_rows else None
            outs.append(self.runner.forward(batch, rows))
            start += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _zero_logits(self, bsz: int, seq: int) -> torch.Tensor:
        vocab = int(self.runner.model.get_output_embeddings().weight.shape[0])
        return torch.zeros((bsz, seq, vocab), dtype=self.runner.dtype, device=self.pool.device)
