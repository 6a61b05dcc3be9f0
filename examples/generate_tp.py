"""Tensor-parallel generate: transformers shards the model, attngraph accelerates each rank.

    torchrun --nproc-per-node 2 examples/generate_tp.py                 # CPU, gloo, a small Llama
    torchrun --nproc-per-node 2 examples/generate_tp.py --model PATH    # a local HF folder
    torchrun --nproc-per-node 2 examples/generate_tp.py --model PATH --dtype bfloat16 --backend triton  # GPUs

Every rank loads the model with ``tp_plan="auto"`` (transformers initializes the process
group: NCCL on GPUs, gloo on CPU; the ``accelerate`` package must be installed), holds its
share of the heads and of the KV pool, and runs the same ``generate`` call with the same
inputs and seed. Without ``--model`` a small random Llama is saved to a temporary folder
first, and the sharded tokens are checked against the unsharded model's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import transformers

import attngraph
from attngraph.runtime.accelerate import state_of


def small_model(folder: str) -> str:
    """A random 4-layer Llama saved by rank 0 (``folder`` is shared by the ranks)."""
    path = os.path.join(folder, "llama")
    if int(os.environ.get("RANK", "0")) == 0:
        cfg = transformers.LlamaConfig(
            vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
        )  # fmt: skip
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="local HF folder (default: a small random Llama)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--backend", default="auto", help="attention backend (torch_native on CPU)")
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    path, made = args.model, None
    if path is None:  # the ranks share the host: rank 0 writes the model, the others wait for it
        made = os.path.join(tempfile.gettempdir(), f"attngraph-tp-{os.environ.get('MASTER_PORT', '0')}")
        path = small_model(made)
        while not os.path.exists(os.path.join(path, "model.safetensors")):
            time.sleep(0.1)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype).eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = next(model.parameters()).device
    torch.manual_seed(1)  # the same prompts and seed on every rank
    ids = torch.randint(3, model.config.vocab_size, (2, 16), device=device)
    want = None
    if made is not None:
        whole = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        with torch.no_grad():
            want = whole.generate(ids.cpu(), max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    attngraph.accelerate(model, attention_backend=args.backend)
    runner = state_of(model).runner
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    seconds = time.perf_counter() - t0
    line = (f"rank {rank}/{world}: {runner.geometry.num_q_heads} query / {runner.geometry.num_kv_heads} KV heads "
            f"on this rank, {args.new_tokens} tokens in {seconds:.2f} s")  # fmt: skip
    if want is not None:
        line += f", tokens equal to the unsharded model: {torch.equal(out.cpu(), want)}"
    print(line, flush=True)
    dist.barrier()
    if made is not None and rank == 0:
        shutil.rmtree(made, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
