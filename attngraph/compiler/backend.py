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
from ..passes.fold_norm_epilogue import fold_norm_epilogue
from ..passes.fold_rms_norm import fold_rms_norm
from ..passes.fold_rope import fold_rope
from ..passes.fold_rope_linear import fold_rope_linear
from ..passes.fuse_attention_o import fuse_attention_o
from ..passes.fuse_gated_mlp import fuse_gated_mlp
from ..passes.rank_one_products import rank_one_products
from ..passes.skinny_linears import skinny_linears
from ..passes.token_mixing import TokenMixingOp, check_token_mixing
from ..forward_context import ForwardContext, use_forward_context
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
        self.rank_one_results: list = []  # a passes.rank_one_products.RankOneResult per paged graph rewritten
        self.fused_linears: list = []  # a passes.fuse_linears.FuseResult per paged graph
        self.skinny_results: list = []  # a passes.skinny_linears.SkinnyResult per paged graph rewritten
        self.norm_results: list = []  # a passes.fold_rms_norm.FoldNormResult per paged graph rewritten
        self.norm_epilogue_results: list = []  # a passes.fold_norm_epilogue.FoldNormEpilogueResult per graph rewritten
        self.gated_mlp_results: list = []  # a passes.fuse_gated_mlp.FuseGatedMlpResult per graph rewritten
        self.rope_results: list = []  # a passes.fold_rope.FoldRopeResult per paged graph rewritten
        self.rope_linear_results: list = []  # a passes.fold_rope_linear.FoldRopeLinearResult per graph rewritten
        self.attention_o_results: list = []  # a passes.fuse_attention_o.FuseAttentionOResult per graph rewritten

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
            gm = self._rank_one_products(gm)
            gm = self._skinny_linears(gm, device_type)
            gm = self._fold_rope(gm)
            gm = self._fuse_attention_o(gm)
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
        graph = fx.Graph()
        graph.output(graph.graph_copy(gm.graph, {}))
        copy = fx.GraphModule(gm, graph)
        result = fuse_linears(copy, example_inputs)
        self.fused_linears.append(result)
        self._record("fuse_linears", result, result.groups)
        return (copy, result.extra_inputs) if result.groups else (gm, [])

    def _rank_one_products(self, gm: fx.GraphModule) -> fx.GraphModule:
        """Paged mode with `CompileConfig.rank_one_products`: matrix products over one
        contracted element become multiplies (`passes.rank_one_products`), on a copy of the
        graph unless `_fuse_linears` made one already."""
        if not self.config.rank_one_products:
            return gm
        gm = self._own_copy(gm)
        result = rank_one_products(gm)
        self.rank_one_results.append(self._record("rank_one_products", result, result.rewritten))
        return gm

    def _skinny_linears(self, gm: fx.GraphModule, device_type: str) -> fx.GraphModule:
        """Paged mode (on CUDA by default): linears call attngraph's linear ops (`passes.skinny_linears`),
        on a copy of the graph unless `_fuse_linears` made one already."""
        if not (self.config.resolved_skinny_linears(device_type) and self.config.lower_attention):
            return gm
        gm = self._own_copy(gm)
        skinny = skinny_linears(gm, token_inputs=self.token_inputs, row_index_inputs=self.row_index_inputs)
        self.skinny_results.append(self._record("skinny_linears", skinny, skinny.linears))
        if self.config.fold_rms_norm:
            norm = fold_rms_norm(gm)
            self.norm_results.append(self._record("fold_rms_norm", norm, norm.folded))
            if self.config.fold_norm_epilogue:
                epilogue = fold_norm_epilogue(gm)
                self.norm_epilogue_results.append(self._record("fold_norm_epilogue", epilogue, epilogue.folded))
            if self.config.resolved_fuse_gated_mlp:
                gated = fuse_gated_mlp(gm)
                self.gated_mlp_results.append(self._record("fuse_gated_mlp", gated, gated.fused))
        return gm

    def _fold_rope(self, gm: fx.GraphModule) -> fx.GraphModule:
        """Paged mode with `CompileConfig.fold_rope`: the rotary embedding into the attention ops
        (`passes.fold_rope`), on a copy of the graph unless an earlier pass made one."""
        if not (self.config.resolved_fold_rope and self.config.lower_attention):
            return gm
        gm = self._own_copy(gm)
        rope = fold_rope(gm)
        self.rope_results.append(self._record("fold_rope", rope, rope.folded))
        if self.config.fold_rope_linear:
            into_linear = fold_rope_linear(gm)
            self.rope_linear_results.append(self._record("fold_rope_linear", into_linear, into_linear.folded))
        return gm

    def _own_copy(self, gm: fx.GraphModule) -> fx.GraphModule:
        """``gm`` to rewrite: a copy where it is Dynamo's own graph (Dynamo keeps reading it),
        else ``gm`` itself (an earlier pass's copy)."""
        if self.graphs and gm is self.graphs[-1]:
            graph = fx.Graph()
            graph.output(graph.graph_copy(gm.graph, {}))
            gm = fx.GraphModule(gm, graph)
        return gm

    def _fuse_attention_o(self, gm: fx.GraphModule) -> fx.GraphModule:
        """Paged mode with `CompileConfig.fuse_attention_o`: each attention op and the output
        projection after it become one op (`passes.fuse_attention_o`), on a copy of the graph
        unless an earlier pass made one."""
        if not (self.config.fuse_attention_o and self.config.lower_attention):
            return gm
        gm = self._own_copy(gm)
        fused = fuse_attention_o(gm)
        self.attention_o_results.append(self._record("fuse_attention_o", fused, fused.fused))
        return gm

    def _record(self, name: str, result: Any, applied: list) -> Any:
        """Put what the paged pass ``name`` did (``applied``, ``result.refused``) in the report
        and the log (a line per pass and graph at INFO; the pass itself logs each refusal's
        reason at DEBUG); returns ``result``."""
        entry = self.report.add_rewrite(name, applied, result.refused)
        logger.info("attngraph: graph %d: %s: %d rewritten, %d refused", entry.graph_index, name, len(entry.applied),
                    len(entry.refused))  # fmt: skip
        return result

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
