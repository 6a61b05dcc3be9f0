"""The rotary embedding applied by a projection (`passes.fold_rope_linear`'s target): the GEMV
and the tensor-core kernel rotating their first columns in the epilogue (`skinny_linear`,
`skinny_dot`: ``rope_cos`` / ``rope_sin`` / ``rope_cols``), the in-place rotation of a
projection's columns (`rope.rope_columns_`, `rope_kernel.rope_inplace`) and the linear ops
that choose between them.

The reference of a rotated projection is the same projection unrotated (the kernel with the
same configuration, or the op's torch path), rotated by `rope.rope_reference`: the rotation
must change nothing else, and the rotated columns must be those values exactly (bit-equal on
the CPU; on the GPU the compiler may contract a product into an FMA: one ulp). Without CUDA the
kernels run in Triton's interpreter; outputs start NaN (`poison_empty`).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from attngraph import linear_ops  # noqa: E402
from attngraph import rope  # noqa: E402
from attngraph import skinny_linear as sl  # noqa: E402
from attngraph.errors import InputError  # noqa: E402

from .test_rope import rows  # noqa: E402
from .test_skinny_linear import _poison_empty, config, device, kernel_ops, launches, rand  # noqa: E402,F401


def rotated(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cols: int) -> torch.Tensor:
    """``y: [M, N]`` with its first ``cols`` columns (heads of ``D``) rotated by the reference."""
    m, d = y.shape[0], cos.shape[1]
    out = y.clone()
    out[:, :cols] = rope.rope_reference(y[:, :cols].reshape(m, cols // d, d), cos[:m], sin[:m]).reshape(m, cols)
    return out


def assert_rotation_of(got: torch.Tensor, plain: torch.Tensor, cos, sin, cols: int) -> None:
    assert not got.isnan().any(), "unwritten (NaN) outputs"
    want = rotated(plain, cos, sin, cols)
    assert torch.equal(got[:, cols:], plain[:, cols:]), "columns past rope_cols changed"
    if got.is_cuda:  # an FMA-contracted product may round one ulp apart
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)
    else:
        assert torch.equal(got, want)


def operands(seed: int, m: int, hq: int, hk: int, d: int, k: int, dtype, device, *, bias=False, cos_rows=None):
    gen = torch.Generator().manual_seed(seed)
    n = (hq + 2 * hk) * d  # q, k, v: the last heads stay unrotated
    x = rand(gen, m, k, dtype=dtype, device=device, scale=2.0)
    w = rand(gen, n, k, dtype=dtype, device=device, scale=k**-0.5)
    b = rand(gen, n, dtype=dtype, device=device) if bias else None
    positions = torch.randint(0, 4096, (cos_rows or m,), generator=gen)
    cos, sin = rows(positions, d, dtype, device)
    return x, w, b, cos, sin, (hq + hk) * d


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("cfg", [config(2, 32), config(4, 64, 1), config(8, 32, 2, 2), config(16, 32, 4), config(4, 32, split=2)],
                         ids=lambda c: "n{BLOCK_N}-k{BLOCK_K}-split{SPLIT_K}".format(**c))  # fmt: skip
@pytest.mark.parametrize("m,bias", [(1, False), (2, True), (5, False)])
def test_gemv_rotates_its_first_columns(device, dtype, cfg, m, bias):
    """Heads of 16, q (4 heads) and k (2) rotated, v (2) not; configurations whose column
    block is a quarter head to a whole one, split K; more cos rows than rows of x."""
    x, w, b, cos, sin, cols = operands(m * 7 + bias, m, 4, 2, 16, 96, dtype, device, bias=bias, cos_rows=m + 3)
    plain = sl.skinny_linear(x, w, b, config=cfg)
    got = sl.skinny_linear(x, w, b, config=cfg, rope_cos=cos, rope_sin=sin, rope_cols=cols)
    assert_rotation_of(got, plain, cos, sin, cols)


@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add_norm"])
@pytest.mark.parametrize("d", [32, 64])
def test_gemv_with_the_norm_folded_rotates_too(device, residual, d):
    """The fused q/k/v of a decode step: RMSNorm (after the residual add) in the loads, the
    rotation in the epilogue; the residual stream written as without it. A column block wider
    than a head's half pairs (BLOCK_N 16 over D 32 and 64)."""
    m = 2
    x, w, _, cos, sin, cols = operands(d + residual, m, 2, 1, d, 128, torch.bfloat16, device)
    gen = torch.Generator().manual_seed(3)
    nw = rand(gen, 128, dtype=torch.bfloat16, device=device) + 1.0
    res = rand(gen, m, 128, dtype=torch.bfloat16, device=device) if residual else None
    cfg = config(16, 64, 2)
    h_plain = torch.empty_like(x) if residual else None
    h_rot = torch.empty_like(x) if residual else None
    plain = sl.skinny_rms_norm_linear(x, nw, 1e-5, w, residual=res, h_out=h_plain, config=cfg)
    got = sl.skinny_rms_norm_linear(x, nw, 1e-5, w, residual=res, h_out=h_rot, config=cfg, rope_cos=cos, rope_sin=sin,
                                    rope_cols=cols)  # fmt: skip
    assert_rotation_of(got, plain, cos, sin, cols)
    if residual:
        assert torch.equal(h_rot, h_plain)


