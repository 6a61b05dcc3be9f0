"""Checks of a model that must fail before anything is traced.

transformers picks an attention implementation per model (``attn_implementation=`` at load
time). The passes read SDPA and the eager matmul-softmax-matmul pattern; other
implementations (``flex_attention`` with its higher-order op, ``flash_attention_2``, the
paged and hub kernels) hide the attention from the graph or cannot be traced, so they are
refused here with the names that work (`explain`, `accelerate`). Stateless
``torch.compile(model, backend="attngraph")`` still runs such a model, its attention unlowered.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedModelError

#: ``attn_implementation`` values whose attention the passes read and lower.
SUPPORTED_ATTN_IMPLEMENTATIONS = ("sdpa", "eager")

_RELOAD = (
    "load the model with attn_implementation='sdpa' or 'eager' (both are lowered), e.g. "
    "AutoModelForCausalLM.from_pretrained(path, attn_implementation='sdpa'), or call "
    "model.set_attn_implementation('sdpa')"
)


def check_attn_implementation(model: torch.nn.Module) -> None:
    """Raise `UnsupportedModelError` when ``model.config`` names an attention implementation other
    than SDPA or eager. Models without a transformers config pass (the passes judge their graph)."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl is None or impl in SUPPORTED_ATTN_IMPLEMENTATIONS:
        return
    raise UnsupportedModelError(
        f"{type(model).__name__} uses attn_implementation={impl!r}, which attngraph cannot lower; "
        f"supported: {list(SUPPORTED_ATTN_IMPLEMENTATIONS)}. {_RELOAD}."
    )
