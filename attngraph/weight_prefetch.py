"""Ask L2 for a projection's weight while the kernel before it still runs.

Under programmatic dependent launch (`attngraph.pdl`) a GEMV or small-GEMM program starts
before its input ``x`` exists; until ``gdc_wait()`` returns it may read only what no recent
kernel writes: the weight. The kernels here already load their first weight chunk into
registers there. A program's remaining chunks would follow only after the wait, so a projection
behind a latency-bound kernel (the o projection behind decode attention, a few microseconds
that use little of the memory bandwidth) streams most of its weight after that kernel ends.
`prefetch_rows_l2` issues ``prefetch.global.L2`` for the rest of the program's weight range,
one per 128-byte line, and holds no registers for it: the loads after the wait find the lines
in L2 (50 MB on an H200: a 1B projection's 8-32 MB fit).

Only programs resident before the wait prefetch early; the others issue their prefetches right
before their own loads, which costs a few instructions. A prefetch is a hint: it changes no
result, and row and column indices are clamped into the weight, so no line outside it is asked
for.

`prefetch_bytes_l2` asks L2 for a whole byte range in one small launch of bulk prefetches
(``cp.async.bulk.prefetch.L2``, no registers held): the Triton backend issues it before a
layer's decode attention for the layer's feed-forward weight
(`CompileConfig.l2_prefetch_mlp_bytes`), so memory otherwise idle during attention streams
weights the GEMM after it would read. Off by default too: slower on an H200 (1B batch 1: 1.038
against 0.967-0.996 ms; `CompileConfig.l2_prefetch_mlp_bytes` gives the numbers).

`bulk_prefetch_l2` is that instruction for a kernel's own lanes: the Triton decode attention
kernel issues it past its wait for the layer's output weight (`CompileConfig.l2_prefetch_o`,
off by default as well).

`ENABLED` (``ATTNGRAPH_WEIGHT_PREFETCH=1``) is off by default: on an H200 it made the
Llama-3.2-1B-shaped decode step slower (batch 1: 1.067 against 0.978 ms; batch 16: 1.238
against 1.092; ``benchmarks/bench_generate.py --prefetch on,off``,
``benchmarks/results/generate_switches_h200_2026-12-05.json``), most likely because the
prefetches compete for the bandwidth the kernel before the wait is still using. `enabled`
applies it only where the kernels launch with PDL. A CUDA graph keeps what was set when it
was captured.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import gdc_launch_dependents, gdc_wait

#: Prefetch the rest of each program's weight range into L2 before ``gdc_wait`` (see the module).
ENABLED = os.environ.get("ATTNGRAPH_WEIGHT_PREFETCH", "0") == "1"

#: Bytes per L2 line on the GPUs with PDL (Hopper, Blackwell).
LINE_BYTES = 128
#: Bytes per bulk prefetch of `prefetch_bytes_l2` (a multiple of 16, the instruction's unit).
BULK_BYTES = 16384
#: Bulk prefetches per program of `prefetch_bytes_l2` (one per thread of its one warp).
BULK_PER_PROGRAM = 32


def enabled(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` now prefetch: `ENABLED` and PDL (`pdl.enabled`)."""
    return ENABLED and pdl.enabled(device)


def line_elements(weight: torch.Tensor) -> int:
    """Elements of ``weight``'s dtype per L2 line (64 for bf16 / fp16)."""
    return max(LINE_BYTES // weight.element_size(), 1)


@triton.jit
def prefetch_rows_l2(W, offs_n, N, stride_wn, k_from, k_hi, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     LINE: tl.constexpr):  # fmt: skip
    """``prefetch.global.L2`` of the weight rows ``offs_n`` (``[BLOCK_N]``; those past ``N``
    clamped to the last row) over columns ``[k_from, k_hi)``, one per ``LINE`` elements (one
    128-byte line; the last clamped to ``k_hi - 1``), walked ``BLOCK_K`` columns at a time.
    W: ``[N, K]``, rows ``stride_wn`` apart. Nothing is returned or written."""
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_rows = W + rows[:, None] * stride_wn  # [BLOCK_N, 1]
    for k0 in range(k_from, k_hi, BLOCK_K):
        offs = tl.minimum(k0 + tl.arange(0, BLOCK_K // LINE) * LINE, k_hi - 1)  # [BLOCK_K // LINE]
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [w_rows + offs[None, :]],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def bulk_prefetch_l2(ptrs, valid, PIECE: tl.constexpr):
    """``cp.async.bulk.prefetch.L2`` of ``PIECE`` bytes (a multiple of 16) from each address of
    ``ptrs`` (16-byte aligned) where ``valid`` holds (same shape). One instruction per element:
    give it a 1-D tensor of one element per thread (``32 * num_warps``), or each replica of an
    element issues it again. NVIDIA GPUs of compute capability 9.0 or later only."""
    sizes = tl.full(ptrs.shape, PIECE, tl.int32)
    tl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $3, 0;\n\t@p cp.async.bulk.prefetch.L2.global [$1], $2;"
        "\n\tmov.u32 $0, 0;\n\t}",
        "=r,l,r,r", [ptrs, sizes, valid.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _bulk_prefetch_l2_kernel(W, nbytes, BULK: tl.constexpr, PER: tl.constexpr, USE_PDL: tl.constexpr):
    """``cp.async.bulk.prefetch.L2`` of bytes ``[0, nbytes)`` from ``W`` (``nbytes`` a multiple
    of ``BULK``), ``PER`` pieces of ``BULK`` bytes per program. The prefetches read nothing any
    kernel writes, so they are issued before ``gdc_wait``; the wait keeps the stream's order
    (the kernel after this one waits for this one only)."""
    offs = (tl.program_id(0) * PER + tl.arange(0, PER)).to(tl.int64) * BULK
    bulk_prefetch_l2(W.to(tl.pointer_type(tl.int8)) + tl.minimum(offs, nbytes - BULK), offs < nbytes, BULK)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


def prefetchable_bytes(t: torch.Tensor, nbytes: int) -> int:
    """How many of the first ``nbytes`` bytes from ``t.data_ptr()`` `prefetch_bytes_l2` asks
    for: at most what ``t``'s storage holds from there, rounded down to `BULK_BYTES`; 0 for an
    address not 16-byte aligned."""
    if nbytes <= 0 or t.data_ptr() % 16:
        return 0
    storage = t.untyped_storage()
    left = storage.nbytes() - (t.data_ptr() - storage.data_ptr())
    return min(int(nbytes), left) // BULK_BYTES * BULK_BYTES


def prefetch_bytes_l2(t: torch.Tensor, nbytes: int) -> bool:
    """Ask L2 for the first ``nbytes`` bytes of memory from ``t.data_ptr()`` (within ``t``'s
    storage; `prefetchable_bytes`): one launch of ``cdiv(bytes, BULK_BYTES * BULK_PER_PROGRAM)``
    one-warp programs, with programmatic dependent launch, so the prefetches are issued while
    the kernel before still runs. A hint: no result changes. Runs only where the device has PDL
    (`pdl.enabled`: compute capability 9.0 or later, where the bulk prefetch exists); returns
    whether it launched."""
    size = prefetchable_bytes(t, nbytes)
    if size == 0 or not pdl.enabled(t.device):
        return False
    per = BULK_BYTES * BULK_PER_PROGRAM
    _bulk_prefetch_l2_kernel[(triton.cdiv(size, per),)](
        t, size, BULK=BULK_BYTES, PER=BULK_PER_PROGRAM, USE_PDL=True, num_warps=1, **pdl.launch_options(True)
    )
    return True
