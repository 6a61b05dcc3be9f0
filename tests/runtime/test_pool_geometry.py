"""The KV pool is shaped like the traced attention sites, not like the config's head counts.

Falcon's config calls its KV heads ``num_kv_heads`` and the model reads it per layout:
Falcon-7B (``multi_query``, old layout) caches one KV head whatever ``num_kv_heads`` says;
Falcon-40B (``new_decoder_architecture``) broadcast K/V to every query head before RoPE up to
transformers 5.24, so the graph (and the pool) held ``num_attention_heads`` of them; from 5.25
it attends over its ``num_kv_heads`` groups (grouped-query attention), and the pool holds those.
The old layout without ``multi_query`` is plain multi-head attention.
"""

import copy

import pytest
import torch
import transformers

import attngraph
from attngraph import CompileConfig
from attngraph.errors import UnsupportedModelError
from attngraph.passes.site import AttentionSite, ScaleExpr
from attngraph.runtime.accelerate import state_of
from attngraph.forward_batch import ForwardBatch
from attngraph.runtime.model_runner import ModelRunner, attention_geometry
from attngraph.runtime.paged_cache import PagedCache

from ..hf_models import COMMON
from .test_generate import PAD, left_padded_batch

# layout -> (FalconConfig overrides, KV heads the model really caches); 4 query heads of dim 16
# (None: the new decoder's, which depend on the transformers version: `cached_kv_heads`)
FALCON_LAYOUTS = {
    "7b_multi_query": (dict(multi_query=True, new_decoder_architecture=False), 1),
    "40b_new_decoder": (dict(new_decoder_architecture=True, num_kv_heads=2), None),
    "old_layout_mha": (dict(multi_query=False, new_decoder_architecture=False), 4),
}


def cached_kv_heads(model: torch.nn.Module, layout: str) -> int:
    """KV heads the model's attention really attends over: the new decoder's ``num_kv_heads``
    groups where its attention repeats them per query group (transformers >= 5.25, whose
    module has ``num_key_value_groups``), else all query heads (K/V broadcast before RoPE)."""
    want = FALCON_LAYOUTS[layout][1]
    if want is not None:
        return want
    attn = model.transformer.h[0].self_attention
    return attn.num_kv_heads if hasattr(attn, "num_key_value_groups") else attn.num_heads
GREEDY = dict(max_new_tokens=6, do_sample=False, pad_token_id=PAD, eos_token_id=None)


def falcon(layout: str, impl: str, seed: int = 0) -> torch.nn.Module:
    overrides, _ = FALCON_LAYOUTS[layout]
    cfg = transformers.FalconConfig(**{**COMMON, "alibi": False, "bos_token_id": 1, "eos_token_id": 2, **overrides})
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).eval()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("layout", list(FALCON_LAYOUTS))
def test_falcon_layouts_generate_like_hf(layout, impl):
    model = falcon(layout, impl)
    reference = copy.deepcopy(model)
    attngraph.accelerate(model, attention_backend="torch_native", page_size=4)
    runner = state_of(model).runner
    kv_heads = cached_kv_heads(reference, layout)
    assert (runner.geometry.num_layers, runner.geometry.num_q_heads) == (2, 4)
    assert (runner.geometry.num_kv_heads, runner.geometry.head_dim) == (kv_heads, 16)
    assert runner.pool.num_kv_heads == kv_heads and runner.pool.k_buffers[0].shape[2:] == (kv_heads, 16)
    assert len(runner.pool.k_buffers) == 2
    ids, mask = left_padded_batch(model.config.vocab_size, lengths=(11, 6))
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(model.generate(ids, attention_mask=mask, **GREEDY), want)
    assert runner.num_compilations == 1
    assert runner.pool.num_used_pages == 0 and runner.pool.num_active_requests == 0


def test_first_pool_access_traces_once_and_steps_reuse_the_graph():
    """Driving ModelRunner directly (its docstring's recipe, no warmup): `pool` compiles the
    model to size itself; the steps that follow run that same graph and give HF's logits."""
    model = falcon("7b_multi_query", "sdpa", seed=3)
    runner = ModelRunner(model, CompileConfig(attention_backend="torch_native", page_size=4, kv_cache_tokens=64))
    assert runner.num_compilations == 0 and runner._geometry is None and runner._pool is None
    pool = runner.pool
    assert runner.num_compilations == 1 and pool.num_kv_heads == 1 and pool.num_pages == 16
    assert runner.pool is pool
    tokens = torch.randint(3, model.config.vocab_size, (9,), generator=torch.Generator().manual_seed(0))
    row = pool.alloc_request()
    pool.reserve([row], [8])
    got = [runner.forward(ForwardBatch.build(pool, [row], [0], [8], tokens[:8]))[0]]
    pool.reserve([row], [9])
    got.append(runner.forward(ForwardBatch.decode(pool, [row], [8], tokens[8:9]))[0])
    pool.free_request(row)
    with torch.no_grad():
        want = model(input_ids=tokens[None]).logits[0]
    torch.testing.assert_close(torch.stack(got), want[[7, 8]], atol=1e-4, rtol=1e-4)
    assert runner.num_compilations == 1 and pool.num_used_pages == 0


