"""Greedy speculative decoding on the paged runtime, for batches: prompt lookup and
accelerated draft models.

``generate(..., prompt_lookup_num_tokens=k)`` or ``generate(..., assistant_model=draft)``
(``draft`` accelerated, same vocabulary) with greedy decoding: each round, every unfinished
request gets up to ``k`` candidate tokens from its proposer (`_LookupProposer`: n-gram lookup
in its own tokens, transformers' rule; `_DraftProposer`: the draft's greedy steps on its own
pool) and the target runs one ragged step over its pending token plus its candidates, with
logits at every one. A request keeps the candidates its argmax agrees with, plus the argmax
after the last one it kept (always at least one new token), and gives back the pool slots of
the rest (`PagedCache.truncate_each`; the draft rolls back too). The tokens are those of plain
greedy decoding. A round reads the device once: the target's argmaxes together with the
draft's proposals, which stay on the device until then.

On CUDA with the Triton backend, the verify step replays a verify graph (`ModelRunner.forward_all`:
a whole-step graph with logits at every token, captured per token bucket on first use) and the
draft's decode steps replay as one graph per round (`ModelRunner.decode_steps`).

Requests advance at their own pace (each keeps as many candidates as it agrees with), which a
ragged step serves directly; transformers' own assisted loop takes one sequence only. Calls this
loop does not reproduce exactly (sampling, logits processors, streamers, stopping criteria other
than max length / EOS, ...) run transformers' assisted loop instead, still on the paged runtime.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from ..argmax import argmax_last_dim
from ..host_copy import to_device
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
    k = int(generation_config.prompt_lookup_num_tokens)
    max_ngram = int(getattr(generation_config, "max_matching_ngram_size", None) or DEFAULT_MAX_NGRAM)
    streamer = streamer if streamer is not None else attngraph_streamer
    why = _checked(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer, k, model_kwargs)
    if why is not None:
        return _transformers_loop(self, why, input_ids, logits_processor, stopping_criteria, generation_config,
                                  synced_gpus, streamer, inputs_tensor, model_kwargs)  # fmt: skip
    return _speculative_greedy(_LookupProposer(k, max_ngram), input_ids, stopping_criteria, generation_config, model_kwargs)


def paged_assisted_decode(
    self,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    inputs_tensor: torch.Tensor | None = None,
    attngraph_streamer=None,
    attngraph_assistant=None,
    **model_kwargs,
) -> torch.LongTensor:
    """transformers' decoding-loop contract for greedy decoding with an accelerated assistant
    (``attngraph_assistant``, passed under a keyword of this loop's own: transformers hands a
    callable loop no ``assistant_model``): the draft proposes on its own pool, the target
    verifies. Returns ``[B, prompt + generated]`` ids, those of plain greedy decoding."""
    from .accelerate import state_of

    draft_state = state_of(attngraph_assistant)
    cfg = attngraph_assistant.generation_config
    k = int(getattr(cfg, "num_assistant_tokens", None) or DEFAULT_DRAFT_TOKENS)
    # transformers' default (unset) is "constant"
    adaptive = getattr(cfg, "num_assistant_tokens_schedule", None) in ("heuristic", "heuristic_transient")
    streamer = streamer if streamer is not None else attngraph_streamer
    why = _checked(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer,
                   k + 2 * adaptive * MAX_DRAFT_GROWTH, model_kwargs)  # fmt: skip
    if why is not None:
        return _transformers_loop(self, why, input_ids, logits_processor, stopping_criteria, generation_config,
                                  synced_gpus, streamer, inputs_tensor, model_kwargs, assistant_model=attngraph_assistant)  # fmt: skip
    with draft_state.lock:  # the draft's runner serves one call at a time
        proposer = _DraftProposer(PagedCache(draft_state.runner), k, adaptive)
        try:
            return _speculative_greedy(proposer, input_ids, stopping_criteria, generation_config, model_kwargs)
        finally:
            proposer.cache.free()


#: Draft tokens per round when the assistant's generation config names none (transformers' default).
DEFAULT_DRAFT_TOKENS = 20
#: Most rounds' worth of growth the adaptive schedule may add (+2 a round) before a step would
#: exceed the traced forward's token limit (checked up front).
MAX_DRAFT_GROWTH = 4


def _transformers_loop(model, why: str, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
                       streamer, inputs_tensor, model_kwargs: dict, **assistant) -> torch.LongTensor:  # fmt: skip
    """transformers' own assisted loop (one sequence), on the paged runtime, for a call the
    speculative loop does not reproduce (``why``)."""
    logger.debug("attngraph: transformers' assisted loop (%s)", why)
    return type(model)._assisted_decoding(
        model, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
        generation_config=generation_config, synced_gpus=synced_gpus, streamer=streamer, inputs_tensor=inputs_tensor,
        **assistant, **model_kwargs,
    )  # fmt: skip


def _checked(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer, k,
             model_kwargs) -> str | None:  # fmt: skip
    """`check_call` (raises), then None when the speculative loop reproduces this call, else why not."""
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if isinstance(cache, PagedCache):
        check_call(cache, input_ids, generation_config, model_kwargs)
    if synced_gpus:
        return "synced_gpus"
    return _why_not(generation_config, logits_processor, stopping_criteria, streamer, cache, input_ids.shape[0], k)


class _Proposal(NamedTuple):
    """One round's candidates: ``counts[i]`` for the ``i``-th live request, held either on the
    host (``host``: a list per request) or on the device (``device``: ``[sum(counts)]`` int64,
    request-major), in which case the verify step's one read brings them back with its own."""

    counts: list[int]
    host: list[list[int]] | None = None
    device: torch.Tensor | None = None


