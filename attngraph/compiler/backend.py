"""The torch.compile backend: pass pipeline -> lowered graph -> inductor or eager.

``import attngraph`` registers it as ``torch.compile(model, backend="attngraph")``;
``attngraph.backend(**config)`` builds one with a custom `CompileConfig`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import torch
from torch import fx

from ..attn_backends.base import AttentionBackend, ModelAttentionSpec
from ..attn_backends.registry import check_usable_here, create_backend
from ..config import CompileConfig
from ..errors import ConfigError
from ..passes import fx_utils as fu
from ..passes.site import AttentionSite
from ..passes.fuse_linears import fuse_linears
from ..passes.token_mixing import TokenMixingOp, check_token_mixing
from ..forward_context import ForwardContext, use_forward_context
from .rewrite_passes import RewritePassManager
from .pipeline import PassPipeline
from .proof_cache import cached_token_mixing
from .report import AttentionReport, user_input_names

logger = logging.getLogger(__name__)


class AttnGraphBackend:
    """A Dynamo backend. Call it with ``(gm, example_inputs)``; it returns the compiled callable.

    ``mode="stateless"``: each call runs under a `ForwardContext` naming the dense attention
    backend. ``mode="paged"``: the runtime publishes the context (with its ForwardBatch) itself,
    and the ``trusted_positions`` placeholders carry token positions. ``on_sites`` is called
    with each graph's sites after the passes, before anything runs (it may raise).
    ``report`` accumulates the sites of every graph compiled through this backend.

    ``token_inputs`` (paged mode): names of the placeholders whose symbolic length is the
    token axis (``input_ids``, ``position_ids``), and ``row_index_inputs`` those holding row
    indices into it (``logits_indices``). With them, every lowered graph is checked for ops
    outside attention that move data across tokens (`check_token_mixing`); the findings go
    to ``report.token_mixing`` before ``on_sites`` is called.

    ``compile_hook(gm, example_inputs, input_names)`` (paged mode): compiles the lowered
    graph instead of `compile_graph`; the runtime passes one that splits the graph at
    attention for piecewise CUDA graphs. ``input_names`` maps placeholders to the user's names.
    """

    def __init__(
        self,
        config: CompileConfig | None = None,
        mode: str = "stateless",
        trusted_positions: Iterable[str] = (),
        on_sites: Callable[[list[AttentionSite]], None] | None = None,
        token_inputs: Iterable[str] = (),
        row_index_inputs: Iterable[str] = (),
        compile_hook: Callable[[fx.GraphModule, list[Any], dict[str, str]], Callable] | None = None,
    ) -> None:
        if mode not in ("stateless", "paged"):
            raise ValueError(f"mode must be 'stateless' or 'paged', got {mode!r}")
        self.config = config or CompileConfig()
        self.mode = mode
        self.pipeline = PassPipeline(self.config, trusted_positions, paged=mode == "paged")
        self.report = AttentionReport()
        self.graphs: list[fx.GraphModule] = []
        self.sites: list[AttentionSite] = []
        self.on_sites = on_sites
        self.token_inputs = tuple(token_inputs)
        self.row_index_inputs = tuple(row_index_inputs)
        self.compile_hook = compile_hook
        self.fused_linears: list = []  # a passes.fuse_linears.FuseResult per paged graph
        #: The rewrite passes after lowering (`compiler.rewrite_passes`); ``rewrites[name]``: their results.
        self.rewrite_passes = RewritePassManager(self.config, self.report, self.token_inputs, self.row_index_inputs)
        self.rewrites = self.rewrite_passes.results

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        input_names = user_input_names(gm)  # read before the passes rewrite the graph
        sites = self.pipeline.run(gm, example_inputs)
        self.report.add_graph(sites, input_names, self._token_mixing(gm))
        self.sites.extend(sites)
        self.graphs.append(gm)
        if self.on_sites is not None:
            self.on_sites(sites)
        device_type = _device_type(sites, example_inputs)
        if self.mode == "paged":
            gm, extra = self._fuse_linears(gm, example_inputs)
            gm = self.rewrite_passes.run(gm, device_type, self._own_copy)
            fu.fill_example_values(gm)  # the passes' nodes: else AOTAutograd's cache refuses the graph
            fakes = self.fused_linears[-1].extra_fakes if extra else []
            inputs = list(example_inputs) + (fakes if len(fakes) == len(extra) else extra)
            if self.compile_hook is not None:
                compiled = self.compile_hook(gm, inputs, input_names)
            else:
                compiled = compile_graph(
                    gm, inputs, self.config.resolved_piece_compiler(device_type),
                    self.config.resolved_inductor_options(device_type),
                )
            for fused in self.fused_linears[-1:] if extra else ():
                fused.share_storage()
            if not extra:
                return compiled
            return lambda *args: compiled(*args, *extra)  # the fused weights follow Dynamo's inputs
        gm = self.rewrite_passes.run(gm, device_type, self._own_copy, paged=False)
        fu.fill_example_values(gm)
        compiled = compile_graph(
            gm, example_inputs, self.config.resolved_piece_compiler(device_type),
            self.config.resolved_inductor_options(device_type),
        )
        backend = self._dense_backend(sites, device_type)

        def run(*args: Any) -> Any:
            with use_forward_context(ForwardContext(backend)):
                return compiled(*args)

        return run

    def _fuse_linears(self, gm: fx.GraphModule, example_inputs: list[Any]) -> tuple[fx.GraphModule, list[torch.Tensor]]:
        """Paged mode: fuse the linears that share an input, on a copy of the graph (Dynamo
        keeps reading the placeholders of its own). Returns the graph to compile and the fused
        weights, to be passed after Dynamo's inputs on every call."""
        if not (self.config.fuse_linears and self.config.lower_attention):
            return gm, []
        copy = _graph_copy(gm)
        result = fuse_linears(copy, example_inputs)
        self.fused_linears.append(result)
        self.rewrite_passes.record("fuse_linears", result, result.groups)
        return (copy, result.extra_inputs) if result.groups else (gm, [])

    def _own_copy(self, gm: fx.GraphModule) -> fx.GraphModule:
        """``gm`` to rewrite: a copy where it is Dynamo's own graph (Dynamo keeps reading it),
        else ``gm`` itself (an earlier pass's copy)."""
        return _graph_copy(gm) if self.graphs and gm is self.graphs[-1] else gm

    def _token_mixing(self, gm: fx.GraphModule) -> list[TokenMixingOp]:
        if self.mode != "paged" or not self.token_inputs or not self.config.lower_attention:
            return []
        return cached_token_mixing(
            gm, self.token_inputs, self.row_index_inputs,
            lambda: check_token_mixing(gm, self.token_inputs, self.row_index_inputs),
        )

    def _dense_backend(self, sites: list[AttentionSite], device_type: str) -> AttentionBackend | None:
        lowered = [s for s in sites if s.lowered]
        if not lowered:
            return None
        q = fu.example_value(lowered[0].q)
        spec = ModelAttentionSpec(
            num_layers=len(lowered),
            num_q_heads=lowered[0].num_q_heads,
            num_kv_heads=lowered[0].num_kv_heads,
            head_dims=tuple(sorted({s.head_dim for s in lowered})),
            dtype=q.dtype,
            device_type=device_type,
            page_size=self.config.page_size,
            uses_window=any(s.window_left >= 0 for s in lowered),
            uses_logit_cap=any(not isinstance(s.logit_cap, float) or s.logit_cap > 0 for s in lowered),
            uses_sinks=any(s.sinks is not None for s in lowered),
            uses_chunks=any(s.chunk_size > 0 for s in lowered),
            uses_alibi=any(s.alibi_slopes is not None for s in lowered),
            non_causal=any(not s.causal for s in lowered),
        )
        backend = create_backend(self.config.attention_backend, spec)
        if not backend.capabilities.dense:
            return create_backend("torch_native", spec)
        return backend


