"""`CompileConfig`: every knob of attngraph in one frozen, validated dataclass."""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

#: `CompileConfig.flashinfer_extend`'s choices.
FLASHINFER_EXTEND = ("auto", "paged", "ragged_merge")
CUDA_GRAPH_MODES = ("auto", "full_and_piecewise", "piecewise", "full", "breakable", "none")
PIECE_COMPILERS = ("auto", "inductor", "eager")


def default_capture_sizes() -> tuple[int, ...]:
    """Batch sizes captured by default: 1, 2, 4, 8, then steps of 8 up to 256."""
    return (1, 2, 4) + tuple(range(8, 257, 8))


#: Inductor options attngraph compiles its graphs with on CUDA (``CompileConfig.inductor_options``
#: left at None). ``combo_kernels``: independent pointwise kernels of one graph run as one
#: launch; in a decode step that is each layer's RoPE of q, RoPE of k and the copy of v out of
#: the fused q/k/v projection (H200, Llama-3.2-1B shape, batch 1: 243 -> 212 kernels, 1.111 ->
#: 1.081 ms of kernel time per step). ``coordinate_descent_tuning`` changed nothing measurable
#: there and is left off. ``triton.enable_pdl`` is added where `pdl.inductor_options` says.
CUDA_INDUCTOR_OPTIONS: dict[str, Any] = {"combo_kernels": True}

#: Inductor options added for the compiles of exact token counts (``exact_token_counts``):
#: coordinate-descent tuning of the reductions their skinny products become.
EXACT_INDUCTOR_OPTIONS: dict[str, Any] = {"coordinate_descent_tuning": True}


