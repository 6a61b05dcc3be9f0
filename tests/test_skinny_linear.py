"""The skinny Triton GEMV (`attngraph.skinny_linear`) and the ops over it (`attngraph.linear_ops`).

Without CUDA the kernel runs in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py before Triton is imported) on small shapes; with CUDA the same tests run
natively, plus the ``gpu`` tests at the projection shapes of Llama-3.2-1B / 3.1-8B, CUDA-graph
capture and repeated split-K runs.

Every test draws fresh random inputs from its own seeded generator and runs with
``torch.utils.deterministic.fill_uninitialized_memory``, so each ``torch.empty`` (outputs,
split-K partials) starts as NaN: an output element the kernel fails to write shows up.
References are fp64 products of the same (rounded) inputs. The interpreter runs a grid's
programs one after another; the memory ordering of split-K between programs is exercised on
the GPU only (here the split axis also runs last to first: `splits_last_to_first`).
"""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from attngraph import linear_ops  # noqa: E402
from attngraph import skinny_linear as sl  # noqa: E402
from attngraph.errors import InputError  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(sl._skinny_linear_kernel, InterpretedFunction):
        # Imported before the variable was set: rebuild the kernel for the interpreter.
        importlib.reload(sl)

ROOT = Path(__file__).resolve().parents[1]
NAN = float("nan")
#: Relative rounding of an fp32 result to the output dtype (half an ulp, with margin).
ROUND = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10, torch.float32: 2.0**-22}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
#: The projections (N, K) of Llama-3.2-1B and Llama-3.1-8B (fused q/k/v, o, fused gate/up,
#: down, LM head): the shapes the heuristic is made for.
PROJECTIONS = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048),
               (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]  # fmt: skip


