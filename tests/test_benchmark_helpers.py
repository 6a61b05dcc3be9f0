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