def test_a_column_block_wider_than_a_head_is_narrowed(device):
    """Heads of 4 under the heuristic's 16-column blocks: the launcher narrows the block so a
    program holds whole rotate-half pairs of one head."""
    x, w, _, cos, sin, cols = operands(5, 1, 8, 4, 4, 64, torch.bfloat16, device)
    plain = sl.skinny_linear(x, w)
    got = sl.skinny_linear(x, w, rope_cos=cos, rope_sin=sin, rope_cols=cols)
    assert_rotation_of(got, plain, cos, sin, cols)


def test_every_column_rotated(device):
    """``rope_cols = N`` (a projection of q alone)."""
    x, w, _, cos, sin, _ = operands(11, 2, 3, 0, 32, 64, torch.bfloat16, device)
    n = w.shape[0]
    got = sl.skinny_linear(x, w, rope_cos=cos, rope_sin=sin, rope_cols=n)
    assert_rotation_of(got, sl.skinny_linear(x, w), cos, sin, n)


@pytest.mark.parametrize("cfg", [None, dict(BLOCK_N=64, BLOCK_K=32, SPLIT_K=2, num_warps=4, num_stages=1)],
                         ids=["default", "split"])  # fmt: skip
@pytest.mark.parametrize("d,m", [(64, 3), (32, 16), (128, 5)])
def test_tensor_core_kernel_rotates_its_first_columns(device, cfg, d, m):
    """`skinny_dot` (3-16 rows): the same rotation on its transposed tile, with a column block
    narrowed to the head where the head is narrower; split K; with the norm folded too."""
    from attngraph import skinny_dot as sd

    x, w, b, cos, sin, cols = operands(d + m, m, 4, 2, d, 128, torch.bfloat16, device, bias=True)
    plain = sd.skinny_dot_linear(x, w, b, config=cfg)
    got = sd.skinny_dot_linear(x, w, b, config=cfg, rope_cos=cos, rope_sin=sin, rope_cols=cols)
    assert_rotation_of(got, plain, cos, sin, cols)
    gen = torch.Generator().manual_seed(m)
    nw = rand(gen, 128, dtype=torch.bfloat16, device=device) + 1.0
    plain = sd.skinny_dot_rms_norm_linear(x, nw, 1e-6, w, b, config=cfg)
    got = sd.skinny_dot_rms_norm_linear(x, nw, 1e-6, w, b, config=cfg, rope_cos=cos, rope_sin=sin, rope_cols=cols)
    assert_rotation_of(got, plain, cos, sin, cols)


def test_tensor_core_kernel_refuses_heads_it_cannot_pair(device, kernel_ops, launches):
    """Heads of 24 (pairs 12 apart) do not fit the tensor-core kernel's 16-column blocks: the
    launcher refuses; the op takes the kernel without the rotation, then rotates the columns."""
    from attngraph import skinny_dot as sd

    assert not sd.rope_fits(24) and sd.rope_fits(80) and sd.rope_fits(64)
    x, w, _, cos, sin, cols = operands(24, sl.MAX_ROWS + 1, 4, 2, 24, 64, torch.bfloat16, device)  # past the GEMV
    with pytest.raises(InputError, match="power-of-two factor"):
        sd.skinny_dot_linear(x, w, rope_cos=cos, rope_sin=sin, rope_cols=cols)
    got = torch.ops.attngraph.linear(x[None], w, None, 0, cos, sin, cols)[0]
    assert not launches
    assert_rotation_of(got, sd.skinny_dot_linear(x, w), cos, sin, cols)


