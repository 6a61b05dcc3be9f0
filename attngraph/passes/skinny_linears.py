"""Pass `skinny_linears`: the paged graph's linears call attngraph's linear ops.

A decode step multiplies a few token rows by every weight matrix. cuBLAS reads the weights of
such products at a fraction of the memory bandwidth and splits K of the tall ones (a fill, a
reduce and a copy launched around the GEMM). `torch.ops.attngraph.linear` runs a Triton GEMV
(`attngraph.skinny_linear`) for one or two rows on CUDA, a tensor-core Triton GEMM
(`attngraph.skinny_dot`) for 3-16 and ``torch.nn.functional.linear`` otherwise, so one traced
graph serves decode and prefill steps alike; a captured CUDA graph holds whichever the step's
row count chose.

Rewrites, on a Dynamo graph (torch-level calls):

* ``linear(x, w, b)`` -> ``attngraph.linear(x, w, b)``;
* ``linear(silu(a) * b, w)`` (a gated MLP's down projection; either operand order of the
  product) -> ``attngraph.silu_mul_linear(a, b, w)``: the GEMV computes the product as it
  loads it, so neither it nor its kernel exists. ``a`` and ``b`` taken through a
  ``.contiguous()`` (`fuse_linears`'s halves of the fused gate/up output) are read as the
  strided views behind it.

Linears that no row count runs on a Triton kernel stay as they are (`SkinnyResult.kept`,
`linear_ops.kernel_may_serve`): weights above `linear_ops.KERNEL_MAX_WEIGHT` elements, or above
`KERNEL_MAX_WEIGHT_ONE_ROW` where one row would take them, except output heads, and above
`linear_ops.DOT_MAX_WEIGHT` (the tensor-core kernel's limit, heads aside); a down
projection that folds SiLU * up has the larger `linear_ops.KERNEL_MAX_SILU_MUL_WEIGHT`, since
the fold also saves the product's launch, and a fused gate/up product whose halves feed that
SiLU * up the gated MLP op's `linear_ops.DOT_MAX_GATED_WEIGHT` (`passes.fuse_gated_mlp`, whose
tensor-core launch forms SiLU * up in its epilogue; at other row counts the op runs cuBLAS for
a weight past the plain limits). Left alone,
with the reason in `SkinnyResult.refused`: a linear with keyword arguments or a weight that is
not a matrix of known shape; a SiLU or product read by anything else is not folded into
the down projection (that linear still becomes ``attngraph.linear``).
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field
from typing import Iterable

import sympy
import torch
from torch import fx

from . import fx_utils as fu
from .fuse_linears import LINEAR_TARGETS

logger = logging.getLogger(__name__)

SILU_TARGETS = (torch.nn.functional.silu, torch.ops.aten.silu.default)
MUL_TARGETS = (operator.mul, torch.mul, torch.ops.aten.mul.Tensor)


@dataclass
class SkinnyResult:
    """``linears``: names of the linears now calling ``attngraph.linear``; ``silu_mul``: of
    those calling ``attngraph.silu_mul_linear``; ``kept``: left to cuBLAS for their weight's
    size; ``refused``: (name, reason); ``rows``: name -> the ops' ``rows`` argument
    (`linear_ops.ANY_ROWS`, ``TOKEN_ROWS``, ``LOGIT_ROWS`` or ``TOKEN_OR_LOGIT_ROWS``)."""

    linears: list[str] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)
    kept: list[str] = field(default_factory=list)
    silu_mul: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)


def _is_call(node, targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _behind_contiguous(node: fx.Node) -> fx.Node:
    """``y`` for ``node = y.contiguous()`` read by nothing else, else ``node``."""
    if node.op == "call_method" and node.target == "contiguous" and len(node.args) == 1 and not node.kwargs:
        if len(node.users) == 1 and isinstance(node.args[0], fx.Node):
            return node.args[0]
    return node


def _silu_mul_operands(x: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(a, b)`` when ``x = silu(a) * b`` (or ``b * silu(a)``), the product and the SiLU read
    only there; None otherwise."""
    if not _is_call(x, MUL_TARGETS) or x.kwargs or len(x.args) != 2 or len(x.users) != 1:
        return None
    for s, b in (x.args, x.args[::-1]):
        if not (_is_call(s, SILU_TARGETS) and isinstance(b, fx.Node) and len(s.users) == 1 and s is not b):
            continue
        if len(s.args) != 1 or any(k != "inplace" or v for k, v in s.kwargs.items()):
            continue
        if isinstance(s.args[0], fx.Node):
            return s.args[0], b
    return None


