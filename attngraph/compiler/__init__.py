"""The torch.compile backend: pass pipeline, graph splitting, piece compilation."""

from .backend import AttnGraphBackend, compile_graph, make_backend, register
from .explain import explain
from .report import AttentionReport, RewriteReport, SiteReport

__all__ = ["AttnGraphBackend", "AttentionReport", "RewriteReport", "SiteReport", "compile_graph", "explain", "make_backend", "register"]
