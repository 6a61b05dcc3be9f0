"""`AttentionReport`: what the passes found in a model and what they did with it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..passes.site import AttentionSite


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
    """All sites of all graphs a compilation produced (one per Dynamo graph, graph breaks included)."""

    sites: list[SiteReport] = field(default_factory=list)
    num_graphs: int = 0

    @property
    def num_lowered(self) -> int:
        return sum(s.lowered for s in self.sites)

    @property
    def all_lowered(self) -> bool:
        return bool(self.sites) and all(s.lowered for s in self.sites)

    def add_graph(self, sites: list[AttentionSite]) -> None:
        self.sites.extend(SiteReport.from_site(s, self.num_graphs) for s in sites)
        self.num_graphs += 1

    def __str__(self) -> str:
        head = f"attngraph: {self.num_lowered}/{len(self.sites)} attention sites lowered in {self.num_graphs} graph(s)"
        if not self.sites:
            return head + "\n  (no attention found)"
        w = max(len(s.name) for s in self.sites)
        rows = [head, f"  {'site':<{w}}  {'kind':<5}  {'lowered':<7}  detail"]
        for s in self.sites:
            rows.append(f"  {s.name:<{w}}  {s.kind:<5}  {'yes' if s.lowered else 'no':<7}  {s.reason}")
        return "\n".join(rows)

    __repr__ = __str__
