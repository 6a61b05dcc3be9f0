"""``CompileConfig(deterministic=True)``: bit-identical results.

* Repeated runs of the same schedule of mixed prefill / decode steps give bit-identical logits,
  on the same runner (with the requests on other physical pages) and on a fresh one.
* A request's decode attention gives bit-identical output alone and inside a bigger batch.
  This is checked on the attention outputs rather than on the logits: on the CPU the linear
  layers' GEMMs already round differently for a different token count (~1 ulp), whatever the
  attention backend does. The decode attention of every layer is captured inside a batched
  model step (the real q and the real pool) and replayed for one request alone.

torch_native runs on the CPU; Triton runs in Triton's interpreter (short runs). On a CUDA
machine (``gpu`` tests) Triton and FlashInfer run in bf16 with the decode CUDA graphs on for
the repeated runs, and with request lengths above FlashInfer's deterministic split (2048 tokens)
for the alone-vs-batched check.
"""

from __future__ import annotations

import random

import pytest
import torch

from attngraph import CompileConfig
from attngraph.attn_backends.registry import get_backend_class
from attngraph.attn_backends.torch_native import TorchNativeBackend
from attngraph.forward_batch import ForwardBatch, ForwardMode
from attngraph.runtime.model_runner import ModelRunner

from ..hf_models import build_model, gpu_model

BACKENDS = ["torch_native", "triton"]


pytestmark = pytest.mark.usefixtures("one_thread")



@pytest.fixture
def backend_name(request):
    if request.param == "triton" and "cpu" not in get_backend_class("triton").capabilities.device_types:
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1 before import (tests/conftest.py)")
    return request.param


def make_runner(model, backend: str, deterministic: bool = True, **options) -> ModelRunner:
    options = {"page_size": 4, "kv_cache_tokens": 1024, "max_context_len": 512, **options}
    cfg = CompileConfig(attention_backend=backend, deterministic=deterministic, **options)
    runner = ModelRunner(model, cfg)
    runner.warmup()
    return runner


def check_plumbed(runner: ModelRunner, deterministic: bool) -> None:
    """The config's flag reached the backend (backends without the option ignore it)."""
    if runner.config.attention_backend in ("triton", "flashinfer"):
        assert getattr(runner.backend, "deterministic", None) is deterministic, (
            f"CompileConfig(deterministic={deterministic}) did not reach {type(runner.backend).__name__}"
        )


def random_schedule(rng: random.Random, vocab: int, num_requests: int, num_steps: int, max_prompt: int):
    """Prompts and steps: each step a list of (request, new tokens), prefill chunks and decodes mixed."""
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))] for _ in range(num_requests)]
    tokens = [list(p) for p in prompts]
    done = [0] * num_requests
    steps = []
    for _ in range(num_steps):
        chosen = rng.sample(range(num_requests), rng.randint(1, num_requests))
        step = []
        for r in chosen:
            if done[r] < len(prompts[r]):
                n = rng.randint(1, len(prompts[r]) - done[r])
            else:
                tokens[r].append(rng.randrange(vocab))
                n = 1
            step.append((r, n))
            done[r] += n
        steps.append(step)
    return tokens, steps


def run_schedule(runner: ModelRunner, tokens, steps, shift_pages: int = 0) -> list[torch.Tensor]:
    """Runs ``steps``; ``shift_pages`` pages are held by a dummy request meanwhile so that the
    requests land on other physical pages. Leaves the pool empty."""
    pool = runner.pool
    dummy = pool.alloc_request()
    pool.reserve([dummy], [shift_pages * pool.page_size])
    rows = [pool.alloc_request() for _ in tokens]
    done = [0] * len(tokens)
    out = []
    for step in steps:
        rs = [rows[r] for r, _ in step]
        pool.reserve(rs, [done[r] + n for r, n in step])
        ids = torch.tensor([t for r, n in step for t in tokens[r][done[r] : done[r] + n]], dtype=torch.long)
        batch = ForwardBatch.build(pool, rs, [done[r] for r, _ in step], [n for _, n in step], ids)
        out.append(runner.forward(batch).clone())
        for r, n in step:
            done[r] += n
    for row in rows + [dummy]:
        pool.free_request(row)
    assert pool.num_used_pages == 0 and pool.num_active_requests == 0
    return out


