"""Faults: errors raised inside a step, bad inputs, and accelerate/restore misuse.

Each case checks the error's type and message and the state left behind: no ForwardContext
published, no page of the KV pool in use once ``generate`` returns or raises, and a next call
that still works and matches HF.
"""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch
import torch._dynamo.exc
from transformers import StoppingCriteria, StoppingCriteriaList

import attngraph
from attngraph import AttnGraphError, CompileConfig
from attngraph.runtime.accelerate import state_of
from attngraph.forward_batch import ForwardBatch
from attngraph.forward_context import get_forward_context
from attngraph.runtime.kv_pool import KVPool
from attngraph.runtime.model_runner import ModelRunner
from attngraph.runtime.paged_cache import PagedCache

from ..hf_models import build_model
from .test_generate import GREEDY, left_padded_batch

GEN = {**GREEDY, "max_new_tokens": 6}


class InjectedFault(RuntimeError):
    pass


@pytest.fixture
def pair():
    """An accelerated tiny Llama and an untouched copy of it (the HF reference)."""
    model = build_model("llama", "sdpa", seed=int(torch.randint(0, 1000, (1,))))
    reference = copy.deepcopy(model)
    attngraph.accelerate(model, attention_backend="torch_native", page_size=4, kv_cache_tokens=256)
    return model, reference


def batch_inputs(model, lengths=(7, 3)):
    return left_padded_batch(model.config.vocab_size, lengths, seed=int(torch.randint(0, 10_000, (1,))))


def assert_clean(model):
    runner = state_of(model).runner
    assert get_forward_context() is None
    assert runner.pool.num_used_pages == 0, f"{runner.pool.num_used_pages} pages still in use"
    assert runner.pool.num_active_requests == 0
    assert not runner.pool.req_to_page_cpu.any() and not runner.pool.req_to_page.any()


def assert_matches_hf(model, reference, lengths=(7, 3)):
    ids, mask = batch_inputs(model, lengths)
    got = model.generate(ids, attention_mask=mask, **GEN)
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, **GEN)
    assert torch.equal(got, want)
    assert_clean(model)


def fail_on_call(monkeypatch, obj, name: str, n: int, exc: BaseException):
    """Make ``obj.name`` raise ``exc`` on its ``n``-th call (1-based); returns the call counter."""
    original = getattr(obj, name)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise exc
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)
    return calls


# --------------------------------------------------------------------------- faults inside a step
# The tiny Llama has 2 layers: calls 1-2 of backend.forward are the prefill, 3-4 the first
# decode step, ... ; odd calls are layer 0 (nothing of the step written for layer 1 yet).
@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_exception_inside_the_compiled_forward(pair, monkeypatch, n):
    model, reference = pair
    runner = state_of(model).runner
    calls = fail_on_call(monkeypatch, runner.backend, "forward", n, InjectedFault(f"injected fault at call {n}"))
    ids, mask = batch_inputs(model)
    with pytest.raises(InjectedFault, match=f"injected fault at call {n}$"):
        model.generate(ids, attention_mask=mask, **GEN)
    assert calls[0] == n
    assert_clean(model)
    monkeypatch.undo()
    assert_matches_hf(model, reference)
    assert runner.num_compilations == 1


def test_keyboard_interrupt_in_a_decode_step(pair, monkeypatch):
    model, reference = pair
    runner = state_of(model).runner
    fail_on_call(monkeypatch, runner.backend, "forward", 6, KeyboardInterrupt())
    ids, mask = batch_inputs(model)
    with pytest.raises(KeyboardInterrupt):
        model.generate(ids, attention_mask=mask, **GEN)
    assert_clean(model)
    monkeypatch.undo()
    assert_matches_hf(model, reference)


def test_exception_in_init_forward_metadata(pair, monkeypatch):
    model, reference = pair
    runner = state_of(model).runner
    fail_on_call(monkeypatch, runner.backend, "init_forward_metadata", 3, InjectedFault("metadata failed"))
    ids, mask = batch_inputs(model)
    with pytest.raises(InjectedFault, match="metadata failed"):
        model.generate(ids, attention_mask=mask, **GEN)
    assert_clean(model)
    monkeypatch.undo()
    assert_matches_hf(model, reference)


def test_exception_in_user_code_of_the_generate_loop(pair):
    """A stopping criterion (user code run by HF's loop between steps) raises mid-generation."""
    model, reference = pair

    class Exploding(StoppingCriteria):
        calls = 0

        def __call__(self, input_ids, scores, **kwargs):
            Exploding.calls += 1
            if Exploding.calls == 3:
                raise ValueError("stopping criterion exploded")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ids, mask = batch_inputs(model)
    with pytest.raises(ValueError, match="stopping criterion exploded"):
        model.generate(ids, attention_mask=mask, stopping_criteria=StoppingCriteriaList([Exploding()]), **GEN)
    assert_clean(model)
    assert_matches_hf(model, reference)


