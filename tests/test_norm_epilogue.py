"""A projection with the residual add and HF's RMSNorm after it in its epilogue
(`passes.fold_norm_epilogue`'s target): the GEMV's ``NORM_OUT`` form
(`skinny_linear.skinny_linear_add_rms_norm`) and the op over it
(`torch.ops.attngraph.linear_add_rms_norm`).

The reference is the pair of launches it replaces: the same GEMV writing the product, then
`attngraph.rms_norm.add_rms_norm` (the norm kernel the op ran before) or, on the op's torch
path, ``F.linear`` and HF's ops. Bit-equal on the CPU, where the kernels run in Triton's
interpreter; on the GPU within one bf16 ulp of the norm (the statistics' sum may be ordered
differently). Outputs start NaN (`poison_empty`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from attngraph import linear_ops  # noqa: E402
from attngraph import rms_norm  # noqa: E402
from attngraph import skinny_linear as sl  # noqa: E402
from attngraph.errors import InputError  # noqa: E402

from .test_skinny_linear import (  # noqa: E402,F401
    _poison_empty, config, device, kernel_ops, launches, rand, reverse_program_axis,
)

OP = torch.ops.attngraph.linear_add_rms_norm


def operands(seed: int, m: int, n: int, k: int, dtype, device, *, bias=False):
    gen = torch.Generator().manual_seed(seed)
    x = rand(gen, m, k, dtype=dtype, device=device, scale=2.0)
    w = rand(gen, n, k, dtype=dtype, device=device, scale=k**-0.5)
    b = rand(gen, n, dtype=dtype, device=device) if bias else None
    r = rand(gen, m, n, dtype=dtype, device=device, scale=3.0)
    nw = (torch.rand(n, generator=gen) + 0.5).to(dtype=dtype, device=device)
    return x, w, b, r, nw


def two_launches(x, w, b, r, nw, eps, cfg=None):
    """The reference: the product, then the standalone add + norm kernel."""
    y = sl.skinny_linear(x, w, b, config=cfg)
    return rms_norm.add_rms_norm(y, nw, eps, r)


def assert_same(got, want) -> None:
    for g, w in zip(got, want):
        assert not g.isnan().any(), "unwritten (NaN) outputs"
        if g.is_cuda:  # the statistics' sum in another order: rstd may differ in its last bits
            torch.testing.assert_close(g.float(), w.float(), rtol=2**-7, atol=1e-6)
        else:
            assert torch.equal(g, w)


@pytest.fixture
def programs_last_to_first(monkeypatch):
    """The interpreter runs each grid's programs with the column axis (the first) reversed."""
    reverse_program_axis(monkeypatch, 0)


# ----------------------------------------------------------------------------- the kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("cfg", [None, config(2, 32), config(8, 64, 2)], ids=["default", "n2-k32", "n8-k64"])
@pytest.mark.parametrize("m,bias", [(1, False), (2, True), (3, False)])
def test_epilogue_equals_the_two_launches(device, dtype, cfg, m, bias):
    """Widths that are and are not a power of two (the norm's block is masked), a bias, the
    rows of a padded ROWS (3 -> 4)."""
    for n, k in ((96, 64), (80, 48)):
        x, w, b, r, nw = operands(n + m + bias, m, n, k, dtype, device, bias=bias)
        got = sl.skinny_linear_add_rms_norm(x, w, b, r, nw, 1e-5, config=cfg)
        assert_same(got, two_launches(x, w, b, r, nw, 1e-5, cfg))


def test_the_last_program_is_whichever_counts_last(device, programs_last_to_first):
    """Programs run last to first: program 0 now counts last and normalizes the rows."""
    x, w, b, r, nw = operands(5, 2, 64, 32, torch.bfloat16, device, bias=True)
    got = sl.skinny_linear_add_rms_norm(x, w, b, r, nw, 1e-6, config=config(4, 32))
    assert_same(got, two_launches(x, w, b, r, nw, 1e-6, config(4, 32)))


