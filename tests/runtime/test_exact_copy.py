"""Exact checks on the trained copy models (``tests/copy_task.py``), fp32 on the CPU.

The random-weight tests compare logits within a tolerance; here the model's greedy choice is
decisive at every step, so the accelerated model must produce HF's tokens exactly, and those
tokens are the copied span (an answer known without running any model). The span sits at one
place in the context only, so a wrong page, length, position or window loses it.

* `accelerate` (torch_native, 1- and 16-token pages): greedy ``generate`` of a single prompt
  and of a left-padded batch of 3 different lengths, token-identical to HF's ``generate``.

Stateless compile on the same models: ``tests/compiler/test_exact_copy.py``.
"""

from __future__ import annotations

import pytest
import torch

import attngraph
from attngraph.runtime.accelerate import state_of

from ..copy_task import GREEDY, MODELS, expected, left_padded, load, prompts

NEW = 64  # generated tokens per prompt on the CPU (the GPU tests generate 128)

pytestmark = [pytest.mark.keep_dynamo_cache, pytest.mark.usefixtures("one_thread")]




@pytest.fixture(scope="module")
def references():
    """HF's own greedy ``generate`` per (model, batch size), computed once."""
    cache: dict = {}

    def get(name: str, count: int):
        if (name, count) not in cache:
            batch = prompts(name, count, seed=count)
            ids, mask = left_padded(batch)
            with torch.no_grad():
                out = load(name).generate(ids, attention_mask=mask, max_new_tokens=NEW, **GREEDY)
            # The checkpoint copies: otherwise its choices are not decisive and the exact
            # comparisons below mean less than they claim.
            assert torch.equal(out, expected(batch, NEW)), f"{name}: HF's greedy output is not the copy; retrain the checkpoint"
            cache[name, count] = (ids, mask, out)
        return cache[name, count]

    return get


@pytest.fixture(scope="module", params=[(n, p) for n in MODELS for p in (1, 16)], ids=lambda x: f"{x[0]}-page{x[1]}")
def accelerated(request):
    name, page_size = request.param
    model = attngraph.accelerate(load(name), attention_backend="torch_native", page_size=page_size, kv_cache_tokens=2048)
    yield name, model
    attngraph.restore(model)


@pytest.mark.parametrize("count", [1, 3])
def test_accelerated_generate_is_token_identical(accelerated, references, count):
    name, model = accelerated
    ids, mask, want = references(name, count)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, **GREEDY)
    diff = (got != want).nonzero().tolist()
    assert not diff, f"{name}: {len(diff)} tokens differ from HF's, first at [row, position] {diff[0]}"
    pool = state_of(model).runner.pool
    assert pool.num_used_pages == 0 and pool.num_active_requests == 0


@pytest.mark.parametrize("count,fold_norm,rope,epilogue", [(1, False, False, False), (3, False, False, False),
                                                            (3, True, False, False), (1, False, True, False),
                                                            (1, False, False, True)],
                         ids=["1", "3", "3-norm-in-dot", "1-rope-in-gemv", "1-norm-epilogue"])  # fmt: skip
