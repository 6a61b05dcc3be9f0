"""Pass `fuse_linears`: linears that read the same input become one GEMM on concatenated weights.

A decoder layer projects one hidden state three times for attention (q, k, v) and twice for
the MLP (gate, up): five GEMMs that each read the activation and launch a kernel, where two
would do. This pass rewrites every group of ``linear(x, w_i, b_i)`` calls on the same node
``x`` into ``linear(x, W, B)`` with ``W = cat(w_i)`` (``B = cat(b_i)``), and gives each former
user its columns back as ``narrow(-1, offset_i, out_i).contiguous()`` (the copy fuses into the
consumer, the RoPE or the SiLU, under inductor).

Weights. The graph is a Dynamo graph whose parameters are placeholders; the pass is given the
real tensors behind them (the backend's example inputs). ``W`` is built once, and once the
graph is compiled (`FuseResult.share_storage`) each fused parameter's storage is replaced by
its rows of ``W`` (``param.data = W[a:b]``), so no second copy of the weights stays in memory
and the model, run eagerly, still computes the same thing. ``W`` and ``B`` enter the graph as new placeholders appended after the existing ones;
the caller appends `FuseResult.extra_inputs` to every call.

Refused (left as they were, with the reason in `FuseResult.refused`): a group whose weights are
not parameters of the graph's inputs, a weight or bias read by anything else (a tied weight),
weights of different dtypes, devices or input widths, biases on some members only, or any
member with keyword arguments. The pass only sees a group of two or more linears.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from . import fx_utils as fu

logger = logging.getLogger(__name__)

LINEAR_TARGETS = (torch._C._nn.linear, torch.nn.functional.linear)


@dataclass
class FuseResult:
    """``groups``: names of the fused linear nodes per group; ``refused``: (names, reason);
    ``extra_inputs``: the real fused weights and biases, in the order of the new placeholders."""

    groups: list[tuple[str, ...]] = field(default_factory=list)
    refused: list[tuple[tuple[str, ...], str]] = field(default_factory=list)
    extra_inputs: list[torch.Tensor] = field(default_factory=list)
    #: Static fake tensors of ``extra_inputs`` in the graph's fake mode (the new placeholders'
    #: ``example_value``), for compilers given example inputs: a real tensor unknown to Dynamo
    #: would be faked with symbolic sizes that no guard source backs. Empty without a fake mode.
    extra_fakes: list[torch.Tensor] = field(default_factory=list)
    # (parameters, their concatenation) waiting for `share_storage`
    pending: list[tuple[list[torch.nn.Parameter], torch.Tensor]] = field(default_factory=list)
    shared: list[torch.nn.Parameter] = field(default_factory=list)  # views since `share_storage`

    def share_storage(self) -> None:
        """Make each fused parameter a view of its rows of the concatenated tensor, dropping
        its own storage (no second copy of the weights). Call it once the graph is compiled:
        the compiler fakes the parameters as they were traced."""
        with torch.no_grad():
            for params, fused in self.pending:
                _view_rows(params, fused)
                self.shared.extend(params)
            # The originals' memory, freed just now, often shares the caching allocator's
            # segments with live weights (q/k/v below its 10 MB large-allocation threshold),
            # so it could never be given back; each concatenation moves into that memory
            # (best fit) and its first copy, in a segment of its own, becomes releasable.
            for params, fused in self.pending:
                if not fused.is_cuda:
                    continue
                moved = torch.empty_like(fused)
                moved.copy_(fused)
                _view_rows(params, moved)
                at = next(i for i, t in enumerate(self.extra_inputs) if t is fused)
                self.extra_inputs[at] = moved  # the compiled callable reads this list per call
        self.pending.clear()

    def unshare_storage(self) -> None:
        """Give every fused parameter its own storage again (a copy of its rows) and drop the
        concatenations: the model as it was before the pass (`save_pretrained` refuses
        parameters that share memory). The fused graph must not run afterwards."""
        with torch.no_grad():
            for p in self.shared:
                p.data = p.data.clone()
        self.shared.clear()
        self.extra_inputs.clear()


def _view_rows(params: list[torch.nn.Parameter], fused: torch.Tensor) -> None:
    """Each parameter becomes the view of its rows of ``fused`` (in order)."""
    offset = 0
    for p in params:
        p.data = fused[offset : offset + p.shape[0]]
        offset += p.shape[0]


def _linear_parts(node: fx.Node) -> tuple[fx.Node, fx.Node, Any] | None:
    if node.op != "call_function" or node.target not in LINEAR_TARGETS or node.kwargs:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    x, w, b = args[:3]
    if not isinstance(x, fx.Node) or not isinstance(w, fx.Node):
        return None
    return x, w, b


def fuse_linears(gm: fx.GraphModule, example_inputs: list[Any]) -> FuseResult:
    """Fuse the linears of ``gm`` that share an input (module docstring). ``example_inputs``:
    the real tensors of ``gm``'s placeholders, in order. Mutates ``gm`` and the fused parameters."""
    result = FuseResult()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return result
    real = dict(zip(placeholders, example_inputs))
    by_input: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        parts = _linear_parts(node)
        if parts is not None:
            by_input.setdefault(parts[0], []).append(node)
    last_placeholder = placeholders[-1] if placeholders else None
    fake_mode = _fake_mode(placeholders)
    graph_mode = fu.graph_fake_mode(gm.graph)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}  # of the linears, which stay put until fused
    for x, members in by_input.items():
        if len(members) < 2:
            continue
        safe = []
        for m in members:
            reason = _member_refusal(m, real)
            if reason:
                result.refused.append(((m.name,), reason))
            else:
                safe.append(m)
        members = safe
        if len(members) < 2:
            continue
        names = tuple(m.name for m in members)
        reason = _group_refusal(members, real)
        if reason:
            result.refused.append((names, reason))
            continue
        weights = [real[_linear_parts(m)[1]] for m in members]
        biases = [real[_linear_parts(m)[2]] for m in members] if _linear_parts(members[0])[2] is not None else None
        fused_w = torch.cat([w.detach() for w in weights], 0)
        fused_b = torch.cat([b.detach() for b in biases], 0) if biases else None
        result.pending.append((weights, fused_w))
        if fused_b is not None:
            result.pending.append((biases, fused_b))
        new_inputs = [fused_w] + ([fused_b] if fused_b is not None else [])
        nodes = []
        for k, t in enumerate(new_inputs):
            with gm.graph.inserting_after(last_placeholder):
                ph = gm.graph.placeholder(f"fused_linear_{len(result.groups)}_{'weight' if k == 0 else 'bias'}")
            if fake_mode is not None:  # the compile's input; the node's value in the graph's own mode
                result.extra_fakes.append(fake_mode.from_tensor(t, static_shapes=True))
                own = graph_mode if graph_mode is not None else fake_mode
                ph.meta["example_value"] = own.from_tensor(t, static_shapes=True)
            last_placeholder = ph
            nodes.append(ph)
        first = min(members, key=order.__getitem__)
        with gm.graph.inserting_before(first):
            fused = gm.graph.call_function(members[0].target, (x, nodes[0], nodes[1] if len(nodes) > 1 else None))
        offset = 0
        for m, w in zip(members, weights):
            with gm.graph.inserting_after(fused):
                piece = gm.graph.call_method("narrow", (fused, -1, offset, w.shape[0]))
            with gm.graph.inserting_after(piece):
                cont = gm.graph.call_method("contiguous", (piece,))
            cont.meta.update(m.meta)  # the same value as the linear's: shape, dtype, contiguous strides
            m.replace_all_uses_with(cont)
            gm.graph.erase_node(m)
            offset += w.shape[0]
        result.groups.append(names)
        result.extra_inputs.extend(new_inputs)
    if result.groups:
        gm.graph.lint()
        gm.recompile()
        logger.debug("fuse_linears: %d groups of linears fused (%s)", len(result.groups), _summary(result.groups))
    for names, reason in result.refused:  # at DEBUG, as `fx_utils.finish_rewrite` logs
        logger.debug("fuse_linears: %s left unfused: %s", ", ".join(names), reason)
    return result


