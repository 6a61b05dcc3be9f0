"""HF's RMSNorm (after a residual add) folded into the skinny GEMV
(`skinny_linear.skinny_rms_norm_linear`), the standalone norm kernel (`attngraph.rms_norm`) and
the ops over both (`linear_ops.rms_norm_linear`, `add_rms_norm_linear`).

References are HF's own `LlamaRMSNorm` (op for op) and fp64 products of its output. The
kernel's row statistics sum in another order than torch's, so a normed element may round one
ulp apart: the products get room for that (`norm_slack`); the residual sum ``h`` must be
bit-equal. Outputs start as NaN (`poison_empty`), so unwritten elements show up.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

pytest.importorskip("triton")

from attngraph import linear_ops  # noqa: E402
from attngraph import rms_norm  # noqa: E402
from attngraph import skinny_dot as sd  # noqa: E402
from attngraph import skinny_linear as sl  # noqa: E402
from attngraph.errors import InputError  # noqa: E402

from .test_skinny_linear import (  # noqa: E402,F401
    DTYPES,
    ROUND,
    _padded_step,
    _poison_empty,
    assert_close_to_reference,
    config,
    device,
    kernel_ops,
    launches,
    rand,
)


def hf_norm(h: torch.Tensor, nw: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm with weight ``nw`` applied to ``h``."""
    mod = LlamaRMSNorm(h.shape[-1], eps=eps).to(device=h.device, dtype=h.dtype)
    with torch.no_grad():
        mod.weight.copy_(nw)
        return mod(h)


