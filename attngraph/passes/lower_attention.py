"""Pass `lower_attention`: replace each lowerable site with ``torch.ops.attngraph.attention``.

Before::

    key = k.expand(b, 2, 2, s, 16).reshape(b, 4, s, 16)
    out = scaled_dot_product_attention(q, key, value, attn_mask=causal_mask, scale=0.25)

After::

    q_t = q.transpose(1, 2).reshape(-1, 4, 16)            # [B*S, Hq, D]
    k_t = k.transpose(1, 2).reshape(-1, 2, 16)            # [B*S, Hkv, D]  (no repeat_kv)
    v_t = v.transpose(1, 2).reshape(-1, 2, 16)
    o = torch.ops.attngraph.attention(q_t, k_t, v_t, layer_id, 0.25, True, -1, 0.0, b)
    out = o.view(b, s, 4, 16).transpose(1, 2)             # [B, Hq, S, Dv], as before

The mask and repeat_kv code become dead; `cleanup` removes them.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import fx

from .. import ops  # noqa: F401  (registers the op)
from .site import AttentionSite

logger = logging.getLogger(__name__)

ATTENTION_OP = torch.ops.attngraph.attention.default


def lower_attention(gm: fx.GraphModule, sites: list[AttentionSite]) -> int:
    """Rewrite every ``site.lowerable`` site in place; returns how many were lowered."""
    graph = gm.graph
    count = 0
    for site in sites:
        if not site.lowerable or site.lowered:
            continue
        node = site.output
        with graph.inserting_before(node):
            bsz = graph.call_method("size", (site.q, 0))
            q_len = graph.call_method("size", (site.q, 2))
            q_t = _ragged(graph, site.q, site.num_q_heads, site.head_dim)
            k_t = _ragged(graph, site.k, site.num_kv_heads, site.head_dim)
            v_t = _ragged(graph, site.v, site.num_kv_heads, site.v_head_dim)
            scale = _scale_arg(graph, site)
            args = (q_t, k_t, v_t, site.layer_id, scale, site.causal, site.window_left, site.logit_cap, bsz)
            sinks = graph.call_method("reshape", (site.sinks, -1)) if site.sinks is not None else None  # [Hq]
            # optional trailing arguments, each given when it or a later one is set
            if sinks is not None or site.chunk_size > 0 or site.alibi_slopes is not None:
                args += (sinks,)
            if site.chunk_size > 0 or site.alibi_slopes is not None:
                args += (site.chunk_size,)
            if site.alibi_slopes is not None:
                args += (list(site.alibi_slopes),)
            out = graph.call_function(ATTENTION_OP, args)
            out = graph.call_method("view", (out, bsz, q_len, site.num_q_heads, site.v_head_dim))
            out = graph.call_method("transpose", (out, 1, 2))  # [B, Hq, Sq, Dv]
            if site.extra.get("merged_heads"):  # Bloom's 3-D form: [B * Hq, Sq, Dv]
                out = graph.call_method("reshape", (out, -1, q_len, site.v_head_dim))
        out.meta["nn_module_stack"] = dict(node.meta.get("nn_module_stack", {}))
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        site.lowered = True
        site.output = out
        count += 1
    if count:
        gm.recompile()
    logger.debug("lower_attention: lowered %d of %d sites", count, len(sites))
    return count


def _ragged(graph: fx.Graph, x: fx.Node, heads: int, dim: int) -> fx.Node:
    """``[B, H, S, D] -> [B*S, H, D]``."""
    t = graph.call_method("transpose", (x, 1, 2))
    return graph.call_method("reshape", (t, -1, heads, dim))


def _scale_arg(graph: fx.Graph, site: AttentionSite):
    scale = site.scale
    if not scale.runtime:
        return float(scale.constant)
    value = scale.constant
    for n in scale.runtime:
        value = graph.call_function(operator.mul, (value, n))
    return value
