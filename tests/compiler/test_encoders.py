"""Encoder models (BERT, RoBERTa) through the stateless path.

Non-causal full attention without a user mask must be lowered (and really run through the
attngraph op); a padding ``attention_mask`` from the user must leave every site alone with a
reason naming that input. Outputs always equal eager.
"""

import pytest
import torch
import transformers

import attngraph
from attngraph.attn_backends.torch_native import TorchNativeBackend
from attngraph.passes import ATTENTION_OP

ENCODERS = ("BertConfig", "RobertaConfig")
IMPLS = ("sdpa", "eager")
VOCAB = 96


def build_encoder(cls_name: str, impl: str, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = getattr(transformers, cls_name)(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        **overrides,
    )
    return transformers.AutoModel.from_config(cfg, attn_implementation=impl).eval()


class CountingBackend(attngraph.compiler.AttnGraphBackend):
    """Counts attention ops in the graphs handed to the piece compiler."""

    def __call__(self, gm, example_inputs):
        fn = super().__call__(gm, example_inputs)
        self.op_counts = getattr(self, "op_counts", []) + [sum(n.target is ATTENTION_OP for n in gm.graph.nodes)]
        return fn


@pytest.fixture
def dense_calls(monkeypatch):
    """Records the AttentionLayer of every dense attention the torch_native backend serves."""
    calls = []
    original = TorchNativeBackend.forward_dense

    def spy(self, q, k, v, layer, batch_size):
        calls.append((layer, int(batch_size), q.shape[0]))
        return original(self, q, k, v, layer, batch_size)

    monkeypatch.setattr(TorchNativeBackend, "forward_dense", spy)
    return calls


def random_ids(gen: torch.Generator, bsz: int, seq: int) -> torch.Tensor:
    # RoBERTa's position ids skip the padding id (1): keep real tokens away from it.
    return torch.randint(3, VOCAB, (bsz, seq), generator=gen)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cls_name", ENCODERS)
def test_full_attention_is_lowered_and_matches_eager(cls_name, impl, dense_calls):
    model = build_encoder(cls_name, impl)
    n_layers = model.config.num_hidden_layers
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    backend = CountingBackend(attngraph.CompileConfig(attention_backend="torch_native"))
    compiled = torch.compile(model, backend=backend)
    ids = random_ids(gen, 2, 13)
    with torch.no_grad():
        out = compiled(input_ids=ids).last_hidden_state
        ref = model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert backend.report.num_lowered == n_layers == len(backend.report.sites), str(backend.report)
    assert all("full" in s.reason for s in backend.report.sites), str(backend.report)
    assert sum(backend.op_counts) == n_layers
    # The op really ran, non-causal, no window, over the dense batch of 2 x 13.
    assert len(dense_calls) == n_layers
    for layer, bsz, n_q in dense_calls:
        assert layer.causal is False and layer.window_left == -1 and layer.logit_cap == 0
        assert (bsz, n_q) == (2, 26)
        assert layer.scale == pytest.approx(1 / (64 // 4) ** 0.5)

    # A causal lowering would differ from eager on every position but the last one: make sure
    # the comparison above can tell (the first token must see the later ones).
    with torch.no_grad():
        prefix = model(input_ids=ids[:, :1]).last_hidden_state
    assert (prefix[:, 0] - ref[:, 0]).abs().max() > 1e-3

    # Another batch size and length: recompiled or dynamic, still the same as eager.
    ids2 = random_ids(gen, 3, 7)
    with torch.no_grad():
        out2 = compiled(input_ids=ids2).last_hidden_state
        ref2 = model(input_ids=ids2).last_hidden_state
    torch.testing.assert_close(out2, ref2, atol=1e-4, rtol=1e-4)
    assert backend.report.num_lowered == len(backend.report.sites), str(backend.report)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cls_name", ENCODERS)
def test_user_padding_mask_is_left_alone(cls_name, impl, dense_calls):
    model = build_encoder(cls_name, impl)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    bsz, seq = 3, 11
    ids = random_ids(gen, bsz, seq)
    mask = torch.ones(bsz, seq, dtype=torch.long)
    lengths = torch.randint(2, seq, (bsz,), generator=gen)
    lengths[-1] = seq  # one row without padding
    for b, n in enumerate(lengths.tolist()):
        mask[b, n:] = 0  # right padding, as tokenizers pad encoders
        ids[b, n:] = model.config.pad_token_id
    backend = CountingBackend(attngraph.CompileConfig(attention_backend="torch_native"))
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        out = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    report = backend.report
    assert len(report.sites) == model.config.num_hidden_layers, str(report)
    assert report.num_lowered == 0, str(report)
    assert all("attention_mask" in s.reason for s in report.sites), str(report)
    assert sum(backend.op_counts) == 0 and dense_calls == []
    # The mask matters: without it the padded rows' real tokens would see the pads.
    with torch.no_grad():
        unmasked = model(input_ids=ids).last_hidden_state
    b = int(lengths.argmin())
    assert (unmasked[b, : lengths[b]] - ref[b, : lengths[b]]).abs().max() > 1e-3


@pytest.mark.parametrize("impl", IMPLS)
def test_all_ones_user_mask_is_still_left_alone(impl, dense_calls):
    """An all-ones mask is still data from the user: never assumed away."""
    model = build_encoder("BertConfig", impl)
    ids = random_ids(torch.Generator().manual_seed(3), 2, 9)
    mask = torch.ones_like(ids)
    backend = attngraph.backend(attention_backend="torch_native")
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        out = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert backend.report.num_lowered == 0, str(backend.report)
    assert all("attention_mask" in s.reason for s in backend.report.sites), str(backend.report)


@pytest.mark.parametrize("impl", IMPLS)
def test_train_mode_attention_dropout_is_left_alone(impl):
    model = build_encoder("BertConfig", impl, attention_probs_dropout_prob=0.5).train()
    backend = attngraph.backend(attention_backend="torch_native")
    compiled = torch.compile(model, backend=backend)
    compiled(input_ids=random_ids(torch.Generator().manual_seed(4), 2, 9))
    assert len(backend.report.sites) == model.config.num_hidden_layers, str(backend.report)
    assert backend.report.num_lowered == 0, str(backend.report)
    assert all("dropout" in s.reason for s in backend.report.sites), str(backend.report)
