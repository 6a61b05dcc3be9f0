"""Pass `find_attention`: locate attention in a Dynamo FX graph and decide what is lowerable.

Two forms are recognized:

* SDPA: ``scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale,
  enable_gqa)``, with or without HF's repeat_kv chain in front of k/v;
* eager: ``matmul(q, k.transpose(-2, -1))``, scale by mul/div (of the scores or of q; of
  the scores also in place, ``s /= c``), optional softcap ``cap * tanh(s / cap)``, optional
  mask add, optional attention sinks (GPT-OSS: a per-head parameter appended as one more
  column of scores, the row maximum subtracted, its probability dropped after the softmax),
  ``softmax(-1)`` with or without an fp32 upcast and cast back, dropout, a same-shape view,
  ``matmul(p, v)``.

A softmax over keys multiplied with values that does not fit these forms (an ALiBi bias added
to the scores, Bloom's ``baddbmm`` on ``[B*H, S, D]``) is reported as a refused site with the
reason, and so is any other softmax over the last dimension of scores that come from a product
of two activations, so that the paged runtime fails loudly instead of missing a cross-token op
and `explain` shows every site.

Before/after (this pass only reads the graph)::

    key = full_key.expand(b, 2, 2, s, 16).reshape(b, 4, s, 16)   # repeat_kv
    out = scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=0.25)
    -> AttentionSite(kind="sdpa", q=q, k=full_key, ..., causal=True, window_left=3)

A site is *lowerable* only when it is provably equivalent to the op: the mask (if any) is a
function of positions alone and evaluates to a causal / sliding-window / full pattern
(`mask_analysis`: proven for every length), dropout is off, the GQA mapping is proven to be the
grouped one (`repeat_kv.peel_repeat_kv`), the shapes are the
``[B, H, S, D]`` ones, and no in-place write the match does not include changes what the site
computes with (the scores, or q/k/v between their use and the site's output, where the op
reads them). Every refusal carries a reason.
"""

from __future__ import annotations

import logging
import math
import operator
from typing import Any, Iterable

import torch
from torch import fx

from . import fx_utils as fu
from .mask_analysis import (
    MaskIsBias,
    NotProvable,
    analyze_mask,
    constant_value,
    is_scalar_item,
)
from .position_bias import analyze_bias, analyze_biased_mask
from .repeat_kv import peel_repeat_kv
from .site import AttentionSite, ScaleExpr

logger = logging.getLogger(__name__)


def find_attention(
    gm: fx.GraphModule,
    trusted_positions: Iterable[str] = (),
    example_inputs: list[Any] | None = None,
) -> list[AttentionSite]:
    """Find every attention site in ``gm`` (graph order) and decide which are lowerable.

    Parameters
    ----------
    gm:
        A Dynamo graph (nodes carry ``meta["example_value"]``) or any GraphModule together
        with ``example_inputs`` (then shapes are propagated first).
    trusted_positions:
        Names of placeholders holding token positions (the ragged runtime's ``position_ids``).
        A mask computed from them describes per-request structure that the runtime supplies
        itself; in the stateless form no input is trusted.

    Returns
    -------
    list[AttentionSite], each with ``.lowerable`` and ``.reason``.
    """
    if example_inputs is not None and not _has_meta(gm):
        _propagate(gm, example_inputs)
    trusted = {n for n in gm.graph.nodes if n.op == "placeholder" and any(t in n.name for t in trusted_positions)}
    sites: list[AttentionSite] = []
    mask_cache: dict[tuple, Any] = {}
    activations: set[fx.Node] | None = None
    with fu.unchanged(gm.graph):  # this pass only reads the graph: index its aliasing once
        for node in gm.graph.nodes:
            site = None
            if fu.is_op(node, fu.SDPA):
                site = _match_sdpa(gm, node)
            elif fu.is_op(node, fu.SOFTMAX):
                site = _match_eager(gm, node)
                if site is None:
                    activations = activations if activations is not None else _activation_nodes(gm.graph)
                    site = _unmatched_attention(node, activations)
            if site is None:
                continue
            if site.reason == "":
                _check_shapes_and_mask(gm, site, trusted, mask_cache)
            sites.append(site)
    _assign_layer_ids(sites)
    logger.debug("find_attention: %d sites, %d lowerable", len(sites), sum(s.lowerable for s in sites))
    return sites


