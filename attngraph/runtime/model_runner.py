"""`ModelRunner`: the ragged model, the KV pool and the attention backend, run one step at a time."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..argmax import argmax_last_dim
from ..attn_backends.base import AttentionBackend, GraphSupport, ModelAttentionSpec
from ..attn_backends.torch_native import TorchNativeBackend
from ..config import CompileConfig
from ..errors import ConfigError, InputError, KernelFaultError, UnsupportedModelError
from ..passes.site import AttentionSite
from ..forward_batch import ForwardBatch
from ..forward_context import ForwardContext, use_forward_context
from .kv_pool import KVPool
from .tensor_parallel import agreed_across_ranks
from .piecewise_runner import frozen
from .ragged_model import MIN_TOKENS, RaggedModel, step_token_limit

logger = logging.getLogger(__name__)

#: KV pool size on CPU when the config gives none (tokens).
CPU_DEFAULT_KV_TOKENS = 16384
#: Graph modes that split the graph at attention (`runtime.piecewise`).
PIECEWISE_MODES = ("piecewise", "full_and_piecewise", "breakable")


class _CapturePlan(NamedTuple):
    """The graphs `ModelRunner._capture_graphs` captures."""

    buckets: tuple[int, ...]  # token counts of the prefill graphs (whole-step or piecewise)
    capture_sizes: tuple[int, ...]  # batch sizes of the whole-step decode graphs
    full: bool  # decode steps as whole-step graphs
    extend_full: bool  # prefill steps as whole-step graphs (else pieces, in a piecewise mode)
    piecewise: bool  # the graph is split at attention (a piecewise mode)

    @property
    def prefill_captured(self) -> bool:
        return bool(self.buckets)

    @property
    def decode_captured(self) -> bool:
        return bool(self.capture_sizes)
#: Most tokens of a step that a verify graph serves (logits at every token); a larger step of a
#: speculative target runs without a graph.
VERIFY_MAX_TOKENS = 256
#: Fraction of free device memory the pool takes on CUDA when the config gives no size.
CUDA_DEFAULT_KV_FRACTION = 0.4
MAX_DEFAULT_CONTEXT = 32768


@dataclass(frozen=True)
class AttentionGeometry:
    """What the paged KV pool and the attention spec are sized by, read off the traced sites."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    #: The values are the keys' first ``v_head_dim`` columns (MLA's latent): the pool stores K only.
    value_in_key: bool = False


def attention_geometry(sites: list[AttentionSite]) -> AttentionGeometry:
    """Layer count and head shapes of the KV pool, from the attention sites of the traced graph.

    The sites carry the shapes attention really runs with, whatever the config calls them
    (Falcon-7B's ``multi_query`` has one KV head while its config's ``num_kv_heads`` counts
    all of them; Falcon-40B broadcasts K/V to every head before caching). The pool holds one
    shape, so every site must share it; layers are the sites' ``layer_id`` (0 .. max).
    """
    if not sites:
        raise UnsupportedModelError("no attention site was found; there is nothing to size the KV pool by")
    first = sites[0]
    shape = (first.num_q_heads, first.num_kv_heads, first.head_dim, first.v_head_dim)
    for s in sites:
        if (s.num_q_heads, s.num_kv_heads, s.head_dim, s.v_head_dim) != shape:
            raise UnsupportedModelError(
                f"attention site {s.name} has {s.num_q_heads} query / {s.num_kv_heads} KV heads of dim "
                f"{s.head_dim}/{s.v_head_dim}, but {first.name} has {shape[0]} / {shape[1]} of dim "
                f"{shape[2]}/{shape[3]}; the paged KV pool holds one shape for every layer"
            )
        if s.layer_id < 0:
            raise UnsupportedModelError(f"attention site {s.name} has no KV-pool layer")
    if len({s.layer_id for s in sites}) != len(sites):
        raise UnsupportedModelError("two attention sites map to the same KV-pool layer")
    if len({s.value_in_key for s in sites}) != 1:  # same dims, but values stored in one layer only
        raise UnsupportedModelError("some attention sites read their values from their keys and others do not")
    return AttentionGeometry(
        max(s.layer_id for s in sites) + 1, first.num_q_heads, first.num_kv_heads, first.head_dim, first.v_head_dim,
        first.value_in_key,
    )


