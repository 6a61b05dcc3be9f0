"""Split a lowered graph at its attention ops: the pieces of the piecewise CUDA-graph runtime.

``split_at_attention(gm)`` cuts the graph with `torch.fx.passes.split_module` (original node
order kept) so that every call of the attention op sits alone in its own piece::

    submod_0 (static) -> submod_1 (attention) -> submod_2 (static) -> ... -> submod_2N (static)

N attention ops give 2N + 1 pieces when ops separate them (two attention ops with nothing in
between share no static piece). The static pieces are token-wise: their only dynamic size is
the token count, so they can be captured once per token-count bucket; the attention pieces
read per-request structure from the `ForwardContext` and run eagerly between them.

``row_inputs`` names graph inputs that select rows of the token axis (the ragged forward's
``logits_indices``). The first op after the last attention that depends on one of them starts
a last piece of kind ``"rows"``: its sizes follow the number of selected rows, not the token
count, so the runtime runs it without a graph (for a causal LM it is the LM head on the
selected rows). The op is named only by its target here: the compiler refers to the attention
op by name and never imports the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from .report import user_input_names

#: The op lowered attention calls (registered by `attngraph.ops`), named, not imported.
ATTENTION_OP_NAME = "attngraph::attention"
#: The attention op with the output projection after it (`passes.fuse_attention_o`): also a cut.
ATTENTION_O_OP_NAME = "attngraph::attention_o"

STATIC, ATTENTION, ROWS = "static", "attention", "rows"


@dataclass(frozen=True)
class Piece:
    """One submodule of the split graph. ``kind``: ``"static"`` (token-wise, capturable per
    token count), ``"attention"`` (one attention op) or ``"rows"`` (after the row selection)."""

    name: str
    kind: str


@dataclass
class SplitGraph:
    """``module``: calls the pieces in order, same inputs and outputs as the unsplit graph."""

    module: fx.GraphModule
    pieces: list[Piece]

    def of_kind(self, kind: str) -> list[Piece]:
        return [p for p in self.pieces if p.kind == kind]


def is_attention_node(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    name = getattr(node.target, "name", None)
    name = name() if callable(name) else name
    return isinstance(name, str) and name.split(".")[0] in (ATTENTION_OP_NAME, ATTENTION_O_OP_NAME)


def split_at_attention(
    gm: fx.GraphModule, row_inputs: Iterable[str] = (), input_names: dict[str, str] | None = None
) -> SplitGraph:
    """Split ``gm`` (a lowered graph) at every attention op; see the module docstring.

    ``input_names``: placeholder name -> the user's name of that input (`user_input_names`,
    read before the passes); by default read now, and Dynamo's ``l_<name>_`` also matches.
    """
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    attention = [n for n in nodes if is_attention_node(n)]
    names = dict(user_input_names(gm), **(input_names or {}))
    rows_start = _rows_start(gm, nodes, attention, set(row_inputs), names)

    partition: dict[fx.Node, int] = {}
    kinds: dict[int, str] = {}
    current = 0
    for node in nodes:
        if node is rows_start:
            current += 1
            kinds[current] = ROWS
        if is_attention_node(node):
            current += 1
            partition[node] = current
            kinds[current] = ATTENTION
            current += 1
            continue
        partition[node] = current
        kinds.setdefault(current, STATIC)

    split = split_module(gm, None, lambda n: partition[n], keep_original_order=True)
    pieces = []
    for node in split.graph.nodes:
        if node.op == "call_module":
            index = int(str(node.target).rsplit("_", 1)[1])
            pieces.append(Piece(str(node.target), kinds[index]))
    return SplitGraph(split, pieces)


def _rows_start(
    gm: fx.GraphModule, nodes: list[fx.Node], attention: list[fx.Node], row_inputs: set[str], names: dict[str, str]
) -> fx.Node | None:
    """The first node after the last attention op that depends on a ``row_inputs`` input."""
    if not row_inputs:
        return None
    dynamo_names = {f"l_{name}_" for name in row_inputs}
    sources = {
        n for n in gm.graph.nodes
        if n.op == "placeholder" and (names.get(n.name, n.name) in row_inputs or n.name in dynamo_names)
    }
    if not sources:
        return None
    depends: set[fx.Node] = set(sources)
    after_last = not attention
    last = attention[-1] if attention else None
    for node in nodes:
        if any(a in depends for a in node.all_input_nodes):
            depends.add(node)
            if after_last and not _is_size_query(node):
                return node
        if node is last:
            after_last = True
    return None


def _is_size_query(node: fx.Node) -> bool:
    """``x.size(0)`` and friends: a size, not data (stays with whatever piece uses it)."""
    value = node.meta.get("example_value")
    return isinstance(value, (int, torch.SymInt))