def norm_slack(normed: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Room for normed elements one ulp apart (two roundings) between torch and the kernel."""
    return 2 * ROUND[normed.dtype] * (normed.double().abs() @ w.double().abs().T)


def make_norm(seed: int, m: int, n: int, k: int, dtype, device, *, bias: bool = False, row_pad: int = 0):
    """``x, residual: [m, k]`` (rows ``k + row_pad`` apart), ``nw: [k]``, ``w: [n, k]``, ``b``."""
    gen = torch.Generator().manual_seed(seed)
    x = rand(gen, m, k + row_pad, dtype=dtype, device=device, scale=2.0)[:, :k]
    r = rand(gen, m, k + row_pad, dtype=dtype, device=device)[:, :k]
    nw = rand(gen, k, dtype=dtype, device=device) + 1.0
    w = rand(gen, n, k, dtype=dtype, device=device, scale=k**-0.5)
    b = rand(gen, n, dtype=dtype, device=device) if bias else None
    return x, r, nw, w, b


# ----------------------------------------------------------------------------- the GEMV launcher
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add_norm"])
def test_norm_linear_matches_hf(device, dtype, m, residual):
    """N and K tails (37 x 100), strided rows, bias; ``h`` bit-equal to torch's addition."""
    x, r, nw, w, b = make_norm(m * 5 + residual, m, 37, 100, dtype, device, bias=True, row_pad=9 if m % 2 else 0)
    eps = 1e-5
    h_want = x + r if residual else x
    normed = hf_norm(h_want, nw, eps)
    if residual:
        h = torch.empty(m, 100, dtype=dtype, device=device)
        y = sl.skinny_rms_norm_linear(x, nw, eps, w, b, residual=r, h_out=h)
        assert torch.equal(h, h_want)
    else:
        y = sl.skinny_rms_norm_linear(x, nw, eps, w, b)
    assert_close_to_reference(y, normed, w, b, norm_slack(normed, w))


@pytest.mark.parametrize(
    "cfg", [config(4, 32), config(16, 64, 4), config(8, 32, 2, 2, split=2), config(4, 32, split=4)],
    ids=lambda c: "n{BLOCK_N}-k{BLOCK_K}-split{SPLIT_K}".format(**c),
)
def test_norm_linear_configs(device, cfg):
    """Several K chunks per program (the statistics loop too), K tails, split K: ``h`` is
    written once, whole, by one program."""
    x, r, nw, w, b = make_norm(cfg["BLOCK_N"] + cfg["SPLIT_K"], 3, 41, 100, torch.bfloat16, device)
    h = torch.empty(3, 100, dtype=torch.bfloat16, device=device)
    y = sl.skinny_rms_norm_linear(x, nw, 1e-6, w, residual=r, h_out=h, config=cfg)
    assert torch.equal(h, x + r)
    normed = hf_norm(x + r, nw, 1e-6)
    assert_close_to_reference(y, normed, w, None, norm_slack(normed, w))


def test_norm_rounds_like_hf(device):
    """With an identity weight the GEMV's output is its normed input: HF's normed row, all
    but a few elements bit-equal (the statistics' summation order aside)."""
    gen = torch.Generator().manual_seed(3)
    x = rand(gen, 2, 64, dtype=torch.bfloat16, device=device, scale=3.0)
    nw = rand(gen, 64, dtype=torch.bfloat16, device=device) + 1.0
    eye = torch.eye(64, dtype=torch.bfloat16, device=device)
    y = sl.skinny_rms_norm_linear(x, nw, 1e-6, eye)
    want = hf_norm(x, nw, 1e-6)
    assert (y != want).float().mean().item() < 0.05
    assert ((y.float() - want.float()).abs() <= 2 * ROUND[torch.bfloat16] * want.float().abs()).all()


MEASURED = [(table, key) for table in ("TUNED", "TUNED_NORM", "TUNED_SILU_MUL") for key in getattr(sl, table)]


@pytest.mark.parametrize("table, key", MEASURED, ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v)))
def test_every_measured_config_runs_at_its_shape(device, table, key):
    """Each measured tile (`skinny_linear.TUNED`, `TUNED_NORM`, `TUNED_SILU_MUL`), as the ops
    pick it, at its own row count and K; N cut to two column blocks and a tail (the tile does
    not depend on N past that). The norm's residual sum must be bit-equal."""
    rows, n_full, k = key
    n = 2 * getattr(sl, table)[key]["BLOCK_N"] + 3
    dtype = torch.bfloat16
    if table == "TUNED_SILU_MUL":
        cfg = sl.default_config(rows, n_full, k, silu_mul=True)
        gen = torch.Generator().manual_seed(rows + k)
        a, b = (rand(gen, rows, k, dtype=dtype, device=device, scale=2.0) for _ in range(2))
        w = rand(gen, n, k, dtype=dtype, device=device, scale=k**-0.5)
        product = linear_ops.silu_mul(a, b)
        assert_close_to_reference(sl.skinny_silu_mul_linear(a, b, w, config=cfg), product, w, None)
    elif table == "TUNED_NORM":
        cfg = sl.default_config(rows, n_full, k, norm=True)
        x, r, nw, w, bias = make_norm(rows + k, rows, n, k, dtype, device, bias=True)
        h = torch.empty(rows, k, dtype=dtype, device=device)
        y = sl.skinny_rms_norm_linear(x, nw, 1e-5, w, bias, residual=r, h_out=h, config=cfg)
        assert torch.equal(h, x + r)
        normed = hf_norm(x + r, nw, 1e-5)
        assert_close_to_reference(y, normed, w, bias, norm_slack(normed, w))
    else:
        cfg = sl.default_config(rows, n_full, k)
        x, _, _, w, bias = make_norm(rows + k, rows, n, k, dtype, device, bias=True)
        assert_close_to_reference(sl.skinny_linear(x, w, bias, config=cfg), x, w, bias)
    assert cfg == getattr(sl, table)[key]


def test_norm_launcher_refusals(device):
    x, r, nw, w, _ = make_norm(4, 2, 8, 16, torch.bfloat16, device)
    with pytest.raises(InputError, match="residual must match"):
        sl.skinny_rms_norm_linear(x, nw, 1e-6, w, residual=r[:1])
    with pytest.raises(InputError, match="norm_weight must be"):
        sl.skinny_rms_norm_linear(x, nw[:8], 1e-6, w)
    with pytest.raises(InputError, match="h_out is written only"):
        sl.skinny_rms_norm_linear(x, nw, 1e-6, w, h_out=torch.empty_like(x))
    with pytest.raises(InputError, match="weight must be"):
        sl.skinny_rms_norm_linear(x, nw, 1e-6, w[:, :8])