def _last_dim_half_of(node) -> fx.Node | None:
    """``y`` for ``node = y.narrow(-1, start, length)`` (through a ``.contiguous()`` read only
    there, `fx_utils.last_dim_narrow`), else None."""
    found = fu.last_dim_narrow(_behind_contiguous(node)) if isinstance(node, fx.Node) else None
    return found[0] if found is not None else None


def _gated_products(graph: fx.Graph) -> set[fx.Node]:
    """The linears without a bias whose output is read only as two last-dim slices (through
    ``.contiguous()``) that are the operands of one ``silu(a) * b`` feeding a linear: a gated
    MLP's fused gate/up product (`fuse_linears`), which `fuse_gated_mlp` may make one op whose
    tensor-core launch forms SiLU * up in its epilogue (`linear_ops.DOT_MAX_GATED_WEIGHT`)."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if not (_is_call(node, LINEAR_TARGETS) and not node.kwargs and node.args and isinstance(node.args[0], fx.Node)):
            continue
        operands = _silu_mul_operands(node.args[0])
        if operands is None:
            continue
        a, b = (_last_dim_half_of(op) for op in operands)
        if a is None or a is not b or not _is_call(a, LINEAR_TARGETS) or a.kwargs or len(a.args) > 3:
            continue
        if (len(a.args) == 3 and a.args[2] is not None) or len(a.users) != 2:
            continue
        found.add(a)
    return found


def _fits(weight: torch.Tensor, max_weight: int | None, silu_mul: bool, gated: bool = False) -> bool:
    """Whether the op may run ``weight`` on the kernel: at most ``max_weight`` elements; -1:
    `linear_ops.kernel_may_serve` (the ops' own limits, the one-row ones included; ``gated``:
    a gated MLP's gate/up product, `_gated_products`)."""
    from .. import linear_ops

    if max_weight is None:
        return True
    n, k = weight.shape
    if not (isinstance(n, int) and isinstance(k, int)):  # a symbolic size: not a weight
        return False
    if max_weight == -1:
        return linear_ops.kernel_may_serve(n, k, silu_mul, gated)
    return n * k <= max_weight


def _axis_symbols(gm: fx.GraphModule, names: Iterable[str]) -> set:
    """Free symbols of the sizes of the placeholders whose names contain one of ``names``."""
    names = tuple(names)
    out: set = set()
    for ph in gm.graph.find_nodes(op="placeholder"):
        val = ph.meta.get("example_value")
        if isinstance(val, torch.Tensor) and any(n in ph.name for n in names):
            for size in val.shape:
                if isinstance(size, torch.SymInt):
                    out |= set(size.node.expr.free_symbols)
    return out


def rows_kind(x: fx.Node, token_symbols: set, logit_symbols: set) -> int:
    """What the rows of the linear input ``x`` are (`linear_ops.ANY_ROWS`...): token or logits
    rows when the product of its leading sizes is exactly one token-count or logits-count
    symbol (``[1, N, K]``, ``[N, K]``); anything else (a constant, ``2 * N`` rows, an MoE
    expert's gathered rows of data-dependent count) computes every row."""
    from .. import linear_ops

    val = x.meta.get("example_value")
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        return linear_ops.ANY_ROWS
    sym = None
    for size in val.shape[:-1]:
        if isinstance(size, torch.SymInt):
            expr = size.node.expr
            if sym is not None or not isinstance(expr, sympy.Symbol):
                return linear_ops.ANY_ROWS
            sym = expr
        elif int(size) != 1:
            return linear_ops.ANY_ROWS
    tokens, logits = sym in token_symbols, sym in logit_symbols
    if tokens and logits:
        return linear_ops.TOKEN_OR_LOGIT_ROWS
    return linear_ops.TOKEN_ROWS if tokens else linear_ops.LOGIT_ROWS if logits else linear_ops.ANY_ROWS


def skinny_linears(
    gm: fx.GraphModule,
    fold_silu_mul: bool = True,
    max_weight: int | None = -1,
    token_inputs: Iterable[str] = (),
    row_index_inputs: Iterable[str] = (),
) -> SkinnyResult:
    """Rewrite ``gm``'s linears (module docstring). Mutates ``gm``; returns what it did.

    ``max_weight``: linears whose weight holds more elements stay as they are (the ops would
    run cuBLAS for them at any row count; a gated MLP's product stays inductor's to fuse).
    ``-1``: the ops' own limits (`linear_ops.kernel_may_serve`: `KERNEL_MAX_WEIGHT`, the
    one-row `KERNEL_MAX_WEIGHT_ONE_ROW` and output heads, `KERNEL_MAX_SILU_MUL_WEIGHT` for a
    linear that folds SiLU * up); None: every linear.

    ``token_inputs`` / ``row_index_inputs``: substrings of the placeholder names whose symbolic
    sizes are the token count (``input_ids: [1, N]``) / the logits count (``logits_indices:
    [L]``) of a ragged graph. A linear whose rows are exactly those tokens or logits rows gets
    the op's ``rows`` argument (`rows_kind`, `SkinnyResult.rows`), so that a padded step
    computes its real rows only. Empty: every op computes every row."""
    from .. import linear_ops  # registers torch.ops.attngraph.linear / silu_mul_linear

    token_symbols, logit_symbols = _axis_symbols(gm, token_inputs), _axis_symbols(gm, row_index_inputs)

    result = SkinnyResult()
    graph = gm.graph
    gated = _gated_products(graph) if max_weight == -1 else set()
    for node in list(graph.nodes):
        if not _is_call(node, LINEAR_TARGETS):
            continue
        if node.kwargs:
            result.refused.append((node.name, "keyword arguments"))
            continue
        x, w, b = (list(node.args) + [None, None])[:3]
        if not isinstance(x, fx.Node) or not isinstance(w, fx.Node) or not (b is None or isinstance(b, fx.Node)):
            result.refused.append((node.name, "an input that is not a graph node"))
            continue
        weight = w.meta.get("example_value")
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            result.refused.append((node.name, "the weight is not a matrix of known shape"))
            continue
        operands = _silu_mul_operands(x) if fold_silu_mul and b is None else None
        if not _fits(weight, max_weight, operands is not None, node in gated):
            result.kept.append(node.name)
            continue
        folded: list[fx.Node] = []
        kind = rows_kind(x, token_symbols, logit_symbols)
        result.rows[node.name] = kind
        with graph.inserting_before(node):
            if operands is not None:
                gate, up = operands
                a, b_up = _behind_contiguous(gate), _behind_contiguous(up)
                new = graph.call_function(torch.ops.attngraph.silu_mul_linear.default, (a, b_up, w, kind))
                folded = [x, x.args[0] if x.args[0] is not up else x.args[1], gate, up]  # mul, silu, copies
                result.silu_mul.append(node.name)
            else:
                new = graph.call_function(torch.ops.attngraph.linear.default, (x, w, b, kind))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        for dead in folded:  # in use order: each is read by nothing once the ones before it are gone
            if dead.op in ("call_function", "call_method") and not dead.users and dead in graph.nodes:
                graph.erase_node(dead)
        result.linears.append(node.name)
    summary = f"skinny_linears: {len(result.linears)} linears call attngraph.linear ({len(result.silu_mul)} with SiLU * up folded in)"
    fu.finish_rewrite(gm, logger, summary if result.linears else None, result.refused, "skinny_linears: %s left as it was: %s")
    return result
