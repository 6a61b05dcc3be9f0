"""`flashinfer`: FlashInfer's paged attention kernels behind the AttentionBackend contract.

Written against flashinfer-python 0.6.18. Importing this module imports FlashInfer; the
registry turns an ImportError into `BackendUnavailableError` with the install command.

Metadata (once per step, shared by every layer)
-----------------------------------------------
* host (``init_forward_metadata_out_graph``): ``kv_indptr`` / ``kv_last_page_len`` (and
  ``qo_indptr`` for extend) from ``batch.*_cpu`` with `host_paged_kv_lengths`, then one
  ``plan()`` per distinct layer kind. FlashInfer's plan copies host arrays to the device and
  reads host arrays only, so it gets host tensors: no device-to-host sync anywhere.
* device (``init_forward_metadata_in_graph``): ONE Triton launch
  (`build_paged_kv_metadata`) gathers ``kv_indices`` from ``kv_pool.req_to_page``. Static
  grid, no allocation in graph mode: it is recorded into the decode CUDA graph.

A *layer kind* (`_Kind`) is everything that FlashInfer bakes into a plan: head counts, head
dims, softmax scale, causal, ``window_left``, ``logits_soft_cap``. In the 0.6.18 API all of
these go to ``plan()``; ``run()`` only accepts a ``window_left`` equal to the planned one.
Gemma-2 style models alternate sliding-window and global layers: one wrapper per kind, each
planned once per step, reused by all layers of that kind. Kinds are registered with
`set_layer_kinds` (the runner knows the lowered sites) or learned from the first eager step;
planning a new kind during CUDA-graph capture is impossible and raises `CaptureError`.

Decode
------
``BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=gqa_group >= 4)``: from
group 4 the tensor-core kernel reads the KV cache faster (`TENSOR_CORE_MIN_GROUP`);
``CompileConfig.flashinfer_decode_tensor_cores`` (the constructor's ``decode_tensor_cores``)
overrides the rule.
After `init_cuda_graph_state`, batch sizes that are captured use wrappers built with
``use_cuda_graph=True`` whose indptr / indices / last_page_len buffers are views of buffers
preallocated here (one wrapper per (batch size, kind); one int workspace per kind, shared by
the batch sizes, since only one batch size runs per step and it is re-planned right before).
The runner must hand ``init_forward_metadata_*`` the *padded* batch (``seq_lens_cpu``
included, padding requests of length ``cuda_graph_seq_len_fill_value`` on a row whose first
page is the dummy page).

Extend: chosen per step by measurement
--------------------------------------
(b) ``"paged"``: write the new K/V into the pool first, then ONE
``BatchPrefillWithPagedKVCacheWrapper`` run over each request's whole paged KV with
``causal=True``. FlashInfer aligns causal masks bottom-right (query ``i`` of a request with
``qo_len <= kv_len`` sits at position ``kv_len - qo_len + i``), so this is exactly "prefix +
causal over new tokens", and its sliding-window mask ``kv_idx >= q_pos - window_left`` is
measured in the same absolute positions. One kernel, one plan per kind, and only the
prebuilt batch-prefill module of each variant.

(a) ``"ragged_merge"``: ``BatchPrefillWithRaggedKVCacheWrapper`` over the new tokens (causal)
plus a paged prefill over the cached prefix (``causal=False``), merged by their log-sum-exp
(FlashInfer's LSE is base 2: ``o = (o_a 2^{s_a} + o_b 2^{s_b}) / (2^{s_a} + 2^{s_b})``). The merge
is done with torch ops rather than ``flashinfer.merge_state``, whose cascade module is not
among the prebuilt kernels and would JIT on a fresh machine. (a) reads the new tokens' K/V
from the contiguous ``k``/``v`` inputs instead of through the page table, which can win for
long new segments on short prefixes, at the cost of two kernels, two plans and a merge; its
prefix part sees positions shifted by the extend length, so a sliding window would need a
custom mask: window kinds always use (b).

The attention table of benchmarks/BENCHMARKS.md times both: the ragged kernel alone wins
with no cached prefix, (b) wins over a long cached prefix, where (a) runs two kernels and a
merge. So the default ``"auto"`` takes the ragged kernel for steps in
which no request has a cached prefix (no merge needed) and (b) otherwise.
``CompileConfig.flashinfer_extend`` (the constructor's ``extend_impl``: ``auto`` | ``paged`` |
``ragged_merge``) forces one design.

Determinism
-----------
``deterministic=True`` (from ``CompileConfig.deterministic``) plans every decode and paged
prefill with ``fixed_split_size`` (``DETERMINISTIC_SPLIT_TOKENS`` worth of pages), so a
request's KV is split and reduced the same way whatever else is in the batch; FlashInfer honours
a fixed split in its tensor-core kernels only, so decode uses them, and extend uses design (b).

Dense (stateless) form
----------------------
``forward_dense`` uses the ragged prefill wrapper (same prebuilt module as the paged one) with
``qo_indptr = arange(B + 1) * Sq``, ``kv_indptr = arange(B + 1) * Sk``; the plan is cached per
kind and re-done only when ``(B, Sq, Sk, dtype)`` changes. Eager only (it plans on first use).

Attention sinks
---------------
Layers with sink logits (GPT-OSS) are planned on ``BatchAttentionWithAttentionSinkWrapper``, a
variant of the paged prefill wrapper built by FlashInfer's JIT on first use (checked against
an fp32 reference on the H200: benchmarks/BENCHMARKS.md), for decode (one query per request,
its own CUDA-graph wrappers), extend (always design (b): a merge of two partial softmaxes
would count the sink twice) and the dense form (each sequence's keys as one page). ``run``
takes the ``[Hq]`` float32 sinks and the scale after the paged cache.

Fallbacks to the torch_native reference (logged once each): non-causal attention with a window
in extend/dense (FlashInfer only has a left window), sinks with a softcap (the sink variant has
none), ``v_head_dim != head_dim`` in decode, float32 inputs in the dense form.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterable

import flashinfer  # ImportError here -> BackendUnavailableError in the registry
import torch

from ..config import FLASHINFER_EXTEND
from ..errors import CaptureError, ConfigError
from ..forward_batch import ForwardBatch, ForwardMode
from .base import AttentionBackend, AttentionLayer, BackendCapabilities, GraphSupport, check_out
from .triton_ops.decode_attention import check_sinks
from .triton_ops.paged_metadata import build_paged_kv_metadata, host_paged_kv_lengths

logger = logging.getLogger(__name__)

#: Float workspace shared by every wrapper (split-KV partial outputs); FlashInfer suggests 128 MB.
WORKSPACE_BYTES = 128 * 1024 * 1024
#: Int workspace (plan info) of one wrapper: FlashInfer's own default size.
INT_WORKSPACE_BYTES = 8 * 1024 * 1024
#: Smallest GQA group whose decode uses the tensor-core (prefill-style) kernel. Measured on the
#: H200 (benchmarks/BENCHMARKS.md): at group 4, bf16, d128, 64 x 2048 tokens, the tensor-core
#: kernel reads KV at 98% of copy bandwidth against 65% for the CUDA-core decode kernel.
TENSOR_CORE_MIN_GROUP = 4
EXTEND_IMPLS = FLASHINFER_EXTEND
#: KV tokens per split when ``deterministic=True`` (converted to pages at plan time).
DETERMINISTIC_SPLIT_TOKENS = 2048


@dataclasses.dataclass(frozen=True)
class _Kind:
    """Everything FlashInfer bakes into one plan (besides the batch's lengths)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    scale: float
    causal: bool
    window_left: int
    logit_cap: float
    #: Per-head sink logits joined to the softmax: planned on FlashInfer's sink wrapper.
    sinks: bool = False

    @classmethod
    def of(cls, layer: AttentionLayer, decode: bool) -> "_Kind":
        # A decode query is the last token: "causal" changes nothing, and a two-sided window
        # equals the left window. Normalising keeps one decode plan for both.
        causal = True if decode else layer.causal
        return cls(
            layer.num_q_heads, layer.num_kv_heads, layer.head_dim, layer.v_head_dim,
            float(layer.scale), causal, int(layer.window_left), float(layer.logit_cap), layer.has_sinks,
        )

    @property
    def gqa_group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def plan_kwargs(self, dtype: torch.dtype) -> dict:
        return dict(
            window_left=self.window_left,
            logits_soft_cap=self.logit_cap if self.logit_cap > 0 else None,
            sm_scale=self.scale,
            q_data_type=dtype,
            kv_data_type=dtype,
        )


@dataclasses.dataclass
class _StepMeta:
    """One step's metadata. Host tensors end in ``_h``; device tensors have no suffix."""

    mode: ForwardMode
    bs: int
    dtype: torch.dtype
    page_size: int
    kv_indptr_h: torch.Tensor  # [bs + 1] int32
    kv_last_h: torch.Tensor  # [bs] int32
    total_pages: int
    kv_indptr: torch.Tensor  # [bs + 1] int32
    kv_indices: torch.Tensor  # [>= total_pages] int32 (filled by the Triton kernel)
    kv_last: torch.Tensor  # [bs] int32
    graph: bool = False  # decode through the CUDA-graph wrappers of this batch size
    qo_indptr_h: torch.Tensor | None = None  # [bs + 1] int32, extend only
    # design (a): the cached prefix alone, and which new tokens have one
    prefix: tuple | None = None  # (indptr_h, last_h, total, indptr, indices, last) or None
    has_prefix_tok: torch.Tensor | None = None  # [T] bool
    planned: dict = dataclasses.field(default_factory=dict)  # _Kind -> wrapper(s)
    ragged: bool = False  # extend through the ragged wrapper (design (a)) this step


@dataclasses.dataclass
class _StepBuffers:
    """Device metadata buffers reused by every piecewise / breakable step (see
    `FlashInferBackend.init_forward_metadata_for_breakable_cuda_graph_capture`)."""

    kv_indptr: torch.Tensor  # [R + 1] int32
    kv_indices: torch.Tensor  # [P] int32
    kv_last: torch.Tensor  # [R] int32

    @classmethod
    def allocate(cls, rows: int, pages: int, device: torch.device) -> "_StepBuffers":
        return cls(
            torch.zeros(rows + 1, dtype=torch.int32, device=device),
            torch.zeros(max(pages, 1), dtype=torch.int32, device=device),
            torch.ones(rows, dtype=torch.int32, device=device),
        )

    def fits(self, bs: int, total_pages: int) -> bool:
        return bs <= self.kv_last.numel() and total_pages <= self.kv_indices.numel()

    def views(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.kv_indptr[: bs + 1], self.kv_indices, self.kv_last[:bs]


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    extend_writes_out = True
    decode_writes_out = True
    use_captured_forward_metadata_for_breakable_cuda_graph = True
    capabilities = BackendCapabilities(
        device_types=("cuda",),
        dtypes=(torch.float16, torch.bfloat16),
        head_dims=(64, 128, 256),
        page_sizes=None,
        sliding_window=True,
        logit_cap=True,
        non_causal=True,  # window + non-causal falls back to torch_native (see module doc)
        dense=True,
        # Its paged decode kernels take one head dim for K and V ("auto" then picks Triton).
        distinct_v_head_dim=False,
        sinks=True,  # BatchAttentionWithAttentionSinkWrapper (a JIT-built paged prefill variant)
        alibi=False,  # its ALiBi mode uses its own slopes (no argument takes the model's) and fa2 kernels only
        chunked=False,  # its masks are causal / window only (chunks would need a virtual batch per chunk)
        graph_support={"decode": GraphSupport.FULL, "extend": GraphSupport.PIECEWISE},
    )

    def __init__(
        self,
        spec=None,
        extend_impl: str | None = None,
        decode_tensor_cores: bool | None = None,
        deterministic: bool = False,
    ) -> None:
        super().__init__(spec)
        if decode_tensor_cores is not None and not isinstance(decode_tensor_cores, bool):
            raise ConfigError(f"decode_tensor_cores must be None (tensor cores from GQA group {TENSOR_CORE_MIN_GROUP}), "
                              f"True or False, got {decode_tensor_cores!r}")  # fmt: skip
        extend_impl = extend_impl or "auto"
        if extend_impl not in EXTEND_IMPLS:
            raise ConfigError(f"extend_impl must be one of {EXTEND_IMPLS}, got {extend_impl!r}")
        if deterministic:
            if decode_tensor_cores is False:
                raise ConfigError("deterministic=True needs the tensor-core decode (fixed KV split size)")
            if extend_impl == "ragged_merge":
                raise ConfigError("deterministic=True needs the paged prefill (fixed KV split size); "
                                  "use extend_impl='auto' or 'paged'")  # fmt: skip
            decode_tensor_cores = True
            extend_impl = "paged"
        #: Batch-invariant results: every plan splits the KV at a fixed number of pages
        #: (``DETERMINISTIC_SPLIT_TOKENS``), so a request's reduction order does not depend on
        #: the rest of the batch. FlashInfer supports the fixed split in its tensor-core decode
        #: and prefill kernels only, hence tensor cores on.
        self.deterministic = bool(deterministic)
        #: None: tensor-core decode for GQA groups >= TENSOR_CORE_MIN_GROUP; True / False: always / never.
        self.decode_tensor_cores = decode_tensor_cores
        self.extend_impl = extend_impl
        self._kinds: dict[tuple[_Kind, bool], None] = {}  # (kind, decode) -> None, ordered set
        self._workspace: torch.Tensor | None = None
        self._decode: dict[_Kind, object] = {}
        self._paged: dict[_Kind, object] = {}
        self._ragged: dict[_Kind, object] = {}
        self._prefix: dict[_Kind, object] = {}
        self._dense: dict[object, tuple[object, tuple]] = {}  # kind (or (kind, "dense")) -> (wrapper, planned shape)
        self._sink: dict[tuple[_Kind, bool], object] = {}  # (kind, decode) -> sink wrapper (eager steps)
        self._meta: _StepMeta | None = None
        self._reference = None
        self._warned: set[str] = set()
        # CUDA-graph state (init_cuda_graph_state)
        self._graph_max_bs = 0
        self._g_indptr: torch.Tensor | None = None  # [max_bs + 1] int32
        self._g_last: torch.Tensor | None = None  # [max_bs] int32
        self._g_indices: torch.Tensor | None = None  # [max_bs * max_pages_per_req] int32, lazily
        self._g_int_ws: dict[_Kind, torch.Tensor] = {}
        self._g_decode: dict[int, dict[_Kind, object]] = {}  # bs -> kind -> wrapper
        self._g_qo_indptr: torch.Tensor | None = None  # [max_bs + 1] int32, sink kinds' decode graphs
        # Piecewise / breakable steps: the step buffers made at capture, refreshed in place.
        self._step_buffers: _StepBuffers | None = None

    # ------------------------------------------------------------------ kinds
    def set_layer_kinds(self, layers: Iterable[AttentionLayer]) -> None:
        """Register the model's attention layers, so that every kind is planned each step
        (needed before CUDA-graph capture; otherwise kinds are learned on first use)."""
        for layer in layers:
            self._kinds.setdefault((_Kind.of(layer, decode=True), True), None)
            self._kinds.setdefault((_Kind.of(layer, decode=False), False), None)

    def _tensor_cores(self, kind: _Kind) -> bool:
        """Whether decode of ``kind`` uses FlashInfer's tensor-core (prefill-style) kernel."""
        if self.decode_tensor_cores is not None:
            return self.decode_tensor_cores
        return kind.gqa_group >= TENSOR_CORE_MIN_GROUP

    def _split_kwargs(self, page_size: int) -> dict:
        if not self.deterministic:
            return {}
        return dict(fixed_split_size=max(1, DETERMINISTIC_SPLIT_TOKENS // page_size))

    def _workspace_on(self, device: torch.device) -> torch.Tensor:
        if self._workspace is None:
            # Zero-filled: FlashInfer's decode wants a zeroed workspace on first use.
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace

    # ------------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Preallocate the decode graphs' indptr / last_page_len buffers and the workspace.

        ``kv_indices`` (``[max_bs * max_pages_per_req]``) is sized from the KV pool, which this
        call does not see: it is allocated at the first capture, before any graph exists.
        """
        device = torch.device("cuda", torch.cuda.current_device())
        self._graph_max_bs = int(max_bs)
        self._g_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self._g_last = torch.ones(max_bs, dtype=torch.int32, device=device)
        self._g_qo_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self._workspace_on(device)

    def _graph_buffers(self, batch: ForwardBatch) -> None:
        if self._g_indptr is None:
            raise CaptureError("FlashInferBackend: call init_cuda_graph_state before capturing")
        if batch.batch_size > self._graph_max_bs:
            raise CaptureError(
                f"batch size {batch.batch_size} exceeds init_cuda_graph_state(max_bs={self._graph_max_bs})"
            )
        if self._g_indices is None:
            pool = batch.kv_pool
            self._g_indices = torch.zeros(
                self._graph_max_bs * pool.max_pages_per_req, dtype=torch.int32, device=pool.device
            )
            # Compile the metadata kernel for this page size / table outside any capture.
            build_paged_kv_metadata(
                pool.req_to_page, batch.req_pool_indices, batch.seq_lens, pool.page_size,
                self._g_indptr, self._g_indices, self._g_last,
            )

    def _graph_decode_wrapper(self, bs: int, kind: _Kind, dtype: torch.dtype):
        per_bs = self._g_decode.setdefault(bs, {})
        if kind not in per_bs:
            ws = self._workspace
            if kind.sinks:  # a prefill-style wrapper: one query per request
                w = _sink_wrapper(
                    ws, kind, dtype, use_cuda_graph=True, qo_indptr_buf=self._g_qo_indptr[: bs + 1],
                    paged_kv_indptr_buf=self._g_indptr[: bs + 1], paged_kv_indices_buf=self._g_indices,
                    paged_kv_last_page_len_buf=self._g_last[:bs],
                )
            else:
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    ws, "NHD", use_cuda_graph=True,
                    use_tensor_cores=self._tensor_cores(kind),
                    paged_kv_indptr_buffer=self._g_indptr[: bs + 1],
                    paged_kv_indices_buffer=self._g_indices,
                    paged_kv_last_page_len_buffer=self._g_last[:bs],
                )
            # One int workspace (plan info) per kind for all batch sizes: a step replays one
            # batch size and re-plans it first. Kinds need their own: all are planned per step.
            int_ws = self._g_int_ws.get(kind)
            if int_ws is None:
                int_ws = torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=ws.device)
                self._g_int_ws[kind] = int_ws
            w.reset_workspace_buffer(ws, int_ws)
            per_bs[kind] = w
        return per_bs[kind]

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata_out_graph(self, batch: ForwardBatch, in_capture: bool = False) -> None:
        mode = batch.mode
        if mode is ForwardMode.IDLE or batch.batch_size == 0:
            self._meta = None
            return
        pool = batch.kv_pool
        bs, ps, device = batch.batch_size, pool.page_size, pool.device
        self._workspace_on(device)
        indptr_h, last_h, total = host_paged_kv_lengths(batch.seq_lens_cpu, ps)
        decode = mode is ForwardMode.DECODE
        graph = decode and (in_capture or bs in self._g_decode)
        if graph:
            self._graph_buffers(batch)
            if total > self._g_indices.numel():
                raise CaptureError(f"{total} KV pages exceed the graph buffer ({self._g_indices.numel()})")
            kv_indptr, kv_indices, kv_last = self._g_indptr[: bs + 1], self._g_indices, self._g_last[:bs]
        elif self._step_buffers is not None and self._step_buffers.fits(bs, total):
            kv_indptr, kv_indices, kv_last = self._step_buffers.views(bs)
        else:
            kv_indptr = torch.empty(bs + 1, dtype=torch.int32, device=device)
            kv_indices = torch.empty(max(total, 1), dtype=torch.int32, device=device)
            kv_last = torch.empty(bs, dtype=torch.int32, device=device)
        meta = _StepMeta(mode, bs, pool.dtype, ps, indptr_h, last_h, total, kv_indptr, kv_indices, kv_last, graph)
        if not decode:
            qo_indptr_h = torch.zeros(bs + 1, dtype=torch.int32)
            torch.cumsum(batch.extend_seq_lens_cpu.to(torch.int32), 0, out=qo_indptr_h[1:])
            meta.qo_indptr_h = qo_indptr_h
            if self.extend_impl == "ragged_merge":
                meta.ragged = True
                self._init_prefix_meta(meta, batch)
            elif self.extend_impl == "auto":  # ragged only when no request has a cached prefix
                meta.ragged = not bool((batch.extend_prefix_lens_cpu > 0).any())
        self._meta = meta
        for kind, kind_decode in list(self._kinds):
            if kind_decode == decode:
                self._plan(meta, kind)

    def init_forward_metadata_for_breakable_cuda_graph_capture(self, batch: ForwardBatch) -> "_StepBuffers":
        """Step buffers for the piecewise / breakable steps: ``kv_indptr [R + 1]``,
        ``kv_last_page_len [R]`` and ``kv_indices [P]`` int32 at fixed addresses (R: the pool's
        request rows, P: its pages, at least what the capture's dummy ``batch`` needs); this
        step is planned on them. A later step too large for them gets fresh ones."""
        pool = batch.kv_pool
        _, _, total = host_paged_kv_lengths(batch.seq_lens_cpu, pool.page_size)
        buffers = _StepBuffers.allocate(max(pool.max_requests, batch.batch_size), max(pool.num_pages, total), pool.device)
        self.prepare_forward_metadata_for_breakable_cuda_graph_replay(buffers, batch)
        return buffers

    def prepare_forward_metadata_for_breakable_cuda_graph_replay(self, capture_metadata: "_StepBuffers", batch: ForwardBatch) -> None:
        """Plan ``batch`` with its device metadata written into ``capture_metadata``'s buffers."""
        self._step_buffers = capture_metadata
        try:
            self.init_forward_metadata(batch)
        finally:
            self._step_buffers = None

    def _init_prefix_meta(self, meta: _StepMeta, batch: ForwardBatch) -> None:
        """Design (a): paged metadata of the cached prefixes alone."""
        prefix_cpu = batch.extend_prefix_lens_cpu
        if not bool((prefix_cpu > 0).any()):
            return
        device = batch.kv_pool.device
        p_indptr_h, p_last_h, p_total = host_paged_kv_lengths(prefix_cpu, meta.page_size)
        meta.prefix = (
            p_indptr_h, p_last_h, p_total,
            torch.empty(meta.bs + 1, dtype=torch.int32, device=device),
            torch.empty(max(p_total, 1), dtype=torch.int32, device=device),
            torch.empty(meta.bs, dtype=torch.int32, device=device),
        )
        has = torch.repeat_interleave(prefix_cpu > 0, batch.extend_seq_lens_cpu.long())
        meta.has_prefix_tok = has.to(device, non_blocking=True)

    def init_forward_metadata_in_graph(self, batch: ForwardBatch) -> None:
        meta = self._meta
        if meta is None:
            return
        pool = batch.kv_pool
        build_paged_kv_metadata(
            pool.req_to_page, batch.req_pool_indices, batch.seq_lens, meta.page_size,
            meta.kv_indptr, meta.kv_indices, meta.kv_last,
        )
        if meta.prefix is not None:
            _, _, _, p_indptr, p_indices, p_last = meta.prefix
            build_paged_kv_metadata(
                pool.req_to_page, batch.req_pool_indices, batch.extend_prefix_lens, meta.page_size,
                p_indptr, p_indices, p_last,
            )

    # ------------------------------------------------------------------ planning
    def _plan(self, meta: _StepMeta, kind: _Kind):
        """Plan ``kind`` for this step (host work only) and remember the wrapper(s)."""
        if meta.mode is ForwardMode.DECODE:
            planned = self._plan_decode(meta, kind)
        elif meta.ragged and kind.window_left < 0 and not kind.sinks:  # a merge would count a sink twice
            planned = self._plan_ragged_merge(meta, kind)
        else:
            planned = self._plan_paged_prefill(meta, kind)
        meta.planned[kind] = planned
        return planned

    def _plan_decode(self, meta: _StepMeta, kind: _Kind):
        if kind.sinks:
            w = self._graph_decode_wrapper(meta.bs, kind, meta.dtype) if meta.graph else self._sink_for(kind, True, meta.dtype)
            qo_indptr_h = torch.arange(meta.bs + 1, dtype=torch.int32)  # one query per request
            self._paged_prefill_plan(
                w, meta, kind, meta.kv_indptr_h, meta.kv_indices[: meta.total_pages], meta.kv_last_h, True, qo_indptr_h
            )
            return w
        if meta.graph:
            w = self._graph_decode_wrapper(meta.bs, kind, meta.dtype)
        else:
            w = self._decode.get(kind)
            if w is None:
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "NHD", use_tensor_cores=self._tensor_cores(kind)
                )
                self._decode[kind] = w
        w.plan(
            meta.kv_indptr_h, meta.kv_indices[: meta.total_pages], meta.kv_last_h,
            kind.num_q_heads, kind.num_kv_heads, kind.head_dim, meta.page_size,
            non_blocking=True, **kind.plan_kwargs(meta.dtype), **self._split_kwargs(meta.page_size),
        )
        return w

    def _paged_prefill_plan(self, w, meta, kind, indptr_h, indices, last_h, causal, qo_indptr_h=None) -> None:
        w.plan(
            meta.qo_indptr_h if qo_indptr_h is None else qo_indptr_h, indptr_h, indices, last_h,
            kind.num_q_heads, kind.num_kv_heads, kind.head_dim, meta.page_size,
            head_dim_vo=kind.v_head_dim, causal=causal, non_blocking=True,
            **kind.plan_kwargs(meta.dtype), **self._split_kwargs(meta.page_size),
        )

    def _sink_for(self, kind: _Kind, decode: bool, dtype: torch.dtype):
        w = self._sink.get((kind, decode))
        if w is None:
            w = self._sink[(kind, decode)] = _sink_wrapper(self._workspace, kind, dtype)
        return w

    def _plan_paged_prefill(self, meta: _StepMeta, kind: _Kind):
        if kind.sinks:
            w = self._sink_for(kind, False, meta.dtype)
            self._paged_prefill_plan(
                w, meta, kind, meta.kv_indptr_h, meta.kv_indices[: meta.total_pages], meta.kv_last_h, kind.causal
            )
            return w
        w = self._paged.get(kind)
        if w is None:
            w = self._paged[kind] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._paged_prefill_plan(
            w, meta, kind, meta.kv_indptr_h, meta.kv_indices[: meta.total_pages], meta.kv_last_h, kind.causal
        )
        return w

    def _plan_ragged_merge(self, meta: _StepMeta, kind: _Kind):
        rw = self._ragged.get(kind)
        if rw is None:
            rw = self._ragged[kind] = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self._workspace, "NHD")
        # New tokens attend to new tokens: kv_indptr == qo_indptr, causal bottom-right.
        rw.plan(
            meta.qo_indptr_h, meta.qo_indptr_h, kind.num_q_heads, kind.num_kv_heads, kind.head_dim,
            head_dim_vo=kind.v_head_dim, causal=kind.causal, non_blocking=True,
            **kind.plan_kwargs(meta.dtype),
        )
        if meta.prefix is None:
            return rw, None
        pw = self._prefix.get(kind)
        if pw is None:
            pw = self._prefix[kind] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        p_indptr_h, p_last_h, p_total, _, p_indices, _ = meta.prefix
        # Every cached token precedes every new one: no mask on the prefix part.
        self._paged_prefill_plan(pw, meta, kind, p_indptr_h, p_indices[:p_total], p_last_h, causal=False)
        return rw, pw

    def _planned(self, kind: _Kind, decode: bool):
        meta = self._meta
        if meta is None:
            raise RuntimeError("FlashInferBackend.forward called before init_forward_metadata")
        planned = meta.planned.get(kind)
        if planned is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise CaptureError(
                    f"attention layer kind {kind} was not planned before CUDA-graph capture; call "
                    "FlashInferBackend.set_layer_kinds(layers) or run one eager step before capturing"
                )
            logger.debug("flashinfer: planning new layer kind %s (decode=%s)", kind, decode)
            self._kinds.setdefault((kind, decode), None)
            planned = self._plan(meta, kind)
        return planned

    # ------------------------------------------------------------------ compute
    def _ref(self):
        if self._reference is None:
            from .torch_native import TorchNativeBackend

            self._reference = TorchNativeBackend(self.spec)
        return self._reference

    def _warn_once(self, what: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("flashinfer backend: %s; using the torch_native reference for it", what)

    def forward_decode(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch, save_kv_cache: bool = True, out=None):
        sink_args = _sink_args(layer, q)  # checked before anything is written
        check_out(out, q, layer)
        if save_kv_cache:
            self.save_kv(layer, batch, k, v)
        if layer.v_head_dim != layer.head_dim:
            self._warn_once("decode with v_head_dim != head_dim")
            return _result(self._ref().forward_decode(q, k, v, layer, batch, save_kv_cache=False), out, q.dtype)
        if layer.has_sinks and layer.logit_cap > 0:
            self._warn_once("attention sinks with a softcap")
            return _result(self._ref().forward_decode(q, k, v, layer, batch, save_kv_cache=False), out, q.dtype)
        pool = batch.kv_pool
        w = self._planned(_Kind.of(layer, decode=True), decode=True)
        kv = (pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id])  # NHD pages
        given = out
        if out is None or out.dtype != pool.dtype or not out.is_contiguous():
            out = q.new_empty((q.shape[0], layer.num_q_heads, layer.v_head_dim), dtype=pool.dtype)
        w.run(q.to(pool.dtype).contiguous(), kv, *sink_args, out=out)  # [B, Hq, D]
        return _result(out, given, q.dtype)

    def forward_extend(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch, save_kv_cache: bool = True, out=None):
        sink_args = _sink_args(layer, q)  # checked before anything is written
        if save_kv_cache:
            self.save_kv(layer, batch, k, v)  # (b) reads the new tokens back from the pool
        if (not layer.causal and layer.window_left >= 0) or (layer.has_sinks and layer.logit_cap > 0):
            self._warn_once("non-causal attention with a sliding window, or sinks with a softcap")
            return self._ref().forward_extend(q, k, v, layer, batch, save_kv_cache=False)
        pool = batch.kv_pool
        dtype = pool.dtype
        planned = self._planned(_Kind.of(layer, decode=False), decode=False)
        qc = q.to(dtype).contiguous()
        given = out
        if out is None or out.dtype != dtype or not out.is_contiguous():
            out = qc.new_empty((q.shape[0], layer.num_q_heads, layer.v_head_dim))
        if not isinstance(planned, tuple):  # design (b)
            kv = (pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id])
            planned.run(qc, kv, *sink_args, out=out)
            return _result(out, given, q.dtype)
        ragged, prefix = planned  # design (a)
        kc, vc = k.to(dtype).contiguous(), v.to(dtype).contiguous()
        if prefix is None:
            ragged.run(qc, kc, vc, out=out)
            return _result(out, given, q.dtype)
        o_new, s_new = ragged.run(qc, kc, vc, return_lse=True)  # [T, Hq, Dv], [T, Hq] log2
        kv = (pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id])
        o_pre, s_pre = prefix.run(qc, kv, return_lse=True)
        merged = merge_states_log2(o_new, s_new, o_pre, s_pre)
        # Requests without a prefix: their prefix part is empty; keep the ragged result.
        out = torch.where(self._meta.has_prefix_tok[:, None, None], merged, o_new)
        return _result(out, given, q.dtype)

    def forward_dense(self, q, k, v, layer: AttentionLayer, batch_size: int) -> torch.Tensor:
        if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
            self._warn_once(f"dense attention in {q.dtype} on {q.device.type}")
            return self._ref().forward_dense(q, k, v, layer, batch_size)
        if (not layer.causal and layer.window_left >= 0) or (layer.has_sinks and layer.logit_cap > 0):
            self._warn_once("non-causal attention with a sliding window, or sinks with a softcap")
            return self._ref().forward_dense(q, k, v, layer, batch_size)
        b = int(batch_size)
        sq, sk = q.shape[0] // b, k.shape[0] // b
        kind = _Kind.of(layer, decode=False)
        shape = (b, sq, sk, q.dtype)
        if kind.sinks:
            return self._dense_with_sinks(q, k, v, layer, kind, shape)
        w, planned_shape = self._dense.get(kind, (None, None))
        if w is None:
            w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self._workspace_on(q.device), "NHD")
        if planned_shape != shape:
            qo_indptr = torch.arange(b + 1, dtype=torch.int32) * sq  # host: plan reads host arrays
            kv_indptr = torch.arange(b + 1, dtype=torch.int32) * sk
            w.plan(
                qo_indptr, kv_indptr, kind.num_q_heads, kind.num_kv_heads, kind.head_dim,
                head_dim_vo=kind.v_head_dim, causal=kind.causal, non_blocking=True,
                **kind.plan_kwargs(q.dtype),
            )
            self._dense[kind] = (w, shape)
        return w.run(q.contiguous(), k.to(q.dtype).contiguous(), v.to(q.dtype).contiguous())

    def _dense_with_sinks(self, q, k, v, layer: AttentionLayer, kind: _Kind, shape: tuple) -> torch.Tensor:
        """The dense form through the (paged) sink wrapper: each sequence's ``Sk`` keys are one
        page of ``Sk`` slots (``[B, Sk, Hkv, D]`` is that paged cache, no copy)."""
        b, sq, sk, dtype = shape
        key = (kind, "dense")
        w, planned_shape = self._dense.get(key, (None, None))
        if w is None:
            w = _sink_wrapper(self._workspace_on(q.device), kind, dtype)
        if planned_shape != shape:
            one = torch.arange(b + 1, dtype=torch.int32)
            w.plan(
                one * sq, one, torch.arange(b, dtype=torch.int32, device=q.device), torch.full((b,), sk, dtype=torch.int32),
                kind.num_q_heads, kind.num_kv_heads, kind.head_dim, sk, head_dim_vo=kind.v_head_dim,
                causal=kind.causal, non_blocking=True, **kind.plan_kwargs(dtype),
            )  # fmt: skip
            self._dense[key] = (w, shape)
        kv = (k.to(dtype).contiguous().view(b, sk, kind.num_kv_heads, kind.head_dim),
              v.to(dtype).contiguous().view(b, sk, kind.num_kv_heads, kind.v_head_dim))  # fmt: skip
        return w.run(q.contiguous(), kv, *_sink_args(layer, q))


