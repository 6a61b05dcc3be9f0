"""Attention of multi-head latent attention, decode and prefill: the latent form against the MHA form.

DeepSeek-V3's attention dims (128 query heads, latent 512 + RoPE 64, nope 128, values 128),
bf16, page size 16, one layer, Triton:

* latent form (`passes.absorb_mla`): one KV head of 576 values per token, the values being its
  first 512 (`KVPool(value_in_key=True)`); the query is ``[128, 576]`` per token;
* MHA form (``absorb_mla=False``): 128 KV heads of 192 (K) and 128 (V) values per token.

``kernel ms``: GPU time of the attention kernels (launches queued behind a sleep kernel);
``KV B/token``: pool bytes per token and layer; ``GB/s``: pool bytes read per kernel time. A
prefill row (new tokens, no cached prefix) counts the form's own multiply-adds: the latent form
does 3.4x those of the MHA form per query-key pair (576 + 512 against 192 + 128 per head).

    python benchmarks/bench_mla.py --out benchmarks/results/mla_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attngraph.attn_backends.base import AttentionLayer, ModelAttentionSpec  # noqa: E402
from attngraph.attn_backends.triton_backend import TritonBackend  # noqa: E402
from attngraph.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from attngraph.runtime.kv_pool import KVPool  # noqa: E402
from bench_attention import copy_bandwidth_gbps, gpu_ms  # noqa: E402
from bench_prefill import result_header  # noqa: E402

HQ, LATENT, ROPE, NOPE, DV, PAGE, DTYPE = 128, 512, 64, 128, 128, 16, torch.bfloat16
SHAPES = [(1, 4096), (16, 4096), (64, 2048)]  # decode: (batch, KV length)
PREFILL_SHAPES = [(1, 2048)]  # prefill without a cached prefix: (batch, new tokens)
FORMS = {  # name -> (KV heads, K head dim, V head dim, values in the keys)
    "latent (absorbed)": (1, LATENT + ROPE, LATENT, True),
    "MHA form": (HQ, NOPE + ROPE, DV, False),
}


def bench(form: str, batch: int, seq: int, gen: torch.Generator, copy_bw: float, prefill: bool = False) -> dict:
    """Decode (one new token on ``seq - 1`` cached) or, with ``prefill``, ``seq`` new tokens per request."""
    hkv, d, dv, value_in_key = FORMS[form]
    pool = KVPool(1, hkv, d, num_pages=batch * math.ceil(seq / PAGE) + 8, page_size=PAGE, dtype=DTYPE, device="cuda",
                  max_requests=batch, max_context_len=seq, v_head_dim=dv, value_in_key=value_in_key)  # fmt: skip
    pool.k_buffers[0].normal_(generator=gen)
    if not value_in_key:
        pool.v_buffers[0].normal_(generator=gen)
    rows = [pool.alloc_request() for _ in range(batch)]
    for frac in (0.5, 1.0):  # interleave the requests' pages, as a running server would
        pool.reserve(rows, [max(1, int(seq * frac))] * batch)
    new = seq if prefill else 1
    t = batch * new
    fb = ForwardBatch.build(pool, rows, [seq - new] * batch, [new] * batch, torch.zeros(t, dtype=torch.long),
                            mode=ForwardMode.EXTEND if prefill else ForwardMode.DECODE)  # fmt: skip
    q = torch.randn(t, HQ, d, device="cuda", dtype=DTYPE, generator=gen)
    k = torch.randn(t, hkv, d, device="cuda", dtype=DTYPE, generator=gen)
    v = k[..., :dv] if value_in_key else torch.randn(t, hkv, dv, device="cuda", dtype=DTYPE, generator=gen)
    spec = ModelAttentionSpec(1, HQ, hkv, tuple(sorted({d, dv})), DTYPE, "cuda", PAGE, v_head_dim=dv,
                              value_in_key=value_in_key)  # fmt: skip
    backend = TritonBackend(spec)
    layer = AttentionLayer(0, HQ, hkv, d, dv, 1 / math.sqrt(NOPE + ROPE))
    backend.init_forward_metadata(fb)
    backend.forward(q, k, v, layer, fb, save_kv_cache=True)
    ms = gpu_ms(lambda: backend.forward(q, k, v, layer, fb, save_kv_cache=False))
    per_token = KVPool.bytes_per_token(1, hkv, d, dv, DTYPE, value_in_key=value_in_key)
    if prefill:  # causal pairs x heads x (QK + PV) multiply-adds of this form
        flops = 2 * batch * (seq * (seq + 1) // 2) * HQ * (d + dv)
        return dict(op="prefill", form=form, batch=batch, new_tokens=seq, kernel_ms=ms, tflop_per_s=flops / (ms * 1e-3) / 1e12)
    read = batch * seq * per_token
    return dict(op="decode", form=form, batch=batch, kv_len=seq, kernel_ms=ms, kv_bytes_per_token=per_token,
                gb_per_s=read / (ms * 1e-3) / 1e9, of_copy_bw=read / (ms * 1e-3) / 1e9 / copy_bw)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = copy_bandwidth_gbps()
    rows = []
    print(f"copy bandwidth {copy_bw:.0f} GB/s\n")
    print("| form | batch x KV length | kernel ms | KV B/token (one layer) | GB/s | % of copy |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for batch, seq in SHAPES:
        for form in FORMS:
            row = bench(form, batch, seq, gen, copy_bw)
            rows.append(row)
            print(f"| {form} | {batch} x {seq} | {row['kernel_ms']:.4f} | {row['kv_bytes_per_token']} | "
                  f"{row['gb_per_s']:.0f} | {100 * row['of_copy_bw']:.0f}% |", flush=True)  # fmt: skip
            torch.cuda.empty_cache()
    print("\n| form | prefill batch x new tokens | kernel ms | TFLOP/s of the form |\n| --- | --- | ---: | ---: |")
    for batch, seq in PREFILL_SHAPES:
        for form in FORMS:
            row = bench(form, batch, seq, gen, copy_bw, prefill=True)
            rows.append(row)
            print(f"| {form} | {batch} x {seq} | {row['kernel_ms']:.4f} | {row['tflop_per_s']:.0f} |", flush=True)
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result_header("bench_mla.py", copy_bandwidth_gbps=copy_bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
