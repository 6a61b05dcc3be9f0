"""Small helpers for reading Dynamo-level FX graphs (torch functions, Tensor methods, operators)."""

from __future__ import annotations

import contextlib
import contextvars
import operator
import re
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

# Each set lists the spellings one operation takes in a Dynamo graph: call_function targets and
# call_method names (strings).
MATMUL = {torch.matmul, operator.matmul, "matmul"}
BMM = {torch.bmm, "bmm"}  # 3-D only: never the [B, H, S, D] form
SOFTMAX = {torch.softmax, F.softmax, "softmax", torch._C._nn.softmax if hasattr(torch._C._nn, "softmax") else F.softmax}
SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
# In-place spellings (``s /= c``, ``s.mul_(c)``) compute the same value; the ops in INPLACE
# mutate their first argument, which `cleanup` checks before removing one.
MUL_INPLACE = {operator.imul, "mul_"}
DIV_INPLACE = {operator.itruediv, "div_"}
ADD_INPLACE = {operator.iadd, "add_"}
MUL = {operator.mul, torch.mul, "mul"} | MUL_INPLACE
DIV = {operator.truediv, torch.div, torch.true_divide, "div", "true_divide"} | DIV_INPLACE
ADD = {operator.add, torch.add, "add"} | ADD_INPLACE
INPLACE = MUL_INPLACE | DIV_INPLACE | ADD_INPLACE
TANH = {torch.tanh, F.tanh, "tanh"}
DROPOUT = {F.dropout, torch.dropout, "dropout"}
CAST = {"to", "float", "type_as", "half", "bfloat16", "type", "double"}
TRANSPOSE = {torch.transpose, "transpose"}
RESHAPE = {torch.reshape, "reshape", "view"}
FLATTEN = {torch.flatten, "flatten"}
EXPAND = {"expand"}
REPEAT_INTERLEAVE = {torch.repeat_interleave, "repeat_interleave"}
GETITEM = {operator.getitem}
CONTIGUOUS = {"contiguous"}
SHAPE_QUERIES = {"size", "dim", torch.ops.aten.sym_size.int, torch.ops.aten.sym_size, "numel"}
SHAPE_ATTRS = {"shape", "device", "dtype", "ndim", "is_cuda"}


def is_op(node: Any, ops: Iterable[Any]) -> bool:
    """Does ``node`` call one of ``ops`` (function targets or method names)?"""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return node.target in ops
    if node.op == "call_method":
        return node.target in ops
    return False


def is_inplace(node: Any) -> bool:
    """Does ``node`` mutate its first argument (``x += y``, ``x.mul_(y)``, ``torch.relu_(x)``)?"""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return False
    if node.target in INPLACE:
        return True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if getattr(node.target, "__module__", "") in ("_operator", "operator"):
        return name in _OPERATOR_INPLACE
    return name.endswith("_") and not name.endswith("__")


_OPERATOR_INPLACE = {
    "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul",
    "iand", "ior", "ixor", "ilshift", "irshift", "iconcat",
}


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Positional-or-keyword argument ``name`` (at ``index``) of a call node."""
    if name in node.kwargs:
        return node.kwargs[name]
    if index < len(node.args):
        return node.args[index]
    return default


def example_value(node: Any) -> Any:
    """The traced example (usually a FakeTensor or SymInt) of ``node``, or None."""
    if not isinstance(node, fx.Node):
        return node
    for key in ("example_value", "val"):
        if key in node.meta:
            return node.meta[key]
    tm = node.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "shape"):  # (a tuple result holds one per element)
        return torch.empty(tm.shape, dtype=tm.dtype, device="meta")
    return None


def last_dim_narrow(node: Any) -> tuple[fx.Node, int, int] | None:
    """``(source, start, length)`` for ``node = source.narrow(dim, start, length)`` along the
    source's last dimension (``-1`` or its index; integer arguments), else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_method" and node.target == "narrow" and not node.kwargs):
        return None
    if len(node.args) != 4 or not isinstance(node.args[0], fx.Node):
        return None
    src, dim, start, length = node.args
    val = example_value(src)
    last = val.dim() - 1 if isinstance(val, torch.Tensor) else None
    if not (isinstance(start, int) and isinstance(length, int) and isinstance(dim, int)) or dim not in (-1, last):
        return None
    return src, start, length


