"""A decode step's GEMVs in the order the model runs them, per launch configuration (GPU).

`bench_skinny_gemm.py` times one projection in a graph of consecutive calls of itself. In a
decode step each GEMV follows a different kernel and, under programmatic dependent launch,
loads its first weight chunk while that kernel finishes, so a configuration that wins alone
can lose in the step. This script captures one CUDA graph per variant of the chain a batch-1
(or ``--rows``) step of the Llama-3.2-1B / 3.1-8B shape runs through its projections::

    for each of the layers (distinct weights):
        qkv  = skinny_rms_norm_linear(down, norm_w, eps, w_qkv, residual=h, h_out=h)   # GEMV
        o    = skinny_linear(qkv[:, :hidden], w_o)                                     # GEMV
        gu   = F.linear(o, w_gate_up)                                                  # cuBLAS
        down = skinny_silu_mul_linear(gu[:, :I], gu[:, I:], w_down)                    # GEMV
    logits = skinny_linear(down, w_lm_head)                                            # GEMV

(no attention, RoPE or norm kernels between them: those are the model's). A variant changes the
configuration of one projection (``qkv``, ``o``, ``down``, ``lm_head``) and keeps the others at
`default_config`'s; ``unpipelined`` runs every GEMV with ``num_stages = 1`` (one weight chunk in
flight per program, the kernel's loop before it was pipelined). The graphs are replayed in
interleaved rounds, so a drift of the clocks spreads over all variants alike; each row gives
the median time per chain and its ratio to the weight-read floor at the copy bandwidth
measured in the same run.

    python benchmarks/bench_gemv_chain.py --shape 1b --rows 1 --out results/gemv_chain.json
    python benchmarks/bench_gemv_chain.py --shape 8b --rows 1 --sweep down --stages 1,2,3

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

from attngraph.skinny_linear import (  # noqa: E402
    default_config,
    rows_padded,
    skinny_linear,
    skinny_rms_norm_linear,
    skinny_silu_mul_linear,
)

#: hidden, intermediate, q/k/v width, vocabulary, layers of each shape
SHAPES = {"1b": (2048, 8192, 3072, 128256, 16), "8b": (4096, 14336, 6144, 128256, 32)}
#: the chain's GEMVs: name -> (what default_config is asked for: silu_mul, norm)
PROJECTIONS = {"qkv": (False, True), "o": (False, False), "down": (True, False), "lm_head": (False, False)}


def projection_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """``name -> (N, K)`` of the chain's GEMVs."""
    hidden, inter, qkv, vocab, _ = SHAPES[shape]
    return {"qkv": (qkv, hidden), "o": (hidden, hidden), "down": (hidden, inter), "lm_head": (vocab, hidden)}