def test_gemv_refuses_rotations_it_cannot_apply(device):
    x, w, _, cos, sin, cols = operands(0, 2, 2, 1, 16, 32, torch.bfloat16, device)
    bad = [
        (dict(rope_cos=cos, rope_cols=cols), "go together"),
        (dict(rope_cos=cos, rope_sin=sin, rope_cols=cols + 8), "multiple of the even head dim"),
        (dict(rope_cos=cos, rope_sin=sin, rope_cols=w.shape[0] + 16), "within the"),
        (dict(rope_cos=cos, rope_sin=sin, rope_cols=0), "positive multiple"),
        (dict(rope_cos=cos.float(), rope_sin=sin, rope_cols=cols), "rope_cos must be a torch.bfloat16"),
        (dict(rope_cos=cos[:1], rope_sin=sin[:1], rope_cols=cols), r"\[>= 2, D\]"),
        (dict(rope_cos=cos[:, :15], rope_sin=sin[:, :15], rope_cols=cols), "even head dim"),
        (dict(rope_cos=cos, rope_sin=sin[:, :8], rope_cols=cols), "the other's D"),
    ]
    for kwargs, match in bad:
        with pytest.raises(InputError, match=match):
            sl.skinny_linear(x, w, **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_columns_rotated_in_place(device, dtype):
    """`rope.rope_columns_` on a strided view of a projection's output: the view's values
    rotated, every other element untouched (one Triton launch on CUDA, torch on the CPU)."""
    gen = torch.Generator().manual_seed(1)
    y = rand(gen, 5, 9 * 16, dtype=dtype, device=device)
    cos, sin = rows(torch.arange(5) * 11, 16, dtype, device)
    want = rotated(y, cos, sin, 6 * 16)
    heads = y[:, : 6 * 16].unflatten(1, (6, 16))
    assert rope.rope_columns_(heads, cos, sin) is heads
    assert torch.equal(y, want) if not y.is_cuda else torch.testing.assert_close(y, want, rtol=2 ** -7, atol=1e-6) is None


def test_rope_inplace_kernel(device):
    """The in-place launch itself (the CPU takes it under Triton's interpreter)."""
    from attngraph.rope_kernel import rope_inplace

    gen = torch.Generator().manual_seed(2)
    y = rand(gen, 3, 7 * 32, dtype=torch.bfloat16, device=device)
    cos, sin = rows(torch.arange(3) + 100, 32, torch.bfloat16, device)
    want = rotated(y, cos, sin, 5 * 32)
    rope_inplace(y[:, : 5 * 32].unflatten(1, (5, 32)), cos, sin)
    assert torch.equal(y, want) if not y.is_cuda else torch.testing.assert_close(y, want, rtol=2 ** -7, atol=1e-6) is None
    with pytest.raises(ValueError, match="unit stride"):
        rope_inplace(y[:, :64].unflatten(1, (2, 32)).transpose(1, 2), cos, sin)


# ----------------------------------------------------------------------------- the ops
def op_operands(m: int, dtype, device):
    x, w, b, cos, sin, cols = operands(m, m, 4, 2, 16, 64, dtype, device, bias=True)
    gen = torch.Generator().manual_seed(m + 50)
    nw = rand(gen, 64, dtype=dtype, device=device) + 1.0
    res = rand(gen, m, 64, dtype=dtype, device=device)
    return x[None], res[None], nw, w, b, cos, sin, cols


@pytest.mark.parametrize("m", [1, 2, 9])
def test_ops_rotate_on_every_path(kernel_ops, launches, m):
    """`linear`, `rms_norm_linear` and `add_rms_norm_linear` with the rotation: on the GEMV for
    up to 8 rows here, past it on the tensor-core kernel (each in its epilogue; the norm of
    nine rows its own launch first): each the op without the rotation, rotated."""
    x, res, nw, w, b, cos, sin, cols = op_operands(m, torch.bfloat16, kernel_ops)
    rot = dict(rope_cos=cos, rope_sin=sin, rope_cols=cols)
    calls = [
        (torch.ops.attngraph.linear, (x, w, b)),
        (torch.ops.attngraph.rms_norm_linear, (x, nw, 1e-6, w, b)),
        (torch.ops.attngraph.add_rms_norm_linear, (x, res, nw, 1e-6, w, b)),
    ]
    for op, args in calls:
        plain = op(*args)
        launches.clear()
        got = op(*args, linear_ops.ANY_ROWS, **rot)
        assert len(launches) == (1 if m <= sl.MAX_ROWS else 0)
        if isinstance(plain, tuple):
            assert torch.equal(got[1], plain[1])
            plain, got = plain[0], got[0]
        assert_rotation_of(got[0], plain[0], cos, sin, cols)


def test_ops_torch_path_equals_the_reference():
    """Without the kernels (the CPU's default): the product, then `rope_columns_`."""
    x, res, nw, w, b, cos, sin, cols = op_operands(3, torch.float32, "cpu")
    got = torch.ops.attngraph.add_rms_norm_linear(x, res, nw, 1e-6, w, b, 0, cos, sin, cols)
    plain = torch.ops.attngraph.add_rms_norm_linear(x, res, nw, 1e-6, w, b)
    assert torch.equal(got[1], plain[1])
    assert_rotation_of(got[0][0], plain[0][0], cos, sin, cols)


def test_ops_refuse_bad_rotations():
    x, res, nw, w, b, cos, sin, cols = op_operands(2, torch.float32, "cpu")
    with pytest.raises(InputError, match="go together"):
        torch.ops.attngraph.linear(x, w, b, 0, cos, None, cols)
    with pytest.raises(InputError, match="multiple of the even head dim"):
        torch.ops.attngraph.rms_norm_linear(x, nw, 1e-6, w, b, 0, cos, sin, cols - 4)
    with pytest.raises(InputError, match="rows for 2 rows"):
        torch.ops.attngraph.linear(x, w, b, 0, cos[:1], sin[:1], cols)


def test_opcheck_with_the_rotation(kernel_ops):
    x, res, nw, w, b, cos, sin, cols = op_operands(2, torch.bfloat16, kernel_ops)
    torch.library.opcheck(torch.ops.attngraph.linear.default, (x, w, b, 0, cos, sin, cols))
    torch.library.opcheck(torch.ops.attngraph.add_rms_norm_linear.default, (x, res, nw, 1e-6, w, b, 0, cos, sin, cols))


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["1b", "8b"])
@pytest.mark.parametrize("m", [1, 2])
def test_gemv_rotation_at_llama_shapes_on_gpu(shape, m):
    """The fused q/k/v GEMVs of Llama-3.2-1B (32 + 8 + 8 heads of 64, K 2048) and
    Llama-3.1-8B (32 + 8 + 8 heads of 128, K 4096) with the residual add and the norm folded,
    at their tuned configurations and under PDL where the GPU has it: the unrotated GEMV's
    output, rotated; the residual stream unchanged."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    d, k = (64, 2048) if shape == "1b" else (128, 4096)
    x, w, _, cos, sin, cols = operands(m, m, 32, 8, d, k, torch.bfloat16, torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(m)
    res = rand(gen, m, k, dtype=torch.bfloat16, device="cuda")
    nw = rand(gen, k, dtype=torch.bfloat16, device="cuda") + 1.0
    h_plain, h_rot = torch.empty_like(x), torch.empty_like(x)
    plain = sl.skinny_rms_norm_linear(x, nw, 1e-5, w, residual=res, h_out=h_plain)
    got = sl.skinny_rms_norm_linear(x, nw, 1e-5, w, residual=res, h_out=h_rot, rope_cos=cos, rope_sin=sin, rope_cols=cols)
    torch.cuda.synchronize()
    assert_rotation_of(got, plain, cos, sin, cols)
    assert torch.equal(h_rot, h_plain)
