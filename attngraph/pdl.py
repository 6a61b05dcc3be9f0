"""Programmatic dependent launch (PDL) of attngraph's Triton kernels on Hopper and later.

A kernel launched with PDL (``kernel[grid](..., launch_pdl=True)``, Triton's
``cuLaunchKernelEx`` with programmatic stream serialization; a programmatic edge once captured
into a CUDA graph) may start while the kernel before it still runs. Its programs then call
``gdc_wait()`` before they read anything an earlier kernel wrote: it returns once the previous
grid has completed and its writes are visible. ``gdc_launch_dependents()`` right after lets the
next PDL kernel start in turn. The decode step's kernels are a few microseconds each, so the
launch and ramp-up they hide is a large part of the step.

Why the reads are ordered. A PDL kernel starts once every program of the kernel before it has
called ``gdc_launch_dependents()`` (or exited); ``gdc_wait()`` returns once that kernel has
completed. Every kernel here calls ``gdc_launch_dependents()`` only after its own ``gdc_wait()``,
so it completes only after its predecessor did, and so on back: when a kernel starts, every
kernel before its predecessor has completed. Hence the contract of the kernels here: before
``gdc_wait()`` a program reads only what the kernel right before it cannot be writing (the
weights; with the decode kernel's fused K/V store also the page table, the lengths and the
pool, written by kernels further back); after it, anything. A kernel launched without PDL
(cuBLAS, a copy) waits for all earlier work as usual, and one launched with PDL after it loses
nothing. Inductor's PDL kernels keep the same order: each waits before its first read of the
previous kernel's output, and every kernel that loads anything waits before it launches its
dependents (``_handle_pdl_after_load`` in ``torch/_inductor/codegen/triton.py``). An inductor
kernel with no load and no dependency on its predecessor does not wait at all: one placed
between a producer and a kernel here would break the order, and nothing here detects it (the
`ATTNGRAPH_PDL=0` switch rules PDL out when a result is in doubt).

`ENABLED` (``ATTNGRAPH_PDL=0`` turns it off) applies to the kernels' launches at the time they
are made, so a CUDA graph holds what was set when it was captured; `enabled` also gates
inductor's own PDL (``triton.enable_pdl`` in `config.resolved_inductor_options`).
"""

from __future__ import annotations

import functools
import os

import torch

#: Launch attngraph's kernels (and let inductor launch its own) with PDL where the device has it.
ENABLED = os.environ.get("ATTNGRAPH_PDL", "1") != "0"

#: Let inductor launch its Triton kernels with PDL too (``triton.enable_pdl``: each waits before
#: its first read of the previous kernel's output), where `ENABLED` and this torch has it.
INDUCTOR = True

#: Compute capability from which CUDA has programmatic dependent launch (Hopper).
MIN_CAPABILITY = (9, 0)


@functools.lru_cache(maxsize=None)
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= MIN_CAPABILITY


# The in-kernel primitives, imported by the kernel modules from here (a @triton.jit function
# reads them as globals of its module). None without Triton or in a Triton without PDL: then
# `enabled` is False and no kernel compiles its USE_PDL code.
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

#: Triton's interpreter (``TRITON_INTERPRET=1``, read once as Triton does): never PDL.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_has_pdl() -> bool:
    """Whether this Triton has the in-kernel primitives (``gdc_wait``, ``gdc_launch_dependents``)."""
    return gdc_wait is not None and gdc_launch_dependents is not None


def launch_options(use_pdl: bool) -> dict[str, bool]:
    """Keyword arguments of a Triton launch: ``launch_pdl=True`` when ``use_pdl``, else none."""
    return {"launch_pdl": True} if use_pdl else {}


def enabled(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` now use PDL: `ENABLED`, an NVIDIA device of compute
    capability >= 9.0 (not ROCm, whose "cuda" devices have no such launch), and a Triton with
    the primitives (never under Triton's interpreter)."""
    if not ENABLED or device.type != "cuda" or torch.version.hip or _INTERPRETED:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_has_pdl(index) and triton_has_pdl()


def inductor_options() -> dict[str, bool]:
    """Inductor settings for attngraph's CUDA compiles: ``{"triton.enable_pdl": True}`` where
    `ENABLED`, `INDUCTOR` and this torch has the setting (inductor applies it on compute
    capability >= 9.0 only), else none."""
    if not (ENABLED and INDUCTOR):
        return {}
    from torch._inductor import config as inductor_config

    return {"triton.enable_pdl": True} if hasattr(inductor_config.triton, "enable_pdl") else {}