@pytest.fixture
def device() -> torch.device:
    """CUDA, or the CPU under Triton's interpreter (skipped where that cannot run)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not sl.interpreting():
        pytest.skip("needs CUDA or Triton's interpreter (TRITON_INTERPRET=1 before import; tests/conftest.py sets it)")
    problem = sl.interpreter_problem()
    if problem is not None:
        pytest.skip(problem)
    return torch.device("cpu")


@pytest.fixture
def kernel_ops(device, monkeypatch):
    """The ops take the kernel path on ``device`` (on the CPU: through the interpreter), for
    up to `skinny_linear.MAX_ROWS` rows (the ops' own limit is lower: where it was faster)."""
    monkeypatch.setattr(linear_ops, "CPU_INTERPRETER", True)
    monkeypatch.setattr(linear_ops, "KERNEL_MAX_ROWS", sl.MAX_ROWS)
    return device


@pytest.fixture(autouse=True)
def _poison_empty(poison_empty):
    """``torch.empty`` returns NaN-filled tensors for the duration of a test (conftest)."""


@pytest.fixture
def launches(monkeypatch):
    """Counts the kernel launches (`skinny_linear._launch` calls)."""
    calls = []
    launch = sl._launch

    def counting(*args, **kwargs):
        calls.append(args[5])  # the config argument
        return launch(*args, **kwargs)

    monkeypatch.setattr(sl, "_launch", counting)
    return calls


def reverse_program_axis(monkeypatch, axis: int):
    """The interpreter runs each grid's programs with ``axis`` (0-2) in reverse order."""
    if torch.cuda.is_available() or not sl.interpreting():
        pytest.skip("orders the programs of Triton's interpreter")
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    set_grid_idx = builder.set_grid_idx

    def reversed_idx(*idx):
        idx = list(idx)
        idx[axis] = builder.grid_dim[axis] - 1 - idx[axis]
        return set_grid_idx(*idx)

    monkeypatch.setattr(builder, "set_grid_idx", reversed_idx)


@pytest.fixture
def splits_last_to_first(monkeypatch):
    """The interpreter runs each grid's programs with the split axis (the second) reversed."""
    reverse_program_axis(monkeypatch, 1)
    return monkeypatch  # .undo(): programs in order again


# ----------------------------------------------------------------------------- helpers
def rand(gen: torch.Generator, *shape: int, dtype=torch.float32, device="cpu", scale: float = 1.0) -> torch.Tensor:
    """Normal samples drawn on ``gen``'s device, scaled, as ``dtype`` on ``device``."""
    return (torch.randn(*shape, generator=gen, device=gen.device) * scale).to(dtype=dtype, device=device)


def make(seed: int, m: int, n: int, k: int, dtype, device, *, bias: bool = False, row_pad: int = 0):
    """``x: [m, k]`` (rows ``k + row_pad`` apart), ``weight: [n, k]``, ``bias: [n]`` or None."""
    gen = torch.Generator().manual_seed(seed)
    x = rand(gen, m, k + row_pad, dtype=dtype, device=device)[:, :k]
    w = rand(gen, n, k, dtype=dtype, device=device, scale=k**-0.5)
    b = rand(gen, n, dtype=dtype, device=device) if bias else None
    return x, w, b


def assert_close_to_reference(y: torch.Tensor, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                              slack: torch.Tensor | None = None) -> None:  # fmt: skip
    """``y`` against ``h @ w^T + b`` in fp64: within the rounding of an fp32 result to ``y``'s
    dtype plus the worst-case error of an fp32 sum of K terms (``slack``: more, elementwise)."""
    assert y.shape == (h.shape[0], w.shape[0]) and y.dtype == h.dtype
    assert not y.isnan().any(), "unwritten (NaN) outputs"
    hd, wd = h.double(), w.double()
    ref = hd @ wd.T + (b.double() if b is not None else 0.0)
    scale = hd.abs() @ wd.abs().T + (b.double().abs() if b is not None else 0.0)
    bound = ROUND[y.dtype] * ref.abs() + (h.shape[1] + 2) * 2.0**-24 * scale + 1e-30
    if slack is not None:
        bound = bound + slack
    err = (y.double() - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {err.max().item():.3g} exceeds the bound (ratio {worst:.3g})"


def silu_mul_slack(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Room for ``silu(a) * b`` rounding one ulp apart between torch and the kernel."""
    return 2 * ROUND[h.dtype] * (h.double().abs() @ w.double().abs().T)


def config(bn: int, bk: int, warps: int = 2, stages: int = 1, split: int = 1) -> dict:
    return dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, SPLIT_K=split)


def heuristic_configs() -> list[dict]:
    """Every configuration `default_config` returns for small shapes and for the projections."""
    seen = {}
    shapes = [(n, k) for n in (1, 5, 37, 130, 300, 1100, 7000) for k in (1, 7, 64, 100, 700, 2048, 5000)]
    for m in range(1, sl.MAX_ROWS + 1):
        for n, k in shapes + PROJECTIONS:
            cfg = sl.default_config(m, n, k)
            seen.setdefault((sl.rows_padded(m), tuple(sorted(cfg.items()))), cfg)
    return [dict(rows=rows, **cfg) for (rows, _), cfg in seen.items()]


# ----------------------------------------------------------------------------- the launchers
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_skinny_linear_matches_reference(device, dtype, m, bias):
    """N and K tails (21 x 100), strided rows of x for odd row counts, the heuristic's config."""
    x, w, b = make(m * 10 + bias, m, 21, 100, dtype, device, bias=bias, row_pad=27 if m % 2 else 0)
    assert_close_to_reference(sl.skinny_linear(x, w, b), x, w, b)


@pytest.mark.parametrize(
    "cfg",
    [config(4, 32), config(16, 64, 4), config(2, 128, 1), config(8, 32, 2, 2, split=2), config(4, 32, split=4),
     config(32, 16, split=8), config(8, 16, 1, 3, split=16)],
    ids=lambda c: "n{BLOCK_N}-k{BLOCK_K}-w{num_warps}-s{num_stages}-split{SPLIT_K}".format(**c),
)
@pytest.mark.parametrize("m", [2, 5])
def test_configs_with_tails(device, cfg, m):
    """Explicit configs: several K chunks per program with a K tail (100 = 3 x 32 + 4), N tails,
    split-K with the last split shorter (and splits beyond K's chunks dropped)."""
    x, w, b = make(m + cfg["BLOCK_N"] * 7 + cfg["SPLIT_K"], m, 37, 100, torch.bfloat16, device, bias=True, row_pad=3)
    assert_close_to_reference(sl.skinny_linear(x, w, b, config=cfg), x, w, b)


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("split", [1, 2, 4], ids=lambda s: f"split{s}")
def test_split_k_matches_reference_and_leaves_counters_zero(device, m, split):
    x, w, b = make(m * 3 + split, m, 37, 300, torch.float32, device, bias=True)
    y = sl.skinny_linear(x, w, b, config=config(8, 64, split=split))
    assert_close_to_reference(y, x, w, b)
    counters = sl._COUNTERS._by_device.get(x.device)
    assert split == 1 or int(counters.abs().sum()) == 0


def test_split_k_same_bits_whichever_split_sums(device, splits_last_to_first):
    """With the splits run last to first, split 0's program counts last and sums: the result is
    bit-identical (partials summed in split order) to the forward run."""
    x, w, b = make(3, 5, 37, 300, torch.float32, device, bias=True)
    cfg = config(8, 32, split=4)
    backward = sl.skinny_linear(x, w, b, config=cfg)
    splits_last_to_first.undo()
    forward = sl.skinny_linear(x, w, b, config=cfg)
    assert torch.equal(backward, forward)
    assert_close_to_reference(forward, x, w, b)


def test_split_k_sums_in_split_order(device):
    """The split-K result is the fp32 sum of the splits' partials in split order, rounded once."""
    x, w, _ = make(4, 2, 37, 256, torch.float32, device)
    parts = [sl.skinny_linear(x[:, s * 64:(s + 1) * 64], w[:, s * 64:(s + 1) * 64].contiguous(), config=config(16, 64))
             for s in range(4)]  # fmt: skip
    want = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    assert torch.equal(sl.skinny_linear(x, w, config=config(16, 64, split=4)), want)


@pytest.mark.parametrize("m", [1, 4, 7])
def test_out_buffer_fully_overwritten(device, m):
    """An ``out=`` buffer full of NaN, its rows strided: every element of ``[m, n]`` written,
    the columns past n left alone."""
    x, w, b = make(m, m, 37, 100, torch.float16, device, bias=True)
    buf = torch.full((m, 37 + 5), NAN, dtype=torch.float16, device=device)
    out = buf[:, :37]
    assert sl.skinny_linear(x, w, b, out=out) is out
    assert_close_to_reference(out, x, w, b)
    assert buf[:, 37:].isnan().all()
    gu = rand(torch.Generator().manual_seed(m), m, 200, dtype=torch.float16, device=device)
    out.fill_(NAN)
    sl.skinny_silu_mul_linear(gu[:, :100], gu[:, 100:], w, out=out, config=config(8, 64, split=2))
    h = linear_ops.silu_mul(gu[:, :100], gu[:, 100:])
    assert_close_to_reference(out, h, w, None, silu_mul_slack(h, w))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("split", [1, 2], ids=lambda s: f"split{s}")
def test_silu_mul_linear_strided_halves(device, dtype, m, split):
    """``a``, ``b``: the two halves of one fused gate/up output (rows 2I apart)."""
    gen = torch.Generator().manual_seed(m * 7 + split)
    inter, n = 100, 37
    gu = rand(gen, m, 2 * inter, dtype=dtype, device=device, scale=2.0)
    w = rand(gen, n, inter, dtype=dtype, device=device, scale=inter**-0.5)
    a, b = gu[:, :inter], gu[:, inter:]
    y = sl.skinny_silu_mul_linear(a, b, w, config=config(8, 32, split=split))
    h = linear_ops.silu_mul(a, b)  # silu(a) * b in fp32, rounded once
    assert_close_to_reference(y, h, w, None, silu_mul_slack(h, w))
    assert torch.equal(y, sl.skinny_silu_mul_linear(a.contiguous(), b.contiguous(), w, config=config(8, 32, split=split)))


def test_silu_mul_rounds_the_product_once(device):
    """The product is rounded to bf16 before the weight multiplies it: with a one-hot weight
    column the output is exactly ``bf16(silu(a) * b)`` (eager's two roundings differ somewhere)."""
    gen = torch.Generator().manual_seed(11)
    a = rand(gen, 8, 64, dtype=torch.bfloat16, device=device, scale=3.0)
    b = rand(gen, 8, 64, dtype=torch.bfloat16, device=device, scale=3.0)
    w = torch.eye(64, dtype=torch.bfloat16, device=device)  # y = h exactly
    y = sl.skinny_silu_mul_linear(a, b, w)
    once = linear_ops.silu_mul(a, b)
    differs = (once != F.silu(a) * b).sum().item()
    assert differs > 0, "the inputs should tell one rounding from two"
    mismatch = (y != once).float().mean().item()
    assert mismatch < 0.01, f"{mismatch:.2%} of silu(a) * b not rounded once"  # fp32 silu ulps aside


def test_every_heuristic_config_runs(device):
    """Each configuration the heuristic returns (small shapes and the projections' alike), on a
    small shape with tails: 19 x 300 (split-K: K a little short of SPLIT_K chunks) at the
    config's row count (M = rows - 1 past two rows)."""
    cfgs = heuristic_configs()
    assert len(cfgs) >= 8
    for i, c in enumerate(cfgs):
        rows = c.pop("rows")
        m = rows - 1 if rows > 2 else rows
        k = 300 if c["SPLIT_K"] == 1 else c["SPLIT_K"] * c["BLOCK_K"] - 37
        x, w, b = make(100 + i, m, 19, k, torch.bfloat16, device, bias=i % 2 == 0)
        assert_close_to_reference(sl.skinny_linear(x, w, b, config=c), x, w, b)


def test_default_config_properties(monkeypatch):
    """The heuristic (measured entries aside): powers of two; at most 64 fp32 accumulators and
    at least one 16-byte weight vector per thread; the projections get >= 3 column blocks per
    SM (or 2-row blocks); never a split."""
    monkeypatch.setattr(sl, "TUNED", {})
    monkeypatch.setattr(sl, "TUNED_SILU_MUL", {})
    for m in range(1, sl.MAX_ROWS + 1):
        rows = sl.rows_padded(m)
        assert rows in (1, 2, 4, 8) and rows >= m
        for n, k in PROJECTIONS + [(37, 100), (1, 1), (130, 4096), (5, 1 << 16), (7000, 7)]:
            c = sl.default_config(m, n, k)
            assert set(c) == {"BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "SPLIT_K"}
            assert all(c[key] & (c[key] - 1) == 0 for key in ("BLOCK_N", "BLOCK_K", "num_warps", "SPLIT_K"))
            threads = 32 * c["num_warps"]
            assert rows * c["BLOCK_N"] * c["BLOCK_K"] <= 64 * threads
            assert c["BLOCK_N"] * c["BLOCK_K"] >= 8 * threads or c["num_warps"] == 1  # tiny K: one warp
            blocks = math.ceil(n / c["BLOCK_N"])
            if (n, k) in PROJECTIONS:
                assert c["SPLIT_K"] == 1 and (blocks >= 3 * sl.NUM_SMS or c["BLOCK_N"] == 2)
                assert c["BLOCK_K"] >= 256
            assert c["SPLIT_K"] == 1
            assert sl.default_config(m, n, k, silu_mul=True) == c


def test_heuristic_gives_the_measured_one_row_tiles(monkeypatch):
    """Without the tables, the heuristic's tile (``BLOCK_N``, ``BLOCK_K``, warps) at one row is
    the measured one at 8 of the 9 measured shapes that are no output head (all but the 8B
    q/k/v, 6144 x 4096: 8 x 512 measured, 8 x 1024 given); that is what it offers the shapes of
    other models."""
    tables = {name: dict(getattr(sl, name)) for name in ("TUNED", "TUNED_NORM", "TUNED_SILU_MUL")}
    for name in tables:
        monkeypatch.setattr(sl, name, {})
    tile = ("BLOCK_N", "BLOCK_K", "num_warps")
    kinds = {"TUNED": {}, "TUNED_NORM": {"norm": True}, "TUNED_SILU_MUL": {"silu_mul": True}}
    differ = [(name, key) for name, table in tables.items() for key, cfg in table.items()
              if key[0] == 1 and key[1] < 16 * key[2]
              and [sl.default_config(*key, **kinds[name])[t] for t in tile] != [cfg[t] for t in tile]]  # fmt: skip
    measured = sum(key[0] == 1 and key[1] < 16 * key[2] for table in tables.values() for key in table)
    assert measured >= 9 and differ == [("TUNED", (1, 6144, 4096))], differ


def test_tuned_entries_win(monkeypatch):
    cfg = config(16, 256, 8, 3, split=2)
    monkeypatch.setitem(sl.TUNED, (4, 2048, 8192), cfg)
    assert sl.default_config(3, 2048, 8192) == cfg and sl.default_config(4, 2048, 8192) == cfg
    assert sl.default_config(2, 2048, 8192) != cfg and sl.default_config(3, 2048, 8192, silu_mul=True) != cfg
    monkeypatch.setitem(sl.TUNED_SILU_MUL, (1, 2048, 8192), cfg)
    assert sl.default_config(1, 2048, 8192, silu_mul=True) == cfg
    sl.default_config(3, 2048, 8192)["BLOCK_N"] = 1  # a copy: the table keeps its entry
    assert sl.TUNED[(4, 2048, 8192)] == cfg


def test_launcher_refusals(device):
    x, w, b = make(0, 2, 37, 100, torch.bfloat16, device, bias=True)
    cases = [
        (lambda: sl.skinny_linear(x[0], w), "must be \\[M, K\\]"),
        (lambda: sl.skinny_linear(torch.cat([x] * 5), w), "at most 8"),
        (lambda: sl.skinny_linear(x, w[:, :50]), "weight must be \\[N, 100\\]"),
        (lambda: sl.skinny_linear(x, w.T.contiguous().T), "must be contiguous"),
        (lambda: sl.skinny_linear(x, w.float()), "must match"),
        (lambda: sl.skinny_linear(x.half(), w.half(), b), "bias must be"),
        (lambda: sl.skinny_linear(x, w, b[:5]), "bias must be"),
        (lambda: sl.skinny_linear(x.to(torch.int32), w.to(torch.int32)), "bfloat16, float16 or float32"),
        (lambda: sl.skinny_linear(torch.empty(100, 2, dtype=x.dtype, device=device).T, w), "last dimension"),
        (lambda: sl.skinny_linear(x, w, out=torch.empty(2, 36, dtype=x.dtype, device=device)), "out must be"),
        (lambda: sl.skinny_linear(x, w, out=torch.empty(2, 37, device=device)), "out must be"),
        (lambda: sl.skinny_linear(x, w, config=dict(BLOCK_N=4)), "config needs exactly the keys"),
        (lambda: sl.skinny_linear(x, w, config=config(3, 64)), "power of two"),
        (lambda: sl.skinny_linear(x, w, config={**config(4, 64), "PRELOAD": 2}), "must be one of \\(0, 1\\)"),
        (lambda: sl.skinny_linear(x, w, config={**config(4, 64), "NORM_STAGES": 0}), "must be one of \\(1, 2, 3, 4\\)"),
        (lambda: sl.skinny_linear(x, w, config={**config(4, 64), "PRELOADS": 0}), "unknown \\['PRELOADS'\\]"),
        (lambda: sl.skinny_silu_mul_linear(x, x[:, :50], w), "one shape"),
        (lambda: sl.skinny_silu_mul_linear(x, x, w[:, :50]), "weight must be"),
    ]
    for call, match in cases:
        with pytest.raises(InputError, match=match):
            call()


def test_outputs_overlapping_inputs_are_refused(device):
    """An output sharing memory with an input the launch's programs still read (in-place: the
    norm's statistics read whole rows of x in every program) is refused before any launch, and
    the inputs are left as they were; byte spans are compared, so views interleaved with an
    input (other columns of its rows) count as overlapping. The output projection's epilogue
    may write its residual stream in place (each program reads its own columns first)."""
    gen = torch.Generator().manual_seed(4)
    buf = rand(gen, 2, 256, dtype=torch.bfloat16, device=device)
    x, r = buf[:, :64], rand(gen, 2, 64, dtype=torch.bfloat16, device=device)
    w = rand(gen, 64, 64, dtype=torch.bfloat16, device=device)
    nw = rand(gen, 64, dtype=torch.bfloat16, device=device)
    before, r_before = buf.clone(), r.clone()
    cases = [
        (lambda: sl.skinny_linear(x, w, out=x), "out overlaps x"),
        (lambda: sl.skinny_linear(x, w, out=buf[:, 32:96]), "out overlaps x"),  # a partial overlap
        (lambda: sl.skinny_linear(x, w, out=buf[:, 128:192]), "out overlaps x"),  # interleaved rows
        (lambda: sl.skinny_silu_mul_linear(x, r, w, out=r), "out overlaps b"),
        (lambda: sl.skinny_rms_norm_linear(x, nw, 1e-5, w, residual=r, h_out=r), "h_out overlaps residual"),
        (lambda: sl.skinny_rms_norm_linear(x, nw, 1e-5, w, residual=r, out=x), "out overlaps x"),
        (lambda: sl.skinny_linear_add_rms_norm(x, w, None, r, nw, 1e-5, out=r), "out overlaps residual"),
    ]
    for call, match in cases:
        with pytest.raises(InputError, match=match):
            call()
    assert torch.equal(buf, before) and torch.equal(r, r_before)
    # separate outputs, and h_out in place of the output projection's residual, are taken
    y, h = sl.skinny_linear_add_rms_norm(x, w, None, r.clone(), nw, 1e-5)
    y2, h2 = sl.skinny_linear_add_rms_norm(x, w, None, r, nw, 1e-5, h_out=r)
    assert torch.equal(y2, y) and torch.equal(h2, h) and h2.data_ptr() == r.data_ptr()
    assert torch.equal(sl.skinny_linear(x, w, out=torch.empty_like(r)), sl.skinny_linear(x, w))


def test_launcher_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setattr(sl, "interpreting", lambda: False)
    x, w, _ = make(0, 2, 37, 100, torch.bfloat16, "cpu")
    with pytest.raises(InputError, match="TRITON_INTERPRET=1"):
        sl.skinny_linear(x, w)
    with pytest.raises(InputError, match="TRITON_INTERPRET=1"):
        sl.skinny_silu_mul_linear(x, x, w)


def test_zero_rows_and_one_column(device):
    x, w, b = make(5, 0, 37, 100, torch.bfloat16, device, bias=True)
    assert sl.skinny_linear(x, w, b).shape == (0, 37)
    x, w, b = make(6, 3, 1, 1, torch.float32, device, bias=True)  # N = K = 1 (Triton specializes 1s)
    assert_close_to_reference(sl.skinny_linear(x, w, b), x, w, b)
    assert_close_to_reference(sl.skinny_linear(x, w, b, config=config(2, 16, split=4)), x, w, b)


# ----------------------------------------------------------------------------- the ops
def test_linear_op_is_the_kernel(kernel_ops, launches):
    """Leading dims flattened (2 x 3 = 6 rows, a row-strided view), values equal to the launcher's."""
    device = kernel_ops
    gen = torch.Generator().manual_seed(21)
    x = rand(gen, 2, 3, 120, dtype=torch.bfloat16, device=device)[..., :100]
    w = rand(gen, 37, 100, dtype=torch.bfloat16, device=device, scale=0.1)
    b = rand(gen, 37, dtype=torch.bfloat16, device=device)
    y = torch.ops.attngraph.linear(x, w, b)
    assert len(launches) == 1 and y.shape == (2, 3, 37) and y.is_contiguous()
    assert torch.equal(y, sl.skinny_linear(x.reshape(6, 100), w, b).view(2, 3, 37))
    assert torch.equal(torch.ops.attngraph.linear(x[0, 0], w), sl.skinny_linear(x[0, :1], w)[0])  # 1-D x


def test_silu_mul_linear_op_is_the_kernel(kernel_ops, launches):
    device = kernel_ops
    gen = torch.Generator().manual_seed(22)
    gu = rand(gen, 5, 200, dtype=torch.float16, device=device)
    w = rand(gen, 37, 100, dtype=torch.float16, device=device, scale=0.1)
    a, b = gu[:, :100], gu[:, 100:]
    y = torch.ops.attngraph.silu_mul_linear(a, b, w)
    assert len(launches) == 1 and y.shape == (5, 37)
    assert torch.equal(y, sl.skinny_silu_mul_linear(a, b, w))
    y3 = torch.ops.attngraph.silu_mul_linear(gu.view(5, 1, 200)[..., :100], gu.view(5, 1, 200)[..., 100:], w)
    assert torch.equal(y3, y.view(5, 1, 37))


@pytest.mark.parametrize(
    "case",
    ["rows_past_max", "fp32", "weight_not_contiguous", "x_not_unit_stride", "interpreter_off", "empty"],
)
def test_ops_fall_back_to_torch(kernel_ops, launches, monkeypatch, case):
    """Inputs the kernel does not serve: exactly torch's result, no launch."""
    device = kernel_ops
    gen = torch.Generator().manual_seed(23)
    rows, dtype = {"rows_past_max": 9, "empty": 0}.get(case, 4), torch.float32 if case == "fp32" else torch.bfloat16
    x = rand(gen, rows, 100, dtype=dtype, device=device)
    w = rand(gen, 37, 100, dtype=dtype, device=device, scale=0.1)
    b = rand(gen, 37, dtype=dtype, device=device)
    gu = rand(gen, rows, 200, dtype=dtype, device=device)
    a, u = gu[:, :100], gu[:, 100:]
    if case == "weight_not_contiguous":
        w = w.T.contiguous().T
    if case == "x_not_unit_stride":
        x, a, u = rand(gen, 100, rows, dtype=dtype, device=device).T, gu[:, ::2], gu[:, 1::2]
    if case == "interpreter_off":
        if device.type == "cuda":
            pytest.skip("the flag concerns CPU tensors")
        monkeypatch.setattr(linear_ops, "CPU_INTERPRETER", False)
    assert torch.equal(torch.ops.attngraph.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(torch.ops.attngraph.linear(x, w, None), F.linear(x, w))
    got = torch.ops.attngraph.silu_mul_linear(a, u, w)
    assert torch.equal(got, F.linear(linear_ops.silu_mul(a, u), w))
    assert launches == []


def test_ops_run_the_kernel_only_where_it_was_measured_faster(device, monkeypatch, launches):
    """Default limits: at most `KERNEL_MAX_ROWS` rows and `KERNEL_MAX_WEIGHT` weight elements;
    at one row `KERNEL_MAX_WEIGHT_ONE_ROW`, and output heads (N >= 16 K) of any size."""
    monkeypatch.setattr(linear_ops, "CPU_INTERPRETER", True)
    gen = torch.Generator().manual_seed(24)
    w = rand(gen, 37, 100, dtype=torch.bfloat16, device=device, scale=0.1)
    for rows, want in ((linear_ops.KERNEL_MAX_ROWS, 1), (linear_ops.KERNEL_MAX_ROWS + 1, 0)):
        launches.clear()
        x = rand(gen, rows, 100, dtype=torch.bfloat16, device=device)
        gu = rand(gen, rows, 200, dtype=torch.bfloat16, device=device)
        torch.ops.attngraph.linear(x, w, None)
        torch.ops.attngraph.silu_mul_linear(gu[:, :100], gu[:, 100:], w)
        assert len(launches) == 2 * want, rows
    monkeypatch.setattr(linear_ops, "KERNEL_MAX_WEIGHT", w.numel() - 1)
    x2, x1 = rand(gen, 2, 100, dtype=torch.bfloat16, device=device), rand(gen, 1, 100, dtype=torch.bfloat16, device=device)
    launches.clear()
    assert torch.equal(torch.ops.attngraph.linear(x2, w, None), F.linear(x2, w)) and launches == []
    torch.ops.attngraph.linear(x1, w, None)
    assert len(launches) == 1
    monkeypatch.setattr(linear_ops, "KERNEL_MAX_WEIGHT_ONE_ROW", w.numel() - 1)
    launches.clear()
    assert torch.equal(torch.ops.attngraph.linear(x1, w, None), F.linear(x1, w)) and launches == []
    head = rand(gen, linear_ops.KERNEL_MIN_HEAD_RATIO * 8, 8, dtype=torch.bfloat16, device=device, scale=0.1)
    monkeypatch.setattr(linear_ops, "KERNEL_MAX_WEIGHT", 1)
    monkeypatch.setattr(linear_ops, "KERNEL_MAX_WEIGHT_ONE_ROW", 1)
    torch.ops.attngraph.linear(x1[:, :8], head, None)
    assert len(launches) == 1
    torch.ops.attngraph.linear(x2[:, :8], head, None)
    torch.ops.attngraph.linear(x1[:, :8], head[:-1, :], None)  # one output short of a head
    assert len(launches) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_silu_mul_alone_is_one_rounding_of_the_fp32_product(device, monkeypatch, dtype):
    """`skinny_linear.silu_mul` (what rows above the GEMV's limit take into cuBLAS): strided
    halves, a tail past the block, equal to torch's fp32 product rounded once."""
    monkeypatch.setattr(linear_ops, "CPU_INTERPRETER", True)
    gen = torch.Generator().manual_seed(25)
    gu = rand(gen, 5, 2 * 1100, dtype=dtype, device=device, scale=3.0)
    a, b = gu[:, :1100], gu[:, 1100:]
    want = (F.silu(a.double()) * b.double()).to(dtype)
    got = sl.silu_mul(a, b)
    assert got.is_contiguous() and not got.isnan().any()
    torch.testing.assert_close(got.double(), want.double(), rtol=2 * ROUND[dtype], atol=1e-6)
    assert torch.equal(linear_ops.silu_mul(a.reshape(5, 1, 1100), b.reshape(5, 1, 1100)), got.view(5, 1, 1100))
    with pytest.raises(InputError, match="one shape"):
        sl.silu_mul(a, b[:, :10])


def _padded_step(tokens: int, logits: int | None):
    """A forward context of a step with ``tokens`` real token rows and ``logits`` real logits rows."""
    from types import SimpleNamespace

    from attngraph.forward_context import ForwardContext, use_forward_context

    return use_forward_context(ForwardContext(None, SimpleNamespace(num_tokens=tokens), num_logits=logits))


@pytest.mark.parametrize(
    ("kind", "tokens", "logits", "computed"),
    [
        (linear_ops.TOKEN_ROWS, 1, None, 1),
        (linear_ops.LOGIT_ROWS, 2, 1, 1),
        (linear_ops.LOGIT_ROWS, 1, None, 2),  # the logits count unknown: every row
        (linear_ops.TOKEN_OR_LOGIT_ROWS, 1, 1, 1),
        (linear_ops.TOKEN_OR_LOGIT_ROWS, 1, 2, 2),  # the counts differ: every row
        (linear_ops.ANY_ROWS, 1, 1, 2),
    ],
)
def test_padded_steps_compute_only_their_real_rows(kernel_ops, launches, kind, tokens, logits, computed):
    """Two input rows of a step padded past its real rows: the real rows equal the unpadded
    product exactly, the padding row is left unwritten (NaN from the poisoned allocator)."""
    device = kernel_ops
    gen = torch.Generator().manual_seed(27)
    x = rand(gen, 1, 2, 100, dtype=torch.bfloat16, device=device)
    w = rand(gen, 37, 100, dtype=torch.bfloat16, device=device, scale=0.1)
    b = rand(gen, 37, dtype=torch.bfloat16, device=device)
    gu = rand(gen, 1, 2, 200, dtype=torch.bfloat16, device=device)
    with _padded_step(tokens, logits):
        y = torch.ops.attngraph.linear(x, w, b, kind)
        z = torch.ops.attngraph.silu_mul_linear(gu[..., :100], gu[..., 100:], w, kind)
    assert len(launches) == 2 and y.shape == z.shape == (1, 2, 37)
    want_y = sl.skinny_linear(x[0, :computed], w, b)
    want_z = sl.skinny_silu_mul_linear(gu[0, :computed, :100], gu[0, :computed, 100:], w)
    assert torch.equal(y[0, :computed], want_y) and torch.equal(z[0, :computed], want_z)
    assert y[0, computed:].isnan().all() and z[0, computed:].isnan().all()


def test_rows_outside_a_paged_step_are_all_computed(kernel_ops):
    device = kernel_ops
    gen = torch.Generator().manual_seed(28)
    x = rand(gen, 2, 64, dtype=torch.bfloat16, device=device)
    w = rand(gen, 40, 64, dtype=torch.bfloat16, device=device, scale=0.1)
    assert torch.equal(torch.ops.attngraph.linear(x, w, None, linear_ops.TOKEN_ROWS), sl.skinny_linear(x, w))
    with pytest.raises(InputError, match="rows must be one of"):
        torch.ops.attngraph.linear(x, w, None, 7)


def test_ops_outputs_are_fresh(kernel_ops):
    """No output aliases an input (also for a square weight and one row on either path)."""
    device = kernel_ops
    gen = torch.Generator().manual_seed(24)
    for dtype in (torch.bfloat16, torch.float32):
        x = rand(gen, 1, 64, dtype=dtype, device=device)
        w = rand(gen, 64, 64, dtype=dtype, device=device)
        y = torch.ops.attngraph.linear(x, w, None)
        z = torch.ops.attngraph.silu_mul_linear(x, x, w)
        ptrs = {x.data_ptr(), w.data_ptr()}
        assert y.data_ptr() not in ptrs and z.data_ptr() not in ptrs and y.data_ptr() != z.data_ptr()


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_opcheck(kernel_ops, monkeypatch, path):
    """torch.library's checks of both ops: schema, fake tensors, AOT dispatch with dynamic shapes."""
    device = kernel_ops
    if path == "torch":
        monkeypatch.setattr(linear_ops, "_use_kernel", lambda *args: False)
    gen = torch.Generator().manual_seed(25)
    x = rand(gen, 2, 3, 64, dtype=torch.bfloat16, device=device)
    w = rand(gen, 40, 64, dtype=torch.bfloat16, device=device, scale=0.1)
    b = rand(gen, 40, dtype=torch.bfloat16, device=device)
    gu = rand(gen, 3, 128, dtype=torch.bfloat16, device=device)
    torch.library.opcheck(torch.ops.attngraph.linear.default, (x, w, b))
    torch.library.opcheck(torch.ops.attngraph.linear.default, (x[0], w, None))
    torch.library.opcheck(torch.ops.attngraph.silu_mul_linear.default, (gu[:, :64], gu[:, 64:], w))
    torch.library.opcheck(torch.ops.attngraph.linear.default, (x, w, b, linear_ops.TOKEN_ROWS))
    torch.library.opcheck(torch.ops.attngraph.silu_mul_linear.default, (gu[:, :64], gu[:, 64:], w, linear_ops.LOGIT_ROWS))


def test_fake_impls_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 7, 96, dtype=torch.bfloat16)
        w = torch.empty(48, 96, dtype=torch.bfloat16)
        y = torch.ops.attngraph.linear(x, w, torch.empty(48, dtype=torch.bfloat16))
        z = torch.ops.attngraph.silu_mul_linear(x, x, w)
        assert y.shape == z.shape == (4, 7, 48) and y.dtype == z.dtype == torch.bfloat16
        with pytest.raises(InputError, match="weight must be"):
            torch.ops.attngraph.linear(x, torch.empty(48, 95, dtype=torch.bfloat16), None)


def test_ops_compile_with_dynamic_shapes(kernel_ops):
    """``fullgraph=True, dynamic=True``: one graph for every row count, the fake impls' symbolic
    shapes, results equal to eager (kernel and torch paths alike)."""
    from torch._dynamo.testing import CompileCounter

    device = kernel_ops

    def mlp(x, w_gu, w_down, bias):
        gu = torch.ops.attngraph.linear(x, w_gu, None)
        inter = gu.shape[-1] // 2
        return torch.ops.attngraph.silu_mul_linear(gu[..., :inter], gu[..., inter:], w_down) + bias

    counter = CompileCounter()
    compiled = torch.compile(mlp, fullgraph=True, dynamic=True, backend=counter)
    gen = torch.Generator().manual_seed(26)
    w_gu = rand(gen, 128, 48, dtype=torch.bfloat16, device=device, scale=0.15)
    w_down = rand(gen, 48, 64, dtype=torch.bfloat16, device=device, scale=0.15)
    bias = rand(gen, 48, dtype=torch.bfloat16, device=device)
    for rows in (2, 3, 12):  # 12: past MAX_ROWS, the torch path
        x = rand(gen, rows, 1, 48, dtype=torch.bfloat16, device=device)
        got = compiled(x, w_gu, w_down, bias)
        assert got.shape == (rows, 1, 48)
        assert torch.equal(got, mlp(x, w_gu, w_down, bias))
    assert counter.frame_count == 1


def test_op_refusals():
    x = torch.randn(3, 16)
    cases = [
        (lambda: torch.ops.attngraph.linear(x, torch.randn(4, 15), None), "weight must be \\[N, 16\\]"),
        (lambda: torch.ops.attngraph.linear(x, torch.randn(2, 4, 16), None), "weight must be"),
        (lambda: torch.ops.attngraph.linear(x, torch.randn(4, 16, dtype=torch.float64), None), "must match"),
        (lambda: torch.ops.attngraph.linear(x, torch.randn(4, 16), torch.randn(5)), "bias must be"),
        (lambda: torch.ops.attngraph.linear(torch.tensor(1.0), torch.randn(4, 1), None), "at least one dimension"),
        (lambda: torch.ops.attngraph.silu_mul_linear(x, x[:2], torch.randn(4, 16)), "one shape"),
        (lambda: torch.ops.attngraph.silu_mul_linear(x, x, torch.randn(4, 8)), "weight must be"),
    ]
    for call, match in cases:
        with pytest.raises(InputError, match=match):
            call()


def test_linear_ops_import_without_triton():
    """``import attngraph.linear_ops`` works where Triton cannot be imported; the ops use torch."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, attngraph.linear_ops as lo\n"
        "lo.CPU_INTERPRETER = True\n"
        "x, w = torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)\n"
        "assert lo._kernels() is None\n"
        "assert torch.equal(torch.ops.attngraph.linear(x, w, None), torch.nn.functional.linear(x, w))\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


# ----------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@pytest.mark.parametrize("silu_mul", [False, True], ids=["linear", "silu_mul"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
def test_gpu_projection_shapes(m, silu_mul):
    """The heuristic's configs at the 1B / 8B projection shapes, against fp64."""
    gen = torch.Generator("cuda").manual_seed(m)
    for n, k in PROJECTIONS:
        w = rand(gen, n, k, dtype=torch.bfloat16, device="cuda", scale=k**-0.5)
        if silu_mul:
            gu = rand(gen, m, 2 * k, dtype=torch.bfloat16, device="cuda")
            y = sl.skinny_silu_mul_linear(gu[:, :k], gu[:, k:], w)
            h = linear_ops.silu_mul(gu[:, :k], gu[:, k:])
            assert_close_to_reference(y, h, w, None, silu_mul_slack(h, w))
        else:
            x = rand(gen, m, k, dtype=torch.bfloat16, device="cuda")
            b = rand(gen, n, dtype=torch.bfloat16, device="cuda")
            assert_close_to_reference(sl.skinny_linear(x, w, b), x, w, b)
        del w
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_gpu_weight_past_int32_offsets():
    """A weight of more than 2^31 elements: the last rows (element offsets past 2^31) are right."""
    k = 4096
    n = (1 << 31) // k + 96
    w = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
    w.normal_(0, k**-0.5, generator=torch.Generator("cuda").manual_seed(1))
    x = rand(torch.Generator().manual_seed(2), 3, k, dtype=torch.bfloat16, device="cuda")
    y = sl.skinny_linear(x, w)
    tail = slice(n - 200, n)
    assert_close_to_reference(y[:, tail], x, w[tail], None)
    del w
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2])
def test_gpu_weight_loaded_after_the_wait_gives_the_same_bits(rows):
    """``PRELOAD = 0`` (every weight chunk loaded after the PDL wait) changes when the weight
    loads, not the sums: bit-equal to the default, plain and with the RMSNorm prologue, for the
    tuned 1B output projection's tile and a whole-row tile."""
    x, w, b = make(21, rows, 2048, 2048, torch.bfloat16, "cuda", bias=True)
    nw = torch.rand(2048, dtype=torch.bfloat16, device="cuda") + 0.5
    for tile in (config(4, 1024), config(4, 2048)):
        first = sl.skinny_linear(x, w, b, config=tile)
        assert_close_to_reference(first, x, w, b)
        assert torch.equal(sl.skinny_linear(x, w, b, config={**tile, "PRELOAD": 0}), first)
        normed = sl.skinny_rms_norm_linear(x, nw, 1e-5, w, b, config=tile)
        assert torch.equal(sl.skinny_rms_norm_linear(x, nw, 1e-5, w, b, config={**tile, "PRELOAD": 0}), normed)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2])
