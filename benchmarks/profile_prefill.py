"""Where a piecewise prefill step's time goes, and where `accelerate()` spends its seconds.

Llama-3.2-1B-shaped model (as in bench_generate.py), bf16, one request of ``--tokens`` tokens.
Prints, for the chosen ``cuda_graph`` mode:

* ``accelerate_s`` with attngraph's log lines timestamped (trace, pieces, pool, captures) and
  Dynamo's own per-phase compile times;
* ``step_ms``: `ModelRunner.forward` of the prefill step, back to back;
* ``gpu_ms``: the GPU kernel time of one step (torch.profiler), so ``step_ms - gpu_ms`` is
  what the host adds;
* the host's share per function (cProfile over ``--iters`` steps, cumulative and own time);
* ``plan_ms``: the backend's ``init_forward_metadata`` alone, and ``replay_ms``: one captured
  piece's ``graph.replay()`` alone.

    python benchmarks/profile_prefill.py [--tokens 128] [--mode full_and_piecewise] [--out x.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import os
import pstats
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import attngraph  # noqa: E402
from attngraph.runtime.accelerate import state_of  # noqa: E402
from bench_generate import llama_1b  # noqa: E402
from bench_prefill import held_beyond_pool, prefill_step  # noqa: E402
from profile_decode import per_call_ms  # noqa: E402


def gpu_ms_per_step(step, steps: int = 5) -> tuple[float, str]:
    """Kernel time of one step and the profiler's table of the busiest host and device ops."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    table = events.table(sort_by="self_cpu_time_total", row_limit=25)
    return device_us / steps / 1e3, table


def host_profile(step, iters: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(30)
    return text.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--mode", default="full_and_piecewise")
    p.add_argument("--backend", default="flashinfer")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--profile-setup", action="store_true", help="run accelerate() under cProfile")
    p.add_argument("--no-fuse", action="store_true", help="CompileConfig.fuse_linears=False")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_prefill.py needs a CUDA device")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(relativeCreated)9.0f ms  %(name)s: %(message)s"))
    log = logging.getLogger("attngraph")
    log.addHandler(handler)
    log.setLevel(logging.INFO)

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(
            llama_1b(16), dtype=torch.bfloat16, attn_implementation="sdpa"
        ).eval()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    setup_prof = cProfile.Profile() if args.profile_setup else None
    t0 = time.perf_counter()
    if setup_prof:
        setup_prof.enable()
    attngraph.accelerate(model, cuda_graph=args.mode, attention_backend=args.backend, fuse_linears=not args.no_fuse)
    torch.cuda.synchronize()
    if setup_prof:
        setup_prof.disable()
    accelerate_s = time.perf_counter() - t0
    runner = state_of(model).runner
    held = held_beyond_pool(before, runner)
    print(f"accelerate_s={accelerate_s:.2f} held_beyond_pool_GiB={held / 2**30:.3f}", flush=True)
    print(torch._dynamo.utils.compile_times(repr="str"), flush=True)
    if setup_prof:
        text = io.StringIO()
        pstats.Stats(setup_prof, stream=text).sort_stats("cumulative").print_stats(60)
        print(text.getvalue(), flush=True)

    step, free = prefill_step(runner, 1, args.tokens, model.config.vocab_size)
    step_ms = per_call_ms(step, 50, warmup=3)
    gpu_ms, table = gpu_ms_per_step(step)
    print(f"step_ms={step_ms:.3f} gpu_ms={gpu_ms:.3f}", flush=True)
    print(table, flush=True)
    print(host_profile(step, args.iters), flush=True)

    row = dict(tokens=args.tokens, mode=args.mode, fuse_linears=not args.no_fuse, accelerate_s=accelerate_s, step_ms=step_ms, gpu_ms=gpu_ms,
               held_beyond_kv_pool_GiB=held / 2**30)
    state = runner._piecewise_state
    if state is not None and state.pieces and runner.piecewise is not None:
        bucket = runner.piecewise.bucket(args.tokens) if args.tokens <= runner.piecewise.max_tokens else None
        entry = state.pieces[1].entries.get(bucket) if bucket else None
        if entry is not None:
            row["replay_ms"] = per_call_ms(entry.graph.replay, 200, warmup=5)
        row["replays_per_step"] = len([p for p in state.pieces if p.entries.get(bucket)]) if bucket else 0
    # The plan alone, on the step's own batch (caught on its way to the backend).
    batch_holder = {}
    orig = runner.backend.init_forward_metadata

    def grab(batch):
        batch_holder["b"] = batch
        return orig(batch)

    runner.backend.init_forward_metadata = grab
    step()
    runner.backend.init_forward_metadata = orig
    if "b" not in batch_holder:  # a whole-step graph plans its own static batch
        graphs = runner.extend_graphs
        batch_holder["b"] = graphs.static_batch(graphs.bucket(args.tokens))
        row["replays_per_step"] = 1
    fb = batch_holder["b"]
    t = time.perf_counter()
    for _ in range(200):
        runner.backend.init_forward_metadata(fb)
    torch.cuda.synchronize()
    row["plan_ms"] = (time.perf_counter() - t) / 200 * 1e3
    free()
    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
