"""Decode-step GEMMs (a few token rows times a weight matrix): cuBLAS against attngraph's Triton GEMV.

The GEMV is `attngraph.skinny_linear`: ``cdiv(N, BLOCK_N) * SPLIT_K`` programs, each streaming
``BLOCK_N`` weight rows once and using each weight tile for all (at most 8) rows of ``x``,
fp32 accumulation without tensor cores; with split K the program that finishes a column block
last sums the partials in split order in the same launch. `skinny_silu_mul_linear` also computes
the MLP's ``silu(gate) * up`` while loading ``x``. (The tensor-core split-K Triton kernel this
script timed before lost to cuBLAS at every shape and is gone: see BENCHMARKS.md.)

For each projection of the Llama-3.2-1B and Llama-3.1-8B shapes (fused q/k/v, o, fused
gate/up, down, the LM head) and each row count, times the GEMV at the configuration attngraph
picks (`default_config`: `TUNED`, else the heuristic) and at every configuration of a pruned
sweep, with ``torch.nn.functional.linear`` (cuBLAS, cuBLASLt) side by side and the weight-read
floor at the copy bandwidth measured in the same run; for the down projection also the fused
``silu(gate) * up`` variant against eager ``F.linear(F.silu(a) * b, w)``. Each timing replays a
CUDA graph of consecutive calls on distinct copies of the weight (more bytes than the L2
holds), as a decode graph reads each layer's weights once; the figure is the graph's time per
call, launch gaps included.

    python benchmarks/bench_skinny_gemm.py --out results/skinny_gemm.json
    python benchmarks/bench_skinny_gemm.py --quick   # ~12 configurations per shape, a few minutes
    python benchmarks/bench_skinny_gemm.py --quick --norm --rows 1   # + RMSNorm folded into q/k/v, gate/up
    python benchmarks/bench_skinny_gemm.py --dot --rows 4,16 --no-gemv   # + the tensor-core kernel (3-16 rows)
    python benchmarks/bench_skinny_gemm.py --dot --dot-default --norm --rows 16 --no-gemv --shapes 1b   # + RMSNorm variants
    python benchmarks/bench_skinny_gemm.py --dot --no-gemv --projections gate_up --rows 16,4   # the gated tiles only

``--dot`` adds `attngraph.skinny_dot` (3-16 rows on tensor cores, SiLU * up folded for the down
projection) at its default configuration and the best of a small sweep (`DOT_SWEEP`;
``--dot-default``: none), beside cuBLAS, as ``dot`` entries of the JSON and a table of its own;
the q/k/v also with q and k rotated in the epilogue, alone and behind the norm's launch (a
batched decode step's), the gate/up with SiLU * up in its epilogue over a few tiles (`time_dot_gated`,
`CompileConfig.fuse_gated_mlp`) beside the product and the SiLU-mul kernel, and with ``--norm``
the q/k/v and gate/up behind a residual add + RMSNorm three ways (`time_dot_norm`).

Prints a Markdown table (the default and the best configuration per shape and row count),
writes one JSON object with every timing, and ends with the best configurations as the
``TUNED`` / ``TUNED_SILU_MUL`` dict literals of ``attngraph/skinny_linear.py``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_prefill import result_header  # noqa: E402

from attngraph import skinny_dot  # noqa: E402
from attngraph.linear_ops import DOT_MIN_ROWS  # noqa: E402
from attngraph.rms_norm import add_rms_norm  # noqa: E402
from attngraph.skinny_linear import (  # noqa: E402
    MAX_ROWS,
    NUM_SMS,
    default_config,
    rows_padded,
    skinny_linear,
    skinny_rms_norm_linear,
    skinny_silu_mul_linear,
)
from attngraph.skinny_linear import silu_mul as skinny_linear_silu_mul  # noqa: E402

#: (name, N, K): output features x input features.
SHAPES = {
    "1b": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192), ("lm_head", 128256, 2048)],
    "8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336), ("lm_head", 128256, 4096)],
}
#: The fused q/k/v's rotated columns (q and k heads) and head dim per shape.
ROPE_COLUMNS = {"1b": (2560, 64), "8b": (5120, 128)}
L2_BYTES = 256 * 2**20  # weight copies per timing: at least this many bytes (H200's L2: 50 MB)
CONFIG_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "SPLIT_K")
#: Largest fp32 accumulator (``ROWS x BLOCK_N x BLOCK_K``) per thread a swept config may have.
MAX_ACC_PER_THREAD = 128


def sweep_configs(rows: int, n: int, k: int, *, block_n, block_k, warps, stages, split_k, limit: int,
                  silu_mul: bool = False) -> list[dict]:  # fmt: skip
    """The configurations to time for ``rows`` x ``[n, k]``: `default_config`'s first, then the
    grid's pruned to

    * a weight tile of at least one 16-byte vector (8 bf16) per thread and an fp32 accumulator
      of at most `MAX_ACC_PER_THREAD` values per thread (``rows`` padded to a power of two);
    * ``BLOCK_K`` no wider than ``k`` rounded up to a power of two (at least 128);
    * at least one program per SM (``cdiv(n, BLOCK_N) * SPLIT_K >= NUM_SMS``);
    * split K only where the column blocks are fewer than 4 per SM, each split two chunks or more;

    nearest the default first (distance in log2 steps of each field), at most ``limit`` in all."""
    base = default_config(rows, n, k, silu_mul=silu_mul)
    padded = rows_padded(rows)
    log2 = lambda v: math.log2(max(v, 1))  # noqa: E731

    def distance(c: dict) -> float:
        return (abs(log2(c["BLOCK_N"]) - log2(base["BLOCK_N"])) + abs(log2(c["BLOCK_K"]) - log2(base["BLOCK_K"]))
                + abs(log2(c["num_warps"]) - log2(base["num_warps"])) + 0.5 * abs(c["num_stages"] - base["num_stages"])
                + abs(log2(c["SPLIT_K"]) - log2(base["SPLIT_K"])))  # fmt: skip

    out = []
    for bn, bk, w, st, sk in itertools.product(block_n, block_k, warps, stages, split_k):
        threads = 32 * w
        blocks = -(-n // bn)
        if bn * bk < 8 * threads or padded * bn * bk > MAX_ACC_PER_THREAD * threads:
            continue
        if bk > max(128, 1 << max(k - 1, 0).bit_length()) or blocks * sk < NUM_SMS:
            continue
        if sk > 1 and (blocks >= 4 * NUM_SMS or k < sk * 2 * bk):
            continue
        cfg = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st, SPLIT_K=sk)
        if cfg != base:
            out.append(cfg)
    out.sort(key=lambda c: (distance(c), tuple(c[key] for key in CONFIG_KEYS)))
    return [base] + out[: max(limit - 1, 0)]


def config_str(c: dict | None) -> str:
    """``BLOCK_N/BLOCK_K/warps/stages/split`` of a config (empty for None)."""
    return "" if c is None else "{BLOCK_N}/{BLOCK_K}/w{num_warps}/s{num_stages}/k{SPLIT_K}".format(**c)


def tuned_literal(name: str, best: dict[tuple[int, int, int], dict]) -> str:
    """``name = {(rows_padded, N, K): {...config...}, ...}``: a literal to paste into
    ``attngraph/skinny_linear.py`` (keys sorted, one entry per line)."""
    lines = [f"{name}: dict[tuple[int, int, int], dict[str, int]] = {{"]
    for key in sorted(best):
        cfg = ", ".join(f"{k!r}: {int(best[key][k])}" for k in CONFIG_KEYS)
        lines.append(f"    {key!r}: {{{cfg}}},")
    lines.append("}")
    return "\n".join(lines)


def record_best(table: dict, m: int, n: int, k: int, best: dict | None) -> None:
    """Put ``best`` (a timing with its config) into ``table`` under ``(rows_padded(m), n, k)``;
    a row count that is its own padding wins over a padded one (3 rows share 4's entry)."""
    if best is None:
        return
    key = (rows_padded(m), n, k)
    if key not in table or m == key[0]:
        table[key] = {c: best[c] for c in CONFIG_KEYS}


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write counted)."""
    a = torch.empty(2**29, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    return 2 * a.numel() * 2 * 10 / (start.elapsed_time(end) / 1e3)


def time_calls(calls) -> float:
    """Microseconds per call of the list ``calls`` replayed as one CUDA graph."""
    for c in calls[:2]:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 10
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(calls))


def inductor_static(fn):
    """``fn`` compiled by inductor for static shapes with coordinate-descent tuning: at one row
    inductor turns ``mm`` into a multiply-and-sum reduction (its matrix-vector form) and fuses
    pointwise producers into it."""
    return torch.compile(fn, dynamic=False, options={"coordinate_descent_tuning": True})


def attngraph_exact(fn, *args):
    """``fn`` compiled as attngraph compiles a piece for an exact token count
    (`compiler.specialize.compile_exact`: skinny products as reductions, rows innermost)."""
    from attngraph.compiler.specialize import compile_exact, static_fakes
    from attngraph.config import EXACT_INDUCTOR_OPTIONS

    gm = torch.fx.symbolic_trace(fn)
    return compile_exact(gm, static_fakes(gm, args), EXACT_INDUCTOR_OPTIONS)


def time_gemv(run, ws, out: torch.Tensor, ref: torch.Tensor, configs: list[dict]) -> tuple[dict, list[dict]]:
    """Time ``run(w, cfg)`` (writing ``out``) over the weight copies ``ws`` for the default
    (``cfg=None``) and each of ``configs``. A config is timed only if its output, written over
    NaN, is within 1% of ``ref``'s largest magnitude; otherwise (or when it fails to compile)
    its entry carries ``error``. Returns ``(default timing, sweep timings)``."""
    tol = 0.01 * ref.abs().max().item()

    def one(cfg: dict | None) -> dict:
        entry = dict(cfg) if cfg is not None else {}
        try:
            out.fill_(float("nan"))
            run(ws[0], cfg)
            err = (out.float() - ref).abs().max().item()
            if not err < tol:
                return {**entry, "error": err}
            return {**entry, "us": round(time_calls([lambda w=w: run(w, cfg) for w in ws]), 2)}
        except Exception as exc:  # a config out of registers / shared memory: recorded, skipped
            torch.cuda.synchronize()
            return {**entry, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}

    return one(None), [one(c) for c in configs]


def fastest(timings: list[dict]) -> dict | None:
    """The timing with the fewest microseconds (None if none ran)."""
    return min((t for t in timings if "us" in t), key=lambda t: t["us"], default=None)


def us_of(timing: dict | None) -> float:
    """A timing's microseconds; NaN for None or a config that failed."""
    return (timing or {}).get("us", float("nan"))