def _propagate(gm: fx.GraphModule, example_inputs: list[Any]) -> None:
    """Record a fake tensor for every node (``meta["val"]``), as Dynamo does: shapes for the
    matchers and storages for the aliasing analysis. Where fake propagation fails, shapes
    alone (ShapeProp); aliasing then falls back to the ops' schemas."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    from torch.fx.passes.shape_prop import ShapeProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        fake = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fake)
    except Exception as exc:  # noqa: BLE001 (any failure: fall back to real shapes)
        logger.debug("fake propagation failed (%s); propagating shapes only", exc)
        for n in gm.graph.nodes:
            n.meta.pop("val", None)
        ShapeProp(gm).propagate(*example_inputs)


def _has_meta(gm: fx.GraphModule) -> bool:
    return all(fu.example_value(n) is not None for n in gm.graph.nodes if n.op == "placeholder")


def _new_site(node: fx.Node, kind: str) -> AttentionSite:
    path, idx = fu.attention_module_path(node)
    return AttentionSite(name=path or node.name, kind=kind, output=node, layer_index=idx)


# --------------------------------------------------------------------------- SDPA
def _match_sdpa(gm: fx.GraphModule, node: fx.Node) -> AttentionSite:
    site = _new_site(node, "sdpa")
    q, k_fed, v_fed = fu.arg(node, 0, "query"), fu.arg(node, 1, "key"), fu.arg(node, 2, "value")
    site.q, site.mask = q, fu.arg(node, 3, "attn_mask")
    dropout = fu.arg(node, 4, "dropout_p", 0.0)
    is_causal = fu.arg(node, 5, "is_causal", False)
    scale = fu.arg(node, 6, "scale", None)
    enable_gqa = fu.arg(node, 7, "enable_gqa", False)
    if not isinstance(is_causal, bool) or not isinstance(enable_gqa, bool):
        return site.refuse("is_causal / enable_gqa are not compile-time constants")
    if not (isinstance(dropout, (int, float)) and dropout == 0):
        return site.refuse(f"dropout_p={_show(dropout)} (attention dropout is active)")
    site.extra["is_causal"] = is_causal
    site.k, n_rep_k, why_k = peel_repeat_kv(gm, k_fed)
    site.v, n_rep_v, why_v = peel_repeat_kv(gm, v_fed)
    if why_k or why_v:
        return site.refuse(why_k or why_v)
    if n_rep_k != n_rep_v:
        return site.refuse("keys and values are repeated differently")
    site.extra["gqa_explicit"] = enable_gqa or n_rep_k > 1
    stale = _stale_operand(site, {"query": (site.q, node), "key": (site.k, node), "value": (site.v, node)})
    if stale is not None:
        return site.refuse(stale)
    if scale is None:
        shape = fu.shape_of(q)
        if shape is None:
            return site.refuse("query shape unknown")
        site.scale = ScaleExpr(1.0 / math.sqrt(fu.size_hint(shape[-1])))
    else:
        try:
            site.scale = _scalar(gm, scale)
        except NotProvable as exc:
            return site.refuse(f"scale: {exc}")
    return site


# --------------------------------------------------------------------------- eager
def _match_eager(gm: fx.GraphModule, softmax: fx.Node) -> AttentionSite | None:
    """Match the eager pattern around ``softmax``; None when it is not attention-shaped at all."""
    x = fu.arg(softmax, 0, "input")
    dim = fu.arg(softmax, 1, "dim", None)
    shape = fu.shape_of(softmax)
    if shape is None or len(shape) != 4 or dim not in (-1, 3):
        return None
    # Downward: softmax -> [cast] -> [dropout] -> [same-shape view] -> matmul(p, v)
    p, out, reshaped, sink_slice = softmax, None, None, None
    while True:
        users = list(p.users)
        if len(users) != 1:
            break
        u = users[0]
        if fu.is_op(u, fu.CAST) or fu.is_op(u, fu.CONTIGUOUS) or fu.is_op(u, fu.DROPOUT):
            p = u
            continue
        if sink_slice is None and _drops_last_column(u, p):
            sink_slice = p = u
            continue
        if (fu.is_op(u, fu.RESHAPE) or fu.is_op(u, fu.FLATTEN)) and u.args[0] is p:
            if not _same_shape(fu.shape_of(u), shape):
                reshaped = reshaped or u
            p = u
            continue
        if (fu.is_op(u, fu.MATMUL) or fu.is_op(u, fu.BMM)) and u.args[0] is p:
            out = u
        break
    if out is None:
        return None
    site = _new_site(out, "eager")
    merged_v = _merged_heads_values(out, p, shape) if reshaped is not None else None
    if merged_v is not None:  # Bloom: probabilities viewed as [B*H, Sq, Sk], bmm with [B*H, Sk, Dv] values
        site.extra["merged_heads"] = True
    elif reshaped is not None or not fu.is_op(out, fu.MATMUL):
        # Attention-shaped (softmax over keys times values) but not in the [B, H, S, D] form.
        if not _attention_shaped(x, out):
            return None
        where = reshaped if reshaped is not None else out
        bias = _upward(x, {torch.baddbmm, "baddbmm"})
        why = f"; the scores come from {bias.name} = baddbmm(bias, q, k^T): a position bias such as ALiBi" if bias else ""
        return site.refuse(
            f"eager attention in an unsupported layout: the probabilities are reshaped to "
            f"{_show_shape(fu.shape_of(where))} before the product with the values ({where.name}){why}"
        )
    # Upward: [sink column: cat(., sinks) - max] [cast] [mask add] [softcap] [scale]* matmul(q [*scale], k^T)
    sinks = None
    if sink_slice is not None:
        peeled = _peel_sinks(x)
        if isinstance(peeled, str):
            if not _attention_shaped(x, out):
                return None
            return site.refuse(peeled)
        x, sinks = peeled
    x = _skip_casts(x)
    mask = None
    scores = None
    filled = _masked_fill_mask(gm, x)
    if filled is not None:  # ``scores.masked_fill(blocked, min)`` (MPT): True where a key is hidden
        scores, mask = filled
        site.extra["mask_inverted"] = True
    elif fu.is_op(x, fu.ADD) and len(x.args) == 2 and not x.kwargs:
        a, b = x.args
        # ``s += mask`` mutates its first argument: only that one may be the scores.
        for s_node, m_node in ((a, b),) if fu.is_inplace(x) else ((a, b), (b, a)):
            if _reaches_qk_matmul(s_node):
                scores, mask = s_node, m_node
                break
        if scores is None:
            if not _attention_shaped(x, out):
                return None
            return site.refuse(f"the scores before the softmax are not computed as q @ k^T ({_producer(x)})")
    else:
        scores = x
    scores = _skip_casts(scores)
    cap: float | fx.Node = 0.0
    capped = _match_softcap(gm, scores)
    if capped is not None:
        scores, cap = capped
    scale = ScaleExpr()
    while True:
        # In-place spellings (``s /= c``) are fine here: the op reads q and k, never ``s``.
        factor = _scale_factor(gm, scores, allow_inplace=True)
        if factor is None:
            break
        scores, f = factor
        scale = scale.times(f)
    scores = _skip_casts(scores)
    if merged_v is not None:
        merged = _merged_heads_scores(gm, scores, scale)
        if isinstance(merged, str):
            return site.refuse(merged)
        scores, q, k_fed, scale, bias = merged
        if bias is not None:
            if cap:  # the op adds its bias after the softcap, not inside it
                return site.refuse("a position bias added inside the softcap (the op adds it after the softcap)")
            site.extra["prescale_bias"] = bias
        return _finish_eager(gm, site, softmax, out, scores, q, k_fed, merged_v, mask, scale, cap, sinks)
    peeled_bias = _peel_prescale_bias(gm, scores, scale)
    if peeled_bias is not None:  # ``(q @ k^T + alibi) * scale`` (Falcon's eager path, MPT)
        if cap:  # the op adds its bias after the softcap, not inside it
            return site.refuse("a position bias added inside the softcap (the op adds it after the softcap)")
        scores, scale, site.extra["prescale_bias"] = peeled_bias
    if not (fu.is_op(scores, fu.MATMUL) and len(scores.args) == 2):
        if not _attention_shaped(x, out):
            return None
        if fu.is_op(scores, fu.ADD):
            return site.refuse(
                f"a term is added to q @ k^T before the softmax that is not a provable mask ({scores.name}: "
                "a position bias such as ALiBi)"
            )
        return site.refuse(f"the scores before the softmax are not scale * q @ k^T [softcap] [+ mask] ({_producer(scores)})")
    q, kt = scores.args
    while (qf := _scale_factor(gm, q)) is not None:
        q, f = qf
        scale = scale.times(f)
    k_fed = _untranspose(kt)
    if k_fed is None:
        if not _attention_shaped(x, out) or fu.example_value(kt) is None or fu.example_value(kt).dim() != 4:
            return None
        return site.refuse(f"the key operand of q @ k^T is not a transposed [B, H, S, D] key ({_producer(kt)})")
    return _finish_eager(gm, site, softmax, out, scores, q, k_fed, out.args[1], mask, scale, cap, sinks)


def _finish_eager(gm, site, softmax, out, scores, q, k_fed, v_fed, mask, scale, cap, sinks) -> AttentionSite:
    """The checks every eager match ends with: repeat_kv, in-place writes, dropout."""
    site.q, site.mask, site.scale, site.logit_cap, site.sinks = q, mask, scale, cap, sinks
    site.k, n_rep_k, why_k = peel_repeat_kv(gm, k_fed)
    site.v, n_rep_v, why_v = peel_repeat_kv(gm, v_fed)
    site.extra.update(is_causal=False, gqa_explicit=n_rep_k > 1, softmax=softmax)
    if why_k or why_v:
        return site.refuse(why_k or why_v)
    if n_rep_k != n_rep_v:
        return site.refuse("keys and values are repeated differently")
    write = _hidden_scores_write(scores, softmax, out)
    if write is not None:
        return site.refuse(
            f"the scores are modified in place by {_producer(write)}, outside the matched scale / softcap / "
            "mask chain (the softmax sees the write; the lowered op would miss it)"
        )
    stale = _stale_operand(site, {"query": (q, scores), "key": (site.k, scores), "value": (site.v, out)})
    if stale is not None:
        return site.refuse(stale)
    for n in _chain(softmax, out):
        if fu.is_op(n, fu.DROPOUT):
            p_drop = fu.arg(n, 1, "p", 0.5)
            training = fu.arg(n, 2, "training", True)
            if training and not (isinstance(p_drop, (int, float)) and p_drop == 0):
                return site.refuse(f"dropout p={_show(p_drop)} in training mode")
    return site


# --------------------------------------------------------------------------- merged heads (Bloom)
# BloomAttention computes in 3-D, batch and heads merged:
#     scores = alibi.baddbmm(batch1=q.reshape(B*H, Sq, D), batch2=k.reshape(B*H, Sk, D).transpose(-1, -2),
#                            beta=1.0, alpha=1/sqrt(D))                      # [B*H, Sq, Sk]
#     p = softmax(scores.view(B, H, Sq, Sk) + mask).view(B*H, Sq, Sk)
#     out = torch.bmm(p, v.reshape(B*H, Sk, D))                             # [B*H, Sq, D]
# The reshapes merge the leading [B, H] of 4-D q/k/v; the op runs on those and its result is
# reshaped back to [B*H, Sq, Dv].


def _merged_from(x: Any, rank4_shape: tuple | None = None) -> fx.Node | None:
    """``t`` when ``x = t.reshape(B*H, ...)`` of a 4-D ``t: [B, H, S, D]`` (leading two merged)."""
    if not (fu.is_op(x, fu.RESHAPE) and isinstance(x.args[0], fx.Node)):
        return None
    src, dst = fu.shape_of(x.args[0]), fu.shape_of(x)
    if src is None or dst is None or len(src) != 4 or len(dst) != 3:
        return None
    if not (_same_shape(tuple(src[2:]), tuple(dst[1:])) and fu.same_size(src[0] * src[1], dst[0])):
        return None
    return x.args[0]


def _merged_heads_values(out: fx.Node, p3: fx.Node, shape: tuple) -> fx.Node | None:
    """The 4-D values when ``out = bmm(p3, v.reshape(B*H, Sk, Dv))`` with ``p3`` the
    probabilities ``shape = [B, H, Sq, Sk]`` viewed as ``[B*H, Sq, Sk]``; None otherwise."""
    if not (fu.is_op(out, fu.BMM) or fu.is_op(out, fu.MATMUL)) or len(out.args) != 2 or out.args[0] is not p3:
        return None
    p_shape = fu.shape_of(p3)
    if p_shape is None or len(p_shape) != 3 or not _same_shape(tuple(p_shape[1:]), tuple(shape[2:])):
        return None
    if not fu.same_size(p_shape[0], shape[0] * shape[1]):
        return None
    v4 = _merged_from(out.args[1])
    return v4 if v4 is not None and fu.same_size(fu.shape_of(v4)[2], shape[3]) else None


def _merged_heads_scores(gm: fx.GraphModule, scores: Any, scale: ScaleExpr):
    """``(s3, q4, k4, scale, (bias, bias scale) or None)`` for 4-D scores that view 3-D ones
    computed by ``baddbmm(bias, q3, k3^T, beta, alpha)`` or ``bmm(q3, k3^T)`` of merged q/k; a
    refusal reason otherwise."""
    if not (fu.is_op(scores, fu.RESHAPE) and isinstance(scores.args[0], fx.Node)):
        return f"the scores before the softmax are not a view of [batch*heads] scores ({_producer(scores)})"
    s3 = _skip_casts(scores.args[0])
    outer = scale
    bias = None
    if fu.is_op(s3, {torch.baddbmm, "baddbmm"}):
        # torch.baddbmm(bias, q3, kt3, beta=, alpha=) or bias.baddbmm(batch1=q3, batch2=kt3, ...)
        inp, q3, kt3 = fu.arg(s3, 0, "input"), fu.arg(s3, 1, "batch1"), fu.arg(s3, 2, "batch2")
        beta, alpha = s3.kwargs.get("beta", 1.0), s3.kwargs.get("alpha", 1.0)
        if len(s3.args) > 3:
            return "baddbmm with positional beta / alpha"
        try:
            beta_v, alpha_v = constant_value(gm, beta), constant_value(gm, alpha)
        except NotProvable as exc:
            return f"baddbmm's beta / alpha are not constants ({exc})"
        if outer.runtime:
            return "a position bias added before a runtime scale"
        scale = scale.times(ScaleExpr(alpha_v))
        bias = (inp, ScaleExpr(outer.constant * beta_v)) if beta_v != 0 else None
    elif (fu.is_op(s3, fu.BMM) or fu.is_op(s3, fu.MATMUL)) and len(s3.args) == 2:
        q3, kt3 = s3.args
    else:
        return f"the [batch*heads] scores are not baddbmm / bmm of q and k^T ({_producer(s3)})"
    if not (fu.is_op(kt3, fu.TRANSPOSE) and isinstance(kt3.args[0], fx.Node)):
        return f"the key operand of the [batch*heads] scores is not a transposed key ({_producer(kt3)})"
    dims = {fu.arg(kt3, 1, "dim0"), fu.arg(kt3, 2, "dim1")}
    if {d % 3 for d in dims if isinstance(d, int)} != {1, 2}:
        return "the key operand of the [batch*heads] scores is not transposed in its last two dimensions"
    q4, k4 = _merged_from(q3), _merged_from(kt3.args[0])
    if q4 is None or k4 is None:
        return "q / k of the [batch*heads] scores are not reshapes of [batch, heads, seq, dim] tensors"
    return s3, q4, k4, scale, bias


def _masked_fill_mask(gm: fx.GraphModule, x: Any) -> tuple[Any, fx.Node] | None:
    """``x = s.masked_fill(blocked, value)`` (out of place) with ``s`` from q @ k^T and a
    constant ``value <= -1e4``: ``(s, blocked)``; None otherwise."""
    if not fu.is_op(x, {torch.masked_fill, "masked_fill"}) or len(x.args) != 3 or x.kwargs:
        return None
    s, blocked, value = x.args
    if not (_reaches_qk_matmul(s) and isinstance(blocked, fx.Node)):
        return None
    try:
        if constant_value(gm, value) > -1e4:
            return None
    except NotProvable:
        return None
    return s, blocked


def _peel_prescale_bias(gm: fx.GraphModule, scores: Any, scale: ScaleExpr) -> tuple[Any, ScaleExpr, tuple] | None:
    """``scores = s + bias`` with ``s`` from q @ k^T and ``bias`` not: ``(s below its casts
    and scale factors, the whole scale, (bias, the scale applied to the bias))``; None otherwise.
    The bias's slopes are proven later (`position_bias.analyze_bias`)."""
    if not (fu.is_op(scores, fu.ADD) and len(scores.args) == 2 and not scores.kwargs) or fu.is_inplace(scores):
        return None
    a, b = scores.args
    for s_node, bias in ((a, b), (b, a)):
        if (
            isinstance(bias, fx.Node)
            and _reaches_qk_matmul(s_node)
            and not _reaches_qk_matmul(bias)
            and _same_shape(fu.shape_of(scores), fu.shape_of(s_node))  # the bias broadcasts, the scores do not
        ):
            outer = scale
            s_node = _skip_casts(s_node)
            while (factor := _scale_factor(gm, s_node, allow_inplace=True)) is not None:
                s_node, f = factor
                scale = scale.times(f)
            s_node = _skip_casts(s_node)
            # Falcon: ``(q @ k^T).view(b, h, q_len, kv_len)``, a view to the same shape
            while fu.is_op(s_node, fu.RESHAPE) and isinstance(s_node.args[0], fx.Node) and _same_shape(
                fu.shape_of(s_node), fu.shape_of(s_node.args[0])
            ):
                s_node = _skip_casts(s_node.args[0])
            return s_node, scale, (bias, outer)
    return None


