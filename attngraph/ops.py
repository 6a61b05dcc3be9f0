"""`torch.ops.attngraph.attention`: the op that lowered attention sites call.

Opaque to Dynamo and inductor (a `torch.library.custom_op` with a fake implementation), and
the point where the piecewise split cuts the graph. What it computes depends on the
`ForwardContext`:

* no context, or a context without a batch (the stateless form): dense attention over
  ``batch_size`` equal-length sequences, by the context's backend (torch_native without one);
* a context with a `ForwardBatch` (the paged form): the new tokens' K/V are written into the
  pool and every request attends to its cached prefix plus its new tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import torch

from .attn_backends.base import AttentionLayer
from .errors import InputError
from .forward_context import get_forward_context


@functools.lru_cache(maxsize=4096)
def _static_layer(
    layer_id: int, hq: int, hkv: int, d: int, dv: int, scale: float, causal: bool, window_left: int, logit_cap: float,
    chunk_size: int, alibi_slopes: tuple[float, ...] | None,
) -> AttentionLayer:
    # AttentionLayer refuses what no backend serves (InputError: chunks without a causal mask,
    # a slope count other than the head count)
    return AttentionLayer(layer_id, hq, hkv, d, dv, scale, causal, window_left, logit_cap, chunk_size=chunk_size,
                          alibi_slopes=alibi_slopes)  # fmt: skip


def _layer(layer_id, hq, hkv, d, dv, scale, causal, window_left, logit_cap, sinks: torch.Tensor | None = None,
           chunk_size: int = 0, alibi_slopes: Sequence[float] | None = None) -> AttentionLayer:  # fmt: skip
    """The site's `AttentionLayer` (cached by its static attributes; a layer with sinks carries
    the tensor this call received)."""
    slopes = tuple(float(x) for x in alibi_slopes) if alibi_slopes is not None else None
    layer = _static_layer(layer_id, hq, hkv, d, dv, scale, causal, window_left, logit_cap, chunk_size, slopes)
    return layer if sinks is None else dataclasses.replace(layer, sinks=sinks)


@functools.lru_cache(maxsize=1)
def _reference_backend():
    from .attn_backends.torch_native import TorchNativeBackend

    return TorchNativeBackend()


def attention_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_id: int,
    scale: float,
    causal: bool,
    window_left: int,
    logit_cap: float,
    batch_size: int,
    sinks: Optional[torch.Tensor] = None,
    chunk_size: int = 0,
    alibi_slopes: Optional[Sequence[float]] = None,
    rope_cos: Optional[torch.Tensor] = None,
    rope_sin: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of ``q: [T, Hq, D]`` over ``k: [Tk, Hkv, D]``, ``v: [Tk, Hkv, Dv]`` -> ``[T, Hq, Dv]``.

    ``layer_id`` names the KV-pool layer (paged form). ``window_left = -1``: no window.
    ``logit_cap = 0``: no softcap. ``batch_size``: number of equal-length sequences in the
    stateless form (ignored in the paged form, where the ForwardBatch gives the structure).
    ``sinks``: ``[Hq]`` attention-sink logits in the units of the scaled scores (GPT-OSS),
    each one more softmax term of its head without a value; None: no sinks. ``chunk_size``:
    causal attention within chunks of that many positions (Llama 4's local layers); 0: none.
    ``alibi_slopes``: ``[Hq]`` ALiBi slopes, ``slope * (key position - query position)`` added
    to the scaled scores (Falcon, Bloom, MPT); None: no bias. ``rope_cos``, ``rope_sin``:
    ``[T, D]`` rows of HF's rotary embedding (`attngraph.rope`): q and k are given before the
    rotation, which is applied first (or inside a backend's decode kernel that folds it:
    `passes.fold_rope`); None: q and k are final.

    The body of `torch.ops.attngraph.attention`; the piecewise runtime calls it directly
    between graph pieces (no dispatcher round trip).
    """
    layer = _layer(layer_id, q.shape[1], k.shape[1], q.shape[2], v.shape[2], scale, causal, window_left, logit_cap, sinks,
                   chunk_size, alibi_slopes)  # fmt: skip
    ctx = get_forward_context()
    if ctx is not None and ctx.batch is not None:
        n = ctx.batch.num_tokens
        if q.shape[0] == n:  # contiguous, as the fake promises (a no-op for the GPU kernels)
            q, k, rope = _rotate(ctx.backend, q, k, rope_cos, rope_sin, layer, ctx.batch)
            return ctx.backend.forward(q, k, v, layer, ctx.batch, **rope).contiguous()
        # Rows past the batch's tokens pad the graph input (see RaggedModel): no K/V stored, their
        # output left unwritten (no fill kernel); the graph is token-wise, so no real row reads them.
        out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
        return paged_attention_into(out, q, k, v, layer_id, scale, causal, window_left, logit_cap, batch_size, sinks,
                                    chunk_size, alibi_slopes, rope_cos, rope_sin)  # fmt: skip
    if q.shape[0] == 0 or batch_size == 0:  # an empty batch: nothing to attend (eager gives [0, ...] too)
        return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    backend = ctx.backend if ctx is not None else _reference_backend()
    q, k, _ = _rotate(None, q, k, rope_cos, rope_sin, layer, None)
    return backend.forward_dense(q, k, v, layer, batch_size).contiguous()