def test_runner_fault_mid_step_then_retry(monkeypatch):
    """Driving ModelRunner directly: a fault in layer 1 of a step (layer 0's K/V already
    written) leaves the caller's pages as they were; retrying the same step gives HF's logits."""
    model = build_model("llama", "sdpa", seed=5)
    runner = ModelRunner(model, CompileConfig(attention_backend="torch_native", page_size=4, kv_cache_tokens=128))
    runner.warmup()
    pool = runner.pool
    g = torch.Generator().manual_seed(int(torch.randint(0, 10_000, (1,))))
    tokens = torch.randint(0, model.config.vocab_size, (12,), generator=g)
    row = pool.alloc_request()
    pool.reserve([row], [9])
    runner.forward(ForwardBatch.build(pool, [row], [0], [9], tokens[:9]))
    pool.reserve([row], [12])
    used, table = pool.num_used_pages, pool.req_to_page_cpu.clone()
    batch = ForwardBatch.build(pool, [row], [9], [3], tokens[9:12])
    fail_on_call(monkeypatch, runner.backend, "forward", 2, InjectedFault("layer 1 failed"))
    with pytest.raises(InjectedFault, match="layer 1 failed"):
        runner.forward(batch)
    assert get_forward_context() is None
    assert pool.num_used_pages == used and torch.equal(pool.req_to_page_cpu, table)
    monkeypatch.undo()
    got = runner.forward(ForwardBatch.build(pool, [row], [9], [3], tokens[9:12]))
    with torch.no_grad():
        want = model(input_ids=tokens[None]).logits[0, -1]
    torch.testing.assert_close(got[0], want, atol=1e-4, rtol=1e-4)
    pool.free_request(row)
    assert pool.num_used_pages == 0 and pool.num_active_requests == 0


# --------------------------------------------------------------------------- dtypes and devices
@pytest.mark.parametrize("src_dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_kv_pool_write_converts_dtype(src_dtype):
    pool = KVPool(num_layers=1, num_kv_heads=2, head_dim=8, num_pages=4, page_size=4, dtype=torch.float32, device="cpu", max_requests=2, max_context_len=16)
    row = pool.alloc_request()
    pool.reserve([row], [5])
    slots = pool.slots_for(torch.tensor([row]), torch.tensor([0]), torch.tensor([5]))
    k = torch.randn(5, 2, 8, dtype=src_dtype)
    v = torch.randn(5, 2, 8, dtype=src_dtype)
    pool.write(0, slots, k, v)
    assert pool.k_buffers[0].dtype == torch.float32
    assert torch.equal(pool.k_buffers[0].view(-1, 2, 8)[slots], k.to(torch.float32))
    assert torch.equal(pool.v_buffers[0].view(-1, 2, 8)[slots], v.to(torch.float32))


def test_model_on_meta_device_is_refused_and_left_untouched():
    model = build_model("llama", "sdpa").to("meta")
    with pytest.raises(AttnGraphError, match="meta"):
        attngraph.accelerate(model, attention_backend="torch_native")
    assert "generate" not in vars(model) and "forward" not in vars(model)
    assert getattr(model, "_attngraph_state", None) is None
    assert get_forward_context() is None


def test_model_on_meta_device_error_names_the_device():
    model = build_model("llama", "sdpa").to("meta")
    with pytest.raises(AttnGraphError) as err:
        attngraph.accelerate(model, attention_backend="torch_native")
    msg = str(err.value)
    assert "meta device" in msg and "must be lowered" not in msg and "stateless" not in msg


def test_float_input_ids_leave_the_pool_consistent(pair):
    model, reference = pair
    ids, mask = batch_inputs(model)
    with pytest.raises(Exception):
        model.generate(ids.float(), attention_mask=mask, **GEN)
    assert_clean(model)
    assert_matches_hf(model, reference)


def test_float_input_ids_clear_error(pair):
    model, _ = pair
    ids, mask = batch_inputs(model)
    runner = state_of(model).runner
    with pytest.raises((TypeError, ValueError), match="dtype") as err:
        model.generate(ids.float(), attention_mask=mask, **GEN)
    assert "input_ids" in str(err.value) and "torch.float32" in str(err.value)
    # The step itself: nothing reserved when it raises.
    cache = PagedCache(runner)
    with pytest.raises((TypeError, ValueError), match="dtype"):
        model(input_ids=ids.float(), attention_mask=mask, cache=cache)
    assert runner.pool.num_used_pages == 0 and cache.rows == []
    cache.free()


def test_input_ids_on_meta_leave_the_pool_consistent(pair):
    model, reference = pair
    ids, mask = batch_inputs(model)
    with pytest.raises(Exception):
        model.generate(ids.to("meta"), attention_mask=mask, **GEN)
    assert_clean(model)
    runner = state_of(model).runner
    cache = PagedCache(runner)
    with pytest.raises(Exception):
        model(input_ids=ids.to("meta"), attention_mask=mask, cache=cache)
    assert cache.lengths in ([], [0, 0]) and cache.columns == 0  # the step did not advance
    cache.free()  # (what generate does when a step raises)
    assert_clean(model)
    assert_matches_hf(model, reference)


def test_input_ids_on_meta_clear_error(pair):
    model, _ = pair
    ids, mask = batch_inputs(model)
    with pytest.raises(ValueError, match="device") as err:
        model.generate(ids.to("meta"), attention_mask=mask, **GEN)
    assert "meta" in str(err.value) and "cpu" in str(err.value)
    runner = state_of(model).runner
    cache = PagedCache(runner)
    with pytest.raises(ValueError, match="device"):
        model(input_ids=ids.to("meta"), attention_mask=mask, cache=cache)
    assert runner.pool.num_used_pages == 0 and cache.rows == []  # nothing reserved when it raises


def test_int32_input_ids_match_hf(pair):
    model, reference = pair
    ids, mask = batch_inputs(model)
    got = model.generate(ids.to(torch.int32), attention_mask=mask, **GEN)
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, **GEN)
    assert torch.equal(got.long(), want)
    assert_clean(model)


