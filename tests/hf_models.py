"""Tiny configs of HF decoder architectures, built in the test (no downloads)."""

from __future__ import annotations

import torch
import transformers

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
)

# name -> (config class, overrides, attention implementations to test)
ARCHS: dict[str, tuple[str, dict, tuple[str, ...]]] = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2), ("sdpa", "eager")),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=8), ("sdpa", "eager")),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2), ("sdpa", "eager")),
    "phi3": ("Phi3Config", dict(num_key_value_heads=2, pad_token_id=0), ("sdpa", "eager")),
    "gemma2": (
        "Gemma2Config",
        dict(num_key_value_heads=2, head_dim=16, sliding_window=8, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
        ("eager",),  # transformers' Gemma2 has no SDPA path (softcap): `_supports_sdpa = False`
    ),
    "gpt_neox": ("GPTNeoXConfig", dict(rotary_pct=0.5), ("sdpa", "eager")),
}


def tiny_config(arch: str):
    cls_name, overrides, _ = ARCHS[arch]
    cls = getattr(transformers, cls_name)
    return cls(**{**COMMON, **overrides})


def build_model(arch: str, impl: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=dtype)
    return model.eval()


def arch_impl_params():
    return [(a, i) for a, (_, _, impls) in ARCHS.items() for i in impls]
