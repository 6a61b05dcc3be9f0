"""The benchmark scripts' pure helpers (their examples are doctests): the GPU busy time of
overlapping kernels and the idle time between kernels, by boundary."""

import doctest
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_profile_kernels_helpers():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import profile_kernels
    finally:
        sys.path.remove(str(BENCHMARKS))
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
    varies one projection and prunes tiles a thread cannot hold."""
    import json

    pytest.importorskip("triton")
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_gemv_chain
        import bench_generate
    finally:
        sys.path.remove(str(BENCHMARKS))
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
    base = dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=2, SPLIT_K=1)
    variants = bench_gemv_chain.sweep(base, "o", 1, 2048, 2048, [2, 4, 64], [1024], [])
    # the default itself is no variant; BLOCK_N=64 x BLOCK_K=1024 is too wide an accumulator
    assert [o for _, o in variants] == [{"o": dict(base, BLOCK_N=2)}]


def test_decode_step_timing_alternates_lengths_and_counts_collections(monkeypatch):
    """`bench_generate.decode_step_ms` on a stand-in model whose generate takes a known wall
    time per token with a host share of half: the step is the difference of the two lengths
    per token, the host step half of it; the lengths alternate after one warm-up each; a
    collection forced inside a timed generate is counted."""
    import gc
    import time

    import torch

    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_generate
    finally:
        sys.path.remove(str(BENCHMARKS))
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