# --------------------------------------------------------------------------- attention sinks
# GPT-OSS joins a learned logit per head to each row of scores and drops its probability:
#     combined = cat([scores, sinks.reshape(1, -1, 1, 1).expand(b, -1, q_len, -1)], dim=-1)
#     probs = softmax(combined - combined.max(-1, keepdim=True).values, -1)[..., :-1]
# Subtracting a row's own maximum does not change its softmax (the sink keeps it finite), and
# the sink column is the op's ``sinks`` argument: sinks[h] for every row of head h.

#: Ops that keep the order of a tensor's elements (sinks ``[H]`` -> ``[1, H, 1, 1]``).
_ORDER_KEEPING = fu.RESHAPE | fu.CAST | fu.CONTIGUOUS | {"unsqueeze", torch.unsqueeze}


def _drops_last_column(node: fx.Node, of: fx.Node) -> bool:
    """``node = of[..., :-1]``."""
    if not fu.is_op(node, fu.GETITEM) or node.args[0] is not of:
        return False
    index = node.args[1]
    if not isinstance(index, tuple) or len(index) != 2 or index[0] is not Ellipsis:
        return False
    last = index[1]
    return isinstance(last, slice) and last.start is None and last.stop == -1 and last.step in (None, 1)


def _row_max_of(node: Any, x: fx.Node) -> bool:
    """``node`` is the maximum of ``x`` over its last dim, kept: ``x.max(-1, keepdim=True)[0]``
    (or ``.values``) or ``x.amax(-1, keepdim=True)``."""
    if not isinstance(node, fx.Node):
        return False
    if fu.is_op(node, fu.GETITEM) and node.args[1] == 0 or node.op == "call_function" and node.target is getattr and node.args[1] == "values":
        node = node.args[0]
        if not fu.is_op(node, {"max", torch.max}):
            return False
    elif not fu.is_op(node, {"amax", torch.amax}):
        return False
    if node.args[0] is not x:
        return False
    dim = fu.arg(node, 1, "dim", None)
    keep = fu.arg(node, 2, "keepdim", False)
    rank = len(fu.shape_of(x) or ())
    return keep is True and isinstance(dim, int) and rank > 0 and dim % rank == rank - 1


