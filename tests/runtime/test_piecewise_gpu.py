"""Every CUDA-graph mode on the GPU in bf16 against HF eager: Llama-, Qwen2- (sliding-window
layers) and Gemma2-shaped (softcapped scores and logits, alternating windows) models.

Random weights give nearly flat next-token distributions, so agreement is measured
teacher-forced (see `test_generate_gpu.py`): the prefill logits at every valid position (a
piecewise step padded up to its bucket) and every generated step's logits must be within bf16
tolerance of HF eager on the same prefix, and the greedy choice must agree at >= 95% of
positions. No compilation may happen after `accelerate()` returns.
"""

import copy

import pytest
import torch
import transformers

import attngraph
from attngraph.runtime.accelerate import state_of
from attngraph.runtime.paged_cache import PagedCache

from .test_generate_gpu import assert_bf16_close, batch, generate_teacher_forced

pytestmark = [pytest.mark.gpu]

MODES = ["full_and_piecewise", "piecewise", "breakable", "full", "none"]
COMMON = dict(
    vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, initializer_range=0.02,
)


def model_of(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "llama":
        cfg, impl = transformers.LlamaConfig(**COMMON), "sdpa"
    elif arch == "qwen2":  # layers 2 and 3 use a 24-token window
        cfg, impl = transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=24, max_window_layers=2), "sdpa"
    else:  # gemma2: every other layer windowed, softcapped scores and logits
        cfg = transformers.Gemma2Config(  # head_dim 128: FlashInfer's prebuilt softcap kernels
            **{**COMMON, "head_dim": 128}, sliding_window=24, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=128,
        )  # fmt: skip
        impl = "eager"
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation=impl).cuda().eval()


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("mode", MODES)
def test_graph_mode_matches_hf_eager(mode, arch, backend):
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    model = model_of(arch)
    reference = copy.deepcopy(model)
    attngraph.accelerate(
        model, attention_backend=backend, cuda_graph=mode, page_size=16, kv_cache_tokens=8192,
        cuda_graph_capture_sizes=(1, 2, 4), cuda_graph_num_tokens=(16, 64, 128),
    )  # fmt: skip
    runner = state_of(model).runner
    assert runner.num_compilations == 1
    assert (runner.graphs is not None) == (mode in ("full", "full_and_piecewise"))
    # Triton captures extend attention: whole prefill graphs instead of pieces.
    whole = backend == "triton" and mode in ("full", "full_and_piecewise")
    assert (runner.extend_graphs is not None) == whole
    assert (runner.piecewise is not None) == (mode in ("full_and_piecewise", "piecewise", "breakable") and not whole)
    ids, mask = batch(model.config.vocab_size)  # 98 tokens: one step padded to 128
    valid = mask.bool()
    with torch.no_grad():
        want = reference(ids, attention_mask=mask).logits
    replays = runner.piecewise.state.replays if runner.piecewise else 0
    whole_replays = runner.extend_graphs.replays if whole else 0
    cache = PagedCache(runner)
    try:
        got = cache.step(ids, mask, 0)
    finally:
        cache.free()
    assert_bf16_close(got[valid], want[valid])
    if whole:  # logits of every row: above what the whole-step graphs return (the last row's)
        assert runner.extend_graphs.replays == whole_replays
    if runner.piecewise is not None:
        assert runner.piecewise.state.replays > replays, "the prefill did not replay the piecewise graphs"
        # Both backends opt in: the metadata made at capture is refreshed, not rebuilt.
        captured = runner.piecewise.captured_metadata
        assert captured is not None
        if backend == "flashinfer":
            assert runner.backend._meta.kv_indices.data_ptr() == captured.kv_indices.data_ptr()

    generate_teacher_forced(model, reference, ids, mask, 48)
    if whole:
        assert runner.extend_graphs.replays == whole_replays + 1, "generate's prefill did not replay its graph"
    assert runner.num_compilations == 1, "a step compiled after accelerate() returned"
    assert runner.pool.num_used_pages == 0
    attngraph.restore(model)


@pytest.mark.parametrize("mode", ["full_and_piecewise", "breakable"])
def test_steps_above_the_largest_bucket_run_without_graphs(mode):
    model = model_of("llama")
    reference = copy.deepcopy(model)
    attngraph.accelerate(
        model, attention_backend="triton", cuda_graph=mode, kv_cache_tokens=8192,
        cuda_graph_capture_sizes=(1, 2), cuda_graph_num_tokens=(16, 32),
    )  # fmt: skip
    runner = state_of(model).runner
    graphs = runner.extend_graphs if mode == "full_and_piecewise" else runner.piecewise  # triton: whole graphs
    counter = (lambda: graphs.replays) if mode == "full_and_piecewise" else (lambda: graphs.state.replays)
    ids, mask = batch(model.config.vocab_size, lengths=(30, 25))  # 55 tokens > 32
    with torch.no_grad():
        want = reference(ids, attention_mask=mask).logits
    replays = counter()
    cache = PagedCache(runner)
    try:
        got = cache.step(ids, mask, 0)
    finally:
        cache.free()
    assert counter() == replays
    assert_bf16_close(got[mask.bool()], want[mask.bool()])
    assert runner.num_compilations == 1
    attngraph.restore(model)
