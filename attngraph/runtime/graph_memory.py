"""Graph-pool and capture helpers shared by the decode, prefill and piecewise graph runners.

Every graph of a model is captured into one private memory pool, largest size first. A
graph's outputs live in that pool; holding them as ordinary tensors would keep each graph's
outputs reserved, so the pool would grow with the sum over all captured sizes. The runners
keep *non-owning* views of them instead (the storage points at the pool memory but does not
keep it allocated), so a later capture may reuse that memory: replays of different sizes
never overlap, and each replay rewrites its outputs before they are read.
"""

from __future__ import annotations

from typing import Callable

import torch


def non_owning(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t``'s memory that does not keep it allocated (CUDA tensors only)."""
    storage = t.untyped_storage()
    meta = {
        "nbytes": storage.nbytes(),
        "data_ptr": storage.data_ptr(),
        "size": t.shape,
        "stride": t.stride(),
        "dtype": t.dtype,
        "device": t.device,
        "storage_offset": t.storage_offset(),
    }
    weak = torch._C._construct_storage_from_data_pointer(meta["data_ptr"], meta["device"], meta["nbytes"])
    return torch._C._construct_CUDA_Tensor_From_Storage_And_Metadata(meta, weak)


def non_owning_tree(value):
    """`non_owning` applied to every CUDA tensor of a (nested) tuple / list output."""
    if isinstance(value, torch.Tensor):
        return non_owning(value) if value.is_cuda else value
    if isinstance(value, (tuple, list)):
        return type(value)(non_owning_tree(v) for v in value)
    return value


def pool_bytes(device: torch.device) -> int:
    """Bytes the caching allocator holds on ``device`` (graph pools included)."""
    return int(torch.cuda.memory_reserved(device))


def capture_step(step: Callable[[], torch.Tensor], stream: torch.cuda.Stream, mempool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Record ``step()`` as a CUDA graph on ``stream`` into ``mempool``; returns the graph and
    a non-owning view of its output.

    ``step`` runs once on ``stream`` first, outside the capture: kernels are compiled and
    autotuned for the size, and lazily created state (cuBLAS's workspace, which belongs to a
    stream, Triton's launchers) exists before recording. The runners of one model share one
    ``stream``: every stream that runs a GEMM keeps a cuBLAS workspace (32 MiB on Hopper).
    """
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=mempool, stream=stream):
        out = step()
    return graph, non_owning_tree(out)
