"""`HybridBackend`: one backend for prefill steps, another for decode steps.

Prefill (EXTEND / MIXED) is compute bound and decode is bandwidth bound, so the best kernel
family can differ (``CompileConfig.prefill_attention_backend`` /
``decode_attention_backend``). The hybrid owns no metadata of its own: each step it forwards
``init_forward_metadata*`` and ``forward`` to the backend of the batch's mode, so the two
children keep fully separate metadata and buffers. IDLE steps touch neither.

`create_attention_backend` turns the three config fields into a backend: a single backend
when prefill and decode resolve to the same name, else a `HybridBackend`.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch

from ..config import CompileConfig
from ..errors import InputError
from ..forward_batch import ForwardBatch, ForwardMode
from .base import AttentionBackend, AttentionLayer, BackendCapabilities, GraphSupport, ModelAttentionSpec
from .registry import create_backend, resolve_backend_name

logger = logging.getLogger(__name__)


def _meet(a: tuple | None, b: tuple | None) -> tuple | None:
    """Intersection of two "allowed values" tuples where ``None`` means any (order of ``a``)."""
    if a is None:
        return b
    if b is None:
        return a
    return tuple(x for x in a if x in b)


def combine_capabilities(prefill: BackendCapabilities, decode: BackendCapabilities) -> BackendCapabilities:
    """What the pair can serve.

    A model runs both kinds of step, so device types, dtypes, head dims, page sizes and the
    feature flags (window, softcap, non-causal) are the intersection of the two. Graph support
    is taken per mode from the backend that serves it (decode from ``decode``, extend from
    ``prefill``), and ``dense`` from ``prefill``, which serves the stateless form.
    """
    return BackendCapabilities(
        device_types=_meet(prefill.device_types, decode.device_types),
        device_hint=" ".join(dict.fromkeys(h for h in (prefill.device_hint, decode.device_hint) if h)),
        dtypes=_meet(prefill.dtypes, decode.dtypes),
        head_dims=_meet(prefill.head_dims, decode.head_dims),
        page_sizes=_meet(prefill.page_sizes, decode.page_sizes),
        sliding_window=prefill.sliding_window and decode.sliding_window,
        logit_cap=prefill.logit_cap and decode.logit_cap,
        non_causal=prefill.non_causal and decode.non_causal,
        distinct_v_head_dim=prefill.distinct_v_head_dim and decode.distinct_v_head_dim,
        sinks=prefill.sinks and decode.sinks,
        chunked=prefill.chunked and decode.chunked,
        alibi=prefill.alibi and decode.alibi,
        value_in_key=prefill.value_in_key and decode.value_in_key,
        dense=prefill.dense,
        graph_support={
            "decode": decode.graph_support["decode"],
            "extend": prefill.graph_support["extend"],
        },
        decode_metadata_on_device=decode.decode_metadata_on_device,
    )


class HybridBackend(AttentionBackend):
    """Routes by ``batch.mode``: DECODE -> ``decode_backend``; EXTEND / MIXED ->
    ``prefill_backend``; IDLE -> neither (empty output). Both children are built by the caller."""

    name = "hybrid"

    def __init__(
        self,
        prefill_backend: AttentionBackend,
        decode_backend: AttentionBackend,
        spec: ModelAttentionSpec | None = None,
    ) -> None:
        super().__init__(spec if spec is not None else prefill_backend.spec)
        self.prefill_backend = prefill_backend
        self.decode_backend = decode_backend
        # Instance attributes shadow the ClassVars of the base: they depend on the children.
        self.capabilities = combine_capabilities(prefill_backend.capabilities, decode_backend.capabilities)
        # Captured graphs are decode graphs (extend runs piecewise, attention eager).
        self.cuda_graph_seq_len_fill_value = decode_backend.cuda_graph_seq_len_fill_value

    def __repr__(self) -> str:
        return f"HybridBackend(prefill={self.prefill_backend.name}, decode={self.decode_backend.name})"

    def backend_for(self, mode: ForwardMode) -> AttentionBackend | None:
        """The child serving ``mode`` (None for IDLE)."""
        if mode is ForwardMode.IDLE:
            return None
        return self.decode_backend if mode is ForwardMode.DECODE else self.prefill_backend

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        child = self.backend_for(batch.mode)
        if child is not None:
            child.init_forward_metadata(batch)

    def init_forward_metadata_out_graph(self, batch: ForwardBatch, in_capture: bool = False) -> None:
        child = self.backend_for(batch.mode)
        if child is not None:
            child.init_forward_metadata_out_graph(batch, in_capture)

    def init_forward_metadata_in_graph(self, batch: ForwardBatch) -> None:
        child = self.backend_for(batch.mode)
        if child is not None:
            child.init_forward_metadata_in_graph(batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """The decode child always (decode graphs); the prefill child only if it captures
        extend attention itself (FULL), since PIECEWISE keeps attention out of the graphs."""
        self.decode_backend.init_cuda_graph_state(max_bs, max_num_tokens)
        if self.prefill_backend.capabilities.graph_support.get("extend") is GraphSupport.FULL:
            self.prefill_backend.init_cuda_graph_state(max_bs, max_num_tokens)

    def set_layer_kinds(self, layers: Iterable[AttentionLayer]) -> None:
        """Forward the model's layers to children that plan per layer kind (FlashInfer)."""
        layers = list(layers)
        for child in (self.prefill_backend, self.decode_backend):
            if hasattr(child, "set_layer_kinds"):
                child.set_layer_kinds(layers)

    def kernel_faults(self) -> str | None:
        faults = [f for child in (self.prefill_backend, self.decode_backend) if (f := child.kernel_faults())]
        return "; ".join(faults) or None

    # ------------------------------------------------------------------ compute
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        batch: ForwardBatch,
        save_kv_cache: bool = True,
        out: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        child = self.backend_for(batch.mode)
        if child is None:
            res = q.new_empty((q.shape[0], layer.num_q_heads, layer.v_head_dim))
            return res if out is None else out.copy_(res)
        return child.forward(q, k, v, layer, batch, save_kv_cache, out=out, **({} if rope is None else {"rope": rope}))

    def folds_rope(self, q, k, layer: AttentionLayer, batch: ForwardBatch) -> bool:
        child = self.backend_for(batch.mode)
        return child is not None and child.folds_rope(q, k, layer, batch)

    def forward_decode(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch, save_kv_cache: bool = True):
        return self.decode_backend.forward_decode(q, k, v, layer, batch, save_kv_cache)

    def forward_extend(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch, save_kv_cache: bool = True):
        return self.prefill_backend.forward_extend(q, k, v, layer, batch, save_kv_cache)

    def forward_dense(self, q, k, v, layer: AttentionLayer, batch_size: int) -> torch.Tensor:
        return self.prefill_backend.forward_dense(q, k, v, layer, batch_size)


