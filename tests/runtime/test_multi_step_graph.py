"""Greedy decode steps: `PagedCache.greedy_steps` against one step at a time, and the body the
multi-step graph records (`MultiStepDecodeGraphs`), run eagerly on the CPU, against
`ModelRunner.decode_steps`' step-at-a-time path. Capture itself needs CUDA
(`test_speculative_gpu.py`)."""

import types

import pytest
import torch

from attngraph import CompileConfig
from attngraph.errors import InputError
from attngraph.runtime.model_runner import ModelRunner
from attngraph.runtime.multi_step_graph import MultiStepDecodeGraphs
from attngraph.runtime.paged_cache import PagedCache

from ..hf_models import build_model
from .test_soak import cpu_triton


def _prompts(runner, lens, g):
    vocab = runner.model.config.vocab_size
    cache = PagedCache(runner)
    width = max(lens)
    ids = torch.randint(0, vocab, (len(lens), width), generator=g)
    mask = torch.zeros(len(lens), width, dtype=torch.long)
    for b, n in enumerate(lens):
        mask[b, width - n :] = 1  # left padding
    cache.step(ids, mask, 1)
    return cache


def test_greedy_steps_match_steps_one_at_a_time():
    g = torch.Generator().manual_seed(3)
    model = build_model("llama", "sdpa", seed=9)
    runner = ModelRunner(model, CompileConfig(attention_backend="torch_native", page_size=4, kv_cache_tokens=512))
    runner.warmup()
    vocab = model.config.vocab_size
    a, b = _prompts(runner, [5, 3, 7], g), _prompts(runner, [5, 3, 7], torch.Generator().manual_seed(3))
    seqs = [0, 2]
    first = torch.randint(0, vocab, (2,), generator=g)
    got = a.greedy_steps(seqs, first, 4)  # [4, 2]
    want, tokens = [], first
    for _ in range(4):
        logits = b.extend_each(seqs, tokens, [1, 1], all_logits=False)
        tokens = torch.argmax(logits.float(), dim=-1)
        want.append(tokens)
    assert torch.equal(got, torch.stack(want))
    assert a.lengths == b.lengths and a.next_positions == b.next_positions
    assert a.lengths[1] == 3  # not stepped
    with pytest.raises(InputError, match="one token per sequence"):
        a.greedy_steps(seqs, first[:1], 2)
    with pytest.raises(InputError, match="steps >= 1"):
        a.greedy_steps(seqs, first, 0)
    with pytest.raises(InputError, match="at least one sequence"):
        a.greedy_steps([], first[:0], 2)
    with pytest.raises(InputError, match="integer token ids"):
        a.greedy_steps(seqs, first.float(), 2)
    assert a.lengths == b.lengths  # refusals change nothing
    a.free(), b.free()
    assert runner.pool.num_used_pages == 0


@pytest.mark.parametrize("steps", [1, 3])
def test_recorded_multi_step_body_matches_step_at_a_time(steps):
    """The body `MultiStepDecodeGraphs` records (planned per-step tensors, argmax fed forward
    on the device, padding requests on the pad row) gives the tokens and K/V of single steps."""
    if not cpu_triton():
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1 before import (tests/conftest.py)")
    g = torch.Generator().manual_seed(5)
    model = build_model("llama", "sdpa", seed=4)
    config = CompileConfig(attention_backend="triton", page_size=4, kv_cache_tokens=512, max_requests=4)
    runner = ModelRunner(model, config)
    runner.warmup()
    assert runner.backend.capabilities.decode_metadata_on_device
    pool = runner.pool
    cache = _prompts(runner, [6, 2, 9], g)
    seqs = [0, 1, 2]
    rows = [cache.rows[b] for b in seqs]
    lengths = [cache.lengths[b] for b in seqs]
    positions = [cache.next_positions[b] for b in seqs]
    pool.reserve(rows, [n + steps for n in lengths])
    first = torch.randint(0, model.config.vocab_size, (3,), generator=g)
    before = [k.clone() for k in pool.k_buffers]
    want = runner.decode_steps(rows, lengths, positions, first, steps)  # no graphs here: one at a time
    written = [k.clone() for k in pool.k_buffers]
    for k, s in zip(pool.k_buffers, before):
        k.copy_(s)
    fill = runner.backend.cuda_graph_seq_len_fill_value
    multi = MultiStepDecodeGraphs(runner, types.SimpleNamespace(sizes=[1, 2, 4], max_bs=4, fill=fill, pad_row=pool.pad_row))
    batches = multi._static_batches(4, steps)  # 3 requests padded to 4
    multi._stage(4, steps, rows, lengths, positions, first)
    multi.tokens.fill_(-1)  # poison: every step must write its argmax
    runner.backend.init_forward_metadata_out_graph(batches[0])
    got = multi._record(batches)[:, :3]
    assert torch.equal(got, want)
    for k, w in zip(pool.k_buffers, written):  # the real slots as single steps (3 rows there, 4 here:
        torch.testing.assert_close(k[1:], w[1:], rtol=1e-5, atol=1e-6)  # fp32 rounding); padding only on the dummy page
    cache.free()
    assert pool.num_used_pages == 0