def test_gpu_pipelined_norm_statistics_give_the_same_bits(rows):
    """``NORM_STAGES`` > 1 changes when the statistics pass loads x and the residual, not what
    it sums: the product, and the residual stream it stores, bit-equal to ``NORM_STAGES = 1``
    at the 1B q/k/v's tile (two chunks of 1024) and at 512 (four), both pipelined and not."""
    x, w, b = make(23, rows, 3072, 2048, torch.bfloat16, "cuda", bias=True)
    res = torch.randn(rows, 2048, dtype=torch.bfloat16, device="cuda")
    nw = torch.rand(2048, dtype=torch.bfloat16, device="cuda") + 0.5
    for tile in (config(4, 1024), config(4, 512, 4, 2)):
        h1, h2 = (torch.full_like(x, float("nan")) for _ in range(2))
        first = sl.skinny_rms_norm_linear(x, nw, 1e-5, w, b, residual=res, h_out=h1, config=tile)
        assert torch.equal(h1, x + res)
        for stages in (2, 3):
            again = sl.skinny_rms_norm_linear(x, nw, 1e-5, w, b, residual=res, h_out=h2, config={**tile, "NORM_STAGES": stages})
            assert torch.equal(again, first) and torch.equal(h2, h1)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [2, 4, 8])
