"""`AttentionReport`: what the passes found in a model and what they did with it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

from torch import fx

from ..passes.site import AttentionSite
from ..passes.token_mixing import TokenMixingOp

#: Dynamo's containers on the way from the module to a parameter or buffer (not the user's names).
_MODULE_CONTAINERS = ("_modules", "_parameters", "_buffers")
_SOURCE_ROOT = re.compile(r"^[LG]\['([^']+)'\]")
_SOURCE_STEP = re.compile(r"\['((?:[^'\\]|\\.)*)'\]|\[(-?\d+)\]|\.(\w+)(\(\))?")


def user_input_names(gm: fx.GraphModule) -> dict[str, str]:
    """Placeholder name -> the name the user wrote for that input.

    Dynamo names a graph input after its access path (``l_kwargs_attention_mask_``,
    ``l_self_modules_encoder_modules_block_modules_0_..._parameters_weight_``); its source
    (``L['kwargs']['attention_mask']``) gives back the argument of ``forward``
    (``attention_mask``) or the parameter's qualified name
    (``encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight``). Inputs whose
    source cannot be read (sizes, unknown sources) keep Dynamo's name.
    """
    names = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        source = getattr(node.meta.get("grapharg"), "source", None)
        text = getattr(source, "name", None)
        text = text() if callable(text) else text
        user = _name_from_source(text) if isinstance(text, str) else None
        if user and user != node.name:
            names[node.name] = user
    return names


def _name_from_source(text: str) -> str | None:
    """``L['kwargs']['attention_mask']`` -> ``attention_mask``; ``L['self']._modules['lm_head']
    ._parameters['weight']`` -> ``lm_head.weight``; ``L['args'][0]`` -> ``args[0]``; None for a
    size (``L['x'].size()[0]``) or anything else it cannot read whole."""
    root = _SOURCE_ROOT.match(text)
    if root is None:
        return None
    steps = list(_SOURCE_STEP.finditer(text, root.end()))
    if "".join(m.group(0) for m in steps) != text[root.end():]:
        return None
    base = root.group(1)
    # ``self`` is the module itself; a dict of keyword arguments (``**kwargs``) is not a name.
    out = "" if base == "self" or (steps and steps[0].group(1) is not None) else base
    for m in steps:
        key, index, attr, call = m.groups()
        if call or attr in _MODULE_CONTAINERS:
            if call:
                return None
            continue
        if index is not None:
            out += f"[{index}]"
        else:
            part = key if key is not None else attr
            out = f"{out}.{part}" if out else part
    return out or None


def _rename(text: str, names: Mapping[str, str]) -> str:
    if not names or not text:
        return text
    pattern = re.compile(r"\b(" + "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)) + r")\b")
    return pattern.sub(lambda m: names[m.group(1)], text)


@dataclass(frozen=True)
class SiteReport:
    """One attention site: ``name`` (module path), ``kind`` ("sdpa"/"eager"), ``lowered``, ``reason``."""

    name: str
    kind: str
    lowered: bool
    reason: str
    layer_id: int
    graph_index: int

    @classmethod
    def from_site(cls, site: AttentionSite, graph_index: int, input_names: Mapping[str, str] | None = None) -> "SiteReport":
        """``input_names``: graph input -> the user's name (`user_input_names`), used in ``reason``."""
        reason = _rename(site.reason, input_names or {})
        return cls(site.name, site.kind, site.lowered, reason, site.layer_id, graph_index)


@dataclass(frozen=True)
class RewriteReport:
    """One paged-runtime rewrite pass over one graph: ``name`` (the pass, as in
    `attngraph.passes`), ``applied`` (what it rewrote: node names, or groups of them joined by
    "+"), ``refused`` (node name, reason) where it matched in part and left the graph as it was."""

    graph_index: int
    name: str
    applied: tuple[str, ...]
    refused: tuple[tuple[str, str], ...]

    def __str__(self) -> str:
        line = f"{self.name}: {len(self.applied)} rewritten"
        if not self.refused:
            return line
        by_reason: dict[str, list[str]] = {}
        for where, reason in self.refused:
            by_reason.setdefault(reason, []).append(where)
        line += f", {len(self.refused)} refused"
        for reason, where in by_reason.items():
            shown = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
            line += f"\n    {reason} ({shown})"
        return line