def matrix_shape(node: Any) -> tuple[int, int] | None:
    """``(rows, columns)`` of a node whose example is a matrix of static sizes (a weight),
    else None."""
    val = example_value(node)
    if not isinstance(val, torch.Tensor) or val.dim() != 2 or not all(isinstance(s, int) for s in val.shape):
        return None
    return int(val.shape[0]), int(val.shape[1])


def graph_fake_mode(graph: fx.Graph):
    """The fake mode of the graph's own example values (Dynamo's tracing mode), or None.

    Not the active one: Dynamo hands its backend a tracing context with a fresh fake mode, while
    the nodes keep the values of the mode they were traced in."""
    from torch._subclasses.fake_tensor import FakeTensor

    for n in graph.nodes:
        if n.op != "placeholder":
            break
        value = n.meta.get("example_value")
        if isinstance(value, FakeTensor):
            return value.fake_mode
    return None


def fill_example_values(gm: fx.GraphModule) -> int:
    """Give every call node without one an ``example_value``, computed on its inputs' fake values
    in the graph's fake mode; returns how many were set.

    Dynamo's nodes all carry one; the nodes the passes add do not, and AOTAutograd's cache
    refuses a graph with a method call on a node without one (a compile in a later process then
    re-traces every graph instead of loading it). A node whose value cannot be computed so (an
    input without a fake value, an op that fails on fakes) is left as it is.
    """
    mode = graph_fake_mode(gm.graph)
    if mode is None:
        return 0
    from torch._dispatch.python import enable_python_dispatcher
    from torch.utils._pytree import tree_flatten

    missing = object()
    filled = 0
    with mode, enable_python_dispatcher():  # symbolic sizes need the Python dispatcher's decompositions
        for node in gm.graph.nodes:
            if node.op not in ("call_function", "call_method") or "example_value" in node.meta:
                continue
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("example_value", n.meta.get("val", missing)))
            if any(a is missing for a in tree_flatten((args, kwargs))[0]):
                continue
            try:
                if node.op == "call_method":
                    value = getattr(args[0], node.target)(*args[1:], **kwargs)
                else:
                    value = node.target(*args, **kwargs)
            except Exception:  # noqa: BLE001 - a value the fakes cannot give stays unset
                continue
            node.meta["example_value"] = value
            filled += 1
    return filled


# --------------------------------------------------------------------------- aliasing and writes
# A Dynamo graph is not functional: ``s.div_(c)``, ``mask[..., j] = 0`` or ``k.mul_(2)`` change a
# tensor that other nodes read, and a view (``m.T``, ``torch.diagonal(m)``, ``m.data``) lets a
# write through one node change another. The passes must see every such write to the tensors a
# site reads before they replace the site or evaluate a mask on its own.
#
# Aliasing is decided by storage: Dynamo records a fake tensor for each node
# (``meta["example_value"]``), and fake tensors of a view and of its base share one storage, as
# the real tensors will (for any op, however it is spelled); `find_attention` propagates fake
# tensors itself through a graph that has none. Only where a node still has no such value is
# the op's own declaration consulted (`may_alias_inputs`): the alias annotations of its aten
# schemas (``numpy_T(Tensor(a) self) -> Tensor(a)``), and for an op with no schema to read,
# "may alias every tensor input": a view op this code has never heard of cannot hide a write.

#: Method spellings that never alias and have no aten schema under their own name.
_FRESH = {"new_zeros", "new_ones", "new_full", "new_empty", "new_tensor", "size", "dim", "numel", "item", "tolist"}
#: ``getattr(x, name)`` that returns a view of ``x``; ``x.data`` may also appear as
#: ``torch._C._autograd._get_data_attr(x)``.
_ALIAS_ATTRS = {"T", "mT", "H", "mH", "data", "real", "imag"}
_ALIAS_FUNCTION_NAMES = {"_get_data_attr"}


def storage_key(node: Any) -> StorageWeakRef | None:
    """The storage identity of ``node``'s traced example value, or None when it has none.

    Only values recorded by tracing count (``meta["example_value"]`` / ``meta["val"]``): the
    tensor `example_value` builds from ``tensor_meta`` is new on every call and aliases nothing.
    """
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("example_value", node.meta.get("val"))
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return StorageWeakRef(val.untyped_storage())
    except Exception:  # tensors without a storage (sparse, nested, ...)
        return None


