"""The benchmark scripts' pure helpers (their examples are doctests): the GPU busy time of
overlapping kernels and the idle time between kernels, by boundary."""

import doctest
import sys
from pathlib import Path

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
