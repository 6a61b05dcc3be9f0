"""`attngraph.accelerate(model).generate(...)` against HF eager generate on a deep copy."""

import copy

import pytest
import torch

import attngraph
from attngraph.runtime.accelerate import state_of

from ..hf_models import arch_impl_params, build_model

PAD = 0


def left_padded_batch(vocab: int, lengths=(24, 13, 20), seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, width - n :] = 1
    return ids, mask


def accelerated_pair(arch, impl, **options):
    model = build_model(arch, impl)
    reference = copy.deepcopy(model)
    options = {"attention_backend": "torch_native", "page_size": 4, **options}
    return attngraph.accelerate(model, **options), reference


GREEDY = dict(max_new_tokens=16, do_sample=False, pad_token_id=PAD, eos_token_id=None)


def greedy_equals_hf(arch, impl, **options):
    """Accelerate a tiny ``arch`` model with ``options`` (`accelerated_pair`), assert its greedy
    tokens of `left_padded_batch` equal HF eager's on the copy, and return ``(model, the paged
    runtime's compile backend)`` for the caller's checks of the rewrites."""
    model, reference = accelerated_pair(arch, impl, **options)
    ids, mask = left_padded_batch(model.config.vocab_size)
    got = model.generate(ids, attention_mask=mask, **GREEDY)
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(got, want)
    return model, state_of(model).runner.ragged.backend


@pytest.mark.parametrize("arch,impl", arch_impl_params())
def test_greedy_and_sampling_match_hf(arch, impl):
    model, reference = accelerated_pair(arch, impl)
    ids, mask = left_padded_batch(model.config.vocab_size)
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, **GREEDY)
    got = model.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(got, want)
    sampling = dict(max_new_tokens=16, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, pad_token_id=PAD)
    torch.manual_seed(123)
    got = model.generate(ids, attention_mask=mask, **sampling)
    torch.manual_seed(123)
    want = reference.generate(ids, attention_mask=mask, **sampling)
    assert torch.equal(got, want)
    runner = state_of(model).runner
    assert runner.num_compilations == 1
    assert runner.pool.num_used_pages == 0 and runner.pool.num_active_requests == 0


def test_one_compilation_over_changing_batches():
    model, reference = accelerated_pair("llama", "sdpa")
    runner = state_of(model).runner
    for seed, lengths in enumerate([(5,), (9, 3), (17, 2, 11, 6), (1,), (30, 30)]):
        ids, mask = left_padded_batch(model.config.vocab_size, lengths, seed)
        got = model.generate(ids, attention_mask=mask, **{**GREEDY, "max_new_tokens": 5})
        want = reference.generate(ids, attention_mask=mask, **{**GREEDY, "max_new_tokens": 5})
        assert torch.equal(got, want)
    assert runner.num_compilations == 1


def test_hf_generate_features_are_intact():
    model, reference = accelerated_pair("qwen2", "sdpa")
    ids, mask = left_padded_batch(model.config.vocab_size, (12, 7))
    common = dict(
        max_new_tokens=10,
        do_sample=False,
        pad_token_id=PAD,
        repetition_penalty=1.3,
        no_repeat_ngram_size=2,
        return_dict_in_generate=True,
        output_scores=True,
    )
    got = model.generate(ids, attention_mask=mask, **common)
    want = reference.generate(ids, attention_mask=mask, **common)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # eos stops a sequence early: pick the token HF generates at step 3 of row 0 as eos.
    eos = int(want.sequences[0, ids.shape[1] + 3])
    got = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=PAD, eos_token_id=eos)
    want = reference.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=PAD, eos_token_id=eos)
    assert torch.equal(got, want)


def test_streamer_receives_the_tokens():
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks = []
            self.ended = False

        def put(self, value):
            self.chunks.append(value.clone())

        def end(self):
            self.ended = True

    model, _ = accelerated_pair("llama", "eager")
    ids, _ = left_padded_batch(model.config.vocab_size, (9,))
    streamer = Collect()
    out = model.generate(ids, streamer=streamer, **GREEDY)
    assert streamer.ended
    streamed = torch.cat([c.reshape(-1) for c in streamer.chunks[1:]])
    assert torch.equal(streamed, out[0, ids.shape[1] :])


def test_restore_gives_back_the_original_model():
    model, reference = accelerated_pair("llama", "sdpa")
    ids, mask = left_padded_batch(model.config.vocab_size, (6, 4))
    attngraph.restore(model)
    assert "generate" not in model.__dict__ and "forward" not in model.__dict__
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits)
    assert torch.equal(model.generate(ids, attention_mask=mask, **GREEDY), reference.generate(ids, attention_mask=mask, **GREEDY))
    attngraph.accelerate(model, attention_backend="torch_native")  # can be accelerated again


def test_direct_forward_without_paged_cache_is_the_original():
    model, reference = accelerated_pair("mistral", "eager")
    ids, _ = left_padded_batch(model.config.vocab_size, (10,))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)


