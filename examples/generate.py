"""HF generate with and without attngraph on the same prompts: same greedy tokens, and tokens/s.

    python examples/generate.py                      # built-in small Llama config, random weights
    python examples/generate.py --model PATH         # real weights (a local HF folder)
    python examples/generate.py --device cuda --dtype bfloat16 --backend flashinfer
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import transformers

import attngraph


def build(args) -> torch.nn.Module:
    dtype = getattr(torch, args.dtype)
    if args.model:
        return transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation=args.attn)
    cfg = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=args.attn)


def prompts(vocab: int, lengths: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch: ``ids, mask: [len(lengths), max(lengths)]``."""
    g = torch.Generator().manual_seed(1)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, width - n :] = 1
    return ids.to(device), mask.to(device)


def timed_generate(model, ids, mask, new_tokens: int) -> tuple[torch.Tensor, float]:
    kw = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    model.generate(ids, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
    if ids.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, **kw)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local HF model folder (default: a built-in config with random weights)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="HF attention implementation")
    p.add_argument("--backend", default="auto", help="attngraph attention backend")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-lengths", default="24,13,40", help="comma-separated prompt lengths (one per sequence)")
    args = p.parse_args()

    model = build(args).to(args.device).eval()
    baseline = copy.deepcopy(model)
    ids, mask = prompts(model.config.vocab_size, [int(x) for x in args.prompt_lengths.split(",")], args.device)

    t0 = time.perf_counter()
    attngraph.accelerate(model, attention_backend=args.backend)
    print(f"accelerate(): {time.perf_counter() - t0:.1f} s (compile + warm-up)")

    with torch.no_grad():
        ref, t_ref = timed_generate(baseline, ids, mask, args.new_tokens)
        out, t_acc = timed_generate(model, ids, mask, args.new_tokens)
    n = ids.shape[0] * args.new_tokens
    same = torch.equal(out, ref)
    print(f"greedy tokens identical to HF generate: {same}")
    print(f"HF generate:        {n / t_ref:8.1f} tokens/s")
    print(f"attngraph generate: {n / t_acc:8.1f} tokens/s")
    if ids.device.type == "cpu":
        print("(CPU: attention runs the torch_native reference backend and no CUDA graphs; speed is a GPU matter)")
    if not same:
        raise SystemExit("greedy tokens differ from HF generate")


if __name__ == "__main__":
    main()