# ----------------------------------------------------------------------------- the tensor-core launcher
def dot_config(bn: int, bk: int, split: int = 1) -> dict:
    return dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=4, num_stages=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add_norm"])
def test_dot_norm_linear_matches_hf(device, dtype, m, residual):
    """The norm folded into the tensor-core kernel: N and K tails (37 x 100 over 16 x 32
    tiles), strided rows, bias; ``h`` bit-equal to torch's addition, written once."""
    x, r, nw, w, b = make_norm(m * 3 + residual, m, 37, 100, dtype, device, bias=True, row_pad=7 if m % 2 else 0)
    eps = 1e-5
    h_want = x + r if residual else x
    normed = hf_norm(h_want, nw, eps)
    if residual:
        h = torch.empty(m, 100, dtype=dtype, device=device)
        y = sd.skinny_dot_rms_norm_linear(x, nw, eps, w, b, residual=r, h_out=h, config=dot_config(16, 32))
        assert torch.equal(h, h_want)
    else:
        y = sd.skinny_dot_rms_norm_linear(x, nw, eps, w, b, config=dot_config(16, 32))
    assert_close_to_reference(y, normed, w, b, norm_slack(normed, w))


@pytest.mark.parametrize("cfg", [dot_config(16, 32, split=2), dot_config(32, 16, split=4), dot_config(16, 64, split=3)],
                         ids=lambda c: "n{BLOCK_N}-k{BLOCK_K}-split{SPLIT_K}".format(**c))  # fmt: skip
@pytest.mark.parametrize("k", [96, 100])
def test_dot_norm_linear_split_k(device, cfg, k):
    """Split K with K even and cut: every split reads all rows for the statistics, one
    program writes ``h``; the counters end at zero."""
    x, r, nw, w, _ = make_norm(k + cfg["SPLIT_K"], 5, 70, k, torch.bfloat16, device)
    h = torch.empty(5, k, dtype=torch.bfloat16, device=device)
    y = sd.skinny_dot_rms_norm_linear(x, nw, 1e-6, w, residual=r, h_out=h, config=cfg)
    assert torch.equal(h, x + r)
    normed = hf_norm(x + r, nw, 1e-6)
    assert_close_to_reference(y, normed, w, None, norm_slack(normed, w))
    counters = sl._COUNTERS._by_device.get(x.device)
    assert counters is None or int(counters.abs().sum()) == 0


def test_dot_norm_linear_equals_norm_then_dot(device):
    """The fold's normed operand is the standalone norm kernel's, bit for bit: the same
    products as the norm's own launch followed by the plain tensor-core kernel."""
    x, r, nw, w, b = make_norm(15, 6, 48, 128, torch.bfloat16, device, bias=True)
    folded = sd.skinny_dot_rms_norm_linear(x, nw, 1e-6, w, b, residual=r, config=dot_config(16, 32, split=2))
    normed, _ = rms_norm.add_rms_norm(x, nw, 1e-6, r)
    assert torch.equal(folded, sd.skinny_dot_linear(normed, w, b, config=dot_config(16, 32, split=2)))


def _sum_square_parts(x: torch.Tensor, parts: int) -> torch.Tensor:
    """``[parts, M]`` fp32 sums of ``x``'s squares over consecutive, uneven column ranges (a
    producer's column blocks; the last range may be empty)."""
    cuts = torch.linspace(0, x.shape[1] + 5, parts + 1).long().clamp(max=x.shape[1]).tolist()
    return torch.stack([x[:, a:b].float().pow(2).sum(1) for a, b in zip(cuts, cuts[1:])]).contiguous()


