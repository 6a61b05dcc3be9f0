"""`attngraph.weight_prefetch`: the rest of a program's weight asked into L2 before the PDL wait.

* CPU: the GEMV (`attngraph.skinny_linear`: plain, SiLU * up with split K, residual + RMSNorm
  with a bias) and the tensor-core kernel (`attngraph.skinny_dot`: split K; residual + RMSNorm
  with a bias; RMSNorm from partial sums of squares; a gated MLP's gate/up with SiLU * up in
  the epilogue) compiled for sm_90 with Triton's ptxas (`tests/sm90_compile.py`): with
  ``PREFETCH`` every ``prefetch.global.L2`` precedes ``griddepcontrol.wait``; with or without
  it the weight's loads are 16-byte vectors and nothing spills.
* CPU: the bulk prefetch kernel of `prefetch_bytes_l2` compiled for sm_90 issues
  ``cp.async.bulk.prefetch.L2`` before ``griddepcontrol.wait``; the byte ranges it is given
  stay inside the tensor's storage.
* GPU: the kernels' outputs with prefetching are bit-equal to those without, eagerly and
  replayed from a CUDA graph.
"""

from __future__ import annotations

import re

import pytest
import torch

from .sm90_compile import compile_in_child, ptxas_missing

GEMV = dict(ROWS=1, BLOCK_N=4, BLOCK_K=1024, SPLIT_K=1, HAS_BIAS=False, SILU_MUL=False, NORM=False, RESIDUAL=False,
            SOFT_BF16=False, USE_PDL=True, LINE=64, ROPE=False, ROPE_D=2, NORM_OUT=False, BLOCK_NO=1, STAGES=2,
            PRELOAD=True, NORM_STAGES=1, TRACE=False)  # fmt: skip
GEMV_TYPES = {**{p: "*bf16" for p in ("X", "X2", "W", "Bias", "Y", "NW", "H", "Cos", "Sin")}, "Part": "*fp32",
              "Counters": "*i32", "eps": "fp32"}  # fmt: skip
DOT = dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, EVEN_K=True, HAS_BIAS=False, SILU_MUL=False, NORM=False,
           RESIDUAL=False, UPCAST=False, PRECISION="tf32", SOFT_BF16=False, USE_PDL=True, LINE=64, ROPE=False,
           ROPE_D=2, GATED=False, SS_PARTS=0)  # fmt: skip
DOT_TYPES = {**{p: "*bf16" for p in ("X", "X2", "W", "Bias", "Y", "NW", "H", "Cos", "Sin")}, "Part": "*fp32",
             "Counters": "*i32", "SS": "*fp32", "eps": "fp32"}  # fmt: skip
#: Integer arguments Triton's launcher specializes as multiples of 16 at the projections' shapes
#: (sizes and row strides of 2048-28672; pointers always): the compiled loads are then 16-byte.
DIVISIBLE = ["N", "K", "k_per_split", "stride_xm", "stride_x2m", "stride_wn", "stride_ym", "stride_hm", "stride_cm",
             "stride_sm"]
