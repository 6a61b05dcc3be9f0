"""Exact GPU checks on the trained copy models (``tests/copy_task.py``): token for token.

The checkpoints' greedy choices are decisive (top-1 minus top-2 logit of several units at
every generated position, measured by ``tests/train_copy_models.py``), so bf16 rounding cannot
flip them, and the accelerated ``generate`` must give exactly HF eager's tokens in the same
dtype: 128 new tokens for a single prompt, a left-padded batch of 3 different lengths and a
batch of 16 (the largest captured size; 3 replays the graph of 4, padded). HF's tokens must in
turn be the copied span, so the reference itself is known to be right. A wrong page, a wrong
length in one request, a window one token off or a stale field in one captured graph moves
attention off the one position that holds the answer, and the tokens differ.

Every backend x graph mode (``cuda_graph="none"``, ``"full"`` where the backend captures
decode attention, and the piecewise modes ``"piecewise"``, ``"full_and_piecewise"``,
``"breakable"`` that replay the prefill) x dtype it supports (FlashInfer has no fp32 kernels), on 1- and 16-token
pages, for the GQA model and the sliding-window model (window 40, prompts + 128 tokens run far
past it). attngraph's own decoding loop (plain ``generate``) runs every batch, HF's loop
(``output_logits=True``) the batch of 3; each accelerated model is built once and serves all
batch sizes.

    python -m pytest -q -m gpu tests/runtime/test_exact_copy_gpu.py
"""

from __future__ import annotations

import pytest
import torch

import attngraph
from attngraph.runtime.accelerate import state_of

from ..copy_task import GREEDY, MODELS, NEW_TOKENS, expected, left_padded, load, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.keep_dynamo_cache]

BF16, FP32 = torch.bfloat16, torch.float32
# (backend, cuda_graph, dtype, page_size): every backend, graph mode and dtype, each graph
# mode on both page sizes.
RUNS = [
    ("torch_native", "none", BF16, 16),
    ("torch_native", "none", FP32, 1),
    ("triton", "none", BF16, 16),
    ("triton", "none", FP32, 1),
    ("triton", "full", BF16, 1),
    ("triton", "full", FP32, 16),
    ("flashinfer", "none", BF16, 16),
    ("flashinfer", "full", BF16, 16),
    ("flashinfer", "full", BF16, 1),
    ("torch_native", "piecewise", BF16, 16),
    ("triton", "full_and_piecewise", BF16, 16),
    ("triton", "breakable", FP32, 1),
    ("flashinfer", "full_and_piecewise", BF16, 16),
    ("flashinfer", "piecewise", BF16, 1),
    ("flashinfer", "breakable", BF16, 16),
]
CAPTURE_SIZES = (1, 2, 4, 8, 16)
BATCHES = [1, 3, 16]


def _id(param) -> str:
    name, backend, graph, dtype, page = param
    return f"{name}-{backend}-graph_{graph}-{str(dtype).removeprefix('torch.')}-page{page}"


@pytest.fixture(scope="module")
def references():
    """HF eager's greedy ``generate`` on the GPU per (model, dtype, batch size), computed once."""
    cache: dict = {}

    def get(name: str, dtype: torch.dtype, count: int):
        key = (name, dtype, count)
        if key not in cache:
            model = load(name, dtype, "cuda", attn_implementation="eager")
            batch = prompts(name, count, seed=count)
            ids, mask = left_padded(batch, "cuda")
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, **GREEDY)
            wrong = (out != expected(batch, NEW_TOKENS, "cuda")).sum().item()
            assert wrong == 0, f"HF eager {name} in {dtype} does not copy ({wrong} tokens): the checkpoint is not decisive"
            cache[key] = (ids, mask, out)
            del model
        return cache[key]

    return get


@pytest.fixture(scope="module", params=[(n, *r) for n in MODELS for r in RUNS], ids=_id)
def accelerated(request):
    name, backend, graph, dtype, page = request.param
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    model = load(name, dtype, "cuda")
    attngraph.accelerate(
        model, attention_backend=backend, cuda_graph=graph, page_size=page, kv_cache_tokens=16 * 512,
        max_requests=32, max_context_len=512, cuda_graph_capture_sizes=CAPTURE_SIZES,
    )  # fmt: skip
    runner = state_of(model).runner
    if graph in ("full", "full_and_piecewise"):
        assert runner.graphs is not None and len(runner.graphs.graphs) == len(CAPTURE_SIZES)
    else:
        assert runner.graphs is None
    whole = backend == "triton" and graph in ("full", "full_and_piecewise")  # prefill graphs, attention inside
    assert (runner.extend_graphs is not None) == whole
    assert (runner.piecewise is not None) == (graph in ("piecewise", "full_and_piecewise", "breakable") and not whole)
    yield request.param, model
    attngraph.restore(model)


def _first_difference(got: torch.Tensor, want: torch.Tensor, width: int) -> str:
    diff = (got != want).nonzero().tolist()
    row, pos = diff[0]
    return f"{len(diff)} tokens differ; first at row {row}, generated step {pos - width}"


@pytest.mark.parametrize("count", BATCHES)
def test_generate_is_token_identical_to_hf(accelerated, references, count):
    (name, backend, graph, dtype, page), model = accelerated
    ids, mask, want = references(name, dtype, count)
    width = ids.shape[1]
    got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, **GREEDY)
    assert torch.equal(got, want), f"own loop: {_first_difference(got, want, width)}"
    if count == 3:  # HF's decoding loop (taken when logits are asked for) through the same runner
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, return_dict_in_generate=True, output_logits=True, **GREEDY
        )
        assert torch.equal(out.sequences, want), f"HF's loop: {_first_difference(out.sequences, want, width)}"
    runner = state_of(model).runner
    assert runner.pool.num_used_pages == 0 and runner.pool.num_active_requests == 0