def test_a_forward_traced_for_short_steps_runs_longer_steps_in_groups():
    """MPT slices its ALiBi table of max_seq_len (48) columns by the length: its traced forward
    holds at most 47 tokens per step. A prefill of 57 tokens runs as groups of requests, 50
    sequences decode through HF's loop in groups; a single 48-token sequence is refused before
    anything is written."""
    model, reference = accelerated_pair("mpt", "eager")
    runner = state_of(model).runner
    assert runner.max_step_tokens == 47
    for lengths in ((24, 13, 20), (4,) * 50):
        ids, mask = left_padded_batch(model.config.vocab_size, lengths, seed=len(lengths))
        got = model.generate(ids, attention_mask=mask, **{**GREEDY, "max_new_tokens": 6})
        with torch.no_grad():
            want = reference.generate(ids, attention_mask=mask, **{**GREEDY, "max_new_tokens": 6})
        assert torch.equal(got, want)
    assert runner.num_compilations == 1
    ids = torch.randint(3, model.config.vocab_size, (1, 48))
    with pytest.raises(attngraph.InputError, match="at most 47 tokens per step"):
        model.generate(ids, **{**GREEDY, "max_new_tokens": 1})
    assert runner.pool.num_used_pages == 0 and runner.pool.num_active_requests == 0


def _one_impl_per_arch() -> list[tuple[str, str]]:
    seen: dict[str, tuple[str, str]] = {}
    for arch, impl in arch_impl_params():
        seen.setdefault(arch, (arch, impl))
    return list(seen.values())


@pytest.mark.parametrize("arch,impl", _one_impl_per_arch())
def test_rotary_fold_keeps_the_tokens(arch, impl):
    """``fold_rope=True`` on every architecture: where HF's rotate-half RoPE feeds a site it
    moves into the attention op (Llama, Mistral, Qwen, Gemma, Falcon, Granite, ...), elsewhere
    the pass leaves the graph alone (partial or interleaved rotary, NoPE layers, ALiBi, MLA);
    greedy tokens are HF's either way."""
    model, reference = accelerated_pair(arch, impl, fold_rope=True)
    ids, mask = left_padded_batch(model.config.vocab_size)
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, **GREEDY)
    got = model.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(got, want)
    results = state_of(model).runner.ragged.backend.rewrites["fold_rope"]
    assert results and not any(r.refused for r in results), [r.refused for r in results]
    if arch in ("llama", "qwen2", "mistral", "gemma"):
        assert all(len(r.folded) == model.config.num_hidden_layers for r in results)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "gemma"])
def test_norm_epilogue_fold_keeps_the_tokens(arch, monkeypatch):
    """``fold_norm_epilogue=True`` with the GEMV's weight limits lowered to these models' sizes
    (8192 elements: the 64 x 64 output projection is the GEMV's, the fused gate/up is not, as
    at Llama-3.2-1B's real sizes): each layer's residual add and MLP norm move into the output
    projection's op (Phi-3's through the eval-mode dropout between). Gemma's norm (``1 +
    weight``) is not folded by `fold_rms_norm` in the first place. Greedy tokens are HF's."""
    from attngraph import linear_ops

    monkeypatch.setattr(linear_ops, "KERNEL_MAX_WEIGHT", 8192)
    monkeypatch.setattr(linear_ops, "KERNEL_MAX_WEIGHT_ONE_ROW", 8192)
    impl = next(i for a, i in arch_impl_params() if a == arch)
    model, reference = accelerated_pair(arch, impl, skinny_linears=True, fold_norm_epilogue=True)
    ids, mask = left_padded_batch(model.config.vocab_size)
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, **GREEDY)
    got = model.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(got, want)
    results = state_of(model).runner.ragged.backend.rewrites["fold_norm_epilogue"]
    assert results
    folded = sum(len(r.folded) for r in results)
    if arch == "gemma":
        assert folded == 0
    else:
        assert folded == model.config.num_hidden_layers * len(results), [r.refused for r in results]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma", "phi3", "qwen3"])
def test_rotary_fold_into_the_projection_keeps_the_tokens(arch):
    """``fold_rope_linear=True`` (with the projections on attngraph's ops): where q and k are
    the first columns of the fused q/k/v projection the rotation moves on into it (Qwen2's
    projection has a bias, Gemma's norm stays outside it); elsewhere the attention op keeps it
    with the reason reported (Qwen3: a norm of q and k between; Phi-3's rotation is not folded
    into the op in the first place). Greedy tokens are HF's either way."""
    impl = next(i for a, i in arch_impl_params() if a == arch)
    model, reference = accelerated_pair(arch, impl, skinny_linears=True, fold_rope=True, fold_rope_linear=True)
    ids, mask = left_padded_batch(model.config.vocab_size)
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, **GREEDY)
    got = model.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(got, want)
    backend = state_of(model).runner.ragged.backend
    into_linear = backend.rewrites["fold_rope_linear"]
    folded = sum(len(r.folded) for r in backend.rewrites["fold_rope"])
    moved = sum(len(r.folded) for r in into_linear)
    assert into_linear and moved + sum(len(r.refused) for r in into_linear) == folded
    if arch in ("llama", "qwen2", "mistral", "gemma"):
        assert moved == folded > 0, [r.refused for r in into_linear]
    if arch == "qwen3":
        assert moved == 0 < folded