CASES = {
    "gemv": ("attngraph.skinny_linear:_skinny_linear_kernel", GEMV_TYPES, GEMV, dict(num_warps=4, num_stages=2)),
    "gemv silu split": ("attngraph.skinny_linear:_skinny_linear_kernel", GEMV_TYPES,
                        {**GEMV, "ROWS": 2, "SILU_MUL": True, "SPLIT_K": 2}, dict(num_warps=4, num_stages=2)),
    "gemv norm residual bias": ("attngraph.skinny_linear:_skinny_linear_kernel", GEMV_TYPES,
                                {**GEMV, "NORM": True, "RESIDUAL": True, "HAS_BIAS": True, "BLOCK_K": 512},
                                dict(num_warps=4, num_stages=2)),
    # the 1B q/k/v of a decode step with the rotation in the epilogue (`passes.fold_rope_linear`)
    "gemv norm residual rope": ("attngraph.skinny_linear:_skinny_linear_kernel", GEMV_TYPES,
                                {**GEMV, "NORM": True, "RESIDUAL": True, "ROPE": True, "ROPE_D": 64},
                                dict(num_warps=4, num_stages=2)),
    # the 1B o projection with the residual add and the MLP's RMSNorm in its epilogue
    "gemv norm out": ("attngraph.skinny_linear:_skinny_linear_kernel", GEMV_TYPES,
                      {**GEMV, "NORM_OUT": True, "BLOCK_NO": 2048}, dict(num_warps=4, num_stages=2)),
    # the 1B q/k/v at 3-16 rows with the rotation in the epilogue
    "dot rope": ("attngraph.skinny_dot:_skinny_dot_kernel", DOT_TYPES, {**DOT, "SPLIT_K": 1, "ROPE": True, "ROPE_D": 64},
                 dict(num_warps=4, num_stages=6)),
    "dot split": ("attngraph.skinny_dot:_skinny_dot_kernel", DOT_TYPES, DOT, dict(num_warps=4, num_stages=4)),
    "dot norm residual": ("attngraph.skinny_dot:_skinny_dot_kernel", DOT_TYPES,
                          {**DOT, "SPLIT_K": 1, "NORM": True, "RESIDUAL": True, "HAS_BIAS": True},
                          dict(num_warps=4, num_stages=3)),
    # the 1B gate/up at 3-16 rows behind an RMSNorm whose statistics are 32 partial sums
    "dot norm parts": ("attngraph.skinny_dot:_skinny_dot_kernel", DOT_TYPES,
                       {**DOT, "SPLIT_K": 1, "NORM": True, "SS_PARTS": 32}, dict(num_warps=4, num_stages=3)),
    # the gate/up at 3-16 rows with SiLU * up in the epilogue (`skinny_dot.GATED_CONFIG`: 64 rows of each half)
    "dot gated": ("attngraph.skinny_dot:_skinny_dot_kernel", DOT_TYPES, {**DOT, "SPLIT_K": 1, "BLOCK_N": 64, "GATED": True},
                  dict(num_warps=4, num_stages=3)),
}  # fmt: skip


BULK = ("attngraph.weight_prefetch:_bulk_prefetch_l2_kernel", {"W": "*bf16"},
        dict(BULK=16384, PER=32, USE_PDL=True), dict(num_warps=1, num_stages=1))


@pytest.fixture(scope="module")
def compiled() -> dict:
    """``(case, prefetch) -> {"ptx", "regs", "local_bytes"}``, compiled in one child process
    without Triton's interpreter."""
    if (why := ptxas_missing()) is not None:
        pytest.skip(why)
    keys = [(case, pf) for case in CASES for pf in (True, False)]
    specs = [dict(kernel=CASES[c][0], types=CASES[c][1], constexprs={**CASES[c][2], "PREFETCH": pf}, options=CASES[c][3],
                  divisible=DIVISIBLE) for c, pf in keys]  # fmt: skip
    specs.append(dict(kernel=BULK[0], types=BULK[1], constexprs=BULK[2], options=BULK[3], divisible=[]))
    return dict(zip(keys + [("bulk", True)], compile_in_child(specs)))


