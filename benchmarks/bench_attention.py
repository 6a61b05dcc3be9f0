"""Attention alone, per backend: paged decode (bandwidth) and prefill (TFLOP/s), on one GPU.

Run from the project root on a machine with an NVIDIA GPU (set-up: benchmarks/BENCHMARKS.md)::

    python benchmarks/bench_attention.py [--quick] [--backends flashinfer,triton,torch_native]
        [--out benchmarks/results/attention_<time>.json]

Numbers reported per (op, shape, backend):

* ``kernel_ms``: one layer's ``backend.forward`` with the step's metadata already built (and,
  for prefill, the new K/V already in the pool: ``save_kv_cache=False``). Measured with CUDA
  events around ``n`` back-to-back calls queued behind ``torch.cuda._sleep`` so that the
  host's launch overhead does not show (the median of several such batches, divided by ``n``).
* ``step_ms``: ``init_forward_metadata`` + one ``forward`` (with the K/V write), timed per call
  with no queueing trick: what one step costs when the model has a single layer, host
  overhead included.
* decode: ``GB/s`` = bytes of K and V read (``sum(seq_lens) * Hkv * D * 2 * itemsize``) per
  ``kernel_ms``, and its share of the device-to-device copy bandwidth measured in the same run
  (``copy_GB/s`` counts read + write bytes of a 1 GiB ``copy_``).
* prefill: ``TFLOP/s`` = causal attention FLOPs (``4 * Hq * D`` per visible (query, key) pair)
  per ``kernel_ms``.

torch_native is the per-request reference (a Python loop with host syncs), shown for scale.
``--min-split-lens`` and ``--decode-block-ns`` time Triton's decode once per shortest split or
key-block size (``--decode-block-ns 64,256 --head-dim 64 --decode-only``: the 1B's heads).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attngraph.attn_backends.base import AttentionLayer, ModelAttentionSpec  # noqa: E402
from attngraph.attn_backends.registry import get_backend_class  # noqa: E402
from attngraph.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from attngraph.runtime.kv_pool import KVPool  # noqa: E402

HQ, HKV, D, PAGE, DTYPE = 32, 8, 128, 16, torch.bfloat16
DECODE_SHAPES = [(64, 2048), (1, 2048), (16, 8192), (128, 4096)]  # (batch, KV length)
PREFILL_SHAPES = [(4, 2048, 0), (1, 8192, 0), (4, 512, 3584)]  # (batch, new tokens, cached prefix)
CLOCK_HZ = 1.98e9  # H200 SM clock, only to size the torch.cuda._sleep that hides launch overhead


# ---------------------------------------------------------------------------------- timing
def gpu_ms(fn, *, reps: int = 7, budget_s: float = 0.2) -> float:
    """Median GPU time of ``fn`` in ms, launches queued behind a sleep kernel."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = max(time.perf_counter() - t0, 1e-6)
    n = max(1, min(200, int(budget_s / reps / once)))
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(min(once * n * 1.5, 1.0) * CLOCK_HZ))  # host enqueues meanwhile
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / n)
    return statistics.median(samples)


