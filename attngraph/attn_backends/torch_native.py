"""`torch_native`: the correctness reference. Gathers each request's pages and calls SDPA.

Plain and per-request on purpose (a Python loop over requests): it is what the GPU backends
are checked against, so it must be obviously right rather than fast.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .base import AttentionBackend, AttentionLayer, BackendCapabilities, GraphSupport


def allowed_keys(q_pos: torch.Tensor, num_keys: int, layer: AttentionLayer) -> torch.Tensor:
    """Bool ``[Sq, Sk]``: may query at position ``q_pos[i]`` see the key at position ``j``."""
    k_pos = torch.arange(num_keys, device=q_pos.device)
    ok = torch.ones((q_pos.shape[0], num_keys), dtype=torch.bool, device=q_pos.device)
    if layer.causal:
        ok &= k_pos[None, :] <= q_pos[:, None]
        if layer.window_left >= 0:
            ok &= k_pos[None, :] >= q_pos[:, None] - layer.window_left
        if layer.chunk_size > 0:
            ok &= k_pos[None, :] >= q_pos[:, None] - q_pos[:, None] % layer.chunk_size
    elif layer.chunk_size > 0:
        raise ValueError("chunked local attention is causal only")
    elif layer.window_left >= 0:
        ok &= (k_pos[None, :] - q_pos[:, None]).abs() <= layer.window_left
    return ok


def alibi_bias(q_pos: torch.Tensor, num_keys: int, layer: AttentionLayer) -> torch.Tensor | None:
    """fp32 ``[..., Hq, Sq, Sk]`` ALiBi bias ``slope[h] * (j - q_pos)`` for ``q_pos: [..., Sq]``
    and keys at positions ``0..num_keys-1``; None when the layer has none."""
    if layer.alibi_slopes is None:
        return None
    slopes = torch.tensor(layer.alibi_slopes, dtype=torch.float32, device=q_pos.device)
    rel = torch.arange(num_keys, device=q_pos.device) - q_pos[..., None]  # [..., Sq, Sk]
    return slopes.view(-1, 1, 1) * rel[..., None, :, :].float()


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
    """Attention of queries at positions ``q_pos`` over keys at positions ``0..Sk-1``.

    ``q: [..., Hq, Sq, D]``, ``k: [..., Hkv, Sk, D]``, ``v: [..., Hkv, Sk, Dv]``,
    ``q_pos: [Sq]`` -> ``[..., Hq, Sq, Dv]`` in q's dtype.
    """
    mask = allowed_keys(q_pos, k.shape[-2], layer)
    return masked_attention(q, k, v, mask, layer, alibi_bias(q_pos, k.shape[-2], layer))


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, layer: AttentionLayer,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``softmax(cap(scale * q k^T) + bias | mask [, sinks]) v`` with a bool ``mask`` and a float
    ``bias`` (ALiBi, `alibi_bias`) broadcastable to ``[..., Hq, Sq, Sk]``. Sinks
    (``layer.sinks: [Hq]``) are one more softmax column per head whose probability is dropped:
    they take weight from the keys and give no value."""
    if layer.logit_cap > 0 or layer.sinks is not None or bias is not None:
        group = q.shape[-3] // k.shape[-3]
        kr = k.repeat_interleave(group, dim=-3).float()
        vr = v.repeat_interleave(group, dim=-3).float()
        s = torch.matmul(q.float(), kr.transpose(-1, -2)) * layer.scale
        if layer.logit_cap > 0:
            s = layer.logit_cap * torch.tanh(s / layer.logit_cap)
        if bias is not None:
            s = s + bias
        s = s.masked_fill(~mask, float("-inf"))
        if layer.sinks is None:
            return torch.matmul(torch.softmax(s, dim=-1), vr).to(q.dtype)
        sink = layer.sinks.float().view(-1, 1, 1).expand(*s.shape[:-1], 1)  # [..., Hq, Sq, 1]
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
        return torch.matmul(p, vr).to(q.dtype)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=layer.scale, enable_gqa=q.shape[-3] != k.shape[-3]
    )


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"
    capabilities = BackendCapabilities(
        device_types=("cpu", "cuda"),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        graph_support={"decode": GraphSupport.NEVER, "extend": GraphSupport.NEVER},
    )

    def forward_dense(self, q, k, v, layer: AttentionLayer, batch_size: int) -> torch.Tensor:
        b = int(batch_size)
        sq, sk = q.shape[0] // b, k.shape[0] // b
        # [B*S, H, D] -> [B, H, S, D]
        q4 = q.view(b, sq, q.shape[1], q.shape[2]).transpose(1, 2)
        k4 = k.view(b, sk, k.shape[1], k.shape[2]).transpose(1, 2)
        v4 = v.view(b, sk, v.shape[1], v.shape[2]).transpose(1, 2)
        q_pos = torch.arange(sk - sq, sk, device=q.device)
        out = reference_attention(q4, k4, v4, q_pos, layer)  # [B, Hq, Sq, Dv]
        return out.transpose(1, 2).reshape(b * sq, layer.num_q_heads, v.shape[-1])

    def _paged(self, q, k, v, layer: AttentionLayer, batch, save_kv_cache: bool) -> torch.Tensor:
        if save_kv_cache:
            self.save_kv(layer, batch, k, v)
        pool = batch.kv_pool
        kbuf, vbuf = pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id]
        out = q.new_empty((q.shape[0], layer.num_q_heads, layer.v_head_dim))
        rows = batch.req_pool_indices.tolist()
        starts = batch.qo_indptr.tolist()
        for i, row in enumerate(rows):
            seq_len = int(batch.seq_lens_cpu[i])
            n_new = int(batch.extend_seq_lens_cpu[i])
            if n_new == 0:
                continue
            pages = pool.req_to_page[row, : math.ceil(seq_len / pool.page_size)].long()
            # [pages, page_size, Hkv, D] -> [Hkv, seq_len, D]
            kr = kbuf[pages].reshape(-1, pool.num_kv_heads, pool.head_dim)[:seq_len].transpose(0, 1)
            vr = vbuf[pages].reshape(-1, pool.num_kv_heads, pool.v_head_dim)[:seq_len].transpose(0, 1)
            qs = q[starts[i] : starts[i] + n_new].transpose(0, 1)  # [Hq, n_new, D]
            q_pos = torch.arange(seq_len - n_new, seq_len, device=q.device)
            o = reference_attention(qs, kr.to(q.dtype), vr.to(q.dtype), q_pos, layer)
            out[starts[i] : starts[i] + n_new] = o.transpose(0, 1)
        return out

    def forward_decode(self, q, k, v, layer, batch, save_kv_cache=True):
        """All requests at once: pages gathered to ``[B, Hkv, L, D]`` (L = longest request),
        keys past each request's length masked out."""
        if save_kv_cache:
            self.save_kv(layer, batch, k, v)
        pool = batch.kv_pool
        seq_lens = batch.seq_lens_cpu.to(torch.long)
        max_len = int(seq_lens.max())
        n_pages = math.ceil(max_len / pool.page_size)
        pages = pool.req_to_page[batch.req_pool_indices.long(), :n_pages].long()  # [B, P]
        bsz = pages.shape[0]

        def gather(buf: torch.Tensor) -> torch.Tensor:  # [B, Hkv, L, D]
            return buf[pages].reshape(bsz, n_pages * pool.page_size, buf.shape[2], buf.shape[3])[:, :max_len].transpose(1, 2)

        # The one query of request b sits at position seq_len_b - 1: causal = "within the length".
        q_pos = (seq_lens - 1).to(q.device)
        j = torch.arange(max_len, device=q.device)
        # Slots past a request's length hold other data (or garbage): zero them, since a masked
        # score still multiplies its value (0 * NaN = NaN).
        inside = (j[None, :] <= q_pos[:, None])[:, None, :, None]  # [B, 1, L, 1]
        kr = torch.where(inside, gather(pool.k_buffers[layer.layer_id]).to(q.dtype), 0)
        vr = torch.where(inside, gather(pool.v_buffers[layer.layer_id]).to(q.dtype), 0)
        mask = allowed_keys(q_pos, max_len, layer) & (j[None, :] <= q_pos[:, None])  # [B, L]
        bias = alibi_bias(q_pos[:, None], max_len, layer)  # [B, Hq, 1, L] or None
        out = masked_attention(q[:, :, None, :], kr, vr, mask[:, None, None, :], layer, bias)  # [B, Hq, 1, Dv]
        return out[:, :, 0]

    def forward_extend(self, q, k, v, layer, batch, save_kv_cache=True):
        return self._paged(q, k, v, layer, batch, save_kv_cache)
