"""Which weight each decode layer's attention kernel asks into L2 (`CompileConfig.l2_prefetch_o`).

At batch 1 a layer's decode attention reads a few hundred kilobytes and runs for microseconds
between two bandwidth-bound projections: the memory idles. The projection right after it is
the attention's output projection, whose weight (8 MiB for the Llama-3.2-1B shape, 32 MiB for
8B) fits in L2. The Triton decode kernel, once past its programmatic-dependent-launch wait
(the q/k/v projection has finished streaming), asks L2 for that weight with bulk prefetches
(`decode_attention_fwd(l2_next=...)`), so the output projection reads it from L2. No launch of
its own, unlike `runtime.mlp_prefetch`.

Off by default (`CompileConfig.l2_prefetch_o`): on an H100 the 1B and 8B batch-1 steps were
0.5-1% slower with it, batch 16 tied. Most likely the output projection's programs, launched
early under PDL, already load their first weight chunk during attention, and the lines
prefetched for the rest do not arrive sooner than its own loads would.

`o_prefetch_source` maps attention layer ``i`` to decoder layer ``i`` of the model's layer list
(`mlp_prefetch.layer_source`) and returns that layer's attention output weight: the module
named `OUT_NAMES` inside the attention module named `ATTENTION_NAMES`. A model whose layers do
not match gets no prefetch; a wrong guess would only cost bandwidth, never a value.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .mlp_prefetch import layer_source

#: Attribute names of a decoder layer's attention block in transformers' models.
ATTENTION_NAMES = ("self_attn", "self_attention", "attention", "attn")
#: Attribute names of an attention block's output projection (Llama / Qwen / Mistral / Gemma,
#: OPT / BART, GPT-NeoX / Falcon / Phi, GPT-2 / GPT-J's Conv1D, T5-style).
OUT_NAMES = ("o_proj", "out_proj", "dense", "c_proj", "wo")


def output_weight(layer: nn.Module) -> torch.Tensor | None:
    """The weight of ``layer``'s attention output projection, or None where none is found."""
    for attn_name in ATTENTION_NAMES:
        attn = getattr(layer, attn_name, None)
        if not isinstance(attn, nn.Module):
            continue
        for out_name in OUT_NAMES:
            weight = getattr(getattr(attn, out_name, None), "weight", None)
            if isinstance(weight, torch.Tensor):
                return weight
    return None


def o_prefetch_source(model: nn.Module, num_layers: int) -> Callable[[int], tuple[torch.Tensor, int] | None]:
    """``layer_id -> (weight, bytes) or None``: attention layer ``layer_id``'s output weight
    (`output_weight`) and its size in bytes, looked up when asked (`mlp_prefetch.layer_source`)."""

    def pick(layer: nn.Module) -> tuple[torch.Tensor, int] | None:
        weight = output_weight(layer)
        return None if weight is None else (weight, weight.numel() * weight.element_size())

    return layer_source(model, num_layers, pick)
