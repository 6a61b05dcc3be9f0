"""Speculative sampling on the paged runtime draws from the target's distribution.

With ``do_sample=True`` and an assistant, transformers accepts each draft token with
probability ``min(1, p/q)`` and resamples rejections from ``max(0, p - q)``; the result is
distributed as the target alone would sample, whatever the draft. Here the target and the
draft are both accelerated, on a vocabulary of 6 tokens; the two generated tokens of many
calls are compared with the target's exact distribution (enumerated with HF's own
model), and the draft is checked to be far from it, so that a verify step whose logits were
wrong at any row (or a loop that took the draft's tokens) would show.
"""

import pytest
import torch
import transformers

import attngraph

VOCAB = 6
CALLS = 500


def tiny(seed: int) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():  # sharper distributions than the random init gives, so the draft differs
        model.lm_head.weight.mul_(6.0)
    return model


def exact_two_tokens(model: torch.nn.Module, prompt: torch.Tensor) -> torch.Tensor:
    """``P[a, b]``: probability that sampling draws ``a`` then ``b`` after ``prompt``."""
    with torch.no_grad():
        first = torch.softmax(model(prompt).logits[0, -1].double(), -1)
        seqs = torch.cat([prompt.repeat(VOCAB, 1), torch.arange(VOCAB)[:, None]], 1)
        second = torch.softmax(model(seqs).logits[:, -1].double(), -1)
    return first[:, None] * second


def empirical(model: torch.nn.Module, prompt: torch.Tensor, **extra) -> torch.Tensor:
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    kw = dict(max_new_tokens=2, do_sample=True, top_k=0, pad_token_id=0, eos_token_id=None, **extra)
    for _ in range(CALLS):
        a, b = model.generate(prompt, **kw)[0, -2:].tolist()
        counts[a, b] += 1
    return counts / CALLS


def tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


@pytest.mark.slow
def test_speculative_sampling_follows_the_target_not_the_draft():
    target, draft = tiny(0), tiny(1)
    want = exact_two_tokens(target, prompt := torch.tensor([[1, 4, 3, 5, 4]]))
    assert tv(want, exact_two_tokens(draft, prompt)) > 0.4  # the draft alone would be caught
    attngraph.accelerate(target, attention_backend="torch_native", page_size=4)
    attngraph.accelerate(draft, attention_backend="torch_native", page_size=4)
    draft.generation_config.num_assistant_tokens = 2
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    torch.manual_seed(11)
    assisted = empirical(target, prompt, assistant_model=draft)
    # 500 draws over 36 outcomes: the expected total-variation distance from the exact law is at
    # most 0.11 (0.11 measured); taking the draft's tokens would give about 0.48.
    assert tv(assisted, want) < 0.2, tv(assisted, want)
