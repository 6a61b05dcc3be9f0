"""Randomized generate calls: each one identical to HF or refused with a clear `AttnGraphError`.

A seeded generator draws the options of a call (greedy or seeded sampling, temperature,
top-k / top-p, repetition penalty, lengths, EOS, min_new_tokens, return_dict_in_generate with
scores and logits, use_cache, streamer, chunked prefill, position_ids, token_type_ids,
per-layer outputs), the padding layout (none, left, right, holes, an all-padding row), the batch
shape, and the model (no window, a window of 4 on every layer, a window on one layer of two).
The reference is plain HF `generate` on a deep copy taken before `accelerate`; the same seed
is set before both calls, and the generator must be left in the same state. A silent
difference fails the test with the draw's description (rerun one draw with
``ATTNGRAPH_PROPERTY_FIRST=<index> ATTNGRAPH_PROPERTY_DRAWS=1``).
"""

import copy
import os
import random
import time

import pytest
import torch
import transformers
from transformers.generation.streamers import BaseStreamer

import attngraph
from attngraph import AttnGraphError
from attngraph.runtime.accelerate import state_of

from ..hf_models import tiny_config

pytestmark = pytest.mark.keep_dynamo_cache

DRAWS = int(os.environ.get("ATTNGRAPH_PROPERTY_DRAWS", "300"))
FIRST = int(os.environ.get("ATTNGRAPH_PROPERTY_FIRST", "0"))
PAD = 0
#: Models by name: (arch, config overrides). Windows are shorter than the longest prompts.
MODELS = {
    "llama": ("llama", {}),
    "mistral_w4": ("mistral", dict(sliding_window=4)),
    "qwen2_w8_layer1": ("qwen2", {}),  # layer 0 full, layer 1 sliding window 8
}


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.clone())

    def end(self):
        self.ended = True


@pytest.fixture(scope="module")
def models():
    out = {}
    for name, (arch, overrides) in MODELS.items():
        cfg = tiny_config(arch)
        for k, v in overrides.items():
            setattr(cfg, k, v)
        torch.manual_seed(len(out))
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
        reference = copy.deepcopy(model)
        out[name] = (attngraph.accelerate(model, attention_backend="torch_native", page_size=4), reference)
    # transformers registers each model class on its first forward, and Dynamo guards on that
    # registry: once every class has run, the graphs are final.
    ids = torch.randint(3, 96, (1, 3))
    for model, reference in out.values():
        for m in (model, reference):
            m.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=PAD)
    return out


