"""Pass `rank_one_products` on Dynamo graphs: products over one contracted element counted
before and after, the ones it must leave alone (with their reasons), the rewritten graph's
values against the module it was traced from (equal bits), and the paged runtime's graphs."""

import inspect
import operator

import pytest
import torch

from attngraph.passes.rank_one_products import fp32_products_are_ieee, rank_one_products

from .test_fuse_linears import dynamo_graph as traced
from .test_skinny_linears import count

PRODUCTS = (torch.matmul, torch.bmm, operator.matmul)
MULS = (torch.mul,)


class RotaryAngles(torch.nn.Module):
    """The angles of HF's rotary embedding as transformers 5.17 writes them (``[B, D/2, 1] @
    [B, 1, T]``), then its cos/sin rows; ``form`` picks the spelling of the product."""

    def __init__(self, half=8, form="operator"):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.rand(half) * 0.9 + 0.05)))
        self.form = form

    def forward(self, x, position_ids):
        inv = self.inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1).to(x.dtype)
        pos = position_ids[:, None, :].to(x.dtype)
        if self.form == "operator":
            freqs = inv @ pos
        elif self.form == "bmm":
            freqs = torch.bmm(inv, pos)
        elif self.form == "method":
            freqs = inv.matmul(pos)
        else:  # a 4-D product with broadcast batch dims
            freqs = (inv[:, None] @ pos[None, :]).sum(0)
        emb = torch.cat((freqs.transpose(1, 2), freqs.transpose(1, 2)), dim=-1)
        return emb.cos() * 2.0, emb.sin()


class PermutedProduct(torch.nn.Module):
    """A product over one element whose first operand is a permuted view (a broadcast multiply
    of it is not contiguous), followed by a ``view`` that needs the product's dense layout."""

    def forward(self, a, b):
        return (a.permute(1, 0, 2) @ b).view(-1)


def test_the_multiply_keeps_the_products_dense_layout():
    a, b = torch.randn(8, 5, 1), torch.randn(5, 1, 7)
    assert not (a.permute(1, 0, 2) * b).is_contiguous()  # what the bare multiply would give
    gm, example = traced(PermutedProduct(), a, b)
    assert len(rank_one_products(gm).rewritten) == 1 and products(gm) == 0
    assert torch.equal(gm(*example)[0], PermutedProduct()(a, b))


def test_symbolic_batch_and_token_counts_keep_the_rewrite_exact():
    """Sizes as symbols (as the paged runtime traces its token counts): the contracted size is
    still the literal 1, the rewritten graph runs at other sizes with equal bits."""
    module = RotaryAngles()
    gm, example = traced(module, torch.randn(3, 7, 16), _positions(torch.float32), dynamic=True)
    assert len(rank_one_products(gm).rewritten) == 1 and products(gm) == 0
    x, pos = torch.randn(2, 11, 16), _positions(torch.float32, batch=2, t=11)
    new_size = {3: 2, 7: 11}  # each symbol's traced value -> its value now
    args = [new_size[e.node.hint] if isinstance(e, torch.SymInt) else pos if e.dtype == torch.long else e
            for e in example]  # fmt: skip
    for g, w in zip(gm(*args), module(x, pos)):
        assert torch.equal(g, w)


def products(gm) -> int:
    call_methods = sum(1 for n in gm.graph.nodes if n.op == "call_method" and n.target in ("matmul", "bmm"))
    return count(gm, PRODUCTS) + call_methods


def _positions(dtype, batch=3, t=7):
    """Random positions of a long context (fp16's: below its largest finite angle)."""
    return torch.randint(0, 4096 if dtype == torch.float16 else 100_000, (batch, t))


