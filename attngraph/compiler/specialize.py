"""Graphs compiled once for a dynamic token count, plus exact-size compiles for chosen counts.

The paged runtime compiles its graphs with a symbolic token count, so one compile serves every
step. A decode step of one or two requests has two token rows (the ragged forward pads a
1-token step to 2), and there every projection is a skinny product: cuBLAS runs it as a GEMM
tile, at several times the weight-read time for the small projections, with split K and its
extra launches at the MLP's down projection.

`TokenCountSpecialized` keeps the dynamic compile and, at the first call with a token count it
was given, compiles a copy of the graph for exactly those input sizes; calls with that count
use it from then on. `compile_exact` compiles it with `skinny_mm_decompositions`: each
``mm`` / ``addmm`` of at most ``max_rows`` rows becomes a multiply-and-sum that inductor turns
into a reduction of its own (rows innermost, so each weight element is read once for all
rows), fused with its neighbours (casts, a bias, a residual add) and tuned by
coordinate descent. The runtime makes that first call before capturing a CUDA graph of the
size, so a replay never compiles.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Iterable

import torch
from torch import fx

logger = logging.getLogger(__name__)

#: Most rows of an ``mm`` that `skinny_mm_decompositions` writes as a reduction by default.
SKINNY_MAX_ROWS = 2


def _skinny_mm(mat1: torch.Tensor, mat2: torch.Tensor, max_rows: int = SKINNY_MAX_ROWS) -> Any:
    """``mat1 [M, K] @ mat2 [K, N]`` as ``sum_k mat1[m, k] * mat2[k, n]`` in fp32, laid out
    ``[N, M]`` (rows innermost) and viewed back as ``[M, N]``; NotImplemented (the usual
    lowering) unless ``M`` is a known int <= ``max_rows``."""
    rows = mat1.shape[0]
    if not isinstance(rows, int) or rows > max_rows or mat1.dim() != 2 or mat2.dim() != 2:
        return NotImplemented
    prod = mat1.float().unsqueeze(0) * mat2.float().t().unsqueeze(1)  # [N, M, K]
    return prod.sum(-1).t().to(mat1.dtype)  # [M, N], strides (1, M)


def _skinny_addmm(bias: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, beta: Any = 1, alpha: Any = 1,
                  max_rows: int = SKINNY_MAX_ROWS) -> Any:  # fmt: skip
    """``bias + mat1 @ mat2`` with `_skinny_mm` (plain ``beta = alpha = 1`` only)."""
    if beta != 1 or alpha != 1:
        return NotImplemented
    out = _skinny_mm(mat1, mat2, max_rows)
    if out is NotImplemented:
        return out
    return (out.float() + bias.float()).to(mat1.dtype)


def skinny_mm_decompositions(max_rows: int = SKINNY_MAX_ROWS) -> dict:
    """Inductor's decomposition table with ``mm`` and ``addmm`` of at most ``max_rows`` static
    rows written as reductions (see the module docstring)."""
    from torch._inductor.decomposition import select_decomp_table

    aten = torch.ops.aten
    table = dict(select_decomp_table())
    table[aten.mm.default] = functools.partial(_skinny_mm, max_rows=max_rows)
    table[aten.addmm.default] = functools.partial(_skinny_addmm, max_rows=max_rows)
    return table


def compile_exact(gm: fx.GraphModule, example_inputs: list[Any], inductor_options: dict[str, Any] | None = None,
                  max_rows: int = SKINNY_MAX_ROWS) -> Callable:  # fmt: skip
    """Compile ``gm`` with inductor for the static ``example_inputs``, skinny products as
    reductions (`skinny_mm_decompositions`); ``inductor_options``: settings for this compile."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(
        gm, example_inputs, config_patches=dict(inductor_options) if inductor_options else None,
        decompositions=skinny_mm_decompositions(max_rows),
    )


