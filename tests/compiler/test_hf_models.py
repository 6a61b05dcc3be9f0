"""Stateless `torch.compile(model, backend="attngraph")` on tiny HF models: same logits as eager,
every decoder attention site lowered."""

import pytest
import torch

import attngraph
from attngraph.passes import ATTENTION_OP

from ..hf_models import arch_impl_params, build_model


class CountingBackend(attngraph.compiler.AttnGraphBackend):
    """Counts attention ops in the graphs handed to the piece compiler."""

    def __call__(self, gm, example_inputs):
        fn = super().__call__(gm, example_inputs)
        self.op_counts = getattr(self, "op_counts", []) + [
            sum(n.target is ATTENTION_OP for n in gm.graph.nodes)
        ]
        return fn


@pytest.mark.parametrize("arch,impl", arch_impl_params())
def test_compile_matches_eager(arch, impl):
    model = build_model(arch, impl)
    n_layers = model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (2, 19))
    backend = CountingBackend(attngraph.CompileConfig(attention_backend="torch_native"))
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        ref = model(ids).logits
        out = compiled(ids).logits
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert backend.report.num_lowered == n_layers, str(backend.report)
    assert sum(backend.op_counts) == n_layers
    # A second shape reuses or recompiles; either way the answer matches.
    ids2 = torch.randint(0, model.config.vocab_size, (3, 11))
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids2).logits, model(ids2).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch,impl", arch_impl_params())
def test_explain_lists_every_layer(arch, impl):
    model = build_model(arch, impl)
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    report = attngraph.explain(model, ids)
    assert report.num_lowered == model.config.num_hidden_layers, str(report)
    assert [s.layer_id for s in report.sites] == list(range(model.config.num_hidden_layers))
    text = str(report)
    assert "lowered" in text and report.sites[0].name in text


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_sliding_window_is_read_from_the_graph(arch):
    model = build_model(arch, "eager")
    ids = torch.randint(0, model.config.vocab_size, (1, 20))  # longer than the window (8)
    report = attngraph.explain(model, ids)
    windows = ["window=8" in s.reason for s in report.sites]
    if arch == "mistral":
        assert all(windows), str(report)
    else:  # Gemma2 alternates sliding and global layers
        assert windows == [True, False], str(report)
        assert all("softcap=50" in s.reason for s in report.sites), str(report)


def test_padding_mask_from_user_is_left_alone():
    model = build_model("llama", "sdpa")
    ids = torch.randint(0, model.config.vocab_size, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    backend = attngraph.backend(attention_backend="torch_native")
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        out = compiled(ids, attention_mask=mask).logits
        ref = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert backend.report.num_lowered == 0
    assert all("attention_mask" in s.reason for s in backend.report.sites), str(backend.report)


def test_dynamic_shapes_lower_and_match():
    model = build_model("mistral", "sdpa")
    compiled = torch.compile(model, backend=attngraph.backend(), dynamic=True)
    with torch.no_grad():
        for shape in [(2, 9), (3, 21), (1, 5)]:
            ids = torch.randint(0, model.config.vocab_size, shape)
            torch.testing.assert_close(compiled(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)


def test_gradients_flow_through_lowered_attention():
    model = build_model("llama", "eager").train()
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    compiled = torch.compile(model, backend=attngraph.backend())
    compiled(ids).logits.square().mean().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(ids).logits.square().mean().backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-4)