@pytest.mark.parametrize("parts", [1, 5, 32])
@pytest.mark.parametrize("m", [3, 16])
@pytest.mark.parametrize("split", [1, 2])
def test_dot_norm_linear_from_sum_square_parts(device, parts, m, split):
    """The rows' statistics given as partial sums of squares (no pass over ``x``): the products
    of HF's RMSNorm as with the pass, and the sums are read (wrong sums change the output)."""
    x, _, nw, w, b = make_norm(parts + m + split, m, 37, 100, torch.bfloat16, device, bias=True)
    eps = 1e-5
    ss = _sum_square_parts(x, parts)
    cfg = dot_config(16, 32, split=split)
    y = sd.skinny_dot_rms_norm_linear(x, nw, eps, w, b, config=cfg, sum_squares=ss)
    normed = hf_norm(x, nw, eps)
    assert_close_to_reference(y, normed, w, b, norm_slack(normed, w))
    halved = sd.skinny_dot_rms_norm_linear(x, nw, eps, w, config=cfg, sum_squares=ss * 4.0)  # rstd halved
    assert_close_to_reference(halved, normed * 0.5, w, None, norm_slack(normed, w))


def test_dot_norm_linear_sum_square_parts_refusals(device):
    x, r, nw, w, _ = make_norm(17, 3, 32, 64, torch.bfloat16, device)
    ss = _sum_square_parts(x, 4)
    with pytest.raises(InputError, match="add the residual first"):
        sd.skinny_dot_rms_norm_linear(x, nw, 1e-6, w, residual=r, sum_squares=ss)
    for bad in (ss.double(), ss[:, :2], ss.t(), ss[:0], torch.zeros(sd.MAX_SUM_SQUARE_PARTS + 1, 3, device=device)):
        with pytest.raises(InputError, match="sum_squares must be a float32"):
            sd.skinny_dot_rms_norm_linear(x, nw, 1e-6, w, sum_squares=bad)


def test_dot_norm_launcher_refusals(device):
    x, r, nw, w, _ = make_norm(16, 3, 32, 64, torch.bfloat16, device)
    with pytest.raises(InputError, match="residual must match"):
        sd.skinny_dot_rms_norm_linear(x, nw, 1e-6, w, residual=r[:1])
    with pytest.raises(InputError, match="norm_weight must be"):
        sd.skinny_dot_rms_norm_linear(x, nw[:8], 1e-6, w)
    with pytest.raises(InputError, match="h_out is written only"):
        sd.skinny_dot_rms_norm_linear(x, nw, 1e-6, w, h_out=torch.empty_like(x))
    with pytest.raises(InputError, match="h_out must be"):
        sd.skinny_dot_rms_norm_linear(x, nw, 1e-6, w, residual=r, h_out=torch.empty(3, 8, dtype=torch.bfloat16, device=device))
    with pytest.raises(InputError, match="bias must be"):
        sd.skinny_dot_rms_norm_linear(x, nw, 1e-6, w, torch.zeros(31, dtype=torch.bfloat16, device=device))
    with pytest.raises(InputError, match="bfloat16 or float16"):
        sd.skinny_dot_rms_norm_linear(x.float(), nw.float(), 1e-6, w.float())


# ----------------------------------------------------------------------------- the standalone norm
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add_norm"])
def test_standalone_norm_matches_hf(device, dtype, residual):
    x, r, nw, _, _ = make_norm(7 + residual, 5, 1, 300, dtype, device, row_pad=4)
    y, h = rms_norm.add_rms_norm(x, nw, 1e-6, r if residual else None)
    h_want = x + r if residual else x
    assert (h is None) == (not residual) and (h is None or torch.equal(h, h_want))
    want = hf_norm(h_want, nw, 1e-6)
    assert not y.isnan().any()
    assert ((y.double() - want.double()).abs() <= 2 * ROUND[dtype] * want.double().abs() + 1e-30).all()


def test_standalone_norm_refusals(device):
    x, r, nw, _, _ = make_norm(8, 2, 1, 16, torch.bfloat16, device)
    with pytest.raises(InputError, match="norm_weight must be"):
        rms_norm.add_rms_norm(x, nw.float(), 1e-6)
    with pytest.raises(InputError, match="x \\(and residual\\)"):
        rms_norm.add_rms_norm(x, nw, 1e-6, r[:, :8])
    with pytest.raises(InputError, match="bfloat16, float16 or float32"):
        rms_norm.add_rms_norm(x.to(torch.int32), nw.to(torch.int32), 1e-6)
    with pytest.raises(InputError, match="at most"):
        big = torch.zeros(1, rms_norm.MAX_K + 1, dtype=torch.bfloat16, device=device)
        rms_norm.add_rms_norm(big, torch.ones(rms_norm.MAX_K + 1, dtype=torch.bfloat16, device=device), 1e-6)


