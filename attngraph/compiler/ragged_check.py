"""What the paged runtime would refuse: the token-mixing ops of a model's ragged-form graph.

`explain` calls `ragged_token_mixing` so that its report lists the ops outside attention that
move data between tokens (`passes.token_mixing`), without building a KV pool or running
anything: the compile is stopped once the backend has checked the graph.
"""

from __future__ import annotations

import itertools
import logging
import types

import torch

from ..config import CompileConfig
from ..passes.token_mixing import TokenMixingOp
from .backend import AttnGraphBackend

logger = logging.getLogger(__name__)

#: The ragged forward's inputs: ``input_ids, position_ids: [1, N]``, ``logits_indices: [L]``.
TOKEN_INPUTS = ("input_ids", "position_ids")
ROW_INDEX_INPUTS = ("logits_indices",)
_ids = itertools.count()


class _Checked(Exception):
    """Stops the compile after the checks (nothing needs to run)."""


def ragged_token_mixing(model: torch.nn.Module, config: CompileConfig) -> list[TokenMixingOp] | None:
    """Trace ``model`` in ragged form (``input_ids[1, N]``, ``position_ids[1, N]``, no cache,
    logits at ``logits_indices[L]``; N and L dynamic) and return its token-mixing ops, or None
    when the model cannot be traced that way (then `accelerate` would say why)."""

    def stop(_sites) -> None:
        raise _Checked

    backend = AttnGraphBackend(
        config.replace(piece_compiler="eager"),
        mode="paged",
        trusted_positions=("position_ids",),
        on_sites=stop,
        token_inputs=TOKEN_INPUTS,
        row_index_inputs=ROW_INDEX_INPUTS,
    )

    def ragged_forward(input_ids, position_ids, logits_indices):
        return model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=logits_indices).logits

    # A code object of its own per call: Dynamo's cache and recompile budget are per code object.
    code = ragged_forward.__code__.replace(co_name=f"explain_ragged_forward_{next(_ids)}")
    fn = types.FunctionType(code, ragged_forward.__globals__, code.co_name, None, ragged_forward.__closure__)
    device = next(model.parameters()).device
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    pos = torch.arange(2, device=device)[None]
    rows = torch.arange(2, device=device)
    for t, dim in ((ids, 1), (pos, 1), (rows, 0)):
        torch._dynamo.mark_dynamic(t, dim)
    try:
        with torch.no_grad():
            torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(ids, pos, rows)
    except Exception as exc:  # noqa: BLE001 - _Checked arrives wrapped by Dynamo
        if not _is_checked(exc):
            logger.debug("explain: no ragged-form check (%s: %s)", type(exc).__name__, exc)
            return None
    return [op for _, op in backend.report.token_mixing]


def _is_checked(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, _Checked):
            return True
        exc = getattr(exc, "inner_exception", None) or exc.__cause__
    return False