class Chain:
    """The weights of ``layers`` layers (random bf16, distinct per layer) and the buffers of a
    ``rows``-row step; `capture` records the chain for given configurations."""

    def __init__(self, shape: str, rows: int, layers: int | None = None) -> None:
        hidden, inter, qkv, vocab, default_layers = SHAPES[shape]
        self.layers = layers or default_layers
        self.hidden, self.inter = hidden, inter
        gen = torch.Generator(device="cuda").manual_seed(0)

        def weight(n: int, k: int) -> torch.Tensor:
            return (torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5).contiguous()

        self.w = [dict(qkv=weight(qkv, hidden), o=weight(hidden, hidden), gate_up=weight(2 * inter, hidden),
                       down=weight(hidden, inter), norm=1 + 0.1 * torch.randn(hidden, device="cuda", dtype=torch.bfloat16))
                  for _ in range(self.layers)]  # fmt: skip
        self.lm_head = weight(vocab, hidden)
        self.x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        self.h = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        self.weight_bytes = sum(t.numel() * 2 for w in self.w for k, t in w.items() if k != "norm") + self.lm_head.numel() * 2

    def run(self, configs: dict[str, dict | None]) -> torch.Tensor:
        """One pass of the chain with ``configs[name]`` (None: `default_config`'s)."""
        down = self.x
        h = self.h.clone()
        for w in self.w:
            qkv = skinny_rms_norm_linear(down, w["norm"], 1e-5, w["qkv"], residual=h, h_out=h, config=configs["qkv"])
            o = skinny_linear(qkv[:, : self.hidden], w["o"], config=configs["o"])
            gu = F.linear(o, w["gate_up"])
            down = skinny_silu_mul_linear(gu[:, : self.inter], gu[:, self.inter :], w["down"], config=configs["down"])
        return skinny_linear(down, self.lm_head, config=configs["lm_head"])

    def capture(self, configs: dict[str, dict | None]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile and warm up outside the capture
                self.run(configs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.run(configs)
        return graph, out


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


def sweep(base: dict, name: str, rows: int, n: int, k: int, block_n, block_k, stages) -> list[tuple[str, dict]]:
    """Variants of projection ``name``: its `default_config` with BLOCK_N, BLOCK_K and
    num_stages from the grids (an empty grid keeps the default's value; one 16-byte vector per
    thread at least, fp32 accumulator at most 128 values per thread)."""
    out = []
    grid = (block_n or [base["BLOCK_N"]], block_k or [base["BLOCK_K"]], stages or [base["num_stages"]])
    for bn, bk, st in itertools.product(*grid):
        cfg = dict(base, BLOCK_N=bn, BLOCK_K=bk, num_stages=st)
        if bk > k or bn * bk < 8 * 32 * cfg["num_warps"] or rows_padded(rows) * bn * bk > 128 * 32 * cfg["num_warps"]:
            continue
        if cfg != base:
            out.append((f"{name} BLOCK_N={bn} BLOCK_K={bk} stages={st}", {name: cfg}))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--layers", type=int, default=None, help="layers of the chain (default: the shape's)")
    p.add_argument("--sweep", default="qkv,o,down,lm_head", help="projections whose configurations are swept")
    p.add_argument("--block-n", default="2,4,8")
    p.add_argument("--block-k", default="512,1024")
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--table-out", default=None,
                   help="write the best configurations as a `bench_generate.py --gemv-table` JSON file")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gemv_chain.py needs a CUDA device")
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    chain = Chain(args.shape, args.rows, args.layers)
    shapes = projection_shapes(args.shape)
    defaults = {name: default_config(args.rows, n, k, silu_mul=PROJECTIONS[name][0], norm=PROJECTIONS[name][1])
                for name, (n, k) in shapes.items()}  # fmt: skip
    variants: list[tuple[str, dict]] = [("default", {}),
                                        ("unpipelined", {n: dict(c, num_stages=1) for n, c in defaults.items()})]  # fmt: skip
    for name in [s for s in args.sweep.split(",") if s]:
        variants += sweep(defaults[name], name, args.rows, *shapes[name], ints(args.block_n), ints(args.block_k),
                          ints(args.stages))  # fmt: skip
    bw = copy_bandwidth()
    floor_ms = chain.weight_bytes / bw * 1e3
    graphs, outs, configs = {}, {}, {}
    for label, override in variants:
        cfgs = {name: override.get(name, defaults[name]) for name in shapes}
        try:
            graphs[label], outs[label] = chain.capture(cfgs)
            configs[label] = cfgs
        except Exception as exc:  # a configuration Triton cannot compile: report, go on
            print(json.dumps(dict(variant=label, error=f"{type(exc).__name__}: {exc}"[:300])), flush=True)
    times = time_graphs(graphs, args.rounds, args.replays)
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
        own = [r for r in rows if r["variant"] == "default" or r["variant"].startswith(name + " ")]
        winner = min(own, key=lambda r: r["ms"])
        best[name] = dict(winner["configs"][name], ms=winner["ms"])
    print("\nbest per projection:", json.dumps(best))
    result = result_header("bench_gemv_chain.py", shape=args.shape, rows=args.rows, layers=chain.layers,
                           copy_bandwidth_GBps=round(bw / 1e9), floor_ms=round(floor_ms, 4), variants=rows, best=best)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.table_out:  # {"plain" | "silu" | "norm": {"ROWS,N,K": config}}
        table: dict[str, dict] = {}
        for name, (n, k) in shapes.items():
            kind = "silu" if PROJECTIONS[name][0] else "norm" if PROJECTIONS[name][1] else "plain"
            table.setdefault(kind, {})[f"{rows_padded(args.rows)},{n},{k}"] = {key: v for key, v in best[name].items() if key != "ms"}
        with open(args.table_out, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