def test_standalone_norm_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setattr(rms_norm, "interpreting", lambda: False)
    x = torch.randn(2, 16)
    with pytest.raises(InputError, match="needs a CUDA device"):
        rms_norm.add_rms_norm(x, torch.ones(16), 1e-6)


# ----------------------------------------------------------------------------- the ops
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add_norm"])
def test_ops_run_the_folded_kernel(kernel_ops, launches, residual):
    device = kernel_ops
    x, r, nw, w, b = make_norm(9, 2, 37, 100, torch.bfloat16, device, bias=True)
    x3, r3 = x.unsqueeze(0), r.unsqueeze(0)  # [1, N, K]: a ragged step's rows
    if residual:
        y, h = torch.ops.attngraph.add_rms_norm_linear(x3, r3, nw, 1e-6, w, b)
        want_y = sl.skinny_rms_norm_linear(x, nw, 1e-6, w, b, residual=r)
        assert torch.equal(h[0], x + r)
    else:
        y = torch.ops.attngraph.rms_norm_linear(x3, nw, 1e-6, w, b)
        want_y = sl.skinny_rms_norm_linear(x, nw, 1e-6, w, b)
    assert len(launches) == 2 and y.shape == (1, 2, 37) and torch.equal(y[0], want_y)


@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add_norm"])
def test_ops_past_the_kernel_run_one_norm_then_cublas(kernel_ops, launches, monkeypatch, residual):
    """Rows past the GEMV's limit: the standalone norm kernel, then ``F.linear``."""
    device = kernel_ops
    monkeypatch.setattr(linear_ops, "KERNEL_MAX_ROWS", 2)
    norms = []
    standalone = rms_norm.add_rms_norm
    monkeypatch.setattr(rms_norm, "add_rms_norm", lambda *a: norms.append(1) or standalone(*a))
    x, r, nw, w, b = make_norm(10, 5, 37, 100, torch.bfloat16, device, bias=True)
    if residual:
        y, h = torch.ops.attngraph.add_rms_norm_linear(x, r, nw, 1e-6, w, b)
        assert torch.equal(h, x + r)
    else:
        y = torch.ops.attngraph.rms_norm_linear(x, nw, 1e-6, w, b)
    normed, _ = standalone(x, nw, 1e-6, r if residual else None)
    assert not launches and norms == [1]
    assert torch.equal(y, F.linear(normed, w, b))


@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add_norm"])
def test_ops_fold_the_norm_into_tensor_cores_where_asked(kernel_ops, launches, monkeypatch, residual):
    """`DOT_FOLD_NORM`: rows on tensor cores take the norm in the kernel's loads (no norm
    launch); with `DOT_MIN_ROWS` at 1, so does one row of a weight the GEMV declines."""
    device = kernel_ops
    monkeypatch.setattr(linear_ops, "KERNEL_MAX_ROWS", 2)
    monkeypatch.setattr(linear_ops, "DOT_FOLD_NORM", True)
    monkeypatch.setattr(rms_norm, "add_rms_norm", lambda *a: pytest.fail("the norm ran its own launch"))
    dots = []
    launch = sd._launch
    monkeypatch.setattr(sd, "_launch", lambda *a, **kw: dots.append(kw.get("norm_weight") is not None) or launch(*a, **kw))
    for m, dot_min, one_row_limit in ((5, 3, linear_ops.KERNEL_MAX_WEIGHT_ONE_ROW), (1, 1, 0)):
        monkeypatch.setattr(linear_ops, "DOT_MIN_ROWS", dot_min)
        monkeypatch.setattr(linear_ops, "KERNEL_MAX_WEIGHT_ONE_ROW", one_row_limit)  # 0: the GEMV declines one row
        monkeypatch.setattr(linear_ops, "KERNEL_MIN_HEAD_RATIO", 1 << 20)
        x, r, nw, w, b = make_norm(20 + m, m, 37, 100, torch.bfloat16, device, bias=True)
        if residual:
            y, h = torch.ops.attngraph.add_rms_norm_linear(x, r, nw, 1e-6, w, b)
            assert torch.equal(h, x + r)
            want = sd.skinny_dot_rms_norm_linear(x, nw, 1e-6, w, b, residual=r)
        else:
            y = torch.ops.attngraph.rms_norm_linear(x, nw, 1e-6, w, b)
            want = sd.skinny_dot_rms_norm_linear(x, nw, 1e-6, w, b)
        assert torch.equal(y, want)
    assert not launches and dots == [True] * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ops_on_the_torch_path_equal_hf(dtype):
    """No kernels (the CPU without the interpreter): HF's norm op for op, then F.linear: the
    values of the graph before the fold, bit for bit."""
    x, r, nw, w, b = make_norm(11, 3, 37, 100, dtype, "cpu", bias=True)
    y, h = linear_ops.add_rms_norm_linear_impl(x, r, nw, 1e-6, w, b)
    assert torch.equal(h, x + r)
    assert torch.equal(y, F.linear(hf_norm(x + r, nw, 1e-6), w, b))
    assert torch.equal(linear_ops.rms_norm_linear_impl(x, nw, 1e-6, w, b), F.linear(hf_norm(x, nw, 1e-6), w, b))


