"""The pass pipeline: find_attention -> lower_attention -> cleanup [-> absorb_mla -> cleanup].

With ``CompileConfig.debug_dump_dir`` set (or ``ATTNGRAPH_DEBUG=1``), the graph is written
before and after each pass to ``<dir>/graph<k>/<step>.py``.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any, Iterable

from torch import fx

from ..config import CompileConfig
from ..passes import absorb_mla, cleanup, find_attention, lower_attention
from ..passes.site import AttentionSite

logger = logging.getLogger(__name__)


class PassPipeline:
    """Runs the passes in order on one Dynamo graph at a time."""

    _graph_ids = itertools.count()

    def __init__(self, config: CompileConfig, trusted_positions: Iterable[str] = (), paged: bool = False) -> None:
        """``paged``: the graph runs on the paged runtime, whose pool may store MLA's latent
        (`absorb_mla`, with ``config.absorb_mla``)."""
        self.config = config
        self.trusted_positions = tuple(trusted_positions)
        self.paged = paged
        self._announced = False

    def run(self, gm: fx.GraphModule, example_inputs: list[Any] | None = None) -> list[AttentionSite]:
        dump = self._dumper()
        dump(gm, "0-dynamo")
        sites = find_attention(gm, self.trusted_positions, example_inputs)
        if self.config.lower_attention:
            lower_attention(gm, sites)
            dump(gm, "1-lower_attention")
            cleanup(gm)
            dump(gm, "2-cleanup")
            if self.paged and self.config.absorb_mla and absorb_mla(gm, sites):
                cleanup(gm)
                dump(gm, "3-absorb_mla")
        return sites

    def _dumper(self):
        root = self.config.debug_dump_dir
        if not root:
            return lambda gm, step: None
        folder = os.path.join(root, f"graph{next(self._graph_ids)}")
        os.makedirs(folder, exist_ok=True)
        if not self._announced:
            logger.warning("attngraph debug: dumping FX graphs before/after each pass to %s", root)
            self._announced = True

        def dump(gm: fx.GraphModule, step: str) -> None:
            with open(os.path.join(folder, f"{step}.py"), "w") as f:
                f.write(gm.print_readable(print_output=False))

        return dump
