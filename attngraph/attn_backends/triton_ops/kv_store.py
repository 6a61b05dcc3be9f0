"""`store_kv`: a step's new K and V written into a layer's pool slots by one kernel.

Two ``index_copy_`` calls (one per buffer) cost two launches per layer; at batch-1 decode the
launches, not the bytes, are the cost (about 2 us each on an H200, 64 per 1B-shaped step).
One program per token copies its K row and its V row; launched with programmatic dependent
launch where `attngraph.pdl` allows it (the slot is read before the wait for the kernel that
produced K and V).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import pdl
from ...pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _store_kv_kernel(
    K, V, KBuf, VBuf, Loc,
    stride_kt, stride_kh, stride_vt, stride_vh,
    HEADS: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)  # the step's slots: no kernel of the step writes them
    if USE_PDL:  # K and V may still be being written by the kernel before (attngraph.pdl)
        gdc_wait()
        gdc_launch_dependents()
    offs_h = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    mask_h = offs_h < HEADS
    offs_d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    mask = mask_h & (offs_d < D)
    k = tl.load(K + t * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    tl.store(KBuf + slot * (HEADS * D) + offs_h * D + offs_d, k, mask=mask)
    offs_dv = tl.arange(0, BLOCK_DV)[None, :]
    mask_v = mask_h & (offs_dv < DV)
    v = tl.load(V + t * stride_vt + offs_h * stride_vh + offs_dv, mask=mask_v)
    tl.store(VBuf + slot * (HEADS * DV) + offs_h * DV + offs_dv, v, mask=mask_v)


def store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``k_buffer[loc[t]] = k[t]`` and ``v_buffer[loc[t]] = v[t]`` for every new token ``t``.

    ``k_buffer: [num_slots, Hkv, D]`` and ``v_buffer: [num_slots, Hkv, Dv]``, contiguous (a
    layer's pool flattened over pages); ``loc: [T]`` integer slots (repeats allowed only where
    the rows written are interchangeable, as CUDA-graph padding rows on the dummy page are);
    ``k: [T, Hkv, D]``, ``v: [T, Hkv, Dv]`` with unit stride in the last dimension (rows may
    be strided: views of a fused q/k/v projection). Another dtype than the pool's is
    converted by torch first (round to nearest; the runtime's K/V already have the pool's).
    """
    t = loc.shape[0]
    if k.shape[0] != t or v.shape[0] != t:
        raise ValueError(f"store_kv: {t} slots for {k.shape[0]} K rows and {v.shape[0]} V rows")
    heads, d, dv = k_buffer.shape[1], k_buffer.shape[2], v_buffer.shape[2]
    if tuple(k.shape[1:]) != (heads, d) or tuple(v.shape[1:]) != (heads, dv):
        raise ValueError(f"store_kv: K {tuple(k.shape)} / V {tuple(v.shape)} do not match the pool's {heads} heads x {d} / {dv}")
    if not (k_buffer.is_contiguous() and v_buffer.is_contiguous()):
        raise ValueError("store_kv: the pool buffers must be contiguous")
    if t == 0:
        return
    if k.dtype != k_buffer.dtype or k.stride(2) != 1:
        k = k.to(k_buffer.dtype).contiguous()
    if v.dtype != v_buffer.dtype or v.stride(2) != 1:
        v = v.to(v_buffer.dtype).contiguous()
    use_pdl = pdl.enabled(k.device)
    _store_kv_kernel[(t,)](
        k, v, k_buffer, v_buffer, loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HEADS=heads, D=d, DV=dv, BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(d), BLOCK_DV=triton.next_power_of_2(dv),
        USE_PDL=use_pdl, num_warps=4 if heads * max(d, dv) >= 1024 else 2, **pdl.launch_options(use_pdl),
    )  # fmt: skip
