"""`split_at_attention`: piece counts and kinds, and the split graph computes what the unsplit one does."""

import pytest
import torch

from attngraph.compiler.backend import AttnGraphBackend
from attngraph.compiler.split import ATTENTION, ROWS, STATIC, is_attention_node, split_at_attention
from attngraph.config import CompileConfig
from tests.hf_models import build_model


class _Recorder(AttnGraphBackend):
    """Keeps each lowered graph with the example inputs Dynamo gave it."""

    def __init__(self):
        super().__init__(CompileConfig(attention_backend="torch_native", piece_compiler="eager"))
        self.examples = []

    def __call__(self, gm, example_inputs):
        self.examples.append(list(example_inputs))
        return super().__call__(gm, example_inputs)


def _lowered(arch: str, seed: int, rows: bool):
    """One lowered graph of a tiny HF model (token count and logits rows dynamic when ``rows``)."""
    model = build_model(arch, "eager" if arch == "gemma2" else "sdpa", seed=seed)
    rec = _Recorder()

    def forward(input_ids, logits_indices):
        return model(input_ids=input_ids, use_cache=False, logits_to_keep=logits_indices).logits

    compiled = torch.compile(forward if rows else (lambda ids: model(input_ids=ids, use_cache=False).logits), backend=rec, fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, 11), generator=g)
    with torch.no_grad():
        if rows:
            compiled(ids, torch.tensor([3, 10]))
        else:
            compiled(ids)
    (gm,) = rec.graphs
    return model, gm, rec.examples[0]


def _attention_count(gm) -> int:
    return sum(is_attention_node(n) for n in gm.graph.nodes)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_split_gives_2n_plus_1_pieces_with_attention_alone(arch):
    _model, gm, _ = _lowered(arch, seed=1, rows=False)
    n = _attention_count(gm)
    assert n >= 2
    split = split_at_attention(gm)
    assert len(split.pieces) == 2 * n + 1
    assert [p.kind for p in split.pieces] == [STATIC, ATTENTION] * n + [STATIC]
    for piece in split.of_kind(ATTENTION):
        sub = getattr(split.module, piece.name)
        calls = [node for node in sub.graph.nodes if node.op == "call_function"]
        assert len(calls) == 1 and is_attention_node(calls[0])
    for piece in split.of_kind(STATIC):
        assert _attention_count(getattr(split.module, piece.name)) == 0


def test_row_inputs_start_a_last_rows_piece():
    _model, gm, _ = _lowered("llama", seed=2, rows=True)
    n = _attention_count(gm)
    split = split_at_attention(gm, row_inputs=("logits_indices",))
    assert [p.kind for p in split.pieces] == [STATIC, ATTENTION] * n + [STATIC, ROWS]
    rows = getattr(split.module, split.of_kind(ROWS)[0].name)
    assert any(node.op == "placeholder" and "logits_indices" in node.name for node in rows.graph.nodes)
    # Without row inputs named, nothing is split off.
    assert [p.kind for p in split_at_attention(gm).pieces][-1] == STATIC


@pytest.mark.parametrize("arch,rows", [("llama", True), ("qwen2", False), ("gemma2", True)])
def test_split_graph_outputs_equal_the_unsplit_graph(arch, rows):
    from attngraph.attn_backends.torch_native import TorchNativeBackend
    from attngraph.forward_context import ForwardContext, use_forward_context

    _model, gm, example = _lowered(arch, seed=3, rows=rows)
    example = [x.node.hint if isinstance(x, torch.SymInt) else x for x in example]  # the call's real sizes
    split = split_at_attention(gm, row_inputs=("logits_indices",) if rows else ())
    with torch.no_grad(), use_forward_context(ForwardContext(TorchNativeBackend())):
        want = gm(*example)
        got = split.module(*example)
    want = want if isinstance(want, (tuple, list)) else (want,)
    got = got if isinstance(got, (tuple, list)) else (got,)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=0, atol=0)
