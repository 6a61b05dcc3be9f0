"""What the paged runtime serves of a `generate` call, checked before the first step.

Three checks, each either passes or raises an `AttnGraphError` that names the option:

* `check_forward_kwargs`: every keyword transformers would pass to the model's forward
  either has a meaning the paged step reproduces, or is refused by name (never dropped).
* `check_prompt_layout`: the padding layout of the prompt's 2-D ``attention_mask``. Left
  padding is served; right padding is refused (HF predicts from the pad column); holes
  (zeros between real tokens) are served unless a layer has a sliding window (HF's window
  counts columns, masked ones included; the pool holds real tokens only).
* `check_capacity`: the pool and ``max_context_len`` can hold the whole call.
"""

from __future__ import annotations

import math

import torch

from ..errors import KVCacheFullError, UnsupportedGenerationError

#: Forward keywords the paged step gives HF's meaning (`PagedCache.step` reads them).
SERVED_FORWARD_KWARGS = frozenset(
    {"input_ids", "attention_mask", "position_ids", "use_cache", "logits_to_keep", "return_dict", "cache", "past_key_values"}
)
#: Keywords transformers' ``prepare_inputs_for_generation`` never forwards.
NEVER_FORWARDED = frozenset({"labels", "next_sequence_length"})
#: Flags whose False is the forward's default.
OFF_BY_DEFAULT = frozenset({"output_attentions", "output_hidden_states"})

_RESTORE = "call attngraph.restore(model) (HF's own generate) or use an un-accelerated copy (copy.deepcopy(model))"


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value)[:40]


def check_forward_kwargs(kwargs: dict) -> None:
    """Raise `UnsupportedGenerationError` naming each keyword of ``kwargs`` (the model kwargs
    of a generate call, or one forward's keywords) that the paged step would not honour."""
    for name in ("output_attentions", "output_hidden_states"):
        if kwargs.get(name):
            raise UnsupportedGenerationError(
                f"{name}=True is not supported by attngraph's accelerated generate: the paged runtime computes "
                f"logits only, no per-layer {'attention weights' if 'attention' in name else 'hidden states'}. "
                f"Drop it, or {_RESTORE}."
            )
    position_ids = kwargs.get("position_ids")
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() != 2:
        raise UnsupportedGenerationError(
            f"position_ids of shape {tuple(position_ids.shape)} is not supported: the paged runtime takes 2-D "
            f"[batch, seq] (or [1, seq]) positions. For other position layouts {_RESTORE}."
        )
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() != 2:
        raise UnsupportedGenerationError(
            f"attention_mask of shape {tuple(mask.shape)} is not supported: pass a 2-D [batch, seq] padding "
            f"mask (a custom 4-D mask cannot be served by the paged runtime), or {_RESTORE}."
        )
    refused = [
        f"{name}={_describe(value)}"
        for name, value in kwargs.items()
        if value is not None
        and name not in SERVED_FORWARD_KWARGS
        and name not in NEVER_FORWARDED
        and not (name in OFF_BY_DEFAULT and value is False)
    ]
    if refused:
        raise UnsupportedGenerationError(
            f"model keyword argument(s) {', '.join(refused)} would reach the model's forward, but attngraph's "
            f"paged runtime runs the model with input_ids, attention_mask and position_ids only, so they would be "
            f"dropped. Served forward keywords: {sorted(SERVED_FORWARD_KWARGS - {'cache', 'past_key_values'})}. "
            f"Drop them, or {_RESTORE}."
        )


def check_prompt_layout(mask: torch.Tensor | None, counts_columns: bool) -> None:
    """``mask: [B, W]`` (1 = real token) of a prompt. Raises for an all-padding row, right
    padding, or holes when ``counts_columns`` (a sliding-window or chunked layer: HF measures
    its window or chunks in mask columns)."""
    if mask is None:
        return
    valid = mask.bool()
    counts = valid.sum(1)
    if bool((counts == 0).any()):
        row = int((counts == 0).nonzero()[0, 0])
        raise UnsupportedGenerationError(
            f"empty prompt in row {row} of the batch (all of its tokens are padding); give every row at least one token"
        )
    if bool((~valid[:, -1]).any()):
        row = int((~valid[:, -1]).nonzero()[0, 0])
        raise UnsupportedGenerationError(
            f"right padding: row {row} of the attention_mask ends with padding, so HF would predict the first new "
            "token from a pad column. Pad on the left (tokenizer.padding_side = 'left'), as decoder-only "
            "generation expects."
        )
    # A hole: a zero after the row's first one.
    seen = valid.long().cummax(1).values.bool()
    holes = seen & ~valid
    if counts_columns and bool(holes.any()):
        row = int(holes.any(1).nonzero()[0, 0])
        raise UnsupportedGenerationError(
            f"row {row} of the attention_mask has holes (zeros between real tokens) and the model has a sliding-window "
            "or chunked layer: HF's window and chunks count the masked columns, the paged KV pool holds real tokens "
            "only. Remove the "
            f"masked tokens from the prompt (left padding only), or {_RESTORE}."
        )


def check_capacity(pool, counts: list[int], new_tokens: int) -> None:
    """Raise `KVCacheFullError` before the first step when the call cannot fit.

    ``counts``: real prompt tokens per row; ``new_tokens``: tokens the call may generate. The
    last new token is never fed back, so row ``b`` stores at most ``counts[b] + new_tokens - 1``.
    """
    if new_tokens <= 0:
        return
    need = [c + new_tokens - 1 for c in counts]
    longest = max(need)
    if longest > pool.max_context_len:
        row = need.index(longest)
        raise KVCacheFullError(
            f"row {row} needs {longest} KV slots ({counts[row]} prompt tokens + max_new_tokens {new_tokens} - 1) but "
            f"max_context_len is {pool.max_context_len}; raise CompileConfig.max_context_len (attngraph.accelerate("
            "model, max_context_len=...)) or lower max_new_tokens / max_length"
        )
    pages = sum(math.ceil(n / pool.page_size) for n in need)
    if pages > pool.num_free_pages:
        raise KVCacheFullError(
            f"the batch needs {pages} KV pages ({sum(need)} tokens for {len(need)} rows: prompt + max_new_tokens "
            f"{new_tokens} - 1 each) but the pool has {pool.num_free_pages} free pages of {pool.page_size} tokens; "
            "raise CompileConfig.kv_cache_tokens or kv_memory_fraction, or lower max_new_tokens / the batch size"
        )
