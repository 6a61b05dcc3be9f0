"""Assisted (speculative) generation on the paged runtime: what its steps cost, side by side.

An 8B-shaped target and a 1B-shaped draft (random weights, bf16, batch 1, both accelerated
with the same backend). Random weights make acceptance rates meaningless, so this measures the
mechanism:

* ``decode_ms``: one plain decode step of the target (`PagedCache.decode_step`, context 128);
* ``verify_ms``: one verify step of k + 1 tokens of the target (`PagedCache.step` with logits at
  every token), then the crop back, as transformers' assisted loop runs them;
* ``draft_decode_ms`` and ``draft_k_steps_ms``: one decode step of the draft, and k of them;
* tokens per second of ``generate`` plain and with an assistant that always agrees (a second
  accelerated copy of the target's weights: every draft token is accepted).

    python benchmarks/bench_speculative.py --backend triton --k 4 --out benchmarks/results/speculative.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import attngraph  # noqa: E402
from attngraph.runtime.accelerate import state_of  # noqa: E402
from attngraph.runtime.paged_cache import PagedCache  # noqa: E402
from bench_prefill import random_model, result_header  # noqa: E402
from profile_decode import per_call_ms as _per_call_ms  # noqa: E402


def per_call_ms(fn) -> float:
    return _per_call_ms(fn, 30, warmup=3)



def step_costs(model, k: int, context: int) -> dict:
    """Decode and verify step times of ``model`` on a request of ``context`` cached tokens."""
    runner = state_of(model).runner
    vocab, dev = model.config.vocab_size, runner.device
    cache = PagedCache(runner)
    try:
        prompt = torch.randint(3, vocab, (1, context), device=dev)
        with torch.no_grad():
            cache.step(prompt, None, 1)
        token = torch.randint(3, vocab, (1,), device=dev)
        candidates = torch.randint(3, vocab, (1, k + 1), device=dev)

        def decode():
            cache.decode_step(token)
            cache.crop(-1)

        def verify():
            cache.step(candidates, None, k + 1)
            cache.crop(-(k + 1))

        def k_decodes():
            for _ in range(k):
                cache.decode_step(token)
            cache.crop(-k)

        with torch.no_grad():
            return {"decode_ms": per_call_ms(decode), "verify_ms": per_call_ms(verify), "k_decodes_ms": per_call_ms(k_decodes)}
    finally:
        cache.free()


def tokens_per_s(model, new_tokens: int, **extra) -> float:
    prompt = torch.randint(3, model.config.vocab_size, (1, 128), device=state_of(model).runner.device)
    kw = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None, **extra)
    model.generate(prompt, **kw)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(prompt, **kw)
    torch.cuda.synchronize()
    return new_tokens / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="triton")
    p.add_argument("--k", type=int, default=4, help="draft tokens per round")
    p.add_argument("--target", default="8b", choices=["1b", "8b"])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_speculative.py needs a CUDA device")
    opts = dict(attention_backend=args.backend)
    target = attngraph.accelerate(random_model(args.target), **opts)
    draft = attngraph.accelerate(random_model("1b"), **opts)
    result = result_header(
        "bench_speculative.py", backend=args.backend, k=args.k,
        target=step_costs(target, args.k, 128), draft=step_costs(draft, args.k, 128),
    )
    t, d = result["target"], result["draft"]
    result["verify_over_decode"] = t["verify_ms"] / t["decode_ms"]
    result["draft_k_steps_over_one"] = d["k_decodes_ms"] / d["decode_ms"]
    del draft
    torch.cuda.empty_cache()
    # An assistant that always agrees: the target's own weights, accelerated on a pool of its own.
    agreeing = copy.deepcopy(attngraph.restore(target))
    attngraph.accelerate(target, **opts)
    attngraph.accelerate(agreeing, **opts)
    agreeing.generation_config.num_assistant_tokens = args.k
    agreeing.generation_config.num_assistant_tokens_schedule = "constant"
    result["plain_tokens_per_s"] = tokens_per_s(target, args.new_tokens)
    result["assisted_tokens_per_s"] = tokens_per_s(target, args.new_tokens, assistant_model=agreeing)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