def _alias_bases(node: fx.Node) -> list[fx.Node]:
    """The input nodes ``node``'s result may share storage with, judged by the op alone."""
    if node.op not in ("call_function", "call_method") or node.target is operator.setitem:
        return []  # (``x[i] = v`` returns nothing; its write is `written_by`'s business)
    if not _may_be_tensor(node):
        return []  # a size, a number: no storage
    inputs = [a for a in node.all_input_nodes if _may_be_tensor(a)]
    if not inputs:
        return []
    base = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if node.target is operator.getitem and base is not None:
        base_val = base.meta.get("example_value", base.meta.get("val"))
        if isinstance(base_val, (tuple, list)):
            # An element of a tuple: a view only when the tuple holds views (split, chunk, unbind),
            # not for the fresh results of e.g. ``torch.max(x, dim)``.
            return [base] if _alias_bases(base) else []
        return [base]  # basic indexing is a view; advanced indexing copies (may alias: erring)
    if is_inplace(node) and base is not None:  # an in-place op returns its first argument
        return [base]
    if node.target is getattr:
        return [base] if len(node.args) > 1 and node.args[1] in _ALIAS_ATTRS else []
    if getattr(node.target, "__name__", "") in _ALIAS_FUNCTION_NAMES:
        return [base] if base is not None else inputs
    aliased = may_alias_inputs(node)
    return inputs if aliased is None else [a for a in aliased if a in inputs]


def _may_be_tensor(n: fx.Node) -> bool:
    """Could ``n`` hold a tensor (or tensors)? Unknown counts as yes."""
    val = n.meta.get("example_value", n.meta.get("val"))
    return val is None or isinstance(val, (torch.Tensor, tuple, list))


#: ``operator`` functions (``a + b``) and the aten ops they call on tensors.
_OPERATOR_ATEN = {
    "add": "add", "sub": "sub", "mul": "mul", "truediv": "div", "floordiv": "floor_divide", "mod": "remainder",
    "pow": "pow", "matmul": "matmul", "neg": "neg", "pos": "positive", "abs": "abs", "invert": "bitwise_not",
    "and_": "bitwise_and", "or_": "bitwise_or", "xor": "bitwise_xor", "lshift": "bitwise_left_shift",
    "rshift": "bitwise_right_shift", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne",
}
#: Modules whose functions are bindings of aten ops of the same name.
_ATEN_MODULES = ("torch", "torch.functional", "torch.nn.functional", "torch._C._nn", "torch._C._VariableFunctions")


def _schemas(node: fx.Node) -> list | None:
    """The aten schemas ``node`` may dispatch to, or None when they cannot be found."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return [target._schema]
    if isinstance(target, torch._ops.OpOverloadPacket):
        packet = target
    else:
        if isinstance(target, str):  # a Tensor method: ``self`` is args[0], as in the schema
            name = target
        elif getattr(target, "__module__", None) in ("_operator", "operator"):
            name = _OPERATOR_ATEN.get(target.__name__)
        elif getattr(target, "__module__", None) in _ATEN_MODULES or type(target) is type(torch.add):
            name = getattr(target, "__name__", None)
        else:
            return None  # a Python function: its schema, if any, is not ours to guess
        packet = getattr(torch.ops.aten, name, None) if name else None
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            return None
    schemas = [getattr(packet, o)._schema for o in packet.overloads()]
    return schemas or None


def may_alias_inputs(node: fx.Node) -> list[fx.Node] | None:
    """The inputs a call's result may alias by its aten schemas' alias annotations (``[]``: a
    fresh tensor), over every overload it may dispatch to; None when it has no schema to read
    (then any input may be aliased)."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if node.op == "call_method" and name in _FRESH:
        return []
    schemas = _schemas(node)
    if schemas is None:
        return None
    out: list[fx.Node] = []
    for schema in schemas:
        sets: set = set()
        for r in schema.returns:
            if r.alias_info is not None:
                sets |= set(r.alias_info.before_set) | set(r.alias_info.after_set)
        if not sets:
            continue
        for i, a in enumerate(schema.arguments):
            if a.alias_info is None or not (set(a.alias_info.before_set) | set(a.alias_info.after_set)) & sets:
                continue
            value = node.args[i] if not a.kwarg_only and i < len(node.args) else node.kwargs.get(a.name)
            out += [n for n in _tensor_nodes(value) if n not in out]
    return out


