"""Which kernels a step runs and how long each takes on the GPU (torch.profiler over replays).

A Llama-3.2-1B-shaped (or 8B-shaped) model, random weights, bf16, accelerated with the chosen
backend and ``cuda_graph`` mode. For one prefill step of 1 x ``--tokens`` each and one decode
step at batch ``--decode-batch`` (128-token context), prints:

* ``gpu_ms``: the summed kernel time of one step, and ``kernels``: launches per step;
* the time per kernel class (GEMM, split-K reduce, attention, inductor's fused kernels,
  K/V writes and copies, other), with the launch count of each;
* the idle time between kernels inside a step, by the classes of the kernels on either side
  (``gemm -> inductor_fused``: the GPU waits after a GEMM for the next launch);
* the busiest kernels by name;
* what each kernel class and name adds to the step's span (``exposed``): with programmatic
  dependent launch the kernels overlap and the summed durations overcount.

    python benchmarks/profile_kernels.py --backend triton --tokens 128,1024 --out x.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import attngraph  # noqa: E402
from attngraph.forward_batch import ForwardBatch  # noqa: E402
from attngraph.runtime.accelerate import state_of  # noqa: E402
from bench_prefill import prefill_step, random_model, result_header  # noqa: E402

#: Kernel classes, first match wins (names as CUPTI reports them).
CLASSES = [
    ("splitk_reduce", re.compile(r"splitKreduce|reduce_kernel.*splitK", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|gemv|skinny|cublas|mm_kernel|triton_tem", re.I)),
    ("attention", re.compile(r"attention|_fwd_kernel|flashinfer|Prefill|Decode|merge|_stage", re.I)),
    # inductor's generated kernels first: their names spell the ops they fused (``..._to_copy..``)
    ("inductor_fused", re.compile(r"^triton_", re.I)),
    ("kv_write_copy", re.compile(r"index_put|index_copy|scatter|copy|Memcpy|Memset|fill|store_kv", re.I)),
]


def classify(name: str) -> str:
    for label, pattern in CLASSES:
        if pattern.search(name):
            return label
    return "other"


def busy_us(intervals) -> float:
    """Length of the union of ``(start, end)`` intervals: the time the GPU ran any kernel.
    Kernels launched with programmatic dependent launch overlap (a kernel's span includes its
    wait for the one before), so their summed durations count that time twice.

    >>> busy_us([(0, 4), (3, 6), (8, 9)])
    7
    """
    total, lo, hi = 0, None, None
    for start, end in sorted(intervals):
        if hi is None or start > hi:
            if hi is not None:
                total += hi - lo
            lo, hi = start, end
        else:
            hi = max(hi, end)
    return total + (hi - lo if hi is not None else 0)


def idle_by_boundary(kernels, max_gap_us: float = 50.0) -> dict[str, list[float]]:
    """Where the GPU idles between kernels: for each kernel, the time from the latest end of
    the kernels before it to its start, summed per boundary ``"<class before> -> <class>"``
    (`classify`), with the count. ``kernels``: ``(start, end, name)`` in microseconds; gaps
    longer than ``max_gap_us`` (the host between steps) are left out.

    >>> idle_by_boundary([(0, 4, "nvjet_gemm"), (6, 9, "triton_poi_fused_0"), (8, 12, "_skinny_linear_kernel")])
    {'gemm -> inductor_fused': [2.0, 1]}
    """
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    last_end, last_name = None, None
    for start, end, name in sorted(kernels):
        if last_end is not None and 0 < start - last_end <= max_gap_us:
            entry = out[f"{classify(last_name)} -> {classify(name)}"]
            entry[0] += start - last_end
            entry[1] += 1
        if last_end is None or end > last_end:
            last_end, last_name = end, name
    return dict(out)


def exposed_us(kernels) -> dict[str, float]:
    """What each kernel adds to the step: the time from the latest end of the kernels before
    it (or its own start, after a gap) to its end, summed per kernel name. Under programmatic
    dependent launch a kernel starts while the one before runs and its span includes that
    overlap; its exposed time does not, and the exposed times plus the gaps add up to the
    step. ``kernels``: ``(start, end, name)`` in microseconds.

    >>> exposed_us([(0, 4, "gemv"), (2, 9, "attention"), (10, 12, "gemv")])
    {'gemv': 6.0, 'attention': 5.0}
    """
    out: dict[str, float] = defaultdict(float)
    last_end = None
    for start, end, name in sorted(kernels, key=lambda k: (k[1], k[0])):
        lo = start if last_end is None else max(start, last_end)
        if end > lo:
            out[name] += end - lo
        last_end = end if last_end is None else max(last_end, end)
    return dict(out)


def exposed_sequence(kernels, steps: int) -> list[list]:
    """Each launch of one step in order, with its duration and exposed time (`exposed_us`'s
    measure) averaged over the ``steps`` profiled steps: ``[name, duration, exposed]`` per
    position, so that one layer's kernels read in order (which GEMV, which boundary). The
    steps must launch the same kernels (``kernels`` holds ``steps`` times as many); else ``[]``.

    >>> exposed_sequence([(0, 4, "a"), (2, 9, "b"), (10, 12, "a"), (11, 20, "b")], 2)
    [['a', 3.0, 3.0], ['b', 8.0, 6.5]]
    """
    spans = sorted(kernels)
    if not spans or len(spans) % steps:
        return []
    per = len(spans) // steps
    if any(spans[i][2] != spans[i % per][2] for i in range(len(spans))):
        return []
    seq = [[spans[i][2], 0.0, 0.0] for i in range(per)]
    last_end = None
    for i, (start, end, _) in enumerate(spans):  # in start order: a kernel is exposed past all before it
        lo = start if last_end is None else max(start, last_end)
        seq[i % per][1] += (end - start) / steps
        seq[i % per][2] += max(end - lo, 0) / steps
        last_end = end if last_end is None else max(last_end, end)
    return [[name, round(d, 2), round(x, 2)] for name, d, x in seq]


def kernel_table(step, steps: int = 5) -> dict:
    """Per-step kernel time and launches of ``step``, by class and by name. ``gpu_ms``: the
    kernels' summed durations; ``gpu_busy_ms``: the time any kernel ran (`busy_us`)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    spans = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        spans.append((e.time_range.start, e.time_range.end, e.name))
        entry = by_name[e.name]
        entry[0] += e.device_time_total / steps
        entry[1] += 1 / steps
    by_class: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, (us, n) in by_name.items():
        c = by_class[classify(name)]
        c[0] += us
        c[1] += n
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:60]
    exposed = exposed_us(spans)
    exposed_class: dict[str, float] = defaultdict(float)
    for name, us in exposed.items():
        exposed_class[classify(name)] += us
    return {
        "gpu_ms": sum(us for us, _ in by_name.values()) / 1e3,
        "gpu_busy_ms": busy_us([span[:2] for span in spans]) / steps / 1e3,
        "idle_us_by_boundary": {k: [round(us / steps, 1), round(n / steps)] for k, (us, n)
                                in sorted(idle_by_boundary(spans).items(), key=lambda kv: -kv[1][0])},
        "kernels": round(sum(n for _, n in by_name.values())),
        "by_class_us": {k: [round(us, 1), round(n)] for k, (us, n) in sorted(by_class.items(), key=lambda kv: -kv[1][0])},
        "top_us": [[name[:110], round(us, 1), round(n)] for name, (us, n) in top],
        # per step: what each class / kernel adds to the step's span (`exposed_us`)
        "exposed_us_by_class": {k: round(us / steps, 1) for k, us in sorted(exposed_class.items(), key=lambda kv: -kv[1])},
        "exposed_top_us": [[name[:110], round(us / steps, 1), round(by_name[name][1])]
                           for name, us in sorted(exposed.items(), key=lambda kv: -kv[1])[:30]],
        # one step's launches in order: [name, duration us, exposed us] (`exposed_sequence`)
        "sequence_us": [[name[:60], d, x] for name, d, x in exposed_sequence(spans, steps)],
    }