def default_num_tokens() -> tuple[int, ...]:
    """Token counts the prefill graphs are captured for: powers of two from 8 to 1024."""
    return (8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class CompileConfig:
    """Configuration of the attngraph compiler and runtime.

    Parameters
    ----------
    attention_backend:
        Name of a registered attention backend (``"torch_native"``, ``"triton"``,
        ``"flashinfer"``) or ``"auto"``: Triton on CUDA (its prefill steps run as whole CUDA
        graphs), else FlashInfer on CUDA, else torch_native.
    prefill_attention_backend, decode_attention_backend:
        Override the backend for prefill (EXTEND/MIXED) or DECODE steps only; when they differ
        a `HybridBackend` routes by mode. ``None`` inherits ``attention_backend``.
    verify_attention_backend:
        The backend of a speculative target's verify steps (its candidates, logits at every
        token; `ModelRunner.forward_all`). ``None``: the prefill backend serves them. Verify
        steps replay CUDA graphs only with a backend that captures extend attention (Triton):
        on an H200 a 5-token verify step then costs about one decode step, and several times
        that without graphs.
    draft_attention_backend:
        The backend with which an ``assistant_model`` that is not accelerated is accelerated
        on its first use by this model's ``generate`` (it then stays accelerated;
        `attngraph.restore` undoes it). ``None``: this config's ``attention_backend``. The
        draft's decode steps of a round replay as one CUDA graph only with a backend whose
        decode attention plans on the device (Triton).
    cuda_graph:
        How the paged runtime uses CUDA graphs (CUDA only; on another device only ``"none"``
        and ``"auto"`` are accepted):

        * ``"full"``: each decode step captured whole, attention included, per padded batch
          size (``cuda_graph_capture_sizes``); prefill / extend / mixed steps too, per token
          bucket (``cuda_graph_num_tokens``), when the backend captures extend attention
          (Triton); other steps run without graphs.
        * ``"piecewise"``: the graph is split at attention; the pieces between attention ops
          are captured per padded token count (``cuda_graph_num_tokens``) and attention runs
          eagerly between them, for every kind of step.
        * ``"full_and_piecewise"``: full graphs for decode steps, and for the other steps
          where the backend captures extend attention (as in ``"full"``); piecewise for the
          rest.
        * ``"breakable"``: piecewise graphs of the traced FX code without inductor (fast
          start: no inductor compile).
        * ``"none"``; ``"auto"``: ``full_and_piecewise`` on CUDA, ``none`` elsewhere.
    cuda_graph_capture_sizes:
        Decode batch sizes captured by full graphs; a batch is padded up to the next one.
    cuda_graph_num_tokens:
        Token counts captured by piecewise or whole-step prefill graphs; a step is padded up
        to the next one, and one above the largest runs without graphs.
    page_size:
        Tokens per KV page (>= 1).
    kv_cache_tokens, kv_memory_fraction:
        Size of the KV pool as a token count, or as a fraction of free device memory. At most
        one may be set; with neither, the pool holds ``max_requests * max_context_len`` tokens.
    max_requests, max_context_len:
        Rows and width of the request-to-page table. ``max_context_len=None`` takes the
        model's ``max_position_embeddings`` (capped at 32768).
    trace_tokens:
        Token count of the dummy step the paged runtime compiles the model on. Inductor sizes
        its kernels' blocks (and tunes them, at their first launch) for the shapes it is given,
        so a count like the largest real step gives kernels that stream large steps at full
        bandwidth; one tuned on 2 tokens runs a 1024-token step's elementwise kernels several
        times slower. ``None``: the largest of ``cuda_graph_num_tokens`` on CUDA (at most
        ``max_context_len``), 2 elsewhere (the CPU gains nothing and pays the compute).
    piece_compiler:
        How graph pieces are compiled: ``"inductor"``, ``"eager"`` (run the FX graph as is), or
        ``"auto"`` (inductor on CUDA, eager on CPU).
    inductor_options:
        Settings of ``torch._inductor.config`` (dotted names, e.g. ``{"combo_kernels": False}``)
        applied to attngraph's inductor compiles only. ``None``: `CUDA_INDUCTOR_OPTIONS` on CUDA
        (and inductor's PDL, `pdl.inductor_options`), inductor's own defaults elsewhere; ``{}``:
        inductor's defaults everywhere.
    exact_token_counts:
        Token counts whose steps run graph pieces compiled for exactly that many tokens
        (`compiler.specialize`, with `EXACT_INDUCTOR_OPTIONS`), compiled at their first use
        (before the CUDA graphs of the size are captured); other counts run the pieces
        compiled once for any count. There, products of at most 2 token rows become inductor
        reductions rather than cuBLAS GEMMs. Applies where the graph is split at attention
        (``cuda_graph`` ``"full_and_piecewise"`` and ``"piecewise"``) with inductor; a decode
        step of one or two requests has 2 tokens (the ragged forward pads one to two).
        ``None`` or ``()``: off. Measured on an H200 (Llama-3.2-1B shape, ``(2,)``): the
        decode step's kernel time went from 1.10 to 2.33 ms (inductor's reductions ran at a
        quarter of the weight-read bandwidth), so it is off by default.
    lower_attention:
        Set False to run the passes for reporting only (nothing rewritten).
    deterministic:
        Fixed split counts and reduction order, so repeated runs give bit-identical results.
    flashinfer_decode_tensor_cores:
        FlashInfer's decode kernel: ``None`` picks the tensor-core (prefill-style) kernel for
        GQA groups of 4 or more and the CUDA-core one below; ``True`` / ``False`` always /
        never take the tensor-core one (``deterministic`` needs it: its fixed KV split exists
        only there).
    flashinfer_extend:
        How FlashInfer runs prefill steps: ``"auto"`` (the ragged kernel where no request has a
        cached prefix, else ``"paged"``), ``"paged"`` (the new K/V written first, one causal
        kernel over each request's pages) or ``"ragged_merge"`` (the new tokens' ragged kernel
        and the cached prefix's paged kernel, merged by their log-sum-exp). ``deterministic``
        takes ``"paged"`` (``"auto"`` resolves to it; ``"ragged_merge"`` is refused).
    rank_one_products:
        Paged runtime and stateless graphs: a matrix product over one contracted element (HF's rotary angles in
        transformers 5.17, ``[B, D/2, 1] @ [B, 1, T]``) becomes the equal broadcast multiply
        (`passes.rank_one_products`), which inductor fuses into the cos/sin kernel instead of
        launching an fp32 GEMM at the head of each step.
    fuse_linears:
        Paged runtime: linears reading the same input (q/k/v, gate/up) run as one GEMM on
        their concatenated weights (`passes.fuse_linears`; the parameters become views of it).
    skinny_linears:
        Paged runtime: linears call `torch.ops.attngraph.linear`, a Triton GEMV for steps of
        one or two token rows on CUDA (`linear_ops.KERNEL_MAX_ROWS`), a tensor-core Triton
        GEMM for 3-16 rows (`attngraph.skinny_dot`; decode steps of small batches) and
        ``torch.nn.functional.linear`` otherwise, with a gated MLP's ``silu(gate) * up``
        computed inside its down projection's GEMV (`passes.skinny_linears`). ``None``: on
        for CUDA; ``True``: everywhere (on the CPU the ops run torch's linear: for testing
        the rewrite); ``False``: off.
    fold_rms_norm:
        With `skinny_linears`: an RMSNorm (and the residual add before it) read only by a
        projection is computed inside that projection's GEMV (`passes.fold_rms_norm`): one
        launch instead of two per norm site of a decode step.
    fold_rope:
        Paged runtime: HF's rotate-half rotary embedding of q and k moves into the attention
        op (`passes.fold_rope`); the Triton backend's decode kernel rotates them as it loads
        them (one launch less per layer of a decode step), every other call rotates them
        first in one launch. ``None`` (the default): on, except with `fuse_attention_o`
        (whose fused kernel does not rotate, so the two would not meet); ``True``: on (then
        `fuse_attention_o` refuses the rotated sites); ``False``: off. On by default: on an
        H100 the Llama-shaped decode steps ran 16 (1B) and 32 (8B) kernels fewer and faster
        at batch 1 and 16 (1B: 1.094-1.097 against 1.108-1.109 ms at batch 1, 1.299-1.301
        against 1.318-1.323 at batch 16; 8B: 5.742 against 5.827 and 6.290 against 6.328;
        ``benchmarks/bench_generate.py --interleave
        --variant default --variant fold-rope=on``,
        ``benchmarks/results/generate_fold_rope_{1b,8b}_h100_2026-12-06.json``). Before the
        decode kernel's merge and gate/up changes of that day it had lost on an H200 at batch
        1 (0.981 against 0.962 ms). Prefill steps (1-8 requests of 128-4096 tokens) took the
        same time with it and without it (``benchmarks/bench_prefill.py --fold-rope on,off,on``,
        ``benchmarks/results/prefill_fold_rope_h100_2026-12-06.json``).
    fold_rope_linear:
        With `fold_rope` (required): where q and k are the first output columns of one
        attngraph projection (a fused q/k/v), the rotation moves on from the attention op into
        that projection (`passes.fold_rope_linear`): a decode step's GEMV (1-2 rows) or
        tensor-core kernel (3-16) rotates the columns in its epilogue, so the attention kernel
        reads q and k rotated and no launch is spent on the rotation; a prefill's rows rotate
        after the GEMM in one launch. Off by default: on an H200 the 1B-shaped decode step ran
        16 kernels fewer but slower at batch 1 (0.967 against 0.948 ms) and even at batch 16
        (1.069 against 1.067; ``benchmarks/bench_generate.py --fold-rope off,linear``,
        ``benchmarks/results/generate_rope_linear_norm_epilogue_h200_2026-12-05.json``).
        Against `fold_rope` alone on an H100 (same kernel count): tied at batch 1 (1.095-1.097
        against 1.094-1.097 ms), slower at batch 16 (1.313-1.315 against 1.299-1.301;
        ``benchmarks/results/generate_fold_rope_1b_h100_2026-12-06.json``).
    fold_norm_epilogue:
        With `fold_rms_norm` (required): where the projection after a residual add + RMSNorm
        never runs the GEMV (Llama-3.1-8B's fused gate/up, on cuBLAS) and the projection
        before it may (the output projection), the add and the norm move into the latter's
        epilogue (`passes.fold_norm_epilogue`): a decode step's GEMV writes the residual sum
        and, in its last program, the normed rows, so the norm spends no launch of its own.
        Other row counts run the projection and one norm launch, as before. Off by default: on
        an H200 the 1B-shaped batch-1 step (its gate/up then on cuBLAS) ran 16 kernels fewer
        but slower (0.999 against 0.948 ms): behind the GEMV under programmatic dependent
        launch the norm kernel cost 0.56 us a layer, the epilogue's serial tail 0.84
        (``--norm-epilogue on,off``, same results file).
    fuse_gated_mlp:
        With `fold_rms_norm`: each gated MLP whose fused gate/up product follows a residual
        add + RMSNorm becomes one op (`passes.fuse_gated_mlp`,
        ``attngraph.add_rms_norm_gated_mlp``). At the rows the tensor-core kernel takes
        (3-16) SiLU * up is formed in the gate/up product's epilogue, so no SiLU-mul kernel
        runs and half the product's output is written; at other row counts the op runs the
        ops it replaces. ``None`` (the default): on with `fold_rms_norm`; ``True`` requires
        it. On by default: on an H100 the 1B-shaped decode step ran 16 kernels fewer and
        faster at batch 4 (1.173-1.174 against 1.187-1.190 ms) and batch 16 (1.197-1.248
        against 1.260-1.311; ``benchmarks/bench_generate.py --interleave --variant default
        --variant gated-mlp=on``, ``benchmarks/results/generate_gated_mlp_h100_2026-12-06.json``).
    fuse_attention_o:
        Paged runtime: each attention op whose output reaches only the output projection
        (through HF's reshapes) and that projection become one op, ``attngraph.attention_o``
        (`passes.fuse_attention_o`). The Triton backend runs a decode step of one request as
        one launch (`triton_ops.decode_attention_o`: the projection's programs load their
        weight while attention runs and start when its last head group is merged), so no
        kernel boundary sits between the two on the step's critical path; other steps and
        backends run the two ops as before. Setting it turns the default `fold_rope` off (the
        fused kernel does not rotate); with ``fold_rope=True`` the rotated sites, and where
        `fold_norm_epilogue` gave the projection the MLP's norm, those sites keep the
        projection apart. Off by default: on an H100 the 1B-shaped batch-1
        step ran 16 kernels fewer but slower (1.268 ms, and 1.251 with 8 splits and 8 weight
        rows per program, against 1.211; ``benchmarks/bench_generate.py --variant default
        --variant fuse-o=on --variant fuse-o=on-s8-o8``,
        ``benchmarks/results/generate_fuse_o_h100_2026-12-06.json``).
    absorb_mla:
        Paged runtime: multi-head latent attention (DeepSeek V2/V3 and kin) attends over its
        latent plus RoPE key, one KV head of ``kv_lora_rank + qk_rope_head_dim`` values per
        token and layer, with ``kv_b_proj`` absorbed into the query and the output
        (`passes.absorb_mla`). Decode attention reads 71x fewer bytes and ran 3-7x faster on
        an H200, prefill 11x slower (3.4x the multiply-adds per query-key pair). False keeps
        the expanded per-head K/V (the MHA form): for prefill-heavy work, and for backends
        limited to common head dims (FlashInfer).
    l2_prefetch_mlp_bytes:
        Paged runtime, Triton decode attention on a GPU with programmatic dependent launch:
        before each layer's decode attention, ask L2 for the first this many bytes of the
        layer's MLP input weight (a gated MLP's fused gate/up rows; `runtime.mlp_prefetch`),
        so memory left idle by the latency-bound kernels of attention streams the weight the
        next GEMM reads. One small launch per layer; a hint that changes no result. 0 (off)
        by default: on an H200 it made decode slower (1B batch 1: 1.038 ms with 32 MiB and
        1.050 with 16 MiB against 0.967-0.996 without; 8B batch 1: 4.593 against 4.432;
        ``benchmarks/bench_generate.py --l2-prefetch-mlp``,
        ``benchmarks/results/generate_l2_prefetch_mlp_h200_2026-12-05.json``).
    l2_prefetch_o:
        Paged runtime, Triton decode attention on a GPU with programmatic dependent launch:
        each layer's decode kernel, once the q/k/v projection before it has finished, asks L2
        for the layer's attention output weight (`runtime.o_prefetch`; bulk prefetches inside
        the kernel, no launch of their own), so the output projection after attention reads it
        from L2 while attention leaves the memory idle. A hint that changes no result. Off by
        default: on an H100 it made decode slower at batch 1 (1B: 1.103 / 1.102 ms against
        1.097 / 1.096; 8B: 5.788 against 5.727) and tied at batch 16 (``benchmarks/
        bench_generate.py --variant l2-prefetch-o=on``,
        ``benchmarks/results/generate_l2_prefetch_o_{1b,8b}_h100_2026-12-06.json``).
    debug_dump_dir:
        Folder for FX graph dumps before/after each pass. The environment variable
        ``ATTNGRAPH_DEBUG=1`` turns dumps on with a temporary folder named in the log.

    Examples
    --------
    >>> cfg = CompileConfig(attention_backend="torch_native", page_size=16)
    >>> cfg.replace(page_size=1).page_size
    1
    """

    attention_backend: str = "auto"
    prefill_attention_backend: str | None = None
    decode_attention_backend: str | None = None
    verify_attention_backend: str | None = None
    draft_attention_backend: str | None = None
    cuda_graph: str = "auto"
    cuda_graph_capture_sizes: tuple[int, ...] = field(default_factory=default_capture_sizes)
    cuda_graph_num_tokens: tuple[int, ...] = field(default_factory=default_num_tokens)
    page_size: int = 16
    kv_cache_tokens: int | None = None
    kv_memory_fraction: float | None = None
    max_requests: int = 256
    max_context_len: int | None = None
    trace_tokens: int | None = None
    piece_compiler: str = "auto"
    inductor_options: Any = None
    exact_token_counts: tuple[int, ...] | None = None
    lower_attention: bool = True
    deterministic: bool = False
    flashinfer_decode_tensor_cores: bool | None = None
    flashinfer_extend: str = "auto"
    rank_one_products: bool = True
    fuse_linears: bool = True
    skinny_linears: bool | None = None
    fold_rms_norm: bool = True
    fold_rope: bool | None = None
    fold_rope_linear: bool = False
    fold_norm_epilogue: bool = False
    fuse_gated_mlp: bool | None = None
    fuse_attention_o: bool = False
    absorb_mla: bool = True
    l2_prefetch_mlp_bytes: int = 0
    l2_prefetch_o: bool = False
    debug_dump_dir: str | None = None

    def __post_init__(self) -> None:
        from .attn_backends.registry import known_backend_names

        names = known_backend_names() + ("auto",)
        for fname in ("attention_backend", "prefill_attention_backend", "decode_attention_backend",
                      "verify_attention_backend", "draft_attention_backend"):  # fmt: skip
            value = getattr(self, fname)
            if value is None and fname != "attention_backend":
                continue
            if value not in names:
                raise ConfigError(
                    f"{fname}={value!r} is not a known attention backend; choose one of {sorted(names)}"
                )
        if self.cuda_graph not in CUDA_GRAPH_MODES:
            raise ConfigError(f"cuda_graph={self.cuda_graph!r}; choose one of {CUDA_GRAPH_MODES}")
        if self.piece_compiler not in PIECE_COMPILERS:
            raise ConfigError(f"piece_compiler={self.piece_compiler!r}; choose one of {PIECE_COMPILERS}")
        if self.inductor_options is not None:
            object.__setattr__(self, "inductor_options", _inductor_options(self.inductor_options))
        if self.exact_token_counts is not None:
            try:
                counts = tuple(self.exact_token_counts)
            except TypeError:
                raise ConfigError(
                    f"exact_token_counts must be a tuple of positive ints, got {self.exact_token_counts!r}; "
                    "e.g. exact_token_counts=(2,), or () to turn it off"
                ) from None
            if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
                raise ConfigError(
                    f"exact_token_counts must be positive ints, got {counts!r}; e.g. exact_token_counts=(2,), or () to turn it off"
                )
            object.__setattr__(self, "exact_token_counts", tuple(sorted(set(counts))))
        for fname in ("cuda_graph_capture_sizes", "cuda_graph_num_tokens"):
            sizes = tuple(getattr(self, fname))
            if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
                raise ConfigError(f"{fname} must be positive ints, got {sizes!r}")
            object.__setattr__(self, fname, tuple(sorted(set(sizes))))
        if self.flashinfer_decode_tensor_cores is not None and not isinstance(self.flashinfer_decode_tensor_cores, bool):
            raise ConfigError("flashinfer_decode_tensor_cores must be None (tensor cores from GQA group 4), True or False, "
                              f"got {self.flashinfer_decode_tensor_cores!r}")  # fmt: skip
        if self.flashinfer_extend not in FLASHINFER_EXTEND:
            raise ConfigError(f"flashinfer_extend={self.flashinfer_extend!r}; choose one of {FLASHINFER_EXTEND}")
        if self.deterministic and self.flashinfer_decode_tensor_cores is False:
            raise ConfigError("deterministic=True needs FlashInfer's tensor-core decode (its fixed KV split exists only "
                              "there): leave flashinfer_decode_tensor_cores None or set it True")  # fmt: skip
        if self.deterministic and self.flashinfer_extend == "ragged_merge":
            raise ConfigError("deterministic=True plans FlashInfer's prefill with a fixed KV split, which its paged "
                              "kernel alone takes: use flashinfer_extend='auto' or 'paged'")  # fmt: skip
        if self.fold_rope is not None and not isinstance(self.fold_rope, bool):
            raise ConfigError(f"fold_rope must be None (on unless fuse_attention_o), True or False, got {self.fold_rope!r}")
        if self.skinny_linears is not None and not isinstance(self.skinny_linears, bool):
            raise ConfigError(f"skinny_linears must be None (on for CUDA), True or False, got {self.skinny_linears!r}")
        if self.fuse_gated_mlp is not None and not isinstance(self.fuse_gated_mlp, bool):
            raise ConfigError(f"fuse_gated_mlp must be None (on with fold_rms_norm), True or False, got {self.fuse_gated_mlp!r}")
        for fname in ("lower_attention", "deterministic", "rank_one_products", "fuse_linears", "fold_rms_norm", "fold_rope_linear",
                      "fold_norm_epilogue", "fuse_attention_o", "absorb_mla", "l2_prefetch_o"):  # fmt: skip
            if not isinstance(getattr(self, fname), bool):  # "no" would read as True
                raise ConfigError(f"{fname} must be True or False, got {getattr(self, fname)!r}")
        if self.fold_rope_linear and not self.resolved_fold_rope:
            raise ConfigError("fold_rope_linear moves the rotation fold_rope gave the attention op on into the projection: "
                              "set fold_rope=True with it")  # fmt: skip
        if self.fold_norm_epilogue and not self.fold_rms_norm:
            raise ConfigError("fold_norm_epilogue moves the add + RMSNorm fold_rms_norm gave a projection back into the "
                              "one before it: set fold_rms_norm=True with it")  # fmt: skip
        if self.fuse_gated_mlp and not self.fold_rms_norm:
            raise ConfigError("fuse_gated_mlp fuses the MLP after the add + RMSNorm fold_rms_norm gives its gate/up "
                              "product: set fold_rms_norm=True with it")  # fmt: skip
        _check_int(self.page_size, "page_size", 1)
        _check_int(self.l2_prefetch_mlp_bytes, "l2_prefetch_mlp_bytes", 0)
        _check_int(self.max_requests, "max_requests", 1)
        if self.max_context_len is not None:
            _check_int(self.max_context_len, "max_context_len", 1)
        if self.trace_tokens is not None:
            _check_int(self.trace_tokens, "trace_tokens", 2)
        if self.kv_cache_tokens is not None and self.kv_memory_fraction is not None:
            raise ConfigError(
                "set either kv_cache_tokens or kv_memory_fraction, not both "
                f"(got {self.kv_cache_tokens} and {self.kv_memory_fraction})"
            )
        if self.kv_cache_tokens is not None:
            _check_int(self.kv_cache_tokens, "kv_cache_tokens", 1)
        if self.kv_memory_fraction is not None and not (0.0 < float(self.kv_memory_fraction) < 1.0):
            raise ConfigError(f"kv_memory_fraction must be in (0, 1), got {self.kv_memory_fraction}")
        if self.debug_dump_dir is None and os.environ.get("ATTNGRAPH_DEBUG", "") not in ("", "0"):
            import tempfile

            object.__setattr__(self, "debug_dump_dir", tempfile.mkdtemp(prefix="attngraph-debug-"))

    @classmethod
    def from_kwargs(cls, config: "CompileConfig | None" = None, **kwargs: Any) -> "CompileConfig":
        """Build a config from keyword arguments, naming any unknown one in the error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown CompileConfig field(s) {unknown}; known fields: {sorted(known)}")
        if config is None:
            return cls(**kwargs)
        return config.replace(**kwargs)

    def replace(self, **changes: Any) -> "CompileConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def resolved_fold_rope(self) -> bool:
        """`fold_rope` with ``None`` resolved: on unless `fuse_attention_o`."""
        return self.fold_rope if self.fold_rope is not None else not self.fuse_attention_o

    @property
    def resolved_fuse_gated_mlp(self) -> bool:
        """`fuse_gated_mlp` with ``None`` resolved: on with `fold_rms_norm`."""
        return self.fuse_gated_mlp if self.fuse_gated_mlp is not None else self.fold_rms_norm

    def resolved_skinny_linears(self, device_type: str) -> bool:
        return device_type == "cuda" if self.skinny_linears is None else self.skinny_linears

    def resolved_piece_compiler(self, device_type: str) -> str:
        if self.piece_compiler != "auto":
            return self.piece_compiler
        return "inductor" if device_type == "cuda" else "eager"

    def resolved_inductor_options(self, device_type: str) -> dict[str, Any]:
        """The inductor settings for graphs on ``device_type`` (see ``inductor_options``)."""
        if self.inductor_options is None:
            if device_type != "cuda":
                return {}
            from . import pdl

            return {**CUDA_INDUCTOR_OPTIONS, **pdl.inductor_options()}
        return dict(self.inductor_options)

    def resolved_exact_token_counts(self, device_type: str) -> tuple[int, ...]:
        """Token counts with compiles of their own on ``device_type`` (see ``exact_token_counts``)."""
        if self.exact_token_counts is None or self.resolved_piece_compiler(device_type) != "inductor":
            return ()
        return self.exact_token_counts

    def resolved_exact_inductor_options(self, device_type: str) -> dict[str, Any]:
        """The inductor settings of the exact-count compiles on ``device_type``."""
        return {**self.resolved_inductor_options(device_type), **EXACT_INDUCTOR_OPTIONS}

    def resolved_cuda_graph(self, device_type: str) -> str:
        """The graph mode on ``device_type``: ``"auto"`` resolved; a mode the device cannot
        run is a `ConfigError` that names the ones it can."""
        if device_type != "cuda":
            if self.cuda_graph in ("auto", "none"):
                return "none"
            raise ConfigError(
                f"cuda_graph={self.cuda_graph!r} needs a CUDA device, but the model is on {device_type}; "
                "use cuda_graph='none' (or 'auto', which is 'none' off CUDA)"
            )
        if self.cuda_graph == "auto":
            return "full_and_piecewise"
        return self.cuda_graph


def _init_naming_bad_fields(init: Any) -> Any:
    """Wrap the dataclass ``__init__`` so an unknown field or a surplus positional argument is a
    `ConfigError` naming the known fields (as ``accelerate(..., foo=1)`` reports it), not
    Python's bare `TypeError`."""
    names = tuple(f.name for f in dataclasses.fields(CompileConfig))

    @functools.wraps(init)
    def __init__(self: CompileConfig, *args: Any, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ConfigError(f"unknown CompileConfig field(s) {unknown}; known fields: {sorted(names)}")
        if len(args) > len(names):
            raise ConfigError(f"CompileConfig takes at most {len(names)} positional fields {names}, got {len(args)}")
        clash = sorted(n for n in names[: len(args)] if n in kwargs)
        if clash:
            raise ConfigError(f"CompileConfig field(s) {clash} given both by position and by name")
        init(self, *args, **kwargs)

    return __init__


CompileConfig.__init__ = _init_naming_bad_fields(CompileConfig.__init__)  # type: ignore[method-assign]


def _check_int(value: Any, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")


def _inductor_options(options: Any) -> tuple[tuple[str, Any], ...]:
    """``options`` (a mapping or pairs) as sorted pairs, each name checked against
    ``torch._inductor.config`` (a misspelt setting would otherwise be ignored)."""
    try:
        pairs = sorted(dict(options).items())
    except (TypeError, ValueError):
        raise ConfigError(f"inductor_options must be a dict of torch._inductor.config settings, got {options!r}") from None
    import torch._inductor.config as inductor_config

    for name, value in pairs:
        obj = inductor_config
        for part in str(name).split("."):
            if not hasattr(obj, part):
                raise ConfigError(
                    f"inductor_options: torch._inductor.config has no setting {name!r}; "
                    "names are dotted paths such as 'combo_kernels' or 'triton.cudagraphs'"
                )
            obj = getattr(obj, part)
        if isinstance(obj, bool) and not isinstance(value, bool):  # "no" would read as True
            raise ConfigError(f"inductor_options: {name!r} is a True/False setting, got {value!r}")
    return tuple(pairs)
