"""A decode step's GEMVs in the order the model runs them, per launch configuration (GPU).

`bench_skinny_gemm.py` times one projection in a graph of consecutive calls of itself. In a
decode step each GEMV follows a different kernel and, under programmatic dependent launch,
loads its first weight chunk while that kernel finishes, so a configuration that wins alone
can lose in the step. This script captures one CUDA graph per variant of the chain a batch-1
(or ``--rows``) step of the Llama-3.2-1B / 3.1-8B shape runs through its projections::

    for each of the layers (distinct weights):
        qkv  = skinny_rms_norm_linear(down, norm_w, eps, w_qkv, residual=h, h_out=h_new)  # GEMV
        o    = skinny_linear(qkv[:, :hidden], w_o)                                     # GEMV
        gu   = F.linear(o, w_gate_up)                        # cuBLAS, or a GEMV (see below)
        down = skinny_silu_mul_linear(gu[:, :I], gu[:, I:], w_down)                    # GEMV
    logits = skinny_linear(down, w_lm_head)                                            # GEMV

(no attention, RoPE or norm kernels between them: those are the model's). With ``--attention``
each layer runs the rest of a decode step's kernels too, the model's order::

        a    = decode_attention_fwd(q, pool, ..., k_new=k, v_new=qkv v, counters,
                                    rope_cos=cos, rope_sin=sin)  # RoPE of q and k, K/V store, merge
        o    = skinny_linear(a, w_o)                                            # GEMV
        x, h = add_rms_norm(o, norm2_w, eps, residual=h)                        # RMSNorm
        gu   = F.linear(x, w_gate_up) ...

over ``--context`` cached keys per request (the pool's keys before the new token, a page table of
consecutive pages), so the GEMVs meet the latency-bound kernels they follow in the model (the
decode kernel rotates q and k as the model's does with `CompileConfig.fold_rope`, its default).
``--fuse-o`` adds variants that run each layer's decode attention and output projection in one
launch (`triton_ops.decode_attention_o`; the model's with `CompileConfig.fuse_attention_o`),
after a RoPE kernel (attngraph's ``rope_qk``; the fused kernel does not rotate), and
``--decode`` variants of the decode kernel (its shortest split, merge chunk, a second merging
launch, the rotation in a kernel of its own before it). A variant changes the
configuration of one projection (``qkv``, ``o``, ``down``, ``lm_head``) and keeps the others at
`default_config`'s. The gate/up product runs where the model's routing puts it
(`linear_ops.gemv_takes`: the 1B one of one row on the GEMV, with the residual add and the MLP's norm
folded into it, ``skinny_rms_norm_linear``; the 8B one on cuBLAS after the norm kernel);
``--sweep gate_up`` times the other of the two as well, and the grid's tiles on the GEMV;
``unpipelined`` runs every GEMV with ``num_stages = 1`` (one weight chunk in
flight per program, the kernel's loop before it was pipelined). The graphs are replayed in
interleaved rounds, so a drift of the clocks spreads over all variants alike; each row gives
the median time per chain and its ratio to the weight-read floor at the copy bandwidth
measured in the same run.

    python benchmarks/bench_gemv_chain.py --shape 1b --rows 1 --out results/gemv_chain.json
    python benchmarks/bench_gemv_chain.py --shape 8b --rows 1 --sweep down --stages 1,2,3
    python benchmarks/bench_gemv_chain.py --attention --sweep o --block-n 4 --block-k 1024,2048 --stages 1 --preload 1,0
    python benchmarks/bench_gemv_chain.py --attention --sweep qkv,gate_up --block-n 4 --block-k 1024 --stages 1 --norm-stages 1,2
    python benchmarks/bench_gemv_chain.py --attention --sweep gate_up --block-n 4,8,16 --block-k 512,1024,2048 --stages 1,2
    python benchmarks/bench_gemv_chain.py --attention --trace --sweep ""   # where a layer's attention time goes
    python benchmarks/bench_gemv_chain.py --attention --trace --sweep "" --decode "min_split=256" --decode "merge_chunk=4"

Prints one JSON line per variant and a Markdown table; ends with the best configuration per
projection (the `TUNED` entries of ``attngraph/skinny_linear.py`` to try in the model with
``bench_generate.py --gemv-table``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_prefill import result_header  # noqa: E402
from bench_skinny_gemm import copy_bandwidth  # noqa: E402

from attngraph.linear_ops import gemv_takes  # noqa: E402
from attngraph.skinny_linear import (  # noqa: E402
    default_config,
    rows_padded,
    skinny_linear,
    skinny_rms_norm_linear,
    skinny_silu_mul_linear,
)

#: hidden, intermediate, q/k/v width, vocabulary, layers of each shape ("tiny": CPU tests)
SHAPES = {"1b": (2048, 8192, 3072, 128256, 16), "8b": (4096, 14336, 6144, 128256, 32), "tiny": (64, 128, 128, 256, 2)}
#: query heads, KV heads, head dim of each shape (q/k/v width = (heads + 2 * KV heads) * head dim)
HEADS = {"1b": (32, 8, 64), "8b": (32, 8, 128), "tiny": (4, 2, 16)}
PAGE_SIZE = 16
EPS = 1e-5
#: `--decode` values allowed: a merge chunk is unrolled in the kernel, so it stays small
MAX_SPEC = {"min_split": 1 << 20, "merge_chunk": 64}
#: the chain's GEMVs: name -> (what default_config is asked for: silu_mul, norm). ``gate_up`` runs on cuBLAS
#: where its configuration is None (after the norm kernel), else on the GEMV with the MLP's norm
#: folded, as the model runs it where `linear_ops.gemv_takes` routes it there.
PROJECTIONS = {"qkv": (False, True), "o": (False, False), "gate_up": (False, True), "down": (True, False),
               "lm_head": (False, False)}  # fmt: skip


def projection_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """``name -> (N, K)`` of the chain's GEMVs."""
    hidden, inter, qkv, vocab, _ = SHAPES[shape]
    return {"qkv": (qkv, hidden), "o": (hidden, hidden), "gate_up": (2 * inter, hidden), "down": (hidden, inter),
            "lm_head": (vocab, hidden)}  # fmt: skip


