"""Pass `rank_one_products`: a matrix product over one contracted element becomes a multiply.

HF's rotary embedding in transformers 5.17 computes its angles as an outer product,
``inv_freq[None, :, None].float() @ position_ids[:, None, :].float()`` (``[B, D/2, 1] @
[B, 1, T]``). Inductor hands every ``matmul`` to cuBLAS, so each decode step launches an fp32
GEMM with K = 1 (a cutlass SIMT kernel of about 3 us on an H100) and a copy making its operands
contiguous, at the head of the step where no kernel before it can hide them. As ``a * b`` (the
operands broadcast against each other) the angles join the cos/sin kernel inductor already
emits. Newer transformers write the product as a multiply themselves; there the pass finds
nothing.

Equal values: with one contracted element every output is the single product ``a[..., i, 0] *
b[..., 0, j]``, rounded once to the output dtype by the GEMM (an fp32 accumulator holds a
product of two 16-bit values exactly) and by the multiply alike. The batch dimensions
broadcast by the same rule in ``matmul`` and in ``*``. (A GEMM adds the product to a zero
accumulator, so a product of -0.0 may come out +0.0 there; equal as values.)

Rewritten: ``operator.matmul`` / ``torch.matmul`` / ``torch.bmm`` / ``Tensor.matmul`` /
``Tensor.bmm`` calls of two tensors of at least two dimensions each, whose contracted size is
the static integer 1, one floating dtype for both operands and the result (an autocast region
that changes the result's dtype is left alone), and, for float32, a matmul precision of IEEE
fp32 at compile time (a TF32 product rounds its operands: left to cuBLAS so the result stays
HF's).

Runs on Dynamo graphs (torch-level calls), paged and stateless. The product's result was
contiguous, so the multiply is followed by ``contiguous()`` (free where its operands already
make it so, as in the rotary angles); that node keeps the product's ``example_value``.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

logger = logging.getLogger(__name__)

#: Call targets of a matrix product (call_function) and the method names (call_method).
PRODUCT_FUNCTIONS = (operator.matmul, torch.matmul, torch.bmm)
PRODUCT_METHODS = ("matmul", "bmm", "__matmul__")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class RankOneResult:
    """``rewritten``: names of the products that became multiplies; ``refused``: (node name,
    reason) for products over one element that stayed products."""

    rewritten: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)


def fp32_products_are_ieee() -> bool:
    """Whether float32 matrix products run in IEEE fp32 now (no TF32 or bf16 rounding of the
    operands), on CUDA and on CPU's oneDNN, read from torch's settings of this version."""
    cuda = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if cuda is None:  # torch without the per-backend precision settings
        return not torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "highest"
    default = getattr(torch.backends, "fp32_precision", "none")
    mkldnn = getattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", "none")
    resolved = [default if p == "none" else p for p in (cuda, mkldnn)]
    return all(p in ("none", "ieee") for p in resolved)


def _operands(node: fx.Node) -> tuple | None:
    """``(a, b)`` if ``node`` is a matrix product of two graph values, else None."""
    if node.kwargs or len(node.args) != 2:
        return None
    if node.op == "call_function" and node.target in PRODUCT_FUNCTIONS:
        a, b = node.args
    elif node.op == "call_method" and node.target in PRODUCT_METHODS:
        a, b = node.args
    else:
        return None
    return (a, b) if isinstance(a, fx.Node) and isinstance(b, fx.Node) else None


def _why_not(a: torch.Tensor, b: torch.Tensor, out, ieee: bool) -> str | None:
    """Why the product of ``a`` and ``b`` (one contracted element; ``out`` its example value)
    must stay a product, or None when ``a * b`` equals it."""
    if not isinstance(out, torch.Tensor):
        return "no example value for the result"
    if not (a.dtype == b.dtype == out.dtype):
        return f"dtypes {a.dtype} @ {b.dtype} -> {out.dtype} (an autocast region)"
    if a.dtype not in _FLOATS:
        return f"dtype {a.dtype} is not a floating type"
    if a.dtype == torch.float32 and not ieee:
        return "float32 products may round to TF32 here (torch's matmul precision): HF's result would differ"
    return None  # (a bmm traced only with 3-D operands of one batch size: ``*`` gives its result)


def _contracts_one(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a @ b`` (both at least 2-D) contracts over one element, statically."""
    if a.dim() < 2 or b.dim() < 2:
        return False
    ka, kb = a.shape[-1], b.shape[-2]
    return isinstance(ka, int) and isinstance(kb, int) and ka == 1 and kb == 1


def rank_one_products(gm: fx.GraphModule) -> RankOneResult:
    """Rewrite ``gm`` in place: each matrix product over one contracted element becomes
    ``torch.mul(a, b).contiguous()`` (see the module doc for the conditions; inductor fuses
    both into the kernel of their reader). Returns what changed."""
    result = RankOneResult()
    ieee = fp32_products_are_ieee()
    for node in list(gm.graph.nodes):
        operands = _operands(node)
        if operands is None:
            continue
        a, b = (x.meta.get("example_value") for x in operands)
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or not _contracts_one(a, b):
            continue
        out = node.meta.get("example_value")
        reason = _why_not(a, b, out, ieee)
        if reason is not None:
            result.refused.append((node.name, reason))
            logger.debug("rank_one_products: %s stays a product: %s", node.name, reason)
            continue
        with gm.graph.inserting_before(node):
            mul = gm.graph.call_function(torch.mul, operands)
            # a product's result is contiguous; a broadcast multiply's need not be (it follows
            # its operands' layout), and a ``view`` after it may rely on that
            dense = gm.graph.call_method("contiguous", (mul,))
        mul.meta.update({k: v for k, v in node.meta.items() if k != "example_value"})  # its value: fill_example_values
        dense.meta.update(node.meta)
        node.replace_all_uses_with(dense)
        gm.graph.erase_node(node)
        result.rewritten.append(mul.name)
    if result.rewritten:
        gm.graph.lint()
        gm.recompile()
    return result