#: The tensor-core kernel's sweep (``--dot``): 64- and 128-row weight tiles, K split 1-4 ways,
#: 3-6 pipeline stages, 128-wide K chunks, four warps.
DOT_SWEEP = [dict(BLOCK_N=bn, BLOCK_K=128, SPLIT_K=sk, num_warps=4, num_stages=st)
             for bn, sk, st in itertools.product((64, 128), (1, 2, 4), (3, 4, 6))]  # fmt: skip


def time_dot(x, ws, out, ref, n: int, k: int, gate_up=None, sweep: bool = True) -> dict:
    """`skinny_dot` at ``default_config`` and (``sweep``) over `DOT_SWEEP` (configs whose split
    leaves a chunk per split); with ``gate_up = (g, u)`` the SiLU * up fold (``ref`` of that
    product)."""
    if gate_up is None:
        run = lambda w, cfg: skinny_dot.skinny_dot_linear(x, w, out=out, config=cfg)  # noqa: E731
    else:
        run = lambda w, cfg: skinny_dot.skinny_dot_silu_mul_linear(*gate_up, w, out=out, config=cfg)  # noqa: E731
    base = skinny_dot.default_config(n, k)
    configs = [base] + [c for c in DOT_SWEEP if sweep and k >= c["SPLIT_K"] * c["BLOCK_K"] and c != base]
    _, timings = time_gemv(run, ws, out, ref, configs)  # the launcher's own pick is configs[0]
    return dict(default=timings[0], default_config=base, best=fastest(timings), timings=timings)


