"""Prefill steps and time to first token per CUDA-graph mode, next to HF eager, with the floor.

A Llama-3.2-1B-shaped model (random weights, bf16). For each ``cuda_graph`` mode: the time of
one prefill step (`ModelRunner.forward` of fresh requests, logits of each request's last
token) at 1 x {128, 1024, 4096} and 8 x {128, 1024} tokens, the time to first token of
``generate`` (prompt 1 x 128), the decode step at batch 1, the `accelerate()` time and the GPU
memory it holds beyond the KV pool. HF eager's forward over the same tokens (no cache, logits
of the last token) is timed in the same run. The floor of a step is the larger of reading every
weight once at the measured copy bandwidth and its GEMM FLOPs at the measured bf16 GEMM rate.

    python benchmarks/bench_prefill.py --out benchmarks/results/prefill.json
    python benchmarks/bench_prefill.py --setup-only --shape 8b   # accelerate() time and memory only
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
from attngraph.forward_batch import ForwardBatch
from attngraph.runtime.accelerate import state_of

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_generate import copy_bandwidth, llama_1b  # noqa: E402
from profile_decode import per_call_ms as _per_call_ms  # noqa: E402


def per_call_ms(fn, iters: int = 20) -> float:
    return _per_call_ms(fn, iters, warmup=2)

SHAPES = [(1, 128), (1, 1024), (1, 4096), (8, 128), (8, 1024)]
MODES = ["none", "full", "full_and_piecewise", "piecewise", "breakable"]


def llama_8b() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
        rope_theta=500000.0,
    )


def random_model(shape: str) -> torch.nn.Module:
    """The ``"1b"`` (Llama-3.2-1B) or ``"8b"`` (Llama-3-8B) shape with random bf16 weights on CUDA."""
    torch.manual_seed(0)
    cfg = llama_1b(16) if shape == "1b" else llama_8b()
    with torch.device("cuda"):
        return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()


def result_header(script: str, **fields) -> dict:
    """The fields every benchmark JSON starts with: the command, the device, torch."""
    return {
        "command": f"python benchmarks/{script} " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        **fields,
    }


def gemm_flops_per_s() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * 20 / (time.perf_counter() - t0)


def prefill_step(runner, batch: int, length: int, vocab: int):
    """A callable running one prefill step of ``batch`` fresh requests of ``length`` tokens."""
    pool = runner.pool
    rows = [pool.alloc_request() for _ in range(batch)]
    pool.reserve(rows, [length] * batch)
    g = torch.Generator().manual_seed(length + batch)
    ids = torch.randint(3, vocab, (batch * length,), generator=g)
    fb = ForwardBatch.build(pool, rows, [0] * batch, [length] * batch, ids)

    def step():
        return runner.forward(fb)

    def free():
        for r in rows:
            pool.free_request(r)

    return step, free


def held_beyond_pool(before: int, runner) -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    pool = runner.pool
    pool_bytes = sum(t.numel() * t.element_size() for t in list(pool.k_buffers) + list(pool.v_buffers))
    return torch.cuda.memory_reserved() - before - pool_bytes


def setup(model, mode: str, **extra) -> tuple[float, int]:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    attngraph.accelerate(model, cuda_graph=mode, **extra)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return seconds, held_beyond_pool(before, state_of(model).runner)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=["1b", "8b"], default="1b")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--backend", default="flashinfer", help="attention backend(s), comma-separated: each mode runs with each")
    p.add_argument("--num-tokens", default=None, help="cuda_graph_num_tokens, comma-separated (default: the config's)")
    p.add_argument("--fold-rope", default="default",
                   help="CompileConfig.fold_rope per run: default (the config's), on and/or off, comma-separated")
    p.add_argument("--setup-only", action="store_true", help="only accelerate() with the default config: time and memory")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if bad := [v for v in args.fold_rope.split(",") if v not in ("default", "on", "off")]:
        p.error(f"--fold-rope takes default, on and/or off; got {', '.join(bad)}")
    if not torch.cuda.is_available():
        sys.exit("bench_prefill.py needs a CUDA device (it times bf16 prefill steps and CUDA-graph captures on the GPU)")
    model = random_model(args.shape)
    cfg = model.config
    modes = [m for m in args.modes.split(",") if m]
    backends = [b for b in args.backend.split(",") if b]
    extra = {}
    if args.num_tokens:
        extra["cuda_graph_num_tokens"] = tuple(int(x) for x in args.num_tokens.split(","))
    folds = args.fold_rope.split(",")
    runs = [(m, b, f) for m in modes for b in backends for f in folds]
    result = dict(
        model=f"Llama-{args.shape.upper()}-shaped, bf16, random weights", device=torch.cuda.get_device_name(),
        torch=torch.__version__, transformers=transformers.__version__, backend=args.backend, rows=[],
    )
    if args.setup_only:
        for mode, backend, _ in runs:
            seconds, held = setup(model, mode, attention_backend=backend, **extra)
            row = dict(mode=mode, backend=backend, accelerate_s=seconds, held_beyond_kv_pool_GiB=held / 2**30)
            result["rows"].append(row)
            print(row, flush=True)
            attngraph.restore(model)
            torch.cuda.empty_cache()
        _write(result, args.out)
        return

    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    bw, flops = copy_bandwidth(), gemm_flops_per_s()
    result.update(copy_bandwidth_GBps=bw / 1e9, gemm_TFLOPs=flops / 1e12)

    def floor_ms(tokens: int, logits_rows: int) -> float:
        body = linear_params - model.lm_head.weight.numel()
        gemm = 2 * body * tokens + 2 * model.lm_head.weight.numel() * logits_rows
        return max(weight_bytes / bw, gemm / flops) * 1e3

    rows = result["rows"]
    with torch.no_grad():
        for b, n in SHAPES:
            ids = torch.randint(3, cfg.vocab_size, (b, n), device="cuda")
            t = per_call_ms(lambda: model(ids, use_cache=False, logits_to_keep=1), 5)
            rows.append(dict(impl="HF eager (sdpa)", batch=b, tokens=n, prefill_ms=t, floor_ms=floor_ms(b * n, b)))
            print(rows[-1], flush=True)
    prompt = torch.randint(3, cfg.vocab_size, (1, 128), device="cuda")
    for mode, backend, fold in runs:
        impl = f"attngraph {mode}" if len(backends) == 1 else f"attngraph {mode} ({backend})"
        impl += "" if fold == "default" else f" fold_rope={fold == 'on'}"
        rope = {} if fold == "default" else {"fold_rope": fold == "on"}
        m = copy.deepcopy(model)
        try:
            seconds, held = setup(m, mode, attention_backend=backend, kv_cache_tokens=1 << 16, max_context_len=8192,
                                  **extra, **rope)  # fmt: skip
        except Exception as exc:
            rows.append(dict(impl=impl, error=f"{type(exc).__name__}: {exc}"[:500]))
            print(rows[-1], flush=True)
            continue
        runner = state_of(m).runner
        compiles = runner.num_compilations
        with torch.no_grad():
            for b, n in SHAPES:
                step, free = prefill_step(runner, b, n, cfg.vocab_size)
                t = per_call_ms(step, 10)
                free()
                rows.append(dict(impl=impl, batch=b, tokens=n, prefill_ms=t, floor_ms=floor_ms(b * n, b)))
                print(rows[-1], flush=True)
            kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
            ttft = per_call_ms(lambda m=m: m.generate(prompt, max_new_tokens=1, **kw), 10)
            gen = per_call_ms(lambda m=m: m.generate(prompt, max_new_tokens=65, **kw), 3)
        rows.append(dict(
            impl=impl, ttft_ms_1x128=ttft, decode_ms_batch1=(gen - ttft) / 64, accelerate_s=seconds,
            held_beyond_kv_pool_GiB=held / 2**30, compilations_after_accelerate=runner.num_compilations - compiles,
            decode_floor_ms=weight_bytes / bw * 1e3,
        ))  # fmt: skip
        print(rows[-1], flush=True)
        attngraph.restore(m)
        del m, runner
        torch.cuda.empty_cache()
    with torch.no_grad():
        kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
        ttft = per_call_ms(lambda: model.generate(prompt, max_new_tokens=1, **kw), 5)
    rows.append(dict(impl="HF eager (sdpa)", ttft_ms_1x128=ttft))
    _write(result, args.out)
    _table(result)


def _write(result: dict, out: str | None) -> None:
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


def _table(result: dict) -> None:
    print("| impl | prefill 1x128 | 1x1024 | 1x4096 | 8x128 | 8x1024 | TTFT 1x128 | decode b1 | accelerate s | held GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    by: dict[str, dict] = {}
    for r in result["rows"]:
        d = by.setdefault(r["impl"], {})
        if "tokens" in r:
            d[(r["batch"], r["tokens"])] = r["prefill_ms"]
        else:
            d.update(r)
    floors = {(r["batch"], r["tokens"]): r["floor_ms"] for r in result["rows"] if "floor_ms" in r}
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    print("| floor | " + " | ".join(fmt(floors.get(s)) for s in SHAPES) + " | - | - | - | - |")
    for impl, d in by.items():
        cells = [fmt(d.get(s)) for s in SHAPES]
        cells += [fmt(d.get("ttft_ms_1x128")), fmt(d.get("decode_ms_batch1")), fmt(d.get("accelerate_s")),
                  fmt(d.get("held_beyond_kv_pool_GiB"))]  # fmt: skip
        print(f"| {impl} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