def wall_ms(fn, *, iters: int = 30) -> float:
    """Median per-call time in ms with CUDA events, no queueing (host overhead included)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy of 1 GiB, read + write bytes per second, in GB/s."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = gpu_ms(lambda: y.copy_(x), reps=9)
    return 2 * x.numel() / (ms * 1e-3) / 1e9


# ---------------------------------------------------------------------------------- setup
def make_step(batch: int, new: int, prefix: int, mode: ForwardMode, gen: torch.Generator):
    """A pool with random KV for ``batch`` requests of ``prefix + new`` tokens, and the batch."""
    seq = prefix + new
    pool = KVPool(
        1, HKV, D, num_pages=batch * math.ceil(seq / PAGE) + 8, page_size=PAGE, dtype=DTYPE,
        device="cuda", max_requests=batch, max_context_len=seq,
    )
    pool.k_buffers[0].normal_(generator=gen)
    pool.v_buffers[0].normal_(generator=gen)
    rows = [pool.alloc_request() for _ in range(batch)]
    for frac in (0.5, 1.0):  # interleave pages of the requests, as a running server would
        pool.reserve(rows, [max(1, int(seq * frac))] * batch)
    t = batch * new
    fb = ForwardBatch.build(pool, rows, [prefix] * batch, [new] * batch, torch.zeros(t, dtype=torch.long), mode=mode)
    q = torch.randn(t, HQ, D, device="cuda", dtype=DTYPE, generator=gen)
    k = torch.randn(t, HKV, D, device="cuda", dtype=DTYPE, generator=gen)
    v = torch.randn(t, HKV, D, device="cuda", dtype=DTYPE, generator=gen)
    return fb, q, k, v


def make_backend(name: str, min_split_lens: list[int] | None = None):
    """(label, backend) pairs for ``name``. FlashInfer four times: the default (tensor-core decode
    from GQA group 4, extend design chosen per step), ``[no_tc]`` (CUDA-core decode kernel: decode
    only), ``[paged]`` and ``[ragged_merge]`` (one extend design forced: prefill only). Triton once
