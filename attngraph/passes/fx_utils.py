"""Small helpers for reading Dynamo-level FX graphs (torch functions, Tensor methods, operators)."""

from __future__ import annotations

import operator
import re
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import fx

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
    if tm is not None:
        return torch.empty(tm.shape, dtype=tm.dtype, device="meta")
    return None


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
    path, _cls = list(stack.values())[-1]
    path = _clean_path(path)
    idx = _INDEX_RE.findall(path)
    return path, (int(idx[-1]) if idx else None)


def _clean_path(path: str) -> str:
    # Dynamo writes "L['self'].model.layers[0].self_attn" or "L['args'][0].model.layers.0...".
    path = re.sub(r"^L\['[^']*'\](\[\d+\])?\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = path.replace("._modules['", ".").replace("']", "")
    path = re.sub(r"^(__self__|self)\.", "", path.strip("."))  # a bound method's receiver
    return path.strip(".")
