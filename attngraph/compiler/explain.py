"""`attngraph.explain`: which attention sites a model has, which are lowered, and why not."""

from __future__ import annotations

from typing import Any

import torch

from ..config import CompileConfig
from ..errors import AttnGraphError
from .backend import AttnGraphBackend
from .model_checks import check_attn_implementation
from .ragged_check import ragged_token_mixing
from .report import AttentionReport


def explain(model: torch.nn.Module, *args: Any, config: CompileConfig | None = None, **kwargs: Any) -> AttentionReport:
    """Trace ``model(*args, **kwargs)`` once through the passes and report every attention site.

    For a generation model the report also lists the ops outside attention that move data
    between tokens (``report.token_mixing``: convolutions, scans, SSM or linear-attention
    layers), which `attngraph.accelerate` refuses. The model itself is not changed. Example::

        report = attngraph.explain(model, input_ids)
        print(report)                      # table: site, kind, lowered, reason
        assert report.num_lowered == model.config.num_hidden_layers
    """
    check_attn_implementation(model)
    cfg = (config or CompileConfig()).replace(piece_compiler="eager")
    backend = AttnGraphBackend(cfg)
    compiled = torch.compile(model, backend=backend)
    try:
        with torch.no_grad():
            compiled(*args, **kwargs)
    except torch._dynamo.exc.BackendCompilerFailed as exc:
        # Dynamo wraps what the backend raised; attngraph's own error is the useful one.
        inner = getattr(exc, "inner_exception", None)
        if isinstance(inner, AttnGraphError):
            raise inner from None
        raise
    report = backend.report
    if hasattr(model, "generate") and not getattr(getattr(model, "config", None), "is_encoder_decoder", True):
        report.token_mixing.extend((-1, op) for op in ragged_token_mixing(model, cfg) or ())
    return report
