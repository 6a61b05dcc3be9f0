"""Pass `fold_rope`: HF's rotary embedding of q and k moves into the lowered attention op.

A decode step otherwise spends a launch per layer on the rotation (inductor's fused kernel of
HF's ops, writing the rotated q and k) before the attention kernel reads them back. After the
pass the op receives q and k as the projections left them plus the token's ``cos`` and ``sin``
rows (``torch.ops.attngraph.attention(..., rope_cos, rope_sin)``): a backend whose decode
kernel stores the new K/V rotates q and k as it loads them (the Triton backend); every other
call rotates them first in one launch (`attngraph.rope`), the count of before. Where
`fuse_linears` gave q, k and v to the site as copies of the fused projection's columns
(``narrow(-1, ...).contiguous()``, a copy inductor fused into the rotation's kernel), the op
reads the columns in place instead (`_drop_split_copy`), so no copy kernel takes the
rotation's place.

Runs in paged mode on a Dynamo graph (torch-level calls), after `lower_attention`. It matches
HF's ``apply_rotary_pos_emb`` with ``rotate_half`` (Llama, Qwen2, Mistral and the models that
copy them) feeding the op's q and k through the lowering's ``transpose(1, 2).reshape(-1, H, D)``::

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)        # cos, sin: [B, T, D]
    q_embed = q * c + cat((-q[..., D/2:], q[..., :D/2]), -1) * s     # q: [B, H, T, D]

(either operand order of each product and of the sum), the same ``cos`` and ``sin`` for q and
k, one dtype for q, k, cos and sin, every node of the pattern read only inside it. The op's
row ``b * T + t`` then takes row ``(b, t)`` of ``cos.reshape(-1, D)``: the rotation the
pattern computed, element for element (16-bit values rotated in fp32 and rounded once, as
inductor's fused kernel of the pattern rounds them).

Not folded (the site keeps its rotation, reported in `FoldRopeResult.refused`): partial
rotary (``rotary_dim < head_dim``: a slice and a concatenation around the pattern), the
interleaved GPT-J form, a rotation of q alone, rotated tensors read elsewhere (a returned
cache), ``cos`` without the ``[B, T, D]`` rows of the op's tokens, mixed dtypes. (Shape reads of the
rotated tensors, ``q_embed.size(0)``, move to the unrotated ones: same shape.)
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from . import fx_utils as fu
from .lower_attention import ATTENTION_OP

logger = logging.getLogger(__name__)

MUL = (operator.mul, torch.mul)
ADD = (operator.add, torch.add)
NEG = (operator.neg, torch.neg, "neg")
CAT = (torch.cat,)

#: The op's positional arguments after ``batch_size`` and their defaults (`ops.attention_impl`).
_OPTIONAL = (None, 0, None)  # sinks, chunk_size, alibi_slopes


@dataclass
class FoldRopeResult:
    """``folded``: names of the attention ops that took the rotation; ``refused``: (op name,
    reason) for sites whose q or k ends in a partial match; ``copies_dropped``: q, k and v
    inputs of folded ops that now read the fused projection's columns in place."""

    folded: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)
    copies_dropped: int = 0  # `fuse_linears`' column copies the folded ops read through instead


def _val(node):
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _pair(node, targets) -> tuple | None:
    if not fu.is_op(node, targets) or node.kwargs or len(node.args) != 2:
        return None
    return tuple(node.args)