def test_bf16_through_the_triton_linear_kernels_is_the_copy(monkeypatch, count, fold_norm, rope, epilogue):
    """In bf16 with the linear ops' Triton kernels run by the interpreter: decode steps of one
    request take the GEMV (RMSNorm and SiLU * up folded in), of three the tensor-core kernel
    (`attngraph.skinny_dot`, after the standalone norm and SiLU-mul kernels, or with the norm
    in its loads: `linear_ops.DOT_FOLD_NORM`); the prefill takes torch. With ``rope``
    (`fold_rope_linear`) the q/k/v GEMV rotates q and k in its epilogue (the tensor-core
    kernel's rotation: `tests/test_rope_linear.py`). With ``epilogue`` (`fold_norm_epilogue`,
    the pass told that the GEMV never takes the [256, 64] gate/up) the output projection's GEMV
    adds the residual and normalizes the MLP's input in its epilogue. The greedy tokens are
    picked by `attngraph.argmax`'s kernels. The tokens must still be the copy."""
    from attngraph import argmax, linear_ops, rms_norm, skinny_dot, skinny_linear

    if not (skinny_linear.interpreting() and skinny_dot.interpreting()) or skinny_linear.interpreter_problem():
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1 before import; tests/conftest.py sets it)")
    monkeypatch.setattr(linear_ops, "CPU_INTERPRETER", True)
    monkeypatch.setattr(linear_ops, "DOT_FOLD_NORM", fold_norm)
    monkeypatch.setattr(argmax, "CPU_INTERPRETER", True)
    picks = []
    applies = argmax._kernel_applies
    monkeypatch.setattr(argmax, "_kernel_applies", lambda x: picks.append(applies(x)) or picks[-1])
    norms = []
    standalone = rms_norm.add_rms_norm
    monkeypatch.setattr(rms_norm, "add_rms_norm", lambda *a: norms.append(a[0].shape[0]) or standalone(*a))
    if epilogue:  # the pass's view: the output projection [64, 256] is the GEMV's, gate/up [256, 64] is not
        monkeypatch.setattr(linear_ops, "gemv_may_serve", lambda n, k: n <= 64)
    launches = {"gemv": 0, "dot": 0, "rotating": 0, "epilogue": 0}

    def counted(launch, key):
        def run(*a, **kw):
            launches[key] += 1
            launches["rotating"] += kw.get("rope") is not None
            launches["epilogue"] += kw.get("norm_out") is not None
            return launch(*a, **kw)

        return run

    for mod, key in ((skinny_linear, "gemv"), (skinny_dot, "dot")):
        monkeypatch.setattr(mod, "_launch", counted(mod._launch, key))
    name = "llama_gqa"
    batch = prompts(name, count, seed=count)
    ids, mask = left_padded(batch)
    options = dict(fold_rope=True, fold_rope_linear=True) if rope else {}
    if epilogue:
        options["fold_norm_epilogue"] = True
    model = attngraph.accelerate(load(name, torch.bfloat16), attention_backend="torch_native", page_size=16,
                                 kv_cache_tokens=2048, skinny_linears=True, **options)  # fmt: skip
    try:
        got = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GREEDY)
    finally:
        attngraph.restore(model)
    want = expected(batch, 6)
    diff = (got != want).nonzero().tolist()
    assert not diff, f"{len(diff)} tokens differ from the copy, first at [row, position] {diff[0]}"
    assert picks and all(picks), picks  # each decode step's argmax ran the kernels
    # (accelerate's own warm-up forwards of a few tokens launch either kernel as well)
    assert launches["gemv" if count == 1 else "dot"] > 0 and (count > 1 or launches["dot"] == 0), launches
    # the norms of three-row steps: folded into the tensor-core kernel, or their own launches
    assert count == 1 or (3 in norms) != fold_norm, norms
    # a kernel rotated (the GEMV or the tensor-core kernel, and accelerate's warm-up forwards)
    assert (launches["rotating"] > 0) == rope, launches
    # the output projections' GEMVs normalized the MLP's input (and the warm-up forwards')
    assert (launches["epilogue"] > 0) == epilogue, launches


@pytest.mark.parametrize("name,backend,into_linear", [("llama_gqa", "torch_native", False), ("llama_gqa", "triton", False),
                                                     ("mistral_window", "triton", False), ("llama_gqa", "torch_native", True),
                                                     ("mistral_window", "torch_native", True)])  # fmt: skip
def test_rotary_embedding_folded_into_attention_is_the_copy(references, monkeypatch, name, backend, into_linear):
    """`CompileConfig.fold_rope`: q and k reach the attention op unrotated with their cos / sin
    rows; the Triton backend's decode kernel rotates them (under Triton's interpreter on the
    CPU), torch_native rotates them first; Mistral's sliding window too. With
    `fold_rope_linear` (fp32: the projections on torch's path) the rotation moves on into the
    fused q/k/v projection op, which rotates its first columns after the product, and no
    decode call gets rotary rows. Every layer's site folds, and the tokens are HF's."""
    from attngraph.attn_backends import triton_backend
    from attngraph.attn_backends.triton_ops.decode_attention import interpreter_problem, interpreting

    if backend == "triton" and not interpreting():
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1 before import; tests/conftest.py sets it)")
    if backend == "triton" and (problem := interpreter_problem()) is not None:
        pytest.skip(problem)
    folded_decodes = []
    fwd = triton_backend.decode_attention_fwd
    monkeypatch.setattr(triton_backend, "decode_attention_fwd",
                        lambda *a, **kw: folded_decodes.append(kw.get("rope_cos") is not None) or fwd(*a, **kw))  # fmt: skip
    ids, mask, want = references(name, 3)
    options = dict(skinny_linears=True, fold_rope_linear=True) if into_linear else {}
    model = attngraph.accelerate(load(name), attention_backend=backend, page_size=16, kv_cache_tokens=2048, fold_rope=True,
                                 **options)  # fmt: skip
    try:
        got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, **GREEDY)
        backend_state = state_of(model).runner.ragged.backend
        results, moved = backend_state.rewrites["fold_rope"], backend_state.rewrites["fold_rope_linear"]
    finally:
        attngraph.restore(model)
    diff = (got != want).nonzero().tolist()
    assert not diff, f"{len(diff)} tokens differ from HF's, first at [row, position] {diff[0]}"
    layers = load(name).config.num_hidden_layers
    assert results and all(len(r.folded) == layers and not r.refused for r in results)
    assert bool(moved) == into_linear and all(len(r.folded) == layers and not r.refused for r in moved), [r.refused for r in moved]
    assert (backend == "triton") == bool(folded_decodes)
    assert not any(folded_decodes) if into_linear else all(folded_decodes)
