"""The rewrite passes after lowering, as data: which run, in what order, and what each did.

`REWRITE_PASSES` lists them in the order they run on a lowered graph (in paged mode after
`passes.fuse_linears`, which the backend runs first because it adds graph inputs). Each entry
names its pass, says from the `CompileConfig` (and the device type) whether it runs, whether it
also runs on stateless graphs (``torch.compile(model, backend="attngraph")``; the others need
the paged runtime's ops), runs it on a graph, and names the field of its result that lists
what it rewrote. `RewritePassManager` runs the enabled ones on one copy of the graph and keeps
every result per pass name (``results["fold_rope"]``: one `passes.fold_rope.FoldRopeResult`
per graph), and puts each in the backend's report and the log (a line per pass and graph at
INFO; each pass logs its refusals' reasons at DEBUG).
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
class RewritePass:
    """One rewrite pass after lowering.

    ``enabled(config, device_type)``: whether it runs; ``run(gm, token_inputs,
    row_index_inputs)``: rewrites ``gm`` in place and returns its result, whose field
    ``applied`` lists the rewritten sites and ``refused`` the (site, reason) pairs it left;
    ``stateless``: it runs on stateless graphs too (paged graphs only otherwise)."""

    name: str
    enabled: Callable[[CompileConfig, str], bool]
    run: Callable[[fx.GraphModule, tuple, tuple], Any]
    applied: str
    stateless: bool = False


def _skinny(config: CompileConfig, device_type: str) -> bool:
    return config.lower_attention and config.resolved_skinny_linears(device_type)


def _norm(config: CompileConfig, device_type: str) -> bool:
    return _skinny(config, device_type) and config.fold_rms_norm


def _rope(config: CompileConfig, device_type: str) -> bool:
    return config.lower_attention and config.resolved_fold_rope


REWRITE_PASSES: tuple[RewritePass, ...] = (
    RewritePass("rank_one_products", lambda c, d: c.rank_one_products, lambda gm, t, r: rank_one_products(gm),
                "rewritten", stateless=True),
    RewritePass("skinny_linears", _skinny,
                lambda gm, t, r: skinny_linears(gm, token_inputs=t, row_index_inputs=r), "linears"),
    RewritePass("fold_rms_norm", _norm, lambda gm, t, r: fold_rms_norm(gm), "folded"),
    RewritePass("fold_norm_epilogue", lambda c, d: _norm(c, d) and c.fold_norm_epilogue,
                lambda gm, t, r: fold_norm_epilogue(gm), "folded"),
    RewritePass("fuse_gated_mlp", lambda c, d: _norm(c, d) and c.resolved_fuse_gated_mlp,
                lambda gm, t, r: fuse_gated_mlp(gm), "fused"),
    RewritePass("fold_rope", _rope, lambda gm, t, r: fold_rope(gm), "folded"),
    RewritePass("fold_rope_linear", lambda c, d: _rope(c, d) and c.fold_rope_linear,
                lambda gm, t, r: fold_rope_linear(gm), "folded"),
    RewritePass("fuse_attention_o", lambda c, d: c.lower_attention and c.fuse_attention_o,
                lambda gm, t, r: fuse_attention_o(gm), "fused"),
)  # fmt: skip


class RewritePassManager:
    """Runs `REWRITE_PASSES` on lowered graphs and keeps their results.

    ``results``: pass name -> the results of the graphs it ran on, in compile order (a pass
    that is off has an empty list)."""

    def __init__(self, config: CompileConfig, report: AttentionReport, token_inputs: tuple = (),
                 row_index_inputs: tuple = (), passes: tuple[RewritePass, ...] = REWRITE_PASSES) -> None:  # fmt: skip
        self.config = config
        self.report = report
        self.token_inputs = tuple(token_inputs)
        self.row_index_inputs = tuple(row_index_inputs)
        self.passes = passes
        self.results: dict[str, list] = {p.name: [] for p in passes}

    def enabled(self, device_type: str, paged: bool = True) -> list[RewritePass]:
        """The passes that run on (``paged`` or stateless) graphs of ``device_type`` under this
        config, in order."""
        return [p for p in self.passes if (paged or p.stateless) and p.enabled(self.config, device_type)]

    def run(self, gm: fx.GraphModule, device_type: str, copy: Callable[[fx.GraphModule], fx.GraphModule],
            paged: bool = True) -> fx.GraphModule:  # fmt: skip
        """The enabled passes, in order, on ``copy(gm)`` (made once, and only if one runs);
        returns the graph they rewrote, or ``gm`` when none is enabled."""
        enabled = self.enabled(device_type, paged)
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
