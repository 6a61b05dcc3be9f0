"""Tiny modules, one per attention pattern the passes must handle (or must leave alone)."""

import math

import torch
import torch.nn.functional as F
from torch import nn

B, HQ, HKV, S, D = 2, 4, 2, 9, 8


def graph_sites(module: nn.Module, *inputs) -> list:
    """`find_attention`'s sites in the Dynamo graph of ``module(*inputs)`` (eval, no grad)."""
    from attngraph.passes import find_attention

    sites = []

    def backend(gm, example_inputs):
        sites.extend(find_attention(gm))
        return gm.forward

    with torch.no_grad():
        torch.compile(module.eval(), backend=backend, fullgraph=True)(*inputs)
    return sites


def qkv(x: torch.Tensor, heads_kv: int = HKV):
    """Split ``x: [B, S, (HQ + 2*heads_kv) * D]`` into ``q [B,HQ,S,D]``, ``k, v [B,heads_kv,S,D]``."""
    b, s, _ = x.shape
    q, k, v = x.split([HQ * D, heads_kv * D, heads_kv * D], dim=-1)
    q = q.view(b, s, HQ, D).transpose(1, 2)
    k = k.view(b, s, heads_kv, D).transpose(1, 2)
    v = v.view(b, s, heads_kv, D).transpose(1, 2)
    return q, k, v


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def causal_bool_mask(s: int, device) -> torch.Tensor:
    i = torch.arange(s, device=device)
    return (i[None, :] <= i[:, None])[None, None]


def window_float_mask(s: int, window: int, device, dtype) -> torch.Tensor:
    i = torch.arange(s, device=device)
    ok = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    return torch.zeros(s, s, dtype=dtype, device=device).masked_fill(~ok, torch.finfo(dtype).min)[None, None]


class Proj(nn.Module):
    def __init__(self, heads_kv: int = HKV):
        super().__init__()
        self.heads_kv = heads_kv
        self.proj = nn.Linear(D * 4, (HQ + 2 * heads_kv) * D)
        self.out = nn.Linear(HQ * D, D * 4)

    def finish(self, o: torch.Tensor) -> torch.Tensor:
        b, h, s, d = o.shape
        return self.out(o.transpose(1, 2).reshape(b, s, h * d))


class SdpaCausal(Proj):
    def __init__(self):
        super().__init__(heads_kv=HQ)

    def forward(self, x):
        q, k, v = qkv(self.proj(x), HQ)
        return self.finish(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class SdpaGqa(Proj):
    def forward(self, x):
        q, k, v = qkv(self.proj(x))
        return self.finish(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.3))