def test_counter_back_at_zero_and_repeatable(device):
    """Each launch leaves the shared arrival counter at zero, so the next one normalizes too."""
    x, w, _, r, nw = operands(6, 1, 48, 32, torch.bfloat16, device)
    first = sl.skinny_linear_add_rms_norm(x, w, None, r, nw, 1e-6)
    assert int(sl._COUNTERS.get(x.device, 1)[0]) == 0
    again = sl.skinny_linear_add_rms_norm(x, w, None, r, nw, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_without_counters_two_launches_give_the_values(device, monkeypatch):
    """A capture that finds no counter made yet (`_SplitCounters.get` -> None) falls back to
    the product and the norm kernel, into the outputs it was given."""
    x, w, _, r, nw = operands(7, 2, 64, 32, torch.bfloat16, device)
    want = two_launches(x, w, None, r, nw, 1e-6)
    monkeypatch.setattr(sl._COUNTERS, "get", lambda device, blocks: None)
    out, h_out = torch.empty_like(r), torch.empty_like(r)
    got = sl.skinny_linear_add_rms_norm(x, w, None, r, nw, 1e-6, out=out, h_out=h_out)
    assert got[0] is out and got[1] is h_out
    assert_same(got, want)


def test_the_epilogue_refuses_bad_operands(device):
    x, w, b, r, nw = operands(8, 2, 32, 16, torch.bfloat16, device, bias=True)
    bad = [
        (dict(residual=r[:1]), r"residual must be a torch.bfloat16 \[2, 32\]"),
        (dict(residual=r.float()), "residual must be a torch.bfloat16"),
        (dict(norm_weight=nw[:16]), r"norm_weight must be a contiguous torch.bfloat16 \[32\]"),
        (dict(bias=b[:8]), "bias must be a contiguous"),
        (dict(x=x[:, :8]), r"weight must be \[N, 8\]"),
    ]
    base = dict(x=x, weight=w, bias=b, residual=r, norm_weight=nw)
    for change, match in bad:
        args = {**base, **change}
        with pytest.raises(InputError, match=match):
            sl.skinny_linear_add_rms_norm(args["x"], args["weight"], args["bias"], args["residual"], args["norm_weight"], 1e-6)
    wide = torch.zeros(rms_norm.MAX_K + 1, 16, dtype=torch.bfloat16, device=device)
    with pytest.raises(InputError, match="at most 16384"):
        sl.skinny_linear_add_rms_norm(x, wide, None, r, nw, 1e-6)


# ----------------------------------------------------------------------------- the op
@pytest.mark.parametrize("m", [1, 2, 5])
def test_op_on_every_path(kernel_ops, launches, monkeypatch, m):
    """1-2 rows: the GEMV alone (one launch); 5 rows (past the ops' GEMV limit, set to 2
    here): the `linear` op's product (on tensor cores), then the norm kernel."""
    monkeypatch.setattr(linear_ops, "KERNEL_MAX_ROWS", 2)
    x, w, b, r, nw = operands(20 + m, m, 64, 32, torch.bfloat16, kernel_ops, bias=True)
    normed, h = OP(x[None], w, b, r[None], nw, 1e-6)
    assert len(launches) == (1 if m <= 2 else 0)
    if m <= 2:
        want = two_launches(x, w, b, r, nw, 1e-6)
    else:
        want = rms_norm.add_rms_norm(torch.ops.attngraph.linear(x, w, b), nw, 1e-6, r)
    assert_same((normed[0], h[0]), want)


def test_op_torch_path_equals_hf_ops():
    """Without the kernels (the CPU's default): ``F.linear``, the addition, HF's RMSNorm."""
    x, w, b, r, nw = operands(30, 3, 40, 24, torch.float32, "cpu", bias=True)
    normed, h = OP(x, w, b, r, nw, 1e-6)
    want_h = F.linear(x, w, b) + r
    assert torch.equal(h, want_h)
    assert torch.equal(normed, linear_ops._rms_norm_torch(want_h, nw, 1e-6))


def test_op_refuses_bad_operands():
    x, w, b, r, nw = operands(31, 2, 40, 24, torch.float32, "cpu")
    with pytest.raises(InputError, match="residual must be"):
        OP(x, w, None, r[:, :8], nw, 1e-6)
    with pytest.raises(InputError, match="norm_weight must be"):
        OP(x, w, None, r, nw[:8], 1e-6)
    with pytest.raises(InputError, match="weight must be"):
        OP(x, w[:, :8], None, r, nw, 1e-6)


def test_opcheck(kernel_ops):
    x, w, b, r, nw = operands(32, 2, 48, 32, torch.bfloat16, kernel_ops, bias=True)
    torch.library.opcheck(OP, (x[None], w, b, r[None], nw, 1e-6))


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(2048, 2048), (4096, 4096)], ids=["1b-o", "8b-o"])
@pytest.mark.parametrize("m", [1, 2])
def test_output_projection_shapes_on_gpu_and_in_a_graph(n, k, m):
    """The output projections of Llama-3.2-1B / 3.1-8B: eagerly and replayed from a CUDA
    graph (fresh operands copied in before each replay), against the two launches."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda")
    x, w, b, r, nw = operands(n + m, m, n, k, torch.bfloat16, dev)
    assert_same(sl.skinny_linear_add_rms_norm(x, w, None, r, nw, 1e-5), two_launches(x, w, None, r, nw, 1e-5))
    sx, sr = x.clone(), r.clone()
    out, h_out = torch.full_like(r, float("nan")), torch.full_like(r, float("nan"))
    sl.skinny_linear_add_rms_norm(sx, w, None, sr, nw, 1e-5, out=out, h_out=h_out)  # warm: counters made
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sl.skinny_linear_add_rms_norm(sx, w, None, sr, nw, 1e-5, out=out, h_out=h_out)
    for seed in range(3):
        x2, _, _, r2, _ = operands(seed, m, n, k, torch.bfloat16, dev)
        sx.copy_(x2)
        sr.copy_(r2)
        out.fill_(float("nan"))
        h_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_same((out, h_out), two_launches(x2, w, None, r2, nw, 1e-5))
