"""Which weight each decode layer asks into L2 during its attention (`CompileConfig.l2_prefetch_mlp_bytes`).

A decode step at batch 1 alternates bandwidth-bound projections with latency-bound kernels
(the rotary embedding, decode attention, RMSNorm) that leave the memory idle. The layer's
feed-forward input projection (a dense gated MLP's fused gate/up weight, the largest read of
the layer) comes right after them, so its first bytes can be streamed into L2 while attention
runs (`weight_prefetch.prefetch_bytes_l2`, launched by the Triton backend before the layer's
decode attention kernel).

`mlp_prefetch_source` maps attention layer ``i`` to decoder layer ``i`` of the model's layer
list and returns, per layer, the first weight its MLP reads (the first ``nn.Linear`` of the
MLP's submodules) extended over the parameters of the MLP laid out right after it in the same
storage (`passes.fuse_linears` makes gate and up rows of one tensor). Models whose decoder
layers cannot be matched to the attention layers one to one, and mixture-of-experts MLPs
(more than three linears: the experts read depends on the routing), get no prefetch.

Measured on an H200 it does not pay: the decode step's GPU busy time grew by 0.06-0.07 ms at
1B batch 1 with 16 or 32 MiB per layer, and by 0.17 ms at 8B (`CompileConfig`'s docstring has
the numbers): most likely the streamed bytes cost the kernels during attention more than the
GEMM after it gains. Hence off by default.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

#: Attribute names of a decoder layer's feed-forward block in transformers' models.
MLP_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe")
#: Most linears a dense MLP holds (gate, up, down); more: experts.
MAX_DENSE_LINEARS = 3


def decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList | None:
    """The model's list of ``num_layers`` decoder layers (the `nn.ModuleList` of that length
    whose entries have an MLP, the one with the most parameters), or None."""
    best, best_params = None, -1
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or len(module) != num_layers or num_layers == 0:
            continue
        if not all(mlp_of(layer) is not None for layer in module):
            continue
        params = sum(p.numel() for p in module.parameters())
        if params > best_params:
            best, best_params = module, params
    return best


def mlp_of(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's feed-forward block (`MLP_NAMES`), or None."""
    for name in MLP_NAMES:
        mlp = getattr(layer, name, None)
        if isinstance(mlp, nn.Module):
            return mlp
    return None


def first_weight_range(mlp: nn.Module) -> tuple[torch.Tensor, int] | None:
    """``(weight, bytes)``: the weight of the MLP's first linear and the bytes from its start
    covered by it and the MLP's parameters laid out right after it in its storage (the fused
    gate/up rows); None for a mixture of experts or an MLP without linears."""
    linears = [m for m in mlp.modules() if isinstance(m, nn.Linear)]
    if not linears or len(linears) > MAX_DENSE_LINEARS:
        return None
    first = linears[0].weight
    storage = first.untyped_storage().data_ptr()
    ranges = sorted(
        (p.data_ptr(), p.numel() * p.element_size()) for p in mlp.parameters()
        if p.device == first.device and p.untyped_storage().data_ptr() == storage
    )  # fmt: skip
    end = first.data_ptr()
    for start, size in ranges:
        if start == end:
            end = start + size
    return first, end - first.data_ptr()


#: What a prefetch source gives for a layer: a tensor and the bytes from its start, or None.
Range = tuple[torch.Tensor, int] | None


def layer_source(model: nn.Module, num_layers: int, pick: Callable[[nn.Module], Range]) -> Callable[[int], Range]:
    """``layer_id -> (tensor, bytes) or None``: ``pick`` of decoder layer ``layer_id`` of the
    model's layer list (`decoder_layers`, found at the first call), looked up when asked, since
    `passes.fuse_linears` moves the weights while the model compiles (the layer list, which
    fusion leaves in place, stays). None past the list, or where no list matches."""
    found_layers: list[nn.ModuleList | None] = []

    def source(layer_id: int) -> tuple[torch.Tensor, int] | None:
        if not found_layers:
            found_layers.append(decoder_layers(model, num_layers))
        layers = found_layers[0]
        if layers is None or not 0 <= layer_id < len(layers):
            return None
        return pick(layers[layer_id])

    return source


def mlp_prefetch_source(model: nn.Module, num_layers: int, nbytes: int) -> Callable[[int], tuple[torch.Tensor, int] | None]:
    """``layer_id -> (weight, bytes) or None``: the first ``nbytes`` bytes (at most) of
    attention layer ``layer_id``'s MLP input weight (`first_weight_range`; `layer_source`)."""

    def pick(layer: nn.Module) -> tuple[torch.Tensor, int] | None:
        found = first_weight_range(mlp_of(layer))
        return None if found is None else (found[0], min(int(nbytes), found[1]))

    return layer_source(model, num_layers, pick)
