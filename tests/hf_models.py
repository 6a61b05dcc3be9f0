"""Tiny configs of HF decoder architectures, built in the test (no downloads).

Two layers, fp32, sliding windows of 8 tokens (shorter than the generate tests' prompts), so
that every feature an architecture has (window, softcap, per-layer RoPE or window, MoE
routing, q/k norms, partial rotary, learned positions) changes the tokens when mishandled.
"""

from __future__ import annotations

import importlib

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

BOTH = ("sdpa", "eager")
# MoE: 4 experts, 2 per token; experts run as transformers' default ("grouped_mm", one graph).
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)


def _supports_sdpa(model_type: str) -> bool:
    """Does this transformers version have an SDPA path for ``model_type``?"""
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    base = next(getattr(module, n) for n in dir(module) if n.endswith("PreTrainedModel"))
    return bool(getattr(base, "_supports_sdpa", False))


# name -> (config class, overrides, attention implementations to test)
ARCHS: dict[str, tuple[str, dict, tuple[str, ...]]] = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2), BOTH),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=8), BOTH),
    "mixtral": ("MixtralConfig", dict(num_key_value_heads=2, sliding_window=8, num_local_experts=4, num_experts_per_tok=2), BOTH),
    # Qwen2: layer 0 full, layer 1 sliding (layers from max_window_layers on).
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=1), BOTH),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(num_key_value_heads=2, num_experts=4, shared_expert_intermediate_size=48, **MOE),
        BOTH,
    ),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=16), BOTH),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_key_value_heads=2, head_dim=16, num_experts=4, **MOE), BOTH),
    "phi3": ("Phi3Config", dict(num_key_value_heads=2, pad_token_id=0), BOTH),
    "phi": ("PhiConfig", dict(qk_layernorm=True), BOTH),  # partial rotary (0.5), MHA
    "gemma": ("GemmaConfig", dict(num_key_value_heads=1, head_dim=16), BOTH),
    "gemma2": (
        "Gemma2Config",
        dict(num_key_value_heads=2, head_dim=16, sliding_window=8, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
        # transformers >= 5.2x dropped Gemma2's SDPA path (SDPA cannot softcap); 5.17 still has
        # it, and there HF's SDPA output has no softcap, which the graph shows and the op copies.
        ("sdpa", "eager") if _supports_sdpa("gemma2") else ("eager",),
    ),
    "gemma3": (  # Gemma3ForCausalLM: sliding and global layers, a RoPE base per layer type
        "Gemma3TextConfig",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
        ),
        BOTH,
    ),
    "gpt_neox": ("GPTNeoXConfig", dict(rotary_pct=0.5), BOTH),
    "gpt2": ("GPT2Config", dict(n_inner=96, bos_token_id=1, eos_token_id=2), BOTH),
    "opt": ("OPTConfig", dict(ffn_dim=96, word_embed_proj_dim=64, bos_token_id=1, eos_token_id=2, pad_token_id=0), BOTH),
    "falcon": (  # 40B layout: K/V broadcast to every head before RoPE; eager scales with `/=`
        "FalconConfig",
        dict(num_kv_heads=2, new_decoder_architecture=True, alibi=False, bos_token_id=1, eos_token_id=2),
        BOTH,
    ),
    "falcon_alibi": (  # ALiBi: the bias in SDPA's mask; eager adds it before and after the scale
        "FalconConfig",
        dict(num_kv_heads=2, new_decoder_architecture=True, alibi=True, bos_token_id=1, eos_token_id=2),
        BOTH,
    ),
    "mpt": (  # ALiBi from a table of max_seq_len columns, sliced by the length: the traced forward
        # holds at most 47 tokens per step, so the paged runtime runs longer steps in parts
        "MptConfig",
        dict(max_seq_len=48, expansion_ratio=2),
        ("sdpa", "eager") if _supports_sdpa("mpt") else ("eager",),
    ),
    "bloom": (  # ALiBi through baddbmm on [batch*heads, seq, dim]; transformers has eager attention only
        "BloomConfig",
        dict(bos_token_id=1, eos_token_id=2, pad_token_id=0),
        ("eager",),
    ),
    "falcon_multi_query": (  # 7B layout: one KV head broadcast over the query heads, whatever num_kv_heads says
        "FalconConfig",
        dict(multi_query=True, new_decoder_architecture=False, alibi=False, bos_token_id=1, eos_token_id=2),
        BOTH,
    ),
    "stablelm": ("StableLmConfig", dict(num_key_value_heads=2, qk_layernorm=True, use_qkv_bias=True), BOTH),
    "olmo2": ("Olmo2Config", dict(num_key_value_heads=2, pad_token_id=0, eos_token_id=2), BOTH),
    "granite": (  # attention_multiplier is the scale
        "GraniteConfig",
        dict(num_key_value_heads=2, attention_multiplier=0.2, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0),
        BOTH,
    ),
    "cohere": ("CohereConfig", dict(num_key_value_heads=2, use_qk_norm=True, logit_scale=0.5), BOTH),
    "starcoder2": ("Starcoder2Config", dict(num_key_value_heads=2, sliding_window=8, bos_token_id=1, eos_token_id=2), BOTH),
    "smollm3": ("SmolLM3Config", dict(num_key_value_heads=2, no_rope_layer_interval=2, pad_token_id=0), BOTH),  # layer 1: no RoPE
    # MLA: latent 32 + RoPE 8 (the paged pool's one KV head of 40); per head nope 16, values 16
    "deepseek_v3": (  # layer 1 MoE, interleaved RoPE
        "DeepseekV3Config",
        dict(num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=16, n_routed_experts=4, n_group=1, topk_group=1, first_k_dense_replace=1, bos_token_id=1,
             eos_token_id=2, **MOE),
        BOTH,
    ),
    "deepseek_v2": (  # its own modeling code, dense MLPs
        "DeepseekV2Config",
        dict(num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=16, n_routed_experts=4, n_group=1, topk_group=1, first_k_dense_replace=2, **MOE),
        BOTH,
    ),
    "minicpm3": (  # MLA with a q_lora path (q_a -> norm -> q_b)
        "MiniCPM3Config",
        dict(num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=16),
        BOTH,
    ),
    "llama4": (  # chunked local layers (RoPE) and a global NoPE layer; dense MLPs (its MoE and
        # temperature tuning are refused by the paged runtime: tests/runtime/test_llama4.py)
        "Llama4TextConfig",
        dict(num_key_value_heads=2, head_dim=16, intermediate_size_mlp=96, attention_chunk_size=8, no_rope_layers=[1, 0],
             moe_layers=[], attn_temperature_tuning=False),
        BOTH,
    ),
    "gpt_oss": (  # attention sinks, sliding and full layers, MoE; transformers has eager attention only
        "GptOssConfig",
        dict(num_key_value_heads=2, head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
             layer_types=["sliding_attention", "full_attention"]),
        ("eager",),
    ),
}

