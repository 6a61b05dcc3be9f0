"""The tensor-core GEMM of 3-16 rows (`attngraph.skinny_dot`) and the ops' use of it.

Without CUDA the kernel runs in Triton's CPU interpreter (``TRITON_INTERPRET=1``, tests/conftest.py)
on small shapes; with CUDA natively, plus the ``gpu`` tests at the Llama projection shapes and in
a CUDA graph. Fresh seeded inputs, NaN-poisoned ``torch.empty`` (an unwritten output shows up),
fp64 references of the same rounded inputs (`tests/test_skinny_linear.py`'s bound).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from attngraph import linear_ops  # noqa: E402
from attngraph import skinny_dot as sd  # noqa: E402
from attngraph import skinny_linear  # noqa: E402
from attngraph.errors import InputError  # noqa: E402

# `device`: CUDA, or the CPU under Triton's interpreter (a fixture)
from .test_skinny_linear import PROJECTIONS, assert_close_to_reference, device, make, silu_mul_slack  # noqa: E402, F401

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(sd._skinny_dot_kernel, InterpretedFunction):
        importlib.reload(sd)


@pytest.fixture(autouse=True)
def _poison_empty(poison_empty):
    """``torch.empty`` returns NaN-filled tensors for the duration of a test (conftest)."""


def cfg(bn: int, bk: int, split: int = 1, warps: int = 4, stages: int = 2) -> dict:
    return dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages)


# fp32 accumulation of exact bf16 / fp16 products: the GEMV's bound holds
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [3, 7, 16])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_matches_reference_with_tails(device, dtype, m, bias):
    """N and K tails (37 x 100 with 16 x 32 tiles), strided rows, padded rows never written."""
    x, w, b = make(m * 7 + bias, m, 37, 100, dtype, device, bias=bias, row_pad=5 if m % 2 else 0)
    assert_close_to_reference(sd.skinny_dot_linear(x, w, b, config=cfg(16, 32)), x, w, b)


@pytest.mark.parametrize("c", [cfg(16, 32, split=2), cfg(32, 16, split=4), cfg(16, 64, split=3), cfg(64, 16, split=1)],
                         ids=lambda c: "n{BLOCK_N}-k{BLOCK_K}-split{SPLIT_K}".format(**c))  # fmt: skip
@pytest.mark.parametrize("k", [96, 100])
def test_split_k_even_and_cut_k(device, c, k):
    """Split K with K a multiple of the chunk (no K mask) and not; the counters end at zero."""
    x, w, b = make(k + c["SPLIT_K"], 9, 70, k, torch.bfloat16, device, bias=True)
    y = sd.skinny_dot_linear(x, w, b, config=c)
    assert_close_to_reference(y, x, w, b)
    counters = skinny_linear._COUNTERS._by_device.get(x.device)
    assert counters is None or int(counters.abs().sum()) == 0


@pytest.mark.parametrize("m", [3, 16])
@pytest.mark.parametrize("split", [1, 2])
def test_silu_mul_matches_reference(device, m, split):
    """``silu(a) * b`` formed in the loads, rounded once: against the rounded product in fp64."""
    gen = torch.Generator().manual_seed(m * 5 + split)
    gu = (torch.randn(m, 2 * 96, generator=gen) * 2).to(torch.bfloat16).to(device)
    a, b = gu[:, :96], gu[:, 96:]  # the halves of a fused gate/up output: rows 192 apart
    w = (torch.randn(40, 96, generator=gen) / 96**0.5).to(torch.bfloat16).to(device)
    h = linear_ops.silu_mul(a.contiguous(), b.contiguous())
    y = sd.skinny_dot_silu_mul_linear(a, b, w, config=cfg(16, 32, split=split))
    assert_close_to_reference(y, h, w, None, slack=silu_mul_slack(h, w))


def test_silu_mul_with_one_tensor_twice_is_not_a_plain_product(device):
    x, w, _ = make(11, 4, 32, 64, torch.bfloat16, device)
    y = sd.skinny_dot_silu_mul_linear(x, x, w, config=cfg(16, 32))
    h = linear_ops.silu_mul(x, x)
    assert_close_to_reference(y, h, w, None, slack=silu_mul_slack(h, w))


def gated_operands(seed: int, m: int, inter: int, k: int, dtype, device):
    """``x: [m, k]`` and a fused gate/up weight ``[2 * inter, k]`` whose products spread over
    SiLU's curved range (scaled up: both signs, values past a few units)."""
    x, w, _ = make(seed, m, 2 * inter, k, dtype, device)
    return x, (w.float() * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m,inter,k,c", [(3, 80, 96, cfg(32, 32)), (16, 64, 100, cfg(64, 32, split=4)), (7, 48, 64, None)],
                         ids=["tails", "split_asked", "default_tile"])  # fmt: skip
