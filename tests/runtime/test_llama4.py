"""Llama 4 as released: chunked local layers, NoPE global layers whose queries are scaled by a
temperature computed from the token's index in the sequence, and an MoE that runs every
expert on every token. Stateless compile serves it as HF computes it; the paged runtime
refuses it and names why (the chunked layers alone are served: see ``llama4`` in
tests/hf_models.py)."""

import copy

import pytest
import torch
import transformers

import attngraph


def llama4(seed: int = 0) -> torch.nn.Module:
    cfg = transformers.Llama4TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, intermediate_size_mlp=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        attention_chunk_size=8, no_rope_layers=[1, 0], num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, floor_scale=4, attn_scale=0.5,  # the temperature changes every 4 tokens
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def test_stateless_compile_equals_hf():
    model = llama4()
    reference = copy.deepcopy(model)
    backend = attngraph.backend(attention_backend="torch_native")
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    ids = torch.randint(3, 96, (2, 21))
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
    chunked = [s for s in backend.sites if s.chunk_size]
    assert len(chunked) == 1 and chunked[0].chunk_size == 8 and all(s.lowered for s in backend.sites), str(backend.report)


def test_paged_runtime_refuses_the_temperature_and_the_moe():
    model = llama4()
    with pytest.raises(attngraph.UnsupportedModelError) as err:
        attngraph.accelerate(model, attention_backend="torch_native", page_size=4)
    text = str(err.value)
    # the temperature reads the token's index in the traced sequence, not its position
    assert "model.layers.1.self_attn" in text and "arange over tokens" in text, text
    assert "model.layers.1.feed_forward" in text, text  # repeat / view of the dense MoE
    assert not hasattr(model, "_attngraph_state")
