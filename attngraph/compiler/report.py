"""`AttentionReport`: what the passes found in a model and what they did with it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..passes.site import AttentionSite
from ..passes.token_mixing import TokenMixingOp


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
    def from_site(cls, site: AttentionSite, graph_index: int) -> "SiteReport":
        return cls(site.name, site.kind, site.lowered, site.reason, site.layer_id, graph_index)


@dataclass
class AttentionReport:
    """All sites of all graphs a compilation produced (one per Dynamo graph, graph breaks included).

    ``token_mixing``: ``(graph_index, op)`` for each op outside attention that moves data
    across tokens in the ragged (paged) form; the paged runtime refuses a model that has any.
    """

    sites: list[SiteReport] = field(default_factory=list)
    num_graphs: int = 0
    token_mixing: list[tuple[int, TokenMixingOp]] = field(default_factory=list)

    @property
    def num_lowered(self) -> int:
        return sum(s.lowered for s in self.sites)

    @property
    def all_lowered(self) -> bool:
        return bool(self.sites) and all(s.lowered for s in self.sites)

    def add_graph(self, sites: list[AttentionSite], token_mixing: list[TokenMixingOp] = ()) -> None:
        self.sites.extend(SiteReport.from_site(s, self.num_graphs) for s in sites)
        self.token_mixing.extend((self.num_graphs, op) for op in token_mixing)
        self.num_graphs += 1

    def token_mixing_of(self, graph_index: int) -> list[TokenMixingOp]:
        return [op for g, op in self.token_mixing if g == graph_index]

    def __str__(self) -> str:
        return self._sites_table() + self._token_mixing_table()

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