@pytest.mark.parametrize("form", ["operator", "bmm", "method", "broadcast"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_angles_become_a_multiply_with_equal_bits(form, dtype):
    module = RotaryAngles(form=form)
    x, pos = torch.randn(3, 7, 16, dtype=dtype), _positions(dtype)
    gm, example = traced(module, x, pos)
    assert products(gm) == 1
    muls = count(gm, MULS)
    want = module(x, pos)
    result = rank_one_products(gm)
    assert len(result.rewritten) == 1 and not result.refused
    assert products(gm) == 0 and count(gm, MULS) == muls + 1
    got = gm(*example)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


class Products(torch.nn.Module):
    """One product of ``a`` and ``b`` (module inputs), optionally in a CPU autocast region."""

    def __init__(self, autocast=False):
        super().__init__()
        self.autocast = autocast

    def forward(self, a, b):
        if self.autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return a @ b
        return a @ b


@pytest.mark.parametrize(
    "a,b",
    [
        (torch.randn(3, 4, 2), torch.randn(3, 2, 5)),  # two contracted elements: a real product
        (torch.randn(1), torch.randn(1, 5)),  # a 1-D operand: matmul's vector rules
        (torch.randn(4, 1), torch.randn(1)),
    ],
)
def test_products_over_more_elements_or_vectors_are_not_candidates(a, b):
    gm, _ = traced(Products(), a, b)
    result = rank_one_products(gm)
    assert products(gm) == 1 and not result.rewritten and not result.refused


def test_an_autocast_region_and_integer_products_are_refused():
    gm, _ = traced(Products(autocast=True), torch.randn(2, 4, 1), torch.randn(2, 1, 5))
    result = rank_one_products(gm)
    assert products(gm) == 1 and not result.rewritten
    assert [reason for _, reason in result.refused] == [
        "dtypes torch.float32 @ torch.float32 -> torch.bfloat16 (an autocast region)"
    ]
    gm, _ = traced(Products(), torch.randint(0, 9, (2, 4, 1)), torch.randint(0, 9, (2, 1, 5)))
    result = rank_one_products(gm)
    assert products(gm) == 1 and "not a floating type" in result.refused[0][1]


@pytest.fixture
def tf32_products():
    """torch's CUDA float32 matmul precision set to TF32 for the test, then restored."""
    before = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    yield
    torch.backends.cuda.matmul.fp32_precision = before


def test_float32_products_stay_where_tf32_may_round_them(tf32_products):
    assert not fp32_products_are_ieee()
    a, b = torch.randn(2, 4, 1), torch.randn(2, 1, 5)
    gm, _ = traced(Products(), a, b)
    result = rank_one_products(gm)
    assert products(gm) == 1 and "TF32" in result.refused[0][1]
    gm, _ = traced(Products(), a.bfloat16(), b.bfloat16())  # 16-bit products do not round to TF32
    assert len(rank_one_products(gm).rewritten) == 1 and products(gm) == 0


def test_ieee_float32_products_by_default():
    assert fp32_products_are_ieee()


def _hf_rotary_is_a_product() -> bool:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return " @ " in inspect.getsource(LlamaRotaryEmbedding.forward)  # not the decorators


def test_accelerated_llama_has_no_rank_one_product_left_and_keeps_hfs_tokens():
    """The paged runtime on a tiny Llama: HF's rotary angles become a multiply in every graph
    where this transformers writes them as a product (5.17), nothing is refused, and greedy
    fp32 tokens equal HF's."""
    from ..runtime.test_generate import greedy_equals_hf

    _, backend = greedy_equals_hf("llama", "sdpa")
    results = backend.rewrites["rank_one_products"]
    assert results and not any(r.refused for r in results)
    expected = 1 if _hf_rotary_is_a_product() else 0
    assert [len(r.rewritten) for r in results] == [expected] * len(results)


def test_the_stateless_backend_rewrites_too():
    """``torch.compile(module, backend=AttnGraphBackend())`` (stateless graphs): the product
    becomes a multiply there as well, and the compiled module returns the module's bits."""
    from attngraph.compiler.backend import AttnGraphBackend

    module = RotaryAngles()
    x, pos = torch.randn(3, 7, 16), _positions(torch.float32)
    backend = AttnGraphBackend()
    torch._dynamo.reset()
    got = torch.compile(module, backend=backend, fullgraph=True)(x, pos)
    assert [len(r.rewritten) for r in backend.rewrites["rank_one_products"]] == [1]
    assert [len(r) for name, r in backend.rewrites.items() if name != "rank_one_products"] == [0] * 7
    for g, w in zip(got, module(x, pos)):
        assert torch.equal(g, w)
