"""Compile an HF model with `backend="attngraph"`; print what was lowered and the difference to eager.

    python examples/compile_model.py                 # built-in small Llama config, random weights
    python examples/compile_model.py --model PATH --attn eager
"""

from __future__ import annotations

import argparse

import torch
import transformers

import attngraph


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", help="local HF model folder (default: a built-in config with random weights)")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=args.attn)
    else:
        torch.manual_seed(0)
        cfg = transformers.MistralConfig(
            vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, sliding_window=16,
        )
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=args.attn)
    model = model.to(args.device).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 48), device=args.device)

    print(attngraph.explain(model, ids))
    compiled = torch.compile(model, backend="attngraph")
    with torch.no_grad():
        diff = (compiled(ids).logits - model(ids).logits).abs().max().item()
    print(f"max |compiled - eager| logits: {diff:.3e}")


if __name__ == "__main__":
    main()
