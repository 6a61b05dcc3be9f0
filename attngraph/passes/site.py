"""`AttentionSite`: one attention computation found in a graph, and whether it may be lowered."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import fx


@dataclass
class ScaleExpr:
    """A product of a constant and runtime scalars (``x.item()`` of unspecialized float attributes)."""

    constant: float = 1.0
    runtime: list[fx.Node] = field(default_factory=list)

    def times(self, other: "ScaleExpr") -> "ScaleExpr":
        return ScaleExpr(self.constant * other.constant, self.runtime + other.runtime)

    def describe(self) -> str:
        return f"{self.constant:.6g}" + "".join(f"*{n.name}" for n in self.runtime)


@dataclass
class AttentionSite:
    """An attention computation ``softmax(scale * q @ k^T [softcap] [+ mask]) @ v`` in a graph.

    ``q: [B, Hq, Sq, D]``, ``k: [B, Hkv, Sk, D]``, ``v: [B, Hkv, Sk, Dv]`` are the nodes before
    any repeat_kv (GQA keeps ``Hkv`` heads); ``output`` is the node producing
    ``[B, Hq, Sq, Dv]`` (the SDPA call or the final matmul).
    """

    name: str
    kind: str  # "sdpa" | "eager"
    output: fx.Node
    q: fx.Node | None = None
    k: fx.Node | None = None
    v: fx.Node | None = None
    mask: fx.Node | None = None
    scale: ScaleExpr | None = None
    logit_cap: float | fx.Node = 0.0
    #: ``[Hq]`` attention-sink logits (a parameter node), joined to each head's softmax.
    sinks: fx.Node | None = None
    causal: bool = True
    window_left: int = -1
    #: Chunked local attention: keys within the query's chunk of this many positions (0: none).
    chunk_size: int = 0
    #: ALiBi: ``[Hq]`` per-head slopes of a bias ``slope * (key position - query position)``
    #: added to the scaled scores, proven from the graph (`position_bias`); None: no bias.
    alibi_slopes: tuple[float, ...] | None = None
    num_q_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    v_head_dim: int = 0
    layer_index: int | None = None
    layer_id: int = -1  # index into the KV pool; set by find_attention
    lowerable: bool = False
    reason: str = ""
    lowered: bool = False
    #: The values are the keys' first ``v_head_dim`` columns (multi-head latent attention over
    #: its latent, `absorb_mla`): the paged pool stores the keys alone.
    value_in_key: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def as_layer(self):
        """The static `AttentionLayer` the op is called with (constant scale and cap only)."""
        from ..attn_backends.base import AttentionLayer

        if self.scale is None or self.scale.runtime or isinstance(self.logit_cap, fx.Node):
            raise ValueError(f"site {self.name} has a runtime scale or softcap")
        return AttentionLayer(
            self.layer_id, self.num_q_heads, self.num_kv_heads, self.head_dim, self.v_head_dim,
            float(self.scale.constant), self.causal, self.window_left, float(self.logit_cap), chunk_size=self.chunk_size,
            alibi_slopes=self.alibi_slopes, has_sinks=self.sinks is not None,
        )

    def refuse(self, reason: str) -> "AttentionSite":
        self.lowerable = False
        self.reason = reason
        return self

    def describe(self) -> str:
        """One line: what the site computes."""
        parts = ["causal" if self.causal else "full"]
        if self.window_left >= 0:
            parts.append(f"window={self.window_left + 1}")
        if self.chunk_size > 0:
            parts.append(f"chunks={self.chunk_size}")
        if isinstance(self.logit_cap, fx.Node) or self.logit_cap:
            cap = self.logit_cap.name if isinstance(self.logit_cap, fx.Node) else f"{self.logit_cap:g}"
            parts.append(f"softcap={cap}")
        if self.sinks is not None:
            parts.append("sinks")
        if self.alibi_slopes is not None:
            parts.append("alibi")
        if "mla" in self.extra:
            mla = self.extra["mla"]
            parts.append(f"mla latent={mla['latent_dim']}+rope={mla['rope_dim']}")
        if self.num_kv_heads and self.num_q_heads != self.num_kv_heads:
            parts.append(f"gqa={self.num_q_heads}/{self.num_kv_heads}")
        if self.scale is not None:
            parts.append(f"scale={self.scale.describe()}")
        return ", ".join(parts)
