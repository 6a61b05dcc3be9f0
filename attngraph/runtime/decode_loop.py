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

Anything outside that scope (streamers, ``return_dict_in_generate``, stopping criteria other
than max length / EOS) runs HF's own `_sample`, still on the paged runtime.
"""

from __future__ import annotations

import logging

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from .paged_cache import PagedCache

logger = logging.getLogger(__name__)

#: Steps between reads of the "all finished" flag (each read waits for the device).
STOP_CHECK_EVERY = 8


def _eligible(stopping_criteria: StoppingCriteriaList, generation_config, streamer, cache) -> str | None:
    """None when the fast loop reproduces HF exactly here, else why not."""
    if not isinstance(cache, PagedCache):
        return "no PagedCache"
    if streamer is not None:
        return "a streamer"
    if generation_config.return_dict_in_generate:
        return "return_dict_in_generate"
    for crit in stopping_criteria:
        if not isinstance(crit, (MaxLengthCriteria, EosTokenCriteria)):
            return f"stopping criterion {type(crit).__name__}"
    if not any(isinstance(c, MaxLengthCriteria) for c in stopping_criteria):
        return "no max length"
    return None


def paged_sample(
    self,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    **model_kwargs,
) -> torch.LongTensor:
    """HF's `_sample` contract (``self`` is the model): returns ``[B, prompt + generated]`` ids."""
    model = self
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    why = None if not synced_gpus else "synced_gpus"
    why = why or _eligible(stopping_criteria, generation_config, streamer, cache)
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
    logits = cache.step(input_ids, model_kwargs.get("attention_mask"), 1)[:, -1]  # prefill: [B, V]
    for step in range(steps):
        scores = logits_processor(input_ids, logits.to(copy=True, dtype=torch.float32))
        if do_sample:
            next_tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
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
                return input_ids[:, : prompt_len + first + 1]
        if not last:
            logits = cache.decode_step(next_tokens)[:, -1]
    return input_ids
