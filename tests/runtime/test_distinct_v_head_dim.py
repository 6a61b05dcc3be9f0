"""Keys and values of different head dims in the paged runtime (multi-head latent attention in
its MHA form, DeepSeek V3 with ``absorb_mla=False``: per head, keys of 16 + 8 RoPE values and
values of 16; the latent form is tested in tests/passes/test_absorb_mla.py)."""

import copy
import os

import pytest
import torch

import attngraph
from attngraph.attn_backends.base import BackendCapabilities, ModelAttentionSpec
from attngraph.attn_backends.hybrid import combine_capabilities
from attngraph.attn_backends.registry import resolve_backend_name
from attngraph.errors import BackendUnavailableError
from attngraph.runtime.accelerate import state_of

from ..hf_models import build_model
from .test_generate import GREEDY, PAD, left_padded_batch


def _backends():
    """torch_native, and Triton where its kernels run: CUDA, or the CPU interpreter when this
    Triton / numpy pair can run it (`test_triton_interpreter.py` checks the refusal otherwise)."""
    names = ["torch_native"]
    if torch.cuda.is_available():
        names.append("triton")
    elif os.environ.get("TRITON_INTERPRET") == "1":
        from attngraph.attn_backends.triton_ops import interpreter_problem

        if interpreter_problem() is None:
            names.append("triton")
    return names


@pytest.mark.parametrize("backend", _backends())
def test_pool_holds_both_dims_and_generates_like_hf(backend):
    model = build_model("deepseek_v3", "sdpa", seed=2)
    reference = copy.deepcopy(model)
    attngraph.accelerate(model, attention_backend=backend, page_size=4, kv_cache_tokens=256, max_context_len=64,
                         absorb_mla=False)  # fmt: skip
    runner = state_of(model).runner
    g = runner.geometry
    assert (g.head_dim, g.v_head_dim) == (24, 16)
    assert runner.pool.k_buffers[0].shape[-1] == 24 and runner.pool.v_buffers[0].shape[-1] == 16
    assert runner.spec.v_head_dim == 16 and runner.spec.head_dims == (16, 24)
    ids, mask = left_padded_batch(model.config.vocab_size, lengths=(11, 5))
    kw = {**GREEDY, "max_new_tokens": 6}
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(model.generate(ids, attention_mask=mask, **kw), want)
    sampling = dict(max_new_tokens=6, do_sample=True, temperature=0.9, top_k=20, pad_token_id=PAD)
    torch.manual_seed(5)
    got = model.generate(ids, attention_mask=mask, **sampling)
    torch.manual_seed(5)
    assert torch.equal(got, reference.generate(ids, attention_mask=mask, **sampling))
    assert runner.num_compilations == 1 and runner.pool.num_used_pages == 0


def _spec(v_head_dim):
    return ModelAttentionSpec(num_layers=2, num_q_heads=4, num_kv_heads=4, head_dims=(128, 192), dtype=torch.bfloat16,
                              device_type="cuda", page_size=16, v_head_dim=v_head_dim)  # fmt: skip


def test_a_backend_without_distinct_dims_is_refused_with_the_reason():
    caps = BackendCapabilities(device_types=("cuda",), dtypes=(torch.bfloat16,), distinct_v_head_dim=False)
    assert caps.why_not(_spec(None)) is None
    assert "values (128)" in caps.why_not(_spec(128))
    full = BackendCapabilities(device_types=("cuda",), dtypes=(torch.bfloat16,))
    assert full.why_not(_spec(128)) is None
    assert not combine_capabilities(prefill=full, decode=caps).distinct_v_head_dim
    assert combine_capabilities(prefill=full, decode=full).distinct_v_head_dim


def test_flashinfer_is_skipped_by_auto_and_refused_by_name():
    pytest.importorskip("flashinfer")
    # "auto" on CUDA goes past FlashInfer (its paged decode takes one head dim) to Triton.
    assert resolve_backend_name("auto", _spec(128)) == "triton"
    with pytest.raises(BackendUnavailableError, match="narrower or wider than its keys.*triton"):
        resolve_backend_name("flashinfer", _spec(128))
