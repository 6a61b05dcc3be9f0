"""attngraph's own greedy / sampling loop, plugged into HF `generate` as its decoding loop.

transformers' `generate(custom_generate=callable)` does all of its usual preparation
(generation config resolution, validation, logits processors, stopping criteria, special
tokens) and then hands the loop to the callable. `paged_sample` is that loop, with HF's
semantics step for step (the same processors on the same float32 logits, argmax or
``torch.multinomial`` on the same probabilities, pad after EOS) but without a host sync per
step:

* the next step's batch is built from host-side lengths (known in advance: one token per
  request per step) and the sampled tokens stay on the device, so decode steps replay the
  captured CUDA graph back to back;
* "all sequences finished" is read every `STOP_CHECK_EVERY` steps; steps run past the
  finishing one are cut off the output, so the result equals HF's;
* greedy search with no logits processor (`greedy_chunks`) runs `GREEDY_CHUNK` steps per call
  of `PagedCache.decode_greedy`: one CUDA graph of all of them where the backend's decode
  metadata lives on the device, the argmax of each step fed to the next inside it. EOS and
  padding are applied to a chunk's tokens afterwards, on the device, and a chunk's "all
  finished" flags are read after the next chunk is launched, so the device never waits for
  the host.

Anything outside that scope (streamers, ``return_dict_in_generate``, ``use_cache=False``,
chunked prefill, stopping criteria other than max length / EOS) runs HF's own `_sample`, still
on the paged runtime. Every call is first checked (`check_call`): what cannot be reproduced is
refused before the first forward. When sampling stops early, the generator's state is rewound
to the one after the finishing step (the loop samples up to `STOP_CHECK_EVERY` - 1 steps past
it), so the next seeded call draws what it would draw after HF's loop.
"""

from __future__ import annotations

import logging

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from ..argmax import argmax_last_dim
from ..errors import UnsupportedGenerationError
from .generate_checks import check_capacity, check_forward_kwargs, check_prompt_layout
from .paged_cache import PagedCache

logger = logging.getLogger(__name__)

#: Steps between reads of the "all finished" flag (each read waits for the device).
STOP_CHECK_EVERY = 8

#: Greedy decode steps per `PagedCache.decode_greedy` call (a remainder runs in chunks of
#: powers of two, so each batch size captures at most four multi-step graphs).
GREEDY_CHUNK = 8


def why_not_own_loop(stopping_criteria: StoppingCriteriaList, generation_config, streamer, cache, batch_size: int) -> str | None:
    """None when the fast loop reproduces HF exactly here, else why not."""
    if not isinstance(cache, PagedCache):
        return "no PagedCache"
    limit = cache.runner.max_step_tokens
    if limit is not None and batch_size > limit:  # HF's loop runs each step in groups (PagedCache.step)
        return f"{batch_size} sequences, above the traced forward's {limit} tokens per step"
    if cache.columns:
        return "a cache holding earlier tokens (an assistant's, passed back)"
    if streamer is not None:
        return "a streamer"
    if generation_config.return_dict_in_generate:
        return "return_dict_in_generate"
    if not generation_config.use_cache:
        return "use_cache=False (every step re-runs the whole sequence)"
    if generation_config.prefill_chunk_size is not None:
        return "prefill_chunk_size"
    for crit in stopping_criteria:
        if not isinstance(crit, (MaxLengthCriteria, EosTokenCriteria)):
            return f"stopping criterion {type(crit).__name__}"
    if not any(isinstance(c, MaxLengthCriteria) for c in stopping_criteria):
        return "no max length"
    return None


