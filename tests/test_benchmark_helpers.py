"""The benchmark scripts' pure helpers (their examples are doctests): the GPU busy time of
overlapping kernels and the idle time between kernels, by boundary."""

import doctest
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def bench_module(name: str):
    """The benchmark script ``benchmarks/<name>.py`` imported as a module."""
    import importlib

    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_profile_kernels_helpers():
    profile_kernels = bench_module("profile_kernels")
    failed, attempted = doctest.testmod(profile_kernels)
    assert attempted >= 2 and failed == 0
    # a long gap (the host between steps) is not idle time of a step; overlaps are not gaps
    idle = profile_kernels.idle_by_boundary(
        [(0, 10, "_skinny_linear_kernel"), (5, 20, "_decode_stage1_kernel"), (21, 30, "nvjet_x"), (200, 210, "nvjet_y")]
    )
    assert idle == {"attention -> gemm": [1, 1]}
    # what each kernel adds: the exposed times and the gaps add up to the span, overlaps once
    spans = [(0, 10, "_skinny_linear_kernel"), (5, 20, "_decode_stage1_kernel"), (6, 12, "nvjet_x"), (21, 30, "nvjet_y")]
    exposed = profile_kernels.exposed_us(spans)
    assert exposed == {"_skinny_linear_kernel": 10, "nvjet_x": 2, "_decode_stage1_kernel": 8, "nvjet_y": 9}
    assert sum(exposed.values()) + 1 == 30


def test_gemv_table_and_chain_sweep(tmp_path):
    """`bench_generate.gemv_table`: a JSON entry wins for its kind and padded row count, the
    module's tables answer the rest, ``unpipelined`` keeps one stage; `bench_gemv_chain.sweep`
    varies one projection and prunes tiles a thread cannot hold; `bench_gemv_chain.trace_summary`
    (its doctest) reads the kernels' timestamps."""
    import json

    pytest.importorskip("triton")
    bench_gemv_chain = bench_module("bench_gemv_chain")
    bench_generate = bench_module("bench_generate")
    from attngraph import skinny_linear
    from attngraph.errors import InputError

    cfg = dict(BLOCK_N=2, BLOCK_K=512, num_warps=4, num_stages=3, SPLIT_K=1)
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"silu": {"1,2048,8192": cfg}}))
    table = bench_generate.gemv_table(str(path), skinny_linear.default_config)
    assert table(1, 2048, 8192, silu_mul=True) == cfg
    assert table(2, 2048, 8192, silu_mul=True) == skinny_linear.default_config(2, 2048, 8192, silu_mul=True)
    assert table(1, 2048, 8192) == skinny_linear.default_config(1, 2048, 8192)
    assert bench_generate.gemv_table("unpipelined", skinny_linear.default_config)(1, 3072, 2048, norm=True)["num_stages"] == 1
    path.write_text(json.dumps({"plain": {"1,2048,2048": dict(cfg, BLOCK_N=3)}}))
    with pytest.raises(InputError, match="power of two"):
        bench_generate.gemv_table(str(path), skinny_linear.default_config)
    failed, attempted = doctest.testmod(bench_gemv_chain)  # `trace_summary`'s example
    assert attempted >= 1 and failed == 0
    base = dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=2, SPLIT_K=1)
    variants = bench_gemv_chain.sweep(base, "o", 1, 2048, 2048, [2, 4, 64], [1024], [])
    # the default itself is no variant; BLOCK_N=64 x BLOCK_K=1024 is too wide an accumulator
    assert [o for _, o in variants] == [{"o": dict(base, BLOCK_N=2)}]
    # PRELOAD swept: the key appears only where it differs from the default (1)
    variants = bench_gemv_chain.sweep(base, "o", 1, 2048, 2048, [4], [1024, 2048], [], [1, 0])
    assert [o["o"] for _, o in variants] == [dict(base, PRELOAD=0), dict(base, BLOCK_K=2048),
                                             dict(base, BLOCK_K=2048, PRELOAD=0)]  # fmt: skip
    assert variants[0][0] == "o BLOCK_N=4 BLOCK_K=1024 stages=2 PRELOAD=0"
    # NORM_STAGES likewise
    variants = bench_gemv_chain.sweep(base, "qkv", 1, 3072, 2048, [4], [1024], [], [], [1, 2])
    assert [(label, o["qkv"]) for label, o in variants] == [("qkv BLOCK_N=4 BLOCK_K=1024 stages=2 NORM_STAGES=2",
                                                             dict(base, NORM_STAGES=2))]  # fmt: skip
    path.write_text(json.dumps({"plain": {"1,2048,2048": dict(cfg, PRELOAD=0)}}))
    assert bench_generate.gemv_table(str(path), skinny_linear.default_config)(1, 2048, 2048)["PRELOAD"] == 0
    # the tensor-core kernel's entries ("dot": {"N,K": ...}) leave the GEMV's table alone
    from attngraph import skinny_dot

    dot = dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=2, num_warps=4, num_stages=4)
    path.write_text(json.dumps({"dot": {"3072,2048": dot}, "plain": {"1,2048,2048": cfg}}))
    dot_config = bench_generate.dot_table(str(path), skinny_dot.default_config)
    assert dot_config(3072, 2048) == dot and dot_config(2048, 2048) == skinny_dot.default_config(2048, 2048)
    assert bench_generate.gemv_table(str(path), skinny_linear.default_config)(1, 2048, 2048) == cfg
    assert bench_generate.dot_table("tuned", skinny_dot.default_config) is skinny_dot.default_config
    path.write_text(json.dumps({"dot": {"3072,2048": dict(dot, BLOCK_N=8)}}))
    with pytest.raises(InputError, match="tensor-core"):
        bench_generate.dot_table(str(path), skinny_dot.default_config)


