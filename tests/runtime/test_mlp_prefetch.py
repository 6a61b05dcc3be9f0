"""`runtime.mlp_prefetch`: which bytes each decode layer asks into L2 during its attention.

CPU: the plan on a tiny Llama (gate and up separate, then fused as `passes.fuse_linears`
leaves them), the refusals (experts, layer counts that do not match), the config check.
GPU: generate with the prefetch equals generate without it (a hint changes no token).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

import attngraph
from attngraph.config import CompileConfig
from attngraph.errors import ConfigError
from attngraph.runtime.mlp_prefetch import decoder_layers, first_weight_range, mlp_prefetch_source


def tiny_llama(layers: int = 3, device: str = "cpu", dtype=torch.float32) -> transformers.PreTrainedModel:
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def fuse_gate_up(model) -> None:
    """Gate and up rows of one tensor, each parameter a view of its rows (as `fuse_linears`)."""
    for layer in model.model.layers:
        gate, up = layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight
        fused = torch.cat([gate.data, up.data])
        gate.data, up.data = fused[: gate.shape[0]], fused[gate.shape[0] :]


def test_unfused_mlp_prefetches_its_gate_weight_only():
    model = tiny_llama()
    assert decoder_layers(model, 3) is model.model.layers
    weight, size = first_weight_range(model.model.layers[1].mlp)
    gate = model.model.layers[1].mlp.gate_proj.weight
    assert weight is gate and size == gate.numel() * gate.element_size()


def test_fused_gate_up_is_one_range_and_the_source_clamps_it():
    model = tiny_llama()
    fuse_gate_up(model)
    mlp = model.model.layers[2].mlp
    weight, size = first_weight_range(mlp)
    both = 2 * mlp.gate_proj.weight.numel() * 4
    assert weight is mlp.gate_proj.weight and size == both  # down_proj is a storage of its own
    source = mlp_prefetch_source(model, 3, nbytes=1000)
    got_weight, got = source(2)
    assert got_weight is mlp.gate_proj.weight and got == 1000
    assert mlp_prefetch_source(model, 3, nbytes=1 << 30)(0)[1] == both
    assert source(3) is None and source(-1) is None


def test_experts_and_mismatched_layer_counts_get_no_prefetch():
    model = tiny_llama()
    assert mlp_prefetch_source(model, 4, nbytes=1 << 20)(0) is None  # 3 decoder layers, 4 attention layers

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(8, 4)
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    assert first_weight_range(Experts()) is None
    assert first_weight_range(nn.Sequential(nn.ReLU())) is None


def test_the_source_finds_the_layer_list_once(monkeypatch):
    from attngraph.runtime import mlp_prefetch

    model = tiny_llama()
    walks = []
    real = mlp_prefetch.decoder_layers
    monkeypatch.setattr(mlp_prefetch, "decoder_layers", lambda *a: walks.append(a) or real(*a))
    source = mlp_prefetch_source(model, 3, nbytes=1 << 20)
    got = [source(i) for i in range(3)]
    assert len(walks) == 1
    assert [w is model.model.layers[i].mlp.gate_proj.weight for i, (w, _) in enumerate(got)] == [True] * 3


def test_config_checks_the_byte_count():
    assert CompileConfig(l2_prefetch_mlp_bytes=1 << 25).l2_prefetch_mlp_bytes == 1 << 25
    for bad in (-1, True, 1.5, "32MB"):
        with pytest.raises(ConfigError, match="l2_prefetch_mlp_bytes"):
            CompileConfig(l2_prefetch_mlp_bytes=bad)


@pytest.mark.gpu
def test_generate_equal_with_and_without_the_prefetch_on_gpu():
    from attngraph import pdl
    from attngraph.runtime.accelerate import state_of

    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("needs programmatic dependent launch (compute capability 9.0, a Triton with gdc_wait)")
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (2, 24), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    outs = []
    for nbytes in (0, 1 << 20):
        model = tiny_llama(device="cuda", dtype=torch.bfloat16)
        attngraph.accelerate(model, attention_backend="triton", l2_prefetch_mlp_bytes=nbytes, kv_cache_tokens=4096)
        outs.append(model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0))
        backend = state_of(model).runner.backend
        ranges = dict(getattr(backend, "decode_backend", backend)._prefetch_ranges)
        attngraph.restore(model)
    assert torch.equal(outs[0], outs[1])
    # with the prefetch on, every layer found its fused gate/up rows (captured at warm-up)
    assert sorted(ranges) == [0, 1, 2] and all(r is not None and r[1] > 0 for r in ranges.values())