def _tensor_nodes(x: Any) -> list[fx.Node]:
    if isinstance(x, fx.Node):
        return [x]
    if isinstance(x, (list, tuple)):
        return [n for a in x for n in _tensor_nodes(a)]
    return []


def written_by(node: fx.Node) -> list[fx.Node]:
    """The nodes whose tensors ``node`` writes in place (``x.mul_(c)``, ``x[i] = v``,
    ``torch.add(a, b, out=x)``, a mutable aten op); [] when it writes none."""
    if node.op not in ("call_function", "call_method"):
        return []
    written: list[fx.Node] = []
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    dunder_inplace = name.startswith("__i") and name.endswith("__") and name[2:-2] in _OPERATOR_INPLACE
    if is_inplace(node) or node.target is operator.setitem or name == "__setitem__" or dunder_inplace:
        written += _tensor_nodes(node.args[:1])
    if "out" in node.kwargs:
        written += _tensor_nodes(node.kwargs["out"])
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                value = node.args[i] if not a.kwarg_only and i < len(node.args) else node.kwargs.get(a.name)
                written += _tensor_nodes(value)
        if not written:  # a mutable op whose written argument we cannot place: any of them
            written = _tensor_nodes((node.args, tuple(node.kwargs.values())))
    return written


class GraphIndex:
    """Node positions, storages, view edges and in-place writes of one graph, gathered in one
    pass; valid while the graph is unchanged (see `unchanged`)."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.position: dict[fx.Node, int] = {}
        self._key: dict[fx.Node, StorageWeakRef | None] = {}
        self._by_storage: dict[StorageWeakRef, list[fx.Node]] = {}
        self._edges: dict[fx.Node, list[fx.Node]] = {}
        self._writes: list[tuple[fx.Node, list[fx.Node]]] = []  # (writer, written), graph order
        for i, n in enumerate(graph.nodes):
            self.position[n] = i
            self._key[n] = k = storage_key(n)
            if k is not None:
                self._by_storage.setdefault(k, []).append(n)
            written = written_by(n)
            if written:
                self._writes.append((n, written))
        for n in graph.nodes:
            if self._key[n] is not None and all(self._key[a] is not None for a in n.all_input_nodes if _may_be_tensor(a)):
                continue  # decided by storage
            for base in _alias_bases(n):
                if self._key[n] is None or self._key[base] is None:
                    self._edges.setdefault(n, []).append(base)
                    self._edges.setdefault(base, []).append(n)

    def aliases(self, nodes: Iterable[Any]) -> set[fx.Node]:
        """See the module function `aliases`."""
        found: set[fx.Node] = set()
        stack = [n for n in nodes if isinstance(n, fx.Node)]
        while stack:
            n = stack.pop()
            if n in found:
                continue
            found.add(n)
            k = self._key.get(n)
            if k is not None:
                stack.extend(self._by_storage[k])
            stack.extend(self._edges.get(n, ()))
        return found

    def first_write(
        self, targets: set[fx.Node], exclude: Iterable[fx.Node] = (), after: fx.Node | None = None,
        before: fx.Node | None = None,
    ) -> fx.Node | None:
        """See the module function `first_write`."""
        lo = self.position[after] if after is not None else -1
        hi = self.position[before] if before is not None else len(self.position)
        exclude = set(exclude)
        for writer, written in self._writes:
            if lo < self.position[writer] < hi and writer not in exclude and any(t in targets for t in written):
                return writer
        return None

    def between(self, src: fx.Node, dst: fx.Node) -> set[fx.Node]:
        """Nodes on some path from ``src`` to ``dst``, both included (empty when there is none)."""
        lo = self.position[src]
        above: set[fx.Node] = set()  # ancestors of dst not placed before src: paths cannot leave them
        stack = [dst]
        while stack:
            n = stack.pop()
            if n in above or self.position[n] < lo:
                continue
            above.add(n)
            stack.extend(n.all_input_nodes)
        region: set[fx.Node] = set()
        stack = [src]
        while stack:
            n = stack.pop()
            if n in region or n not in above:
                continue
            region.add(n)
            stack.extend(n.users)
        return region


_ACTIVE_INDEX: contextvars.ContextVar[GraphIndex | None] = contextvars.ContextVar("attngraph_graph_index", default=None)


@contextlib.contextmanager
def unchanged(graph: fx.Graph):
    """Within the block ``graph`` is only read: `aliases`, `first_write` and `between` share one
    `GraphIndex` of it instead of each scanning the graph again."""
    token = _ACTIVE_INDEX.set(GraphIndex(graph))
    try:
        yield
    finally:
        _ACTIVE_INDEX.reset(token)


def graph_index(graph: fx.Graph) -> GraphIndex:
    """The shared index of ``graph`` inside `unchanged`, else a fresh one."""
    index = _ACTIVE_INDEX.get()
    return index if index is not None and index.graph is graph else GraphIndex(graph)


def aliases(nodes: Iterable[Any]) -> set[fx.Node]:
    """``nodes`` and every node of their graph whose tensor may share storage with one of them.

    Two nodes with traced example values alias exactly when their storages are the same (this
    finds views however they are spelled, and bases as well as views). An edge between an op
    and an input it may alias (`may_alias_inputs`; every input for an op without a schema) is
    followed, in either direction, only where one of the two has no example value to compare.
    """
    start = [n for n in nodes if isinstance(n, fx.Node)]
    return graph_index(start[0].graph).aliases(start) if start else set()


def first_write(
    targets: set[fx.Node], exclude: Iterable[fx.Node] = (), after: fx.Node | None = None,
    before: fx.Node | None = None,
) -> fx.Node | None:
    """The first node (graph order) not in ``exclude`` that writes one of ``targets`` in place,
    looking only strictly after ``after`` and strictly before ``before`` when given; else None.

    ``targets`` should be closed under aliasing (`aliases`): then a write through any view counts.
    """
    if not targets:
        return None
    return graph_index(next(iter(targets)).graph).first_write(targets, exclude, after, before)


def between(src: fx.Node, dst: fx.Node) -> set[fx.Node]:
    """Nodes on some path from ``src`` to ``dst``, both included (empty when there is none)."""
    return graph_index(src.graph).between(src, dst)


def shape_of(node: Any) -> tuple | None:
    val = example_value(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def same_size(a: Any, b: Any) -> bool:
    """Are two (possibly symbolic) sizes provably the same expression?"""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return a.node.expr == b.node.expr
    return False


def size_hint(value: Any) -> int:
    """A concrete int for a possibly symbolic size."""
    if isinstance(value, torch.SymInt):
        return int(value.node.hint) if value.node.hint is not None else int(value.node.shape_env.size_hint(value.node.expr))
    return int(value)


_INDEX_RE = re.compile(r"(?:\.|\[)(\d+)\]?")


def attention_module_path(node: fx.Node) -> tuple[str, int | None]:
    """``(module_path, layer_index)`` of the innermost module around ``node``.

    The path is the user-facing one (``model.layers.3.self_attn``); the layer index is the
    last integer in it (``3``), or None.
    """
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", None
    paths = [_clean_path(path) for path, _cls in stack.values()]
    # A module object held by a module-level global (``G['...']``: a function transformers
    # wraps as a module, e.g. a short convolution kernel) is not in the model's tree: name the
    # innermost enclosing module of the model instead.
    inside = [p for p in paths if not p.startswith("G[")]
    path = inside[-1] if inside else paths[-1]
    idx = _INDEX_RE.findall(path)
    return path, (int(idx[-1]) if idx else None)


def _clean_path(path: str) -> str:
    # Dynamo writes "L['self'].model.layers[0].self_attn" or "L['args'][0].model.layers.0...".
    path = re.sub(r"^L\['[^']*'\](\[\d+\])?\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = path.replace("._modules['", ".").replace("']", "")
    path = re.sub(r"^(__self__|self)\.", "", path.strip("."))  # a bound method's receiver
    return path.strip(".")


def finish_rewrite(gm: fx.GraphModule, log, summary: str | None, refused: Iterable[tuple[str, str]], refused_format: str) -> None:
    """A rewriting pass's ending: where it changed the graph (``summary``, the line it logs;
    None: unchanged) lint and recompile ``gm``; then log each ``(node name, reason)`` of
    ``refused`` through ``refused_format`` (two ``%s``). At DEBUG: the paged runtime's backend
    logs one INFO line per pass and graph (`AttnGraphBackend`), so a model of many layers does
    not log a line per refused site at INFO."""
    if summary is not None:
        gm.graph.lint()
        gm.recompile()
        log.debug(summary)
    for name, reason in refused:
        log.debug(refused_format, name, reason)