def _rms_norm(h: "torch.Tensor", weight: "torch.Tensor") -> "torch.Tensor":
    import torch

    return weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))


def _attention_reference(q, keys, values, group: int):
    """fp32 softmax attention of one token: ``q: [Hq, D]`` over ``keys, values: [L, Hkv, D]``."""
    import torch

    scores = torch.einsum("hd,khd->hk", q, keys.repeat_interleave(group, 1)) * q.shape[-1] ** -0.5
    return torch.einsum("hk,khd->hd", scores.softmax(-1), values.repeat_interleave(group, 1))


def test_chain_with_attention_runs_a_decode_layer(monkeypatch):
    """`bench_gemv_chain.Chain` with ``attention`` (the interpreter on the CPU, or CUDA):

    * one layer's decode attention with the rotation in the kernel (`Chain._attend`, 71 keys:
      two splits merged in the launch) against fp32 torch ops over the pool's cached keys and the rotated new token,
      which the kernel also stores at its slot;
    * the whole chain (two layers of GEMVs, attention, add + RMSNorm, the MLP, the LM head)
      against the same layers in fp32 torch ops: the logits' relative error; and with each
      layer's attention and output projection in one launch (``fuse_o``)."""
    import torch
    import torch.nn.functional as F

    pytest.importorskip("triton")
    bench_gemv_chain = bench_module("bench_gemv_chain")
    from attngraph import skinny_linear
    from attngraph.attn_backends.triton_ops import decode_attention
    from attngraph.rope import rope_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and (not skinny_linear.interpreting() or skinny_linear.interpreter_problem()
                            or decode_attention.interpreter_problem()):  # fmt: skip
        pytest.skip("needs CUDA or Triton's interpreter (one that runs the decode kernel's loops)")
    context = 70
    chain = bench_gemv_chain.Chain("tiny", 1, attention=True, context=context, device=device)
    hq, hkv, d = chain.heads, chain.kv_heads, chain.head_dim
    group = hq // hkv
    assert chain.max_splits >= 2
    cached = [(k.clone(), v.clone()) for k, v in chain.pools]
    slots = (chain.req_to_page[0].long()[:, None] * bench_gemv_chain.PAGE_SIZE
             + torch.arange(bench_gemv_chain.PAGE_SIZE, device=device)).flatten()[: context + 1]  # fmt: skip
    cos, sin = chain.cos.float(), chain.sin.float()

    def layer_attention(layer, q, k, v):  # q: [Hq, D], k / v: [Hkv, D] unrotated, fp32
        q = rope_reference(q.view(1, hq, d), cos, sin)[0]
        k = rope_reference(k.view(1, hkv, d), cos, sin)[0]
        keys = torch.cat([cached[layer][0].float()[slots[:context]], k[None]])  # [context + 1, Hkv, D]
        values = torch.cat([cached[layer][1].float()[slots[:context]], v.view(1, hkv, d)])
        return _attention_reference(q, keys, values, group).reshape(1, hq * d), k

    qkv = torch.randn(1, (hq + 2 * hkv) * d, device=device).to(torch.bfloat16)
    got = chain._attend(qkv, 0).float()
    want, k_rot = layer_attention(0, *qkv.float().split([hq * d, hkv * d, hkv * d], -1))
    assert (got - want).abs().max() < 1e-2, (got - want).abs().max()
    assert (chain.pools[0][0][slots[context]].float() - k_rot).abs().max() < 2e-2  # rotated, rounded to bf16
    assert torch.equal(chain.pools[0][1][slots[context]], qkv[0, (hq + hkv) * d :].view(hkv, d))
    # `--decode` variants of the kernel: one split (no merge), a merge chunk of one split, the
    # splits merged by a second launch, the rotation by a RoPE kernel before it; the same output
    # within rounding (the same new K/V stored)
    for decode in (dict(min_split_len=256), dict(merge_chunk=1), dict(merge=False), dict(rope=False)):
        again = chain._attend(qkv, 0, None, decode).float()
        assert (again - want).abs().max() < 1e-2, (decode, (again - want).abs().max())
    from attngraph.attn_backends.triton_ops import decode_attention

    assert decode_attention.merge_chunk(16, 64) == decode_attention.MAX_MERGE_CHUNK  # the override was put back

    got = chain.run({name: None for name in bench_gemv_chain.PROJECTIONS}).float()
    down, h = chain.x.float(), chain.h.float()
    for layer, w in enumerate(chain.w):
        h = down + h
        attn, _ = layer_attention(layer, *(_rms_norm(h, w["norm"]) @ w["qkv"].float().T).split([hq * d, hkv * d, hkv * d], -1))
        h = attn @ w["o"].float().T + h
        gate, up = (_rms_norm(h, w["norm2"]) @ w["gate_up"].float().T).chunk(2, -1)
        down = (F.silu(gate) * up) @ w["down"].float().T
    want = down @ chain.lm_head.float().T
    assert got.shape == want.shape == (1, 256)
    assert (got - want).norm() / want.norm() < 0.03
    # attention and the output projection in one launch: the same attention output, the
    # projection summed in another order
    defaults = {name: None for name in bench_gemv_chain.PROJECTIONS}
    for fuse in (dict(max_splits=None, block_o=8, preload=True), dict(max_splits=2, block_o=16, preload=False)):
        fused = chain.run({**defaults, "fuse_o": fuse}).float()
        assert (fused - got).norm() / got.norm() < 1e-2, fuse
    assert not chain.sync.any()
    # gate/up on the GEMV with the residual add and the MLP's norm folded, instead of cuBLAS
    # after the add + norm kernel: the same step within rounding
    from attngraph.skinny_linear import default_config

    n, k = bench_gemv_chain.projection_shapes("tiny")["gate_up"]
    normed_gemvs = []
    plain = bench_gemv_chain.skinny_rms_norm_linear
    monkeypatch.setattr(bench_gemv_chain, "skinny_rms_norm_linear", lambda *a, **kw: normed_gemvs.append(a[3]) or plain(*a, **kw))
    gemv = chain.run({**defaults, "gate_up": default_config(1, n, k, norm=True)}).float()
    assert [t.shape for t in normed_gemvs] == [chain.w[0]["qkv"].shape, chain.w[0]["gate_up"].shape] * chain.layers
    assert all(t is layer["gate_up"] for t, layer in zip(normed_gemvs[1::2], chain.w))
    assert (gemv - got).norm() / got.norm() < 1e-2