class SdpaRepeatKvCausalMask(Proj):
    def forward(self, x):
        q, k, v = qkv(self.proj(x))
        k, v = repeat_kv(k, HQ // HKV), repeat_kv(v, HQ // HKV)
        mask = causal_bool_mask(x.shape[1], x.device)
        return self.finish(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


class SdpaWindowMask(Proj):
    def forward(self, x):
        q, k, v = qkv(self.proj(x))
        k, v = repeat_kv(k, HQ // HKV), repeat_kv(v, HQ // HKV)
        mask = window_float_mask(x.shape[1], 3, x.device, x.dtype)
        return self.finish(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


class EagerHF(Proj):
    """HF's eager_attention_forward: mul scale, mask add, fp32 softmax cast back, dropout."""

    def forward(self, x):
        q, k, v = qkv(self.proj(x))
        k, v = repeat_kv(k, HQ // HKV), repeat_kv(v, HQ // HKV)
        w = torch.matmul(q, k.transpose(2, 3)) * (D ** -0.5)
        w = w + window_float_mask(x.shape[1], 100, x.device, x.dtype)
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        w = F.dropout(w, p=0.1, training=self.training)
        return self.finish(torch.matmul(w, v))


class EagerDivNoMask(Proj):
    """Division by a tensor constant, no mask (full attention), repeat_interleave GQA."""

    def forward(self, x):
        q, k, v = qkv(self.proj(x))
        k, v = k.repeat_interleave(HQ // HKV, dim=1), v.repeat_interleave(HQ // HKV, dim=1)
        w = torch.matmul(q, k.transpose(-1, -2)) / torch.full([], math.sqrt(D), dtype=x.dtype)
        return self.finish(torch.matmul(w.softmax(-1), v))


class EagerPrescaledSoftcap(Proj):
    """Scale applied to q, softcap, sliding-window mask."""

    def forward(self, x):
        q, k, v = qkv(self.proj(x))
        k, v = repeat_kv(k, HQ // HKV), repeat_kv(v, HQ // HKV)
        w = torch.matmul(q * 0.5, k.transpose(2, 3))
        w = torch.tanh(w / 3.0) * 3.0
        w = w + window_float_mask(x.shape[1], 4, x.device, x.dtype)
        return self.finish(torch.matmul(torch.softmax(w.float(), dim=-1).type_as(q), v))


# ---------------------------------------------------------------- must NOT be lowered
class UserMask(Proj):
    def forward(self, x, attention_mask):
        q, k, v = qkv(self.proj(x))
        pad = attention_mask[:, None, None, :].bool() & causal_bool_mask(x.shape[1], x.device)
        return self.finish(F.scaled_dot_product_attention(q, k, v, attn_mask=pad, enable_gqa=True))


class Custom4DMask(Proj):
    def forward(self, x, mask4d):
        q, k, v = qkv(self.proj(x))
        k, v = repeat_kv(k, HQ // HKV), repeat_kv(v, HQ // HKV)
        w = torch.matmul(q, k.transpose(2, 3)) * 0.3 + mask4d
        return self.finish(torch.matmul(w.softmax(-1), v))


class TrainDropout(Proj):
    def forward(self, x):
        q, k, v = qkv(self.proj(x))
        k, v = repeat_kv(k, HQ // HKV), repeat_kv(v, HQ // HKV)
        w = torch.matmul(q, k.transpose(2, 3)) * 0.3
        w = F.dropout(w.softmax(-1), p=0.5, training=True)
        return self.finish(torch.matmul(w, v))


class SdpaTrainDropout(Proj):
    def forward(self, x):
        q, k, v = qkv(self.proj(x))
        return self.finish(F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True, enable_gqa=True))


class NotAttention(nn.Module):
    """matmul-softmax-matmul over a weight matrix and along dim -2: a mixer, not attention."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, S))
        self.v = nn.Parameter(torch.randn(S, D))

    def forward(self, x):  # x: [B, HQ, S, D]
        a = torch.matmul(x, self.w).softmax(-1)  # not q @ k^T of a 4-D key
        b = torch.matmul(x, x.transpose(2, 3)).softmax(dim=-2)  # softmax over queries
        return torch.matmul(a, self.v) + torch.matmul(b, x)


class AntiCausalMask(Proj):
    def forward(self, x):
        q, k, v = qkv(self.proj(x))
        i = torch.arange(x.shape[1], device=x.device)
        mask = (i[None, :] >= i[:, None])[None, None]  # future only: positional but not causal
        return self.finish(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))


class PositionBias(Proj):
    def forward(self, x):
        q, k, v = qkv(self.proj(x))
        i = torch.arange(x.shape[1], device=x.device, dtype=x.dtype)
        bias = -(i[:, None] - i[None, :]).abs()[None, None] * 0.1  # ALiBi-like: a bias, not a mask
        return self.finish(F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True))


class OutputAttentions(Proj):
    def forward(self, x):
        q, k, v = qkv(self.proj(x))
        k, v = repeat_kv(k, HQ // HKV), repeat_kv(v, HQ // HKV)
        p = (torch.matmul(q, k.transpose(2, 3)) * 0.3).softmax(-1)
        return self.finish(torch.matmul(p, v)), p