def _member_refusal(m: fx.Node, real: dict[fx.Node, Any]) -> str | None:
    """Why linear ``m`` cannot join a group, or None."""
    _, w, b = _linear_parts(m)
    for t, what in ((w, "weight"), (b, "bias")):
        if t is None:
            continue
        value = real.get(t) if isinstance(t, fx.Node) else None
        if not isinstance(value, torch.nn.Parameter):
            return f"the {what} of {m.name} is not a parameter input of the graph"
        if len(t.users) != 1:
            return f"the {what} of {m.name} ({t.name}) is also read elsewhere"
    if real[w].dim() != 2:
        return f"the weight of {m.name} is not a matrix"
    return None


def _group_refusal(members: list[fx.Node], real: dict[fx.Node, Any]) -> str | None:
    """Why these (individually safe) linears cannot become one GEMM, or None."""
    parts = [_linear_parts(m) for m in members]
    if len({p[2] is not None for p in parts}) > 1:
        return "biases on some members only"
    shapes = {(real[w].shape[1], real[w].dtype, real[w].device) for _, w, _ in parts}
    if len(shapes) > 1:
        return f"weights of different input widths, dtypes or devices: {sorted(map(str, shapes))}"
    return None


def _fake_mode(placeholders: list[fx.Node]):
    """The compile's fake mode (the tracing context's, under Dynamo), else the placeholders'."""
    from torch._subclasses.fake_tensor import FakeTensor

    active = torch._guards.detect_fake_mode()
    if active is not None:
        return active
    for ph in placeholders:
        value = ph.meta.get("example_value")
        if isinstance(value, FakeTensor):
            return value.fake_mode
    return None


def _summary(groups: list[tuple[str, ...]]) -> str:
    sizes: dict[int, int] = {}
    for g in groups:
        sizes[len(g)] = sizes.get(len(g), 0) + 1
    return ", ".join(f"{count} of {size}" for size, count in sorted(sizes.items()))