def test_decode_step_timing_alternates_lengths_and_counts_collections(monkeypatch):
    """`bench_generate.decode_step_ms` on a stand-in model whose generate takes a known wall
    time per token with a host share of half: the step is the difference of the two lengths
    per token, the host step half of it; the lengths alternate after one warm-up each; a
    collection forced inside a timed generate is counted."""
    import gc
    import time

    import torch

    bench_generate = bench_module("bench_generate")
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    pending = [0.0]

    def synchronize():  # the device finishes what the host left queued
        clock[0] += pending[0]
        pending[0] = 0.0

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    calls = []

    class Model:
        def generate(self, ids, max_new_tokens, **kw):
            calls.append(max_new_tokens)
            if len(calls) == 4:
                gc.collect(0)
            clock[0] += 5.0 + 0.5 * max_new_tokens  # setup, then the host's share per token
            pending[0] = 0.5 * max_new_tokens  # the device's remainder
            return ids

    out, ms, steps, stats = bench_generate.decode_step_ms(Model(), "ids", "mask", 9, repeats=3)
    assert calls == [1, 9] + [1, 9] * 3
    assert out == "ids" and steps == [1000.0] * 3 and ms == 1000.0  # 1 s per token
    assert stats["host_ms_per_step"] == 500.0 and stats["gc_collections"][0] >= 1