def test_padded_step_computes_only_its_real_rows(kernel_ops, launches):
    """A step of one real token padded to two: the real row of y and h equal the unpadded
    result exactly; the padding row of both is left unwritten (NaN)."""
    device = kernel_ops
    x, r, nw, w, _ = make_norm(12, 2, 37, 100, torch.bfloat16, device)
    with _padded_step(1, 1):
        y, h = torch.ops.attngraph.add_rms_norm_linear(x[None], r[None], nw, 1e-6, w, None, linear_ops.TOKEN_ROWS)
    want = sl.skinny_rms_norm_linear(x[:1], nw, 1e-6, w, residual=r[:1])
    assert torch.equal(y[0, :1], want) and torch.equal(h[0, :1], x[:1] + r[:1])
    assert y[0, 1:].isnan().all() and h[0, 1:].isnan().all()


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_opcheck(kernel_ops, monkeypatch, path):
    device = kernel_ops
    if path == "torch":
        monkeypatch.setattr(linear_ops, "_use_kernel", lambda *args: False)
    x, r, nw, w, b = make_norm(13, 3, 40, 64, torch.bfloat16, device, bias=True)
    torch.library.opcheck(torch.ops.attngraph.rms_norm_linear.default, (x[None], nw, 1e-6, w, b))
    torch.library.opcheck(torch.ops.attngraph.add_rms_norm_linear.default, (x, r, nw, 1e-6, w, None))
    torch.library.opcheck(torch.ops.attngraph.add_rms_norm_linear.default, (x[None], r[None], nw, 1e-5, w, b, linear_ops.TOKEN_ROWS))


def test_op_refusals():
    x, r, nw, w, _ = make_norm(14, 2, 8, 16, torch.float32, "cpu")
    with pytest.raises(InputError, match="residual must match"):
        torch.ops.attngraph.add_rms_norm_linear(x, r[:1], nw, 1e-6, w)
    with pytest.raises(InputError, match="norm_weight must be"):
        torch.ops.attngraph.rms_norm_linear(x, nw[:4], 1e-6, w)
    with pytest.raises(InputError, match="weight must be"):
        torch.ops.attngraph.rms_norm_linear(x, nw, 1e-6, w.T)


# ----------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
def test_gpu_projection_shapes(m):
    """The folded GEMV at the 1B / 8B q/k/v and gate/up shapes, against HF's norm in fp64."""
    for n, k in [(3072, 2048), (16384, 2048), (6144, 4096), (28672, 4096)]:
        x, r, nw, w, _ = make_norm(n + m, m, n, k, torch.bfloat16, "cuda")
        h = torch.empty_like(x)
        y = sl.skinny_rms_norm_linear(x, nw, 1e-5, w, residual=r, h_out=h)
        assert torch.equal(h, x + r)
        normed = hf_norm(x + r, nw, 1e-5)
        assert_close_to_reference(y, normed, w, None, norm_slack(normed, w))