@pytest.mark.parametrize("trace_tokens", [None, 5, 40])
def test_the_trace_length_changes_no_result_and_compiles_once(trace_tokens):
    """The dummy sequence the model is compiled on (`CompileConfig.trace_tokens`, 2 on the CPU
    by default) only sizes inductor's kernels: the steps after it, shorter or longer, reuse
    the one graph and generate HF's tokens."""
    model = falcon("40b_new_decoder", "sdpa", seed=5)
    reference = copy.deepcopy(model)
    attngraph.accelerate(model, attention_backend="torch_native", page_size=4, trace_tokens=trace_tokens)
    runner = state_of(model).runner
    assert runner.trace_tokens() == (trace_tokens or 2)
    ids, mask = left_padded_batch(model.config.vocab_size, lengths=(13, 4))
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(model.generate(ids, attention_mask=mask, **GREEDY), want)
    assert runner.num_compilations == 1


def test_paged_cache_on_a_fresh_runner_compiles_once():
    """`PagedCache` reads `geometry` (its layer count) before `pool`: either access compiles."""
    runner = ModelRunner(falcon("7b_multi_query", "eager"), CompileConfig(attention_backend="torch_native", kv_cache_tokens=64))
    cache = PagedCache(runner)
    assert runner.num_compilations == 1 and len(cache.layers) == 2 and cache.pool is runner.pool
    assert runner.pool.num_kv_heads == 1 and runner.num_compilations == 1


def test_release_before_the_pool_exists_compiles_nothing():
    runner = ModelRunner(falcon("7b_multi_query", "sdpa"), CompileConfig(attention_backend="torch_native"))
    runner.release()
    assert runner.num_compilations == 0 and runner._geometry is None and runner._pool is None


# --------------------------------------------------------------------------- refusals
def site(layer_id: int, hq: int = 4, hkv: int = 1, d: int = 16, dv: int = 16) -> AttentionSite:
    return AttentionSite(
        name=f"h.{layer_id}.attn", kind="sdpa", output=None, scale=ScaleExpr(0.25), num_q_heads=hq,
        num_kv_heads=hkv, head_dim=d, v_head_dim=dv, layer_id=layer_id, lowerable=True, lowered=True,
    )  # fmt: skip


def test_geometry_is_read_from_the_sites():
    g = attention_geometry([site(0), site(1)])
    assert (g.num_layers, g.num_q_heads, g.num_kv_heads, g.head_dim, g.v_head_dim) == (2, 4, 1, 16, 16)
    g = attention_geometry([site(0, dv=8), site(1, dv=8)])  # values narrower than keys (MLA's MHA form)
    assert (g.head_dim, g.v_head_dim) == (16, 8)


@pytest.mark.parametrize(
    "sites,match",
    [
        ([site(0), site(1, hkv=2)], "h.1.attn has 4 query / 2 KV heads.*one shape for every layer"),
        ([site(0), site(1, d=8, dv=8)], "h.1.attn .* of dim 8/8"),
        ([site(0, dv=8), site(1)], "h.1.attn .* of dim 16/16, but h.0.attn .* of dim 16/8"),
        ([site(0), site(0)], "same KV-pool layer"),
        ([], "no attention site"),
    ],
)
def test_sites_the_pool_cannot_hold_are_refused(sites, match):
    with pytest.raises(UnsupportedModelError, match=match):
        attention_geometry(sites)


def test_recompiled_graph_must_fit_the_existing_pool():
    runner = ModelRunner(falcon("7b_multi_query", "sdpa"), CompileConfig(attention_backend="torch_native", kv_cache_tokens=64))
    runner.warmup()
    backend = runner.backend
    with pytest.raises(UnsupportedModelError, match=r"\(4 query / 2 KV heads .* does not fit the KV pool .*\(4 query / 1 KV heads of dim 16"):
        runner._on_sites_checked([site(0, hkv=2), site(1, hkv=2)])
    with pytest.raises(UnsupportedModelError, match=r"3 layers\) does not fit"):
        runner._on_sites_checked([site(0), site(1), site(2)])
    assert runner.backend is backend and runner.pool.num_kv_heads == 1
    runner._on_sites_checked([site(0), site(1)])  # a graph that fits is accepted
    assert runner.geometry.num_kv_heads == 1
