"""Where a decode step's time goes: GPU work of the captured graph vs host work around it.

Llama-3.2-1B-shaped model (as in bench_generate.py), bf16, batch 1 by default. Per backend:

* ``replay_ms``: the captured decode graph replayed back to back (the plan done once before):
  the GPU time of one step, nearly free of host overhead.
* ``decode_step_ms``: `PagedCache.decode_step` in a loop (batch build, page reservation,
  static-buffer copies, plan, replay), synchronized once at the end: what the runtime costs
  per step without the decoding loop around it.
* ``generate_ms``: per token of ``model.generate`` (attngraph's own loop: HF's logits
  processors and stopping criteria on top).

    python benchmarks/profile_decode.py [--backends triton,flashinfer] [--batch 1] [--out x.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import attngraph  # noqa: E402
from attngraph.runtime.accelerate import state_of  # noqa: E402
from attngraph.runtime.cuda_graph import GraphKey  # noqa: E402
from attngraph.forward_batch import ForwardMode  # noqa: E402
from attngraph.runtime.paged_cache import PagedCache  # noqa: E402
from bench_generate import llama_1b  # noqa: E402


def per_call_ms(fn, iters: int, warmup: int = 1) -> float:
    """Mean ms per call of ``fn`` over ``iters`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="triton,flashinfer")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_decode.py needs a CUDA device (it times the captured decode CUDA graphs)")
    if args.batch < 1:
        sys.exit(f"--batch must be >= 1, got {args.batch}")
    torch.manual_seed(0)
    cfg = llama_1b(args.layers)
    base = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    ids = torch.randint(3, cfg.vocab_size, (args.batch, 128), device="cuda")
    rows = []
    for name in args.backends.split(","):
        model = attngraph.accelerate(base, attention_backend=name, kv_cache_tokens=1 << 15, cuda_graph_capture_sizes=(args.batch,))
        runner = state_of(model).runner
        kw = dict(max_new_tokens=64, do_sample=False, pad_token_id=0, eos_token_id=None)
        with torch.no_grad():
            model.generate(ids, **kw)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, **kw)
            torch.cuda.synchronize()
            generate_ms = (time.perf_counter() - t0) / 64 * 1e3
            cache = PagedCache(runner)
            cache.step(ids, None, 1)
            tok = torch.randint(3, cfg.vocab_size, (args.batch,), device="cuda")
            decode_step_ms = per_call_ms(lambda: cache.decode_step(tok), 200)
            graphs = runner.graphs
            key = GraphKey(ForwardMode.DECODE, args.batch)
            replay_ms = per_call_ms(graphs.graphs[key].replay, 200)  # the last step's plan and inputs
            cache.free()
        rows.append(dict(backend=name, batch=args.batch, replay_ms=replay_ms, decode_step_ms=decode_step_ms, generate_ms=generate_ms))
        print(rows[-1], flush=True)
        attngraph.restore(model)
        torch.cuda.empty_cache()
    weight_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    print("| backend | batch | graph replay ms (GPU) | decode_step ms | generate ms/token |\n| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['backend']} | {r['batch']} | {r['replay_ms']:.3f} | {r['decode_step_ms']:.3f} | {r['generate_ms']:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(model=f"Llama-3.2-1B-shaped ({args.layers} layers), bf16", weight_GB=weight_bytes / 1e9, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
