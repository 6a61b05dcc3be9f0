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
  finishing one are cut off the output, so the result equals HF's.

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

from ..errors import UnsupportedGenerationError
from .generate_checks import check_capacity, check_forward_kwargs, check_prompt_layout
from .paged_cache import PagedCache

logger = logging.getLogger(__name__)

#: Steps between reads of the "all finished" flag (each read waits for the device).
STOP_CHECK_EVERY = 8


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
            next_tokens = torch.argmax(scores, dim=-1)
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