def test_interleaved_steps_rotate_runs_and_cancel_a_drift(monkeypatch):
    """`bench_generate.interleaved_steps` on two stand-in models of 1.0 and 1.1 s per token on a
    machine that slows by 1% per generate: each run's settings are applied before each of its
    generates; the runs alternate in rotated order after one warm-up of each length; and the
    faster run comes out faster by about the true 10%, where timing one run after the other
    (`decode_step_ms`) lets the drift swallow the difference."""
    import time

    import torch

    bench_generate = bench_module("bench_generate")
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    slowdown = [1.0]
    applied = []
    calls = []

    class Model:
        def __init__(self, name, per_token):
            self.name, self.per_token = name, per_token

        def generate(self, ids, max_new_tokens, **kw):
            assert applied[-1] == self.name  # its own settings are in force
            calls.append((self.name, max_new_tokens))
            clock[0] += (2.0 + self.per_token * max_new_tokens) * slowdown[0]
            slowdown[0] *= 1.01
            return ids

    fast, slow = Model("fast", 1.0), Model("slow", 1.1)
    runs = [dict(model=m, ids="ids", mask="mask", extra={}, apply=lambda n=m.name: applied.append(n)) for m in (slow, fast)]
    results = bench_generate.interleaved_steps(runs, 33, repeats=4)
    assert calls[:4] == [("slow", 1), ("slow", 33), ("fast", 1), ("fast", 33)]
    timed = [name for name, n in calls[4:] if n == 33]
    assert timed == ["slow", "fast", "fast", "slow", "slow", "fast", "fast", "slow"]
    (_, slow_ms, slow_steps, _), (_, fast_ms, fast_steps, _) = results
    assert len(slow_steps) == len(fast_steps) == 4
    assert 1.05 < slow_ms / fast_ms < 1.15
    # the same machine timed one run after the other: the drift hides most of the difference
    slowdown[0] = 1.0
    applied.append("slow")
    _, slow_alone, _, _ = bench_generate.decode_step_ms(slow, "ids", "mask", 33, repeats=4)
    applied.append("fast")
    _, fast_alone, _, _ = bench_generate.decode_step_ms(fast, "ids", "mask", 33, repeats=4)
    assert slow_alone / fast_alone < 1.05


def test_variant_rows_name_switches_and_default_the_rest():
    """`bench_generate.variant_rows`: a spec's NAME=VALUE set those switches, the rest take their
    flag's first value; a new value joins its flag's list (so the flag's own checks see it);
    an unknown name or a list value is refused through the parser's error."""
    import argparse

    bench_generate = bench_module("bench_generate")
    flags = {attr: "first" for attr in bench_generate.VARIANT_SWITCHES}
    args = argparse.Namespace(**flags, variant=["default", "fold-rope=linear decode-block-n=256", "fold-rope=first"])
    rows = bench_generate.variant_rows(args, error=lambda msg: pytest.fail(msg))
    index = {attr: i for i, attr in enumerate(bench_generate.VARIANT_SWITCHES)}
    assert rows[0] == ("first",) * len(index) == rows[2]
    assert rows[1][index["fold_rope"]] == "linear" and rows[1][index["decode_block_n"]] == "256"
    assert sum(v != "first" for v in rows[1]) == 2
    assert args.fold_rope == "first,linear" and args.decode_block_n == "first,256"

    class Refused(Exception):
        pass

    def error(msg):
        raise Refused(msg)

    for bad in ("foo=1", "fold-rope", "fold-rope=on,off"):
        with pytest.raises(Refused, match="is no NAME=VALUE"):
            bench_generate.variant_rows(argparse.Namespace(**flags, variant=[bad]), error)
    with pytest.raises(Refused, match="names fold-rope twice"):
        bench_generate.variant_rows(argparse.Namespace(**flags, variant=["fold-rope=on fold-rope=off"]), error)


