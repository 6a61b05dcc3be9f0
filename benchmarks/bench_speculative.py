"""Speculative generation on the paged runtime: what its steps cost, side by side.

An 8B-shaped target and a 1B-shaped draft (random weights, bf16, batch 1, both accelerated
with the same backend). Random weights make acceptance rates meaningless, so this measures the
mechanism, each step as attngraph's speculative loop runs it:

* ``decode_ms``: one plain decode step (context 128; the decode graph), rolled back;
* ``verify_ms``: one verify step of k + 1 tokens with logits at every one
  (`PagedCache.extend_each`: the verify graph), rolled back (`truncate_each`);
* ``k_steps_ms``: k greedy decode steps as the draft runs them (`PagedCache.greedy_steps`:
  one multi-step graph), and ``k_decodes_ms``: the same k steps one decode graph at a time;
* tokens per second of ``generate`` plain; with the 1B draft (random weights: it almost never
  agrees); with the 1B draft under forced acceptance (every verify step runs, then its argmaxes
  are replaced by the candidates, so every round keeps all k: the loop's throughput when the
  draft is always right); and with an assistant that always agrees for real (a second
  accelerated copy of the target's weights, as slow as the target).

    python benchmarks/bench_speculative.py --backend triton --k 4 --out benchmarks/results/speculative.json
"""

from __future__ import annotations

import argparse
import contextlib
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
    """Decode, verify and k-step times of ``model`` on a request of ``context`` cached tokens."""
    runner = state_of(model).runner
    vocab, dev = model.config.vocab_size, runner.device
    cache = PagedCache(runner)
    try:
        prompt = torch.randint(3, vocab, (1, context), device=dev)
        with torch.no_grad():
            cache.step(prompt, None, 1)
        token = torch.randint(3, vocab, (1,), device=dev)
        candidates = torch.randint(3, vocab, (k + 1,), device=dev)

        def decode():
            cache.extend_each([0], token, [1], all_logits=False)
            cache.truncate_each([0], [context])

        def verify():
            cache.extend_each([0], candidates, [k + 1])
            cache.truncate_each([0], [context])

        def k_steps():
            cache.greedy_steps([0], token, k)
            cache.truncate_each([0], [context])

        def k_decodes():
            t = token
            for _ in range(k):
                t = torch.argmax(cache.extend_each([0], t, [1], all_logits=False).float(), dim=-1)
            cache.truncate_each([0], [context])

        with torch.no_grad():
            out = {name: per_call_ms(fn) for name, fn in
                   (("decode_ms", decode), ("verify_ms", verify), ("k_steps_ms", k_steps), ("k_decodes_ms", k_decodes))}
        out["graphs"] = {
            "verify": runner.verify_graphs is not None and runner.verify_graphs.replays > 0,
            "multi_step": runner.multi_step is not None and runner.multi_step.replays > 0,
        }
        return out
    finally:
        cache.free()


@contextlib.contextmanager
def forced_acceptance():
    """Every verify step of the speculative loop runs as usual, then reports the target's
    argmaxes as equal to the candidates (and its last one after them): each round keeps all of
    its candidates. Yields the list of rounds run (one entry per verify step)."""
    from attngraph.runtime import speculative

    real, rounds = speculative._verify, []

    def agree(cache, live, pending, proposal):
        cands, preds = real(cache, live, pending, proposal)
        rounds.append(len(live))
        return cands, [c + [p[-1]] for c, p in zip(cands, preds)]

    speculative._verify = agree
    try:
        yield rounds
    finally:
        speculative._verify = real


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
        "bench_speculative.py", backend=args.backend, k=args.k, target_shape=args.target,
        target=step_costs(target, args.k, 128), draft=step_costs(draft, args.k, 128),
    )
    t, d = result["target"], result["draft"]
    result["verify_over_decode"] = t["verify_ms"] / t["decode_ms"]
    result["draft_k_steps_over_one"] = d["k_steps_ms"] / d["decode_ms"]
    result["draft_k_decodes_over_one"] = d["k_decodes_ms"] / d["decode_ms"]
    draft.generation_config.num_assistant_tokens = args.k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    result["plain_tokens_per_s"] = tokens_per_s(target, args.new_tokens)
    result["draft_assisted_tokens_per_s"] = tokens_per_s(target, args.new_tokens, assistant_model=draft)
    with forced_acceptance() as rounds:
        result["forced_acceptance_tokens_per_s"] = tokens_per_s(target, args.new_tokens, assistant_model=draft)
    # tokens_per_s runs generate twice (warm-up, timed); the prefill gives each call's first token
    result["forced_acceptance_tokens_per_round"] = (args.new_tokens - 1) / (len(rounds) / 2)
    del draft
    torch.cuda.empty_cache()
    # An assistant that always agrees: the target's own weights, accelerated on a pool of its own.
    agreeing = copy.deepcopy(attngraph.restore(target))
    attngraph.accelerate(target, **opts)
    attngraph.accelerate(agreeing, **opts)
    agreeing.generation_config.num_assistant_tokens = args.k
    agreeing.generation_config.num_assistant_tokens_schedule = "constant"
    result["plain_tokens_per_s_again"] = tokens_per_s(target, args.new_tokens)
    result["agreeing_assisted_tokens_per_s"] = tokens_per_s(target, args.new_tokens, assistant_model=agreeing)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
