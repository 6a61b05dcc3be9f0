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
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import fx

from ..compiler.backend import compile_graph
from ..compiler.ragged_check import ROW_INDEX_INPUTS, TOKEN_INPUTS
from ..compiler.specialize import TokenCountSpecialized, compile_exact, copy_graph_module, free_symbols, token_axis
from ..compiler.split import ATTENTION, ATTENTION_O_OP_NAME, ROWS, STATIC, is_attention_node, split_at_attention
from ..errors import CaptureError
from ..ops import attention_impl, attention_o_impl, paged_attention_into, paged_attention_o_into
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
    modules: list[fx.GraphModule] = field(default_factory=list)  # the split module of each compiled graph

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
        return self.staging_rows(like.shape[0], tuple(like.shape[1:]), like.dtype, like.device)

    def staging_rows(self, rows: int, trailing: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (trailing, dtype, device)
        buf = self.staging.get(key)
        if buf is None:
            buf = torch.zeros((self.max_tokens, *trailing), dtype=dtype, device=device)
            self.staging[key] = buf
        return buf[:rows]

    def release(self) -> None:
        for piece in self.pieces:
            piece.entries.clear()
        self.pieces.clear()
        self.modules.clear()
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

    def __init__(
        self, name: str, compiled: Callable, state: PiecewiseState, staged_args: tuple[int, ...], capturable: bool = True
    ) -> None:
        self.name = name
        self.compiled = compiled
        self.state = state
        self.staged_args = staged_args  # argument positions that hold eager attention outputs
        # False when the piece's sizes depend on anything but the token count (a graph
        # captured per bucket would replay stale sizes): it always runs compiled.
        self.capturable = capturable
        self.entries: dict[int, _Entry] = {}

    def __call__(self, *args: Any) -> Any:
        state = self.state
        bucket = state.bucket
        if bucket is None or not self.capturable:
            return self.compiled(*args)
        entry = self.entries.get(bucket)
        if entry is not None:
            for i, view in entry.staged:
                if args[i].data_ptr() != view.data_ptr():  # an attention piece wrote it in place
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
            if args[i].data_ptr() != view.data_ptr():
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


class AttentionPiece:
    """One attention op between graph pieces, called without the dispatcher.

    With a bucket published it writes the real rows of its output straight into the staging
    buffer the next graph piece was captured reading (`ops.paged_attention_into`), so the
    replay copies nothing; otherwise it is the op itself (`ops.attention_impl`).
    """

    def __init__(self, name: str, sub: fx.GraphModule, state: PiecewiseState) -> None:
        self.name = name
        self.state = state
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        (call,) = [n for n in sub.graph.nodes if is_attention_node(n)]
        outputs = [n for n in sub.graph.nodes if n.op == "output"]
        if call.kwargs or outputs[0].args[0] is not call:
            raise CaptureError(f"attention piece {name} is not a single positional call of the op")
        # Each op argument: ("arg", index into the piece's inputs) or ("const", value).
        self.template = tuple(
            ("arg", placeholders.index(a)) if isinstance(a, fx.Node) else ("const", a) for a in call.args
        )
        # the attention op, or the op that also projects its output (`ops.attention_o_impl`)
        self.projects = getattr(call.target, "name", lambda: "")().split(".")[0] == ATTENTION_O_OP_NAME

    def __call__(self, *inputs: Any) -> torch.Tensor:
        args = [inputs[v] if kind == "arg" else v for kind, v in self.template]
        state = self.state
        if state.bucket is None:
            return attention_o_impl(*args) if self.projects else attention_impl(*args)
        q, v = args[0], args[2]
        if self.projects:  # [T, N]: the projection's output (``o_weight: [N, Hq * Dv]``)
            out = state.staging_rows(q.shape[0], (args[14].shape[0],), q.dtype, q.device)
            return paged_attention_o_into(out, *args)
        out = state.staging_rows(q.shape[0], (q.shape[1], v.shape[2]), q.dtype, q.device)
        return paged_attention_into(out, *args)


def build_piecewise(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    input_names: dict[str, str],
    piece_compiler: str,
    state: PiecewiseState,
    inductor_options: dict[str, Any] | None = None,
    exact_token_counts: tuple[int, ...] = (),
    exact_inductor_options: dict[str, Any] | None = None,
) -> Callable:
    """Split ``gm`` at attention and compile its pieces (the compiler's hook; see module docstring).
    ``inductor_options``: `compile_graph`'s settings for inductor. ``exact_token_counts``: token
    counts whose calls of an inductor-compiled static piece run a compile for exactly that size
    (`compiler.specialize.TokenCountSpecialized`, with ``exact_inductor_options``).

    Returns the split module: same inputs and outputs as ``gm``.
    """
    split = split_at_attention(gm, ROW_INDEX_INPUTS, input_names)
    kinds = {p.name: p.kind for p in split.pieces}
    module = split.module
    staged = _staged_args(module, kinds)
    compiled: dict[str, Callable] = {}
    capturable: dict[str, bool] = {}
    by_structure: dict[tuple, Callable] = {}
    outputs_like: dict[tuple, Callable[[Any], Any] | None] = {}  # structure key -> maker of its fake outputs

    class _CompilePieces(fx.Interpreter):
        """Runs the split module on fake inputs; each piece is compiled with the fake
        arguments it receives (their symbolic token count included)."""

        def call_module(self, target: str, args: Any, kwargs: Any) -> Any:
            capturable[target] = free_symbols(args) <= token_symbols
            if kinds[target] not in (STATIC, ROWS):
                return super().call_module(target, args, kwargs)
            sub = getattr(module, target)
            key = structure_key(sub, args)
            make = outputs_like.get(key) if key is not None else None
            if make is not None:
                # The same function of inputs of the same sizes (every decoder layer after the
                # first): its outputs are fresh tensors of the sizes the first one gave (or the
                # arguments it passes on), so the fake run need not go through its ops again.
                out = make(args)
            else:
                out = super().call_module(target, args, kwargs)
                if key is not None and key not in outputs_like:
                    outputs_like[key] = _fresh_like(out, args)
            fn = by_structure.get(key) if key is not None else None
            if fn is None:
                axis = token_axis(list(args), token_symbols) if exact_token_counts and capturable[target] else None
                exact = axis is not None and kinds[target] == STATIC and piece_compiler == "inductor"
                traced = copy_graph_module(sub) if exact else None  # before compile_graph rewrites sub
                fn = compile_graph(sub, list(args), piece_compiler, inductor_options)
                if exact:
                    fn = TokenCountSpecialized(
                        traced, fn, axis, exact_token_counts,
                        functools.partial(compile_exact, inductor_options=exact_inductor_options),
                        name=f"piecewise {target}",
                    )
                if key is not None:
                    by_structure[key] = fn
            compiled[target] = fn
            return out

    fake_mode = torch._guards.detect_fake_mode(example_inputs) or torch._guards.detect_fake_mode()
    if fake_mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    from torch._dispatch.python import enable_python_dispatcher
    from torch._subclasses.fake_tensor import FakeTensor

    # Only the token inputs carry the symbolic token count (Dynamo's own fakes of them, from
    # its memo); every other real input (weights, the fused weights appended by the compiler)
    # is static.
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    dynamic = {i for i, n in enumerate(placeholders) if _is_named(n, input_names, TOKEN_INPUTS + ROW_INDEX_INPUTS)}
    fake_args = [
        fake_mode.from_tensor(x, static_shapes=i not in dynamic)
        if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) else x
        for i, x in enumerate(example_inputs)
    ]
    token_symbols = _token_symbols(module, fake_args, input_names)
    with fake_mode, enable_python_dispatcher():
        _CompilePieces(module).run(*fake_args)

    for name, kind in kinds.items():
        if kind == STATIC:
            piece = StaticPiece(name, compiled[name], state, staged.get(name, ()), capturable[name])
            if not piece.capturable:
                logger.warning("piecewise: %s has sizes other than the token count; it runs without graphs", name)
            state.pieces.append(piece)
        elif kind == ATTENTION:
            piece = AttentionPiece(name, getattr(module, name), state)
        else:
            piece = compiled[name]
        delattr(module, name)
        setattr(module, name, piece)
    state.modules.append(module)
    logger.info(
        "piecewise: %d static pieces (%d compiled, the others share their code), %d attention pieces, %d row pieces",
        len(split.of_kind(STATIC)), len(set(map(id, compiled.values()))), len(split.of_kind(ATTENTION)),
        len(split.of_kind(ROWS)),
    )
    return module


