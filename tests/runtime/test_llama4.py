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


def test_backends_without_chunks_are_refused_with_the_reason():
    from attngraph.attn_backends.base import BackendCapabilities, ModelAttentionSpec
    from attngraph.attn_backends.hybrid import create_attention_backend

    spec = ModelAttentionSpec(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dims=(64,), dtype=torch.bfloat16,
                              device_type="cuda", page_size=16, uses_chunks=True)  # fmt: skip
    caps = BackendCapabilities(device_types=("cuda",), dtypes=(torch.bfloat16,), chunked=False)
    assert "chunked local attention" in caps.why_not(spec)
    assert BackendCapabilities(device_types=("cuda",), dtypes=(torch.bfloat16,)).why_not(spec) is None
    cpu = ModelAttentionSpec(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dims=(16,), dtype=torch.float32,
                             device_type="cpu", page_size=4, uses_chunks=True)  # fmt: skip
    assert create_attention_backend("torch_native", spec=cpu).capabilities.chunked
    flashinfer = pytest.importorskip("attngraph.attn_backends.flashinfer_backend")
    assert not flashinfer.FlashInferBackend.capabilities.chunked


def test_a_prompt_with_holes_is_refused_for_a_chunked_model():
    from ..hf_models import build_model

    model = build_model("llama4", "sdpa")
    attngraph.accelerate(model, attention_backend="torch_native", page_size=4)
    ids = torch.randint(3, 96, (1, 12))
    mask = torch.ones_like(ids)
    mask[0, 5] = 0  # a hole between real tokens
    with pytest.raises(attngraph.UnsupportedGenerationError, match="chunked"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
