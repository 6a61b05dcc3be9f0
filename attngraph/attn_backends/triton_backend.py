"""`triton`: paged attention with Triton kernels (split-KV decode, one-pass extend).

* DECODE: `decode_attention_fwd`, stage 1 over ``(request, KV head, split)`` with all query
  heads of a GQA group in one program, stage 2 merging the splits. The split count of each
  request is decided on the device from its length, so the whole decode step can be captured
  in a CUDA graph (`GraphSupport.FULL`); the only host-side choice is ``max_splits``, a
  function of the (padded, static) batch size. With ``fused_decode`` (the default; not over
  MLA's latent pool) a layer's decode is one launch: the kernel stores the new K/V itself and
  merges the splits in the same launch (per-tile counters owned by the backend, zero between
  launches).
* EXTEND / MIXED: the new K/V are appended to the pool first, then `extend_attention_fwd`
  runs one online softmax over each request's keys ``0..seq_len-1`` read back from the pool.
  Its grid follows the longest new-token run; in a captured extend graph it follows the
  graph's token count instead (``ForwardBatch.static_max_extend_len``: ``N // BLOCK_M + B``
  programs per head, each finding its request by binary search), so whole prefill steps are
  captured too (`GraphSupport.FULL`).
* Dense (stateless) form: `dense_attention_fwd`, the extend kernel over contiguous K/V.

Devices: CUDA; and the CPU in Triton's interpreter when ``TRITON_INTERPRET=1`` was set before
attngraph was imported (Triton decides when a ``@triton.jit`` function is defined). Then the
capabilities declare ``("cuda", "cpu")`` and ``accelerate(model, attention_backend="triton")``
serves CPU tensors (slowly: it is for stepping through the kernels; decode's split axis stops
at the batch's longest request, `TritonBackend._launch_splits`); ``"auto"`` still picks
torch_native on CPU. Without the variable a CPU model is refused with a message naming it.

Example
-------
>>> backend = TritonBackend(spec, deterministic=True)   # doctest: +SKIP
>>> backend.init_forward_metadata(batch)                 # doctest: +SKIP
>>> out = backend.forward(q, k, v, layer, batch)         # doctest: +SKIP
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch

from ..errors import BackendUnavailableError, InputError
from .base import AttentionBackend, AttentionLayer, BackendCapabilities, GraphSupport, ModelAttentionSpec, check_out
from .triton_ops import (
    DEFAULT_MIN_SPLIT_LEN,
    decode_attention_fwd,
    dense_attention_fwd,
    extend_attention_fwd,
    interpreter_problem,
    interpreting,
    slopes_tensor,
)

if TYPE_CHECKING:
    from ..forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

#: Head dims served: any multiple of 8 up to 256 (decode splits a dim that is no power of two
#: into a power of two plus a tail block, extend pads it and masks), and multi-head latent
#: attention's latent form: keys of 576 (latent 512 + RoPE 64) with values of 512.
SUPPORTED_HEAD_DIMS = tuple(range(8, 257, 8)) + (512, 576)
#: Upper bound on decode splits per request (and the deterministic mode's fixed bound).
DEFAULT_MAX_KV_SPLITS = 32
#: Stage-1 programs aimed for per SM when choosing ``max_splits`` for a batch (measured on an
#: H200: bf16, 32/8 heads, head dim 128 -- about 1.5 TB/s at batch 1 x 4096 keys, 4.3 TB/s at
#: batch 64 x 4096 keys, CUDA-graph timings).
_PROGRAMS_PER_SM = 4


#: How to run the kernels without a GPU (named in every "needs CUDA" refusal).
INTERPRETER_HINT = (
    "to run the Triton kernels on the CPU, set TRITON_INTERPRET=1 before importing attngraph "
    "(Triton's interpreter: slow, for stepping through the kernels); otherwise use "
    "attention_backend='torch_native'"
)
_INTERPRETER_PROBLEM = interpreter_problem() if interpreting() else None
if _INTERPRETER_PROBLEM is not None:
    INTERPRETER_HINT = f"TRITON_INTERPRET=1 is set, but {_INTERPRETER_PROBLEM}; or use attention_backend='torch_native'"


def _slopes(layer: AttentionLayer, like: torch.Tensor) -> torch.Tensor | None:
    """The layer's ALiBi slopes as the kernels' fp32 ``[Hq]`` tensor (made once per device)."""
    return None if layer.alibi_slopes is None else slopes_tensor(layer.alibi_slopes, like.device)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class TritonBackend(AttentionBackend):
    """Paged attention through the Triton kernels of `triton_ops`.

    Parameters
    ----------
    spec:
        The model's `ModelAttentionSpec` (needed only by `init_cuda_graph_state`).
    deterministic:
        Fix decode's ``max_splits`` to ``max_kv_splits`` whatever the batch size, so a
        request's result depends on that request alone (its split count then follows only
        its own length) and repeated runs are bit-identical. Otherwise ``max_splits`` grows
        for small batches to fill the GPU.
    max_kv_splits:
        Upper bound on decode splits per request.
    min_split_len:
        Shortest decode split in keys; shorter requests use fewer splits.
    fused_decode:
        One launch per decode layer: the new K/V are stored by the attention kernel (when they
        have the pool's dtype) and the splits are merged in the same launch. False, and always
        over MLA's latent pool (``value_in_key``): K/V store, stage 1 and stage 2 as three
        launches. The results are the same.
    """

    name = "triton"
    decode_writes_out = True
    capabilities = BackendCapabilities(
        # Under the interpreter the kernels take CPU tensors; "auto" never picks it there.
        device_types=("cuda", "cpu") if interpreting() and _INTERPRETER_PROBLEM is None else ("cuda",),
        device_hint=INTERPRETER_HINT,
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        head_dims=SUPPORTED_HEAD_DIMS,
        page_sizes=None,
        graph_support={"decode": GraphSupport.FULL, "extend": GraphSupport.FULL},
        decode_metadata_on_device=True,  # the kernels read seq_lens and the page table directly
    )

    #: `forward_decode_o`'s launch: at most this many splits per KV head (None: as the decode
    #: kernel's `decode_max_splits`; fewer attention programs leave more of the launch's
    #: register budget to the projection's), and the weight rows per projection program.
    fused_o_max_splits: int | None = None
    fused_o_block_o: int = 4

    def __init__(
        self,
        spec: ModelAttentionSpec | None = None,
        *,
        deterministic: bool = False,
        max_kv_splits: int = DEFAULT_MAX_KV_SPLITS,
        min_split_len: int = DEFAULT_MIN_SPLIT_LEN,
        fused_decode: bool = True,
    ) -> None:
        super().__init__(spec)
        if max_kv_splits < 1 or min_split_len < 1:
            raise ValueError(f"max_kv_splits and min_split_len must be >= 1, got {max_kv_splits}, {min_split_len}")
        if interpreting():
            logger.info("triton attention backend: kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1)")
        self.deterministic = deterministic
        self.max_kv_splits = int(max_kv_splits)
        self.min_split_len = int(min_split_len)
        self.fused_decode = bool(fused_decode)
        self._sm_counts: dict[torch.device, int] = {}
        # CUDA-graph scratch of decode (flat fp32, viewed per batch size), see init_cuda_graph_state.
        self._graph_part_o: torch.Tensor | None = None
        self._graph_part_lse: torch.Tensor | None = None
        # Merge counters of fused decode (int32, zero between launches: each launch resets the
        # ones it uses); the CUDA-graph one is never replaced, the eager ones grow on demand.
        self._graph_counters: torch.Tensor | None = None
        self._eager_counters: dict[torch.device, torch.Tensor] = {}
        # decode_attention_o's counters, SYNC_SLOTS int32 per layer (zero between launches)
        self._graph_o_sync: torch.Tensor | None = None
        self._eager_o_sync: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._o_sync_handed_out = False  # a fused attention + projection launch took counters
        # Per-step state from init_forward_metadata_out_graph.
        self._step_batch: "ForwardBatch | None" = None
        self._step_max_extend_len = 0
        self._step_partials: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        # set_decode_prefetch: layer -> (tensor, bytes) asked into L2 before its decode attention
        self._prefetch_source: "Callable[[int], tuple[torch.Tensor, int] | None] | None" = None
        self._prefetch_ranges: dict[int, tuple[torch.Tensor, int] | None] = {}
        # set_decode_l2_next: layer -> (tensor, bytes) its decode kernel asks into L2 past its wait
        self._l2_next_source: "Callable[[int], tuple[torch.Tensor, int] | None] | None" = None
        self._l2_next_ranges: dict[int, tuple[torch.Tensor, int] | None] = {}

    # ------------------------------------------------------------------ planning
    def _sm_count(self, device: torch.device) -> int:
        if device not in self._sm_counts:
            if device.type == "cuda":
                self._sm_counts[device] = torch.cuda.get_device_properties(device).multi_processor_count
            else:
                self._sm_counts[device] = 4  # interpreter: any small number
        return self._sm_counts[device]

    def decode_max_splits(self, batch_size: int, num_kv_heads: int, device: torch.device) -> int:
        """Grid size along the split axis for a decode batch (static per batch size)."""
        if self.deterministic:
            return self.max_kv_splits
        target = _PROGRAMS_PER_SM * self._sm_count(device)
        per_split = max(1, batch_size * num_kv_heads)
        return max(1, min(self.max_kv_splits, -(-target // per_split)))

    def _launch_splits(self, splits: int, seq_lens: torch.Tensor, device: torch.device) -> int:
        """The split axis of a launch: ``splits`` on CUDA (static per batch size, as a captured
        graph needs). Over CPU tensors it is cut to the most splits a request of the batch uses,
        ``cdiv(max(seq_lens), min_split_len)``: the interpreter runs every program in turn, those
        past a request's last split included. A request's own split count, ``clamp(cdiv(span,
        min_split_len), 1, splits)`` with ``span <= seq_len``, and so its result stay the same."""
        if device.type != "cpu" or seq_lens.numel() == 0:
            return splits
        longest = int(seq_lens.max())  # a CPU tensor here: no device sync
        return max(1, min(splits, -(-longest // self.min_split_len)))

    def init_forward_metadata_out_graph(self, batch: "ForwardBatch", in_capture: bool = False) -> None:
        """Host side: remember the longest new-token run (extend's grid) from the host copy,
        or the captured graph's fixed bound."""
        self._step_batch = batch
        self._step_max_extend_len = batch.static_max_extend_len or batch.max_extend_len
        self._step_partials.clear()

    def init_forward_metadata_in_graph(self, batch: "ForwardBatch") -> None:
        """Nothing to refresh: the kernels read ``seq_lens``, ``req_pool_indices`` and the page
        table straight from the batch's device tensors."""

    use_captured_forward_metadata_for_breakable_cuda_graph = True

    def init_forward_metadata_for_breakable_cuda_graph_capture(self, batch: "ForwardBatch") -> "TritonBackend":
        """Nothing to allocate: the kernels read the batch's own device tensors, and the one
        host value (the longest new-token run) is refreshed per step."""
        self.init_forward_metadata(batch)
        return self

    def prepare_forward_metadata_for_breakable_cuda_graph_replay(self, capture_metadata, batch: "ForwardBatch") -> None:
        self.init_forward_metadata(batch)

    def set_layer_kinds(self, layers) -> None:
        """Make the ALiBi slopes' device tensors now, before any CUDA graph is captured."""
        if self.spec is not None and self.spec.device_type == "cuda" and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
            for layer in layers:
                if layer.alibi_slopes is not None:
                    slopes_tensor(layer.alibi_slopes, device)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate decode's split buffers once for every batch size up to ``max_bs``.

        ``partial_out`` holds ``max_b(b * max_splits(b)) * Hq * Dv`` fp32 values and
        ``partial_lse`` the same without ``Dv``; each step views their heads as
        ``[B, Hq, max_splits(B), Dv]`` / ``[B, Hq, max_splits(B)]``. The fused decode's merge
        counters: ``max_bs * Hq`` int32 zeros, made once (the kernel leaves them zero).
        """
        if self.spec is None:
            raise ValueError("TritonBackend.init_cuda_graph_state needs the ModelAttentionSpec; pass spec= to the constructor")
        spec = self.spec
        device = torch.device(spec.device_type)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        rows = max(b * self.decode_max_splits(b, spec.num_kv_heads, device) for b in range(1, max(1, max_bs) + 1))
        dv = max(spec.head_dims)
        self._graph_part_o = torch.empty(rows * spec.num_q_heads * dv, dtype=torch.float32, device=device)
        self._graph_part_lse = torch.empty(rows * spec.num_q_heads, dtype=torch.float32, device=device)
        if self.fused_decode:
            self._graph_counters = torch.zeros(max(1, max_bs) * spec.num_q_heads, dtype=torch.int32, device=device)
            from .triton_ops.decode_attention_o import SYNC_SLOTS

            self._graph_o_sync = torch.zeros(spec.num_layers * SYNC_SLOTS, dtype=torch.int32, device=device)
        logger.debug(
            "triton backend: decode split buffers for max_bs=%d: %d (request, split) rows, %.1f MiB",
            max_bs, rows, self._graph_part_o.numel() * 4 / 2**20,
        )  # fmt: skip

    def _partials(self, bsz: int, hq: int, splits: int, dv: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch ``[B, Hq, splits, Dv]`` and ``[B, Hq, splits]`` fp32 for one decode launch."""
        n_o, n_l = bsz * hq * splits * dv, bsz * hq * splits
        go, gl = self._graph_part_o, self._graph_part_lse
        if go is not None and go.device == device and go.numel() >= n_o and gl.numel() >= n_l:
            return go[:n_o].view(bsz, hq, splits, dv), gl[:n_l].view(bsz, hq, splits)
        key = (bsz, hq, splits, dv, device)
        if key not in self._step_partials:  # shared by the layers of one step
            self._step_partials[key] = (
                torch.empty((bsz, hq, splits, dv), dtype=torch.float32, device=device),
                torch.empty((bsz, hq, splits), dtype=torch.float32, device=device),
            )
        return self._step_partials[key]

    def _counters(self, n: int, device: torch.device) -> torch.Tensor:
        """``[n]`` int32 merge counters, all zero, for one fused decode launch: the CUDA-graph
        buffer where it is large enough, else a persistent eager one (zeroed once, when made)."""
        go = self._graph_counters
        if go is not None and go.device == device and go.numel() >= n:
            return go[:n]
        eager = self._eager_counters.get(device)
        if eager is None or eager.numel() < n:
            eager = self._eager_counters[device] = torch.zeros(n, dtype=torch.int32, device=device)
        return eager[:n]

    @staticmethod
    def _check_device(t: torch.Tensor) -> None:
        if t.device.type != "cuda" and not interpreting():
            raise BackendUnavailableError(
                f"the triton attention backend runs on CUDA; got a {t.device.type} tensor: {INTERPRETER_HINT}"
            )

    # ------------------------------------------------------------------ compute
    def _stores_new_kv(self, k, v, batch: "ForwardBatch") -> bool:
        """Whether the decode kernel stores the new K/V itself. Not over MLA's latent pool: the
        kernel does not write a pool whose values are its keys, and one program merging a tile
        of up to 64 heads x 512 values per split (32 splits: 4 MiB of partials) would serialise
        what stage 2 spreads over every query head."""
        pool = batch.kv_pool
        return self.fused_decode and not pool.value_in_key and k.dtype == pool.dtype and v.dtype == pool.dtype

    def folds_rope(self, q, k, layer: AttentionLayer, batch: "ForwardBatch") -> bool:
        """Decode steps whose kernel stores the new K/V (it rotates q and the new key as it
        loads them), with a power-of-two head dim, on CUDA or the interpreter."""
        from ..forward_batch import ForwardMode

        d = q.shape[-1]
        pool = batch.kv_pool
        return (batch.mode is ForwardMode.DECODE and d > 0 and not d & (d - 1) and pool is not None
                and (q.is_cuda or interpreting()) and self._stores_new_kv(k, k, batch))  # fmt: skip

    def forward_decode(self, q, k, v, layer: AttentionLayer, batch: "ForwardBatch", save_kv_cache: bool = True,
                       out: torch.Tensor | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
        """``q: [B, Hq, D]`` (one new token per request) -> ``[B, Hq, Dv]``, written to ``out``
        (contiguous ``[B, Hq, Dv]``) when given; ``k: [B, Hkv, D]``, ``v: [B, Hkv, Dv]`` are
        stored at ``batch.out_cache_loc`` with ``save_kv_cache``. ``rope``: ``(cos, sin)``
        ``[B, D]`` rows of HF's rotary embedding the kernel applies to q and k (`folds_rope`)."""
        self._check_device(q)
        check_out(out, q, layer)  # before the pool is written
        pool = batch.kv_pool
        bsz = q.shape[0]
        fused = self.fused_decode and not pool.value_in_key
        new_kv = {}
        if rope is not None and not (save_kv_cache and self.folds_rope(q, k, layer, batch) and self._stores_new_kv(k, v, batch)):
            raise InputError("triton decode: rotary rows reach the kernel only where folds_rope holds and it stores the new K/V")
        if save_kv_cache:
            if self._stores_new_kv(k, v, batch):
                # stored by the attention kernel: no store kernel of its own
                new_kv = dict(k_new=_last_dim_contiguous(k), v_new=_last_dim_contiguous(v), new_loc=batch.out_cache_loc)
                if rope is not None:
                    new_kv.update(rope_cos=_last_dim_contiguous(rope[0]), rope_sin=_last_dim_contiguous(rope[1]))
            else:
                self.save_kv(layer, batch, k, v)
        kb = pool.k_buffers[layer.layer_id].view(-1, pool.num_kv_heads, pool.head_dim)
        vb = pool.v_buffers[layer.layer_id].view(-1, pool.num_kv_heads, pool.v_head_dim)
        if out is None:
            out = q.new_empty((bsz, layer.num_q_heads, pool.v_head_dim))
        self._prefetch_for_decode(layer.layer_id, q.device)
        splits = self._launch_splits(self.decode_max_splits(bsz, pool.num_kv_heads, q.device), batch.seq_lens, q.device)
        part_o, part_lse = self._partials(bsz, layer.num_q_heads, splits, pool.v_head_dim, q.device)
        # A decode query is the last key, so causal and non-causal see the same keys.
        return decode_attention_fwd(
            _last_dim_contiguous(q), kb, vb, out, pool.req_to_page, batch.req_pool_indices, batch.seq_lens,
            part_o, part_lse, page_size=pool.page_size, scale=layer.scale, max_splits=splits,
            min_split_len=self.min_split_len, logit_cap=layer.logit_cap, window_left=layer.window_left,
            sinks=layer.sinks, chunk_size=layer.chunk_size, alibi_slopes=_slopes(layer, q),
            counters=self._counters(bsz * layer.num_q_heads, q.device) if fused else None,
            l2_next=self._l2_next_for(layer.layer_id), **new_kv,
        )  # fmt: skip

    def forward_decode_o(self, q, k, v, layer: AttentionLayer, batch: "ForwardBatch", weight: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor | None:  # fmt: skip
        """One request's decode attention and the output projection after it in one launch
        (`decode_attention_o_fwd`), or None where that kernel does not serve the step (the
        caller then runs the attention op and the projection).

        ``q: [T, Hq, D]``, ``k: [T, Hkv, D]``, ``v: [T, Hkv, Dv]`` with ``T >= 1`` rows, of
        which the batch's one token is the first (the others pad a captured graph);
        ``weight: [N, Hq * Dv]``, ``bias: [N]`` or None -> ``[T, N]`` with row 0 written
        (the padding rows are left unwritten, as the two ops leave them). Served: a DECODE
        batch of one request whose new K/V the kernel stores (`_stores_new_kv`), heads of a
        power-of-two dim with ``Dv == D``, a GQA group in one head block, no logit cap, sinks,
        chunks or ALiBi (a sliding window is honoured), ``Hq * D`` a power of two of at most
        `triton_ops.decode_attention_o.MAX_ROW`, a contiguous weight of q's dtype, on CUDA
        (or the interpreter)."""
        from ..forward_batch import ForwardMode
        from .triton_ops.decode_attention import decode_block_h
        from .triton_ops.decode_attention_o import MAX_ROW, decode_attention_o_fwd

        pool = batch.kv_pool
        d, hq, hkv = q.shape[-1], q.shape[1], k.shape[1]
        kw = hq * d
        if not (batch.mode is ForwardMode.DECODE and batch.num_tokens == 1 and batch.req_pool_indices.numel() == 1
                and (q.is_cuda or interpreting()) and self._stores_new_kv(k, v, batch)):  # fmt: skip
            return None
        if (d & (d - 1) or v.shape[-1] != d or pool.v_head_dim != d or hq % hkv or hq // hkv > decode_block_h(hq // hkv, d, d, q.dtype)
                or layer.logit_cap or layer.sinks is not None or layer.chunk_size or layer.alibi_slopes is not None
                or kw & (kw - 1) or kw > MAX_ROW):  # fmt: skip
            return None
        if (weight.dim() != 2 or tuple(weight.shape[1:]) != (kw,) or not weight.is_contiguous() or weight.dtype != q.dtype
                or weight.device != q.device or (bias is not None and (not bias.is_contiguous() or bias.dtype != q.dtype))):  # fmt: skip
            return None
        kb = pool.k_buffers[layer.layer_id].view(-1, pool.num_kv_heads, pool.head_dim)
        vb = pool.v_buffers[layer.layer_id].view(-1, pool.num_kv_heads, pool.v_head_dim)
        splits = self.decode_max_splits(1, hkv, q.device)
        if self.fused_o_max_splits is not None:
            splits = max(1, min(splits, self.fused_o_max_splits))
        splits = self._launch_splits(splits, batch.seq_lens, q.device)
        part_o, part_lse = self._partials(1, hq, splits, d, q.device)
        y = q.new_empty((q.shape[0], weight.shape[0]))
        decode_attention_o_fwd(
            _last_dim_contiguous(q[:1]), kb, vb, pool.req_to_page, batch.req_pool_indices, batch.seq_lens, part_o,
            part_lse, page_size=pool.page_size, scale=layer.scale, max_splits=splits, k_new=_last_dim_contiguous(k[:1]),
            v_new=_last_dim_contiguous(v[:1]), new_loc=batch.out_cache_loc[:1],
            counters=self._counters(hq, q.device), weight=weight, sync=self._o_sync(layer.layer_id, q.device),
            bias=bias, out=y[:1], min_split_len=self.min_split_len, window_left=layer.window_left,
            block_o=self.fused_o_block_o,
        )  # fmt: skip
        return y

    def _o_sync(self, layer_id: int, device: torch.device) -> torch.Tensor:
        """`decode_attention_o`'s counters of one layer (`SYNC_SLOTS` int32, zero between
        launches): a slice of the buffer made in `init_cuda_graph_state`, else a layer's own
        eager one, made once and kept (a captured launch may hold its address)."""
        from .triton_ops.decode_attention_o import SYNC_SLOTS, new_sync

        self._o_sync_handed_out = True
        lo, hi = layer_id * SYNC_SLOTS, (layer_id + 1) * SYNC_SLOTS
        buf = self._graph_o_sync
        if buf is not None and buf.device == device and buf.numel() >= hi:
            return buf[lo:hi]
        key = (layer_id, device)
        if key not in self._eager_o_sync:
            self._eager_o_sync[key] = new_sync(device)
        return self._eager_o_sync[key]

    def kernel_faults(self) -> str | None:
        """Projection programs of `decode_attention_o` that stopped waiting for their attention
        (``sync[3]`` of every layer's counters; they are never reset): their outputs, and the
        logits after them, are wrong. None, without reading the device, where the fused kernel
        never ran."""
        from .triton_ops.decode_attention_o import SYNC_SLOTS

        if not self._o_sync_handed_out:
            return None
        syncs = ([self._graph_o_sync] if self._graph_o_sync is not None else []) + list(self._eager_o_sync.values())
        gave_up = sum(int(s.view(-1, SYNC_SLOTS)[:, 3].sum()) for s in syncs)  # a device read: syncs the stream
        if not gave_up:
            return None
        return (f"decode_attention_o: {gave_up} projection programs stopped waiting for the attention of their layer "
                f"(triton_ops.decode_attention_o.MAX_SPINS polls)")  # fmt: skip

    def set_decode_prefetch(self, source: "Callable[[int], tuple[torch.Tensor, int] | None] | None") -> None:
        """Before each decode attention launch of layer ``i``, ask L2 for ``source(i)``:
        ``(tensor, bytes)``, the first ``bytes`` of memory from ``tensor``'s start
        (`weight_prefetch.prefetch_bytes_l2`, one launch; a hint that changes no result), or
        None for nothing. The runtime passes its MLP weights (`runtime.mlp_prefetch`) when
        `CompileConfig.l2_prefetch_mlp_bytes` is set; ``source`` is asked once per layer, at
        the first decode launch (CUDA graphs keep the launch they captured). A tensor on
        another device than the decode's is skipped. None: off."""
        self._prefetch_source = source
        self._prefetch_ranges = {}

    def _prefetch_for_decode(self, layer_id: int, device: torch.device) -> None:
        source = self._prefetch_source
        if source is None or device.type != "cuda":
            return
        if layer_id not in self._prefetch_ranges:
            self._prefetch_ranges[layer_id] = source(layer_id)
        found = self._prefetch_ranges[layer_id]
        if found is not None and found[0].device == device:  # a weight on another GPU: not this stream's to ask
            from ..weight_prefetch import prefetch_bytes_l2

            prefetch_bytes_l2(*found)

    def set_decode_l2_next(self, source: "Callable[[int], tuple[torch.Tensor, int] | None] | None") -> None:
        """Decode attention of layer ``i`` asks L2, once past its programmatic-dependent-launch
        wait, for ``source(i)``: ``(tensor, bytes)``, the first ``bytes`` of memory from
        ``tensor``'s start (`decode_attention_fwd`'s ``l2_next``: bulk prefetches inside the
        kernel, no launch of their own; a hint that changes no result), or None for nothing. The
        runtime passes each layer's output-projection weight (`runtime.o_prefetch`) when
        `CompileConfig.l2_prefetch_o` is set; ``source`` is asked once per layer, at its first
        decode launch (CUDA graphs keep the launch they captured). None: off."""
        self._l2_next_source = source
        self._l2_next_ranges = {}

    def _l2_next_for(self, layer_id: int) -> tuple[torch.Tensor, int] | None:
        if self._l2_next_source is None:
            return None
        if layer_id not in self._l2_next_ranges:
            self._l2_next_ranges[layer_id] = self._l2_next_source(layer_id)
        return self._l2_next_ranges[layer_id]

    def forward_extend(self, q, k, v, layer: AttentionLayer, batch: "ForwardBatch", save_kv_cache: bool = True) -> torch.Tensor:
        """``q: [T, Hq, D]`` ragged by ``batch.qo_indptr`` -> ``[T, Hq, Dv]``.

        Appends the new K/V to the pool first; the kernel reads them back from there."""
        self._check_device(q)
        if save_kv_cache:
            self.save_kv(layer, batch, k, v)
        pool = batch.kv_pool
        kb = pool.k_buffers[layer.layer_id].view(-1, pool.num_kv_heads, pool.head_dim)
        vb = pool.v_buffers[layer.layer_id].view(-1, pool.num_kv_heads, pool.v_head_dim)
        out = q.new_empty((q.shape[0], layer.num_q_heads, pool.v_head_dim))
        if self._step_batch is batch:
            max_ext = self._step_max_extend_len
        else:
            max_ext = batch.static_max_extend_len or batch.max_extend_len
        return extend_attention_fwd(
            _last_dim_contiguous(q), kb, vb, out, pool.req_to_page, batch.req_pool_indices, batch.seq_lens,
            batch.qo_indptr, max_ext, page_size=pool.page_size, scale=layer.scale, causal=layer.causal,
            window_left=layer.window_left, logit_cap=layer.logit_cap, static_num_tokens=batch.static_max_extend_len,
            sinks=layer.sinks, chunk_size=layer.chunk_size, alibi_slopes=_slopes(layer, q),
        )  # fmt: skip

    def forward_dense(self, q, k, v, layer: AttentionLayer, batch_size: int) -> torch.Tensor:
        """Stateless form by a real kernel: the extend kernel over contiguous K/V
        (``q: [B * Sq, Hq, D]``, ``k/v: [B * Sk, Hkv, D/Dv]`` -> ``[B * Sq, Hq, Dv]``)."""
        self._check_device(q)
        out = q.new_empty((q.shape[0], layer.num_q_heads, v.shape[-1]))
        return dense_attention_fwd(
            _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v), out, int(batch_size),
            scale=layer.scale, causal=layer.causal, window_left=layer.window_left, logit_cap=layer.logit_cap,
            sinks=layer.sinks, chunk_size=layer.chunk_size, alibi_slopes=_slopes(layer, q),
        )  # fmt: skip
