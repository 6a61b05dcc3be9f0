"""The copy task and its trained checkpoints: models whose greedy choice is decisive.

A sequence is a span of distinct random tokens followed by the span again, periodically:
``s0 s1 .. s(L-1) s0 s1 ..``. From the second period on, the next token is a copy of the token
``L - 1`` positions back, which a two-layer decoder finds with an induction head (layer 0
attends to the previous token, layer 1 to the earlier position whose previous token is the
current one). Trained on it, the model's top-1 logit beats the runner-up by many units at every
copying position, so bf16 rounding cannot flip a greedy choice, while a wrong page, a wrong
length or a wrong window moves attention off the one position that holds the answer.

Checkpoints (``tests/data/copy_models/<name>``, made by ``python -m tests.train_copy_models``):

* ``llama_gqa``: Llama, 4 query heads sharing 2 KV heads, spans of 8..64 tokens (across
  several 16-token pages).
* ``mistral_window``: Mistral, 4 query heads sharing 1 KV head, ``sliding_window=40``; spans
  of up to 40 tokens. The window lets a position see itself and the 39 tokens before it, so a
  40-token span is copied from the oldest position inside the window: a window one token too
  small loses the answer. Prompt + generated tokens run far past the window.

Both use head dim 64 (FlashInfer's prebuilt kernels serve it) on a hidden size of 64.
"""

from __future__ import annotations

import dataclasses
import pathlib

import torch
import transformers

DATA = pathlib.Path(__file__).parent / "data" / "copy_models"
PAD, BOS, EOS = 0, 1, 2
FIRST = 3  # spans use tokens FIRST..vocab-1 (never the special ones)
VOCAB = 128
TRAIN_LEN = 256  # sequence length of the training batches; prompt + generated stays within it
NEW_TOKENS = 128


@dataclasses.dataclass(frozen=True)
class CopyModel:
    """One checkpoint: its HF config and the span lengths it was trained on."""

    name: str
    config_class: str
    config: dict
    min_span: int
    max_span: int

    @property
    def path(self) -> pathlib.Path:
        return DATA / self.name

    def make_config(self) -> transformers.PretrainedConfig:
        common = dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, head_dim=64, max_position_embeddings=512,
            pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False,
        )  # fmt: skip
        return getattr(transformers, self.config_class)(**{**common, **self.config})


WINDOW = 40
MODELS = {
    m.name: m
    for m in (
        CopyModel("llama_gqa", "LlamaConfig", dict(num_key_value_heads=2), min_span=8, max_span=64),
        CopyModel("mistral_window", "MistralConfig", dict(num_key_value_heads=1, sliding_window=WINDOW), 8, WINDOW),
    )
}


# ---------------------------------------------------------------------------- sequences
def random_span(gen: torch.Generator, length: int) -> torch.Tensor:
    """``length`` distinct tokens from FIRST..VOCAB-1 (so each token has one successor)."""
    return torch.randperm(VOCAB - FIRST, generator=gen)[:length] + FIRST


def periodic(span: torch.Tensor, length: int) -> torch.Tensor:
    """``span`` repeated and cut to ``length`` tokens."""
    reps = -(-length // span.numel())
    return span.repeat(reps)[:length]


def training_batch(spec: CopyModel, gen: torch.Generator, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [batch, TRAIN_LEN], labels [batch, TRAIN_LEN])``. HF's loss scores the logits at
    position ``p`` against ``labels[p + 1]``; the next token is known from position ``n`` on
    (the current token was seen once before), so labels before ``n + 1`` are -100."""
    ids = torch.empty((batch, TRAIN_LEN), dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for b in range(batch):
        n = int(torch.randint(spec.min_span // 2, spec.max_span + 1, (1,), generator=gen))
        ids[b] = periodic(random_span(gen, n), TRAIN_LEN)
        labels[b, n + 1 :] = ids[b, n + 1 :]
    return ids, labels


@dataclasses.dataclass(frozen=True)
class Prompt:
    tokens: list[int]
    span: int  # period of the sequence

    def continuation(self, n: int) -> list[int]:
        """The ``n`` tokens that copying the span gives after the prompt."""
        start = len(self.tokens)
        return [self.tokens[(start + i) % self.span] for i in range(n)]


def prompts(name: str, count: int, seed: int = 0) -> list[Prompt]:
    """``count`` prompts for model ``name``: a span (its lengths spread over the trained range,
    the longest included) followed by its first 1..24 tokens again. Different lengths per row,
    so a left-padded batch has padding of several sizes."""
    spec = MODELS[name]
    gen = torch.Generator().manual_seed(1000 + seed)
    lo = max(spec.min_span, 8)
    lengths = torch.linspace(spec.max_span, lo, count).round().long().tolist() if count > 1 else [spec.max_span]
    out = []
    for i, n in enumerate(lengths):
        span = random_span(gen, n)
        repeat = 1 + (7 * i + seed) % 24
        out.append(Prompt(periodic(span, n + repeat).tolist(), n))
    return out


def left_padded(batch: list[Prompt], device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, W], attention_mask [B, W])``, padded on the left with PAD."""
    width = max(len(p.tokens) for p in batch)
    ids = torch.full((len(batch), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, width - len(p.tokens) :] = torch.tensor(p.tokens)
        mask[i, width - len(p.tokens) :] = 1
    return ids.to(device), mask.to(device)


def expected(batch: list[Prompt], new_tokens: int, device="cpu") -> torch.Tensor:
    """``[B, W + new_tokens]``: the padded prompts followed by the copied continuation."""
    ids, _ = left_padded(batch, device)
    cont = torch.tensor([p.continuation(new_tokens) for p in batch], device=ids.device)
    return torch.cat([ids, cont], 1)


# ---------------------------------------------------------------------------- models
def load(name: str, dtype: torch.dtype = torch.float32, device="cpu", attn_implementation: str = "sdpa"):
    """The checkpoint through ``from_pretrained`` from its local folder, in eval mode."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        MODELS[name].path, dtype=dtype, attn_implementation=attn_implementation
    )
    return model.to(device).eval()


GREEDY = dict(do_sample=False, pad_token_id=PAD, eos_token_id=None)


def margins(model, batch: list[Prompt], new_tokens: int = NEW_TOKENS) -> torch.Tensor:
    """``[B, new_tokens]``: top-1 minus top-2 logit of HF's greedy ``generate`` at each step."""
    ids, mask = left_padded(batch, next(model.parameters()).device)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, return_dict_in_generate=True, output_logits=True, **GREEDY
        )
    top2 = torch.stack(out.logits, 1).float().topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]