def assert_bit_identical(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what}: step {i} differs by {(x - y).abs().max().item():.3g}"


@pytest.mark.parametrize("backend_name", BACKENDS, indirect=True)
def test_repeated_runs_are_bit_identical(backend_name):
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    model = build_model("mistral", "sdpa", seed=seed % 1000)  # sliding window 8
    short = backend_name == "triton"  # interpreter: a few steps only
    tokens, steps = random_schedule(rng, model.config.vocab_size, 3 if short else 5, 5 if short else 30, 16 if short else 40)
    runner = make_runner(model, backend_name)
    check_plumbed(runner, True)
    first = run_schedule(runner, tokens, steps)
    again = run_schedule(runner, tokens, steps, shift_pages=3)
    assert_bit_identical(first, again, f"seed={seed}, same runner, other pages")
    fresh = make_runner(model, backend_name)
    assert_bit_identical(first, run_schedule(fresh, tokens, steps, shift_pages=1), f"seed={seed}, fresh runner")
    # Deterministic, and right: the last step's logits match HF's forward.
    with torch.no_grad():
        r, _ = steps[-1][-1]
        want = model(input_ids=torch.tensor([tokens[r][: sum(n for s in steps for q, n in s if q == r)]])).logits[0, -1]
    torch.testing.assert_close(first[-1][-1], want, atol=1e-4, rtol=1e-4)


def capture_decode(runner: ModelRunner):
    """Wraps the runner's backend so every decode attention call is recorded (inputs, batch, output)."""
    calls = []
    backend = runner.backend
    original = backend.forward

    def spy(q, k, v, layer, batch, save_kv_cache=True, **kwargs):
        out = original(q, k, v, layer, batch, save_kv_cache, **kwargs)
        if batch.mode is ForwardMode.DECODE:
            calls.append((q.clone(), layer, batch, out.clone()))
        return out

    backend.forward = spy
    return calls


def alone_vs_batched(backend_name: str, deterministic: bool, seed: int, model=None, lens=(300, 37, 140, 9), **options):
    """Decode attention outputs of request 0 (``lens[0]`` cached keys: several KV splits) inside a
    4-request decode step, and the same attention replayed for request 0 alone."""
    g = torch.Generator().manual_seed(seed)
    if model is None:
        model = build_model("llama", "sdpa", seed=seed % 1000)
    # The replay below attends with the recorded q and without storing K/V: q must arrive
    # rotated (a rotation folded into the op runs only with the store of the new K/V).
    options.setdefault("fold_rope", False)
    runner = make_runner(model, backend_name, deterministic=deterministic, **options)
    check_plumbed(runner, deterministic)
    pool = runner.pool
    lens = list(lens)
    toks = [torch.randint(0, model.config.vocab_size, (n + 1,), generator=g) for n in lens]
    rows = [pool.alloc_request() for _ in lens]
    pool.reserve(rows, [n + 1 for n in lens])
    # The prefill only fills the pool: the reference backend does it fast (the layout is shared).
    backend, runner.backend = runner.backend, TorchNativeBackend()
    try:
        runner.forward(ForwardBatch.build(pool, rows, [0] * 4, lens, torch.cat([t[:-1] for t in toks])))
    finally:
        runner.backend = backend
    calls = capture_decode(runner)
    runner.forward(ForwardBatch.build(pool, rows, lens, [1] * 4, torch.stack([t[-1] for t in toks])))
    del runner.backend.forward
    assert len(calls) == model.config.num_hidden_layers
    results = []
    for q, layer, batch, together in calls:
        alone = ForwardBatch.build(pool, rows[:1], lens[:1], [1], toks[0][-1:])
        runner.backend.init_forward_metadata(alone)
        # The K/V of this step are already in the pool: replay without writing them again.
        out = runner.backend.forward(q[:1], q.new_empty(0), q.new_empty(0), layer, alone, save_kv_cache=False)
        results.append((together[0], out[0]))
    for row in rows:
        pool.free_request(row)
    return runner, results