def _peel_sinks(x: Any) -> tuple[fx.Node, fx.Node] | str:
    """``(scores, sinks)`` for softmax input ``x`` = ``cat([scores, sink column]) [- row max]``,
    where the sink column is a parameter ``[H]`` laid out as ``[B, H, S, 1]``; else the reason."""
    x = _skip_casts(x)
    if fu.is_op(x, {operator.sub, torch.sub, "sub"}) and len(x.args) == 2 and _row_max_of(x.args[1], x.args[0]):
        x = _skip_casts(x.args[0])
    if not fu.is_op(x, _CAT):
        return f"the probabilities drop their last column, but the softmax input is not a concatenation ({_producer(x)})"
    parts = fu.arg(x, 0, "tensors", None)
    dim = fu.arg(x, 1, "dim", 0)
    shape = fu.shape_of(x)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or shape is None or not isinstance(dim, int) or dim % len(shape) != len(shape) - 1:
        return f"{x.name} does not append one column to the scores"
    scores, column = parts
    col_shape, s_shape = fu.shape_of(column), fu.shape_of(scores)
    if col_shape is None or s_shape is None or len(col_shape) != 4 or len(s_shape) != 4 or col_shape[3] != 1:
        return f"the column appended by {x.name} is not [B, H, S, 1]"
    heads = fu.size_hint(s_shape[1])
    # Downward from the parameter: order-keeping reshapes to [1, H, 1, 1], then expands only.
    chain, n = [], column
    while isinstance(n, fx.Node) and (fu.is_op(n, _ORDER_KEEPING) or fu.is_op(n, fu.EXPAND)):
        chain.append(n)
        n = n.args[0]
    root_val = fu.example_value(n)
    if not isinstance(n, fx.Node) or not _is_parameter(n) or not isinstance(root_val, torch.Tensor) or tuple(root_val.shape) != (heads,):
        return f"the column appended by {x.name} is not a per-head parameter of {heads} values ({_producer(n)})"
    expanded = False
    for step in reversed(chain):  # from the parameter down to the column
        if fu.is_op(step, fu.EXPAND):
            expanded = True
        elif expanded and not fu.is_op(step, fu.CAST | fu.CONTIGUOUS):
            return f"the sink column is reshaped after it is expanded ({step.name})"
        elif not expanded:
            sh = fu.shape_of(step)
            if sh is not None and len(sh) == 4 and [fu.size_hint(d) for d in sh] != [1, heads, 1, 1]:
                return f"the sinks are laid out as {_show_shape(sh)}, not [1, {heads}, 1, 1] ({step.name})"
    return scores, n


