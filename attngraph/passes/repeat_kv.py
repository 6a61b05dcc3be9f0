"""The grouped-query K/V repetition in front of an attention site, proven or refused.

`peel_repeat_kv` sees through HF's ``repeat_kv`` (and the other spellings of the same grouped
mapping) so that the op gets the unrepeated K/V with its own head count; any index that could
permute heads or positions is refused with the reason.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from . import fx_utils as fu
from .mask_analysis import extract_subgraph, unseen_mutation, value_inputs


def peel_repeat_kv(gm: fx.GraphModule, x: Any) -> tuple[Any, int, str]:
    """``(k, n_rep, "")`` when ``x`` is provably the grouped repetition of ``k`` (query head
    ``h`` reads key head ``h // n_rep``); ``(x, 1, "")`` when ``x`` is used as it is;
    ``(x, 1, reason)`` when ``x`` has the form of HF's repeat_kv but indexes something else too.

    Accepted: ``k[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)`` (HF's
    repeat_kv, with no index but the new axis), ``k.repeat_interleave(n, dim=1)`` with an
    integer ``n``, and ``k[:, idx]`` with an ``idx`` computed from constants alone whose value
    is ``arange(h).repeat_interleave(n)``. Any other index (a permutation of the heads, a
    reversed sequence) is not the grouped mapping: the tensor is then used as computed, or,
    inside the repeat_kv form, the site is refused.
    """
    if fu.is_op(x, fu.RESHAPE):
        e = x.args[0]
        if fu.is_op(e, fu.EXPAND) and fu.is_op(e.args[0], fu.GETITEM):
            g = e.args[0]
            index = g.args[1]
            if isinstance(index, tuple) and len(index) in (3, 4, 5) and index[2] is None:
                if any(not _full_slice(i) for k, i in enumerate(index) if k != 2):
                    return x, 1, (
                        f"the keys/values are repeated for grouped-query attention through the index "
                        f"{_show_index(index)} ({g.name}), which is not only the new group axis: it may "
                        "permute heads or positions, so the grouped mapping is not proven"
                    )
                src = g.args[0]
                s_src, s_out = fu.shape_of(src), fu.shape_of(x)
                s_exp = fu.shape_of(e)
                if s_src is not None and s_out is not None and s_exp is not None and len(s_src) == 4 and len(s_exp) == 5:
                    n_rep = fu.size_hint(s_exp[2])
                    if (
                        fu.size_hint(s_out[1]) == fu.size_hint(s_src[1]) * n_rep
                        and all(fu.same_size(s_out[i], s_src[i]) for i in (0, 2, 3))
                        and all(fu.same_size(s_exp[i], s_src[j]) for i, j in ((0, 0), (1, 1), (3, 2), (4, 3)))
                    ):
                        return src, n_rep, ""
    if fu.is_op(x, fu.REPEAT_INTERLEAVE):
        n_rep = fu.arg(x, 1, "repeats")
        dim = fu.arg(x, 2, "dim")
        if isinstance(n_rep, int) and dim in (1, -3) and fu.arg(x, 3, "output_size") in (None,):
            return x.args[0], n_rep, ""
    if fu.is_op(x, fu.GETITEM) and isinstance(x.args[1], tuple) and len(x.args[1]) == 2:
        first, idx = x.args[1]
        n_rep = _grouped_index(gm, idx, fu.shape_of(x.args[0])) if _full_slice(first) else None
        if n_rep is not None:
            return x.args[0], n_rep, ""
    return x, 1, ""


def _full_slice(i: Any) -> bool:
    return isinstance(i, slice) and i.start is None and i.stop is None and i.step is None


def _show_index(index: tuple) -> str:
    def one(i):
        if i is None:
            return "None"
        if _full_slice(i):
            return ":"
        return i.name if isinstance(i, fx.Node) else repr(i)

    return "[" + ", ".join(one(i) for i in index) + "]"


def _grouped_index(gm: fx.GraphModule, idx: Any, src_shape: tuple | None) -> int | None:
    """``n`` when ``idx`` is computed from constants alone (no input values, no size symbol,
    no in-place write) and equals ``arange(h).repeat_interleave(n)`` for the ``h`` heads of a
    ``[B, h, S, D]`` source; else None."""
    val = fu.example_value(idx)
    if not isinstance(idx, fx.Node) or not isinstance(val, torch.Tensor) or val.dim() != 1 or src_shape is None:
        return None
    if len(src_shape) != 4 or val.dtype in (torch.bool, torch.uint8) or val.dtype.is_floating_point:
        return None
    if value_inputs(idx) or unseen_mutation(idx) is not None:
        return None
    sub, inputs = extract_subgraph(gm, idx)
    if inputs:  # sizes or inputs: the value may change between calls
        return None
    try:
        with torch.no_grad():
            got = sub()
    except Exception:
        return None
    h = fu.size_hint(src_shape[1])
    if not isinstance(got, torch.Tensor) or got.numel() % h or got.numel() == 0:
        return None
    n = got.numel() // h
    want = torch.arange(h).repeat_interleave(n)
    return n if torch.equal(got.cpu().long(), want) else None
