"""Where the seconds of `attngraph.accelerate()` go, in one process.

A Llama-3.2-1B-shaped (or 8B-shaped) model, random weights, bf16, the default config. Prints
one JSON line: the import time of torch + transformers + attngraph, the whole ``accelerate()``,
and its phases (each phase's seconds include the ones listed under it):

* ``trace``: the first compile: Dynamo's trace and the compiler backend;
  * ``backend_call``: attngraph's passes, the split into pieces and their inductor compiles;
    * ``build_piecewise``: the split, the fake run over the pieces, the compiles;
    * ``pass_pipeline``, ``fill_example_values``;
* ``warmup``: the dummy steps and the CUDA-graph captures (``capture``);
* ``aot_autograd`` / ``inductor_cache``: the cache counters (a ``bypass`` re-traces a graph);
* ``dynamo``: Dynamo's own timers above 0.25 s (``_compile.compile_inner`` is the whole first
  compile; ``create_aot_dispatcher_function`` appears only for graphs not loaded from a cache);
* ``triton_jit``: attngraph's own Triton kernels (``@triton.jit``; inductor's kernels compile
  through their own path) compiled in the process: variants per kernel and their seconds (a
  variant found in Triton's disk cache takes milliseconds).

Run it twice in fresh processes: the first pays inductor's and Triton's compiles (caches
cold), the second shows what every later start costs. Python's own bytecode should be there as
after a pip install: where the environment has none (``PYTHONDONTWRITEBYTECODE=1``, no
``__pycache__``), compile it first, e.g. ``PYTHONPYCACHEPREFIX=/tmp/pyc python -m compileall -q
-j 0 <site-packages> <stdlib> .`` and run with the same ``PYTHONPYCACHEPREFIX``; otherwise every
process compiles the modules it imports from source.

    python benchmarks/profile_startup.py --shape 1b --out x.json
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import json
import os
import sys
import time

_t0 = time.perf_counter()
import torch  # noqa: E402

importlib.import_module("transformers")  # timed with the rest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import attngraph  # noqa: E402
from bench_prefill import random_model, result_header  # noqa: E402

IMPORT_S = time.perf_counter() - _t0
SECONDS: dict[str, float] = collections.defaultdict(float)


def _timed(owner, name: str, key: str) -> None:
    """Add the time of every call of ``owner.name`` to ``SECONDS[key]``."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SECONDS[key] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def instrument() -> None:
    from attngraph.compiler import backend, pipeline
    from attngraph.passes import fx_utils
    from attngraph.runtime import cuda_graph, extend_graph, model_runner, piecewise

    _timed(model_runner.ModelRunner, "_trace", "trace")
    _timed(backend.AttnGraphBackend, "__call__", "backend_call")
    _timed(piecewise, "build_piecewise", "build_piecewise")  # looked up when the runner is made
    _timed(pipeline.PassPipeline, "run", "pass_pipeline")
    _timed(fx_utils, "fill_example_values", "fill_example_values")
    _timed(model_runner.ModelRunner, "warmup", "warmup")
    _timed(model_runner.ModelRunner, "_capture_graphs", "capture")
    for module in (cuda_graph, extend_graph):
        _timed(module, "capture_step", "capture_steps")


TRITON_JIT: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"variants": 0, "s": 0.0})


def count_triton_compiles() -> None:
    """Count the ``@triton.jit`` variants compiled (or loaded from disk) in this process."""
    import triton

    started: dict[object, float] = {}

    def before(*, key, fn, **_):
        started[key] = time.perf_counter()
        return False  # go on and compile

    def after(*, key, fn, **_):
        row = TRITON_JIT[str(getattr(fn, "name", fn)).rsplit(".", 1)[-1]]
        row["variants"] += 1
        row["s"] += time.perf_counter() - started.pop(key, time.perf_counter())

    triton.knobs.runtime.jit_cache_hook = before
    triton.knobs.runtime.jit_post_compile_hook = after


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=["1b", "8b"], default="1b")
    p.add_argument("--out", default=None, help="append the JSON line to this file")
    p.add_argument("--cprofile", default=None, help="write cProfile's top functions (cumulative) of accelerate() here")
    args = p.parse_args()
    instrument()
    count_triton_compiles()
    model = random_model(args.shape)
    torch.cuda.synchronize()
    profiler = None
    if args.cprofile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    start = time.perf_counter()
    attngraph.accelerate(model)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("cumulative").print_stats(120)
        stats.sort_stats("tottime").print_stats(60)
        stats.sort_stats("cumulative").print_callees("build_piecewise|compile_graph|call_module")
        with open(args.cprofile, "w") as f:
            f.write(text.getvalue())

    from torch._dynamo.utils import compilation_time_metrics, counters

    row = result_header(
        "profile_startup.py",
        shape=args.shape,
        import_s=round(IMPORT_S, 2),
        accelerate_s=round(seconds, 2),
        phases_s={k: round(v, 2) for k, v in SECONDS.items()},
        aot_autograd=dict(counters["aot_autograd"]),
        inductor_cache={k: v for k, v in counters["inductor"].items() if "cache" in k},
        triton_jit={k: {"variants": v["variants"], "s": round(v["s"], 2)} for k, v in TRITON_JIT.items()},
        dynamo={k: round(sum(v), 2) for k, v in compilation_time_metrics.items() if sum(v) > 0.25},
    )
    line = json.dumps(row)
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