def test_int32_input_ids_do_not_recompile(pair):
    model, _ = pair
    ids, mask = batch_inputs(model)
    model.generate(ids.to(torch.int32), attention_mask=mask, **GEN)
    assert state_of(model).runner.num_compilations == 1


# --------------------------------------------------------------------------- config and lifecycle
@pytest.mark.parametrize(
    "cfg",
    [
        CompileConfig(),
        CompileConfig(
            attention_backend="torch_native",
            decode_attention_backend="triton",
            cuda_graph="none",
            cuda_graph_capture_sizes=(8, 1, 2),
            page_size=1,
            kv_cache_tokens=1000,
            max_requests=3,
            max_context_len=77,
            piece_compiler="eager",
            lower_attention=False,
            deterministic=True,
            debug_dump_dir="/tmp/x",
        ),
    ],
)
def test_compile_config_pickles(cfg):
    back = pickle.loads(pickle.dumps(cfg))
    assert back == cfg and hash(back) == hash(cfg) and back is not cfg
    assert copy.deepcopy(cfg) == cfg
    with pytest.raises(AttributeError):
        back.page_size = 2  # still frozen


def test_accelerate_twice_then_restore_and_again(pair):
    model, reference = pair
    state = state_of(model)
    with pytest.raises(AttnGraphError, match="already accelerated") as err:
        attngraph.accelerate(model, attention_backend="torch_native")
    assert "restore" in str(err.value)
    assert state_of(model) is state  # the failed call changed nothing
    assert_matches_hf(model, reference)

    assert attngraph.restore(model) is model
    assert getattr(model, "_attngraph_state", None) is None
    assert "generate" not in vars(model) and "forward" not in vars(model)
    assert attngraph.restore(model) is model  # idempotent
    ids, mask = batch_inputs(model)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, attention_mask=mask, **GEN), reference.generate(ids, attention_mask=mask, **GEN))

    attngraph.accelerate(model, attention_backend="torch_native", page_size=16)
    assert state_of(model) is not state and state_of(model).runner.pool.page_size == 16
    assert_matches_hf(model, reference, lengths=(2, 9, 5))


def test_restore_releases_the_kv_pool(pair):
    model, _ = pair
    pool = state_of(model).runner.pool
    k0 = weakref.ref(pool.k_buffers[0])
    del pool
    attngraph.restore(model)
    gc.collect()
    assert k0() is None, "the KV pool's buffers are still referenced after restore()"


def test_accelerate_restore_more_times_than_the_recompile_limit():
    """accelerate/restore cycles on one model, more of them than Dynamo's recompile limit
    (lowered to 2 here; 8 by default): each cycle compiles afresh and matches HF."""
    import torch._dynamo.config as dynamo_config

    model = build_model("llama", "sdpa")
    ids, mask = batch_inputs(model, (4,))
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, **GEN)
    with dynamo_config.patch(recompile_limit=2):
        for _ in range(dynamo_config.recompile_limit + 1):
            attngraph.accelerate(model, attention_backend="torch_native", page_size=4, kv_cache_tokens=64)
            assert torch.equal(model.generate(ids, attention_mask=mask, **GEN), want)
            assert state_of(model).runner.num_compilations == 1
            attngraph.restore(model)
