"""Prove what an attention mask in a graph is, for every sequence length.

A mask may be replaced by the op's own ``causal`` / ``window_left`` parameters only when it
is a function of shapes and positions alone. `value_inputs` finds the graph inputs whose
*values* (not just sizes) reach the mask; any input other than the trusted positions makes
the mask data-dependent and the site stays as it is. Otherwise `analyze_mask`:

1. evaluates the mask's subgraph on a few probe sizes and reads off a *candidate*: causal
   (aligned bottom-right), causal with a sliding window of ``W`` keys, causal within chunks of
   ``C`` positions (Llama 4's local layers), or full. Probing only proposes; it proves nothing
   about lengths it did not try;
2. derives the mask's element formula over (query row, key column, the graph's size symbols)
   from the subgraph (`symbolic_mask`) and proves it equal to the candidate for every
   integer value of those symbols that the shape environment allows (`linear_proof`). ``W``
   and ``C`` are numbers in the candidate, so a window that changes with the length (``i - j < S // 3``)
   fails the proof, as does any mask that is no such pattern at some length.

A site is lowered only when step 2 succeeds; otherwise the refusal says why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable

import sympy
import torch
from torch import fx

from . import linear_proof, symbolic_mask
from .fx_utils import SHAPE_ATTRS, SHAPE_QUERIES, aliases, example_value, first_write, is_op
from .symbolic_mask import I, NotProvable, size_expr

logger = logging.getLogger(__name__)

#: Largest probe length: masks are evaluated as dense [L, L] tensors.
MAX_PROBE_LEN = 8192


class MaskIsBias(NotProvable):
    """The float mask adds values other than 0 and blocked ones: a bias (`position_bias`)."""


@dataclass(frozen=True)
class MaskPattern:
    causal: bool
    window_left: int = -1  # query at position p sees keys j >= p - window_left; -1: none
    chunk_size: int = 0  # query at position p sees keys j >= p - p % chunk_size; 0: none

    def describe(self) -> str:
        if not self.causal:
            return "full"
        if self.chunk_size > 0:
            return f"causal, chunks of {self.chunk_size}"
        return "causal" if self.window_left < 0 else f"causal, window {self.window_left + 1}"


def _is_shape_query(node: fx.Node) -> bool:
    if is_op(node, SHAPE_QUERIES):
        return True
    return node.op == "call_function" and node.target is getattr and len(node.args) > 1 and node.args[1] in SHAPE_ATTRS


def ancestors(node: fx.Node, values_only: bool = False) -> set[fx.Node]:
    """``node`` and every node it is computed from. ``values_only``: only ancestors whose
    values (not just sizes) reach ``node``; edges through shape queries are cut."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if not (values_only and _is_shape_query(n)):
            stack.extend(n.all_input_nodes)
    return seen


def unseen_mutation(node: fx.Node) -> fx.Node | None:
    """A node that modifies (in place, possibly through a view) a tensor ``node`` is computed
    from, without being among ``node``'s ancestors; None when there is none.

    Evaluating ``node``'s ancestors alone would miss such a write (``mask[..., :n] = padding``),
    so a mask with one is not provable. A write counts wherever it is in the graph, and whatever
    view it goes through (``mask.mT[...] = x``, ``torch.diagonal(mask).fill_(x)``,
    ``mask.data[...] = x``): the written tensors are found by storage (`fx_utils.aliases`).
    """
    need = ancestors(node, values_only=True)
    return first_write(aliases(need), exclude=need)


def value_inputs(node: fx.Node) -> set[fx.Node]:
    """Graph inputs (placeholders, get_attr) whose tensor *values* flow into ``node``.

    Edges through size/shape/device/dtype queries are cut: they read metadata only.
    SymInt placeholders are sizes, not data, and are not reported.
    """
    seen: set[fx.Node] = set()
    found: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            if isinstance(example_value(n), torch.Tensor):
                found.add(n)
            continue
        if n.op == "get_attr":
            found.add(n)
            continue
        if _is_shape_query(n):
            continue
        stack.extend(n.all_input_nodes)
    return found


