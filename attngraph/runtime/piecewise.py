"""Piecewise CUDA graphs: the lowered graph split at attention, its static pieces captured per
token count, attention run eagerly between them.

`build_piecewise` is the compile hook the paged runtime gives the compiler: it splits the
lowered graph (`compiler.split.split_at_attention`), compiles each static piece once for a
dynamic token count (inductor, or the FX code as is for ``cuda_graph="breakable"``), and puts
a `StaticPiece` in its place. What a piece does on a call depends on the `PiecewiseState` the
runner shares with all pieces of the model:

* no bucket (a step above the largest bucket, CPU, or a FULL decode capture that records the
  whole forward itself): the compiled piece runs as is;
* a bucket of ``N`` tokens while capturing: the piece is recorded into a CUDA graph of its own
  (one private pool for every graph of the model, largest bucket first) and its outputs are
  kept as non-owning views (`graph_memory.non_owning`);
* a bucket that was captured: the graph replays.

A static piece reads (a) outputs of earlier graphs of the same bucket, at the addresses they
had at capture (the pool keeps them: they were alive while the later pieces were captured),
(b) the runner's static input buffers and the weights, which do not move, and (c) outputs of
the eager attention pieces, which are fresh tensors every step: those are copied into one
staging buffer per trailing shape (``[max_tokens, *rest]``, sliced to the bucket) that the
graph was captured reading.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import fx

from ..compiler.backend import compile_graph
from ..compiler.ragged_check import ROW_INDEX_INPUTS
from ..compiler.split import ATTENTION, ROWS, STATIC, split_at_attention
from ..errors import CaptureError
from .graph_memory import non_owning_tree

logger = logging.getLogger(__name__)


@dataclass
class PiecewiseState:
    """Shared by the runner and every piece of one model (see the module docstring)."""

    debug: bool = False
    bucket: int | None = None
    capturing: bool = False
    mempool: Any = None
    stream: "torch.cuda.Stream | None" = None
    max_tokens: int = 0
    num_graphs: int = 0
    replays: int = 0  # piece replays so far (tests and benchmarks read it)
    staging: dict[tuple, torch.Tensor] = field(default_factory=dict)
    pieces: list["StaticPiece"] = field(default_factory=list)

    @contextlib.contextmanager
    def step(self, bucket: int | None, capturing: bool = False) -> Iterator[None]:
        """Run the pieces for a padded token count ``bucket`` (None: without graphs)."""
        previous = (self.bucket, self.capturing)
        self.bucket, self.capturing = bucket, capturing
        try:
            yield
        finally:
            self.bucket, self.capturing = previous

    def staging_view(self, like: torch.Tensor) -> torch.Tensor:
        """Rows ``[:like.shape[0]]`` of the staging buffer for ``like``'s trailing shape."""
        key = (tuple(like.shape[1:]), like.dtype, like.device)
        buf = self.staging.get(key)
        if buf is None:
            buf = torch.empty((self.max_tokens, *like.shape[1:]), dtype=like.dtype, device=like.device)
            self.staging[key] = buf
        return buf[: like.shape[0]]

    def release(self) -> None:
        for piece in self.pieces:
            piece.entries.clear()
        self.pieces.clear()
        self.staging.clear()
        self.num_graphs = 0


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    outputs: Any
    staged: list[tuple[int, torch.Tensor]]
    addresses: tuple[int, ...] = ()


