"""`ForwardContext`: what the attention op reads during one forward (published, then restored).

The compiled graph does not carry the KV pool or per-step metadata as inputs; the op
`torch.ops.attngraph.attention` looks them up here. A context is frozen and lives exactly as
long as one forward: `use_forward_context` restores the previous one on exit, exceptions
included.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from .attn_backends.base import AttentionBackend
    from .forward_batch import ForwardBatch


@dataclass(frozen=True)
class ForwardContext:
    """``backend``: serves the op. ``batch``: the paged step (None in the stateless, dense form).
    ``num_logits``: how many of the step's logits rows are real, when the caller padded them
    (a captured decode batch of one runs two rows); None: not known here, every row counts."""

    backend: "AttentionBackend"
    batch: "ForwardBatch | None" = None
    num_logits: int | None = None


_state = threading.local()


def get_forward_context() -> ForwardContext | None:
    """The context of the forward running on this thread, or None outside one."""
    return getattr(_state, "ctx", None)


@contextlib.contextmanager
def use_forward_context(ctx: ForwardContext | None) -> Iterator[ForwardContext | None]:
    previous = getattr(_state, "ctx", None)
    _state.ctx = ctx
    try:
        yield ctx
    finally:
        _state.ctx = previous