def extract_subgraph(gm: fx.GraphModule, target: fx.Node) -> tuple[fx.GraphModule, list[fx.Node]]:
    """A GraphModule computing ``target`` from the placeholders it needs (in graph order)."""
    need = ancestors(target)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []
    for n in gm.graph.nodes:
        if n not in need:
            continue
        if n.op == "placeholder":
            env[n] = graph.placeholder(n.name)
            inputs.append(n)
        else:
            env[n] = graph.node_copy(n, lambda x: env[x])
    graph.output(env[target])
    return fx.GraphModule(gm, graph), inputs


def _free_symbols(inputs: Iterable[fx.Node]) -> dict[sympy.Symbol, int]:
    """Free size symbols of the inputs' example values, with their traced (hint) values."""
    hints: dict[sympy.Symbol, int] = {}

    def visit(size: Any) -> None:
        if isinstance(size, torch.SymInt):
            shape_env = size.node.shape_env
            values = getattr(shape_env, "backed_var_to_val", None)
            if values is None:  # torch < 2.13
                values = shape_env.var_to_val
            for sym in size.node.expr.free_symbols:
                if sym not in hints:
                    hints[sym] = int(values.get(sym, 2))

    for n in inputs:
        val = example_value(n)
        if isinstance(val, torch.SymInt):
            visit(val)
        elif isinstance(val, torch.Tensor):
            for s in val.shape:
                visit(s)
    return hints


def _concrete(size: Any, assignment: dict[sympy.Symbol, int]) -> int:
    if isinstance(size, torch.SymInt):
        return int(size.node.expr.xreplace({k: sympy.Integer(v) for k, v in assignment.items()}))
    return int(size)


def _int_constants(gm: fx.GraphModule) -> list[int]:
    out: list[int] = []

    def visit(a: Any) -> None:
        if isinstance(a, bool):
            return
        if isinstance(a, int):
            out.append(abs(a))
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)
        elif isinstance(a, slice):
            visit((a.start, a.stop, a.step))

    for n in gm.graph.nodes:
        visit(n.args)
        visit(tuple(n.kwargs.values()))
    return out


def _probe_input(node: fx.Node, assignment: dict[sympy.Symbol, int], positions: set[fx.Node], gen: torch.Generator) -> Any:
    val = example_value(node)
    if isinstance(val, (torch.SymInt, int)):
        return _concrete(val, assignment)
    if isinstance(val, torch.Tensor):
        shape = [_concrete(s, assignment) for s in val.shape]
        device = val.device if val.device.type != "meta" else torch.device("cpu")
        if node in positions:
            pos = torch.arange(shape[-1], device=device, dtype=val.dtype) if shape else torch.zeros((), dtype=val.dtype)
            return pos.expand(shape).contiguous()
        # Size-only inputs get random contents: an undetected value dependence then shows up
        # as an inconsistent mask instead of a plausible one.
        if val.dtype == torch.bool:
            return (torch.rand(shape, generator=gen) > 0.5).to(device)
        if val.dtype.is_floating_point:
            return torch.randn(shape, generator=gen).to(device=device, dtype=val.dtype)
        return torch.randint(-7, 7, shape, generator=gen).to(device=device, dtype=val.dtype)
    raise NotProvable(f"input {node.name} has no example value to probe with")


def probe_assignments(inputs: list[fx.Node], constants: list[int]) -> list[dict[sympy.Symbol, int]]:
    hints = _free_symbols(inputs)
    if not hints:
        return [{}]
    probes = [dict(hints), {s: v + 1 for s, v in hints.items()}]
    big = max([0] + constants) + 3
    if max(hints.values()) < big <= MAX_PROBE_LEN:  # beyond it, the proof alone decides
        probes.append({s: big for s in hints})
    return probes