#: Tiles of the gated gate/up (``--dot`` rows of a gate/up): ``BLOCK_N`` rows of the fused
#: weight per program, half from each half; K unsplit (the epilogue needs both whole products).
GATED_SWEEP = [dict(BLOCK_N=bn, BLOCK_K=128, SPLIT_K=1, num_warps=w, num_stages=st)
               for bn, w, st in ((32, 4, 4), (64, 4, 4), (64, 4, 6), (128, 4, 3), (128, 8, 3), (128, 8, 4))]  # fmt: skip


def time_dot_gated(x, ws, sweep: bool = True) -> dict:
    """A gated MLP's activation from the fused ``[2I, K]`` weights ``ws`` on tensor cores,
    SiLU * up in the gate/up product's epilogue (`skinny_dot_gated_linear`, what
    `CompileConfig.fuse_gated_mlp` runs at 3-16 rows), at its default tile and (``sweep``)
    `GATED_SWEEP`; beside it, the plain product followed by the SiLU-mul kernel (the step
    without the fusion), both at default tiles. ``x: [M, K]``."""
    i = ws[0].shape[0] // 2
    out = torch.empty(x.shape[0], i, device=x.device, dtype=x.dtype)
    full = torch.empty(x.shape[0], 2 * i, device=x.device, dtype=x.dtype)
    ref = F.silu(F.linear(x.float(), ws[0][:i].float())) * F.linear(x.float(), ws[0][i:].float())
    run = lambda w, cfg: skinny_dot.skinny_dot_gated_linear(x, w, out=out, config=cfg)  # noqa: E731
    base = dict(skinny_dot.GATED_CONFIG)  # the launcher's pick (it halves BLOCK_N per half)
    configs = [base] + [c for c in GATED_SWEEP if sweep and c != base]
    _, timings = time_gemv(run, ws, out, ref, configs)

    def separate(w):
        skinny_dot.skinny_dot_linear(x, w, out=full)
        return skinny_linear_silu_mul(full[:, :i], full[:, i:])

    return dict(default=timings[0], default_config=base, best=fastest(timings), timings=timings,
                product_then_silu_mul_us=round(time_calls([lambda w=w: separate(w) for w in ws]), 2))  # fmt: skip