def _rotate(backend, q, k, cos, sin, layer, batch) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(q, k, kwargs)``: with rotary rows (``cos``, ``sin``), q and k rotated here
    (`rope.apply_rope`) unless ``backend`` folds the rotation into this call's kernel
    (``backend.folds_rope(q, k, layer, batch)``), then ``kwargs`` carries them to its
    ``forward`` (``rope=(cos, sin)``)."""
    if cos is None and sin is None:
        return q, k, {}
    if cos is None or sin is None:
        raise InputError("attention: rope_cos and rope_sin come together (both None: q and k are already rotated)")
    from .rope import apply_rope, check_rope

    check_rope(q, k, cos, sin)
    folds = getattr(backend, "folds_rope", None)
    if batch is not None and folds is not None and folds(q, k, layer, batch):
        return q, k, {"rope": (cos, sin)}
    q, k = apply_rope(q, k, cos, sin)
    return q, k, {}


def paged_attention_into(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_id: int,
    scale: float,
    causal: bool,
    window_left: int,
    logit_cap: float,
    batch_size: int,
    sinks: torch.Tensor | None = None,
    chunk_size: int = 0,
    alibi_slopes: Sequence[float] | None = None,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """The paged form writing rows ``[:n]`` of ``out: [T, Hq, Dv]`` (n: the published batch's
    tokens; rows past n are padding and keep whatever they held: the rows of a token-wise
    graph never read each other). Returns ``out``."""
    ctx = get_forward_context()
    n = ctx.batch.num_tokens
    layer = _layer(layer_id, q.shape[1], k.shape[1], q.shape[2], v.shape[2], scale, causal, window_left, logit_cap, sinks,
                   chunk_size, alibi_slopes)  # fmt: skip
    cos, sin = (rope_cos[:n], rope_sin[:n]) if rope_cos is not None and rope_sin is not None else (rope_cos, rope_sin)
    q, k, rope = _rotate(ctx.backend, q[:n], k[:n], cos, sin, layer, ctx.batch)
    ctx.backend.forward(q, k, v[:n], layer, ctx.batch, out=out[:n], **rope)
    return out


attention = torch.library.custom_op("attngraph::attention", mutates_args=())(attention_impl)
attention.__doc__ = attention_impl.__doc__


@attention.register_fake
def _(q, k, v, layer_id, scale, causal, window_left, logit_cap, batch_size, sinks=None, chunk_size=0, alibi_slopes=None,
      rope_cos=None, rope_sin=None):  # fmt: skip
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, layer_id, scale, causal, window_left, logit_cap, batch_size, sinks, chunk_size, alibi_slopes, cos, sin = inputs
    ctx.has_sinks = sinks is not None
    ctx.has_rope = cos is not None and sin is not None
    ctx.save_for_backward(q, k, v, *((sinks,) if sinks is not None else ()), *((cos, sin) if ctx.has_rope else ()))
    slopes = tuple(alibi_slopes) if alibi_slopes is not None else None
    ctx.attrs = (layer_id, scale, causal, window_left, logit_cap, batch_size, chunk_size, slopes)


def _backward(ctx, grad_out: torch.Tensor):
    """Gradients of the stateless form, by differentiating the torch_native reference.

    Lowering keeps models trainable through the compiled graph (dropout-free attention, sink
    logits included); the paged form is inference-only.
    """
    fwd_ctx = get_forward_context()
    if fwd_ctx is not None and fwd_ctx.batch is not None:
        raise RuntimeError("attngraph paged attention is inference-only; run it under torch.no_grad()")
    q, k, v, *rest = ctx.saved_tensors
    layer_id, scale, causal, window_left, logit_cap, batch_size, chunk_size, slopes = ctx.attrs
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v, *rest)]
        sinks = leaves[3] if ctx.has_sinks else None
        qk = leaves[:2]
        if ctx.has_rope:  # differentiated through the rotation too
            from .rope import rope_reference

            cos, sin = leaves[-2:]
            qk = [rope_reference(t, cos, sin) for t in qk]
        layer = AttentionLayer(layer_id, q.shape[1], k.shape[1], q.shape[2], v.shape[2], scale, causal, window_left,
                               logit_cap, sinks, chunk_size, slopes)  # fmt: skip
        out = _reference_backend().forward_dense(*qk, leaves[2], layer, batch_size)
        grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    sink_grad = grads[3] if ctx.has_sinks else None
    rope_grads = tuple(grads[-2:]) if ctx.has_rope else (None, None)
    return (*grads[:3], None, None, None, None, None, None, sink_grad, None, None, *rope_grads)


attention.register_autograd(_backward, setup_context=_setup_context)


def attention_o_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_id: int,
    scale: float,
    causal: bool,
    window_left: int,
    logit_cap: float,
    batch_size: int,
    sinks: Optional[torch.Tensor],
    chunk_size: int,
    alibi_slopes: Optional[Sequence[float]],
    rope_cos: Optional[torch.Tensor],
    rope_sin: Optional[torch.Tensor],
    o_weight: torch.Tensor,
    o_bias: Optional[torch.Tensor] = None,
    o_rows: int = 0,
) -> torch.Tensor:
    """Attention and the output projection after it: ``linear(attention(q, k, v, ...).view(T,
    Hq * Dv), o_weight, o_bias, o_rows)`` -> ``[T, N]`` (`passes.fuse_attention_o` writes it).

    The first fourteen arguments are `attention_impl`'s; ``o_weight: [N, Hq * Dv]``,
    ``o_bias: [N]`` or None and ``o_rows`` (`linear_ops.ANY_ROWS`...) are the projection's.
    In the paged form a backend with ``forward_decode_o`` may run both in one launch (Triton:
    one request's decode step, `triton_ops.decode_attention_o`); otherwise the attention op
    and `attngraph.linear` run one after the other. Rows past the batch's tokens (padding)
    are left as the two ops leave them: unread. Inference only (no autograd).

    Raises `InputError` for a projection that does not fit the attention output (weight not
    ``[N, Hq * Dv]`` of q's dtype and device, a bias not ``[N]``, an unknown ``o_rows``) before
    anything runs: no K/V is stored then."""
    from .linear_ops import _check_bias, _check_linear, linear_impl, real_rows

    n_out = _check_linear("attention_o", q, o_weight, q.shape[1] * v.shape[2])  # the output is q's dtype
    _check_bias(o_bias, n_out, q)
    real_rows(o_rows, q.shape[0])  # a valid row kind
    ctx = get_forward_context()
    if ctx is not None and ctx.batch is not None and rope_cos is None and rope_sin is None:
        fused = getattr(ctx.backend, "forward_decode_o", None)
        n = ctx.batch.num_tokens
        if fused is not None and 0 < n <= q.shape[0]:
            layer = _layer(layer_id, q.shape[1], k.shape[1], q.shape[2], v.shape[2], scale, causal, window_left,
                           logit_cap, sinks, chunk_size, alibi_slopes)  # fmt: skip
            y = fused(q, k, v, layer, ctx.batch, o_weight, o_bias)
            if y is not None:
                return y
    a = attention_impl(q, k, v, layer_id, scale, causal, window_left, logit_cap, batch_size, sinks, chunk_size,
                       alibi_slopes, rope_cos, rope_sin)  # fmt: skip
    return linear_impl(a.view(a.shape[0], -1), o_weight, o_bias, o_rows)


def paged_attention_o_into(out: torch.Tensor, *args) -> torch.Tensor:
    """`attention_o_impl` writing rows ``[:n]`` of ``out: [T, N]`` (n: the published batch's
    tokens), as `paged_attention_into` does for the attention op. Returns ``out``."""
    n = get_forward_context().batch.num_tokens
    out[:n].copy_(attention_o_impl(*args)[:n])
    return out


attention_o = torch.library.custom_op("attngraph::attention_o", mutates_args=())(attention_o_impl)
attention_o.__doc__ = attention_o_impl.__doc__


@attention_o.register_fake
def _(q, k, v, layer_id, scale, causal, window_left, logit_cap, batch_size, sinks, chunk_size, alibi_slopes, rope_cos,
      rope_sin, o_weight, o_bias=None, o_rows=0):  # fmt: skip
    return q.new_empty((q.shape[0], o_weight.shape[0]))