def test_gated_equals_the_product_then_silu_mul(device, dtype, m, inter, k, c):
    """The activation in the epilogue: the bits of the product (the tile's half, K unsplit)
    followed by `silu_mul` on its halves, and within rounding of ``silu(g) * u`` in fp64."""
    x, w = gated_operands(m * 7 + inter, m, inter, k, dtype, device)
    out = torch.full((m, inter), float("nan"), dtype=dtype, device=device)
    sd.skinny_dot_gated_linear(x, w, out=out, config=c)
    half = sd._check_config(c or sd.default_config(2 * inter, k))
    half.update(BLOCK_N=max(half["BLOCK_N"] // 2, sd.MIN_BLOCK_N), SPLIT_K=1)
    y = sd.skinny_dot_linear(x, w, config=half)
    assert torch.equal(out, skinny_linear.silu_mul(y[:, :inter], y[:, inter:]))
    g, u = (x.double() @ w[:inter].double().T), (x.double() @ w[inter:].double().T)
    ref = F.silu(g) * u
    bound = 4 * (2.0**-8 if dtype == torch.bfloat16 else 2.0**-11) * (ref.abs() + (x.double().abs() @ w.double().abs().T)[:, :inter])
    assert ((out.double() - ref).abs() <= bound).all()
    assert not torch.equal(out, y[:, :inter])  # not the plain product


def test_gated_refusals(device):
    x, w, _ = make(2, 4, 64, 32, torch.bfloat16, device)
    with pytest.raises(InputError, match=r"\[2I, K\]"):
        sd.skinny_dot_gated_linear(x, w[:63])
    with pytest.raises(InputError, match="out must be"):
        sd.skinny_dot_gated_linear(x, w, out=torch.empty(4, 64, dtype=torch.bfloat16, device=device))
    xs = torch.randn(4, 64, dtype=torch.bfloat16, device=device)
    with pytest.raises(InputError, match="out overlaps x"):
        sd.skinny_dot_gated_linear(xs, torch.randn(128, 64, dtype=torch.bfloat16, device=device), out=xs)


def test_the_default_configs_are_valid():
    for n, k in PROJECTIONS + [(37, 100), (5, 7000), (70000, 64)]:
        c = sd.default_config(n, k)
        assert sd._check_config(c) == c
        assert c["SPLIT_K"] == 1 or k >= c["SPLIT_K"] * c["BLOCK_K"]


def test_refusals(device):
    x, w, b = make(1, 4, 32, 64, torch.bfloat16, device)
    with pytest.raises(InputError, match="M <= 16"):
        sd.skinny_dot_linear(torch.zeros(17, 64, dtype=torch.bfloat16, device=device), w)
    with pytest.raises(InputError, match="bfloat16 or float16"):
        sd.skinny_dot_linear(x.float(), w.float())
    with pytest.raises(InputError, match=r"contiguous \[N, 64\]"):
        sd.skinny_dot_linear(x, w.T.contiguous().T)
    with pytest.raises(InputError, match="bias"):
        sd.skinny_dot_linear(x, w, torch.zeros(31, dtype=torch.bfloat16, device=device))
    with pytest.raises(InputError, match="out must be"):
        sd.skinny_dot_linear(x, w, out=torch.empty(4, 31, dtype=torch.bfloat16, device=device))
    with pytest.raises(InputError, match="one shape"):
        sd.skinny_dot_silu_mul_linear(x, x[:3], w)
    with pytest.raises(InputError, match="power of two"):
        sd.skinny_dot_linear(x, w, config=cfg(48, 32))
    with pytest.raises(InputError, match=">= 16"):
        sd.skinny_dot_linear(x, w, config=cfg(8, 32))
    # an output sharing memory with an input its programs still read
    xs, rs = (torch.randn(4, 64, dtype=torch.bfloat16, device=device) for _ in range(2))
    nw = torch.rand(64, dtype=torch.bfloat16, device=device) + 0.5
    w64 = torch.randn(64, 64, dtype=torch.bfloat16, device=device)
    with pytest.raises(InputError, match="out overlaps x"):
        sd.skinny_dot_linear(xs, w64, out=xs)
    with pytest.raises(InputError, match="out overlaps a"):
        sd.skinny_dot_silu_mul_linear(xs, rs, w64, out=xs)
    with pytest.raises(InputError, match="h_out overlaps residual"):
        sd.skinny_dot_rms_norm_linear(xs, nw, 1e-5, w64, residual=rs, h_out=rs)


def test_empty_shapes(device):
    w = torch.randn(5, 0, dtype=torch.bfloat16, device=device)
    b = torch.randn(5, dtype=torch.bfloat16, device=device)
    y = sd.skinny_dot_linear(torch.zeros(4, 0, dtype=torch.bfloat16, device=device), w, b)
    assert torch.equal(y, b.expand(4, 5))
    assert sd.skinny_dot_linear(torch.zeros(0, 8, dtype=torch.bfloat16, device=device), torch.ones(5, 8, dtype=torch.bfloat16, device=device)).shape == (0, 5)


# ----------------------------------------------------------------------------- the ops' routing
@pytest.fixture
def kernel_ops(device, monkeypatch):
    monkeypatch.setattr(linear_ops, "CPU_INTERPRETER", True)
    return device


def test_ops_route_3_to_16_rows_to_tensor_cores(kernel_ops, monkeypatch):
    calls = []
    launch = sd._launch
    monkeypatch.setattr(sd, "_launch", lambda *a, **kw: calls.append(kw["silu_mul"]) or launch(*a, **kw))
    x, w, b = make(5, 16, 48, 64, torch.bfloat16, kernel_ops, bias=True)
    assert_close_to_reference(linear_ops.linear(x.view(2, 8, 64), w, b).view(16, 48), x, w, b)
    gen = torch.Generator().manual_seed(3)
    gu = (torch.randn(5, 128, generator=gen)).to(torch.bfloat16).to(kernel_ops)
    y = linear_ops.silu_mul_linear(gu[:, :64], gu[:, 64:], w)
    h = linear_ops.silu_mul(gu[:, :64].contiguous(), gu[:, 64:].contiguous())
    assert_close_to_reference(y, h, w, None, slack=silu_mul_slack(h, w))
    assert calls == [False, False]  # the product runs its own launch, then the plain kernel
    linear_ops.linear(make(1, 17, 48, 64, torch.bfloat16, kernel_ops)[0], w)  # 17 rows: torch
    linear_ops.linear(make(1, 2, 48, 64, torch.bfloat16, kernel_ops)[0], w)  # 2 rows: the GEMV
    assert len(calls) == 2


@pytest.mark.parametrize("m", [2, 5, 17])
def test_gated_mlp_op_equals_the_ops_it_replaces(kernel_ops, monkeypatch, m):
    """`add_rms_norm_gated_mlp`: at 3-16 rows the norm, the gated tensor-core launch and the down
    product (the residual stream bit-equal, the output within a rounding of the separate ops';
    the gate/up tile differs); at 2 rows (the GEMV's folds) and 17 (torch) exactly the ops."""
    gated = []
    launch = sd._launch
    monkeypatch.setattr(sd, "_launch", lambda *a, **kw: gated.append(kw.get("gated", False)) or launch(*a, **kw))
    gen = torch.Generator().manual_seed(m)
    x, r = ((torch.randn(m, 64, generator=gen) * 2).to(torch.bfloat16).to(kernel_ops) for _ in range(2))
    nw = (torch.rand(64, generator=gen) + 0.5).to(torch.bfloat16).to(kernel_ops)
    w_gu = (torch.randn(2 * 96, 64, generator=gen) / 4).to(torch.bfloat16).to(kernel_ops)
    w_down = (torch.randn(48, 96, generator=gen) / 10).to(torch.bfloat16).to(kernel_ops)
    out, h = linear_ops.add_rms_norm_gated_mlp(x, r, nw, 1e-5, w_gu, w_down)
    took_gated = any(gated)
    y, h_ref = linear_ops.add_rms_norm_linear(x, r, nw, 1e-5, w_gu)
    ref = linear_ops.silu_mul_linear(y[:, :96], y[:, 96:], w_down)
    assert torch.equal(h, h_ref) and out.shape == ref.shape and not out.isnan().any()
    assert took_gated == (3 <= m <= 16)
    if took_gated:
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    else:
        assert torch.equal(out, ref)
    with pytest.raises(InputError, match=r"\[2I, K\]"):
        linear_ops.add_rms_norm_gated_mlp(x, r, nw, 1e-5, w_gu[:191], w_down)


@pytest.mark.parametrize("gated_limit,takes", [(2 * 96 * 64, True), (2 * 96 * 64 - 1, False)])
def test_gated_mlp_op_has_its_own_weight_limit(kernel_ops, monkeypatch, gated_limit, takes):
    """The gated launch takes gate/up weights up to `linear_ops.DOT_MAX_GATED_WEIGHT` elements,
    past the plain products' `DOT_MAX_WEIGHT` (here lowered below the weight); above it the op
    runs the ops it replaces, bit for bit."""
    gated = []
    launch = sd._launch
    monkeypatch.setattr(sd, "_launch", lambda *a, **kw: gated.append(kw.get("gated", False)) or launch(*a, **kw))
    monkeypatch.setattr(linear_ops, "DOT_MAX_WEIGHT", 64 * 64)
    monkeypatch.setattr(linear_ops, "DOT_MAX_GATED_WEIGHT", gated_limit)
    gen = torch.Generator().manual_seed(gated_limit)
    x, r = ((torch.randn(5, 64, generator=gen) * 2).to(torch.bfloat16).to(kernel_ops) for _ in range(2))
    nw = (torch.rand(64, generator=gen) + 0.5).to(torch.bfloat16).to(kernel_ops)
    w_gu = (torch.randn(2 * 96, 64, generator=gen) / 4).to(torch.bfloat16).to(kernel_ops)
    w_down = (torch.randn(48, 96, generator=gen) / 10).to(torch.bfloat16).to(kernel_ops)
    out, _ = linear_ops.add_rms_norm_gated_mlp(x, r, nw, 1e-5, w_gu, w_down)
    y, _ = linear_ops.add_rms_norm_linear(x, r, nw, 1e-5, w_gu)
    ref = linear_ops.silu_mul_linear(y[:, :96], y[:, 96:], w_down)
    assert any(gated) == takes
    if takes:
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    else:
        assert torch.equal(out, ref)


def test_ops_keep_fp32_off_tensor_cores(kernel_ops, monkeypatch):
    monkeypatch.setattr(sd, "_launch", lambda *a, **kw: pytest.fail("tensor-core kernel launched"))
    x, w, _ = make(2, 8, 48, 64, torch.float32, kernel_ops)
    torch.testing.assert_close(linear_ops.linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("heads", [True, False])
def test_output_heads_above_the_weight_limit_follow_dot_heads(kernel_ops, monkeypatch, heads):
    """An output head (N >= 16 K) of 3-16 rows takes the tensor-core kernel with `DOT_HEADS`,
    however large (here above a lowered `DOT_MAX_WEIGHT`; N no multiple of the tile), and
    cuBLAS without it; other weights above the limit stay cuBLAS's either way."""
    launched = []
    launch = sd._launch
    monkeypatch.setattr(sd, "_launch", lambda *a, **kw: launched.append(a) or launch(*a, **kw))
    monkeypatch.setattr(linear_ops, "DOT_HEADS", heads)
    monkeypatch.setattr(linear_ops, "DOT_MAX_WEIGHT", 64 * 64)
    x, w, _ = make(4, 5, 16 * 64 + 40, 64, torch.bfloat16, kernel_ops)  # 1064 x 64: a head
    y = linear_ops.linear(x, w)
    assert len(launched) == int(heads)
    if heads:
        assert_close_to_reference(y, x, w, None)
    else:
        assert torch.equal(y, F.linear(x, w))
    x, w, _ = make(6, 5, 16 * 64 - 8, 64, torch.bfloat16, kernel_ops)  # 1016 x 64: no head, above the limit
    assert torch.equal(linear_ops.linear(x, w), F.linear(x, w)) and len(launched) == int(heads)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", PROJECTIONS[:4] + PROJECTIONS[5:9], ids=lambda v: str(v))
def test_projection_shapes_on_the_gpu(n, k):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for m in (3, 16):
        x, w, b = make(n + m, m, n, k, torch.bfloat16, "cuda")
        assert_close_to_reference(sd.skinny_dot_linear(x, w), x, w, None)
        a, bb = x, make(n + m + 1, m, n, k, torch.bfloat16, "cuda")[0]
        h = linear_ops.silu_mul(a, bb)
        assert_close_to_reference(sd.skinny_dot_silu_mul_linear(a, bb, w), h, w, None, slack=silu_mul_slack(h, w))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(128256, 2048), (151936, 1536), (50257, 768)], ids=["llama_1b", "qwen2", "gpt2_odd"])
def test_output_heads_on_the_gpu(n, k):
    """LM heads of 3-16 rows through the op (`DOT_HEADS`): the tensor-core kernel within the
    reference's rounding, a vocabulary no multiple of the tile included."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for m in (3, 16):
        x, w, _ = make(n + m, m, n, k, torch.bfloat16, "cuda")
        y = linear_ops.linear(x, w)  # its output NaN-filled until written (torch.empty poisoned)
        assert not y.isnan().any()
        assert_close_to_reference(y, x, w, None)
        assert_close_to_reference(sd.skinny_dot_linear(x, w), x, w, None)


@pytest.mark.gpu
@pytest.mark.parametrize("inter,k", [(8192, 2048), (4096, 4096)], ids=["1b", "odd_shape"])
def test_gated_at_projection_shapes_on_the_gpu(inter, k):
    """The 1B gate/up's tuned tile (and a heuristic one): the product's bits, then silu_mul."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for m in (3, 16):
        x, w = gated_operands(inter + m, m, inter, k, torch.bfloat16, "cuda")
        out = sd.skinny_dot_gated_linear(x, w)
        half = sd.default_config(2 * inter, k)
        half.update(BLOCK_N=max(half["BLOCK_N"] // 2, sd.MIN_BLOCK_N), SPLIT_K=1)
        y = sd.skinny_dot_linear(x, w, config=half)
        assert torch.equal(out, skinny_linear.silu_mul(y[:, :inter], y[:, inter:]))


@pytest.mark.gpu
def test_in_a_cuda_graph_replays_equal_eager():
    """Split-K counters made before capture; every replay gives the eager bits (split order)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x, w, b = make(7, 16, 2048, 8192, torch.bfloat16, "cuda", bias=True)
    eager = sd.skinny_dot_linear(x, w, b)
    out = torch.empty_like(eager)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sd.skinny_dot_linear(x, w, b, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sd.skinny_dot_linear(x, w, b, out=out)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