def norm_operands(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual ``[M, K]`` and an RMSNorm weight ``[K]`` (near 1) for the input ``x: [M, K]``."""
    return torch.randn_like(x), torch.randn(x.shape[1], device=x.device, dtype=x.dtype) * 0.1 + 1.0


def time_dot_norm(x, ws, out, m: int, k: int, column_block: int = 64) -> dict:
    """A residual add + RMSNorm in front of the tensor-core kernel, three ways (default
    configs): the norm kernel then the plain product; the norm folded with every program's pass
    over the rows for their statistics (`skinny_dot_rms_norm_linear` with a residual); the norm
    folded with the statistics read as partial sums of squares, one per ``column_block``
    columns (what a producer's column blocks would write), over the summed rows ``h``."""
    r, nw = norm_operands(x)
    eps, h_out = 1e-5, torch.empty_like(x)
    normed, h = add_rms_norm(x, nw, eps, r)
    ss = h.float().pow(2).view(m, -1, column_block).sum(-1).t().contiguous()  # [k / column_block, m]
    want = skinny_dot.skinny_dot_linear(normed, ws[0])
    got = skinny_dot.skinny_dot_rms_norm_linear(h, nw, eps, ws[0], sum_squares=ss)
    return dict(
        norm_then_dot_us=round(time_calls([lambda w=w: skinny_dot.skinny_dot_linear(add_rms_norm(x, nw, eps, r)[0], w, out=out)
                                           for w in ws]), 2),  # fmt: skip
        fold_us=round(time_calls([lambda w=w: skinny_dot.skinny_dot_rms_norm_linear(x, nw, eps, w, residual=r, out=out,
                                                                                     h_out=h_out) for w in ws]), 2),  # fmt: skip
        sum_squares_us=round(time_calls([lambda w=w: skinny_dot.skinny_dot_rms_norm_linear(h, nw, eps, w, out=out, sum_squares=ss)
                                         for w in ws]), 2),  # fmt: skip
        parts=ss.shape[0],
        max_abs_diff_vs_norm_then_dot=(got.float() - want.float()).abs().max().item(),
    )


def time_dot_rope(x, ws, out, rope_cols: int, head_dim: int) -> dict:
    """The fused q/k/v product with its first ``rope_cols`` columns rotated in the tensor-core
    kernel's epilogue (`passes.fold_rope_linear`; default configs), alone and behind the
    residual add + RMSNorm launch (a batched decode step's q/k/v)."""
    angles = torch.rand(x.shape[0], head_dim // 2, device=x.device) * 6.0
    cos = torch.cat([angles.cos()] * 2, -1).to(x.dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(x.dtype)
    r, nw = norm_operands(x)
    rope = dict(rope_cos=cos, rope_sin=sin, rope_cols=rope_cols)
    return dict(
        rope_us=round(time_calls([lambda w=w: skinny_dot.skinny_dot_linear(x, w, out=out, **rope) for w in ws]), 2),
        norm_then_rope_us=round(time_calls([lambda w=w: skinny_dot.skinny_dot_linear(add_rms_norm(x, nw, 1e-5, r)[0], w,
                                                                                      out=out, **rope) for w in ws]), 2),
        rope_cols=rope_cols, head_dim=head_dim,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1b,8b")
    p.add_argument("--projections", default="", help="projection names to time (qkv,o,gate_up,down,lm_head); all when empty")
    p.add_argument("--rows", default="1,2,4,8", help=f"row counts, each at most {MAX_ROWS}")
    p.add_argument("--block-n", default="2,4,8,16,32")
    p.add_argument("--block-k", default="128,256,512,1024")
    p.add_argument("--warps", default="2,4,8")
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--split-k", default="1,2,4,8")
    p.add_argument("--max-configs", type=int, default=60, help="configurations timed per shape and row count")
    p.add_argument("--quick", action="store_true", help="at most 12 configurations per shape and row count")
    p.add_argument("--no-triton", action="store_true", help="only the BLAS libraries (cuBLAS, cuBLASLt)")
    p.add_argument("--inductor", action="store_true",
                   help="also inductor at static shapes (coordinate-descent tuning) and attngraph's exact-count compile")
    p.add_argument("--norm", action="store_true",
                   help="also q/k/v and gate/up behind a residual add + RMSNorm: one norm launch + cuBLAS against the fold "
                        "(with --dot also on tensor cores: norm kernel + product, the fold, the fold given partial sums "
                        "of squares)")
    p.add_argument("--dot", action="store_true", help="also the tensor-core kernel (attngraph.skinny_dot) at 3-16 rows")
    p.add_argument("--dot-heads", action="store_true", help="with --dot: the LM heads on tensor cores too")
    p.add_argument("--dot-default", action="store_true", help="with --dot: its default configuration only, no sweep")
    p.add_argument("--no-gemv", action="store_true", help="skip the GEMV's sweeps (with --dot: cuBLAS and the tensor-core kernel)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.no_gemv:
        args.no_triton = True
    known = {name for shape in SHAPES.values() for name, _, _ in shape}
    if args.projections and not set(args.projections.split(",")) <= known:
        p.error(f"--projections takes names from {sorted(known)}; got {args.projections!r}")
    if args.inductor:  # one compile per (shape, rows)
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 256)
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    limit = min(args.max_configs, 12) if args.quick else args.max_configs
    grid = dict(block_n=ints(args.block_n), block_k=ints(args.block_k), warps=ints(args.warps), stages=ints(args.stages),
                split_k=ints(args.split_k), limit=limit)  # fmt: skip
    bw = copy_bandwidth()
    torch.manual_seed(0)
    rows_out = []
    tuned: dict[tuple[int, int, int], dict] = {}
    tuned_silu: dict[tuple[int, int, int], dict] = {}
    tuned_norm: dict[tuple[int, int, int], dict] = {}
    dot_lines = []
    print("| shape | proj | N x K | rows | floor us | cuBLAS us | cuBLASLt us | gemv default us | gemv best us | inductor us "
          "| exact us | best x floor | default config | best config |")  # fmt: skip
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for shape in args.shapes.split(","):
        for name, n, k in SHAPES[shape]:
            if args.projections and name not in args.projections.split(","):
                continue
            copies = max(2, -(-L2_BYTES // (n * k * 2)))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
            floor_us = n * k * 2 / bw * 1e6
            for m in ints(args.rows):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                ref = F.linear(x.float(), ws[0].float())
                blas = {}
                for lib in ("cublas", "cublaslt"):
                    torch.backends.cuda.preferred_blas_library(lib)
                    blas[lib] = time_calls([lambda w=w: F.linear(x, w) for w in ws])
                torch.backends.cuda.preferred_blas_library("cublas")
                cublas = blas["cublas"]
                ind_us, exact_us, gated = float("nan"), float("nan"), None
                if args.inductor:
                    tol = 0.05 * ref.abs().max().item()
                    lin = inductor_static(lambda x, w: F.linear(x, w))
                    err = (lin(x, ws[0]).float() - ref).abs().max().item()
                    ind_us = time_calls([lambda w=w: lin(x, w) for w in ws]) if err < tol else float("nan")
                    ex = attngraph_exact(lambda x, w: F.linear(x, w), x, ws[0])
                    got = ex(x, ws[0])
                    err = ((got[0] if isinstance(got, (tuple, list)) else got).float() - ref).abs().max().item()
                    exact_us = time_calls([lambda w=w: ex(x, w) for w in ws]) if err < tol else float("nan")
                if name == "down":  # the MLP's SiLU(gate) * up as the GEMM's producer
                    gu = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
                    g, u = gu[:, :k], gu[:, k:]  # the halves of a fused gate/up output
                    mlp = lambda g, u, w: F.linear(F.silu(g) * u, w)  # noqa: E731
                    gated = dict(eager_us=round(time_calls([lambda w=w: mlp(g, u, w) for w in ws]), 2))
                    if args.inductor:  # compiled for (and called with) contiguous gate and up
                        gc, uc = g.contiguous(), u.contiguous()
                        mlp_ind = inductor_static(mlp)
                        mlp_ex = attngraph_exact(mlp, gc, uc, ws[0])
                        gated["inductor_us"] = round(time_calls([lambda w=w: mlp_ind(gc, uc, w) for w in ws]), 2)
                        gated["exact_us"] = round(time_calls([lambda w=w: mlp_ex(gc, uc, w) for w in ws]), 2)
                    if not args.no_triton and m <= MAX_ROWS:
                        h = (F.silu(g.float()) * u.float()).to(torch.bfloat16)  # rounded once, as the kernel
                        default, timings = time_gemv(
                            lambda w, cfg: skinny_silu_mul_linear(g, u, w, out=out, config=cfg), ws, out,
                            F.linear(h.float(), ws[0].float()), sweep_configs(m, n, k, silu_mul=True, **grid),
                        )  # fmt: skip
                        best = fastest(timings)
                        record_best(tuned_silu, m, n, k, best)
                        gated.update(gemv_default=default, gemv_default_config=default_config(m, n, k, silu_mul=True),
                                     gemv_best=best, gemv_timings=timings)  # fmt: skip
                    nan = float("nan")
                    d_us, b_us = us_of(gated.get("gemv_default")), us_of(gated.get("gemv_best"))
                    best_us = min(v for v in (gated["eager_us"], d_us, b_us, gated.get("inductor_us", nan)) if v == v)
                    print(f"| {shape} | silu(gate)*up -> down | {n} x {k} | {m} | {floor_us:.2f} | eager {gated['eager_us']:.2f} | "
                          f"| {d_us:.2f} | {b_us:.2f} | {gated.get('inductor_us', nan):.2f} | {gated.get('exact_us', nan):.2f} "
                          f"| {best_us / floor_us:.2f} | {config_str(gated.get('gemv_default_config'))} "
                          f"| {config_str(gated.get('gemv_best'))} |")  # fmt: skip
                if args.norm and name in ("qkv", "gate_up") and not args.no_triton and m <= MAX_ROWS:
                    # the residual add + RMSNorm in front: one norm launch + cuBLAS, or folded into the GEMV
                    r = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    nw = torch.randn(k, device="cuda", dtype=torch.bfloat16) * 0.1 + 1.0
                    h_out = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
                    normed, _ = add_rms_norm(x, nw, 1e-5, r)
                    separate = time_calls([lambda w=w: F.linear(add_rms_norm(x, nw, 1e-5, r)[0], w) for w in ws])
                    fold = lambda w, cfg: skinny_rms_norm_linear(x, nw, 1e-5, w, residual=r, out=out, h_out=h_out, config=cfg)  # noqa: E731
                    default, timings = time_gemv(fold, ws, out, F.linear(normed.float(), ws[0].float()),
                                                 sweep_configs(m, n, k, **grid))  # fmt: skip
                    best = fastest(timings)
                    record_best(tuned_norm, m, n, k, best)
                    d_us, b_us = us_of(default), us_of(best)
                    print(f"| {shape} | add+rmsnorm -> {name} | {n} x {k} | {m} | {floor_us:.2f} | norm + cuBLAS {separate:.2f} | "
                          f"| {d_us:.2f} | {b_us:.2f} | | | {min(separate, b_us) / floor_us:.2f} | "
                          f"{config_str(default_config(m, n, k, norm=True))} | {config_str(best)} |")  # fmt: skip
                    normed_row = dict(separate_us=round(separate, 2), gemv_default=default, gemv_best=best, gemv_timings=timings)
                else:
                    normed_row = None
                dot = None
                # the heads (`linear_ops.KERNEL_MIN_HEAD_RATIO`, `DOT_HEADS`) are long to time: --dot-heads
                if args.dot and DOT_MIN_ROWS <= m <= skinny_dot.MAX_ROWS and (name != "lm_head" or args.dot_heads):
                    dot = {"plain": time_dot(x, ws, out, ref, n, k, sweep=not args.dot_default)}
                    line = f"| {shape} | {name} | {n} x {k} | {m} | {floor_us:.2f} | {cublas:.2f} | {us_of(dot['plain']['default']):.2f} | " \
                           f"{us_of(dot['plain']['best']):.2f} | {config_str(dot['plain']['best'])} |"
                    dot_lines.append(line)
                    if name == "qkv":
                        dot["rope"] = time_dot_rope(x, ws, out, *ROPE_COLUMNS[shape])
                        dr = dot["rope"]
                        dot_lines.append(f"| {shape} | {name}, q and k rotated | {n} x {k} | {m} | {floor_us:.2f} | "
                                         f"behind the norm kernel {dr['norm_then_rope_us']:.2f} | {dr['rope_us']:.2f} | | |")  # fmt: skip
                    if name == "gate_up":
                        dot["gated"] = time_dot_gated(x, ws, sweep=not args.dot_default)
                        dg = dot["gated"]
                        dot_lines.append(f"| {shape} | gate_up, SiLU * up in the epilogue | {n} x {k} | {m} | {floor_us:.2f} | "
                                         f"product + SiLU-mul kernel {dg['product_then_silu_mul_us']:.2f} | "
                                         f"{us_of(dg['default']):.2f} | {us_of(dg['best']):.2f} | {config_str(dg['best'])} |")  # fmt: skip
                    if args.norm and name in ("qkv", "gate_up"):
                        dot["norm"] = time_dot_norm(x, ws, out, m, k)
                        nd = dot["norm"]
                        dot_lines.append(f"| {shape} | add+rmsnorm -> {name} | {n} x {k} | {m} | {floor_us:.2f} | "
                                         f"norm kernel + dot {nd['norm_then_dot_us']:.2f} | folded, statistics pass "
                                         f"{nd['fold_us']:.2f} | from {nd['parts']} sums of squares {nd['sum_squares_us']:.2f} | |")  # fmt: skip
                    if gated is not None:
                        h = (F.silu(g.float()) * u.float()).to(torch.bfloat16)
                        dot["silu_mul"] = time_dot(x, ws, out, F.linear(h.float(), ws[0].float()), n, k, gate_up=(g, u),
                                                   sweep=not args.dot_default)
                        dot_lines.append(f"| {shape} | silu(gate)*up -> down | {n} x {k} | {m} | {floor_us:.2f} | "
                                         f"eager {gated['eager_us']:.2f} | {us_of(dot['silu_mul']['default']):.2f} | "
                                         f"{us_of(dot['silu_mul']['best']):.2f} | {config_str(dot['silu_mul']['best'])} |")  # fmt: skip
                default, timings, best = None, [], None
                if not args.no_triton and m <= MAX_ROWS:
                    default, timings = time_gemv(lambda w, cfg: skinny_linear(x, w, out=out, config=cfg), ws, out, ref,
                                                 sweep_configs(m, n, k, **grid))  # fmt: skip
                    best = fastest(timings)
                    record_best(tuned, m, n, k, best)
                d_us, b_us = us_of(default), us_of(best)
                best_us = min(v for v in (cublas, blas["cublaslt"], d_us, b_us, ind_us) if v == v)
                default_cfg = default_config(m, n, k) if m <= MAX_ROWS else None
                print(f"| {shape} | {name} | {n} x {k} | {m} | {floor_us:.2f} | {cublas:.2f} | {blas['cublaslt']:.2f} | "
                      f"{d_us:.2f} | {b_us:.2f} | {ind_us:.2f} | {exact_us:.2f} | {best_us / floor_us:.2f} | "
                      f"{config_str(default_cfg)} | {config_str(best)} |")  # fmt: skip
                rows_out.append(dict(shape=shape, proj=name, n=n, k=k, rows=m, floor_us=round(floor_us, 2),
                                     cublas_us=round(cublas, 2), cublaslt_us=round(blas["cublaslt"], 2),
                                     gemv_default=default, gemv_default_config=default_cfg, best=best, timings=timings,
                                     inductor_static_us=round(ind_us, 2), exact_us=round(exact_us, 2), gated_down=gated,
                                     normed=normed_row, dot=dot))  # fmt: skip
            del ws
            torch.cuda.empty_cache()
    if dot_lines:
        print("\n## The tensor-core kernel (attngraph.skinny_dot), microseconds per call")
        print("| shape | proj | N x K | rows | floor us | cuBLAS us | dot default us | dot best us | best config |")
        print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
        print("\n".join(dot_lines))
    print("\n# Best measured configurations, for attngraph/skinny_linear.py:")
    print(tuned_literal("TUNED", tuned))
    print(tuned_literal("TUNED_SILU_MUL", tuned_silu))
    if tuned_norm:
        print(tuned_literal("TUNED_NORM", tuned_norm))
    row = result_header("bench_skinny_gemm.py", copy_gbps=round(bw / 1e9), results=rows_out,
                        tuned={repr(key): cfg for key, cfg in sorted(tuned.items())},
                        tuned_silu_mul={repr(key): cfg for key, cfg in sorted(tuned_silu.items())},
                        tuned_norm={repr(key): cfg for key, cfg in sorted(tuned_norm.items())})  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f)


if __name__ == "__main__":
    main()
