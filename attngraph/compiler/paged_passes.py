"""The paged runtime's rewrite passes after lowering, as data: which run, in what order, and
what each did.

`PAGED_PASSES` lists them in the order they run on a lowered paged graph (after
`passes.fuse_linears`, which the backend runs first because it adds graph inputs). Each entry
names its pass, says from the `CompileConfig` (and the device type) whether it runs, runs it on
a graph, and names the field of its result that lists what it rewrote. `PagedPassManager` runs
the enabled ones on one copy of the graph and keeps every result per pass name
(``results["fold_rope"]``: one `passes.fold_rope.FoldRopeResult` per graph), and puts each in
the backend's report and the log (a line per pass and graph at INFO; each pass logs its
refusals' reasons at DEBUG).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from torch import fx

from ..config import CompileConfig
from ..passes.fold_norm_epilogue import fold_norm_epilogue
from ..passes.fold_rms_norm import fold_rms_norm
from ..passes.fold_rope import fold_rope
from ..passes.fold_rope_linear import fold_rope_linear
from ..passes.fuse_attention_o import fuse_attention_o
from ..passes.fuse_gated_mlp import fuse_gated_mlp
from ..passes.rank_one_products import rank_one_products
from ..passes.skinny_linears import skinny_linears
from .report import AttentionReport

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PagedPass:
    """One rewrite pass of the paged runtime.

    ``enabled(config, device_type)``: whether it runs; ``run(gm, token_inputs,
    row_index_inputs)``: rewrites ``gm`` in place and returns its result, whose field
    ``applied`` lists the rewritten sites and ``refused`` the (site, reason) pairs it left."""

    name: str
    enabled: Callable[[CompileConfig, str], bool]
    run: Callable[[fx.GraphModule, tuple, tuple], Any]
    applied: str


def _skinny(config: CompileConfig, device_type: str) -> bool:
    return config.lower_attention and config.resolved_skinny_linears(device_type)


def _norm(config: CompileConfig, device_type: str) -> bool:
    return _skinny(config, device_type) and config.fold_rms_norm


def _rope(config: CompileConfig, device_type: str) -> bool:
    return config.lower_attention and config.resolved_fold_rope


PAGED_PASSES: tuple[PagedPass, ...] = (
    PagedPass("rank_one_products", lambda c, d: c.rank_one_products, lambda gm, t, r: rank_one_products(gm),
              "rewritten"),
    PagedPass("skinny_linears", _skinny,
              lambda gm, t, r: skinny_linears(gm, token_inputs=t, row_index_inputs=r), "linears"),
    PagedPass("fold_rms_norm", _norm, lambda gm, t, r: fold_rms_norm(gm), "folded"),
    PagedPass("fold_norm_epilogue", lambda c, d: _norm(c, d) and c.fold_norm_epilogue,
              lambda gm, t, r: fold_norm_epilogue(gm), "folded"),
    PagedPass("fuse_gated_mlp", lambda c, d: _norm(c, d) and c.resolved_fuse_gated_mlp,
              lambda gm, t, r: fuse_gated_mlp(gm), "fused"),
    PagedPass("fold_rope", _rope, lambda gm, t, r: fold_rope(gm), "folded"),
    PagedPass("fold_rope_linear", lambda c, d: _rope(c, d) and c.fold_rope_linear,
              lambda gm, t, r: fold_rope_linear(gm), "folded"),
    PagedPass("fuse_attention_o", lambda c, d: c.lower_attention and c.fuse_attention_o,
              lambda gm, t, r: fuse_attention_o(gm), "fused"),
)  # fmt: skip


class PagedPassManager:
    """Runs `PAGED_PASSES` on lowered paged graphs and keeps their results.

    ``results``: pass name -> the results of the graphs it ran on, in compile order (a pass
    that is off has an empty list)."""

    def __init__(self, config: CompileConfig, report: AttentionReport, token_inputs: tuple = (),
                 row_index_inputs: tuple = (), passes: tuple[PagedPass, ...] = PAGED_PASSES) -> None:  # fmt: skip
        self.config = config
        self.report = report
        self.token_inputs = tuple(token_inputs)
        self.row_index_inputs = tuple(row_index_inputs)
        self.passes = passes
        self.results: dict[str, list] = {p.name: [] for p in passes}

    def enabled(self, device_type: str) -> list[PagedPass]:
        """The passes that run on graphs of ``device_type`` under this config, in order."""
        return [p for p in self.passes if p.enabled(self.config, device_type)]

    def run(self, gm: fx.GraphModule, device_type: str, copy: Callable[[fx.GraphModule], fx.GraphModule]) -> fx.GraphModule:
        """The enabled passes, in order, on ``copy(gm)`` (made once, and only if one runs);
        returns the graph they rewrote, or ``gm`` when none is enabled."""
        enabled = self.enabled(device_type)
        if not enabled:
            return gm
        gm = copy(gm)
        for p in enabled:
            result = p.run(gm, self.token_inputs, self.row_index_inputs)
            self.results[p.name].append(result)
            self.record(p.name, result, getattr(result, p.applied))
        return gm

    def record(self, name: str, result: Any, applied: list) -> None:
        """Put what pass ``name`` did (``applied``, ``result.refused``) in the report and the log."""
        entry = self.report.add_rewrite(name, applied, result.refused)
        logger.info("attngraph: graph %d: %s: %d rewritten, %d refused", entry.graph_index, name, len(entry.applied),
                    len(entry.refused))  # fmt: skip