def draw_case(rng: random.Random, vocab: int) -> dict:
    """One generate call: ``model``, ``ids``, ``kwargs``, ``seed`` and a readable ``desc``."""
    bsz = rng.randint(1, 3)
    lengths = [rng.randint(1, 10) for _ in range(bsz)]
    layout = rng.choices(["none", "left", "right", "holes", "empty_row"], weights=[2, 6, 1, 2, 0.3])[0]
    if layout == "none":
        lengths = [max(lengths)] * bsz
    width = max(lengths) + (rng.randint(0, 2) if layout != "none" else 0)
    ids = torch.full((bsz, width), PAD, dtype=torch.long)
    mask = torch.zeros((bsz, width), dtype=torch.long)
    for r, n in enumerate(lengths):
        tokens = torch.tensor([rng.randrange(3, vocab) for _ in range(n)])
        cols = slice(0, n) if layout == "right" else slice(width - n, width)
        ids[r, cols], mask[r, cols] = tokens, 1
    if layout == "holes":
        for r, n in enumerate(lengths):
            if n >= 3:
                mask[r, rng.randrange(width - n + 1, width - 1)] = 0
    if layout == "empty_row":
        mask[rng.randrange(bsz)] = 0
    kw: dict = dict(pad_token_id=PAD)
    if layout != "none" or rng.random() < 0.5:
        kw["attention_mask"] = mask
    if rng.random() < 0.85:
        kw["max_new_tokens"] = rng.randint(1, 8)
    else:
        kw["max_length"] = width + rng.randint(1, 8)
    kw["do_sample"] = rng.random() < 0.5
    if kw["do_sample"]:
        if rng.random() < 0.5:
            kw["temperature"] = rng.choice([0.5, 0.8, 1.3])
        if rng.random() < 0.5:
            kw["top_k"] = rng.choice([1, 5, 20])
        if rng.random() < 0.5:
            kw["top_p"] = rng.choice([0.5, 0.9])
    else:
        kw.update(temperature=None, top_k=None, top_p=None)
    if rng.random() < 0.3:
        kw["repetition_penalty"] = rng.choice([0.8, 1.3])
    if rng.random() < 0.15:
        kw["no_repeat_ngram_size"] = 2
    eos = rng.choice([None, None, "one", "many"])
    kw["eos_token_id"] = None if eos is None else (rng.randrange(3, vocab) if eos == "one" else rng.sample(range(3, vocab), vocab // 3))
    if eos is not None and rng.random() < 0.4:
        kw["min_new_tokens"] = rng.randint(1, 4)
    if rng.random() < 0.3:
        kw.update(return_dict_in_generate=True, output_scores=rng.random() < 0.8, output_logits=rng.random() < 0.5)
    if rng.random() < 0.15:
        kw["use_cache"] = False
    if rng.random() < 0.15:
        kw["streamer"] = "collect"
    if rng.random() < 0.15:
        kw["prefill_chunk_size"] = rng.randint(1, 4)
    if rng.random() < 0.15:
        kw["position_ids"] = torch.cumsum(torch.tensor([[rng.randint(1, 4) for _ in range(width)] for _ in range(bsz)]), 1)
    if rng.random() < 0.05:
        kw["token_type_ids"] = torch.ones_like(ids)
    if rng.random() < 0.05:
        kw[rng.choice(["output_hidden_states", "output_attentions"])] = True
        kw["return_dict_in_generate"] = True
    model = rng.choice(sorted(MODELS))
    desc = f"{model} layout={layout} lengths={lengths} width={width} " + " ".join(
        f"{k}={tuple(v.shape) if isinstance(v, torch.Tensor) else v}" for k, v in kw.items() if k != "attention_mask"
    )
    return dict(model=model, ids=ids, kwargs=kw, seed=rng.randrange(2**31), desc=desc)


def run(model, case):
    """``(result, streamed, rng_state)`` or ``(exception, None, None)``."""
    kw = dict(case["kwargs"])
    streamer = Collect() if kw.get("streamer") == "collect" else None
    if streamer is not None:
        kw["streamer"] = streamer
    torch.manual_seed(case["seed"])
    try:
        out = model.generate(case["ids"], **kw)
    except Exception as exc:  # compared below: HF's own refusal, or attngraph's
        return exc, None, None
    streamed = None
    if streamer is not None:  # the prompt, then one [B] chunk per step
        streamed = torch.stack([c.reshape(-1) for c in streamer.chunks[1:]]) if len(streamer.chunks) > 1 else torch.zeros(0)
    return out, streamed, torch.get_rng_state()


def compare(got, want) -> str | None:
    """None when ``got`` is HF's result, else what differs."""
    (g, gs, grng), (w, ws, wrng) = got, want
    if isinstance(g, Exception):
        if isinstance(g, AttnGraphError) or (isinstance(w, Exception) and type(g) is type(w)):
            return None
        return f"raised {type(g).__name__}: {g}"
    if isinstance(w, Exception):
        return f"HF raised {type(w).__name__}: {w}, attngraph returned a result"
    if isinstance(w, torch.Tensor):
        if not torch.equal(g, w):
            return f"sequences differ:\n{g}\n{w}"
    else:
        if not torch.equal(g.sequences, w.sequences):
            return f"sequences differ:\n{g.sequences}\n{w.sequences}"
        for field in ("scores", "logits"):
            a, b = getattr(g, field, None), getattr(w, field, None)
            if (a is None) != (b is None) or (a is not None and len(a) != len(b)):
                return f"{field} differ in presence or length"
            for x, y in zip(a or (), b or ()):
                finite = torch.isfinite(y)
                if not torch.equal(finite, torch.isfinite(x)) or not torch.allclose(x[finite], y[finite], atol=1e-5, rtol=1e-5):
                    return f"{field} differ by {(x[finite] - y[finite]).abs().max()}"
    if (gs is None) != (ws is None) or (gs is not None and not torch.equal(gs, ws)):
        return "streamed tokens differ"
    if not torch.equal(grng, wrng):
        return "the global generator is left in a different state"
    return None


def test_random_generate_calls_match_hf_or_refuse(models):
    rng = random.Random(20261201)
    cases = [draw_case(rng, 96) for _ in range(FIRST + DRAWS)][FIRST:]
    graphs = [state_of(m).runner.num_compilations for m, _ in models.values()]
    start, served, failures = time.perf_counter(), 0, []
    for index, case in enumerate(cases, start=FIRST):
        model, reference = models[case["model"]]
        want = run(reference, case)
        got = run(model, case)
        why = compare(got, want)
        if why is not None:
            failures.append(f"draw {index}: {case['desc']}\n  {why}")
        served += not isinstance(got[0], Exception)
        pool = state_of(model).runner.pool
        assert pool.num_used_pages == 0 and pool.num_active_requests == 0, f"draw {index} left pages in use"
    elapsed = time.perf_counter() - start
    print(f"{len(cases)} draws in {elapsed:.1f}s, {served} served, {len(cases) - served} refused")
    assert not failures, f"{len(failures)} of {len(cases)} draws differ from HF:\n" + "\n".join(failures[:10])
    assert served >= len(cases) // 2, f"only {served} of {len(cases)} draws were served"
    assert graphs == [state_of(m).runner.num_compilations for m, _ in models.values()], "a draw recompiled a model"