def _names(item) -> str:
    """A pass result's entry as text: a node name, or a group of names joined by "+"."""
    return "+".join(map(str, item)) if isinstance(item, (tuple, list)) else str(item)


@dataclass
class AttentionReport:
    """All sites of all graphs a compilation produced (one per Dynamo graph, graph breaks included).

    ``token_mixing``: ``(graph_index, op)`` for each op outside attention that moves data
    across tokens in the ragged (paged) form; the paged runtime refuses a model that has any.
    """

    sites: list[SiteReport] = field(default_factory=list)
    num_graphs: int = 0
    token_mixing: list[tuple[int, TokenMixingOp]] = field(default_factory=list)
    rewrites: list[RewriteReport] = field(default_factory=list)

    @property
    def num_lowered(self) -> int:
        return sum(s.lowered for s in self.sites)

    @property
    def all_lowered(self) -> bool:
        return bool(self.sites) and all(s.lowered for s in self.sites)

    def add_graph(
        self,
        sites: list[AttentionSite],
        input_names: Mapping[str, str] | None = None,
        token_mixing: list[TokenMixingOp] = (),
    ) -> None:
        """Record one compiled graph's sites and token-mixing ops; ``input_names`` maps its
        inputs to the user's names."""
        self.sites.extend(SiteReport.from_site(s, self.num_graphs, input_names) for s in sites)
        self.token_mixing.extend((self.num_graphs, op) for op in token_mixing)
        self.num_graphs += 1

    def add_rewrite(self, name: str, applied, refused) -> RewriteReport:
        """Record what the pass ``name`` did to the last graph added: ``applied`` (node names
        or tuples of them), ``refused`` ((node name or names, reason) pairs)."""
        entry = RewriteReport(self.num_graphs - 1, name, tuple(_names(a) for a in applied),
                              tuple((_names(w), str(r)) for w, r in refused))  # fmt: skip
        self.rewrites.append(entry)
        return entry

    def rewrites_of(self, name: str) -> list[RewriteReport]:
        """The entries of the pass ``name``, one per graph it ran on."""
        return [r for r in self.rewrites if r.name == name]

    def token_mixing_of(self, graph_index: int) -> list[TokenMixingOp]:
        return [op for g, op in self.token_mixing if g == graph_index]

    def __str__(self) -> str:
        return self._sites_table() + self._token_mixing_table() + self._rewrites_table()

    def _rewrites_table(self) -> str:
        if not self.rewrites:
            return ""
        rows = ["\nrewrites of the paged runtime's graphs (pass: rewritten, refused with the reason):"]
        for g in sorted({r.graph_index for r in self.rewrites}):
            rows.append(f"  graph {g}:")
            rows += ["    " + str(r).replace("\n", "\n    ") for r in self.rewrites if r.graph_index == g]
        return "\n".join(rows)

    def _token_mixing_table(self) -> str:
        if not self.token_mixing:
            return ""
        rows = [f"\nops outside attention that mix tokens ({len(self.token_mixing)}; the paged runtime refuses them):"]
        rows += [f"  {op}" for _, op in self.token_mixing]
        return "\n".join(rows)

    def _sites_table(self) -> str:
        head = f"attngraph: {self.num_lowered}/{len(self.sites)} attention sites lowered in {self.num_graphs} graph(s)"
        if not self.sites:
            return head + "\n  (no attention found)"
        w = max(len(s.name) for s in self.sites)
        rows = [head, f"  {'site':<{w}}  {'kind':<5}  {'lowered':<7}  detail"]
        for s in self.sites:
            rows.append(f"  {s.name:<{w}}  {s.kind:<5}  {'yes' if s.lowered else 'no':<7}  {s.reason}")
        return "\n".join(rows)

    __repr__ = __str__