def free_symbols(values: Iterable[Any]) -> set:
    """Symbols in the sizes and strides of fake tensors and in symbolic scalars."""
    found: set = set()

    def add(x: Any) -> None:
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            found.update(x.node.expr.free_symbols)

    for v in values:
        if isinstance(v, torch.Tensor):
            for d in (*v.shape, *v.stride(), v.storage_offset()):
                add(d)
        elif isinstance(v, (tuple, list)):
            found |= free_symbols(v)
        else:
            add(v)
    return found


def token_axis(args: list[Any], token_symbols: set) -> tuple[int, int] | None:
    """``(argument, dim)`` of the first fake tensor among ``args`` whose size along ``dim`` is
    exactly a token-count symbol; None when no argument has one."""
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            continue
        for d, size in enumerate(a.shape):
            if isinstance(size, torch.SymInt) and size.node.expr in token_symbols:
                return i, d
    return None


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph (attributes shared with ``gm``): a
    compile may rewrite the graph it is given in place."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def _shape_key(args: tuple[Any, ...]) -> tuple:
    return tuple(
        (tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else (type(a).__name__, a) for a in args
    )


def static_fakes(gm: fx.GraphModule, args: tuple[Any, ...]) -> list[Any]:
    """Fake tensors of static sizes for ``args`` (real tensors and ints), in a fresh fake mode,
    with every node of ``gm`` given its ``example_value`` for them (the inductor passes read it;
    the values Dynamo left hold the symbolic sizes of another fake mode)."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in args]

    class _Stamp(fx.Interpreter):
        def run_node(self, node: fx.Node) -> Any:
            out = super().run_node(node)
            if node.op != "output":
                node.meta["example_value"] = out
                node.meta.pop("val", None)
            return out

    with mode, enable_python_dispatcher():
        _Stamp(gm).run(*fakes)
    return fakes


class TokenCountSpecialized:
    """A compiled graph (``dynamic``) plus, for the token counts in ``counts``, compiles of
    ``gm`` for the exact sizes of the call (see the module docstring).

    ``gm``: the graph as traced, not yet given to any compile (pass a `copy_graph_module` of
    a graph that ``dynamic`` was compiled from: a compile may rewrite its graph in place).
    ``axis``: ``(argument, dim)`` holding the token count in the call's arguments.
    ``compile_exact(gm, fake_args)`` compiles a copy of the graph for static fake arguments.
    Calls with another count, or with the token-count argument on a device type outside
    ``devices``, run ``dynamic``.
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        dynamic: Callable,
        axis: tuple[int, int],
        counts: Iterable[int],
        compile_exact: Callable[[fx.GraphModule, list[Any]], Callable],
        name: str = "graph",
        devices: Iterable[str] = ("cuda",),
    ) -> None:
        self.graph_module = gm
        self.dynamic = dynamic
        self.arg, self.dim = axis
        self.counts = frozenset(int(c) for c in counts)
        self.compile_exact = compile_exact
        self.name = name
        self.devices = frozenset(devices)
        self.exact: dict[tuple, Callable] = {}

    def __call__(self, *args: Any) -> Any:
        x = args[self.arg]
        if x.shape[self.dim] not in self.counts or x.device.type not in self.devices:
            return self.dynamic(*args)
        key = _shape_key(args)
        fn = self.exact.get(key)
        if fn is None:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                # a compile (and its tuning runs) cannot happen inside a capture
                logger.warning(
                    "%s: first call for %d tokens is inside a CUDA graph capture; the graph records the "
                    "compile for any count (run the size once before capturing it)", self.name, x.shape[self.dim],
                )
                return self.dynamic(*args)
            gm = copy_graph_module(self.graph_module)
            fn = self.compile_exact(gm, static_fakes(gm, args))
            self.exact[key] = fn
            logger.debug("%s: compiled for exactly %d tokens", self.name, x.shape[self.dim])
        return fn(*args)