@pytest.mark.parametrize("backend_name", BACKENDS, indirect=True)
def test_decode_alone_and_in_a_batch_are_bit_identical(backend_name):
    seed = random.SystemRandom().randrange(2**31)
    runner, results = alone_vs_batched(backend_name, True, seed)
    if backend_name == "triton":
        # The scenario would tell a batch-size dependent split count apart.
        be, dev = runner.backend, torch.device(runner.device)
        assert be.decode_max_splits(1, 2, dev) == be.decode_max_splits(4, 2, dev)
        assert -(-301 // be.min_split_len) > 1  # request 0 really uses several splits
    for layer_id, (together, alone) in enumerate(results):
        assert torch.equal(together, alone), (
            f"seed={seed} layer {layer_id}: alone vs batched differ by {(together - alone).abs().max().item():.3g}"
        )


# ------------------------------------------------------------------------------------ GPU
GPU_BACKENDS = ["triton", "flashinfer"]


def _gpu_backend(name: str) -> str:
    if name == "flashinfer":
        pytest.importorskip("flashinfer")
    return name


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_repeated_runs_are_bit_identical(backend):
    """Mixed prefill / decode schedule in bf16, decode steps through the CUDA graphs."""
    _gpu_backend(backend)
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    model, reference = gpu_model("mistral", torch.bfloat16, seed=seed % 1000)  # sliding window 8
    tokens, steps = random_schedule(rng, model.config.vocab_size, 6, 40, 60)
    opts = dict(cuda_graph="full", cuda_graph_capture_sizes=(1, 2, 4, 8))
    runner = make_runner(model, backend, **opts)
    check_plumbed(runner, True)
    assert runner.graphs is not None
    first = run_schedule(runner, tokens, steps)
    again = run_schedule(runner, tokens, steps, shift_pages=3)
    assert_bit_identical(first, again, f"{backend} seed={seed}, same runner, other pages")
    fresh = make_runner(model, backend, **opts)
    assert_bit_identical(first, run_schedule(fresh, tokens, steps, shift_pages=1), f"{backend} seed={seed}, fresh runner")
    r, _ = steps[-1][-1]
    with torch.no_grad():
        seq = tokens[r][: sum(n for s in steps for q, n in s if q == r)]
        want = reference(input_ids=torch.tensor([seq], device="cuda")).logits[0, -1]
    err = (first[-1][-1].float() - want).abs().max().item()
    assert err <= 0.05 * want.abs().max().item(), f"{backend} seed={seed}: last logits off by {err:.4g}"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_decode_alone_and_in_a_batch_are_bit_identical(backend):
    """Request 0 holds 5000 keys: several splits for both backends' deterministic split sizes."""
    _gpu_backend(backend)
    seed = random.SystemRandom().randrange(2**31)
    model, _ = gpu_model("llama", torch.bfloat16, seed=seed % 1000)
    model.config.max_position_embeddings = 8192
    runner, results = alone_vs_batched(
        backend, True, seed, model=model, lens=(5000, 37, 2100, 9), cuda_graph="none", max_context_len=8192,
        kv_cache_tokens=16384,
    )
    for layer_id, (together, alone) in enumerate(results):
        assert torch.equal(together, alone), (
            f"{backend} seed={seed} layer {layer_id}: alone vs batched differ by {(together - alone).abs().max().item():.3g}"
        )