# Parameters an architecture initializes to values that would hide a mishandled feature.
_POST_INIT = {
    "gpt_oss": lambda model: [layer.self_attn.sinks.data.normal_() for layer in model.model.layers],  # zeros
}


def tiny_config(arch: str):
    cls_name, overrides, _ = ARCHS[arch]
    cls = getattr(transformers, cls_name)
    return cls(**{**COMMON, **overrides})


def build_model(arch: str, impl: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=dtype)
    if arch in _POST_INIT:
        with torch.no_grad():
            _POST_INIT[arch](model)
    return model.eval()


def arch_impl_params():
    return [(a, i) for a, (_, _, impls) in ARCHS.items() for i in impls]


def gpu_model(arch: str, dtype: torch.dtype, seed: int = 0):
    """``(model, reference)`` on CUDA: the tiny config widened to head dim 64 (FlashInfer's
    prebuilt kernels serve it; 4 query heads), ``model`` in ``dtype`` and ``reference`` in
    float32 holding exactly the same (rounded) weights."""
    cfg = tiny_config(arch)
    cfg.hidden_size, cfg.head_dim = 256, 64
    torch.manual_seed(seed)
    reference = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").cuda().eval()
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype).cuda().eval()
    model.load_state_dict(reference.state_dict())
    reference.load_state_dict(model.state_dict())  # the reference holds the rounded weights
    return model, reference