def evaluate(gm: fx.GraphModule, target: fx.Node, positions: set[fx.Node] = frozenset()) -> list[tuple[dict, Any]]:
    """Evaluate ``target`` at every probe assignment: ``[(assignment, value), ...]``."""
    sub, inputs = extract_subgraph(gm, target)
    gen = torch.Generator().manual_seed(0)
    results = []
    for assignment in probe_assignments(inputs, _int_constants(sub)):
        args = [_probe_input(n, assignment, positions, gen) for n in inputs]
        with torch.no_grad():
            results.append((assignment, sub(*args)))
    return results


def classify(mask: torch.Tensor, q_len: int, k_len: int) -> MaskPattern:
    """Read the pattern off one evaluated mask (SDPA convention: bool True = attend, float added)."""
    from ..attn_backends.base import AttentionLayer
    from ..attn_backends.torch_native import allowed_keys

    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.dtype.is_floating_point:
        allowed = mask == 0
        blocked = mask[~allowed]
        if blocked.numel() and not bool((blocked <= -1e4).all()):
            raise MaskIsBias("the mask adds values other than 0 and -inf (a bias, not a mask)")
    else:
        raise NotProvable(f"mask of dtype {mask.dtype}")
    if allowed.dim() < 2 or allowed.shape[-1] not in (1, k_len) or allowed.shape[-2] not in (1, q_len):
        raise NotProvable(f"mask of shape {tuple(allowed.shape)} does not match q_len={q_len}, k_len={k_len}")
    allowed = allowed.expand(*allowed.shape[:-2], q_len, k_len).reshape(-1, q_len, k_len)
    if not bool((allowed == allowed[:1]).all()):
        raise NotProvable("the mask differs between batch entries or heads (it carries data)")
    a = allowed[0]
    q_pos = torch.arange(k_len - q_len, k_len, device=a.device)
    candidates = [MaskPattern(True, -1), MaskPattern(False, -1)]
    widths = a.sum(-1)
    if q_len and int(widths.max()) > 0:
        candidates.append(MaskPattern(True, int(widths.max()) - 1))
    # chunks: the first position after 0 whose query sees only itself starts the second chunk
    if q_len:
        alone = (q_pos > 0) & (widths == 1) & a[torch.arange(q_len, device=a.device), q_pos]
        if bool(alone.any()):
            candidates.append(MaskPattern(True, -1, int(q_pos[alone.nonzero()[0, 0]])))
    for cand in candidates:
        layer = AttentionLayer(0, 1, 1, 1, 1, 1.0, cand.causal, cand.window_left, chunk_size=cand.chunk_size)
        if bool((allowed_keys(q_pos, k_len, layer) == a).all()):
            return cand
    raise NotProvable("the mask is not causal, sliding-window causal, chunked causal, or full")


def analyze_mask(
    gm: fx.GraphModule, mask: fx.Node, q: fx.Node, k: fx.Node, trusted_positions: set[fx.Node] = frozenset(),
    inverted: bool = False,
) -> MaskPattern:
    """The pattern of ``mask`` for queries ``q: [B, H, Sq, D]`` and keys ``k: [B, H, Sk, D]``.
    ``inverted``: a Boolean mask that is True where a key is blocked (``scores.masked_fill(mask,
    min)``, MPT), not where it is seen.

    Raises `NotProvable` with the reason when the mask depends on data or is no known pattern.
    """
    check_positional(mask, trusted_positions)
    q_shape, k_shape = example_value(q).shape, example_value(k).shape
    seen: list[tuple[MaskPattern, int]] = []
    for assignment, value in evaluate(gm, mask, set(trusted_positions)):
        if not isinstance(value, torch.Tensor):
            raise NotProvable("the mask is not a tensor")
        k_len = _concrete(k_shape[-2], assignment)
        if inverted:
            if value.dtype != torch.bool:
                raise NotProvable(f"masked_fill with a {value.dtype} mask")
            value = ~value
        seen.append((classify(value, _concrete(q_shape[-2], assignment), k_len), k_len))
    _merge(seen)  # the probes refuse early, with a concrete reason; they accept nothing
    return prove_mask(mask, q_shape[-2], k_shape[-2], set(trusted_positions), inverted)