def _head_dims(g: AttentionGeometry) -> str:
    if g.value_in_key:
        return f"{g.head_dim} (latent + RoPE key; the values are its first {g.v_head_dim})"
    return str(g.head_dim) if g.v_head_dim == g.head_dim else f"{g.head_dim} (K) / {g.v_head_dim} (V)"


class ModelRunner:
    """Runs a `ForwardBatch` through the ragged model with the pool and backend published.

    Built by `attngraph.accelerate`; usable directly for custom serving loops::

        runner = ModelRunner(model, CompileConfig(attention_backend="torch_native"))
        row = runner.pool.alloc_request(); runner.pool.reserve([row], [len(prompt)])
        batch = ForwardBatch.build(runner.pool, [row], [0], [len(prompt)], prompt)
        logits = runner.forward(batch, batch.qo_indptr[1:] - 1)   # [1, vocab]

    The KV pool is shaped like the attention the compiler finds in the graph, not like the
    config says: the first access to `pool` (or `warmup`) compiles the model to learn it.
    """

    def __init__(self, model: torch.nn.Module, config: CompileConfig) -> None:
        self.model = model
        self.config = config
        param = next(model.parameters())
        if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
            raise UnsupportedModelError(
                "the model's weights are on the meta device (not loaded); load them "
                "(from_pretrained, load_state_dict or to_empty + initialization) before attngraph.accelerate()"
            )
        self.device, self.dtype = param.device, param.dtype
        max_pos = getattr(model.config, "max_position_embeddings", None) or MAX_DEFAULT_CONTEXT
        self.max_context_len = config.max_context_len or min(int(max_pos), MAX_DEFAULT_CONTEXT)
        self._geometry: AttentionGeometry | None = None  # set by the first compile, from its sites
        #: Most tokens per step the traced graph holds (`step_token_limit`); None: no limit.
        self.max_step_tokens: int | None = None
        self._pool: KVPool | None = None
        self.spec: ModelAttentionSpec | None = None
        self.backend: AttentionBackend | None = None
        self._reference = TorchNativeBackend()
        self.graphs = None  # DecodeGraphRunner once captured
        self.piecewise = None  # PiecewiseGraphRunner once captured
        self.extend_graphs = None  # ExtendGraphRunner once captured
        #: ExtendGraphRunner with logits at every token (speculative verify steps); its buckets
        #: are captured the first time a step needs them.
        self.verify_graphs = None
        #: The backend of verify steps (`CompileConfig.verify_attention_backend`; else `backend`).
        self.verify_backend: AttentionBackend | None = None
        self.multi_step = None  # MultiStepDecodeGraphs (a draft's greedy decode steps)
        self.capture_stream: "torch.cuda.Stream | None" = None  # shared by every capture
        self.graph_mempool = None  # the graphs' shared memory pool
        self.graph_mode = config.resolved_cuda_graph(self.device.type)  # ConfigError for a mode the device lacks
        self._piecewise_state = None
        hook = None
        if self.graph_mode in PIECEWISE_MODES:
            import functools

            from .piecewise import PiecewiseState, build_piecewise

            self._piecewise_state = PiecewiseState(debug=bool(config.debug_dump_dir))
            compiler = "eager" if self.graph_mode == "breakable" else config.resolved_piece_compiler(self.device.type)
            hook = functools.partial(
                build_piecewise, piece_compiler=compiler, state=self._piecewise_state,
                inductor_options=config.resolved_inductor_options(self.device.type),
                exact_token_counts=config.resolved_exact_token_counts(self.device.type),
                exact_inductor_options=config.resolved_exact_inductor_options(self.device.type),
            )
        if config.exact_token_counts and not config.resolved_exact_token_counts(self.device.type) or (
            config.exact_token_counts and self.graph_mode not in ("piecewise", "full_and_piecewise")
        ):
            logger.warning(
                "exact_token_counts=%s has no effect here (cuda_graph=%r, pieces compiled by %r): it needs the "
                "graph split at attention with inductor, i.e. a CUDA model with cuda_graph='full_and_piecewise' "
                "or 'piecewise'", config.exact_token_counts, self.graph_mode,
                config.resolved_piece_compiler(self.device.type),
            )
        if self.device.type == "cuda" and self.graph_mode != "breakable" and config.resolved_piece_compiler("cuda") == "inductor":
            from ..compiler.backend import start_compile_workers

            start_compile_workers()  # ready by the time the trace ends and the graphs compile
        self.ragged = RaggedModel(model, config, compile_hook=hook)
        self.ragged.backend.on_sites = self._on_sites_checked

    # ------------------------------------------------------------------ setup
    @property
    def geometry(self) -> AttentionGeometry:
        """Layers and head shapes of the traced attention sites (the first access compiles)."""
        if self._geometry is None:
            self._trace()
        return self._geometry

    @property
    def pool(self) -> KVPool:
        """The paged KV pool, sized by `geometry` (the first access compiles)."""
        if self._pool is None:
            self._pool = self._make_pool()
        return self._pool

    def trace_tokens(self) -> int:
        """Tokens of the dummy sequence the model is compiled on (`CompileConfig.trace_tokens`)."""
        if self.config.trace_tokens is not None:
            return self.config.trace_tokens
        if self.device.type != "cuda":
            return MIN_TOKENS
        return max(MIN_TOKENS, min(max(self.config.cuda_graph_num_tokens), self.max_context_len))

    def _trace(self) -> None:
        """Compile the ragged model on a dummy sequence (`trace_tokens`) before any pool exists.

        The compiler reports the sites (`_on_sites_checked` records their geometry and picks
        the backend) before the graph runs; the run itself is published without a
        `ForwardBatch`, so the lowered op attends densely and touches no pool. The shapes are
        those of every later step, so the graph is the one they reuse (no second compile).
        """
        n = self.trace_tokens()
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        positions = torch.arange(n, dtype=torch.long, device=self.device)
        last = torch.tensor([n - 1], dtype=torch.long, device=self.device)
        with use_forward_context(ForwardContext(self._reference)):
            self.ragged(ids, positions, last)
        if self._geometry is None:  # _check_sites refuses a graph without attention first
            raise UnsupportedModelError("compiling the model reported no attention sites; cannot size the KV pool")

    def _make_pool(self) -> KVPool:
        g, cfg = self.geometry, self.config
        per_token = KVPool.bytes_per_token(g.num_layers, g.num_kv_heads, g.head_dim, g.v_head_dim, self.dtype,
                                           value_in_key=g.value_in_key)  # fmt: skip
        if cfg.kv_cache_tokens is not None:
            tokens = cfg.kv_cache_tokens
        elif self.device.type == "cuda":
            fraction = cfg.kv_memory_fraction or CUDA_DEFAULT_KV_FRACTION
            torch.cuda.empty_cache()  # what the trace's activations left cached counts as free
            free, _total = torch.cuda.mem_get_info(self.device)
            tokens = int(free * fraction) // per_token
        else:
            tokens = CPU_DEFAULT_KV_TOKENS
        num_pages = agreed_across_ranks(self.model, max(1, tokens // cfg.page_size), self.device)
        logger.info(
            "KV pool: %d pages x %d tokens (%.1f MiB, %d bytes per token) for %d layers of %d KV heads x %s",
            num_pages, cfg.page_size, num_pages * cfg.page_size * per_token / 2**20, per_token, g.num_layers,
            g.num_kv_heads, _head_dims(g),
        )
        return KVPool(
            num_layers=g.num_layers,
            num_kv_heads=g.num_kv_heads,
            head_dim=g.head_dim,
            v_head_dim=g.v_head_dim,
            value_in_key=g.value_in_key,
            num_pages=num_pages,
            page_size=cfg.page_size,
            dtype=self.dtype,
            device=self.device,
            max_requests=cfg.max_requests,
            max_context_len=self.max_context_len,
        )

    def _on_sites_checked(self, sites: list[AttentionSite]) -> None:
        """Called by the compiler with each graph's sites, before the graph runs.

        The first graph fixes the geometry (and so the pool); a later graph (a recompile) must
        fit the pool that already holds the requests' K/V.
        """
        self.ragged._check_sites(sites)
        if self._geometry is None:
            self.max_step_tokens = step_token_limit(sites)
            if self.max_step_tokens is not None:
                logger.info("the traced forward holds at most %d tokens per step; longer steps run in parts",
                            self.max_step_tokens)  # fmt: skip
        g = attention_geometry(sites)
        have = self._geometry
        if have is not None:
            heads = (g.num_q_heads, g.num_kv_heads, g.head_dim, g.v_head_dim)
            if heads != (have.num_q_heads, have.num_kv_heads, have.head_dim, have.v_head_dim) or g.num_layers > have.num_layers \
                    or g.value_in_key != have.value_in_key:  # fmt: skip
                raise UnsupportedModelError(
                    f"a recompiled graph's attention ({g.num_q_heads} query / {g.num_kv_heads} KV heads of dim "
                    f"{g.head_dim}/{g.v_head_dim}, {g.num_layers} layers) does not fit the KV pool sized by the first "
                    f"graph ({have.num_q_heads} query / {have.num_kv_heads} KV heads of dim {have.head_dim}/"
                    f"{have.v_head_dim}, {have.num_layers} layers)"
                )
            g = have
        self.spec = ModelAttentionSpec(
            num_layers=g.num_layers,
            num_q_heads=g.num_q_heads,
            num_kv_heads=g.num_kv_heads,
            head_dims=tuple(sorted({g.head_dim, g.v_head_dim})),
            dtype=self.dtype,
            device_type=self.device.type,
            page_size=self.config.page_size,
            uses_window=any(s.window_left >= 0 for s in sites),
            uses_logit_cap=any(isinstance(s.logit_cap, torch.fx.Node) or s.logit_cap > 0 for s in sites),
            uses_sinks=any(s.sinks is not None for s in sites),
            uses_chunks=any(s.chunk_size > 0 for s in sites),
            uses_alibi=any(s.alibi_slopes is not None for s in sites),
            non_causal=any(not s.causal for s in sites),
            v_head_dim=g.v_head_dim if g.v_head_dim != g.head_dim else None,
            value_in_key=g.value_in_key,
        )
        from ..attn_backends.hybrid import create_attention_backend

        self.backend = create_attention_backend(self.config, spec=self.spec)
        self.backend.set_layer_kinds([s.as_layer() for s in sites])
        self._set_decode_prefetches(g.num_layers)
        self.verify_backend = self.backend
        verify = self.config.verify_attention_backend
        if verify is not None:
            from ..attn_backends.registry import resolve_backend_name

            cfg = self.config
            prefill = cfg.prefill_attention_backend or cfg.attention_backend
            if resolve_backend_name(verify, self.spec) != resolve_backend_name(prefill, self.spec):
                self.verify_backend = create_attention_backend(
                    cfg.replace(attention_backend=verify, prefill_attention_backend=None, decode_attention_backend=None),
                    spec=self.spec,
                )
                self.verify_backend.set_layer_kinds([s.as_layer() for s in sites])
        self._geometry = g
        logger.info(
            "attention backend: %s; %d layers, %d query / %d KV heads of dim %d",
            type(self.backend).__name__, g.num_layers, g.num_q_heads, g.num_kv_heads, g.head_dim,
        )

    def _set_decode_prefetches(self, num_layers: int) -> None:
        """Hand the decode backend the L2 prefetches that `CompileConfig.l2_prefetch_mlp_bytes`
        and `l2_prefetch_o` ask for. Only the Triton backend's decode has them; with another,
        a warning names the setting, and decode runs without the hint."""
        decode = getattr(self.backend, "decode_backend", self.backend)
        cfg = self.config

        def served(name: str, setter: str) -> bool:
            if hasattr(decode, setter):
                return True
            logger.warning("%s has no effect with the %s decode backend: only the Triton backend's decode kernels "
                           "ask L2 for weights", name, type(decode).__name__)  # fmt: skip
            return False

        if cfg.l2_prefetch_mlp_bytes and served("l2_prefetch_mlp_bytes", "set_decode_prefetch"):
            from .mlp_prefetch import mlp_prefetch_source

            decode.set_decode_prefetch(mlp_prefetch_source(self.model, num_layers, cfg.l2_prefetch_mlp_bytes))
        if cfg.l2_prefetch_o and served("l2_prefetch_o", "set_decode_l2_next"):
            from .o_prefetch import o_prefetch_source

            decode.set_decode_l2_next(o_prefetch_source(self.model, num_layers))

    def warmup(self) -> None:
        """Compile now (a dummy sequence of `trace_tokens`, which sizes the pool; then a prefill and a
        decode step of a dummy request on the chosen backend) so errors surface at `accelerate`
        time; then capture the CUDA graphs ``graph_mode`` asks for.

        A dummy step is left out where a capture covers its path: every capture runs its step
        once before recording (`capture_step`), which compiles and checks the same code; the
        eager step would only compile kernel variants (Triton's non-graph prefill) that steps
        served by graphs never use."""
        pool = self.pool
        plan = self._capture_plan()
        prefill, decode = not plan.prefill_captured, not plan.decode_captured
        if prefill or decode:
            row = pool.alloc_request()
            try:
                pool.reserve([row], [3])
                ids = torch.zeros(3, dtype=torch.long, device=self.device)
                # (a decode step needs the prefill's K/V before it)
                self.forward(ForwardBatch.build(pool, [row], [0], [2], ids[:2]))
                if decode:
                    self.forward(ForwardBatch.build(pool, [row], [2], [1], ids[2:]))
            finally:
                pool.free_request(row)
        self._capture_graphs()

    def _capture_plan(self) -> "_CapturePlan":
        """What `_capture_graphs` will capture (ConfigError for a mode the backend cannot serve)."""
        mode = self.graph_mode
        if mode == "none":
            return _CapturePlan((), (), False, False, False)
        support = self.backend.capabilities.graph_support
        full = mode in ("full", "full_and_piecewise") and support.get("decode", GraphSupport.NEVER) >= GraphSupport.FULL
        extend_full = mode in ("full", "full_and_piecewise") and support.get("extend", GraphSupport.NEVER) >= GraphSupport.FULL
        if mode == "full" and not full:
            raise ConfigError(
                f"cuda_graph='full' needs a backend that captures decode attention; "
                f"{type(self.backend).__name__} does not. Use attention_backend='flashinfer' or 'triton', "
                "cuda_graph='piecewise' (attention runs between the graphs) or cuda_graph='none'"
            )
        limit = self.max_step_tokens or float("inf")  # a graph's tokens must fit the traced forward
        buckets = tuple(n for n in self.config.cuda_graph_num_tokens if n <= limit)
        capture_sizes = tuple(n for n in self.config.cuda_graph_capture_sizes if n <= limit)
        if not (extend_full or mode in PIECEWISE_MODES):
            buckets = ()
        return _CapturePlan(buckets, capture_sizes if full else (), full, extend_full, mode in PIECEWISE_MODES)

    def _capture_graphs(self) -> None:
        """Capture what ``graph_mode`` asks for into one memory pool, largest first: the
        token buckets (up to 1024 tokens by default), then the decode batch sizes.

        In ``full`` and ``full_and_piecewise`` a backend that captures extend attention
        (``graph_support["extend"] == FULL``) gets whole-step graphs per token bucket
        (`ExtendGraphRunner`) in place of the piecewise ones; otherwise ``full_and_piecewise``
        captures the pieces and runs attention between them."""
        mode = self.graph_mode
        if mode == "none":
            return
        plan = self._capture_plan()
        import time

        from tqdm.auto import tqdm

        from .cuda_graph import DecodeGraphRunner
        from .extend_graph import ExtendGraphRunner
        from .graph_memory import pool_bytes
        from .piecewise_runner import PiecewiseGraphRunner

        debug = bool(self.config.debug_dump_dir)
        buckets, capture_sizes = plan.buckets, plan.capture_sizes
        torch.cuda.synchronize()
        start, before = time.perf_counter(), pool_bytes(self.device)
        mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)  # one capture stream: one cuBLAS workspace
        pieces = decode = extend = None
        if plan.extend_full and buckets:
            extend = ExtendGraphRunner(self, buckets, mempool=mempool, debug=debug)
        elif plan.piecewise and buckets:
            state = self._piecewise_state
            state.mempool, state.stream = mempool, stream
            pieces = PiecewiseGraphRunner(self, state, buckets)
        if capture_sizes:
            decode = DecodeGraphRunner(self, capture_sizes, debug=debug, mempool=mempool)
        total = sum(len(r.sizes) for r in (pieces, extend, decode) if r is not None)
        with tqdm(total=total, desc="attngraph: capturing CUDA graphs", unit="size", leave=False) as bar:
            for r in (extend, pieces, decode):
                if r is not None:
                    r.capture(bar, stream=stream)
        self.piecewise, self.graphs, self.extend_graphs = pieces, decode, extend
        self.capture_stream, self.graph_mempool = stream, mempool
        verify = self.verify_backend
        limit = self.max_step_tokens or float("inf")
        sizes = tuple(n for n in self.config.cuda_graph_num_tokens if n <= min(limit, VERIFY_MAX_TOKENS))
        if (mode in ("full", "full_and_piecewise") and sizes
                and verify.capabilities.graph_support.get("extend", GraphSupport.NEVER) >= GraphSupport.FULL):  # fmt: skip
            # captured on first use: only speculative targets need them
            self.verify_graphs = ExtendGraphRunner(self, sizes, mempool=mempool, debug=debug, all_logits=True,
                                                   backend=verify)  # fmt: skip
        if decode is not None and self.backend.capabilities.decode_metadata_on_device:
            from .multi_step_graph import MultiStepDecodeGraphs

            self.multi_step = MultiStepDecodeGraphs(self, decode)  # captured on first use too
        torch.cuda.synchronize()
        logger.info(
            "cuda_graph=%s: captured %d prefill graphs (%s tokens), %d piecewise graphs (%s tokens) and "
            "%d decode graphs (batch sizes %s) in %.1f s; graph memory %.0f MiB",
            mode, len(extend.graphs) if extend else 0, list(extend.sizes) if extend else [],
            pieces.state.num_graphs if pieces else 0, list(pieces.sizes) if pieces else [],
            len(decode.graphs) if decode else 0, list(decode.sizes) if decode else [],
            time.perf_counter() - start, (pool_bytes(self.device) - before) / 2**20,
        )

    # ------------------------------------------------------------------ step
    def forward(self, batch: ForwardBatch, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``batch``; returns logits ``[L, vocab]`` of the token rows ``logits_indices: [L]``
        (default: the last new token of each request, ``L = batch_size``)."""
        self._check_step_tokens(batch)
        if logits_indices is None:
            if self.graphs is not None and self.graphs.can_run(batch):
                return self.graphs.replay(batch)
            if self.extend_graphs is not None and self.extend_graphs.can_run(batch):
                return self.extend_graphs.replay(batch)
            logits_indices = batch.qo_indptr[1:].long() - 1
        if self.piecewise is not None and self.piecewise.can_run(batch):
            return self.piecewise.run(batch, logits_indices)
        # (self.backend is None during the call that compiles: the sites pick the backend)
        return self._eager(batch, logits_indices, self.backend or self._reference)

    def _eager(self, batch: ForwardBatch, logits_indices: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """The compiled model run without graphs, ``backend`` serving its attention."""
        backend.init_forward_metadata(batch)
        with use_forward_context(ForwardContext(backend, batch)), self._after_capture():
            return self.ragged(batch.input_ids, batch.positions, logits_indices.to(self.device))

    def _check_step_tokens(self, batch: ForwardBatch) -> None:
        if self.max_step_tokens is not None and batch.num_tokens > self.max_step_tokens:
            raise InputError(
                f"a step of {batch.num_tokens} tokens: {type(self.model).__name__}'s traced forward holds at most "
                f"{self.max_step_tokens} tokens per step (its own code limits the sequence length); give fewer or "
                "shorter sequences per call"
            )

    def forward_all(self, batch: ForwardBatch) -> torch.Tensor:
        """Run ``batch``; logits ``[T, vocab]`` at every one of its ``T`` new tokens (a
        speculative target's verify step). A verify graph serves it when the step fits one."""
        verify = self.verify_graphs
        if verify is not None and verify.can_run(batch):
            return verify.replay(batch)
        rows = torch.arange(batch.num_tokens, device=self.device)
        if self.verify_backend is None or self.verify_backend is self.backend:
            return self.forward(batch, rows)
        self._check_step_tokens(batch)
        return self._eager(batch, rows, self.verify_backend)

    def decode_steps(self, rows: list[int], lengths: list[int], positions: list[int], tokens: torch.Tensor,
                     steps: int) -> torch.Tensor:  # fmt: skip
        """``steps`` greedy decode steps of the requests ``rows`` (``lengths``: tokens each holds;
        ``positions``: the position of each one's next token; ``tokens: [B]`` device, the
        tokens fed first). Step ``j`` feeds each request's argmax of step ``j - 1`` at
        ``positions + j``. Returns the argmaxes ``[steps, B]`` (int64, device; nothing is read
        on the host). The pages of ``lengths + steps`` tokens must be reserved.

        One CUDA graph replays all steps when the backend's decode metadata lives on the
        device (`MultiStepDecodeGraphs`), else a step runs at a time."""
        if self.multi_step is not None and self.multi_step.can_run(len(rows), steps):
            return self.multi_step.run(rows, lengths, positions, tokens, steps)
        pool, out = self.pool, []
        for j in range(steps):
            batch = ForwardBatch.decode(pool, rows, [n + j for n in lengths], tokens, [p + j for p in positions])
            tokens = argmax_last_dim(self.forward(batch))  # = of the float32 logits (`MultiStepDecodeGraphs._record`)
            out.append(tokens)
        return torch.stack(out) if out else torch.zeros(0, len(rows), dtype=torch.long, device=self.device)

    def _after_capture(self):
        """Steps above the largest bucket skip Dynamo's guards too once graphs are captured."""
        captured = self.piecewise is not None or self.extend_graphs is not None
        return frozen() if captured else contextlib.nullcontext()

    @property
    def num_compilations(self) -> int:
        return self.ragged.num_compilations

    def check_kernel_faults(self) -> None:
        """Raise `KernelFaultError` where an attention backend's kernels reported a fault
        (`AttentionBackend.kernel_faults`); the runtime checks after each ``generate``."""
        backends = [b for b in (self.backend, self.verify_backend) if b is not None]
        faults = [f for i, b in enumerate(backends) if b not in backends[:i] and (f := b.kernel_faults())]
        if faults:
            raise KernelFaultError(
                f"{'; '.join(faults)}. The outputs of the call that just ended may be wrong, and so may those of "
                "every later call of this model: call attngraph.restore(model), then attngraph.accelerate(model, ...) "
                "again with fuse_attention_o=False, and report the GPU, the driver and the model."
            )

    def release(self) -> None:
        """Free the KV pool, the CUDA graphs and the backend now. Dynamo's caches keep the
        compiled callable (and its backend object) alive until `torch._dynamo.reset`, so the
        big buffers are dropped explicitly and the compiler's hook is cut."""
        self.graphs = None
        self.piecewise = None
        self.extend_graphs = None
        self.verify_graphs = None
        self.verify_backend = None
        self.multi_step = None
        if self._piecewise_state is not None:
            self._piecewise_state.release()
        self.backend = None
        self.ragged.backend.on_sites = None
        self.ragged.backend.graphs.clear()
        self.ragged.backend.sites.clear()
        for fused in self.ragged.backend.fused_linears:  # parameters of their own again; the
            fused.unshare_storage()  # compiled callable's fused weights dropped
        if self._pool is not None:
            self._pool.release()