def check_call(cache: PagedCache, input_ids: torch.Tensor, generation_config, model_kwargs: dict) -> None:
    """Everything attngraph refuses about a prepared generate call, before its first forward:
    model keywords it would drop, padding layouts it cannot reproduce, a call the pool cannot
    hold. ``model_kwargs`` are what transformers passes on to the model's forward."""
    check_forward_kwargs(model_kwargs)
    if not generation_config.use_cache and generation_config.prefill_chunk_size is not None:
        raise UnsupportedGenerationError(
            "prefill_chunk_size needs use_cache=True (transformers refuses chunked prefill without a cache too)"
        )
    mask = model_kwargs.get("attention_mask")
    spec = cache.runner.spec
    check_prompt_layout(mask, spec is not None and (spec.uses_window or spec.uses_chunks))
    cache.layout_checked = True
    bsz, width = input_ids.shape
    counts = mask.bool().sum(1).tolist() if mask is not None else [width] * bsz
    if generation_config.max_length is not None:
        check_capacity(cache.pool, counts, generation_config.max_length - width)


class _RngTrail:
    """States of the generator ``torch.multinomial`` draws from (the default one of the
    device), one per step since the last stop check, so the loop can rewind the steps it ran
    past the finishing one: the generator is left where HF's loop leaves it."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.states: list[torch.Tensor] = []

    def record(self) -> None:
        self.states.append(torch.cuda.get_rng_state(self.device) if self.cuda else torch.get_rng_state())

    def restore(self, index: int) -> None:
        if self.cuda:
            torch.cuda.set_rng_state(self.states[index], self.device)
        else:
            torch.set_rng_state(self.states[index])

    def clear(self) -> None:
        self.states.clear()


def paged_sample(
    self,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    attngraph_streamer=None,
    **model_kwargs,
) -> torch.LongTensor:
    """HF's `_sample` contract (``self`` is the model): returns ``[B, prompt + generated]`` ids.

    transformers hands a callable ``custom_generate`` no streamer, so the accelerated
    generate passes it again as ``attngraph_streamer`` (transformers routes keywords that
    `_sample` does not know to the callable).
    """
    model = self
    streamer = streamer if streamer is not None else attngraph_streamer
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if isinstance(cache, PagedCache):
        check_call(cache, input_ids, generation_config, model_kwargs)
    why = None if not synced_gpus else "synced_gpus"
    why = why or why_not_own_loop(stopping_criteria, generation_config, streamer, cache, input_ids.shape[0])
    if why is not None:
        logger.debug("attngraph: HF decoding loop (%s)", why)
        return type(model)._sample(
            model, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
            generation_config=generation_config, synced_gpus=synced_gpus, streamer=streamer, **model_kwargs,
        )
    max_length = min(c.max_length for c in stopping_criteria if isinstance(c, MaxLengthCriteria))
    has_eos = any(isinstance(c, EosTokenCriteria) for c in stopping_criteria)
    pad = generation_config._pad_token_tensor
    do_sample = bool(generation_config.do_sample)
    bsz, prompt_len = input_ids.shape
    steps = max_length - prompt_len
    if steps <= 0:
        return input_ids

    if not do_sample and len(logits_processor) == 0:
        eos = next((c.eos_token_id for c in stopping_criteria if isinstance(c, EosTokenCriteria)), None)
        return greedy_chunks(cache, input_ids, model_kwargs, steps, eos, pad)

    unfinished = torch.ones(bsz, dtype=torch.long, device=input_ids.device)
    all_done: list[torch.Tensor] = []  # per step: 0-d bool, every sequence finished after it
    rng = _RngTrail(input_ids.device) if do_sample else None
    checked = 0  # steps before this one whose flags were read
    prefill = cache.step(input_ids, model_kwargs.get("attention_mask"), 1, model_kwargs.get("position_ids"))
    logits = prefill[:, -1]  # [B, V]
    for step in range(steps):
        scores = logits_processor(input_ids, logits.to(copy=True, dtype=torch.float32))
        if do_sample:
            next_tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            rng.record()
        else:
            next_tokens = argmax_last_dim(scores)
        if has_eos:
            next_tokens = next_tokens * unfinished + pad * (1 - unfinished)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        unfinished = unfinished & ~stopping_criteria(input_ids, scores)
        all_done.append(unfinished.max() == 0)
        last = step == steps - 1
        if last or (step + 1) % STOP_CHECK_EVERY == 0:
            done = torch.stack(all_done)
            if bool(done.any()):  # host sync
                first = int(done.nonzero()[0, 0])
                if rng is not None:  # rewind the draws of the steps run past the finishing one
                    rng.restore(first - checked)
                return input_ids[:, : prompt_len + first + 1]
            checked = step + 1
            if rng is not None:
                rng.clear()
        if not last:
            logits = cache.decode_step(next_tokens)[:, -1]
    return input_ids


def _chunk_sizes(steps: int) -> list[int]:
    """``steps`` decode steps as chunks of `GREEDY_CHUNK`, the remainder in powers of two."""
    sizes = [GREEDY_CHUNK] * (steps // GREEDY_CHUNK)
    rest = steps % GREEDY_CHUNK
    while rest:
        sizes.append(1 << (rest.bit_length() - 1))
        rest -= sizes[-1]
    return sizes


def _finish_chunk(tokens: torch.Tensor, unfinished: torch.Tensor, eos: torch.Tensor | None, pad) -> tuple:
    """HF's per-step EOS rule over a chunk ``tokens: [k, B]`` (the raw argmaxes) at once:
    a sequence finished before step ``j`` emits ``pad`` there, and finishes at its first EOS.
    ``unfinished: [B]`` bool before the chunk. Returns (tokens to emit ``[k, B]``, the
    per-step flag "every sequence finished after step j" ``[k]``, ``unfinished`` after); the
    tokens emitted never share memory with ``tokens``."""
    if eos is None:  # a copy: ``tokens`` may be the runner's buffer, which the next chunk overwrites
        return tokens.clone(), torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device), unfinished
    hit = torch.isin(tokens, eos.to(tokens.device)).long()  # [k, B]
    seen = hit.cumsum(0)  # EOS emitted up to and including step j
    alive = unfinished[None, :] & (seen - hit == 0)  # unfinished before step j
    emitted = torch.where(alive, tokens, torch.as_tensor(pad, dtype=tokens.dtype, device=tokens.device))
    after = unfinished[None, :] & (seen == 0)  # unfinished after step j
    return emitted, ~after.any(dim=1), after[-1]


def greedy_chunks(cache: PagedCache, input_ids: torch.Tensor, model_kwargs: dict, steps: int,
                  eos: torch.Tensor | None, pad) -> torch.LongTensor:  # fmt: skip
    """Greedy search without logits processors: ``steps`` new tokens, equal to HF's `_sample`.

    The first token is the prefill's argmax; the other ``steps - 1`` come from
    `PagedCache.decode_greedy` in chunks (`_chunk_sizes`). Each chunk is fed the previous
    chunk's last raw argmax: a finished sequence keeps decoding its own argmaxes where HF feeds
    it ``pad``; its emitted tokens are ``pad`` all the same, and no other sequence reads its
    keys, so the output equals HF's. Returns ``[B, prompt + generated]``, cut after the first
    step at which every sequence had finished."""
    prompt_len = input_ids.shape[1]
    prefill = cache.step(input_ids, model_kwargs.get("attention_mask"), 1, model_kwargs.get("position_ids"))
    first = argmax_last_dim(prefill[:, -1])  # [B]; = of the float32 logits (widening is exact and keeps the order)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    emitted, done, unfinished = _finish_chunk(first[None, :], unfinished, eos, pad)
    out = [input_ids, emitted.T]
    pending, offset = done, 0  # the flags not yet read, and the step of their first one
    feed = first
    for k in _chunk_sizes(steps - 1):
        raw = cache.decode_greedy(feed, k)  # [k, B], a view of the runner's buffer
        feed = raw[-1]
        emitted, done, unfinished = _finish_chunk(raw, unfinished, eos, pad)  # queued before the next chunk
        out.append(emitted.T)
        if eos is not None and bool(pending.any()):  # host sync, with this chunk already queued
            ids = torch.cat(out, dim=1)
            return ids[:, : prompt_len + offset + int(pending.nonzero()[0, 0]) + 1]
        offset += pending.numel()
        pending = done
    ids = torch.cat(out, dim=1)
    if eos is not None and bool(pending.any()):
        return ids[:, : prompt_len + offset + int(pending.nonzero()[0, 0]) + 1]
    return ids
