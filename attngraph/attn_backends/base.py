"""The AttentionBackend contract.

A backend turns one `ForwardBatch` into kernel metadata once per step
(`init_forward_metadata`), then serves every attention layer of that step (`forward`).
The split of the metadata work follows what CUDA graphs need:

* `init_forward_metadata_out_graph(batch, in_capture)`: host side, dynamic shapes, may read
  the host copies of the lengths (``batch.seq_lens_cpu``). Never recorded into a graph.
* `init_forward_metadata_in_graph(batch)`: static-shape device work only (no ``.item()``,
  ``.cpu()``, ``.tolist()``, no allocation); safe to record into a CUDA graph and replay.
* Piecewise / breakable graphs (attention eager between the captured pieces): a backend that
  sets `use_captured_forward_metadata_for_breakable_cuda_graph` creates its metadata once at
  capture (`init_forward_metadata_for_breakable_cuda_graph_capture`) and refreshes it in place
  before each replay (`prepare_forward_metadata_for_breakable_cuda_graph_replay`); any other
  gets `init_forward_metadata` every step.
* `forward(..., out=)`: the result written into a caller's buffer (the piecewise staging rows);
  by the kernel itself where `extend_writes_out` / `decode_writes_out`.

Layouts: ``q: [T, num_q_heads, head_dim]``, ``k/v: [T, num_kv_heads, head_dim]`` (GQA keeps its
own KV head count), output ``[T, num_q_heads, v_head_dim]``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from ..forward_batch import ForwardBatch


class GraphSupport(enum.IntEnum):
    """How much of a step a backend allows inside CUDA graphs."""

    NEVER = 0  # attention must run eagerly and its metadata cannot be refreshed in place
    PIECEWISE = 1  # attention runs eagerly between captured pieces
    FULL = 2  # attention itself is captured; metadata refreshed in place before replay


@dataclass(frozen=True)
class AttentionLayer:
    """Static attributes of one attention site, as lowered into the op.

    ``window_left``: a causal query at position ``i`` sees keys ``j`` with
    ``i - window_left <= j <= i``; a non-causal one sees ``|j - i| <= window_left``
    (``-1``: no window). ``logit_cap``: ``cap * tanh(s / cap)`` applied to the scaled scores
    (``0``: none). ``causal=False`` means every query sees every key of its request.
    ``sinks``: ``[Hq]`` attention-sink logits (GPT-OSS), in the units of the scaled scores:
    each joins its head's softmax as one more key without a value (None: no sinks). A tensor
    the op receives per call, so it takes no part in comparing or hashing layers.
    ``chunk_size``: chunked local attention (Llama 4), causal only: the sequence is cut into
    chunks of ``chunk_size`` positions from position 0, and a query at ``i`` sees keys ``j``
    with ``i - i % chunk_size <= j <= i`` (``0``: no chunks).
    ``alibi_slopes``: ALiBi, ``[Hq]`` slopes: ``slope[h] * (j - i)`` is added to head ``h``'s
    scaled score of the query at position ``i`` and the key at position ``j`` (after the
    softcap, before the mask); None: no bias.
    """

    layer_id: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    scale: float
    causal: bool = True
    window_left: int = -1
    logit_cap: float = 0.0
    sinks: "torch.Tensor | None" = field(default=None, compare=False, hash=False, repr=False)
    chunk_size: int = 0
    alibi_slopes: tuple[float, ...] | None = None
    #: The op passes ``sinks`` to this layer (known when the graph is compiled, before any
    #: tensor is: backends that plan per layer kind plan a sink variant). Set with ``sinks``.
    has_sinks: bool = False

    def __post_init__(self) -> None:
        """Refuse attributes no backend can serve, before any K/V is written with them."""
        from ..errors import InputError

        if self.sinks is not None and not self.has_sinks:
            object.__setattr__(self, "has_sinks", True)

        if self.chunk_size < 0 or (self.chunk_size > 0 and not self.causal):
            raise InputError(f"chunk_size must be >= 0 and needs causal=True; got {self.chunk_size} (causal={self.causal})")
        if self.alibi_slopes is not None and len(self.alibi_slopes) != self.num_q_heads:
            raise InputError(f"alibi_slopes has {len(self.alibi_slopes)} slopes for {self.num_q_heads} query heads")
        if self.alibi_slopes is not None and not all(math.isfinite(x) for x in self.alibi_slopes):
            raise InputError(f"alibi_slopes must be finite numbers, got {self.alibi_slopes}")
        if self.num_kv_heads <= 0 or self.num_q_heads % self.num_kv_heads:
            raise InputError(f"num_q_heads {self.num_q_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def gqa_group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


@dataclass(frozen=True)
class ModelAttentionSpec:
    """What a model asks of a backend: the union over its attention layers."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dims: tuple[int, ...]
    dtype: torch.dtype
    device_type: str
    page_size: int
    uses_window: bool = False
    uses_logit_cap: bool = False
    non_causal: bool = False
    #: Paged form: the pool's value head dim where it differs from the key head dim (the MHA
    #: form of multi-head latent attention: DeepSeek V2/V3 keys of 192, values of 128); None
    #: when they are equal, and in the stateless form.
    v_head_dim: int | None = None
    #: Some layer joins per-head sink logits to its softmax (GPT-OSS).
    uses_sinks: bool = False
    #: Some layer attends within fixed chunks of positions (Llama 4's local layers).
    uses_chunks: bool = False
    #: Some layer adds an ALiBi bias (Falcon, Bloom, MPT).
    uses_alibi: bool = False
    #: Paged form: the pool stores multi-head latent attention's latent + RoPE key as one KV
    #: head, and the values are its first ``v_head_dim`` columns (`passes.absorb_mla`).
    value_in_key: bool = False


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can serve. ``None`` in a tuple field means "any"."""

    device_types: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    head_dims: tuple[int, ...] | None = None
    page_sizes: tuple[int, ...] | None = None
    sliding_window: bool = True
    logit_cap: bool = True
    non_causal: bool = True
    dense: bool = True  # serves the stateless (no ForwardContext batch) form
    #: Serves a paged pool whose values have another head dim than its keys, in every mode.
    distinct_v_head_dim: bool = True
    #: Serves attention sinks (`AttentionLayer.sinks`) in every mode.
    sinks: bool = True
    #: Serves a pool whose values are its keys' first columns (MLA's latent cache).
    value_in_key: bool = True
    #: Serves chunked local attention (`AttentionLayer.chunk_size`) in every mode.
    chunked: bool = True
    #: Serves ALiBi biases (`AttentionLayer.alibi_slopes`) in every mode.
    alibi: bool = True
    #: Appended to a "runs on ..., not <device>" refusal: how to get the missing device support.
    device_hint: str = ""
    graph_support: dict[str, GraphSupport] = field(
        default_factory=lambda: {"decode": GraphSupport.NEVER, "extend": GraphSupport.NEVER}
    )
    #: Decode attention reads every per-step value (lengths, page table, new slots) from the
    #: batch's device tensors and plans nothing on the host, so several decode steps, each with
    #: its own tensors, can be recorded in one CUDA graph (a draft model's greedy steps).
    decode_metadata_on_device: bool = False

    def why_not(self, spec: ModelAttentionSpec) -> str | None:
        """None when ``spec`` can be served, else the reason in words."""
        if spec.device_type not in self.device_types:
            hint = f"; {self.device_hint}" if self.device_hint else ""
            return f"runs on {self.device_types}, not {spec.device_type}{hint}"
        if spec.dtype not in self.dtypes:
            return f"supports dtypes {[str(d) for d in self.dtypes]}, not {spec.dtype}"
        if spec.value_in_key and not self.value_in_key:
            return (
                f"does not serve multi-head latent attention over its latent cache (one KV head of "
                f"{max(spec.head_dims)} values, the first {min(spec.head_dims)} of them the values); "
                "CompileConfig(absorb_mla=False) keeps the expanded per-head K/V instead"
            )
        if self.head_dims is not None:
            bad = [d for d in spec.head_dims if d not in self.head_dims]
            if bad:
                return f"supports head dims {self.head_dims}, not {bad}"
        if self.page_sizes is not None and spec.page_size not in self.page_sizes:
            return f"supports page sizes {self.page_sizes}, not {spec.page_size}"
        if spec.uses_window and not self.sliding_window:
            return "does not support sliding-window attention"
        if spec.uses_logit_cap and not self.logit_cap:
            return "does not support logit softcapping"
        if spec.non_causal and not self.non_causal:
            return "does not support non-causal attention"
        if spec.v_head_dim is not None and not self.distinct_v_head_dim:
            return f"does not serve a paged cache whose values ({spec.v_head_dim}) are narrower or wider than its keys"
        if spec.uses_sinks and not self.sinks:
            return "does not support attention sinks (per-head logits joined to the softmax)"
        if spec.uses_chunks and not self.chunked:
            return "does not support chunked local attention (keys within the query's chunk of positions)"
        if spec.uses_alibi and not self.alibi:
            return "does not support ALiBi position biases"
        return None


class AttentionBackend:
    """Base class of every attention backend (see the module docstring for the contract)."""

    name: ClassVar[str] = "base"
    capabilities: ClassVar[BackendCapabilities]
    #: Lengths used for dummy requests while capturing: 1, not 0, since capture really runs kernels.
    cuda_graph_seq_len_fill_value: ClassVar[int] = 1
    #: True when `forward_extend` takes ``out=`` and its kernel writes the result there (no copy).
    extend_writes_out: ClassVar[bool] = False
    #: True when `forward_decode` takes ``out=`` and its kernel writes the result there (no copy).
    decode_writes_out: ClassVar[bool] = False
    #: Piecewise / breakable CUDA graphs (attention runs between the captured pieces): True when
    #: the backend creates its step metadata once, when the runner captures
    #: (`init_forward_metadata_for_breakable_cuda_graph_capture`), with device buffers at fixed
    #: addresses, and refreshes it in place before each replay
    #: (`prepare_forward_metadata_for_breakable_cuda_graph_replay`); False: the runner calls
    #: `init_forward_metadata` every step and the backend builds fresh metadata.
    use_captured_forward_metadata_for_breakable_cuda_graph: ClassVar[bool] = False

    def __init__(self, spec: ModelAttentionSpec | None = None) -> None:
        self.spec = spec

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, batch: "ForwardBatch") -> None:
        """Prepare metadata for ``batch``; called once per step before the first layer."""
        self.init_forward_metadata_out_graph(batch, in_capture=False)
        self.init_forward_metadata_in_graph(batch)

    def init_forward_metadata_out_graph(self, batch: "ForwardBatch", in_capture: bool = False) -> None:
        """Host-side, dynamic-shape work (planning); never recorded into a CUDA graph."""

    def init_forward_metadata_in_graph(self, batch: "ForwardBatch") -> None:
        """Static-shape device work only; may be recorded into a CUDA graph."""

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Preallocate every buffer a captured kernel reads (indptr, indices, split buffers)."""

    def init_forward_metadata_for_breakable_cuda_graph_capture(self, batch: "ForwardBatch") -> Any:
        """Create the metadata the piecewise / breakable graphs are captured with, for the
        capture's dummy ``batch``, and make it this step's; returns it (an object the runner
        hands back to `prepare_forward_metadata_for_breakable_cuda_graph_replay`). Only for
        backends that set `use_captured_forward_metadata_for_breakable_cuda_graph`."""
        raise NotImplementedError(f"{type(self).__name__} builds fresh metadata every step")

    def prepare_forward_metadata_for_breakable_cuda_graph_replay(self, capture_metadata: Any, batch: "ForwardBatch") -> None:
        """Refresh ``capture_metadata`` in place for ``batch`` (same buffers, new contents) and
        make it this step's, before the runner replays the pieces around attention."""
        raise NotImplementedError(f"{type(self).__name__} builds fresh metadata every step")

    def set_layer_kinds(self, layers: "list[AttentionLayer]") -> None:
        """The model's attention layers, known once the model is traced (for per-kind planning)."""

    def kernel_faults(self) -> str | None:
        """What this backend's kernels have reported as faults since it was made (a counter
        read from the device, so a sync where there is one to read), or None."""
        return None

    # ------------------------------------------------------------------ compute
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        batch: "ForwardBatch",
        save_kv_cache: bool = True,
        out: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Paged attention of the new tokens of ``batch``.

        ``q: [T, Hq, D]``, ``k: [T, Hkv, D]``, ``v: [T, Hkv, Dv]`` are the new tokens'; with
        ``save_kv_cache`` the backend writes k/v into the pool at ``batch.out_cache_loc`` first.
        Returns ``[T, Hq, Dv]``; with ``out`` (contiguous ``[T, Hq, Dv]``) the result is written
        there and ``out`` is returned (by the kernel itself where `extend_writes_out` /
        `decode_writes_out`). ``rope``: ``(cos, sin)`` rows ``[T, D]`` of HF's rotary
        embedding still to be applied to q and k, passed only where `folds_rope` said the
        decode kernel applies them (`attngraph.ops` rotates q and k itself otherwise).
        """
        from ..forward_batch import ForwardMode

        check_out(out, q, layer)
        extra = {} if rope is None else {"rope": rope}
        if rope is not None and batch.mode is not ForwardMode.DECODE:
            from ..errors import InputError

            raise InputError(f"{type(self).__name__}: rotary rows reach the backend only for a decode step; got {batch.mode}")
        if batch.mode is ForwardMode.IDLE:
            res = q.new_empty((q.shape[0], layer.num_q_heads, layer.v_head_dim))
        elif batch.mode is ForwardMode.DECODE and out is not None and self.decode_writes_out and out.is_contiguous():
            return self.forward_decode(q, k, v, layer, batch, save_kv_cache, out=out, **extra)
        elif batch.mode is ForwardMode.DECODE:
            res = self.forward_decode(q, k, v, layer, batch, save_kv_cache, **extra)
        elif out is not None and self.extend_writes_out:
            return self.forward_extend(q, k, v, layer, batch, save_kv_cache, out=out)
        else:
            res = self.forward_extend(q, k, v, layer, batch, save_kv_cache)
        if out is None:
            return res
        out.copy_(res)
        return out

    def forward_decode(self, q, k, v, layer: AttentionLayer, batch: "ForwardBatch", save_kv_cache: bool = True) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no decode path")

    def folds_rope(self, q: torch.Tensor, k: torch.Tensor, layer: AttentionLayer, batch: "ForwardBatch") -> bool:
        """Whether this call's kernel applies HF's rotary embedding to q and k itself (`forward`
        then gets ``rope``). Never, unless a backend says so: `attngraph.ops` rotates them
        first."""
        return False

    def forward_extend(self, q, k, v, layer: AttentionLayer, batch: "ForwardBatch", save_kv_cache: bool = True) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no extend path")

    def forward_dense(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch_size: int
    ) -> torch.Tensor:
        """Stateless attention over a dense batch.

        ``q: [B * Sq, Hq, D]``, ``k/v: [B * Sk, Hkv, D]`` with every sequence of the same
        length; causal attention is aligned bottom-right (query ``i`` sits at key position
        ``Sk - Sq + i``). Returns ``[B * Sq, Hq, Dv]``.
        """
        raise NotImplementedError(f"{type(self).__name__} has no dense path")

    # ------------------------------------------------------------------ helpers
    def save_kv(self, layer: AttentionLayer, batch: "ForwardBatch", k: torch.Tensor, v: torch.Tensor) -> None:
        batch.kv_pool.write(layer.layer_id, batch.out_cache_loc, k, v)


def check_out(out: torch.Tensor | None, q: torch.Tensor, layer: AttentionLayer) -> None:
    """`InputError` unless ``out`` is None or a ``[T, Hq, Dv]`` tensor on ``q``'s device (checked
    before a backend writes anything, the pool included)."""
    if out is None:
        return
    want = (q.shape[0], layer.num_q_heads, layer.v_head_dim)
    if tuple(out.shape) != want or out.device != q.device:
        from ..errors import InputError

        raise InputError(
            f"out= must be a {list(want)} tensor on {q.device} (the new tokens' attention output), "
            f"got {list(out.shape)} on {out.device}"
        )