def _fresh_like(out: Any, args: Any) -> Callable[[Any], Any] | None:
    """A maker of fake outputs like ``out`` (a piece's outputs on ``args``) for another call of
    the same piece, given that call's arguments. An output on an argument's storage (a value
    the piece passes on, as each layer passes the rotary embedding's cos / sin to the next
    attention, itself or reshaped) is the same view of that call's argument; other tensors are
    new, of the same sizes, strides, storage offsets and dtypes, and outputs that share a
    storage (q, k and v as views of one fused projection's output) share a new one of the
    same size; other values are kept as they are.

    None where that cannot be told from sizes alone: an output on a storage that several
    arguments share or starting before its argument, a dtype other than its storage's, or a
    storage offset not known here."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten(out)
    arg_leaves = tree_flatten(args)[0]
    on_storage: dict[Any, list[int]] = {}  # storage -> the argument leaves on it
    for i, a in enumerate(arg_leaves):
        if isinstance(a, torch.Tensor):
            on_storage.setdefault(StorageWeakRef(a.untyped_storage()), []).append(i)
    storages: dict[Any, int] = {}  # storage of the piece's own outputs -> index into `bases`
    bases: list[tuple[Any, torch.dtype, torch.device]] = []  # (elements, dtype, device) per storage
    meta: list[tuple | None] = []  # per leaf: ("arg", index, size, stride, offset past the argument's,
    # the argument itself), ("new", base, size, stride, offset) or None (not a tensor)
    for x in leaves:
        if not isinstance(x, torch.Tensor):
            meta.append(None)
            continue
        ref = StorageWeakRef(x.untyped_storage())
        offset = x.storage_offset()
        if not isinstance(offset, int):
            return None
        if ref in on_storage:
            owners = {id(arg_leaves[i]) for i in on_storage[ref]}
            arg = arg_leaves[on_storage[ref][0]]
            past = offset - arg.storage_offset()
            if len(owners) != 1 or arg.dtype != x.dtype or not isinstance(past, int) or past < 0:
                return None
            whole = past == 0 and tuple(x.shape) == tuple(arg.shape) and tuple(x.stride()) == tuple(arg.stride())
            meta.append(("arg", on_storage[ref][0], tuple(x.shape), tuple(x.stride()), past, whole))
            continue
        if ref not in storages:
            nbytes = x.untyped_storage().nbytes()
            if isinstance(nbytes, int) and nbytes % x.element_size():
                return None
            storages[ref] = len(bases)
            bases.append((nbytes // x.element_size(), x.dtype, x.device))
        base = storages[ref]
        if bases[base][1] != x.dtype:
            return None
        meta.append(("new", base, tuple(x.shape), tuple(x.stride()), offset))
    n_args = len(arg_leaves)

    def make(call_args: Any) -> Any:
        given = tree_flatten(call_args)[0]
        if len(given) != n_args:
            raise AssertionError(f"piecewise: a shared piece called with {len(given)} argument leaves, not {n_args}")
        fresh = [torch.empty(n, dtype=dtype, device=device) for n, dtype, device in bases]
        new = []
        for x, m in zip(leaves, meta):
            if m is None:
                new.append(x)
            elif m[0] == "arg":
                arg = given[m[1]]
                new.append(arg if m[5] else arg.as_strided(m[2], m[3], arg.storage_offset() + m[4]))
            else:
                new.append(fresh[m[1]].as_strided(m[2], m[3], m[4]))
        return tree_unflatten(new, spec)

    return make


def _is_named(node: fx.Node, input_names: dict[str, str], names: tuple[str, ...]) -> bool:
    """Whether placeholder ``node`` is one of the user's inputs ``names``."""
    wanted = set(names) | {f"l_{name}_" for name in names}
    return input_names.get(node.name, node.name) in wanted or node.name in wanted


