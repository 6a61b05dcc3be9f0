"""Steps padded past their tokens (a captured batch of one runs two graph rows): the padding
rows' attention output is never written, and no real row reads it."""

from __future__ import annotations

import pytest
import torch

import attngraph.ops as ops
from attngraph import CompileConfig
from attngraph.forward_batch import ForwardBatch
from attngraph.forward_context import ForwardContext, use_forward_context
from attngraph.runtime.model_runner import ModelRunner
from attngraph.runtime.ragged_model import MIN_TOKENS, graph_rows

from ..hf_models import build_model


def _interpreted_linears(monkeypatch) -> list[int]:
    """attngraph's linear ops run their kernels on the CPU (Triton's interpreter); returns the
    list the row count of every launch goes to. Skips where the interpreter cannot run."""
    from attngraph import linear_ops, skinny_linear

    if not skinny_linear.interpreting() or skinny_linear.interpreter_problem() is not None:
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1 before import; tests/conftest.py sets it)")
    monkeypatch.setattr(linear_ops, "CPU_INTERPRETER", True)
    launches: list[int] = []
    launch = skinny_linear._launch

    def counting(x, *args, **kwargs):
        launches.append(x.shape[0])
        return launch(x, *args, **kwargs)

    monkeypatch.setattr(skinny_linear, "_launch", counting)
    return launches


def test_graph_rows_pads_only_below_the_minimum():
    assert [graph_rows(b) for b in (1, 2, 3, 16)] == [MIN_TOKENS, 2, 3, 16]


@pytest.mark.parametrize("linear_kernels", [False, True], ids=["torch_linears", "gemv_real_rows"])
def test_poisoned_padding_rows_leave_the_real_row_exact(one_thread, monkeypatch, request, linear_kernels):
    """Decode one request as one row (the runtime pads it itself) and as two rows whose second
    holds a random token and position, with every padding row's attention output poisoned
    (NaN): the real row's logits are bit-identical and the padding row's are NaN, so the
    poison did flow through the model and stayed in its row. ``gemv_real_rows``: the linears
    run the GEMV (Triton's interpreter) on the real row only, leaving the padding row's outputs
    unwritten (NaN-poisoned allocations); bf16, the GEMV's dtype."""
    launches = _interpreted_linears(monkeypatch) if linear_kernels else []
    if linear_kernels:
        request.getfixturevalue("poison_empty")  # the rows the GEMV leaves unwritten are NaN
    model = build_model("llama", "sdpa", seed=11)
    if linear_kernels:
        model = model.to(torch.bfloat16)  # the GEMV's dtypes
    config = CompileConfig(attention_backend="torch_native", page_size=4, kv_cache_tokens=256, max_requests=2,
                           skinny_linears=linear_kernels)  # fmt: skip
    runner = ModelRunner(model, config)
    pool, backend = runner.pool, runner.backend
    g = torch.Generator().manual_seed(12)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (9,), generator=g)
    row = pool.alloc_request()
    pool.reserve([row], [10])
    runner.forward(ForwardBatch.build(pool, [row], [0], [9], prompt))
    token = torch.randint(0, vocab, (1,), generator=g)
    batch = ForwardBatch.build(pool, [row], [9], [1], token)
    backend.init_forward_metadata(batch)
    del launches[:]  # those of the runner's warm-up and the prefill
    with use_forward_context(ForwardContext(backend, batch)):
        want = runner.ragged(batch.input_ids, batch.positions, torch.zeros(1, dtype=torch.long))

        plain = ops.paged_attention_into

        def poisoned(out, *args, **kwargs):
            out.fill_(float("nan"))
            return plain(out, *args, **kwargs)

        monkeypatch.setattr(ops, "paged_attention_into", poisoned)
        ids = torch.cat([token, torch.randint(0, vocab, (1,), generator=g)])
        positions = torch.cat([batch.positions, torch.randint(0, 9, (1,), generator=g)])
        got = runner.ragged(ids, positions, torch.arange(2))
    pool.free_request(row)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got[:1], want, rtol=0, atol=0)
    assert torch.isnan(got[1]).all()
    if linear_kernels:  # every GEMV of both decodes ran the real row alone, but the LM head of
        assert launches[-1] == 2 and set(launches[:-1]) == {1}  # the two logits rows
