"""Train the copy-task checkpoints in ``tests/data/copy_models`` (CPU, one thread, seeded).

    OMP_NUM_THREADS=1 python -m tests.train_copy_models            # all models
    OMP_NUM_THREADS=1 python -m tests.train_copy_models llama_gqa  # one

The task, the configs and the test prompts are in ``tests/copy_task.py``. Training is
deterministic (fixed seeds, one thread, AdamW), so the same torch version makes the same
weights. Each model is trained for a fixed number of steps, then saved with
``save_pretrained`` (config.json + model.safetensors) and checked: the greedy continuation of
the test prompts is the copied span, and the smallest top-1 minus top-2 logit margin is printed.

Measured (torch 2.13 CPU, one thread on a shared 2-core machine, 1200 steps): about 30 min per
model with two models training side by side (~1.5 s per step; under 10 min on an idle core).
Checkpoints: 659 kB each (fp32). Smallest top-1 minus top-2 logit margin over the 128 greedy
steps of the test prompts (batches of 1, 3, 16, ``prompts(name, count, seed=count)``), median
about 10: llama_gqa 5.11 / 2.06 / 2.22, mistral_window 8.15 / 8.13 / 3.35; every continuation is
the copy. (Other prompt seeds can hit a position the model gets wrong; the tests check that
HF's own output is the copy, so such a prompt fails loudly rather than weakening the check.)
"""

from __future__ import annotations

import math
import sys
import time

import torch
import transformers

from .copy_task import MODELS, NEW_TOKENS, expected, left_padded, load, margins, prompts, training_batch

STEPS = 1200
BATCH = 24
LR = 3e-3
WARMUP = 100


def train(name: str, steps: int = STEPS, seed: int = 0) -> transformers.PreTrainedModel:
    spec = MODELS[name]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(spec.make_config(), attn_implementation="sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / WARMUP) * (0.55 + 0.45 * math.cos(math.pi * min(s, steps) / steps))
    )
    gen = torch.Generator().manual_seed(seed + 1)
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        ids, labels = training_batch(spec, gen, BATCH)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"{name} step {step} loss {loss.item():.5f} ({time.perf_counter() - start:.0f} s)", flush=True)
    return model.eval()


def check(name: str) -> float:
    """Greedy continuations of the test prompts are the copies; returns the smallest margin."""
    model = load(name)
    worst = math.inf
    for count in (1, 3, 16):
        batch = prompts(name, count, seed=count)  # the prompts the tests use
        m = margins(model, batch)
        ids, mask = left_padded(batch)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        wrong = (out != expected(batch, NEW_TOKENS)).sum().item()
        print(f"{name} batch {count}: min margin {m.min().item():.2f}, median {m.median().item():.2f}, {wrong} tokens not copied")
        worst = min(worst, m.min().item())
    return worst


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    for name in names:
        start = time.perf_counter()
        model = train(name)
        seconds = time.perf_counter() - start
        MODELS[name].path.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(MODELS[name].path)
        print(f"{name}: trained in {seconds:.0f} s, min margin {check(name):.2f}")


if __name__ == "__main__":
    main(sys.argv[1:] or list(MODELS))
