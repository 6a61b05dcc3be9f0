"""End-to-end `generate` on the GPU: HF eager vs attngraph.accelerate, with the weight-read floor.

A Llama-3.2-1B-shaped model (random weights, bf16). For each backend: ms per generated token
at batch 1 and batch 8, and the fraction of greedy tokens identical to HF eager generate.
The floor is the time to read every weight once at the copy bandwidth measured in the same run.

    python benchmarks/bench_generate.py --out benchmarks/results/generate.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch
import transformers

import attngraph


def llama_1b(layers: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
        tie_word_embeddings=True, rope_theta=500000.0,
    )


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    iters = 20
    for _ in range(iters):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * n * iters / (time.perf_counter() - t0)


def prompts(vocab: int, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for i in range(1, batch):  # left padding of different amounts
        pad = (7 * i) % (length // 2)
        ids[i, :pad] = 0
        mask[i, :pad] = 0
    return ids.cuda(), mask.cuda()


def timed(model, ids, mask, new_tokens: int, **extra) -> tuple[torch.Tensor, float]:
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None, **extra)
    model.generate(ids, max_new_tokens=new_tokens, **kw)  # warm-up at the timed length (compiles, caches)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, **kw)
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) / new_tokens


def teacher_forced_agreement(reference, accelerated, sequences, prompt_len: int, mask) -> float:
    """Fraction of generated positions where HF eager, given the accelerated run's own prefix,
    picks the same greedy token (random weights make free-running sequences diverge at the
    first bf16 near-tie, so this is the per-position measure)."""
    full_mask = torch.cat([mask, torch.ones_like(sequences[:, prompt_len:])], 1)
    with torch.no_grad():
        logits = reference(sequences, attention_mask=full_mask).logits[:, prompt_len - 1 : -1]
    return float((logits.argmax(-1) == sequences[:, prompt_len:]).float().mean())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--backends", default="flashinfer,triton")
    p.add_argument("--hf-static", action="store_true", help="also HF generate with a static cache (compiled by transformers)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_generate.py needs a CUDA device (it times bf16 generate on the GPU); "
                 "on a CPU `attngraph generate llama --tiny --prompt ...` compares tokens/s")  # fmt: skip
    torch.manual_seed(0)
    cfg = llama_1b(args.layers)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    bw = copy_bandwidth()
    floor_ms = weight_bytes / bw * 1e3  # reading every weight once at the measured HBM traffic rate
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    refs = {}
    with torch.no_grad():
        for b in batches:
            ids, mask = prompts(cfg.vocab_size, b, args.prompt)
            out, t = timed(model, ids, mask, args.new_tokens)
            refs[b] = out
            rows.append(dict(impl="HF eager (sdpa)", batch=b, ms_per_token=t * 1e3, token_match=1.0))
            print(rows[-1], flush=True)
            if args.hf_static:  # transformers compiles the forward itself for a static cache
                try:
                    out, t = timed(model, ids, mask, args.new_tokens, cache_implementation="static")
                    gen, ref = out[:, ids.shape[1]:], refs[b][:, ids.shape[1]:]
                    rows.append(dict(impl="HF static cache + torch.compile", batch=b, ms_per_token=t * 1e3,
                                     token_match=float((gen == ref).float().mean()),
                                     teacher_forced_agreement=teacher_forced_agreement(model, None, out, ids.shape[1], mask)))
                except Exception as exc:
                    rows.append(dict(impl="HF static cache + torch.compile", error=f"{type(exc).__name__}: {exc}"[:500]))
                print(rows[-1], flush=True)
    for name in [x for x in args.backends.split(",") if x]:
        m = copy.deepcopy(model)
        t0 = time.perf_counter()
        try:
            attngraph.accelerate(m, attention_backend=name, kv_cache_tokens=1 << 16, cuda_graph_capture_sizes=tuple(batches))
        except Exception as exc:  # report and go on with the next backend
            rows.append(dict(impl=f"attngraph[{name}]", error=f"{type(exc).__name__}: {exc}"[:500]))
            print(rows[-1], flush=True)
            continue
        setup_s = time.perf_counter() - t0
        for b in batches:
            ids, mask = prompts(cfg.vocab_size, b, args.prompt)
            out, t = timed(m, ids, mask, args.new_tokens)
            gen, ref = out[:, ids.shape[1]:], refs[b][:, ids.shape[1]:]
            rows.append(dict(
                impl=f"attngraph[{name}]", batch=b, ms_per_token=t * 1e3,
                token_match=float((gen == ref).float().mean()),
                teacher_forced_agreement=teacher_forced_agreement(model, m, out, ids.shape[1], mask),
                setup_s=setup_s,
            ))
            print(rows[-1], flush=True)
        attngraph.restore(m)
        del m
        torch.cuda.empty_cache()
    result = dict(
        model=f"Llama-3.2-1B-shaped ({args.layers} layers), bf16, random weights",
        device=torch.cuda.get_device_name(), torch=torch.__version__, transformers=transformers.__version__,
        prompt=args.prompt, new_tokens=args.new_tokens, copy_bandwidth_GBps=bw / 1e9,
        weight_read_floor_ms=floor_ms, rows=rows,
    )
    print(f"\nweights {weight_bytes / 1e9:.2f} GB; copy bandwidth {bw / 1e9:.0f} GB/s; floor {floor_ms:.3f} ms/step")
    print("| impl | batch | ms/token | free-running tokens equal | teacher-forced agreement |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['impl']} | - | error: {r['error'][:80]} | - | - |")
        else:
            tf = r.get("teacher_forced_agreement")
            tf_s = "-" if tf is None else f"{100 * tf:.1f}%"
            print(f"| {r['impl']} | {r['batch']} | {r['ms_per_token']:.2f} | {100 * r['token_match']:.1f}% | {tf_s} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