per ``min_split_lens`` value when given (decode's shortest split)."""
    spec = ModelAttentionSpec(1, HQ, HKV, (D,), DTYPE, "cuda", PAGE)
    cls = get_backend_class(name)  # BackendUnavailableError when it cannot load
    why = cls.capabilities.why_not(spec)
    if why:
        raise RuntimeError(why)
    if name == "flashinfer":
        return [
            ("flashinfer", cls(spec)),
            ("flashinfer[no_tc]", cls(spec, decode_tensor_cores=False)),
            ("flashinfer[paged]", cls(spec, extend_impl="paged")),
            ("flashinfer[ragged_merge]", cls(spec, extend_impl="ragged_merge")),
        ]
    if name == "triton" and min_split_lens:
        return [(f"triton[min_split={n}]", cls(spec, min_split_len=n)) for n in min_split_lens]
    return [(name, cls(spec))]


def bench_one(label, backend, op, shape, gen, copy_bw):
    layer = AttentionLayer(0, HQ, HKV, D, D, 1 / math.sqrt(D))
    if op == "decode":
        batch, seq = shape
        fb, q, k, v = make_step(batch, 1, seq - 1, ForwardMode.DECODE, gen)
    else:
        batch, new, prefix = shape
        fb, q, k, v = make_step(batch, new, prefix, ForwardMode.EXTEND, gen)
    backend.init_forward_metadata(fb)
    backend.forward(q, k, v, layer, fb, save_kv_cache=True)  # K/V in the pool for what follows
    kernel = gpu_ms(lambda: backend.forward(q, k, v, layer, fb, save_kv_cache=False))

    def step():
        backend.init_forward_metadata(fb)
        backend.forward(q, k, v, layer, fb, save_kv_cache=True)

    row = dict(op=op, shape=list(shape), backend=label, kernel_ms=kernel, step_ms=wall_ms(step))
    if op == "decode":
        kv_bytes = int(fb.seq_lens_cpu.sum()) * HKV * D * 2 * DTYPE.itemsize
        row["GB/s"] = kv_bytes / (kernel * 1e-3) / 1e9
        row["of_copy_bw"] = row["GB/s"] / copy_bw
    else:
        pairs = sum(n * p + n * (n + 1) // 2 for n, p in zip(fb.extend_seq_lens_cpu.tolist(), fb.extend_prefix_lens_cpu.tolist()))
        row["TFLOP/s"] = 4 * HQ * D * pairs / (kernel * 1e-3) / 1e12
    return row


def markdown(rows, copy_bw) -> str:
    lines = [
        f"copy bandwidth (read + write): {copy_bw:.0f} GB/s",
        "",
        "| op | shape | backend | kernel ms | step ms | GB/s | % copy BW | TFLOP/s |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['op']} | {r['shape']} | {r['backend']} | error: {r['error'][:80]} | | | | |")
            continue
        gbs = f"{r['GB/s']:.0f}" if "GB/s" in r else ""
        frac = f"{100 * r['of_copy_bw']:.0f}%" if "of_copy_bw" in r else ""
        tfl = f"{r['TFLOP/s']:.1f}" if "TFLOP/s" in r else ""
        lines.append(
            f"| {r['op']} | {'x'.join(map(str, r['shape']))} | {r['backend']} | {r['kernel_ms']:.4f} "
            f"| {r['step_ms']:.4f} | {gbs} | {frac} | {tfl} |"
        )
    return "\n".join(lines)


def main() -> None:
    global D
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one decode and one prefill shape")
    ap.add_argument("--backends", default="flashinfer,triton,torch_native")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/attention_<time>.json)")
    ap.add_argument("--decode-shapes", default=None, help="decode shapes BATCHxKV_LEN,... (default: the built-in list)")
    ap.add_argument("--decode-only", action="store_true", help="no prefill shapes")
    ap.add_argument("--head-dim", type=int, default=D, help=f"head dim (default {D}; 64 is the 1B shape's)")
    ap.add_argument("--min-split-lens", default=None, help="triton: one run per decode min_split_len, e.g. 16,32,64,128")
    ap.add_argument("--decode-block-ns", default=None,
                    help="triton: one run per decode block size in keys (decode_block_n), e.g. 64,256")
    args = ap.parse_args()
    D = args.head_dim
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA device")
    decode_shapes = DECODE_SHAPES[:1] if args.quick else DECODE_SHAPES
    if args.decode_shapes:
        decode_shapes = [tuple(int(v) for v in s.split("x")) for s in args.decode_shapes.split(",")]
    prefill_shapes = [] if args.decode_only else PREFILL_SHAPES[:1] if args.quick else PREFILL_SHAPES
    min_split_lens = [int(v) for v in args.min_split_lens.split(",")] if args.min_split_lens else None
    block_ns = [int(v) for v in args.decode_block_ns.split(",")] if args.decode_block_ns else [None]
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = copy_bandwidth_gbps()
    rows = []
    from attngraph.attn_backends.triton_ops import decode_attention

    block_n_default = decode_attention.decode_block_n
    for name in args.backends.split(","):
        try:
            backends = make_backend(name, min_split_lens)
        except Exception as exc:  # a backend that cannot load is reported, not fatal
            print(f"skipping {name}: {exc}", file=sys.stderr)
            rows.append(dict(op="-", shape=[], backend=name, error=str(exc)))
            continue
        # triton: each backend once per decode block size (read by the kernel's launcher)
        runs = [(f"{label}[block_n={n}]" if n else label, backend, n) for label, backend in backends
                for n in (block_ns if name == "triton" else [None])]  # fmt: skip
        for label, backend, block_n in runs:
            decode_attention.decode_block_n = block_n_default if block_n is None else (lambda *a, n=block_n: n)
            work = [("decode", s) for s in decode_shapes] + [("prefill", s) for s in prefill_shapes]
            if label.endswith("[no_tc]"):  # differs from the default in decode only
                work = work[: len(decode_shapes)]
            elif label.endswith("_merge]") or label.endswith("[paged]"):  # differs in prefill only
                work = work[len(decode_shapes) :]
            for op, shape in work:
                try:
                    row = bench_one(label, backend, op, shape, gen, copy_bw)
                except Exception as exc:
                    row = dict(op=op, shape=list(shape), backend=label, error=f"{type(exc).__name__}: {exc}")
                print(row, file=sys.stderr)
                rows.append(row)
                torch.cuda.empty_cache()
        decode_attention.decode_block_n = block_n_default
    print(markdown(rows, copy_bw))
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", f"attention_{time.strftime('%Y%m%d_%H%M%S')}.json"
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    meta = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, dtype=str(DTYPE),
        q_heads=HQ, kv_heads=HKV, head_dim=D, page_size=PAGE, copy_GBps=copy_bw,
    )
    try:
        import flashinfer

        meta["flashinfer"] = flashinfer.__version__
    except ImportError:
        pass
    with open(out, "w") as f:
        json.dump(dict(meta=meta, results=rows), f, indent=1)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
