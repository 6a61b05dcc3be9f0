"""Timestamps read inside attngraph's Triton kernels: where a latency-bound kernel's time goes.

A decode step's kernels take a few microseconds each and overlap under programmatic dependent
launch (`attngraph.pdl`), so a profiler's kernel spans do not say when a kernel's programs
started, when their wait for the kernel before returned, or how long a load or an atomic took.
A kernel built with its ``TRACE`` constexpr records, per program, the GPU's global nanosecond
timer (``%globaltimer``) and the SM's cycle counter (``%clock64``) at fixed points of its
path, and the SM it ran on, into a buffer the caller passes; the default build (``TRACE`` off)
holds none of it and computes the same values either way. Spans within one program (its
cycle counter) are exact. The global timer orders programs on different SMs only to within
about 2 us: on an H100 a GEMV's programs stamped their release from the PDL wait before the
kernel they waited for had finished, which the wait forbids (``benchmarks/BENCHMARKS.md``).
``benchmarks/bench_gemv_chain.py --trace`` reads the records of a decode step's kernels.

A stamp takes a value the program has just computed (``dep``, an int32 scalar) and reads the
timers only once that value exists (a predicate on it guards the read), so a stamp after an
atomic or a reduction marks its result's arrival, not the instruction's issue. NVIDIA GPUs
only: Triton's interpreter has no timers (`RECORD` and `decode` are plain Python).

Record of one program (int64, `RECORD` values): ``POINTS`` global-timer stamps (ns), ``POINTS``
cycle stamps, then the SM's index; a point the program did not pass stays 0. The kernels put the
entry in point 0 and the return from the PDL wait in point 1 (the entry again when launched
without PDL).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .errors import InputError

__all__ = ["POINTS", "RECORD", "decode", "new_buffer", "now", "sm_id", "store_record"]

#: Stamps per program.
POINTS = 8
#: int64 values per program record: POINTS timer stamps, POINTS cycle stamps, the SM.
RECORD = 2 * POINTS + 1
_POINTS = tl.constexpr(POINTS)  # globals read by @jit code must be constexpr
_RECORD = tl.constexpr(RECORD)


@triton.jit
def now(dep):
    """``(global ns, SM cycles)`` read once the int32 scalar ``dep`` exists (an impossible
    value of ``dep``, 0x7fc00001, would read 0: the predicate is what orders the reads)."""
    t = tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.eq.b32 p, $1, 0x7fc00001; @!p mov.u64 $0, %globaltimer; @p mov.u64 $0, 0; }",
        "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1,
    )  # fmt: skip
    c = tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.eq.b32 p, $1, 0x7fc00001; @!p mov.u64 $0, %clock64; @p mov.u64 $0, 0; }",
        "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1,
    )  # fmt: skip
    return t, c


@triton.jit
def sm_id(dep):
    """The index of the SM running the program (``%smid``); ``dep``: any int32 scalar."""
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [dep], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def store_record(Trace, program, t0, c0, t1, c1, t2, c2, t3, c3, t4, c4, t5, c5, sm):
    """Program ``program``'s record at ``Trace`` (``[programs, RECORD]`` int64): six stamps
    ``(t, c)`` in points 0-5 (points 6-7 stay as they are) and the SM."""
    base = Trace + program.to(tl.int64) * _RECORD
    tl.store(base + 0, t0)
    tl.store(base + 1, t1)
    tl.store(base + 2, t2)
    tl.store(base + 3, t3)
    tl.store(base + 4, t4)
    tl.store(base + 5, t5)
    tl.store(base + _POINTS + 0, c0)
    tl.store(base + _POINTS + 1, c1)
    tl.store(base + _POINTS + 2, c2)
    tl.store(base + _POINTS + 3, c3)
    tl.store(base + _POINTS + 4, c4)
    tl.store(base + _POINTS + 5, c5)
    tl.store(base + _RECORD - 1, sm.to(tl.int64))


def new_buffer(programs: int, device: torch.device | str) -> torch.Tensor:
    """Zeros for ``programs`` records: ``[programs, RECORD]`` int64 on ``device``."""
    return torch.zeros(programs, RECORD, dtype=torch.int64, device=device)


def decode(buffer: torch.Tensor, names: tuple[str, ...], origin_ns: int | None = None) -> list[dict]:
    """The records of ``buffer`` (``[programs, RECORD]``) as dicts: ``sm``, and for each named
    point (``names[i]`` is point ``i``) its global time in microseconds after ``origin_ns``
    (default: the earliest stamp in the buffer) and its cycle count after the program's first
    stamp. Programs without stamps (never run, or returned before their first) are left out.

    >>> b = torch.zeros(2, RECORD, dtype=torch.int64)
    >>> b[0, :2] = torch.tensor([5000, 7500]); b[0, POINTS:POINTS + 2] = torch.tensor([100, 4100]); b[0, -1] = 3
    >>> decode(b, ("entry", "wait"))
    [{'program': 0, 'sm': 3, 'entry_us': 0.0, 'wait_us': 2.5, 'entry_cycles': 0, 'wait_cycles': 4000}]
    """
    if buffer.dim() != 2 or buffer.shape[1] != RECORD or buffer.dtype != torch.int64 or not 0 < len(names) <= POINTS:
        raise InputError(f"decode takes an int64 [programs, {RECORD}] buffer (new_buffer) and 1 to {POINTS} point names; "
                         f"got {buffer.dtype} {tuple(buffer.shape)} and {len(names)} names")  # fmt: skip
    rows = buffer.cpu().tolist()
    stamps = [t for row in rows for t in row[: len(names)] if t]
    if not stamps:
        return []
    origin = min(stamps) if origin_ns is None else origin_ns
    out = []
    for program, row in enumerate(rows):
        if not row[0]:
            continue
        rec = {"program": program, "sm": row[-1]}
        for i, name in enumerate(names):
            rec[f"{name}_us"] = round((row[i] - origin) / 1e3, 3) if row[i] else None
        for i, name in enumerate(names):
            rec[f"{name}_cycles"] = row[POINTS + i] - row[POINTS] if row[POINTS + i] else None
        out.append(rec)
    return out
