"""One rank of the tensor-parallel test (`test_tensor_parallel.py`), run under torchrun.

Loads the saved model twice: sharded with ``tp_plan="auto"`` (accelerated) and whole (the
reference); prints one JSON line with what this rank saw.
"""

import json
import sys

import torch
import torch.distributed as dist
import transformers

import attngraph
from attngraph.runtime.accelerate import state_of


def main() -> None:
    path, backend = sys.argv[1], sys.argv[2]
    sharded = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).eval()
    whole = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    lengths = (11, 6)
    ids = torch.zeros((2, max(lengths)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):  # left-padded, as generate expects
        ids[i, -n:] = torch.randint(3, whole.config.vocab_size, (n,), generator=g)
        mask[i, -n:] = 1
    greedy = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        want = whole.generate(ids, **greedy)
    result = {"rank": rank, "world": world}
    try:
        # Pools asked for of different sizes per rank (as free GPU memory may give): they agree on the smallest.
        attngraph.accelerate(sharded, attention_backend=backend, page_size=4, kv_cache_tokens=512 + 256 * rank,
                             max_context_len=64)  # fmt: skip
    except attngraph.AttnGraphError as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        print("RESULT " + json.dumps(result), flush=True)
        return
    runner = state_of(sharded).runner
    if len(sys.argv) > 3 and sys.argv[3] == "fail-rank-1" and rank == 1:
        step, calls = runner.forward, []

        def failing(*args, **kwargs):  # the third step of rank 1 fails; rank 0 is then in a collective
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("rank 1 failed during a step")
            return step(*args, **kwargs)

        runner.forward = failing
    got = sharded.generate(ids, **greedy)
    result.update(
        equal=bool(torch.equal(got, want)),
        q_heads=runner.geometry.num_q_heads,
        kv_heads=runner.geometry.num_kv_heads,
        pool_kv_heads=runner.pool.num_kv_heads,
        pool_pages=runner.pool.num_pages,
        used_pages=runner.pool.num_used_pages,
        compilations=runner.num_compilations,
    )
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