def _is_parameter(n: fx.Node) -> bool:
    if n.op == "get_attr":
        return True
    return n.op == "placeholder" and (isinstance(fu.example_value(n), torch.nn.Parameter) or "_parameters_" in n.name)


# --------------------------------------------------------------------------- unmatched softmax
# A softmax over keys of scores computed as a product of two activations is attention, whatever
# happens around it. When the matchers above do not accept it, it is still reported, refused
# with what was seen: the paged runtime must fail loudly on it and `explain` must show it.

#: Ops an upward walk from the scores does not cross: they start another computation.
_WALK_STOPS = {torch.nn.functional.linear, torch._C._nn.linear, "linear", torch.nn.functional.embedding,
               torch.nn.functional.layer_norm, torch.nn.functional.rms_norm, "softmax", torch.softmax,
               torch.nn.functional.softmax}
#: Spellings of concatenation.
_CAT = {torch.cat, torch.concat, torch.concatenate}


def _activation_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose values derive from a model input (not only from parameters, buffers,
    constants or sizes)."""
    act: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder":
            val = fu.example_value(n)
            if isinstance(val, torch.Tensor) and not isinstance(val, torch.nn.Parameter) and "_buffers_" not in n.name:
                act.add(n)
        elif n.op in ("call_function", "call_method") and not _is_size_query(n):
            if any(a in act for a in n.all_input_nodes):
                act.add(n)
    return act


def _is_size_query(n: fx.Node) -> bool:
    return fu.is_op(n, fu.SHAPE_QUERIES) or (n.target is getattr and len(n.args) > 1 and n.args[1] in fu.SHAPE_ATTRS)


def _unmatched_attention(softmax: fx.Node, activations: set[fx.Node], depth: int = 10) -> AttentionSite | None:
    """A refused site for a softmax over the last dimension of scores that come, within a few
    elementwise / layout steps, from a product of two activations (q @ k^T); else None."""
    val = fu.example_value(softmax)
    dim = fu.arg(softmax, 1, "dim", None)
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or not isinstance(dim, int) or dim % val.dim() != val.dim() - 1:
        return None
    product = None
    frontier, seen = [fu.arg(softmax, 0, "input")], set()
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if not isinstance(n, fx.Node) or n in seen or n not in activations:
                continue
            seen.add(n)
            if fu.is_op(n, _PRODUCTS):
                operands = [a for a in n.all_input_nodes if isinstance(fu.example_value(a), torch.Tensor)]
                if len(operands) >= 2 and sum(a in activations for a in operands) >= 2:
                    product = n
                    break
                continue
            if fu.is_op(n, _WALK_STOPS):
                continue
            nxt.extend(n.all_input_nodes)
        if product is not None or not nxt:
            break
        frontier = nxt
    if product is None:
        return None
    site = _new_site(softmax, "eager")
    path = fu.between(product, softmax)
    cat = next((n for n in path if fu.is_op(n, _CAT)), None)
    if cat is not None:
        extra = [a for a in (cat.args[0] if cat.args and isinstance(cat.args[0], (list, tuple)) else []) if a not in path]
        what = ", ".join(a.name for a in extra if isinstance(a, fx.Node)) or "another tensor"
        return site.refuse(
            f"a column concatenated to the scores before the softmax ({cat.name} = cat(scores, {what})) in a form "
            "the attention-sink match does not accept (a per-head parameter appended last, its probability "
            "dropped by [..., :-1] before the values)"
        )
    users = list(softmax.users)
    return site.refuse(
        f"a softmax over q @ k^T ({product.name}) that the matchers do not recognize: the scores come from "
        f"{_producer(fu.arg(softmax, 0, 'input'))} and the probabilities go to "
        f"{', '.join(_producer(u) for u in users) or 'nothing'}"
    )


# --------------------------------------------------------------------------- in-place writes
# The match reads a site off the nodes that compute it, but a Dynamo graph also holds in-place
# writes that change those nodes' tensors from the side. ``s.div_(c)`` or
# ``s.masked_fill_(mask, min)`` without reassignment (XLM, Flaubert) leave the softmax reading
# the node of ``q @ k^T`` itself, the write being another user of it; and the lowered op, placed
# at the site's output, reads q, k and v there, after any write between their use and the
# output. Sites with such writes are refused (the mask's own writes: `mask_analysis`).


def _hidden_scores_write(product: fx.Node, softmax: fx.Node, out: fx.Node) -> fx.Node | None:
    """A write, before ``out``, into the tensor of a node between the ``product`` q @ k^T and
    ``out`` (directly or through any alias) by a node that is not itself on that path."""
    path = fu.between(product, softmax) | set(_chain(softmax, out))
    return fu.first_write(fu.aliases(path), exclude=path, before=out)


def _stale_operand(site: AttentionSite, operands: dict[str, tuple[fx.Node, fx.Node]]) -> str | None:
    """Why the lowered op would read a q/k/v different from the one the site computes with.

    ``operands`` maps a role to ``(x, consumer)``: the site's ``x`` (``site.k``: before
    repeat_kv) feeds ``consumer`` (the q @ k^T product, the final matmul, the SDPA call). The
    site reads ``x`` at the first node on the way to ``consumer``; the lowered op reads it at
    ``site.output``. A write to ``x``'s storage in between makes the two differ (a write before
    both reads is seen by both).
    """
    position = fu.graph_index(site.output.graph).position
    for role, (x, consumer) in operands.items():
        if not isinstance(x, fx.Node):
            continue
        path = fu.between(x, consumer)
        readers = [u for u in x.users if u in path]
        if not readers:
            continue
        first = min(readers, key=position.__getitem__)
        write = fu.first_write(fu.aliases([x]), after=first, before=site.output)
        if write is not None:
            return (
                f"the {role} ({x.name}) is modified in place by {_producer(write)} after the attention "
                f"reads it and before its output ({site.output.name}), where the lowered op would read it"
            )
    return None


#: Products that may compute attention scores from two activations.
_PRODUCTS = fu.MATMUL | fu.BMM | {torch.baddbmm, "baddbmm", torch.einsum}


def _attention_shaped(scores_in: Any, out: fx.Node) -> bool:
    """Does ``softmax(scores_in) ... @ out.args[1]`` look like attention: the values are an
    activation (not a weight), and the scores come from a product of activations within a few
    steps? Then an unmatched form is reported as a refused site instead of being ignored."""
    v = out.args[1] if len(out.args) > 1 else None
    val = fu.example_value(v)
    if not isinstance(v, fx.Node) or v.op == "get_attr" or not isinstance(val, torch.Tensor) or val.dim() < 3:
        return False
    product = _upward(scores_in, _PRODUCTS)
    operands = product.all_input_nodes if product is not None else []
    return len(operands) >= 2 and all(a.op != "get_attr" for a in operands)


def _upward(x: Any, ops: set, depth: int = 8) -> fx.Node | None:
    """The first node calling one of ``ops`` among ``x``'s ancestors within ``depth`` steps."""
    frontier, seen = [x], set()
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if not isinstance(n, fx.Node) or n in seen:
                continue
            seen.add(n)
            if fu.is_op(n, ops):
                return n
            nxt.extend(n.all_input_nodes)
        frontier = nxt
    return None