def check_positional(node: fx.Node, trusted_positions: Iterable[fx.Node] = (), what: str = "the mask") -> None:
    """`NotProvable` unless ``node`` is computed from sizes and the trusted positions alone,
    with no in-place write outside its own computation."""
    mutation = unseen_mutation(node)
    if mutation is not None:
        raise NotProvable(f"{what} is modified in place by {mutation.name}, outside its own computation")
    untrusted = value_inputs(node) - set(trusted_positions)
    if untrusted:
        names = ", ".join(sorted(n.name for n in untrusted))
        raise NotProvable(f"{what} depends on the values of input(s) {names} (it can carry padding or data)")


def prove_mask(
    mask: fx.Node, q_len: Any, k_len: Any, positions: set[fx.Node] = frozenset(), inverted: bool = False
) -> MaskPattern:
    """The pattern of ``mask`` for ``q_len`` queries and ``k_len`` keys (ints or SymInts),
    proven for every value of the size symbols; `NotProvable` with the reason otherwise."""
    try:
        allowed, shape = mask_formula(mask, positions)
        if inverted:
            if isinstance(allowed, sympy.Piecewise):
                allowed = linear_proof.piecewise_to_bool(allowed)
            allowed = sympy.Not(allowed)
    except MaskIsBias:
        raise
    except NotProvable as exc:
        raise NotProvable(f"the mask cannot be proven causal, sliding-window or full for every length: {exc}") from None
    sq, sk = size_expr(q_len), size_expr(k_len)
    ranges = _shape_env_ranges(mask)
    pattern = candidate_pattern(allowed, shape, sq, sk, ranges)
    prove_pattern(allowed, shape, pattern, sq, sk, ranges)
    return pattern


#: Length at which `candidate_pattern` reads a window off the formula (a larger window is
#: taken for plain causal, which the proof then rejects: a refusal, never a wrong lowering).
CANDIDATE_LEN = 1 << 20


def candidate_pattern(allowed: Any, shape: tuple, sq: Any, sk: Any, ranges: dict) -> MaskPattern:
    """Read the pattern the formula shows for the first and the last query at a long length:
    a guess that `prove_pattern` must then confirm for every length."""
    import numpy as np

    n = len(shape)
    row, col = I[n - 2], I[n - 1]
    sizes = {s for e in (allowed, sq, sk) for s in getattr(e, "free_symbols", ()) if s not in I}
    values = {}
    for s in sizes:
        lo, hi = ranges.get(s.name, (0, None))
        values[s] = sympy.Integer(max(lo, min(CANDIDATE_LEN, hi if hi is not None else CANDIDATE_LEN)))
    q_n, k_n = int(sq.xreplace(values)), int(sk.xreplace(values))
    if q_n < 1 or k_n < 1:
        raise NotProvable("the mask has no queries or no keys")
    base = allowed.xreplace({I[k]: sympy.Integer(0) for k in range(n - 2)}).xreplace(values)
    keys = np.arange(k_n, dtype=np.int64)

    def visible(r: int):
        e = base.xreplace({row: sympy.Integer(r if shape[-2] != 1 else 0)})
        if shape[-1] == 1:
            e = e.xreplace({col: sympy.Integer(0)})
        got = sympy.lambdify([col], e, "numpy")(keys)
        return np.nonzero(np.broadcast_to(np.asarray(got, dtype=bool), keys.shape))[0]

    last, first = visible(q_n - 1), visible(0)
    if len(last) == k_n and len(first) == k_n:
        return MaskPattern(False)
    # the last query sits at position k_n - 1 (bottom-right alignment)
    if len(last) and last[-1] == k_n - 1 and last[0] == k_n - len(last):
        start = int(last[0])
        if start == 0:
            return MaskPattern(True)
        # A window slides with the query; a chunk starts over: the query at the last chunk's
        # start sees itself alone, and the one before it sees back to its own chunk's start.
        row_of = lambda p: p - (k_n - q_n)  # noqa: E731
        if 0 <= row_of(start - 1) and len(last) > 1 and list(visible(row_of(start))) == [start]:
            before = visible(row_of(start - 1))
            if len(before) and before[-1] == start - 1:
                return MaskPattern(True, -1, int(start - before[0]))
        return MaskPattern(True, len(last) - 1)
    raise NotProvable("the mask is not causal, sliding-window causal, chunked causal, or full (read at the last query)")


