"""Pass `absorb_mla`: multi-head latent attention attends over its latent, not over expanded K/V.

DeepSeek V2/V3's attention (transformers' ``expand_kv`` form, which other models' code copies)
keeps one latent ``c: [B, 1, S, r]`` per token plus a RoPE key ``kr: [B, 1, S, p]`` shared by all
heads, and expands the latent per head with ``kv_b_proj`` (weight ``W: [H * (n + dv), r]``)::

    kv = linear(c, W).view(B, S, H, n + dv).transpose(1, 2)     # [B, H, S, n + dv]
    k_nope, v = kv.split([n, dv], -1)
    key = kv.new_empty(B, H, S, n + p)
    key[..., :n].copy_(k_nope); key[..., n:].copy_(kr.expand(-1, H, -1, -1))
    q = cat((q_nope, q_rot), -1)                                 # [B, H, S, n + p]
    out = attention(q, key, v)                                   # [B, H, S, dv]

With ``W_UK[h] = W.view(H, n + dv, r)[h, :n]`` and ``W_UV[h] = W.view(...)[h, n:]``,
``q_nope . (W_UK[h] c) = (q_nope W_UK[h]) . c`` and ``sum_j p_j W_UV[h] c_j = W_UV[h] sum_j p_j c_j``,
so the same attention is (up to float rounding)::

    q' = cat((q_nope @ W_UK, q_rot), -1)                          # [B, H, S, r + p]
    k' = cat((c, kr), -1)                                         # [B, 1, S, r + p]: one KV head
    out = attention(q', k', c) @ W_UV^T                           # [B, H, S, r] -> [B, H, S, dv]

The paged pool then holds ``r + p`` values per token and layer (576 at DeepSeek-V3's dims,
instead of ``H * (n + p + dv)`` = 40,960), and the value is read from the key's first ``r``
columns (`AttentionSite.value_in_key`).

The pass runs on lowered sites (after `lower_attention` and `cleanup`), and rewrites a site only
when every piece above is found with the shapes that make the identity hold: the key buffer
written by exactly the two copies (no other reader or writer), the split of one bias-free
``kv_b`` linear on a single-head latent, the RoPE key broadcast over the heads, the query a
concatenation of the same widths in the same order, and one dtype throughout. Anything else
leaves the site as it was (the MHA form, still exact), and the reason is logged.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from . import fx_utils as fu
from .lower_attention import ATTENTION_OP
from .site import AttentionSite

logger = logging.getLogger(__name__)

_LINEAR = {torch._C._nn.linear, F.linear}
_SPLIT = {torch.split, torch.functional.split, "split"}
_CAT = {torch.cat, torch.concat, torch.concatenate}


class _NoMatch(Exception):
    """The site is not (provably) MLA; the message says which piece is missing."""


@dataclass
class _Match:
    op: fx.Node  # the lowered attention op
    query: fx.Node  # cat((q_nope, q_rot), -1): [B, H, S, n + p]
    q_nope: fx.Node  # [B, H, S, n]
    q_rot: fx.Node  # [B, H, S, p]
    latent: fx.Node  # c: [B, 1, S, r]
    rope_key: fx.Node  # kr: [B, 1, S, p]
    weight: fx.Node  # kv_b_proj's weight [H * (n + dv), r]
    copies: list[fx.Node]  # the two copy_ into the key buffer, and their slices
    heads: int
    nope: int
    rope: int
    latent_dim: int
    v_head_dim: int


def absorb_mla(gm: fx.GraphModule, sites: list[AttentionSite]) -> list[AttentionSite]:
    """Rewrite every lowered MLA site to attend over its latent (see the module docstring).

    Updates each rewritten site: one KV head, ``head_dim = r + p``, ``v_head_dim = r``,
    ``value_in_key = True`` and ``extra["mla"]`` (the dims); returns the rewritten sites.
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    ops: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is ATTENTION_OP:
            ops.setdefault(node.args[3], []).append(node)
    done = []
    for site in sites:
        if not site.lowered:
            continue
        try:
            found = ops.get(site.layer_id, [])
            if len(found) != 1:  # (cleanup may have folded the output's transpose: find the op by layer)
                raise _NoMatch(f"{len(found)} lowered ops of layer {site.layer_id}")
            match = _match(site, found[0], order)
        except _NoMatch as exc:
            logger.debug("absorb_mla: %s stays in MHA form: %s", site.name, exc)
            continue
        except (AttributeError, IndexError, TypeError, ValueError) as exc:  # a shape of graph not foreseen
            logger.debug("absorb_mla: %s stays in MHA form: %s: %s", site.name, type(exc).__name__, exc)
            continue
        _rewrite(gm.graph, site, match)
        done.append(site)
    if done:  # the expansion, the key buffer and the old op are dead now: `cleanup` removes them
        gm.recompile()
        logger.info("absorb_mla: %d of %d attention sites attend over their latent", len(done), len(sites))
    return done