def _producer(x: Any) -> str:
    if not isinstance(x, fx.Node):
        return repr(x)
    target = x.target if isinstance(x.target, str) else getattr(x.target, "__name__", str(x.target))
    return f"{x.name} = {target}(...)"


def _same_shape(a: tuple | None, b: tuple | None) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(
        fu.same_size(x, y) or (isinstance(x, int) and isinstance(y, int) and x == y) for x, y in zip(a, b)
    )


def _show_shape(shape: tuple | None) -> str:
    return "?" if shape is None else "[" + ", ".join(str(s) for s in shape) + "]"


def _chain(start: fx.Node, end: fx.Node) -> list[fx.Node]:
    nodes, n = [], start
    while n is not end:
        nodes.append(n)
        n = next(iter(n.users))
    return nodes


def _skip_casts(x: Any) -> Any:
    while fu.is_op(x, fu.CAST) or fu.is_op(x, fu.CONTIGUOUS):
        x = x.args[0]
    return x


def _reaches_qk_matmul(x: Any, depth: int = 8) -> bool:
    """Is ``x`` (within a few elementwise steps) the product of a matmul with a transposed key?"""
    for _ in range(depth):
        if not isinstance(x, fx.Node):
            return False
        if fu.is_op(x, fu.MATMUL):
            return _untranspose(x.args[1]) is not None or fu.is_op(x.args[1], fu.TRANSPOSE)
        if fu.is_op(x, fu.BMM) and len(x.args) == 2:  # the merged-heads form (Bloom)
            return fu.is_op(x.args[1], fu.TRANSPOSE)
        if fu.is_op(x, {torch.baddbmm, "baddbmm"}):
            key = x.args[2] if len(x.args) > 2 else x.kwargs.get("batch2")
            return fu.is_op(key, fu.TRANSPOSE)
        if x.op not in ("call_function", "call_method") or not x.args:
            return False
        x = x.args[0]
    return False


