"""Speculative decoding's graphs on the GPU (bf16): the verify graphs (logits at every token of
a ragged step) against HF eager, the draft's multi-step decode graph against the decode graph
replayed a step at a time, and whole speculative `generate` calls, teacher-forced against HF
eager as in `test_generate_gpu.py`."""

import copy

import pytest
import torch

import attngraph
from attngraph.runtime.accelerate import state_of
from attngraph.runtime.paged_cache import PagedCache

from .test_generate_gpu import assert_bf16_close, batch, model_of

pytestmark = pytest.mark.gpu

GRAPHS = dict(attention_backend="triton", page_size=16, kv_cache_tokens=8192, cuda_graph_capture_sizes=(1, 2, 4),
              cuda_graph_num_tokens=(8, 16, 32, 64))  # fmt: skip


def test_verify_graph_logits_match_hf():
    model = model_of("llama")
    reference = copy.deepcopy(model)
    attngraph.accelerate(model, **GRAPHS)
    runner = state_of(model).runner
    assert runner.verify_graphs is not None and not runner.verify_graphs.graphs  # captured on first use
    ids, mask = batch(model.config.vocab_size)
    g = torch.Generator().manual_seed(5)
    counts = [5, 1, 3, 7]  # 16 tokens: bucket 16
    new = torch.randint(3, model.config.vocab_size, (sum(counts),), generator=g).cuda()
    cache = PagedCache(runner)
    try:
        cache.step(ids, mask, 1)
        got = cache.extend_each([0, 1, 2, 3], new, counts).clone()  # [16, V]
        assert runner.verify_graphs.replays == 1 and set(runner.verify_graphs.graphs) == {16}
        got2 = cache.extend_each([1, 3], new[:3], [2, 1]).clone()  # bucket 8, captured now
        assert runner.verify_graphs.replays == 2 and set(runner.verify_graphs.graphs) == {8, 16}
    finally:
        cache.free()
    assert runner.pool.num_used_pages == 0
    start = 0
    with torch.no_grad():
        for b, c in enumerate(counts):
            seq = torch.cat([ids[b][mask[b].bool()], new[start : start + c]])[None]
            want = reference(seq).logits[0, -c:]
            assert_bf16_close(got[start : start + c], want)
            start += c
        # the second step: sequences 1 and 3 grew by the first step's tokens, then these
        extra = {1: new[:2], 3: new[2:3]}
        start = 0
        for b in (1, 3):
            off = sum(counts[:b])
            seq = torch.cat([ids[b][mask[b].bool()], new[off : off + counts[b]], extra[b]])[None]
            want = reference(seq).logits[0, -len(extra[b]) :]
            assert_bf16_close(got2[start : start + len(extra[b])], want)
            start += len(extra[b])


def test_multi_step_graph_matches_decode_graph_steps():
    model = model_of("llama")
    attngraph.accelerate(model, **GRAPHS)
    runner = state_of(model).runner
    assert runner.multi_step is not None
    ids, mask = batch(model.config.vocab_size)
    first = torch.randint(3, model.config.vocab_size, (3,), generator=torch.Generator().manual_seed(2)).cuda()
    seqs, steps = [0, 2, 3], 4  # 3 requests: the batch-4 graphs with one padding request
    a, b = PagedCache(runner), PagedCache(runner)
    try:
        a.step(ids, mask, 1)
        b.step(ids, mask, 1)
        runner.multi_step.tokens.fill_(-1)  # poison
        got = a.greedy_steps(seqs, first, steps).clone()
        assert runner.multi_step.replays == 1
        want, tokens = [], first
        for _ in range(steps):  # the decode graph of batch 4, one step per replay
            tokens = torch.argmax(b.extend_each(seqs, tokens, [1] * 3, all_logits=False).float(), dim=-1)
            want.append(tokens)
        assert torch.equal(got, torch.stack(want))
        assert a.lengths == b.lengths
        pool = runner.pool
        for s in seqs:  # the K/V the steps wrote are the same
            n = a.lengths[s]
            slots = [pool.slots_for(torch.tensor([c.rows[s]]), torch.tensor([0]), torch.tensor([n])) for c in (a, b)]
            for layer in range(len(pool.k_buffers)):
                kv = pool.k_buffers[layer].view(-1, pool.num_kv_heads, pool.head_dim)
                assert torch.equal(kv[slots[0]], kv[slots[1]])
    finally:
        a.free()
        b.free()
    assert runner.pool.num_used_pages == 0