def _sink_wrapper(workspace: torch.Tensor, kind: _Kind, dtype: torch.dtype, **graph_buffers):
    """FlashInfer's attention-sink variant of the paged prefill wrapper for ``kind`` (its
    kernel is built on first use: about 20-90 s, then cached by FlashInfer)."""
    return flashinfer.BatchAttentionWithAttentionSinkWrapper(
        workspace, "NHD", q_data_type=dtype, kv_data_type=dtype, head_dim_qk=kind.head_dim,
        head_dim_vo=kind.v_head_dim, window_left=kind.window_left, **graph_buffers,
    )


def _sink_args(layer: AttentionLayer, q: torch.Tensor) -> tuple:
    """The sink variant's extra ``run`` arguments: the ``[Hq]`` float32 sink logits (on ``q``'s
    device, else `InputError`) and the softmax scale; none for other layers."""
    if not layer.has_sinks:
        return ()
    if layer.sinks is None:
        raise ValueError(f"layer {layer.layer_id} was compiled with attention sinks but got none")
    sinks = check_sinks(layer.sinks, layer.num_q_heads, q)  # InputError: not [Hq] on q's device
    return sinks.float().contiguous(), float(layer.scale)


def _result(out: torch.Tensor, given: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's ``out`` in ``dtype``, copied into the caller's ``given`` buffer unless it
    already is that buffer."""
    if given is None:
        return out.to(dtype)
    if out is not given:
        given.copy_(out)
    return given


def merge_states_log2(o_a: torch.Tensor, s_a: torch.Tensor, o_b: torch.Tensor, s_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from the partial results.

    ``o_*: [T, H, Dv]`` normalised outputs, ``s_*: [T, H]`` float32 log2-sum-exp of the scaled
    scores (FlashInfer's convention). Returns ``[T, H, Dv]`` in ``o_a``'s dtype.
    """
    m = torch.maximum(s_a, s_b)
    w_a = torch.exp2(s_a - m)[..., None]  # [T, H, 1]
    w_b = torch.exp2(s_b - m)[..., None]
    out = (o_a.float() * w_a + o_b.float() * w_b) / (w_a + w_b)
    return out.to(o_a.dtype)