@pytest.mark.parametrize("argv,message", [
    (["bench_gemv_chain.py", "--attention", "--decode", "merge_chunk=0"], "merge_chunk takes a count from 1 to 64"),
    (["bench_gemv_chain.py", "--attention", "--decode", "merge_chunk=500"], "merge_chunk takes a count from 1 to 64"),
    (["bench_gemv_chain.py", "--attention", "--decode", "min_split=x"], "min_split takes a count"),
    (["bench_gemv_chain.py", "--decode", "merge_chunk=2"], "--decode needs --attention"),
    (["bench_gemv_chain.py", "--sweep", "gate,o"], "'gate' is none of qkv, o, gate_up, down, lm_head"),
    (["bench_generate.py", "--decode-merge-chunk", "0"], "from 1 to 64; got 0"),
    (["bench_generate.py", "--decode-merge-chunk", "default,65"], "from 1 to 64; got 65"),
])  # fmt: skip
def test_bench_switches_refuse_bad_values_before_the_gpu(argv, message, monkeypatch, capsys):
    """A bad merge chunk, split length or projection name stops the benchmark with an error
    naming the allowed values, before it asks for a GPU (this machine has none)."""
    module = bench_module(argv[0].removesuffix(".py"))
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as stop:
        module.main()
    assert stop.value.code == 2  # argparse's error, not the missing-GPU exit
    assert message in capsys.readouterr().err


def test_chain_routes_gate_up_as_the_model_and_its_table_keeps_gemv_tiles():
    """`linear_ops.gemv_takes`, by which the chain routes gate/up, keeps to the ops' limits (the
    1B gate/up of one row on the GEMV, the 8B one and two 1B rows on cuBLAS, an output head of
    one row on the GEMV at any size); `gemv_table` gives each projection
    the tile of its fastest GEMV variant, also where a cuBLAS variant was faster, and leaves out
    projections that no variant ran on the GEMV."""
    chain = bench_module("bench_gemv_chain")
    from attngraph import linear_ops

    assert linear_ops.gemv_takes(1, *chain.projection_shapes("1b")["gate_up"])
    assert not linear_ops.gemv_takes(1, *chain.projection_shapes("8b")["gate_up"])
    assert not linear_ops.gemv_takes(2, *chain.projection_shapes("1b")["gate_up"])
    assert linear_ops.gemv_takes(linear_ops.KERNEL_MAX_ROWS, 64, 64)
    assert not linear_ops.gemv_takes(linear_ops.KERNEL_MAX_ROWS + 1, 64, 64) and not linear_ops.gemv_takes(0, 64, 64)
    assert linear_ops.gemv_takes(1, *chain.projection_shapes("8b")["lm_head"])
    assert not linear_ops.gemv_takes(2, *chain.projection_shapes("8b")["lm_head"])

    def tile(bn: int, bk: int) -> dict:
        return dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=1, SPLIT_K=1)

    shapes = chain.projection_shapes("1b")
    base = {"qkv": tile(4, 1024), "o": tile(4, 1024), "gate_up": None, "down": tile(4, 1024), "lm_head": None}
    rows = [
        dict(variant="default", ms=1.00, configs=base),
        dict(variant="gate_up BLOCK_N=8 BLOCK_K=1024 stages=1", ms=1.02, configs=dict(base, gate_up=tile(8, 1024))),
        dict(variant="gate_up BLOCK_N=16 BLOCK_K=512 stages=1", ms=1.04, configs=dict(base, gate_up=tile(16, 512))),
        dict(variant="qkv BLOCK_N=8 BLOCK_K=512 stages=1", ms=0.98, configs=dict(base, qkv=tile(8, 512))),
        dict(variant="o BLOCK_N=2 BLOCK_K=512 stages=1", ms=1.01, configs=dict(base, o=tile(2, 512))),
    ]  # fmt: skip
    table = chain.gemv_table(rows, shapes, 1)
    assert table == {
        "norm": {"1,3072,2048": tile(8, 512), "1,16384,2048": tile(8, 1024)},
        "plain": {"1,2048,2048": tile(4, 1024)},
        "silu": {"1,2048,8192": tile(4, 1024)},
    }