class Chain:
    """The weights of ``layers`` layers (random bf16, distinct per layer) and the buffers of a
    ``rows``-row step; `capture` records the chain for given configurations. ``attention``:
    each layer also holds a KV pool of ``context`` cached keys per row (one request per row)
    and runs RoPE, decode attention and the RMSNorm before the MLP (see the module's docstring).
    ``device``: CUDA, or the CPU under Triton's interpreter (`run` only: the tests)."""

    def __init__(self, shape: str, rows: int, layers: int | None = None, *, attention: bool = False, context: int = 128,
                 device: str = "cuda") -> None:  # fmt: skip
        hidden, inter, qkv, vocab, default_layers = SHAPES[shape]
        self.layers = layers or default_layers
        self.hidden, self.inter, self.rows, self.attention = hidden, inter, rows, attention
        self.heads, self.kv_heads, self.head_dim = HEADS[shape]
        if qkv != (self.heads + 2 * self.kv_heads) * self.head_dim:
            raise ValueError(f"shape {shape}: q/k/v width {qkv} does not match its heads {HEADS[shape]}")
        gen = torch.Generator(device=device).manual_seed(0)
        bf16 = dict(device=device, dtype=torch.bfloat16)

        def weight(n: int, k: int) -> torch.Tensor:
            return (torch.randn(n, k, generator=gen, **bf16) * k**-0.5).contiguous()

        def norm_weight() -> torch.Tensor:
            return 1 + 0.1 * torch.randn(hidden, generator=gen, **bf16)

        self.w = [dict(qkv=weight(qkv, hidden), o=weight(hidden, hidden), gate_up=weight(2 * inter, hidden),
                       down=weight(hidden, inter), norm=norm_weight(), norm2=norm_weight())
                  for _ in range(self.layers)]  # fmt: skip
        self.lm_head = weight(vocab, hidden)
        self.x = torch.randn(rows, hidden, generator=gen, **bf16)
        self.h = torch.randn(rows, hidden, generator=gen, **bf16)
        self.weight_bytes = sum(t.numel() * 2 for w in self.w for k, t in w.items() if not k.startswith("norm"))
        self.weight_bytes += self.lm_head.numel() * 2
        if attention:
            self._attention_state(context, gen, device)

    def _attention_state(self, context: int, gen: torch.Generator, device: str) -> None:
        """Per layer a K and a V pool of consecutive pages per row, ``context`` random cached keys
        each; the new token's slot, lengths, page table, RoPE rows and the decode kernel's
        scratch (as `TritonBackend` sizes it for this batch)."""
        from attngraph.attn_backends.triton_backend import TritonBackend
        from attngraph.attn_backends.triton_ops.decode_attention_o import new_sync

        rows, hkv, d = self.rows, self.kv_heads, self.head_dim
        self.context = context
        pages = -(-(context + 1) // PAGE_SIZE)
        slots = rows * pages * PAGE_SIZE
        bf16 = dict(device=device, dtype=torch.bfloat16)
        self.pools = [(torch.randn(slots, hkv, d, generator=gen, **bf16), torch.randn(slots, hkv, d, generator=gen, **bf16))
                      for _ in range(self.layers)]  # fmt: skip
        i32 = dict(device=device, dtype=torch.int32)
        self.req_to_page = torch.arange(rows * pages, **i32).view(rows, pages)
        self.req_idx = torch.arange(rows, **i32)
        self.seq_lens = torch.full((rows,), context + 1, **i32)
        self.new_loc = self.req_to_page[:, context // PAGE_SIZE].long() * PAGE_SIZE + context % PAGE_SIZE
        angle = torch.rand(rows, d // 2, generator=gen, device=device) * 6.0
        self.cos = torch.cat([angle.cos()] * 2, 1).to(torch.bfloat16)  # [rows, D], HF's layout
        self.sin = torch.cat([angle.sin()] * 2, 1).to(torch.bfloat16)
        self.max_splits = TritonBackend().decode_max_splits(rows, hkv, torch.device(device))
        self.part_o = torch.empty(rows, self.heads, self.max_splits, d, device=device, dtype=torch.float32)
        self.part_lse = torch.empty(rows, self.heads, self.max_splits, device=device, dtype=torch.float32)
        self.counters = torch.zeros(rows * self.heads, **i32)
        self.sync = new_sync(device)  # the fused kernel's counters (`_attend_project`)

    def new_traces(self, configs: dict[str, dict | None]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer `attngraph.kernel_clock` buffers for its decode attention and its output
        projection (``configs["o"]``'s programs) launches."""
        from attngraph import kernel_clock
        from attngraph.attn_backends.triton_ops.decode_attention import decode_programs

        cfg = configs["o"] or default_config(self.rows, self.hidden, self.hidden)
        o_programs = -(-self.hidden // cfg["BLOCK_N"]) * cfg["SPLIT_K"]
        attn = decode_programs(self.rows, self.heads, self.kv_heads, self.head_dim, self.head_dim, torch.bfloat16,
                               self.max_splits)  # fmt: skip
        return [(kernel_clock.new_buffer(attn, "cuda"), kernel_clock.new_buffer(o_programs, "cuda")) for _ in self.w]

    def _attend(self, qkv: torch.Tensor, layer: int, trace: torch.Tensor | None = None,
                decode: dict | None = None) -> torch.Tensor:  # fmt: skip
        """RoPE and decode attention of one layer: ``qkv: [rows, (Hq + 2 Hkv) D]`` -> ``[rows, Hq D]``
        (the new K/V stored into the layer's pool by the decode kernel). ``decode``: the
        kernel's ``min_split_len``, ``merge_chunk`` (splits the merging program loads at once),
        ``merge`` (False: stage 1 stores the partials and a second launch merges them) and
        ``rope`` (False: a RoPE kernel rotates q and k first; by default the decode kernel does)."""
        from attngraph.attn_backends.triton_ops import decode_attention as da
        from attngraph.attn_backends.triton_ops.decode_attention import DEFAULT_MIN_SPLIT_LEN, decode_attention_fwd
        from attngraph.rope_kernel import rope_qk

        decode = decode or {}
        chunk = decode.get("merge_chunk")
        plain_chunk = da.merge_chunk
        if chunk is not None:  # read by the launch below
            da.merge_chunk = lambda *_: chunk

        rows, hq, hkv, d = self.rows, self.heads, self.kv_heads, self.head_dim
        q = qkv[:, : hq * d].view(rows, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(rows, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(rows, hkv, d)
        rope = {}
        if decode.get("rope", True):
            rope = dict(rope_cos=self.cos, rope_sin=self.sin)
        else:
            q, k = rope_qk(q, k, self.cos, self.sin)
        out = torch.empty(rows, hq, d, device=qkv.device, dtype=qkv.dtype)
        k_pool, v_pool = self.pools[layer]
        try:
            decode_attention_fwd(q, k_pool, v_pool, out, self.req_to_page, self.req_idx, self.seq_lens, self.part_o,
                                 self.part_lse, page_size=PAGE_SIZE, scale=d**-0.5, max_splits=self.max_splits, k_new=k,
                                 v_new=v, new_loc=self.new_loc, counters=self.counters if decode.get("merge", True) else None,
                                 trace=trace, min_split_len=decode.get("min_split_len", DEFAULT_MIN_SPLIT_LEN),
                                 **rope)  # fmt: skip
        finally:
            da.merge_chunk = plain_chunk
        return out.view(rows, hq * d)

    def _attend_project(self, qkv: torch.Tensor, layer: int, w_o: torch.Tensor, fuse: dict) -> torch.Tensor:
        """RoPE, then decode attention and the output projection in one launch
        (`decode_attention_o_fwd`; ``fuse``: ``max_splits`` (None: the backend's), ``block_o``,
        ``preload``) -> ``[rows, hidden]``."""
        from attngraph.attn_backends.triton_ops.decode_attention_o import decode_attention_o_fwd
        from attngraph.rope_kernel import rope_qk

        hq, hkv, d = self.heads, self.kv_heads, self.head_dim
        q = qkv[:, : hq * d].view(1, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(1, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(1, hkv, d)
        q, k = rope_qk(q, k, self.cos, self.sin)
        k_pool, v_pool = self.pools[layer]
        out, _ = decode_attention_o_fwd(
            q, k_pool, v_pool, self.req_to_page, self.req_idx, self.seq_lens, self.part_o, self.part_lse,
            page_size=PAGE_SIZE, scale=d**-0.5, max_splits=fuse.get("max_splits") or self.max_splits, k_new=k, v_new=v,
            new_loc=self.new_loc, counters=self.counters, weight=w_o, sync=self.sync, block_o=fuse["block_o"],
            preload_weight=fuse["preload"],
        )  # fmt: skip
        return out

    def run(self, configs: dict[str, dict | None], traces: list | None = None) -> torch.Tensor:
        """One pass of the chain with ``configs[name]`` (None: `default_config`'s; for ``gate_up``
        cuBLAS, and a configuration runs it on the GEMV with the MLP's norm folded); ``traces``
        (`new_traces`, with ``attention``): each layer's attention and output projection
        record timestamps."""
        from attngraph.rms_norm import add_rms_norm

        down, h = self.x, self.h
        gate_up = configs.get("gate_up")
        for layer, w in enumerate(self.w):
            # a new residual stream: every program reads the old one for the norm's statistics
            h, residual = torch.empty_like(h), h
            qkv = skinny_rms_norm_linear(down, w["norm"], EPS, w["qkv"], residual=residual, h_out=h, config=configs["qkv"])
            if not self.attention:
                x = skinny_linear(qkv[:, : self.hidden], w["o"], config=configs["o"])
                gu = F.linear(x, w["gate_up"]) if gate_up is None else skinny_linear(x, w["gate_up"], config=gate_up)
            else:
                if configs.get("fuse_o"):
                    o = self._attend_project(qkv, layer, w["o"], configs["fuse_o"])
                else:
                    attn_trace, o_trace = traces[layer] if traces is not None else (None, None)
                    a = self._attend(qkv, layer, attn_trace, configs.get("decode") or {})
                    o = skinny_linear(a, w["o"], config=configs["o"], trace=o_trace)
                if gate_up is None:
                    x, h = add_rms_norm(o, w["norm2"], EPS, residual=h)
                    gu = F.linear(x, w["gate_up"])
                else:  # the residual add and the MLP's norm in the gate/up GEMV
                    h, residual = torch.empty_like(h), h
                    gu = skinny_rms_norm_linear(o, w["norm2"], EPS, w["gate_up"], residual=residual, h_out=h, config=gate_up)
            down = skinny_silu_mul_linear(gu[:, : self.inter], gu[:, self.inter :], w["down"], config=configs["down"])
        return skinny_linear(down, self.lm_head, config=configs["lm_head"])

    def capture(self, configs: dict[str, dict | None], traces: list | None = None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile and warm up outside the capture
                self.run(configs, traces)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.run(configs, traces)
        return graph, out


ATTENTION_POINTS = ("entry", "wait", "attended", "counted", "merged", "done")
GEMV_POINTS = ("entry", "wait", "reduced", "unused3", "unused4", "done")


def trace_summary(traces: list[tuple[list[dict], list[dict]]]) -> dict:
    """Where one layer's decode attention and output projection spend their time, from the
    `attngraph.kernel_clock` records of each layer (``(attention records, o records)``, as
    `kernel_clock.decode` gives them). Every time is in microseconds after the first of the
    layer's attention programs returned from its PDL wait, the median over the layers after the
    first; ``first`` / ``last`` over a kernel's programs. Also the attention programs' median
    phases from their own cycle counters, in microseconds at the clock the stamps give.

    >>> attn = [dict(entry_us=1.0, wait_us=2.0, attended_us=3.0, counted_us=4.0, merged_us=5.0, done_us=5.5,
    ...              wait_cycles=1000, attended_cycles=3000, counted_cycles=5000, merged_cycles=7000, done_cycles=8000)]
    >>> o = [dict(entry_us=2.5, wait_us=6.5, reduced_us=7.5, done_us=8.0), dict(entry_us=3.0, wait_us=7.0, reduced_us=8.5, done_us=9.0)]
    >>> s = trace_summary([(attn, o), (attn, o)])
    >>> s["attention"]["done"]["last"], s["o"]["wait"]["first"], s["o"]["done"]["last"], s["boundary_us"]
    (3.5, 4.5, 7.0, 1.0)
    >>> s["attention_phases_us"]["attend"], s["ghz"]
    (1.0, 2.0)
    """
    import statistics

    def points(records, names):
        out = {}
        for n in names:
            vals = [r[f"{n}_us"] for r in records if r.get(f"{n}_us") is not None]
            if vals:
                out[n] = (min(vals), max(vals))
        return out

    layers = traces[1:] or traces
    per_layer = []
    ghz = []
    phases: dict[str, list[float]] = {"attend": [], "count": [], "merge": [], "store": []}
    for attn, o in layers:
        a, g = points(attn, ATTENTION_POINTS), points(o, GEMV_POINTS)
        zero = a["wait"][0]
        per_layer.append({"attention": {k: (lo - zero, hi - zero) for k, (lo, hi) in a.items()},
                          "o": {k: (lo - zero, hi - zero) for k, (lo, hi) in g.items()}})  # fmt: skip
        for r in attn:
            if r.get("done_us") is not None and r.get("wait_us") is not None and r["done_us"] > r["wait_us"]:
                ghz.append((r["done_cycles"] - r["wait_cycles"]) / ((r["done_us"] - r["wait_us"]) * 1e3))
            for phase, lo, hi in (("attend", "wait", "attended"), ("count", "attended", "counted"),
                                  ("merge", "counted", "merged"), ("store", "merged", "done")):  # fmt: skip
                if r.get(f"{lo}_cycles") is not None and r.get(f"{hi}_cycles") is not None:
                    phases[phase].append(r[f"{hi}_cycles"] - r[f"{lo}_cycles"])
    clock = statistics.median(ghz) if ghz else None
    med = lambda vals: round(statistics.median(vals), 3)  # noqa: E731
    out: dict = {"layers": len(layers), "ghz": round(clock, 3) if clock else None}
    for kernel in ("attention", "o"):
        out[kernel] = {p: {"first": med([L[kernel][p][0] for L in per_layer]), "last": med([L[kernel][p][1] for L in per_layer])}
                       for p in per_layer[0][kernel]}  # fmt: skip
    out["boundary_us"] = round(out["o"]["wait"]["first"] - out["attention"]["done"]["last"], 3)
    out["attention_phases_us"] = {p: round(statistics.median(v) / clock / 1e3, 3) for p, v in phases.items() if v and clock}
    return out


def print_trace_summary(label: str, summary: dict) -> None:
    print(f"\n{label}: us after decode attention's first program passed its PDL wait (median of {summary['layers']} layers)")
    print("| kernel | point | first program | last program |\n| --- | --- | ---: | ---: |")
    for kernel in ("attention", "o"):
        for point, v in summary[kernel].items():
            print(f"| {kernel} | {point} | {v['first']:.3f} | {v['last']:.3f} |")
    print(f"attention done -> o projection released: {summary['boundary_us']} us (global timers of different SMs: "
          f"+-2 us); attention programs' phases (us, {summary['ghz']} GHz, each program's own clock): "
          f"{json.dumps(summary['attention_phases_us'])}")


def time_graphs(graphs: dict[str, torch.cuda.CUDAGraph], rounds: int, replays: int) -> dict[str, list[float]]:
    """Milliseconds per replay of each graph, ``rounds`` interleaved rounds of ``replays``."""
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, g in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                g.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / replays)
    return times


def sweep(base: dict, name: str, rows: int, n: int, k: int, block_n, block_k, stages, preload=(),
          norm_stages=()) -> list[tuple[str, dict]]:  # fmt: skip
    """Variants of projection ``name``: its `default_config` with BLOCK_N, BLOCK_K, num_stages,
    PRELOAD and NORM_STAGES from the grids (an empty grid keeps the default's value, PRELOAD's
    and NORM_STAGES' is 1; one 16-byte vector per thread at least, fp32 accumulator at most 128
    values per thread). NORM_STAGES matters only where the norm is folded in (q/k/v; the
    one-row 1B gate/up)."""
    out = []
    grid = (block_n or [base["BLOCK_N"]], block_k or [base["BLOCK_K"]], stages or [base["num_stages"]],
            preload or [base.get("PRELOAD", 1)], norm_stages or [base.get("NORM_STAGES", 1)])  # fmt: skip
    for bn, bk, st, pre, ns in itertools.product(*grid):
        cfg = dict(base, BLOCK_N=bn, BLOCK_K=bk, num_stages=st)
        if pre != base.get("PRELOAD", 1):
            cfg["PRELOAD"] = pre
        if ns != base.get("NORM_STAGES", 1):
            cfg["NORM_STAGES"] = ns
        if bk > k or bn * bk < 8 * 32 * cfg["num_warps"] or rows_padded(rows) * bn * bk > 128 * 32 * cfg["num_warps"]:
            continue
        if cfg != base:
            label = f"{name} BLOCK_N={bn} BLOCK_K={bk} stages={st}" + (f" PRELOAD={pre}" if "PRELOAD" in cfg else "")
            label += f" NORM_STAGES={ns}" if "NORM_STAGES" in cfg else ""
            out.append((label, {name: cfg}))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1b", choices=["1b", "8b"])
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--layers", type=int, default=None, help="layers of the chain (default: the shape's)")
    p.add_argument("--sweep", default="qkv,o,down,lm_head", help="projections whose configurations are swept")
    p.add_argument("--block-n", default="2,4,8")
    p.add_argument("--block-k", default="512,1024")
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--preload", default="1", help="PRELOAD values swept (1: the first weight chunk before the PDL wait)")
    p.add_argument("--norm-stages", default="1",
                   help="NORM_STAGES values swept (the pipelining depth of the folded norm's statistics pass; 1: none)")
    p.add_argument("--attention", action="store_true",
                   help="each layer also runs RoPE, decode attention and the RMSNorm before the MLP")
    p.add_argument("--context", type=int, default=128, help="cached keys per request with --attention")
    p.add_argument("--fuse-o", action="store_true",
                   help="with --attention and one row: also time decode attention and the output projection in one "
                        "launch (decode_attention_o_fwd), at the backend's splits with 4 weight rows per program and "
                        "at 8 splits with 4 and 8 rows, the weight tile before (and after) the PDL wait")
    p.add_argument("--decode", action="append", default=[], metavar="SPEC",
                   help="with --attention, a variant of the decode kernel (repeatable): space-separated min_split=N "
                        "(shortest split in keys), merge_chunk=N (splits the merging program loads at once), "
                        "merge=0 (a second launch merges the splits), rope=0 (a RoPE kernel before it rotates q and "
                        "k, not the decode kernel)")  # fmt: skip
    p.add_argument("--trace", action="store_true",
                   help="with --attention: also replay each variant with timestamps recorded inside its decode attention "
                        "and output projection kernels (attngraph.kernel_clock), and print where a layer's time goes")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--table-out", default=None,
                   help="write the best configurations as a `bench_generate.py --gemv-table` JSON file")
    args = p.parse_args()
    decode_specs = []  # checked before the GPU is needed
    for spec in args.decode:
        if not args.attention:
            p.error("--decode needs --attention")
        keys = {"min_split": ("min_split_len", int), "merge_chunk": ("merge_chunk", int), "merge": ("merge", lambda v: v != "0"),
                "rope": ("rope", lambda v: v != "0")}  # fmt: skip
        decode = {}
        for item in spec.split():
            key, _, value = item.partition("=")
            if key not in keys or not value:
                p.error(f"--decode {spec!r}: {item!r} is none of min_split=N, merge_chunk=N, merge=0, rope=0")
            if key in MAX_SPEC and not (value.isdigit() and 1 <= int(value) <= MAX_SPEC[key]):
                p.error(f"--decode {spec!r}: {key} takes a count from 1 to {MAX_SPEC[key]}")
            decode[keys[key][0]] = keys[key][1](value)
        decode_specs.append((spec, decode))
    for name in [s for s in args.sweep.split(",") if s]:
        if name not in PROJECTIONS:
            p.error(f"--sweep: {name!r} is none of {', '.join(PROJECTIONS)}")
    if not torch.cuda.is_available():
        sys.exit("bench_gemv_chain.py needs a CUDA device")
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    chain = Chain(args.shape, args.rows, args.layers, attention=args.attention, context=args.context)
    shapes = projection_shapes(args.shape)
    gemv_defaults = {name: default_config(args.rows, n, k, silu_mul=PROJECTIONS[name][0], norm=PROJECTIONS[name][1])
                     for name, (n, k) in shapes.items()}  # fmt: skip
    on_gemv = gemv_takes(args.rows, *shapes["gate_up"])
    defaults = dict(gemv_defaults, gate_up=gemv_defaults["gate_up"] if on_gemv else None)  # as the model routes it
    variants: list[tuple[str, dict]] = [("default", {}),
                                        ("unpipelined", {n: dict(c, num_stages=1) for n, c in defaults.items() if c})]  # fmt: skip
    if args.fuse_o:
        if not args.attention or args.rows != 1:
            p.error("--fuse-o needs --attention and --rows 1")
        for splits, block_o, preload in ((None, 4, True), (8, 4, True), (8, 8, True), (8, 8, False)):
            label = f"fused attention + o, splits={splits or 'backend'} BLOCK_O={block_o}" + ("" if preload else " after wait")
            variants.append((label, {"fuse_o": dict(max_splits=splits, block_o=block_o, preload=preload)}))
    for spec, decode in decode_specs:
        variants.append((f"decode {spec}", {"decode": decode}))
    for name in [s for s in args.sweep.split(",") if s]:
        if name == "gate_up":  # the other of cuBLAS and the GEMV at default_config's tile, then the grid
            variants.append(("gate_up cuBLAS", {"gate_up": None}) if on_gemv else ("gate_up GEMV", {"gate_up": gemv_defaults[name]}))
        variants += sweep(gemv_defaults[name], name, args.rows, *shapes[name], ints(args.block_n), ints(args.block_k),
                          ints(args.stages), ints(args.preload), ints(args.norm_stages))  # fmt: skip
    bw = copy_bandwidth()
    floor_ms = chain.weight_bytes / bw * 1e3
    graphs, outs, configs = {}, {}, {}
    for label, override in variants:
        cfgs = {name: override.get(name, defaults[name]) for name in shapes}
        for extra in ("fuse_o", "decode"):
            if extra in override:
                cfgs[extra] = override[extra]
        try:
            graphs[label], outs[label] = chain.capture(cfgs)
            configs[label] = cfgs
        except Exception as exc:  # a configuration Triton cannot compile: report, go on
            print(json.dumps(dict(variant=label, error=f"{type(exc).__name__}: {exc}"[:300])), flush=True)
    if args.trace and not args.attention:
        p.error("--trace needs --attention")
    times = time_graphs(graphs, args.rounds, args.replays)
    gave_up = int(chain.sync[3]) if args.attention else 0  # the fused kernel's waits that gave up: a fault
    if gave_up:
        print(json.dumps(dict(error=f"decode_attention_o: {gave_up} projection programs stopped waiting for attention")))
    traced = {}
    if args.trace:  # separate graphs: the stamps cost a little, the timed graphs hold none
        from attngraph import kernel_clock

        for label, cfgs in configs.items():
            if cfgs.get("fuse_o"):  # the fused kernel records no timestamps
                continue
            bufs = chain.new_traces(cfgs)
            graph, _ = chain.capture(cfgs, bufs)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            traced[label] = trace_summary([(kernel_clock.decode(a, ATTENTION_POINTS), kernel_clock.decode(o, GEMV_POINTS))
                                           for a, o in bufs])  # fmt: skip
            print_trace_summary(label, traced[label])
            del graph
    ref = outs["default"].float()
    rows = []
    for label, ts in times.items():
        ms = statistics.median(ts)
        err = (outs[label].float() - ref).abs().max().item()
        rows.append(dict(variant=label, ms=round(ms, 4), x_floor=round(ms / floor_ms, 3), min_ms=round(min(ts), 4),
                         max_ms=round(max(ts), 4), max_abs_diff_vs_default=err, configs=configs[label]))  # fmt: skip
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "configs"}), flush=True)
    base_ms = next(r["ms"] for r in rows if r["variant"] == "default")
    print(f"\n| variant | ms per chain | x floor | vs default |\n| --- | ---: | ---: | ---: |")
    for r in sorted(rows, key=lambda r: r["ms"]):
        print(f"| {r['variant']} | {r['ms']:.4f} | {r['x_floor']:.3f} | {r['ms'] / base_ms:.3f} |")
    best = {}
    for name in shapes:
        winner = min(own_rows(rows, name), key=lambda r: r["ms"])
        best[name] = dict(winner["configs"][name] or {"cuBLAS": 1}, ms=winner["ms"])
    print("\nbest per projection:", json.dumps(best))
    result = result_header("bench_gemv_chain.py", shape=args.shape, rows=args.rows, layers=chain.layers,
                           attention=args.attention, context=args.context if args.attention else None,
                           copy_bandwidth_GBps=round(bw / 1e9), floor_ms=round(floor_ms, 4), variants=rows, best=best,
                           traces=traced or None, fused_waits_given_up=gave_up if args.fuse_o else None)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.table_out:
        table = gemv_table(rows, shapes, args.rows)
        slower = [name for name in shapes if "cuBLAS" in best[name] and any(r["configs"].get(name) for r in rows)]
        if slower:
            print(f"--table-out: cuBLAS was faster for {', '.join(slower)}; the table holds the best GEMV tile anyway")
        with open(args.table_out, "w") as f:
            json.dump(table, f, indent=1)


def own_rows(rows: list[dict], name: str) -> list[dict]:
    """The default's row and those of the variants of projection ``name`` (labels ``name ...``)."""
    return [r for r in rows if r["variant"] == "default" or r["variant"].startswith(name + " ")]


def gemv_table(rows: list[dict], shapes: dict[str, tuple[int, int]], m: int) -> dict[str, dict]:
    """``{"plain" | "silu" | "norm": {"ROWS,N,K": config}}`` (a `bench_generate.py --gemv-table`
    file): per projection, the tile of its fastest variant that ran it on the GEMV (its own
    sweep's, or the default's), even where cuBLAS was faster: whether the GEMV serves a shape
    is the step's routing limits' to say, the table only gives its tile there."""
    table: dict[str, dict] = {}
    for name, (n, k) in shapes.items():
        own = [r for r in own_rows(rows, name) if r["configs"].get(name)]
        if not own:
            continue
        kind = "silu" if PROJECTIONS[name][0] else "norm" if PROJECTIONS[name][1] else "plain"
        table.setdefault(kind, {})[f"{rows_padded(m)},{n},{k}"] = dict(min(own, key=lambda r: r["ms"])["configs"][name])
    return table


if __name__ == "__main__":
    main()