class StaticPiece:
    """A compiled token-wise piece, captured and replayed per bucket (module docstring)."""

    def __init__(self, name: str, compiled: Callable, state: PiecewiseState, staged_args: tuple[int, ...]) -> None:
        self.name = name
        self.compiled = compiled
        self.state = state
        self.staged_args = staged_args  # argument positions that hold eager attention outputs
        self.entries: dict[int, _Entry] = {}

    def __call__(self, *args: Any) -> Any:
        state = self.state
        bucket = state.bucket
        if bucket is None:
            return self.compiled(*args)
        entry = self.entries.get(bucket)
        if entry is not None:
            for i, view in entry.staged:
                view.copy_(args[i])
            if state.debug and self._addresses(args, entry) != entry.addresses:
                raise CaptureError(f"an input of graph piece {self.name} (bucket {bucket}) moved since capture")
            entry.graph.replay()
            state.replays += 1
            return entry.outputs
        if not state.capturing:
            return self.compiled(*args)
        return self._capture(bucket, list(args))

    def _capture(self, bucket: int, args: list[Any]) -> Any:
        state = self.state
        staged = []
        for i in self.staged_args:
            view = state.staging_view(args[i])
            view.copy_(args[i])
            args[i] = view
            staged.append((i, view))
        graph = torch.cuda.CUDAGraph()
        stream = state.stream
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=state.mempool)
                try:
                    out = self.compiled(*args)
                finally:
                    graph.capture_end()
        except Exception as exc:
            raise CaptureError(f"capturing graph piece {self.name} for {bucket} tokens failed: {exc}") from exc
        torch.cuda.current_stream().wait_stream(stream)
        entry = _Entry(graph, non_owning_tree(out), staged)
        if state.debug:
            entry.addresses = self._addresses(args, entry)
        self.entries[bucket] = entry
        state.num_graphs += 1
        return out

    def _addresses(self, args: Any, entry: _Entry) -> tuple[int, ...]:
        staged = {i for i, _ in entry.staged}
        return tuple(a.data_ptr() for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in staged)


def build_piecewise(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    input_names: dict[str, str],
    piece_compiler: str,
    state: PiecewiseState,
) -> Callable:
    """Split ``gm`` at attention and compile its pieces (the compiler's hook; see module docstring).

    Returns the split module: same inputs and outputs as ``gm``.
    """
    split = split_at_attention(gm, ROW_INDEX_INPUTS, input_names)
    kinds = {p.name: p.kind for p in split.pieces}
    module = split.module
    staged = _staged_args(module, kinds)
    compiled: dict[str, Callable] = {}

    class _CompilePieces(fx.Interpreter):
        """Runs the split module on fake inputs; each piece is compiled with the fake
        arguments it receives (their symbolic token count included)."""

        def call_module(self, target: str, args: Any, kwargs: Any) -> Any:
            out = super().call_module(target, args, kwargs)
            if kinds[target] in (STATIC, ROWS):
                compiled[target] = compile_graph(getattr(module, target), list(args), piece_compiler)
            return out

    fake_mode = torch._guards.detect_fake_mode(example_inputs) or torch._guards.detect_fake_mode()
    if fake_mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    from torch._dispatch.python import enable_python_dispatcher
    from torch._subclasses.fake_tensor import FakeTensor

    fake_args = [
        fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) else x
        for x in example_inputs
    ]
    with fake_mode, enable_python_dispatcher():
        _CompilePieces(module).run(*fake_args)

    for name, fn in compiled.items():
        if kinds[name] == STATIC:
            piece = StaticPiece(name, fn, state, staged.get(name, ()))
            state.pieces.append(piece)
        else:
            piece = fn
        delattr(module, name)
        setattr(module, name, piece)
    logger.info(
        "piecewise: %d static pieces, %d attention pieces, %d row pieces",
        len(split.of_kind(STATIC)), len(split.of_kind(ATTENTION)), len(split.of_kind(ROWS)),
    )
    return module


def _staged_args(module: fx.GraphModule, kinds: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """For each static piece: positions of its arguments that an attention piece produced."""
    staged = {}
    for node in module.graph.nodes:
        if node.op != "call_module" or kinds.get(node.target) != STATIC:
            continue
        positions = tuple(
            i for i, a in enumerate(node.args)
            if isinstance(a, fx.Node) and a.op == "call_module" and kinds.get(a.target) == ATTENTION
        )
        if positions:
            staged[node.target] = positions
    return staged
