"""`fuse_linears`: linears that read the same input run as one GEMM on concatenated weights,
the parameters become views of it (no second copy), and the unsafe groups are left alone."""

import pytest
import torch
import transformers
from torch import nn

from attngraph import CompileConfig
from attngraph.forward_batch import ForwardBatch
from attngraph.passes.fuse_linears import LINEAR_TARGETS, fuse_linears
from attngraph.runtime.model_runner import ModelRunner

from ..hf_models import tiny_config


def dynamo_graph(fn, *args, dynamic: bool = False):
    """``(gm, real example inputs)`` of ``fn`` traced by Dynamo (``dynamic``: sizes as symbols,
    which then are placeholders too)."""
    captured = []

    def backend(gm, example_inputs):
        captured.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*args)
    return captured[-1]


def linears(gm) -> int:
    return sum(n.op == "call_function" and n.target in LINEAR_TARGETS for n in gm.graph.nodes)


def held(model) -> int:
    """Bytes of the distinct storages behind the model's parameters."""
    return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}.values())


def hf_model(arch: str, layers: int = 3):
    cfg = tiny_config(arch)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[i % len(cfg.layer_types)] for i in range(layers)]
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_qkv_and_gate_up_become_one_gemm_each_with_the_same_outputs(arch):
    model = hf_model(arch)
    ids = torch.randint(0, model.config.vocab_size, (1, 11))
    gm, inputs = dynamo_graph(lambda i: model(input_ids=i).logits, ids)
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        want = gm(*inputs)[0]
    held_before = held(model)
    assert linears(gm) == 7 * layers + 1
    result = fuse_linears(gm, inputs)
    assert len(result.groups) == 2 * layers and not result.refused
    assert sorted(len(g) for g in result.groups) == [2] * layers + [3] * layers
    assert linears(gm) == 4 * layers + 1  # qkv, o, gate_up, down per layer; the LM head
    result.share_storage()
    attn = model.model.layers[0].self_attn
    fused = attn.q_proj.weight.untyped_storage()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == fused.data_ptr()  # views of one tensor
    assert any(t.untyped_storage().data_ptr() == fused.data_ptr() for t in result.extra_inputs)
    # Every fused parameter is a view of its group's tensor: the weights are held once.
    assert held(model) == held_before
    with torch.no_grad():
        got = gm(*inputs, *result.extra_inputs)[0]
        eager = model(input_ids=ids).logits  # the model itself, on the views
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eager, want, rtol=1e-5, atol=1e-5)
    result.unshare_storage()  # as `attngraph.restore` does: own storage per parameter again
    ptrs = [p.untyped_storage().data_ptr() for p in model.parameters()]
    assert len(set(ptrs)) == len(ptrs) and not result.extra_inputs
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 6, bias=False)  # biases on one only
        self.c, self.d = nn.Linear(8, 3, bias=False), nn.Linear(8, 5, bias=False)
        self.e = nn.Linear(8, 2, bias=False)
        self.f, self.g = nn.Linear(8, 4, bias=False), nn.Linear(8, 4, bias=False)
        self.h, self.i = nn.Linear(8, 3, bias=False), nn.Linear(8, 3, bias=False)

    def forward(self, x, y, z, u):
        first = self.a(x).sum(-1) + self.b(x).sum(-1)
        tied = self.c(y).sum(-1) + self.d(y).sum(-1) + self.c(z).sum(-1)  # c's weight read twice
        computed = nn.functional.linear(u, self.f.weight * 2).sum(-1) + self.g(u).sum(-1)
        fine = self.h(z).sum(-1) + self.i(z).sum(-1) + self.e(u).sum(-1) * 0
        return first + tied + computed + fine


def test_unsafe_groups_are_refused_with_a_reason_and_left_as_they_were():
    torch.manual_seed(1)
    toy = Toy().eval()
    args = [torch.randn(2, 8) for _ in range(4)]
    gm, inputs = dynamo_graph(toy, *args)
    with torch.no_grad():
        want = gm(*inputs)
    before = linears(gm)
    result = fuse_linears(gm, inputs)
    reasons = " | ".join(r for _, r in result.refused)
    assert "biases on some members only" in reasons
    assert "also read elsewhere" in reasons
    assert "not a parameter input" in reasons
    # The safe members still fuse: h and i on z (c, read twice, stays out), g and e on u
    # (f's weight is computed).
    assert sorted(len(g) for g in result.groups) == [2, 2]
    assert linears(gm) == before - 2
    result.share_storage()
    assert toy.c.weight.untyped_storage().nbytes() == toy.c.weight.numel() * 4  # untouched
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs, *result.extra_inputs), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_paged_runtime_fused_and_unfused_give_the_same_logits(arch):
    fused_model, plain_model = hf_model(arch, layers=2), hf_model(arch, layers=2)
    ids = torch.randint(0, fused_model.config.vocab_size, (13,), generator=torch.Generator().manual_seed(3))
    logits = []
    for model, fuse in ((plain_model, False), (fused_model, True)):
        runner = ModelRunner(model, CompileConfig(attention_backend="torch_native", kv_cache_tokens=256, max_requests=2, fuse_linears=fuse))
        pool = runner.pool
        row = pool.alloc_request()
        pool.reserve([row], [14])
        logits.append(runner.forward(ForwardBatch.build(pool, [row], [0], [13], ids), torch.arange(13)))
        logits.append(runner.forward(ForwardBatch.build(pool, [row], [13], [1], ids[:1])))
        groups = sum(len(r.groups) for r in runner.ragged.backend.fused_linears)
        assert groups == (4 if fuse else 0)
        runner.release()  # what attngraph.restore does
        ptrs = [p.untyped_storage().data_ptr() for p in model.parameters()]
        assert len(set(ptrs)) == len(ptrs), "a parameter still shares the fused storage after release"
    for a, b in ((logits[0], logits[2]), (logits[1], logits[3])):
        assert a.abs().max() > 0
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