# ----------------------------------------------------------------------------- matching
def _shape(node: Any) -> tuple:
    val = fu.example_value(node)
    if not isinstance(val, torch.Tensor):
        raise _NoMatch(f"{getattr(node, 'name', node)} has no traced tensor value")
    return tuple(val.shape)


def _shape4(node: Any) -> tuple:
    shape = _shape(node)
    if len(shape) != 4:
        raise _NoMatch(f"{node.name} is {len(shape)}-D, not [B, H, S, D]")
    return shape


def _dtype(node: fx.Node) -> torch.dtype:
    return fu.example_value(node).dtype


def _same(a: Any, b: Any) -> bool:
    """Equal sizes, symbolic ones included (the token count)."""
    try:
        return bool(a == b)
    except Exception:  # an undecidable symbolic comparison
        return False


def _same_shape(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def _unragged(node: Any, what: str) -> fx.Node:
    """``reshape(transpose(x, 1, 2), -1, H, D)`` (what `lower_attention` feeds the op) -> x."""
    if not (fu.is_op(node, fu.RESHAPE) and len(node.users) == 1):
        raise _NoMatch(f"the op's {what} is not lower_attention's reshape")
    t = node.args[0]
    if not (fu.is_op(t, fu.TRANSPOSE) and len(t.users) == 1 and set(t.args[1:3]) == {1, 2}):
        raise _NoMatch(f"the op's {what} is not lower_attention's transpose")
    return t.args[0]


def _slice_of_last(node: fx.Node, width: int) -> tuple[int, int] | None:
    """``x[..., a:b]`` -> ``(a, b)`` with ``b`` resolved against ``width``; None otherwise."""
    if not (node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2):
        return None
    idx = node.args[1]
    if not (isinstance(idx, tuple) and len(idx) == 2 and idx[0] is Ellipsis and isinstance(idx[1], slice)):
        return None
    s = idx[1]
    if s.step not in (None, 1) or not all(v is None or isinstance(v, int) for v in (s.start, s.stop)):
        return None
    start, stop, _ = s.indices(width)
    return start, stop


def _match(site: AttentionSite, op: fx.Node, order: dict[fx.Node, int]) -> _Match:
    q = _unragged(op.args[0], "query")
    key = _unragged(op.args[1], "key")
    value = _unragged(op.args[2], "value")

    # The key buffer: new_empty, written by two copies into [0, n) and [n, D), read by the op.
    if not fu.is_op(key, {"new_empty"}):
        raise _NoMatch("the key is not a buffer filled by copies")
    b, heads, s, d = _shape4(key)
    slices, copies = {}, []
    for user in key.users:
        if user is op.args[1].args[0]:
            continue
        span = _slice_of_last(user, d)
        copy = next(iter(user.users)) if len(user.users) == 1 else None
        if span is None or not (fu.is_op(copy, {"copy_"}) and copy.args[0] is user and not copy.users
                                and len(copy.args) == 2 and not copy.kwargs):  # fmt: skip
            raise _NoMatch(f"the key buffer has another user: {user.name}")
        if order[copy] > order[op]:
            raise _NoMatch("a copy into the key buffer comes after the attention")
        slices[span] = copy.args[1]
        copies += [copy, user]
    if len(slices) != 2:
        raise _NoMatch("the key buffer is not written by exactly two copies")
    (lo, src_lo), (hi, src_hi) = sorted(slices.items())
    nope = lo[1]
    if lo[0] != 0 or hi != (nope, d) or not 0 < nope < d:
        raise _NoMatch("the two copies do not split the key's last dim in two")
    rope = d - nope

    # k_nope and v: the two parts of one split of kv_b_proj(c), per head.
    split = src_lo.args[0] if src_lo.op == "call_function" and src_lo.target is operator.getitem else None
    if not (fu.is_op(split, _SPLIT) and src_lo.args[1] == 0):
        raise _NoMatch("the key's first part is not a split's first piece")
    if not (value.op == "call_function" and value.target is operator.getitem and value.args == (split, 1)):
        raise _NoMatch("the value is not the second piece of the key's split")
    sizes, dim = fu.arg(split, 1, "split_size_or_sections"), fu.arg(split, 2, "dim", 0)
    if sizes is None:
        sizes = fu.arg(split, 1, "split_size")
    kv = split.args[0]
    if not (isinstance(sizes, (list, tuple)) and len(sizes) == 2 and sizes[0] == nope and dim in (-1, 3)):
        raise _NoMatch("the split is not [nope, v] along the last dim")
    dv = sizes[1]
    if not (fu.is_op(kv, fu.TRANSPOSE) and set(kv.args[1:3]) == {1, 2}):
        raise _NoMatch("the split input is not the heads moved forward")
    per_token = kv.args[0]
    if not fu.is_op(per_token, fu.RESHAPE):
        raise _NoMatch("the expanded latent is not viewed per head")
    lin = per_token.args[0]
    if not (fu.is_op(lin, _LINEAR) and fu.arg(lin, 2, "bias") is None and len(lin.args) >= 2):
        raise _NoMatch("the latent is not expanded by a bias-free linear")
    latent, weight = lin.args[0], lin.args[1]
    if not (isinstance(weight, fx.Node) and weight.op == "placeholder"):
        raise _NoMatch("kv_b's weight is not a graph input")
    lb, one, ls, r = _shape4(latent)
    if not (one == 1 and _same_shape(_shape(lin), (b, 1, s, heads * (nope + dv))) and _same_shape(
            _shape(per_token), (b, s, heads, nope + dv)) and _same_shape(_shape(weight), (heads * (nope + dv), r))
            and _same(lb, b) and _same(ls, s)):  # fmt: skip
        raise _NoMatch("the latent's expansion has other shapes than [B, 1, S, r] -> [B, H, S, n + v]")

    # The RoPE key: one head broadcast over all of them.
    if not fu.is_op(src_hi, fu.EXPAND):
        raise _NoMatch("the key's second part is not a broadcast RoPE key")
    rope_key = src_hi.args[0]
    if not (_same_shape(_shape(rope_key), (b, 1, s, rope)) and _same_shape(_shape(src_hi), (b, heads, s, rope))):
        raise _NoMatch("the RoPE key is not one head broadcast over the heads")

    # The query: [q_nope | q_rot] with the key's widths, in the key's order.
    if not (fu.is_op(q, _CAT) and fu.arg(q, 1, "dim", 0) in (-1, 3)):
        raise _NoMatch("the query is not a concatenation along the last dim")
    parts = fu.arg(q, 0, "tensors")
    if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and all(isinstance(p, fx.Node) for p in parts)):
        raise _NoMatch("the query is not a concatenation of two parts")
    q_nope, q_rot = parts
    if not (_same_shape(_shape(q_nope), (b, heads, s, nope)) and _same_shape(_shape(q_rot), (b, heads, s, rope))):
        raise _NoMatch("the query's parts do not have the key's widths")
    if site.num_q_heads != heads or site.num_kv_heads != heads:
        raise _NoMatch("query and key head counts differ")
    dtypes = {_dtype(n) for n in (q_nope, q_rot, latent, rope_key, weight, key)}
    if len(dtypes) != 1:
        raise _NoMatch(f"mixed dtypes {sorted(map(str, dtypes))}")
    # The rewrite reads the parts where the op runs; an in-place write to any of them (or to
    # a view of one) anywhere could make that differ from what the copies and the cat read.
    written = fu.first_write(fu.aliases([q_nope, q_rot, latent, rope_key, weight]), exclude=copies)
    if written is not None:
        raise _NoMatch(f"{written.name} writes in place to a tensor the latent form reads")
    return _Match(op, q, q_nope, q_rot, latent, rope_key, weight, copies, heads, nope, rope, r, dv)