def mask_formula(mask: fx.Node, positions: set[fx.Node] = frozenset()) -> tuple[Any, tuple]:
    """``(allowed, shape)``: the Boolean formula, in the index symbols ``I[k]`` of the mask's
    dimensions and the graph's size symbols, of "this query may see this key" (SDPA
    convention: a bool mask is True where allowed, a float mask adds 0 there and a value at or
    below -1e4 elsewhere)."""
    value = symbolic_mask.ElementInterpreter(positions).run(mask)
    if value.kind == "bool":
        return value.expr, value.shape
    if value.kind != "float":
        raise NotProvable(f"mask of dtype {value.dtype}")
    for leaf in symbolic_mask._leaves(value.expr):
        if leaf == 0 or leaf == -sympy.oo or (leaf.is_number and leaf.is_real and leaf <= -1e4):
            continue
        raise MaskIsBias("the mask adds values other than 0 and -inf (a bias, not a mask)")
    return symbolic_mask._rel(sympy.Eq, value.expr, sympy.Integer(0)), value.shape


def pattern_formula(pattern: MaskPattern, row: sympy.Expr, col: sympy.Expr, offset: sympy.Expr) -> Any:
    """The keys a query may see under ``pattern``: query ``row`` sits at position
    ``row + offset`` (``offset = k_len - q_len``: aligned bottom-right), key ``col`` at ``col``."""
    if not pattern.causal:
        return sympy.true
    p = row + offset
    allowed = col <= p
    if pattern.window_left >= 0:
        allowed = sympy.And(allowed, col >= p - pattern.window_left)
    if pattern.chunk_size > 0:
        allowed = sympy.And(allowed, sympy.Eq(sympy.floor(col / pattern.chunk_size), sympy.floor(p / pattern.chunk_size)))
    return allowed


def prove_pattern(allowed: Any, shape: tuple, pattern: MaskPattern, sq: Any, sk: Any, ranges: dict) -> None:
    """Prove that the mask formula ``allowed`` over index symbols of ``shape`` is ``pattern``
    for ``sq`` queries and ``sk`` keys (sympy sizes) at every length the shape environment
    allows; raise `NotProvable` with the reason otherwise."""
    if isinstance(allowed, sympy.Piecewise):
        allowed = linear_proof.piecewise_to_bool(allowed)
    n = len(shape)
    if n < 2:
        raise NotProvable(f"mask of shape {shape} has no query and key dimensions")
    for have, want, what in ((shape[-2], sq, "queries"), (shape[-1], sk, "keys")):
        if have != 1 and sympy.simplify(have - want) != 0:
            raise NotProvable(f"the mask has {have} {what} where the attention has {want}")
    row, col = I[n - 2], I[n - 1]
    # a dimension of size one broadcasts: every query (key) reads its single entry
    allowed = allowed.xreplace({I[k]: sympy.Integer(0) for k in (n - 2, n - 1) if shape[k] == 1})
    domain = [row >= 0, row <= sq - 1, col >= 0, col <= sk - 1]
    domain += [sympy.And(I[k] >= 0, I[k] <= shape[k] - 1) for k in range(n - 2)]
    domain += _size_ranges(ranges, [allowed, sq, sk, *shape])
    want = pattern_formula(pattern, row, col, sk - sq)
    try:
        same, how = linear_proof.equivalent(allowed, want, domain)
    except linear_proof.Unsupported as exc:
        raise NotProvable(f"the mask cannot be proven {pattern.describe()} for every length: {exc}") from None
    if not same:
        raise NotProvable(
            f"the mask is not {pattern.describe()} at every length (it {how}); "
            "only causal, causal with a fixed window or fixed chunks, and full masks are lowered"
        )