class _LookupProposer:
    """Candidates by n-gram lookup in each sequence's own tokens (`lookup_candidates`)."""

    def __init__(self, k: int, max_ngram: int) -> None:
        self.k, self.max_ngram = k, max_ngram

    def start(self, input_ids, mask, position_ids, prompts: list[list[int]]) -> None:
        self.prompts = prompts

    def propose(self, live: list[int], pending: list[int], outputs: list[list[int]], budgets: list[int]) -> _Proposal:
        cands = [
            lookup_candidates(self.prompts[b] + outputs[b], min(self.k, budget), self.max_ngram)
            for b, budget in zip(live, budgets)
        ]
        return _Proposal([len(c) for c in cands], host=cands)

    def accepted(self, live: list[int], cands: list[list[int]], kept: list[int]) -> None:
        """Nothing to roll back: lookup holds no state."""


class _DraftProposer:
    """Candidates from an accelerated draft model, greedy, on its own pool (``cache``).

    The draft lags the target by the tokens it has not consumed yet (``unseen``: the last
    round's pending token, and a last candidate it proposed but never fed); each round feeds
    them and the pending token in one ragged step, then runs the further greedy decode steps
    (`PagedCache.greedy_steps`: one CUDA graph for all of them where the backend allows). The
    proposals stay on the device; the target's verify step reads them back with its own
    argmaxes. With ``adaptive`` (transformers' "heuristic" schedules) a sequence's k grows by 2
    after a round whose candidates were all kept and shrinks by 1 (to at least 1) otherwise,
    within this call."""

    def __init__(self, cache: PagedCache, k: int, adaptive: bool) -> None:
        self.cache, self.k0, self.adaptive = cache, k, adaptive

    def start(self, input_ids, mask, position_ids, prompts: list[list[int]]) -> None:
        self.cache.step(input_ids, mask, 1, position_ids)  # the prompt (the draft's own next token is not used)
        self.unseen: list[list[int]] = [[] for _ in prompts]
        self.k = [self.k0] * len(prompts)
        self.cap = self.k0 + 2 * MAX_DRAFT_GROWTH * self.adaptive

    def propose(self, live: list[int], pending: list[int], outputs: list[list[int]], budgets: list[int]) -> _Proposal:
        ks = [min(self.k[b], budget) for b, budget in zip(live, budgets)]
        self.fed_at = {}  # b -> draft length after its feed
        feeds = {b: self.unseen[b] + [pending[b]] for b in live}
        active = [b for b, k in zip(live, ks) if k > 0]
        for b, k in zip(live, ks):
            if k == 0:
                self.unseen[b] = feeds[b]  # nothing to propose: it stays behind
        if not active:
            return _Proposal([0] * len(live), host=[[] for _ in live])
        want = dict(zip(live, ks))
        device = self.cache.pool.device
        ids = torch.tensor([t for b in active for t in feeds[b]], dtype=torch.long, device=device)
        logits = self.cache.extend_each(active, ids, [len(feeds[b]) for b in active], all_logits=False)  # [A, V]
        first = torch.argmax(logits.float(), dim=-1)  # each active request's first proposal
        for b in active:
            self.fed_at[b] = self.cache.lengths[b]
            self.unseen[b] = []
        # Requests that want as many proposals decode together: nobody steps past its own k.
        pieces, where = [first], {}  # where[b] = (offset of b's later proposals, stride)
        offset = first.numel()
        for w in sorted({want[b] for b in active if want[b] > 1}):
            group = [i for i, b in enumerate(active) if want[b] == w]
            idx = torch.tensor(group, device=device)
            steps = self.cache.greedy_steps([active[i] for i in group], first.index_select(0, idx), w - 1)  # [w-1, g]
            pieces.append(steps.reshape(-1))
            for pos, i in enumerate(group):
                where[active[i]] = (offset + pos, len(group))
            offset += steps.numel()
        gather = []  # request-major: b's first proposal, then its later ones
        for i, b in enumerate(active):
            gather.append(i)
            if b in where:
                start, stride = where[b]
                gather.extend(start + stride * j for j in range(want[b] - 1))
        flat = torch.cat(pieces).index_select(0, torch.tensor(gather, device=device))
        return _Proposal([want[b] if b in self.fed_at else 0 for b in live], device=flat)

    def accepted(self, live: list[int], cands: list[list[int]], kept: list[int]) -> None:
        """Roll the draft back to the kept candidates: it fed all but its last proposal."""
        for b, c, n in zip(live, cands, kept):
            if not c:
                continue
            self.cache.truncate_each([b], [self.fed_at[b] + min(n, len(c) - 1)])
            if n == len(c):
                self.unseen[b] = [c[-1]]  # kept but never fed to the draft
            if self.adaptive:
                self.k[b] = min(self.cap, self.k[b] + 2) if n == len(c) else max(1, self.k[b] - 1)


