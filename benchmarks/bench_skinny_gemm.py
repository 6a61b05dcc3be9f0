"""Decode-step GEMMs (a few token rows times a weight matrix): cuBLAS against a Triton GEMV.

The Triton kernel here (`skinny_gemm`) spreads the weight over ``cdiv(N, BLOCK_N) * SPLIT_K``
programs, each a 16-row tensor-core tile of ``x`` against ``BLOCK_N`` weight rows; with split K
the program that finishes a column block last sums the partials in split order in the same
launch (an int32 counter per block, acquire-release, reset by that program). It is kept here as
a measured alternative, not used by attngraph: on the H200 it lost to cuBLAS at every shape.

For each projection of the Llama-3.2-1B and Llama-3.1-8B shapes (fused q/k/v, o, fused
gate/up, down, the LM head) and each row count, times every `skinny_gemm` configuration in a
sweep and ``torch.nn.functional.linear`` (cuBLAS) side by side, with the weight-read floor at
the copy bandwidth measured in the same run. Each timing replays a CUDA graph of consecutive
calls on distinct copies of the weight (more bytes than the L2 holds), as a decode graph reads
each layer's weights once; the figure is the graph's time per call, launch gaps included.

    python benchmarks/bench_skinny_gemm.py --out results/skinny_gemm.json

Prints a Markdown table (best configuration per shape and row count) and writes one JSON
object with every timing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_prefill import result_header  # noqa: E402

#: Rows of ``x`` one launch takes (the tensor-core tile's height).
MAX_ROWS = 16


@triton.jit(do_not_specialize=["M", "split_k", "k_per_split"])
def _skinny_gemm_kernel(
    X, W, Y, Part, Counters,
    M, N, K, split_k, k_per_split, stride_xm, stride_wn, stride_ym,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns = weight rows
    mask_n = offs_n < N
    offs_m = tl.arange(0, 16)  # [16] rows of x, the first M real
    mask_m = offs_m < M
    k_lo = pid_k * k_per_split
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)  # y^T tile: W rows x x rows
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = tl.load(W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        x = tl.load(X + offs_m[None, :] * stride_xm + offs_k[:, None],
                    mask=mask_m[None, :] & mask_k[:, None], other=0.0)  # [BLOCK_K, 16] = x^T
        acc = tl.dot(w, x.to(w.dtype), acc)
    y_ptrs = Y + offs_m[None, :] * stride_ym + offs_n[:, None]
    y_mask = mask_n[:, None] & mask_m[None, :]
    if not SPLIT:
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=y_mask)
    else:
        # Partials [SPLIT_K, N, 16] fp32; the last program of this column block sums them.
        part_ptrs = Part + (pid_k * N + offs_n[:, None]).to(tl.int64) * 16 + offs_m[None, :]
        tl.store(part_ptrs, acc, mask=mask_n[:, None])
        tl.debug_barrier()  # every thread's partials stored before the release below
        arrived = tl.atomic_add(Counters + pid_n, 1, sem="acq_rel")
        if arrived == split_k - 1:
            total = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
            for s in range(0, split_k):
                p = Part + (s * N + offs_n[:, None]).to(tl.int64) * 16 + offs_m[None, :]
                total += tl.load(p, mask=mask_n[:, None], other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=y_mask)
            tl.store(Counters + pid_n, 0)


class SkinnyGemmWorkspace:
    """The split-K partials ``[SPLIT_K, N, 16]`` fp32 and the zeroed counters, per device,
    grown on demand and shared by every call (calls on one stream run one after another)."""

    def __init__(self) -> None:
        self._part: dict[torch.device, torch.Tensor] = {}
        self._counters: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, part_numel: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        part = self._part.get(device)
        if part is None or part.numel() < part_numel:
            part = self._part[device] = torch.empty(part_numel, dtype=torch.float32, device=device)
        counters = self._counters.get(device)
        if counters is None or counters.numel() < blocks:
            counters = self._counters[device] = torch.zeros(blocks, dtype=torch.int32, device=device)
        return part, counters


WORKSPACE = SkinnyGemmWorkspace()


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block_n: int,
    block_k: int,
    split_k: int,
    num_warps: int = 4,
    num_stages: int = 4,
) -> torch.Tensor:
    """``x: [M, K]`` (M <= 16), ``weight: [N, K]`` -> ``out: [M, N]`` in ``x``'s dtype.

    ``split_k`` programs share each column block's K range (``K / split_k`` rounded up to
    ``block_k``); their partials are summed in split order by the last one to finish.
    """
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"skinny_gemm takes at most {MAX_ROWS} rows, got {m}")
    if weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)} and weight {tuple(weight.shape)} must share a contiguous K")
    if out is None:
        out = x.new_empty((m, n))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    blocks = triton.cdiv(n, block_n)
    part, counters = WORKSPACE.get(x.device, split_k * n * 16 if split_k > 1 else 1, blocks)
    _skinny_gemm_kernel[(blocks, split_k)](
        x, weight, out, part, counters,
        m, n, k, split_k, k_per_split, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split_k > 1,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


#: (name, N, K): output features x input features.
SHAPES = {
    "1b": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192), ("lm_head", 128256, 2048)],
    "8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336), ("lm_head", 128256, 4096)],
}
L2_BYTES = 256 * 2**20  # weight copies per timing: at least this many bytes (H200's L2: 50 MB)


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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1b,8b")
    p.add_argument("--rows", default="1,4,16")
    p.add_argument("--block-n", default="16,32,64")
    p.add_argument("--block-k", default="128,256")
    p.add_argument("--split-k", default="1,2,4,8")
    p.add_argument("--stages", default="3,4")
    p.add_argument("--no-triton", action="store_true", help="only the BLAS libraries (cuBLAS, cuBLASLt)")
    p.add_argument("--inductor", action="store_true",
                   help="also inductor at static shapes (coordinate-descent tuning) and attngraph's exact-count compile")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.inductor:  # one compile per (shape, rows)
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 256)
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    bw = copy_bandwidth()
    torch.manual_seed(0)
    rows_out = []
    print("| shape | proj | N x K | rows | floor us | cuBLAS us | cuBLASLt us | skinny us | inductor us | exact us | x floor | config |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for shape in args.shapes.split(","):
        for name, n, k in SHAPES[shape]:
            copies = max(2, -(-L2_BYTES // (n * k * 2)))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
            floor_us = n * k * 2 / bw * 1e6
            for m in ints(args.rows):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                ref = torch.nn.functional.linear(x.float(), ws[0].float())
                blas = {}
                for lib in ("cublas", "cublaslt"):
                    torch.backends.cuda.preferred_blas_library(lib)
                    blas[lib] = time_calls([lambda w=w: torch.nn.functional.linear(x, w) for w in ws])
                torch.backends.cuda.preferred_blas_library("cublas")
                cublas = blas["cublas"]
                ind_us, exact_us, gated = float("nan"), float("nan"), None
                if args.inductor:
                    tol = 0.05 * ref.abs().max().item()
                    lin = inductor_static(lambda x, w: torch.nn.functional.linear(x, w))
                    err = (lin(x, ws[0]).float() - ref).abs().max().item()
                    ind_us = time_calls([lambda w=w: lin(x, w) for w in ws]) if err < tol else float("nan")
                    ex = attngraph_exact(lambda x, w: torch.nn.functional.linear(x, w), x, ws[0])
                    got = ex(x, ws[0])
                    err = ((got[0] if isinstance(got, (tuple, list)) else got).float() - ref).abs().max().item()
                    exact_us = time_calls([lambda w=w: ex(x, w) for w in ws]) if err < tol else float("nan")
                    if name == "down":  # the MLP's SiLU(gate) * up as the GEMM's producer
                        g, u = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                        mlp = lambda g, u, w: torch.nn.functional.linear(torch.nn.functional.silu(g) * u, w)  # noqa: E731
                        mlp_ind = inductor_static(mlp)
                        mlp_ex = attngraph_exact(mlp, g, u, ws[0])
                        gated = dict(eager_us=round(time_calls([lambda w=w: mlp(g, u, w) for w in ws]), 2),
                                     inductor_us=round(time_calls([lambda w=w: mlp_ind(g, u, w) for w in ws]), 2),
                                     exact_us=round(time_calls([lambda w=w: mlp_ex(g, u, w) for w in ws]), 2))  # fmt: skip
                        print(f"| {shape} | silu(gate)*up -> down | {n} x {k} | {m} | {floor_us:.2f} | eager {gated['eager_us']:.2f} | | | {gated['inductor_us']:.2f} | {gated['exact_us']:.2f} | | |")
                timings = []
                sweep = [] if args.no_triton else itertools.product(ints(args.block_n), ints(args.block_k), ints(args.split_k), ints(args.stages))
                for bn, bk, sk, st in sweep:
                    cfg = dict(block_n=bn, block_k=bk, split_k=sk, num_stages=st)
                    out.fill_(float("nan"))
                    skinny_gemm(x, ws[0], out, **cfg)
                    err = (out.float() - ref).abs().max().item()
                    if not err < 0.05 * ref.abs().max().item():
                        timings.append({**cfg, "error": err})
                        continue
                    us = time_calls([lambda w=w: skinny_gemm(x, w, out, **cfg) for w in ws])
                    timings.append({**cfg, "us": round(us, 2)})
                best = min((t for t in timings if "us" in t), key=lambda t: t["us"], default=None)
                cfg_s = "" if best is None else f"{best['block_n']}/{best['block_k']}/{best['split_k']}/{best['num_stages']}"
                best_us = min(cublas, blas["cublaslt"], best["us"] if best else float("inf"), ind_us if ind_us == ind_us else float("inf"))
                print(f"| {shape} | {name} | {n} x {k} | {m} | {floor_us:.2f} | {cublas:.2f} | {blas['cublaslt']:.2f} | "
                      f"{best['us'] if best else float('nan'):.2f} | {ind_us:.2f} | {exact_us:.2f} | {best_us / floor_us:.2f} | {cfg_s} |")  # fmt: skip
                rows_out.append(dict(shape=shape, proj=name, n=n, k=k, rows=m, floor_us=round(floor_us, 2),
                                     cublas_us=round(cublas, 2), cublaslt_us=round(blas["cublaslt"], 2), best=best, timings=timings,
                                     inductor_static_us=round(ind_us, 2), exact_us=round(exact_us, 2), gated_down=gated))  # fmt: skip
            del ws
            torch.cuda.empty_cache()
    row = result_header("bench_skinny_gemm.py", copy_gbps=round(bw / 1e9), results=rows_out)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f)


if __name__ == "__main__":
    main()
