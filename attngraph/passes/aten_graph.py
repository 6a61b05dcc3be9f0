"""Re-trace a Dynamo graph to ATen ops, keeping each node's module path and symbolic shapes.

A Dynamo graph spells one operation many ways (``x.sum(1)``, ``torch.sum(x, dim=1)``,
``x.sum(dim=(1,))``, an ``einsum`` string, ``F.conv1d`` ...). Re-tracing it with `make_fx`
under Dynamo's own fake mode yields the ATen ops they all dispatch to: a closed set with
schemas (every dim argument has a name and a position), tags (``torch.Tag.pointwise``) and
fake values whose sizes are the same sympy symbols as the Dynamo graph's. Each ATen node keeps
the ``nn_module_stack`` of the Dynamo node it came from (`preserve_node_meta`), so findings
name the module.

Nothing runs on real data: the inputs are the placeholders' fake values.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
from torch import fx

from . import fx_utils as fu


class AtenTraceError(RuntimeError):
    """Re-tracing failed at ``node`` (a node of the Dynamo graph) with ``error``."""

    def __init__(self, node: fx.Node | None, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        self.node = node
        self.error = error


class _Recording(fx.Interpreter):
    """An interpreter that remembers the node it is running (to name a failure's place)."""

    current: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        return super().run_node(n)

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        spelled = _SIZE_SAFE.get(target)
        return spelled(*args, **kwargs) if spelled is not None else super().call_function(target, args, kwargs)

    def call_method(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if target == "matmul":
            return _matmul(*args, **kwargs)
        return super().call_method(target, args, kwargs)


def to_aten(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[fx.Node]]:
    """``gm`` (Dynamo graph, placeholders with fake values) -> (ATen graph, gm's placeholders).

    The ATen graph's placeholders are in the same order as ``gm``'s. Raises `AtenTraceError`
    naming the Dynamo node where tracing failed (the caller decides what a failure means).
    """
    from torch._guards import tracing
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    args = [fu.example_value(n) for n in placeholders]
    # The placeholders' own mode: the compile's tracing context may hold another one.
    fake_mode = next((a.fake_mode for a in args if isinstance(a, FakeTensor)), None)

    interpreter = _Recording(gm)

    def run(*inputs: Any) -> Any:
        with fx_traceback.preserve_node_meta():
            return interpreter.run(*inputs)

    if fake_mode is None:
        raise RuntimeError("the graph's placeholders carry no fake values to trace with")
    # A meta kernel that fails logs a traceback at error level before raising; the failure
    # is reported as an AtenTraceError instead.
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        with tracing(None), fake_mode:
            aten = make_fx(run, decomposition_table=_DECOMPOSITIONS, tracing_mode="real", record_module_stack=True)(*args)
    except Exception as exc:  # noqa: BLE001 - reported with the place it happened
        raise AtenTraceError(interpreter.current, exc) from exc
    finally:
        fake_log.setLevel(level)
    return aten, placeholders


def _pad_with_symbolic_widths(x: torch.Tensor, pad: list, value: float = 0.0) -> Any:
    """``constant_pad_nd`` has no kernel for symbolic widths (a chunked scan pads the sequence
    to a multiple of its chunk); spell those as a fill and a copy into a slice, keep the rest."""
    if all(isinstance(p, int) for p in pad):
        return NotImplemented
    from torch._refs import constant_pad_nd

    return constant_pad_nd(x, pad, value)


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` spelled with views, ``mm`` and ``bmm``.

    Some torch releases (2.11) run matmul's and linear's C++ composite kernels on concrete
    ``sizes()``: under a fake mode with symbolic sizes that reads every size as an int and
    guards it, which specializes the token count in Dynamo's shape environment (the compile
    then fails with a constraint violation). These spellings keep every size symbolic; they
    are the views and products the composite kernels dispatch to anyway.
    """
    if a.dim() == 1 and b.dim() == 1:
        return (a * b).sum()
    if a.dim() == 1:
        return _matmul(a.unsqueeze(0), b).squeeze(-2)
    if b.dim() == 1:
        return _matmul(a, b.unsqueeze(-1)).squeeze(-1)
    if b.dim() == 2:  # [..., n, k] @ [k, m]: one mm over the flattened rows
        lead = a.shape[:-1]
        return torch.mm(a.reshape(-1, a.shape[-1]), b).reshape(*lead, b.shape[-1])
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    return torch.bmm(a3, b3).reshape(*batch, a.shape[-2], b.shape[-1])


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = _matmul(x, weight.t())
    return out if bias is None else out + bias


def _polar(abs: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """``torch.polar`` spelled as a stack of the real and imaginary parts viewed as complex.

    The fake kernel of ``polar`` (through ``torch.complex``'s meta) reads every size as an
    int, which specializes the token count as `_matmul`'s composites do (Llama 4's rotary
    embedding builds its frequencies with ``polar``)."""
    parts = torch.stack([abs * torch.cos(angle), abs * torch.sin(angle)], dim=-1)
    return torch.view_as_complex(parts)


#: Dynamo-graph targets re-spelled before dispatch (see `_matmul`).
_SIZE_SAFE = {
    torch.polar: _polar,
    operator.matmul: _matmul,
    torch.matmul: _matmul,
    torch.Tensor.matmul: _matmul,
    torch._C._nn.linear: _linear,
}

_DECOMPOSITIONS = {torch.ops.aten.constant_pad_nd.default: _pad_with_symbolic_widths}