def _speculative_greedy(proposer, input_ids, stopping_criteria, generation_config, model_kwargs) -> torch.LongTensor:
    """The speculative loop: the target's prefill, then rounds of propose / verify / keep."""
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    max_length = min(c.max_length for c in stopping_criteria if isinstance(c, MaxLengthCriteria))
    eos = set()
    for crit in stopping_criteria:
        if isinstance(crit, EosTokenCriteria):
            eos.update(int(t) for t in torch.as_tensor(crit.eos_token_id).flatten().tolist())
    bsz, prompt_len = input_ids.shape
    steps = max_length - prompt_len
    if steps <= 0:
        return input_ids
    mask = model_kwargs.get("attention_mask")
    position_ids = model_kwargs.get("position_ids")
    prompts = [row[m.bool()].tolist() for row, m in zip(input_ids, mask)] if mask is not None else input_ids.tolist()

    logits = cache.step(input_ids, mask, 1, position_ids)[:, -1]  # [B, V]
    pending = torch.argmax(logits.float(), dim=-1).tolist()  # next token of each request, not in the pool yet
    outputs = [[t] for t in pending]
    done = [t in eos or steps == 1 for t in pending]
    if not all(done):
        proposer.start(input_ids, mask, position_ids, prompts)
    while not all(done):
        live = [b for b in range(bsz) if not done[b]]
        # Each live request feeds its pending token and its candidates: 1 + c_b tokens, ragged.
        proposal = proposer.propose(live, pending, outputs, [steps - len(outputs[b]) - 1 for b in live])
        # per live request: its candidates, and the argmax after each token it fed
        cands, preds = _verify(cache, live, [pending[b] for b in live], proposal)
        kept = []
        for b, c, p in zip(live, cands, preds):
            n = 0
            while n < len(c) and c[n] == p[n]:
                n += 1
            kept.append(n)
            cache.truncate_each([b], [cache.lengths[b] - (len(c) - n)])  # drop the rejected candidates
            new = c[:n] + [p[n]]
            for t in new:
                outputs[b].append(t)
                if t in eos or len(outputs[b]) == steps:
                    done[b] = True
                    break
            pending[b] = new[-1]
        proposer.accepted(live, cands, kept)
    width = max(len(o) for o in outputs)
    pad = generation_config._pad_token_tensor
    fill = int(pad) if pad is not None else 0
    out = [o + [fill] * (width - len(o)) for o in outputs]
    return torch.cat([input_ids, torch.tensor(out, dtype=input_ids.dtype, device=input_ids.device)], dim=1)


def _verify(cache: PagedCache, live: list[int], pending: list[int], proposal: _Proposal) -> tuple[list[list[int]], list[list[int]]]:
    """One step of request ``live[i]``'s pending token and its candidates; returns the
    candidates and the argmax of the logits after each fed token, both on the host (the
    round's one read of the device)."""
    device = cache.pool.device
    counts = [1 + c for c in proposal.counts]
    if proposal.device is None:
        ids = to_device(torch.tensor([t for p, c in zip(pending, proposal.host) for t in [p] + c], dtype=torch.long), device)
    else:  # [pending..., candidates...] permuted request-major: one copy up, one gather
        order, start = [], len(pending)
        for i, c in enumerate(proposal.counts):
            order += [i] + list(range(start, start + c))
            start += c
        host = to_device(torch.tensor(pending + order, dtype=torch.long), device)
        ids = torch.cat([host[: len(pending)], proposal.device]).index_select(0, host[len(pending) :])
    # [T, V]; a round without candidates is a decode step: its graph serves it
    logits = cache.extend_each(live, ids, counts, all_logits=any(c > 1 for c in counts))
    preds = argmax_last_dim(logits)  # = of the float32 logits: widening is exact and keeps the order
    if proposal.device is None:
        flat, cands = preds.tolist(), proposal.host
    else:
        both = torch.cat([preds, proposal.device]).tolist()
        flat, rest, cands, start = both[: preds.numel()], both[preds.numel() :], [], 0
        for c in proposal.counts:
            cands.append(rest[start : start + c])
            start += c
    out, start = [], 0
    for n in counts:
        out.append(flat[start : start + n])
        start += n
    return cands, out
