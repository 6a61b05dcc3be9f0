"""Tiny configs of HF hybrid decoders: attention plus layers that keep state besides the KV
cache (SSM, short convolution, linear attention). Built in the test, no downloads.

Layer 0 is the stateful layer, layer 1 attention, so the refused module is ``model.layers.0.*``.
"""

from __future__ import annotations

import torch
import transformers

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16)

# name -> (config class, overrides, the stateful module of layer 0)
HYBRIDS: dict[str, tuple[str, dict, str]] = {
    # short causal convolution (LFM2)
    "lfm2": ("Lfm2Config", dict(layer_types=["conv", "full_attention"], conv_L_cache=3, block_ff_dim=96), "model.layers.0.conv"),
    # SSM (Mamba2 mixer)
    "bamba": ("BambaConfig", dict(attn_layer_indices=[1], **MAMBA2), "model.layers.0.mamba"),
    # linear attention (gated delta rule) with MoE feed-forward
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(
            layer_types=["linear_attention", "full_attention"], head_dim=16, linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        ),
        "model.layers.0.linear_attn",
    ),
    # SSM with MoE feed-forward
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        dict(layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48, **MAMBA2),
        "model.layers.0.mamba",
    ),
    # SSM (Mamba1 selective scan) with MoE
    "jamba": (
        "JambaConfig",
        dict(
            attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
            num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
        ),
        "model.layers.0.mamba",
    ),
}


def build_hybrid(name: str, seed: int = 0) -> torch.nn.Module:
    cls_name, overrides, _ = HYBRIDS[name]
    cfg = getattr(transformers, cls_name)(**{**COMMON, **overrides})
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