def _size_ranges(ranges: dict, exprs: list[Any]) -> list[Any]:
    """Bounds of the size symbols in ``exprs``, from the graph's shape environment (Dynamo
    specializes sizes 0 and 1, so its symbols start at 2); 0 when it is not known."""
    symbols = set()
    for e in exprs:
        if hasattr(e, "free_symbols"):
            symbols |= {s for s in e.free_symbols if s not in I and not isinstance(s, sympy.Dummy)}
    out = []
    for s in symbols:
        lo, hi = ranges.get(s.name, (0, None))
        out.append(s >= lo)
        if hi is not None:
            out.append(s <= hi)
    return out


def _shape_env_ranges(node: fx.Node) -> dict[str, tuple[int, int | None]]:
    env = None
    for n in node.graph.nodes:
        val = example_value(n)
        sizes = [val] if isinstance(val, torch.SymInt) else list(val.shape) if isinstance(val, torch.Tensor) else []
        for s in sizes:
            if isinstance(s, torch.SymInt):
                env = s.node.shape_env
                break
        if env is not None:
            break
    if env is None:
        return {}
    out = {}
    for sym, vr in env.var_to_range.items():
        lo = int(vr.lower) if getattr(vr.lower, "is_Integer", False) else 0
        hi = int(vr.upper) if getattr(vr.upper, "is_Integer", False) else None
        out[str(sym)] = (max(lo, 0), hi)
    return out


def _merge(seen: list[tuple[MaskPattern, int]]) -> MaskPattern:
    """One pattern consistent with every probe.

    A window of ``w + 1`` keys is invisible in a probe with at most that many keys: there
    "causal" and "causal, window w" agree, so such probes do not contradict the window.
    """
    windows = {p.window_left for p, _ in seen if p.window_left >= 0}
    chunks = {p.chunk_size for p, _ in seen if p.chunk_size > 0}
    kinds = {p.causal for p, _ in seen}
    if len(kinds) == 1 and not windows and not chunks:
        return seen[0][0]
    # Chunks of c positions are invisible in a probe of at most c keys (it reads "causal").
    if kinds == {True} and not windows and len(chunks) == 1:
        c = chunks.pop()
        if all(p.chunk_size == c or k_len <= c for p, k_len in seen):
            return MaskPattern(True, -1, c)
    if kinds == {True} and len(windows) == 1:
        w = windows.pop()
        if all(p.window_left == w or k_len <= w + 1 for p, k_len in seen):
            return MaskPattern(True, w)
    described = sorted({p.describe() for p, _ in seen})
    raise NotProvable(f"the mask changes pattern with the sequence length: {described}")


def constant_value(gm: fx.GraphModule, node: Any) -> float:
    """The value of a scalar that does not depend on any input's values (e.g. ``full([], 8.0)``)."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return float(node)
    if not isinstance(node, fx.Node):
        raise NotProvable(f"{node!r} is not a number")
    if value_inputs(node):
        raise NotProvable(f"{node.name} depends on input values")
    if unseen_mutation(node) is not None:
        raise NotProvable(f"{node.name} is modified in place")
    _, inputs = extract_subgraph(gm, node)
    if _free_symbols(inputs):
        # Sizes reach the value: probes cannot show that it is the same at every length, its
        # formula can (a closed term has no symbol left).
        try:
            value = symbolic_mask.ElementInterpreter().run(node)
        except NotProvable as exc:
            raise NotProvable(f"{node.name} may depend on the sequence length ({exc})") from None
        expr = symbolic_mask.as_number(value)
        if value.ndim or not getattr(expr, "is_number", False):
            raise NotProvable(f"{node.name} depends on the sequence length")
    values = {float(v) for _, v in evaluate(gm, node)}
    if len(values) != 1:
        raise NotProvable(f"{node.name} depends on the sequence length")
    return values.pop()


def is_scalar_item(node: Any) -> bool:
    """``x.item()`` of a 0-d input: how Dynamo passes an unspecialized float module attribute."""
    return (
        isinstance(node, fx.Node)
        and node.op == "call_method"
        and node.target == "item"
        and isinstance(node.args[0], fx.Node)
        and node.args[0].op == "placeholder"
    )