@pytest.mark.parametrize("k", [1, 4])
def test_speculative_generate_with_graphs_agrees_with_hf(k):
    """A draft that is the target's copy (all candidates agree up to bf16 noise) and prompt
    lookup: every generated token is HF eager's greedy choice on the same prefix at >= 95% of
    positions, and the verify and multi-step graphs served the rounds."""
    model = model_of("llama")
    reference = copy.deepcopy(model)
    draft = copy.deepcopy(model)  # accelerated by the first call, with the target's config
    attngraph.accelerate(model, **GRAPHS)
    draft.generation_config.num_assistant_tokens = k
    ids, mask = batch(model.config.vocab_size)
    runner = state_of(model).runner
    new = 48
    for kwargs in (dict(assistant_model=draft), dict(prompt_lookup_num_tokens=k)):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                             eos_token_id=None, **kwargs)  # fmt: skip
        assert out.shape == (ids.shape[0], ids.shape[1] + new)
        full_mask = torch.cat([mask, torch.ones_like(out[:, ids.shape[1] :])], 1)
        with torch.no_grad():
            hf = reference(out, attention_mask=full_mask).logits[:, ids.shape[1] - 1 : -1].argmax(-1)
        agree = (hf == out[:, ids.shape[1] :]).float().mean().item()
        assert agree >= 0.95, f"{kwargs}: generated tokens are HF eager's greedy choice at {agree:.1%} of positions"
        draft_runner = state_of(draft).runner
        assert runner.pool.num_used_pages == 0 and draft_runner.pool.num_used_pages == 0
    assert runner.verify_graphs.replays > 0
    if k > 1:
        assert draft_runner.multi_step.replays > 0


def test_triton_verify_graphs_under_flashinfer():
    """``verify_attention_backend="triton"`` on a FlashInfer model: FlashInfer serves prefill and
    decode, Triton's verify graphs serve the verify steps. The draft (accelerated by the call,
    on FlashInfer) runs its decode steps a replay at a time: FlashInfer plans on the host."""
    pytest.importorskip("flashinfer")
    model = model_of("llama")
    reference = copy.deepcopy(model)
    attngraph.accelerate(model, **{**GRAPHS, "attention_backend": "flashinfer"}, verify_attention_backend="triton")
    runner = state_of(model).runner
    assert runner.verify_graphs is not None and runner.verify_graphs.backend is runner.verify_backend
    assert runner.verify_backend is not runner.backend
    draft = copy.deepcopy(reference)
    draft.generation_config.num_assistant_tokens = 3
    ids, mask = batch(model.config.vocab_size)
    new = 32
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                         eos_token_id=None, assistant_model=draft)  # fmt: skip
    assert state_of(draft).runner.multi_step is None
    full_mask = torch.cat([mask, torch.ones_like(out[:, ids.shape[1] :])], 1)
    with torch.no_grad():
        hf = reference(out, attention_mask=full_mask).logits[:, ids.shape[1] - 1 : -1].argmax(-1)
    agree = (hf == out[:, ids.shape[1] :]).float().mean().item()
    assert agree >= 0.95, f"generated tokens are HF eager's greedy choice at {agree:.1%} of positions"
    assert runner.verify_graphs.replays > 0 and runner.pool.num_used_pages == 0


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} and {tuple(b.shape)}"
    where = (a != b).nonzero()
    return "equal" if not len(where) else f"first difference at {tuple(where[0].tolist())} of {len(where)}"


def test_greedy_generate_runs_chunks_as_multi_step_graphs_bit_identical():
    """Plain greedy `generate` (no logits processor) decodes in chunks of multi-step graphs;
    its tokens equal the same model's step-at-a-time decode graphs, with and without an EOS
    that stops one sequence inside a chunk."""
    model = model_of("llama")
    attngraph.accelerate(model, **GRAPHS)
    runner = state_of(model).runner
    ids, mask = batch(model.config.vocab_size)
    multi = runner.multi_step
    kw = dict(attention_mask=mask, max_new_tokens=29, do_sample=False, pad_token_id=0)

    def generate(eos, chunks: bool):
        runner.multi_step = multi if chunks else None  # None: one decode graph per step
        try:
            return model.generate(ids, eos_token_id=eos, **kw)
        finally:
            runner.multi_step = multi

    plain = generate(None, chunks=False)
    assert torch.equal(generate(None, chunks=False), plain), "step-at-a-time decode is not repeatable"
    got = generate(None, chunks=True)
    assert multi.replays > 0 and {k for _, k in multi.graphs} <= {8, 4, 2, 1}
    assert torch.equal(got, plain), _first_difference(got, plain)
    eos = int(plain[1, ids.shape[1] + 11])
    want = generate(eos, chunks=False)
    got = generate(eos, chunks=True)
    assert torch.equal(got, want), _first_difference(got, want)
    assert runner.pool.num_used_pages == 0