def _dot_bench(monkeypatch, mark):
    """``(bench_skinny_gemm, device, launched)`` for timing helpers of the tensor-core kernel:
    CUDA, or the CPU under Triton's interpreter (else the test is skipped); the CUDA-graph timer
    replaced by one call of each; ``mark(launch keywords)`` appended to ``launched`` per launch."""
    import torch

    pytest.importorskip("triton")
    bench = bench_module("bench_skinny_gemm")
    from attngraph import skinny_dot, skinny_linear

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and (not skinny_dot.interpreting() or skinny_linear.interpreter_problem()):
        pytest.skip("needs CUDA or Triton's interpreter")
    launched = []
    launch = skinny_dot._launch
    monkeypatch.setattr(skinny_dot, "_launch", lambda *a, **kw: launched.append(mark(kw)) or launch(*a, **kw))
    monkeypatch.setattr(bench, "time_calls", lambda calls: [c() for c in calls] and 1.0)
    return bench, device, launched


def test_tensor_core_norm_and_rope_timings_run_what_they_name(monkeypatch):
    """`bench_skinny_gemm.time_dot_norm` and `time_dot_rope` (the interpreter on the CPU, or
    CUDA) with the CUDA-graph timer replaced by one call of each: the norm from partial sums of
    squares gives the norm kernel's products, and the calls reach the launches they are named
    for (the sums, the rotation)."""
    import torch

    bench, device, launched = _dot_bench(monkeypatch, lambda kw: (
        ("sums" if kw.get("sum_squares") is not None else "") + ("rope" if kw.get("rope") is not None else "")))  # fmt: skip
    torch.manual_seed(0)
    x = torch.randn(5, 256, dtype=torch.bfloat16, device=device)
    ws = [torch.randn(192, 256, dtype=torch.bfloat16, device=device) / 16 for _ in range(2)]
    out = torch.empty(5, 192, dtype=torch.bfloat16, device=device)
    norm = bench.time_dot_norm(x, ws, out, 5, 256)
    assert norm["parts"] == 4 and norm["max_abs_diff_vs_norm_then_dot"] <= 2 ** -6 * out.float().abs().max().item()
    assert launched.count("sums") == 1 + len(ws)
    del launched[:]
    rope = bench.time_dot_rope(x, ws, out, 128, 64)
    assert rope["rope_us"] == 1.0 and launched == ["rope"] * (2 * len(ws))


def test_gated_timings_check_every_tile_and_run_the_gated_launch(monkeypatch):
    """`bench_skinny_gemm.time_dot_gated` (the interpreter on the CPU, or CUDA) with the CUDA-graph
    timer replaced by one call of each: every tile's output passes the check against SiLU * up
    of the fp32 products (none carries an error), the tiles run the gated launch, and the
    comparison runs the plain product."""
    import torch

    from attngraph import skinny_dot

    bench, device, launched = _dot_bench(monkeypatch, lambda kw: kw.get("gated", False))
    monkeypatch.setattr(bench, "GATED_SWEEP", bench.GATED_SWEEP[:2])  # the interpreter is slow
    torch.manual_seed(0)
    x = torch.randn(5, 256, dtype=torch.bfloat16, device=device)
    ws = [torch.randn(192, 256, dtype=torch.bfloat16, device=device) / 16 for _ in range(2)]
    gated = bench.time_dot_gated(x, ws)
    base = dict(skinny_dot.GATED_CONFIG)  # the launcher's pick
    tiles = [base] + [c for c in bench.GATED_SWEEP if c != base]  # the default first, then the others
    assert [{k: t[k] for k in base} for t in gated["timings"]] == tiles and len(tiles) >= 2
    assert all(t.get("us") == 1.0 for t in gated["timings"]), gated["timings"]
    assert gated["best"] is not None and gated["product_then_silu_mul_us"] == 1.0
    # time_gemv also times the launcher's own pick (config None, the default again): one check
    # and one call per weight copy for it and for each tile
    assert launched.count(True) == (1 + len(tiles)) * (1 + len(ws)) and launched.count(False) == len(ws)


def test_skinny_gemm_refuses_unknown_projection_names(monkeypatch, capsys):
    """`bench_skinny_gemm --projections` names projections of its shapes; a misspelt one is an
    argument error before anything is timed."""
    bench = bench_module("bench_skinny_gemm")
    monkeypatch.setattr(sys, "argv", ["bench_skinny_gemm.py", "--projections", "gate_up,gateup"])
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: pytest.fail("timed before checking its arguments"))
    with pytest.raises(SystemExit) as exc:
        bench.main()
    assert exc.value.code == 2
    assert "gateup" in capsys.readouterr().err
