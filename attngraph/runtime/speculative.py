"""Greedy speculative decoding on the paged runtime: prompt lookup, for batches.

``generate(..., prompt_lookup_num_tokens=k)`` with greedy decoding: each round, every unfinished
request proposes up to ``k`` tokens by n-gram lookup in its own tokens (`lookup_candidates`,
transformers' rule) and the target runs one ragged step over its pending token plus its
candidates, with logits at every one. A request keeps the candidates its argmax agrees with,
plus the argmax after the last one it kept (always at least one new token), and gives back the
pool slots of the rest (`PagedCache.truncate_each`). The tokens are those of plain greedy
decoding; a round costs one host read (the argmaxes).

Requests advance at their own pace (each keeps as many candidates as it agrees with), which a
ragged step serves directly; transformers' own assisted loop takes one sequence only. Calls this
loop does not reproduce exactly (sampling, logits processors, streamers, stopping criteria other
than max length / EOS, ...) run transformers' assisted loop instead, still on the paged runtime.
"""

from __future__ import annotations

import logging

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from .decode_loop import why_not_own_loop, check_call
from .paged_cache import PagedCache

logger = logging.getLogger(__name__)

#: transformers' default longest n-gram matched by prompt lookup (``max_matching_ngram_size``).
DEFAULT_MAX_NGRAM = 2


def lookup_candidates(tokens: list[int], num_tokens: int, max_ngram: int = DEFAULT_MAX_NGRAM) -> list[int]:
    """Up to ``num_tokens`` tokens that followed the earliest earlier occurrence of the last
    ``n`` tokens of ``tokens``, for ``n = max_ngram .. 1`` (the first ``n`` with a match that has
    tokens after it wins); ``[]`` when nothing matches. transformers' prompt-lookup rule."""
    length = len(tokens)
    if num_tokens <= 0:
        return []
    for n in range(min(max_ngram, length - 1), 0, -1):
        tail = tokens[length - n :]
        for start in range(0, length - n):  # windows ending before the tail itself
            if tokens[start : start + n] == tail:
                after = start + n
                return tokens[after : min(after + num_tokens, length)]
    return []


def _why_not(generation_config, logits_processor, stopping_criteria, streamer, cache, batch_size: int, k: int) -> str | None:
    """None when this loop reproduces greedy decoding exactly here, else why not."""
    if generation_config.do_sample:
        return "sampling (transformers' speculative sampling)"
    if len(logits_processor) > 0:
        return f"logits processors ({', '.join(type(p).__name__ for p in logits_processor)})"
    why = why_not_own_loop(stopping_criteria, generation_config, streamer, cache, batch_size)
    if why is not None:
        return why
    limit = cache.runner.max_step_tokens
    if limit is not None and batch_size * (k + 1) > limit:
        return f"{batch_size} x {k + 1} tokens per round, above the traced forward's {limit} tokens per step"
    return None


def paged_lookup_decode(
    self,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    inputs_tensor: torch.Tensor | None = None,
    attngraph_streamer=None,
    **model_kwargs,
) -> torch.LongTensor:
    """transformers' decoding-loop contract (``self`` is the model) for prompt lookup:
    returns ``[B, prompt + generated]`` ids, pads after a sequence's EOS as plain greedy does."""
    model = self
    streamer = streamer if streamer is not None else attngraph_streamer
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    k = int(generation_config.prompt_lookup_num_tokens)
    if isinstance(cache, PagedCache):
        check_call(cache, input_ids, generation_config, model_kwargs)
    why = "synced_gpus" if synced_gpus else None
    why = why or _why_not(generation_config, logits_processor, stopping_criteria, streamer, cache, input_ids.shape[0], k)
    if why is not None:
        logger.debug("attngraph: transformers' assisted loop (%s)", why)
        return type(model)._assisted_decoding(
            model, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
            generation_config=generation_config, synced_gpus=synced_gpus, streamer=streamer,
            inputs_tensor=inputs_tensor, **model_kwargs,
        )  # fmt: skip
    max_length = min(c.max_length for c in stopping_criteria if isinstance(c, MaxLengthCriteria))
    eos = set()
    for crit in stopping_criteria:
        if isinstance(crit, EosTokenCriteria):
            eos.update(int(t) for t in torch.as_tensor(crit.eos_token_id).flatten().tolist())
    bsz, prompt_len = input_ids.shape
    steps = max_length - prompt_len
    if steps <= 0:
        return input_ids
    max_ngram = int(getattr(generation_config, "max_matching_ngram_size", None) or DEFAULT_MAX_NGRAM)
    mask = model_kwargs.get("attention_mask")
    prompts = [row[m.bool()].tolist() for row, m in zip(input_ids, mask)] if mask is not None else input_ids.tolist()

    logits = cache.step(input_ids, mask, 1, model_kwargs.get("position_ids"))[:, -1]  # [B, V]
    pending = torch.argmax(logits.float(), dim=-1).tolist()  # next token of each request, not in the pool yet
    outputs = [[t] for t in pending]
    done = [t in eos or steps == 1 for t in pending]
    while not all(done):
        live = [b for b in range(bsz) if not done[b]]
        # Each live request feeds its pending token and its candidates: 1 + c_b tokens, ragged.
        cands = [lookup_candidates(prompts[b] + outputs[b], min(k, steps - len(outputs[b]) - 1), max_ngram) for b in live]
        fed = [[pending[b]] + c for b, c in zip(live, cands)]
        preds = _verify(cache, live, fed)  # per live request: argmax after each fed token
        for b, c, p in zip(live, cands, preds):
            n = 0
            while n < len(c) and c[n] == p[n]:
                n += 1
            cache.truncate_each([b], [cache.lengths[b] - (len(c) - n)])  # drop the rejected candidates
            new = c[:n] + [p[n]]
            for t in new:
                outputs[b].append(t)
                if t in eos or len(outputs[b]) == steps:
                    done[b] = True
                    break
            pending[b] = new[-1]
    width = max(len(o) for o in outputs)
    pad = generation_config._pad_token_tensor
    fill = int(pad) if pad is not None else 0
    out = [o + [fill] * (width - len(o)) for o in outputs]
    return torch.cat([input_ids, torch.tensor(out, dtype=input_ids.dtype, device=input_ids.device)], dim=1)


def _verify(cache: PagedCache, live: list[int], fed: list[list[int]]) -> list[list[int]]:
    """One step of the tokens ``fed[i]`` appended to request ``live[i]``; the argmax of the
    logits after each of them, read on the host (the round's one sync)."""
    device = cache.pool.device
    ids = torch.tensor([t for f in fed for t in f], dtype=torch.long, device=device)
    logits = cache.extend_each(live, ids, [len(f) for f in fed])  # [T, V]
    flat = torch.argmax(logits.float(), dim=-1).tolist()
    out, start = [], 0
    for f in fed:
        out.append(flat[start : start + len(f)])
        start += len(f)
    return out