def _half_slice(node, x: fx.Node, upper: bool, half: int) -> bool:
    """Whether ``node`` is ``x[..., half:]`` (``upper``) or ``x[..., :half]``."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return False
    if node.args[0] is not x or not isinstance(node.args[1], tuple) or len(node.args[1]) != 2 or node.args[1][0] is not Ellipsis:
        return False
    sl = node.args[1][1]
    want = slice(half, None, None) if upper else slice(None, half, None)
    return isinstance(sl, slice) and (sl.start, sl.stop, sl.step) == (want.start, want.stop, want.step)


def _rotate_half_of(node) -> tuple[fx.Node, list[fx.Node]] | None:
    """``(x, pattern nodes)`` for ``cat((-x[..., D/2:], x[..., :D/2]), -1)``, else None."""
    if not fu.is_op(node, CAT):
        return None
    args, kwargs = list(node.args), dict(node.kwargs)
    parts = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or set(kwargs) - {"tensors", "dim"}:
        return None
    neg, low = parts
    if not (fu.is_op(neg, NEG) and len(neg.args) == 1 and not neg.kwargs and isinstance(low, fx.Node)):
        return None
    high = neg.args[0]
    x = low.args[0] if isinstance(low, fx.Node) and low.args else None
    xv = _val(x)
    if not isinstance(xv, torch.Tensor) or dim not in (-1, xv.dim() - 1) or xv.shape[-1] % 2:
        return None
    half = xv.shape[-1] // 2
    if not (_half_slice(high, x, True, half) and _half_slice(low, x, False, half)):
        return None
    return x, [node, neg, high, low]


def _unsqueezed(node) -> fx.Node | None:
    """``c`` for ``c.unsqueeze(1)`` (``torch.unsqueeze(c, 1)``), else None."""
    if not fu.is_op(node, (torch.unsqueeze, "unsqueeze")) or node.kwargs or len(node.args) != 2 or node.args[1] != 1:
        return None
    return node.args[0] if isinstance(node.args[0], fx.Node) else None


def _match_rope(e: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, list[fx.Node]] | str | None:
    """``(x, cos, sin, pattern nodes from e up)`` for ``e = x * c + rotate_half(x) * s``;
    a reason where the sum of products is there but a piece differs; None otherwise."""
    terms = _pair(e, ADD)
    if terms is None:
        return None
    products = [_pair(t, MUL) for t in terms]
    if any(p is None for p in products):
        return None
    rotated = [[(_rotate_half_of(a), b) for a, b in (p, p[::-1])] for p in products]
    # exactly one product has a rotate_half operand: (x, c) is the other
    which = [i for i, options in enumerate(rotated) if any(r is not None for r, _ in options)]
    if len(which) != 1:
        return "no rotate_half(x) * sin term" if not which else "rotate_half in both terms"
    (r, s_node), = [(r, s) for r, s in rotated[which[0]] if r is not None]
    x, rot_nodes = r
    plain = products[1 - which[0]]
    if x not in plain:
        return "x * cos and rotate_half(y) * sin rotate different tensors"
    c_node = plain[1] if plain[0] is x else plain[0]
    cos, sin = _unsqueezed(c_node), _unsqueezed(s_node)
    if cos is None or sin is None:
        return "cos and sin are not unsqueezed at dim 1"
    xv, cv, sv, ev = _val(x), _val(cos), _val(sin), _val(e)
    if not all(isinstance(v, torch.Tensor) for v in (xv, cv, sv, ev)):
        return "no example values"
    if xv.dim() != 4 or tuple(cv.shape) != (xv.shape[0], xv.shape[2], xv.shape[3]) or cv.shape != sv.shape:
        return f"cos {tuple(cv.shape)} is not the [B, T, D] rows of x {tuple(xv.shape)}"
    if not (xv.dtype == cv.dtype == sv.dtype == ev.dtype):
        return f"mixed dtypes (x {xv.dtype}, cos {cv.dtype}, sin {sv.dtype}, result {ev.dtype})"
    return x, cos, sin, [e, terms[0], terms[1], c_node, s_node, *rot_nodes]


def _op_input(arg) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """``(e, transpose, reshape)`` for the lowering's ``e.transpose(1, 2).reshape(...)``."""
    if not fu.is_op(arg, ("reshape",)) or arg.kwargs:
        return None
    tr = arg.args[0]
    if not fu.is_op(tr, ("transpose",)) or tr.kwargs or tuple(tr.args[1:]) not in ((1, 2), (2, 1)):
        return None
    return (tr.args[0], tr, arg) if isinstance(tr.args[0], fx.Node) else None


_VIEWS_ANY_STRIDE = ("reshape", "transpose", "permute")  # valid on any strides (reshape copies if it must)


def _drop_split_copy(arg: fx.Node, op: fx.Node) -> fx.Node | None:
    """Drop `fuse_linears`' ``narrow(-1, ...).contiguous()`` copy behind an input of a folded op.

    ``arg`` (q, k or v of the op) = reshape / transpose / permute ops over ``view(c, ...)``
    with ``c = narrow(y, -1, a, n).contiguous()``. Without the fold, inductor fused that copy
    into the rotation's kernel; with it, the copy would be a launch of its own. Where the
    ``view`` only splits the last dimension, it is valid on the narrowed columns too (their
    last stride is 1), and the ops after it are valid on any strides, so the view reads the
    fused GEMM's output in place: the op (``op``) takes strided ``[T, H, D]`` inputs (unit
    stride along D; a backend that needs more copies them itself). Nodes on the way may have
    other readers only of their size (same shape either way). Returns the dropped copy's
    input, or None where nothing matched."""
    node = arg
    while fu.is_op(node, _VIEWS_ANY_STRIDE) and not node.kwargs and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    view = node
    if not (fu.is_op(view, ("view",)) and not view.kwargs and isinstance(view.args[0], fx.Node)):
        return None
    copy = view.args[0]
    if not (fu.is_op(copy, ("contiguous",)) and len(copy.args) == 1 and not copy.kwargs and len(copy.users) == 1):
        return None
    split = copy.args[0]
    before, after = fu.shape_of(copy), fu.shape_of(view)
    if not (fu.is_op(split, ("narrow",)) and isinstance(split.args[0], fx.Node) and before and after):
        return None
    dim = split.args[1] if len(split.args) > 1 else split.kwargs.get("dim")
    if dim not in (-1, len(before) - 1) or len(after) < len(before):
        return None
    if not all(fu.same_size(a, b) for a, b in zip(before[:-1], after)):
        return None  # the view reshapes more than the last dimension
    # the path from the view to arg: read only along it (or for a size)
    path, node = [], arg
    while node is not view:
        path.append(node)
        node = node.args[0]
    path.append(view)
    inside = {*path, op}
    for n in path:
        if any(u not in inside and not (fu.is_op(u, ("size",)) and u.args[0] is n) for u in n.users):
            return None
    copy.replace_all_uses_with(split)
    copy.graph.erase_node(copy)
    for n in path:  # their strides changed: `fx_utils.fill_example_values` computes them anew
        n.meta.pop("example_value", None)
    return split