def _untranspose(kt: Any) -> fx.Node | None:
    """``k`` when ``kt`` is ``k.transpose(-2, -1)`` of a 4-D ``k`` (any spelling), else None."""
    if fu.is_op(kt, fu.TRANSPOSE):
        d0, d1 = fu.arg(kt, 1, "dim0"), fu.arg(kt, 2, "dim1")
        shape = fu.shape_of(kt.args[0])
        if shape is None or len(shape) != 4:
            return None
        if {d % 4 for d in (d0, d1) if isinstance(d, int)} == {2, 3}:
            return kt.args[0]
    if kt is not None and isinstance(kt, fx.Node) and kt.op == "call_function" and kt.target is getattr and kt.args[1] == "mT":
        return kt.args[0]
    return None


def _match_softcap(gm: fx.GraphModule, x: Any) -> tuple[fx.Node, float | fx.Node] | None:
    """``cap * tanh(s / cap)`` -> ``(s, cap)``."""
    if not fu.is_op(x, fu.MUL) or len(x.args) != 2:
        return None
    for t, c in (x.args, x.args[::-1]):
        if fu.is_op(t, fu.TANH):
            inner = t.args[0]
            if fu.is_op(inner, fu.DIV) and _same_scalar(gm, inner.args[1], c):
                return inner.args[0], _cap_value(gm, c)
    return None