def create_attention_backend(
    attention_backend: "str | CompileConfig" = "auto",
    prefill_attention_backend: str | None = None,
    decode_attention_backend: str | None = None,
    *,
    spec: ModelAttentionSpec,
) -> AttentionBackend:
    """The backend for a model: a single one, or a `HybridBackend` when prefill and decode differ.

    ``attention_backend`` is a registered name or ``"auto"``; it may also be a `CompileConfig`
    (its three backend fields), in which case the other two arguments must be left out.
    ``None`` for the prefill or decode name inherits ``attention_backend``. A config's
    ``deterministic`` and ``flashinfer_*`` options go to backends that take them. Names are resolved (``"auto"`` included)
    before comparing, so ``("auto", decode="triton")`` on a machine where auto picks Triton
    gives one backend. Raises `BackendUnavailableError` naming the alternatives when a name
    cannot serve ``spec``, and `InputError` for an ``attention_backend`` that is neither a name
    nor a `CompileConfig`, or a config together with names.
    """
    options = {}
    if isinstance(attention_backend, CompileConfig):
        cfg = attention_backend
        if prefill_attention_backend is not None or decode_attention_backend is not None:
            raise InputError("pass either a CompileConfig or backend names, not both")
        attention_backend = cfg.attention_backend
        prefill_attention_backend, decode_attention_backend = cfg.prefill_attention_backend, cfg.decode_attention_backend
        options.update(deterministic=cfg.deterministic, decode_tensor_cores=cfg.flashinfer_decode_tensor_cores,
                       extend_impl=cfg.flashinfer_extend)  # (FlashInfer's options; a backend takes those it names)
    elif not isinstance(attention_backend, str):
        raise InputError(f"attention_backend must be a backend name or a CompileConfig, got {type(attention_backend).__name__}")
    prefill_name = resolve_backend_name(prefill_attention_backend or attention_backend, spec)
    decode_name = resolve_backend_name(decode_attention_backend or attention_backend, spec)
    if prefill_name == decode_name:
        return create_backend(prefill_name, spec, **options)
    logger.info("attention: %s for prefill, %s for decode", prefill_name, decode_name)
    return HybridBackend(
        create_backend(prefill_name, spec, **options), create_backend(decode_name, spec, **options), spec
    )