def test_bulk_prefetches_precede_the_wait(compiled):
    ptx = compiled["bulk", True]["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    assert wait > 0 and ptx.find("griddepcontrol.launch_dependents") > wait
    issued = ptx.count("cp.async.bulk.prefetch.L2.global")
    assert issued >= 1 and ptx.rfind("cp.async.bulk.prefetch.L2.global") < wait
    assert compiled["bulk", True]["local_bytes"] == 0


def test_prefetchable_bytes_stay_in_the_storage():
    from attngraph.weight_prefetch import BULK_BYTES, prefetchable_bytes

    fused = torch.empty(3 * BULK_BYTES + 100, dtype=torch.uint8)
    assert prefetchable_bytes(fused, 1 << 30) == 3 * BULK_BYTES  # clamped to the storage, whole pieces
    assert prefetchable_bytes(fused, 2 * BULK_BYTES + 5) == 2 * BULK_BYTES
    assert prefetchable_bytes(fused[BULK_BYTES:], 1 << 30) == 2 * BULK_BYTES  # from the view's start
    assert prefetchable_bytes(fused[1:], 1 << 30) == 0  # not 16-byte aligned
    assert prefetchable_bytes(fused, 0) == 0 and prefetchable_bytes(fused, BULK_BYTES - 1) == 0


@pytest.mark.parametrize("case", list(CASES))
def test_prefetches_precede_the_wait_and_nothing_spills(compiled, case):
    on, off = compiled[case, True], compiled[case, False]
    ptx = on["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    assert wait > 0, "the PDL kernel lost its wait"
    assert "prefetch.global.L2" in ptx, "PREFETCH issued no L2 prefetch"
    assert ptx.rfind("prefetch.global.L2") < wait, "a prefetch sits after griddepcontrol.wait"
    assert "prefetch.global.L2" not in off["ptx"]
    assert on["local_bytes"] == 0 and off["local_bytes"] == 0, (on["local_bytes"], off["local_bytes"])
    # the weight's loads (marked evict_first) stay 16-byte vectors
    weight_loads = re.findall(r"ld\.global\.L1::evict_first[\w.:]*", ptx)
    assert weight_loads and all(op.endswith(".v4.b32") for op in weight_loads), sorted(set(weight_loads))


def _loops(ptx: str) -> list[str]:
    """The bodies of the PTX's loops (from a label to the branch back to it)."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\$(\w+):", line.strip()))}
    bodies = []
    for i, line in enumerate(lines):
        m = re.search(r"bra(?:\.uni)?\s+\$(\w+);", line)
        if m and labels.get(m.group(1), i) < i:
            bodies.append("\n".join(lines[labels[m.group(1)]:i]))
    return bodies


@pytest.mark.parametrize("case", ["dot norm residual", "dot norm parts"])
def test_dot_norm_loop_waits_on_no_plain_load(compiled, case):
    """The tensor-core kernel with the RMSNorm in its loads: the K loop (the one with the
    wgmma) reads x, the residual and the norm weight only through the pipeliner's ``cp.async``
    copies, no ``ld.global`` it would wait for in every chunk (the norm weight as a
    ``[BLOCK_K]`` vector of 2 bytes per thread was one), and so does the pass over x for the
    rows' statistics where the kernel makes one (``_rms_rstd``'s ``STAGES``)."""
    loops = _loops(compiled[case, False]["ptx"])
    assert sum("wgmma.mma_async" in body for body in loops) == 1
    assert len(loops) == (2 if case == "dot norm residual" else 1)
    for loop in loops:
        assert "cp.async.cg.shared.global" in loop
        assert "ld.global" not in loop, [line.strip() for line in loop.splitlines() if "ld.global" in line]


def test_gemv_loop_streams_the_next_chunks():
    """``STAGES > 1``: Triton's pipeliner issues the next chunks' weight and x loads as
    ``cp.async`` copies into shared memory before the current chunk is multiplied; with
    ``STAGES = 1`` the loop has plain loads (one chunk in flight per program). Either way
    nothing spills, at the 1B down projection's configuration and the 8B LM head's."""
    if (why := ptxas_missing()) is not None:
        pytest.skip(why)
    cases = [({**GEMV, "SILU_MUL": True, "PREFETCH": False}, 4), ({**GEMV, "BLOCK_N": 16, "BLOCK_K": 256, "PREFETCH": False}, 4)]
    specs = [dict(kernel=CASES["gemv"][0], types=GEMV_TYPES, constexprs={**c, "STAGES": st},
                  options=dict(num_warps=w, num_stages=st), divisible=DIVISIBLE)
             for c, w in cases for st in (1, 3)]  # fmt: skip
    got = compile_in_child(specs)
    for (plain, piped), case in zip(zip(got[::2], got[1::2]), cases):
        assert "cp.async" not in plain["ptx"], case
        assert piped["ptx"].count("cp.async.cg.shared.global") >= 4, case  # 16-byte copies of two chunks ahead
        assert "cp.async.wait_group" in piped["ptx"]
        assert plain["local_bytes"] == 0 and piped["local_bytes"] == 0


@pytest.mark.parametrize("preload", [True, False])
def test_gemv_norm_statistics_pass_streams_with_norm_stages(preload):
    """``NORM_STAGES = 2``: the pass over x (and the residual) for the rows' statistics, two
    chunks of 1024 at the 1B q/k/v's tile, issues the next chunk's loads as ``cp.async`` copies
    before it sums the current one; with 1 it waits on plain loads chunk by chunk. The main
    loop stays unpipelined (``STAGES = 1``, the tuned tiles'), and nothing spills."""
    if (why := ptxas_missing()) is not None:
        pytest.skip(why)
    base = {**GEMV, "NORM": True, "RESIDUAL": True, "STAGES": 1, "PREFETCH": False, "PRELOAD": preload}
    specs = [dict(kernel=CASES["gemv"][0], types=GEMV_TYPES, constexprs={**base, "NORM_STAGES": ns},
                  options=dict(num_warps=4, num_stages=1), divisible=DIVISIBLE)
             for ns in (1, 2)]  # fmt: skip
    plain, piped = compile_in_child(specs)
    assert "cp.async" not in plain["ptx"]
    stats = [body for body in _loops(piped["ptx"]) if "cp.async.cg.shared.global" in body]
    assert len(stats) == 1 and "cp.async.wait_group" in stats[0]
    assert plain["local_bytes"] == 0 and piped["local_bytes"] == 0


def test_gemv_without_preload_loads_the_weight_after_the_wait():
    """``PRELOAD``: the first weight chunk's loads (``evict_first``) precede
    ``griddepcontrol.wait``; without it every weight load follows the wait, and the program
    launches its dependents right after it either way. At the 1B output projection's tile and
    with the RMSNorm prologue of the q/k/v projection; nothing spills."""
    if (why := ptxas_missing()) is not None:
        pytest.skip(why)
    cases = [GEMV, {**GEMV, "NORM": True, "RESIDUAL": True, "ROPE": True, "ROPE_D": 64}]
    specs = [dict(kernel=CASES["gemv"][0], types=GEMV_TYPES, constexprs={**c, "STAGES": 1, "PREFETCH": False, "PRELOAD": pre},
                  options=dict(num_warps=4, num_stages=1), divisible=DIVISIBLE)
             for c in cases for pre in (True, False)]  # fmt: skip
    got = compile_in_child(specs)
    for (early, late), case in zip(zip(got[::2], got[1::2]), ("plain", "norm rope")):
        for out, preload in ((early, True), (late, False)):
            ptx = out["ptx"]
            wait = ptx.find("griddepcontrol.wait")
            assert 0 < wait < ptx.find("griddepcontrol.launch_dependents"), case
            first_weight = ptx.find("ld.global.L1::evict_first")
            assert first_weight > 0, case
            assert (first_weight < wait) == preload, (case, preload)
            assert out["local_bytes"] == 0, case


# ----------------------------------------------------------------------------- GPU


def _poisoned(m: int, n: int) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4, 16])
def test_outputs_bit_equal_with_and_without_prefetch_on_gpu(monkeypatch, rows):
    from attngraph import pdl, skinny_dot, skinny_linear, weight_prefetch

    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("needs programmatic dependent launch (compute capability 9.0, a Triton with gdc_wait)")
    torch.manual_seed(rows)
    n, k = 2048, 8192  # four chunks of 1024 per GEMV program, split K on the tensor-core kernel
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    up = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
    bias = torch.randn(n, dtype=torch.bfloat16, device="cuda")

    def run(prefetch: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(weight_prefetch, "ENABLED", prefetch)
        outs = [_poisoned(rows, n) for _ in range(2)]
        if rows <= 2:  # the GEMV's rows (linear_ops.KERNEL_MAX_ROWS)
            skinny_linear.skinny_linear(x, w, bias, out=outs[0])
            skinny_linear.skinny_silu_mul_linear(x, up, w, out=outs[1])
        else:
            skinny_dot.skinny_dot_linear(x, w, bias, out=outs[0])
            skinny_dot.skinny_dot_silu_mul_linear(x, up, w, out=outs[1])
        return outs

    eager_off, eager_on = run(False), run(True)
    # captured with prefetching, replayed onto poisoned outputs
    monkeypatch.setattr(weight_prefetch, "ENABLED", True)
    run(True)  # compiles and makes the split-K counters outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(True)
    for t in captured:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = (x.float() @ w.float().T + bias.float(), (torch.nn.functional.silu(x.float()) * up.float()).bfloat16().float() @ w.float().T)
    for off, on, rep, ref in zip(eager_off, eager_on, captured, want):
        assert not off.isnan().any()
        assert torch.equal(on, off) and torch.equal(rep, off)
        assert (off.float() - ref).abs().max().item() <= 0.05 * ref.abs().max().item()