def _same_scalar(gm: fx.GraphModule, a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return constant_value(gm, a) == constant_value(gm, b)
    except NotProvable:
        return False


def _cap_value(gm: fx.GraphModule, c: Any) -> float | fx.Node:
    if is_scalar_item(c):
        return c
    return constant_value(gm, c)


def _scale_factor(gm: fx.GraphModule, x: Any, allow_inplace: bool = False) -> tuple[fx.Node, ScaleExpr] | None:
    """``y * c``, ``c * y`` or ``y / c`` with a scalar ``c`` -> ``(y, c or 1/c)``.

    In-place forms (``y *= c``) only with ``allow_inplace``: they change ``y`` itself, so ``y``
    no longer holds the unscaled value for a consumer placed after them.
    """
    if not (fu.is_op(x, fu.MUL) or fu.is_op(x, fu.DIV)) or len(x.args) != 2 or x.kwargs:
        return None
    inplace = fu.is_inplace(x)
    if inplace and not allow_inplace:
        return None
    a, b = x.args
    candidates = [(a, b)] if fu.is_op(x, fu.DIV) or inplace else [(a, b), (b, a)]
    for y, c in candidates:
        if not _is_tensor_node(y) or not _is_scalar(c):
            continue
        try:
            f = _scalar(gm, c)
        except NotProvable:
            return None
        if fu.is_op(x, fu.DIV):
            if f.runtime:
                return None
            f = ScaleExpr(1.0 / f.constant)
        return y, f
    return None


def _is_tensor_node(x: Any) -> bool:
    val = fu.example_value(x)
    return isinstance(val, torch.Tensor) and val.dim() == 4


def _is_scalar(c: Any) -> bool:
    if isinstance(c, (int, float)) and not isinstance(c, bool):
        return True
    val = fu.example_value(c)
    if isinstance(val, (int, float, torch.SymFloat, torch.SymInt)):
        return True
    return isinstance(val, torch.Tensor) and val.dim() == 0


def _scalar(gm: fx.GraphModule, c: Any) -> ScaleExpr:
    if is_scalar_item(c):
        return ScaleExpr(1.0, [c])
    return ScaleExpr(constant_value(gm, c))


# --------------------------------------------------------------------------- checks
def _check_shapes_and_mask(gm: fx.GraphModule, site: AttentionSite, trusted: set[fx.Node], mask_cache: dict) -> None:
    qs, ks, vs = fu.shape_of(site.q), fu.shape_of(site.k), fu.shape_of(site.v)
    if qs is None or ks is None or vs is None:
        site.refuse("q/k/v shapes are unknown")
        return
    if not (len(qs) == len(ks) == len(vs) == 4):
        site.refuse(f"q/k/v are not [batch, heads, seq, head_dim] (ranks {len(qs)}, {len(ks)}, {len(vs)})")
        return
    hq, hkv, d, dv = (fu.size_hint(s) for s in (qs[1], ks[1], qs[3], vs[3]))
    if fu.size_hint(ks[3]) != d or fu.size_hint(vs[1]) != hkv or not fu.same_size(ks[2], vs[2]):
        site.refuse("q/k/v shapes do not line up")
        return
    if not (_same_shape(qs[:1], ks[:1]) and _same_shape(qs[:1], vs[:1])):
        site.refuse(f"keys/values of batch {ks[0]} for queries of batch {qs[0]} (broadcast over the batch)")
        return
    # One key head broadcast over every query head (multi-query attention written without
    # repeat_kv, e.g. Falcon-7B) is the grouped mapping with a single group.
    if hq % hkv != 0 or (hq != hkv and hkv != 1 and not site.extra.get("gqa_explicit")):
        site.refuse(f"{hq} query heads vs {hkv} key heads without grouped-query broadcasting")
        return
    site.num_q_heads, site.num_kv_heads, site.head_dim, site.v_head_dim = hq, hkv, d, dv
    if site.mask is None:
        if site.extra.get("is_causal"):
            if not fu.same_size(qs[2], ks[2]):
                site.refuse("is_causal with different query and key lengths (SDPA aligns it top-left)")
                return
            site.causal = True
        else:
            site.causal = False
    else:
        if site.extra.get("is_causal"):
            site.refuse("both a mask and is_causal")
            return
        key = (site.mask, str(qs[2]), str(ks[2]), hq, site.extra.get("mask_inverted", False))
        if key not in mask_cache:
            try:
                try:
                    inverted = site.extra.get("mask_inverted", False)
                    mask_cache[key] = analyze_mask(gm, site.mask, site.q, site.k, trusted, inverted)
                except MaskIsBias as exc:
                    try:  # a mask that also adds an ALiBi bias (Falcon's SDPA path)
                        mask_cache[key] = analyze_biased_mask(gm, site.mask, site.q, site.k, hq, trusted)
                    except NotProvable as why:
                        raise NotProvable(f"{exc}; as a position bias: {why}") from None
            except NotProvable as exc:
                mask_cache[key] = str(exc)
            except Exception as exc:  # an evaluation failure is a refusal, never a wrong lowering
                mask_cache[key] = f"the mask could not be evaluated ({type(exc).__name__}: {exc})"
        pattern = mask_cache[key]
        if isinstance(pattern, str):
            site.refuse(pattern)
            return
        if isinstance(pattern, tuple):
            pattern, slopes = pattern
            site.alibi_slopes = _add_slopes(site.alibi_slopes, slopes)
        site.causal, site.window_left, site.chunk_size = pattern.causal, pattern.window_left, pattern.chunk_size
    if "prescale_bias" in site.extra:
        bias, outer = site.extra["prescale_bias"]
        if outer.runtime:
            site.refuse("a position bias added before a runtime scale")
            return
        try:
            slopes = analyze_bias(gm, bias, hq, trusted, merged_heads=bool(site.extra.get("merged_heads")))
        except Exception as exc:  # NotProvable, or an evaluation failure: a refusal, never a wrong lowering
            why = str(exc) if isinstance(exc, NotProvable) else f"it could not be evaluated: {type(exc).__name__}: {exc}"
            site.refuse(f"a term is added to q @ k^T before the softmax that is not a proven ALiBi bias ({bias.name}: {why})")
            return
        site.alibi_slopes = _add_slopes(site.alibi_slopes, tuple(x * outer.constant for x in slopes))
    if site.alibi_slopes is not None and site.sinks is not None:
        # The bias is proven up to a constant per query row, which the softmax cancels, but a
        # sink logit does not move with it.
        site.refuse("a position bias together with attention sinks (the bias is known only up to a per-row constant)")
        return
    site.lowerable = True
    site.reason = "lowered: " + site.describe()


def _add_slopes(a: tuple[float, ...] | None, b: tuple[float, ...]) -> tuple[float, ...]:
    return b if a is None else tuple(x + y for x, y in zip(a, b))


def _assign_layer_ids(sites: list[AttentionSite]) -> None:
    """KV-pool layer ids: the module's layer index when unique among sites, else graph order."""
    idx = [s.layer_index for s in sites]
    unique = all(i is not None for i in idx) and len(set(idx)) == len(idx)
    for ordinal, s in enumerate(sites):
        s.layer_id = s.layer_index if unique else ordinal


def _show(x: Any) -> str:
    return x.name if isinstance(x, fx.Node) else repr(x)