def _graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule over a copy of ``gm``'s graph (same submodules and attributes)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def compile_graph(
    gm: fx.GraphModule, example_inputs: list[Any], piece_compiler: str, inductor_options: dict[str, Any] | None = None
) -> Callable:
    """Compile a (lowered) graph with inductor, or return it to run as is (``"eager"``).
    ``inductor_options``: ``torch._inductor.config`` settings for this compile only
    (`CompileConfig.resolved_inductor_options`)."""
    if piece_compiler == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches=dict(inductor_options) if inductor_options else None)
    return gm.forward


def start_compile_workers() -> None:
    """Start inductor's compile worker processes now, ahead of the first compile (as torch's own
    ``inductor`` backend does when Dynamo first calls it, only earlier: before the trace).

    The workers take seconds to start; until they are ready, inductor compiles each kernel
    in this process, one after the other."""
    try:
        from torch._inductor.async_compile import AsyncCompile, maybe_warm_pool
    except ImportError:  # an inductor without the pool: it compiles in-process anyway
        return
    maybe_warm_pool()
    submit_ready_check = getattr(AsyncCompile, "use_process_pool", None)
    if submit_ready_check is not None:
        submit_ready_check()  # its first call hands the pool a job, which starts the workers


def _device_type(sites: list[AttentionSite], example_inputs: list[Any]) -> str:
    for s in sites:
        val = fu.example_value(s.q)
        if isinstance(val, torch.Tensor):
            return val.device.type
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return x.device.type
    return "cpu"


def make_backend(**config: Any) -> AttnGraphBackend:
    """``torch.compile(model, backend=attngraph.backend(attention_backend="torch_native"))``.

    The config is validated and each named attention backend is checked to run on this machine
    here, so a wrong choice raises `ConfigError` / `BackendUnavailableError` at this call rather
    than inside Dynamo (which wraps errors raised while compiling in ``BackendCompilerFailed``;
    its ``.inner_exception`` is attngraph's error).
    """
    cfg = CompileConfig.from_kwargs(**config)
    for name in dict.fromkeys((cfg.attention_backend, cfg.prefill_attention_backend, cfg.decode_attention_backend,
                               cfg.verify_attention_backend, cfg.draft_attention_backend)):
        if name is not None:
            check_usable_here(name)
    return AttnGraphBackend(cfg)


def _registered_backend(
    gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None, **kwargs: Any
) -> Callable:
    """``torch.compile(model, backend="attngraph", options={...})``: torch hands the options
    dict over as ``options=``; its keys are `CompileConfig` fields."""
    if "mode" in kwargs:
        raise ConfigError(
            f"torch.compile(mode={kwargs['mode']!r}) is not used by the attngraph backend; "
            "pass CompileConfig fields as options={...} instead"
        )
    return AttnGraphBackend(CompileConfig.from_kwargs(**(options or {}), **kwargs))(gm, example_inputs)


def register() -> None:
    from torch._dynamo import list_backends, register_backend

    if "attngraph" not in list_backends(exclude_tags=()):
        register_backend(name="attngraph")(_registered_backend)