def test_gpu_split_k_is_deterministic(split):
    """Repeated split-K launches (programs finishing in any order) give the same bits."""
    x, w, b = make(split, 4, 512, 8192, torch.bfloat16, "cuda", bias=True)
    cfg = config(4, 256, 4, 2, split=split)
    first = sl.skinny_linear(x, w, b, config=cfg)
    assert_close_to_reference(first, x, w, b)
    for _ in range(50):
        assert torch.equal(sl.skinny_linear(x, w, b, config=cfg), first)
    assert int(sl._COUNTERS._by_device[x.device].abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("split", [1, 4])
def test_gpu_ops_in_a_cuda_graph(monkeypatch, split):
    """Both ops captured in a CUDA graph (split-K counters made by the eager warm-up) and
    replayed on new inputs: the eager results, bit for bit."""
    m, n, k = 2, 1024, 4096
    monkeypatch.setitem(sl.TUNED, (m, n, k), config(4, 256, 4, 2, split=split))
    monkeypatch.setitem(sl.TUNED_SILU_MUL, (m, n, k), config(4, 256, 4, 2, split=split))
    x, w, b = make(7, m, n, k, torch.bfloat16, "cuda", bias=True)
    gu = torch.randn(m, 2 * k, dtype=torch.bfloat16, device="cuda")

    def step():
        return torch.ops.attngraph.linear(x, w, b), torch.ops.attngraph.silu_mul_linear(gu[:, :k], gu[:, k:], w)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: compiles, makes the counters
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        gu.copy_(torch.randn(gu.shape, generator=gen, device="cuda"))
        graph.replay()
        want = step()
        assert torch.equal(outs[0], want[0]) and torch.equal(outs[1], want[1])
