"""`runtime.o_prefetch`: each decode layer's attention kernel asks L2 for its output weight.

CPU: the source on a tiny Llama (``self_attn.o_proj``) and a GPT-2 (``attn.c_proj``, a Conv1D),
the refusals (layer counts that do not match, a layer without a known attention block), the
config check, the Triton backend (Triton's interpreter) asking the source once per layer during
generate, with the same tokens as without it, and a backend without the prefetches warning.
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
from attngraph.runtime.accelerate import state_of
from attngraph.runtime.o_prefetch import o_prefetch_source, output_weight

from .test_mlp_prefetch import tiny_llama


def test_llama_layers_prefetch_their_o_proj():
    model = tiny_llama()
    source = o_prefetch_source(model, 3)
    for i, layer in enumerate(model.model.layers):
        weight, size = source(i)
        assert weight is layer.self_attn.o_proj.weight and size == 64 * 64 * 4
    assert source(3) is None and source(-1) is None
    assert o_prefetch_source(model, 4)(0) is None  # 3 decoder layers, 4 attention layers


def test_gpt2_prefetches_its_conv1d_c_proj():
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    weight, size = o_prefetch_source(model, 2)(1)
    assert weight is model.transformer.h[1].attn.c_proj.weight and size == 32 * 32 * 4


def test_layer_without_a_known_attention_block_gets_none():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.mixer = nn.Linear(4, 4)
            self.mlp = nn.Linear(4, 4)

    assert output_weight(Layer()) is None
    model = nn.Module()
    model.layers = nn.ModuleList([Layer(), Layer()])
    assert o_prefetch_source(model, 2)(0) is None


def test_config_takes_a_bool():
    assert CompileConfig(l2_prefetch_o=True).l2_prefetch_o is True
    with pytest.raises(ConfigError, match="l2_prefetch_o"):
        CompileConfig(l2_prefetch_o="yes")


def _generate(model, device: str, **options):
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (2, 9)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    attngraph.accelerate(model, attention_backend="triton", kv_cache_tokens=1024, **options)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    backend = state_of(model).runner.backend
    ranges = dict(getattr(backend, "decode_backend", backend)._l2_next_ranges)
    attngraph.restore(model)
    return out, ranges


def test_triton_backend_asks_the_source_once_per_layer():
    """Under Triton's interpreter the kernel issues no prefetch (no programmatic dependent launch),
    but the backend hands each layer's range to it: the o_proj weights the model holds then."""
    from attngraph.attn_backends.triton_ops.decode_attention import interpreter_problem, interpreting

    if torch.cuda.is_available() or not interpreting() or interpreter_problem():
        pytest.skip("the CPU form of this test runs the kernels in Triton's interpreter")
    plain, none = _generate(tiny_llama(), "cpu")
    model = tiny_llama()
    want = [layer.self_attn.o_proj.weight for layer in model.model.layers]
    out, ranges = _generate(model, "cpu", l2_prefetch_o=True)
    assert none == {} and torch.equal(out, plain)
    assert sorted(ranges) == [0, 1, 2]
    assert all(ranges[i][0] is want[i] and ranges[i][1] == want[i].numel() * 4 for i in range(3))


@pytest.mark.gpu
def test_generate_equal_with_and_without_the_prefetch_on_gpu():
    from attngraph import pdl

    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("needs programmatic dependent launch (compute capability 9.0, a Triton with gdc_wait)")
    outs = []
    for on in (False, True, False, True):
        out, ranges = _generate(tiny_llama(device="cuda", dtype=torch.bfloat16), "cuda", l2_prefetch_o=on)
        outs.append(out)
        if on:
            assert sorted(ranges) == [0, 1, 2] and all(r is not None and r[1] == 64 * 64 * 2 for r in ranges.values())
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_backends_without_the_prefetches_warn(caplog):
    """torch_native decodes without L2 hints: each setting asked for is named in a warning, and
    generate runs as without it."""
    outs = []
    for options in ({}, dict(l2_prefetch_o=True, l2_prefetch_mlp_bytes=1 << 20)):
        model = tiny_llama()
        caplog.clear()
        with caplog.at_level("WARNING", logger="attngraph.runtime.model_runner"):
            attngraph.accelerate(model, attention_backend="torch_native", kv_cache_tokens=1024, **options)
            ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(2))
            outs.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                                       pad_token_id=0))  # fmt: skip
        warned = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
        assert len(warned) == len(options), warned
        assert all("TorchNativeBackend" in w for w in warned)
        attngraph.restore(model)
    assert torch.equal(outs[0], outs[1])