def _only_read_inside(nodes: list[fx.Node], outside_ok: set[fx.Node]) -> bool:
    inside = set(nodes) | outside_ok
    return all(u in inside for n in nodes for u in n.users)


def fold_rope(gm: fx.GraphModule) -> FoldRopeResult:
    """Move the rotary embedding of each matching site's q and k into its attention op (module
    docstring). Mutates ``gm``; returns what it did."""
    result = FoldRopeResult()
    graph = gm.graph
    for op in list(graph.nodes):
        if not (op.op == "call_function" and op.target is ATTENTION_OP) or op.kwargs or len(op.args) < 9:
            continue
        args = list(op.args) + list(_OPTIONAL[len(op.args) - 9 :]) if len(op.args) < 12 else list(op.args)
        if len(args) > 12 and any(a is not None for a in args[12:]):
            continue  # rotary rows already
        found = []
        for arg in args[:2]:
            chain = _op_input(arg)
            match = _match_rope(chain[0]) if chain is not None else None
            found.append((chain, match))
        reasons = [m for _, m in found if isinstance(m, str)]
        matches = [m for _, m in found if isinstance(m, tuple)]
        if len(matches) != 2:
            if matches or reasons:
                result.refused.append((op.name, reasons[0] if reasons else "only one of q and k is rotated"))
            continue
        (qx, qcos, qsin, qnodes), (kx, kcos, ksin, knodes) = matches
        if qcos is not kcos or qsin is not ksin:
            result.refused.append((op.name, "q and k rotate with different cos / sin"))
            continue
        (qe, qtr, qrs), (ke, ktr, krs) = found[0][0], found[1][0]
        dead = list(dict.fromkeys([qrs, qtr, *qnodes, krs, ktr, *knodes]))  # q and k share cos / sin's unsqueezes
        # the lowering's shape reads of the rotated tensors (the op's batch size, the output
        # view): x has the same shape
        sizes = [(u, x) for e, x in ((qe, qx), (ke, kx)) for u in e.users if fu.is_op(u, ("size",)) and u.args[0] is e]
        if qe is ke or not _only_read_inside(dead, {op, *(u for u, _ in sizes)}):
            outside = sorted({f"{n.name} (by {u.name})" for n in dead for u in n.users if u not in set(dead) | {op}})
            result.refused.append((op.name, f"a piece of the rotation is read elsewhere: {', '.join(outside)}"))
            continue
        d = _val(qx).shape[-1]
        with graph.inserting_before(op):
            new_q = graph.call_method("reshape", (graph.call_method("transpose", (qx, *qtr.args[1:])), *qrs.args[1:]))
            new_k = graph.call_method("reshape", (graph.call_method("transpose", (kx, *ktr.args[1:])), *krs.args[1:]))
            cos2 = graph.call_method("reshape", (qcos, -1, d))
            sin2 = graph.call_method("reshape", (qsin, -1, d))
            new_op = graph.call_function(ATTENTION_OP, (new_q, new_k, *args[2:12], cos2, sin2))
        new_op.meta.update(op.meta)
        op.replace_all_uses_with(new_op)
        for size, x in sizes:
            size.replace_input_with(size.args[0], x)
        graph.erase_node(op)
        while dead:  # readers before what they read
            unread = [n for n in dead if not n.users]
            for node in unread:
                graph.erase_node(node)
            dead = [n for n in dead if n not in unread]
            if not unread:
                raise AssertionError(f"fold_rope: pattern nodes still read after the rewrite: {dead}")
        for arg in new_op.args[:3]:  # q, k, v
            if _drop_split_copy(arg, new_op) is not None:
                result.copies_dropped += 1
        result.folded.append(new_op.name)
    summary = f"fold_rope: {len(result.folded)} rotary embeddings folded into attention ops"
    fu.finish_rewrite(gm, logger, summary if result.folded else None, result.refused, "fold_rope: %s keeps its rotation: %s")
    return result