def decode_step(runner, batch: int, context: int, vocab: int):
    """A callable running one decode step of ``batch`` requests with ``context`` cached tokens."""
    pool = runner.pool
    rows = [pool.alloc_request() for _ in range(batch)]
    pool.reserve(rows, [context + 1] * batch)
    ids = torch.randint(3, vocab, (batch,))
    fb = ForwardBatch.build(pool, rows, [context] * batch, [1] * batch, ids)

    def free():
        for r in rows:
            pool.free_request(r)

    return (lambda: runner.forward(fb)), free


def generate_table(model, batch: int, prompt: int, new_tokens: int) -> dict:
    """Where the wall time of a greedy ``model.generate`` goes: per decode step (the N-token
    call's kernels, less the 1-token call's, over N - 1), the launches, the GPU busy time, and
    the idle time between kernels by boundary and by gap length (the gaps inside the CUDA
    graphs, and those where the device waits for the host)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    from bench_generate import prompts

    ids, mask = prompts(model.config.vocab_size, batch, prompt)
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None)

    def run(n: int):
        model.generate(ids, max_new_tokens=n, **kw)  # warm: compiles, captures
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=n, **kw)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA)  # fmt: skip
        return wall * 1e6, spans

    (w1, s1), (wn, sn) = run(1), run(new_tokens)
    steps = new_tokens - 1

    def gaps(spans):
        bins = {"<2us": 0.0, "2-10us": 0.0, "10-50us": 0.0, ">50us": 0.0}
        last = None
        for start, end, _ in spans:
            if last is not None and start > last:
                g = start - last
                bins["<2us" if g < 2 else "2-10us" if g < 10 else "10-50us" if g < 50 else ">50us"] += g
            last = end if last is None else max(last, end)
        return bins

    g1, gn = gaps(s1), gaps(sn)
    per_step = lambda a, b: round((b - a) / steps, 2)  # noqa: E731
    e1, en = exposed_us(s1), exposed_us(sn)
    c1, cn = defaultdict(int), defaultdict(int)
    for spans, counts in ((s1, c1), (sn, cn)):
        for _, _, name in spans:
            counts[name] += 1
    by_name = {name: [per_step(e1.get(name, 0.0), en[name]), per_step(c1[name], cn[name])] for name in en}
    return {
        "wall_us_per_step": per_step(w1, wn),
        "kernels_per_step": per_step(len(s1), len(sn)),
        "busy_us_per_step": per_step(busy_us([s[:2] for s in s1]), busy_us([s[:2] for s in sn])),
        "idle_us_per_step_by_gap": {k: per_step(g1[k], gn[k]) for k in gn},
        "idle_us_per_step_by_boundary": {k: [round(us / steps, 2), round(n / steps, 2)] for k, (us, n) in
                                         sorted(idle_by_boundary(sn, 1e9).items(), key=lambda kv: -kv[1][0])[:12]},
        # [exposed us, launches] per step by kernel name (the N-token call's less the 1-token
        # call's, over N - 1): what the decoding loop adds to the model's step shows here
        "exposed_us_per_step_by_name": dict(sorted(by_name.items(), key=lambda kv: -kv[1][0])[:16]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="triton")
    p.add_argument("--mode", default="full_and_piecewise")
    p.add_argument("--shape", default="1b", choices=["1b", "8b"])
    p.add_argument("--tokens", default="128,1024", help="prefill step sizes, comma-separated")
    p.add_argument("--decode-batch", type=int, default=1)
    p.add_argument("--trace-tokens", type=int, default=None, help="CompileConfig.trace_tokens")
    p.add_argument("--num-tokens", default=None, help="CompileConfig.cuda_graph_num_tokens, comma-separated")
    p.add_argument("--no-skinny", action="store_true", help="CompileConfig.skinny_linears=False (cuBLAS for every linear)")
    p.add_argument("--generate", type=int, default=0,
                   help="also profile a greedy model.generate of this many new tokens (prompt 128, --decode-batch rows)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_kernels.py needs a CUDA device")
    model = random_model(args.shape)
    extra = {}
    if args.num_tokens:
        extra["cuda_graph_num_tokens"] = tuple(int(t) for t in args.num_tokens.split(","))
    attngraph.accelerate(model, cuda_graph=args.mode, attention_backend=args.backend, trace_tokens=args.trace_tokens,
                       skinny_linears=not args.no_skinny, **extra)  # fmt: skip
    runner = state_of(model).runner
    vocab = model.config.vocab_size
    result = result_header(
        "profile_kernels.py", shape=args.shape, backend=args.backend, mode=args.mode,
        trace_tokens=runner.trace_tokens(), skinny_linears=not args.no_skinny, steps={},
    )
    for n in [int(t) for t in args.tokens.split(",") if t]:
        step, free = prefill_step(runner, 1, n, vocab)
        result["steps"][f"prefill_1x{n}"] = kernel_table(step)
        free()
    step, free = decode_step(runner, args.decode_batch, 128, vocab)
    result["steps"][f"decode_b{args.decode_batch}"] = kernel_table(step)
    free()
    if args.generate:
        result["generate"] = generate_table(model, args.decode_batch, 128, args.generate)
        print("== generate:", json.dumps(result["generate"], indent=1))
    for name, row in result["steps"].items():
        print(f"== {name}: gpu {row['gpu_ms']:.3f} ms, {row['kernels']} kernels")
        for cls, (us, n) in row["by_class_us"].items():
            print(f"   {cls:16s} {us:9.1f} us  {n:4d} launches")
        for boundary, (us, n) in row["idle_us_by_boundary"].items():
            print(f"   idle {us:9.1f} us  {n:4d}x  {boundary}")
        for kname, us, n in row["top_us"]:
            print(f"   {us:9.1f} us {n:4d}x  {kname}")
        print("   exposed (what each adds to the step):", json.dumps(row["exposed_us_by_class"]))
        for i, (kname, d, x) in enumerate(row["sequence_us"][:24]):
            print(f"   #{i:3d} {d:7.2f} us, exposed {x:6.2f}  {kname}")
        for kname, us, n in row["exposed_top_us"]:
            print(f"   exposed {us:9.1f} us {n:4d}x  {kname}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