# ----------------------------------------------------------------------------- rewriting
def _rewrite(graph: fx.Graph, site: AttentionSite, m: _Match) -> None:
    h, n, p, r, dv = m.heads, m.nope, m.rope, m.latent_dim, m.v_head_dim
    op = m.op
    with graph.inserting_before(op):
        w = graph.call_method("view", (m.weight, h, n + dv, r))  # [H, n + dv, r]
        w_uk = graph.call_function(operator.getitem, (w, (slice(None), slice(None, n), slice(None))))  # [H, n, r]
        w_uv_t = graph.call_method(  # [H, r, dv]
            "transpose", (graph.call_function(operator.getitem, (w, (slice(None), slice(n, None), slice(None)))), 1, 2)
        )
        q_abs = graph.call_function(torch.matmul, (m.q_nope, w_uk))  # [B, H, S, r]
        q_new = graph.call_function(torch.cat, ((q_abs, m.q_rot), -1))  # [B, H, S, r + p]
        k_new = graph.call_function(torch.cat, ((m.latent, m.rope_key), -1))  # [B, 1, S, r + p]
        ragged = [
            graph.call_method("reshape", (graph.call_method("transpose", (x, 1, 2)), -1, heads, dim))
            for x, heads, dim in ((q_new, h, r + p), (k_new, 1, r + p), (m.latent, 1, r))
        ]
        out = graph.call_function(ATTENTION_OP, (*ragged, *op.args[3:]), dict(op.kwargs))  # [T, H, r]
        up = graph.call_function(torch.matmul, (graph.call_method("transpose", (out, 0, 1)), w_uv_t))  # [H, T, dv]
        result = graph.call_method("transpose", (up, 0, 1))  # [T, H, dv], what the op gave before
    for node in (w, w_uk, w_uv_t, q_abs, q_new, k_new, out, up, result):
        node.meta["nn_module_stack"] = dict(op.meta.get("nn_module_stack", {}))
    b, _, s = _shape(m.q_nope)[:3]
    _fake_value(q_new, m.q_nope, (b, h, s, r + p))  # later passes read site.q / site.k's values
    _fake_value(k_new, m.q_nope, (b, 1, s, r + p))
    op.replace_all_uses_with(result)
    graph.erase_node(op)
    # lower_attention read the batch and length off the old query (``q.size(0)``, ``q.size(2)``);
    # q_nope has them too, and the old concatenation then goes with the rest of the MHA form.
    for user in list(m.query.users):
        if user.op == "call_method" and user.target == "size" and user.args[1:] in ((0,), (2,)):
            user.replace_input_with(m.query, m.q_nope)
    for node in m.copies:  # copy_, then its slice: the key buffer loses its last readers
        graph.erase_node(node)
    site.q, site.k, site.v = q_new, k_new, m.latent
    site.num_kv_heads, site.head_dim, site.v_head_dim = 1, r + p, r
    site.value_in_key = True
    site.extra["mla"] = {"latent_dim": r, "rope_dim": p, "nope_dim": n, "v_head_dim": dv}


def _fake_value(node: fx.Node, like: fx.Node, shape: tuple) -> None:
    """Set ``node``'s ``example_value``: a contiguous tensor of ``shape`` in ``like``'s fake mode
    (its own, not the active one: Dynamo gives its backend a fresh mode)."""
    from torch._subclasses.fake_tensor import FakeTensor

    ref = fu.example_value(like)
    if not isinstance(ref, FakeTensor):
        return
    mode = ref.fake_mode
    with mode:
        node.meta["example_value"] = torch.empty(shape, dtype=ref.dtype, device=ref.device)