def _token_symbols(module: fx.GraphModule, fake_args: list[Any], input_names: dict[str, str]) -> set:
    """Symbols of the token count: those in the sizes of the token inputs (``input_ids``,
    ``position_ids``)."""
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    found: set = set()
    for node, value in zip(placeholders, fake_args):
        if _is_named(node, input_names, TOKEN_INPUTS):
            found |= free_symbols([value])
    return found


def structure_key(sub: fx.GraphModule, args: Any) -> tuple | None:
    """A key equal for two pieces that compute the same function of their inputs: the same
    ops on the same argument structure (node names ignored) and inputs of the same shapes,
    strides and dtypes. Each decoder layer's piece differs from the next only in the weights
    it is given, so one compiled piece serves every layer. None (never shared) for a piece
    that reads module attributes (constants of its own)."""
    index: dict[fx.Node, int] = {}
    ops = []

    def norm(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return ("node", index[a])
        if isinstance(a, (tuple, list)):
            return (type(a).__name__, tuple(norm(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple(sorted((k, norm(v)) for k, v in a.items())))
        if isinstance(a, slice):
            return ("slice", norm(a.start), norm(a.stop), norm(a.step))
        if isinstance(a, (int, float, bool, str, type(None), type(...), torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return (type(a).__name__, repr(a))
        raise TypeError(f"no structure key for {type(a).__name__}")
    try:
        for node in sub.graph.nodes:
            if node.op == "get_attr":
                return None
            target = node.target if node.op in ("call_method", "placeholder", "output") else _qualified(node.target)
            ops.append((node.op, target if node.op != "placeholder" else "", norm(node.args), norm(node.kwargs)))
            index[node] = len(index)
    except TypeError as exc:
        logger.debug("piecewise: a piece is compiled on its own (%s)", exc)
        return None
    inputs = []
    for a in args:
        if isinstance(a, torch.Tensor):
            inputs.append(("t", str(a.shape), str(a.stride()), a.dtype, a.device.type, a.requires_grad))
        else:
            inputs.append(("v", type(a).__name__, str(a)))
    return tuple(ops), tuple(inputs)


def _qualified(target: Any) -> str:
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    return f"{module}.{name}@{id(target)}"  # the object itself: two builtins may share a name


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
