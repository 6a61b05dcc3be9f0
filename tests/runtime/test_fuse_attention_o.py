"""`CompileConfig.fuse_attention_o` through the paged runtime: the Triton backend runs a decode
step of one request as one launch of attention and the output projection
(`triton_ops.decode_attention_o`, in Triton's CPU interpreter here), every other step as the
two ops; greedy generation equals HF's, and a step's logits equal those of the unfused model
within bf16 rounding (the projection sums in another order than the GEMV)."""

from __future__ import annotations

import copy

import pytest
import torch

import attngraph
from attngraph import CompileConfig
from attngraph.attn_backends.triton_ops import decode_attention_o as fused_kernel
from attngraph.forward_batch import ForwardBatch
from attngraph.runtime.model_runner import ModelRunner

from ..hf_models import build_model

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


@pytest.fixture
def interpreted(monkeypatch):
    """The Triton kernels (attention, GEMV) on the CPU; counts the fused kernel's launches."""
    from attngraph import linear_ops, skinny_linear

    if torch.cuda.is_available() or not skinny_linear.interpreting() or skinny_linear.interpreter_problem() is not None:
        pytest.skip("needs Triton's interpreter on a machine without CUDA (tests/conftest.py sets TRITON_INTERPRET=1)")
    monkeypatch.setattr(linear_ops, "CPU_INTERPRETER", True)
    launches = []
    plain = fused_kernel.decode_attention_o_fwd

    def counting(q, *args, **kwargs):
        launches.append(tuple(q.shape))
        return plain(q, *args, **kwargs)

    monkeypatch.setattr(fused_kernel, "decode_attention_o_fwd", counting)
    return launches


def _config(fuse: bool, **extra) -> CompileConfig:
    # The fused kernel does not rotate (with the fusion `fold_rope` resolves to off): without it
    # the rotation stays where HF has it too, so the steps' stored keys compare bit for bit.
    extra.setdefault("fold_rope", False)
    return CompileConfig(attention_backend="triton", page_size=4, kv_cache_tokens=128, max_requests=2, max_context_len=64,
                         skinny_linears=True, fuse_attention_o=fuse, cuda_graph="none", **extra)  # fmt: skip


def _decode_logits(model, fuse: bool, prompt: torch.Tensor, tokens: list[int]):
    """Prefill ``prompt`` then decode ``tokens`` one at a time; each step's logits, and the
    layer-0 K pool rows the steps wrote."""
    runner = ModelRunner(model, _config(fuse))
    pool = runner.pool
    row = pool.alloc_request()
    n = prompt.numel()
    pool.reserve([row], [n + len(tokens)])
    runner.forward(ForwardBatch.build(pool, [row], [0], [n], prompt))
    steps = []
    for i, t in enumerate(tokens):
        batch = ForwardBatch.build(pool, [row], [n + i], [1], torch.tensor([t]))
        steps.append(runner.forward(batch).float())
    locs = ForwardBatch.build(pool, [row], [0], [n + len(tokens)], torch.zeros(n + len(tokens), dtype=torch.long)).out_cache_loc
    return torch.cat(steps), pool.k_buffers[0].view(-1, *pool.k_buffers[0].shape[-2:])[locs].clone()


def test_one_request_decodes_through_the_fused_kernel(interpreted, one_thread):
    """Same prompt and tokens with and without the fusion: the fused kernel runs once per layer
    and decode step (and never in the prefill), the logits agree within bf16 rounding and the
    keys the steps stored are the same bits."""
    model = build_model("llama", "sdpa", seed=3).to(torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, model.config.vocab_size, (7,), generator=g)
    tokens = torch.randint(0, model.config.vocab_size, (3,), generator=g).tolist()
    want, want_k = _decode_logits(copy.deepcopy(model), False, prompt, tokens)
    assert not interpreted
    got, got_k = _decode_logits(model, True, prompt, tokens)
    layers = model.config.num_hidden_layers
    assert len(interpreted) == layers * len(tokens) and all(s[0] == 1 for s in interpreted), interpreted
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert torch.equal(got_k, want_k)


def test_generate_with_the_fusion_equals_hf(interpreted, one_thread):
    """`accelerate(..., fuse_attention_o=True)` greedy-generates HF's tokens (fp32: the fused
    kernel's sums against HF's agree far below the argmax margins of a tiny model), one request
    through the fused kernel, two through the two ops."""
    model = build_model("llama", "sdpa", seed=5)
    reference = copy.deepcopy(model)
    attngraph.accelerate(model, attention_backend="triton", page_size=4, kv_cache_tokens=128, max_context_len=64,
                         skinny_linears=True, fuse_attention_o=True, cuda_graph="none")  # fmt: skip
    g = torch.Generator().manual_seed(6)
    for batch in (1, 2):
        ids = torch.randint(3, model.config.vocab_size, (batch, 6), generator=g)
        before = len(interpreted)
        with torch.no_grad():
            want = reference.generate(ids, max_new_tokens=5, **GREEDY)
        assert torch.equal(model.generate(ids, max_new_tokens=5, **GREEDY), want)
        fused = len(interpreted) - before
        assert fused == (4 * model.config.num_hidden_layers if batch == 1 else 0), fused


def test_a_kernel_fault_fails_the_generate_that_saw_it(interpreted, one_thread):
    """Projection programs of the fused kernel that stop waiting for their attention (every
    layer's merged-group count set far below zero, as a lost release would leave it) make the
    generate that ran them raise `KernelFaultError`, saying what to do, with its pages back in
    the pool; the count stays, so the next one raises too. Accelerated again without the
    fusion, the model generates HF's tokens."""
    from attngraph import KernelFaultError
    from attngraph.runtime.accelerate import state_of

    model = build_model("llama", "sdpa", seed=7)
    reference = copy.deepcopy(model)
    options = dict(attention_backend="triton", page_size=4, kv_cache_tokens=128, max_context_len=64,
                   skinny_linears=True, cuda_graph="none")  # fmt: skip
    attngraph.accelerate(model, fuse_attention_o=True, **options)
    ids = torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = reference.generate(ids, max_new_tokens=4, **GREEDY)
    assert torch.equal(model.generate(ids, max_new_tokens=4, **GREEDY), want)
    runner = state_of(model).runner
    assert runner.backend.kernel_faults() is None
    syncs = list(getattr(runner.backend, "decode_backend", runner.backend)._eager_o_sync.values())
    assert len(syncs) == model.config.num_hidden_layers
    for sync in syncs:
        sync[1] = -(1 << 20)
    for _ in range(2):
        with pytest.raises(KernelFaultError, match="stopped waiting.*fuse_attention_o=False"):
            model.generate(ids, max_new_tokens=4, **GREEDY)
        assert runner.pool.num_used_pages == 0 and runner.pool.num_active_requests == 0
    attngraph.restore(model)
    attngraph.accelerate(model, fuse_attention_o=False, **options)
    assert torch.equal(model.generate(ids, max_new_tokens=4, **GREEDY), want)
