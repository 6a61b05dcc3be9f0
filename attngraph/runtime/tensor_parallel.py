"""Models sharded by transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")``).

transformers shards the weights over a ``torch.distributed`` process group (DTensors) and adds
the collectives itself (all-reduce after the row-parallel ``o_proj`` / ``down_proj``, an
all-gather of the column-parallel ``lm_head``). Dynamo traces them as functional collectives,
which stay in the compiled graph (and in the CUDA graphs: NCCL allows capture). Each rank then
traces its own shard: its attention sites have ``heads / world`` query and KV heads, and its
KV pool is sized by those. Every rank must run the same schedule of steps (the same
``generate`` calls with the same inputs and seeds), as transformers' own tensor parallelism
requires, so that pages and graphs agree across ranks.

The checks here fail the same way on every rank (they read only the config and the rank
count), so a refused model raises everywhere instead of leaving ranks waiting in a collective.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedModelError


def _mesh(model: torch.nn.Module):
    """The device mesh the model's weights are sharded over, or None (no DTensor weight)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh
    return None


def tensor_parallel_size(model: torch.nn.Module) -> int:
    """Ranks the model's weights are sharded over (1 when none is a DTensor)."""
    mesh = _mesh(model)
    return 1 if mesh is None else int(mesh.size())


def agreed_across_ranks(model: torch.nn.Module, num_pages: int, device: torch.device) -> int:
    """The smallest of every rank's KV-pool page count (``num_pages`` without tensor
    parallelism). Pools sized from each GPU's free memory may differ; with equal pools a full
    pool is hit by every rank at the same step (the same error everywhere), never by one rank
    while the others wait for it in a collective. Every rank calls this at `accelerate` time."""
    mesh = _mesh(model)
    if mesh is None or mesh.size() == 1:
        return num_pages
    import torch.distributed as dist

    pages = torch.tensor([num_pages], dtype=torch.int64, device=device)
    dist.all_reduce(pages, op=dist.ReduceOp.MIN, group=mesh.get_group())
    return int(pages.item())


def _head_counts(config) -> tuple[int | None, int | None]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hq = getattr(text, "num_attention_heads", None)
    hkv = getattr(text, "num_key_value_heads", None) or hq
    return hq, hkv


def check_shardable(model: torch.nn.Module) -> int:
    """The rank count, after checking that it divides the model's query and KV heads."""
    world = tensor_parallel_size(model)
    if world == 1:
        return 1
    hq, hkv = _head_counts(model.config)
    bad = [f"{n} {name}" for n, name in ((hq, "query heads"), (hkv, "KV heads")) if n is not None and n % world]
    if bad:
        raise UnsupportedModelError(
            f"the model is sharded over {world} ranks, which does not divide its {' and '.join(bad)}: each rank "
            f"would hold part of a head. Use a rank count that divides {hq} and {hkv} (torchrun --nproc-per-node)"
        )
    return world


def check_local_heads(model: torch.nn.Module, world: int, num_q_heads: int, num_kv_heads: int) -> None:
    """The traced attention holds this rank's share of the heads (``heads / world``)."""
    if world == 1:
        return
    hq, hkv = _head_counts(model.config)
    if hq is None or hkv is None:
        return
    if (num_q_heads * world, num_kv_heads * world) != (hq, hkv):
        raise UnsupportedModelError(
            f"the model is sharded over {world} ranks, but this rank's traced attention has {num_q_heads} query / "
            f"{num_kv_heads} KV heads for a model of {hq} / {hkv}: a sharding the passes do not understand "
            "(expected each rank to hold heads / ranks of both). Shard with transformers' tp_plan, or accelerate "
            "the unsharded model"
        )
