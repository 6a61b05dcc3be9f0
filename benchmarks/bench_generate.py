"""Decode steps of `generate` on the GPU: attngraph against HF, each row against the floor.

Llama-3.2-1B- and Llama-3.1-8B-shaped models (random weights, bf16), greedy, left-padded
prompts of ``--prompt`` tokens. A decode step is ``(t(N) - t(1)) / (N - 1)``: the wall time of
a ``generate`` of ``N = --new-tokens`` tokens minus that of a 1-token one (the prefill), each
timed after a warm-up run of the same length. The floor is the time to read every weight once
at the copy bandwidth measured in the same run; each row gives its ratio to it. For attngraph
rows also: kernels per decode step and their summed GPU time (torch.profiler over one decode
step of the captured graph), and the teacher-forced agreement with HF eager (HF eager's greedy
choice on the row's own prefix).

    python benchmarks/bench_generate.py --shapes 1b,8b --batches 1,16,64 --backends triton \
        --hf-static --out benchmarks/results/generate.json
    python benchmarks/bench_generate.py --shapes 1b --batches 1,16 --backends triton \
        --loops chunks,steps --skinny on,off   # the decoding loops and the GEMV side by side
    python benchmarks/bench_generate.py --shapes 1b,8b --batches 1,16 --backends triton \
        --pdl on,ours,off   # programmatic dependent launch: all kernels, attngraph's only, none
    python benchmarks/bench_generate.py --shapes 1b,8b --batches 1,16 --backends triton \
        --prefetch on,off   # the projections' weights asked into L2 before the PDL wait, or not
    python benchmarks/bench_generate.py --shapes 1b --batches 1,16 --backends triton \
        --dot-fold-norm on,off --dot-min-rows 3,1   # norm in the tensor-core kernel; 1-2 rows on it
    python benchmarks/bench_generate.py --shapes 1b --batches 1,16 --backends triton \
        --fold-rope on,off,linear   # the rotary embedding in the decode attention kernel, the q/k/v GEMV, or neither
    python benchmarks/bench_generate.py --shapes 1b --batches 1,16 --backends triton \
        --l2-prefetch-mlp 0,33554432   # 32 MiB of each layer's gate/up asked into L2 during attention
    python benchmarks/bench_generate.py --shapes 1b --batches 1,16 --backends triton \
        --norm-epilogue off,on   # the MLP's add + RMSNorm in the output projection's GEMV epilogue
    python benchmarks/bench_generate.py --shapes 1b,8b --batches 1 --backends triton --interleave \
        --variant default --variant fuse-o=on --variant default   # attention + output projection in one op
    python benchmarks/bench_generate.py --shapes 1b,8b --batches 1,16 --backends triton \
        --gemv-table tuned,chain.json   # GEMV configurations of `bench_gemv_chain.py --table-out chain.json`
    python benchmarks/bench_generate.py --shapes 1b --batches 1,16 --backends triton --interleave \
        --variant default --variant "fold-rope=linear" --variant "decode-block-n=256" --variant default
    python benchmarks/plot_generate.py benchmarks/results/generate.json --png benchmarks/generate.png

Rows are every combination of the switches' values, built and timed one after the other; with
``--variant`` (repeatable) only the rows named, each a set of switches over their first values.
``--interleave`` builds every row first (each keeps its model copy, KV pool and CUDA graphs on
the device) and then times their generates in rounds, the rows in an order rotated by one each
round: a drift of the machine's speed over the minutes of a run (rows of one command timed
sequentially have moved by 5% between the first and the last) then meets every row alike.
Naming one row twice (an A/A pair) shows what is left of the noise.

``--gemv-table`` sets the GEMV's launch configurations read at capture: ``tuned`` (the module's
tables and heuristic), ``unpipelined`` (the same with ``num_stages = 1``: one weight chunk in
flight per program) or a JSON file ``{"plain" | "silu" | "norm": {"ROWS,N,K": config}}`` whose
entries take precedence (``ROWS`` padded to a power of two; `bench_gemv_chain.py`'s winners;
a config may add ``"PRELOAD": 0``, every weight chunk loaded after the PDL wait); its ``"dot":
{"N,K": config}`` entries set the tensor-core kernel's (`attngraph.skinny_dot`, 3-16 rows). The files of
``benchmarks/gemv_tables/`` are the ones timed in BENCHMARKS.md and ``run_gpu.sh decode``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import os
import re
import shlex
import statistics
import sys
import time

import torch
import transformers

import attngraph
import attngraph.argmax
import attngraph.pdl
from attngraph import linear_ops

ONE_ROW_DEFAULT = linear_ops.KERNEL_MAX_WEIGHT_ONE_ROW
DOT_DEFAULTS = (linear_ops.DOT_MAX_ROWS, linear_ops.DOT_MAX_WEIGHT)
DOT_FOLD_NORM_DEFAULT, DOT_MIN_ROWS_DEFAULT = linear_ops.DOT_FOLD_NORM, linear_ops.DOT_MIN_ROWS
DOT_HEADS_DEFAULT = linear_ops.DOT_HEADS
GATED_WEIGHT_DEFAULT = linear_ops.DOT_MAX_GATED_WEIGHT


def gemv_table(value: str, tuned):
    """The `skinny_linear.default_config` to capture with for ``--gemv-table``'s ``value`` (see
    the module's docstring), over ``tuned`` (the module's own). A file's configurations are
    checked as the kernel's launcher checks them (`InputError` names a bad key or value)."""
    from attngraph import skinny_linear

    if value == "tuned":
        return tuned
    if value == "unpipelined":
        return lambda m, n, k, **kw: dict(tuned(m, n, k, **kw), num_stages=1)
    with open(value) as f:
        table = {kind: {tuple(int(v) for v in key.split(",")): skinny_linear._check_config(cfg)
                        for key, cfg in entries.items()}
                 for kind, entries in json.load(f).items() if kind != "dot"}  # fmt: skip

    def config(m, n, k, *, silu_mul=False, norm=False):
        kind = "silu" if silu_mul else "norm" if norm else "plain"
        hit = table.get(kind, {}).get((skinny_linear.rows_padded(m), n, k))
        return dict(hit) if hit is not None else tuned(m, n, k, silu_mul=silu_mul, norm=norm)

    return config


def dot_table(value: str, tuned):
    """The `skinny_dot.default_config` (3-16 rows on tensor cores) to capture with for
    ``--gemv-table``'s ``value``: a JSON file's ``"dot": {"N,K": config}`` entries over ``tuned``
    (the module's own), checked as the kernel's launcher checks them."""
    from attngraph import skinny_dot

    if value in ("tuned", "unpipelined"):
        return tuned
    with open(value) as f:
        entries = json.load(f).get("dot", {})
    table = {tuple(int(v) for v in key.split(",")): skinny_dot._check_config(cfg) for key, cfg in entries.items()}
    if not table:
        return tuned
    return lambda n, k: dict(table[(int(n), int(k))]) if (int(n), int(k)) in table else tuned(n, k)


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


def _generate_once(model, ids, mask, new_tokens: int, kw: dict) -> tuple[torch.Tensor, float, float]:
    """``(sequences, wall seconds, host seconds)`` of one generate: wall until the device has
    finished, host until ``generate`` returned (it reads nothing back on attngraph's greedy
    path, so the host may return long before the device finishes, unless it is the slower one)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, **kw)
    t_host = time.perf_counter()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0, t_host - t0


class _Collections:
    """Counts the garbage collector's passes per generation while active (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.counts[info["generation"]] += 1

    def __enter__(self) -> "_Collections":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


class _KeepScores(transformers.LogitsProcessor):
    """A logits processor that changes nothing: with one, attngraph's loop decodes a step at a
    time (the loop greedy search without processors replaces by multi-step chunks)."""

    def __call__(self, input_ids, scores):
        return scores


#: ``--fuse-o`` on: ``on``, ``on-s8`` (at most 8 splits per KV head), ``on-o8`` (8 weight rows per
#: projection program), ``on-s8-o8``.
FUSE_O = re.compile(r"on(-s(\d+))?(-o(\d+))?")

#: ``--pdl``: what each setting adds to the label.
PDL_LABELS = {"on": "", "ours": " pdl=attngraph kernels only", "off": " pdl=off"}

#: The switches a row combines, in the order of its variant tuple (``--variant`` names them so).
VARIANT_SWITCHES = ("backends", "skinny", "fold_rms_norm", "pdl", "one_row_limit", "dot", "prefetch", "dot_fold_norm",
                    "dot_min_rows", "fold_rope", "l2_prefetch_mlp", "norm_epilogue", "gemv_table", "decode_block_n",
                    "decode_min_split", "fuse_o", "decode_merge_chunk", "gated_mlp", "l2_prefetch_o", "dot_heads", "gated_weight_limit",
                    "rank_one", "argmax")  # fmt: skip

#: ``--loops``: generate keywords per decoding loop.
LOOPS = {"chunks": {}, "steps": {"logits_processor": transformers.LogitsProcessorList([_KeepScores()])}}


def teacher_forced_agreement(reference, accelerated, sequences, prompt_len: int, mask) -> float:
    """Fraction of generated positions where HF eager, given the accelerated run's own prefix,
    has the generated token as a greedy choice: its largest logit, tied or not (random weights
    make free-running sequences diverge at the first bf16 near-tie, so this is the per-position
    measure; at an exact tie both tokens are HF's argmax)."""
    full_mask = torch.cat([mask, torch.ones_like(sequences[:, prompt_len:])], 1)
    with torch.no_grad():
        logits = reference(sequences, attention_mask=full_mask).logits[:, prompt_len - 1 : -1]
    picked = logits.gather(-1, sequences[:, prompt_len:, None]).squeeze(-1)
    return float((picked == logits.max(-1).values).float().mean())


def spread(steps: list[float]) -> dict:
    """The range of a row's repeated step timings, for the JSON (``ms_per_step_range``)."""
    return {"ms_per_step_range": [round(min(steps), 3), round(max(steps), 3)]} if len(steps) > 1 else {}


def decode_step_ms(model, ids, mask, new_tokens: int, repeats: int = 1,
                   **extra) -> tuple[torch.Tensor, float, list[float], dict]:  # fmt: skip
    """``(sequences of the N-token generate, ms per decode step, each repeat's, host stats)``:
    `interleaved_steps` of this one model (after one warm-up of each length, the 1- and N-token
    generates alternate, so a drift of the host's speed meets both)."""
    return interleaved_steps([dict(model=model, ids=ids, mask=mask, extra=extra, apply=lambda: None)], new_tokens, repeats)[0]


def interleaved_steps(runs: list[dict], new_tokens: int, repeats: int) -> list[tuple]:
    """`decode_step_ms` of several runs at once, their timed generates interleaved.

    Each run is a dict of ``model``, ``ids``, ``mask``, ``extra`` (generate keywords) and
    ``apply`` (a callable that sets the module settings the run was built with; called before
    each of its generates). A decode step is ``(t(N) - t(1)) / (N - 1)``, with t(1) the median
    of a run's ``repeats`` 1-token timings and t(N) each of its N-token ones; the step reported
    is their median. After one warm-up of each length per run, every round times each run's 1-
    and N-token generates in turn, the runs in an order rotated by one per round, so a drift of
    the device's or the host's speed over the minutes of a benchmark (clocks, heat) meets every
    run alike rather than the rows timed last.

    Returns per run ``(sequences of its last N-token generate, ms per step, each repeat's, host
    stats)``. Host stats: ``host_ms_per_step``, the same difference of the times until
    ``generate`` returned (near the step itself: the host, not the device, sets the pace), and
    ``gc_collections``, the collector's passes per generation during all the timed generates.
    """
    kws = [dict(attention_mask=r["mask"], do_sample=False, pad_token_id=0, eos_token_id=None, **r["extra"]) for r in runs]
    for run, kw in zip(runs, kws):  # compiles, caches
        run["apply"]()
        for n in (1, new_tokens):
            _generate_once(run["model"], run["ids"], run["mask"], n, kw)
    walls = [{1: [], new_tokens: []} for _ in runs]
    hosts = [{1: [], new_tokens: []} for _ in runs]
    outs = [None] * len(runs)
    with _Collections() as collections:
        for r in range(repeats):
            for j in range(len(runs)):
                i = (j + r) % len(runs)
                runs[i]["apply"]()
                for n in (1, new_tokens):
                    outs[i], wall, host = _generate_once(runs[i]["model"], runs[i]["ids"], runs[i]["mask"], n, kws[i])
                    walls[i][n].append(wall)
                    hosts[i][n].append(host)
    results = []
    for i in range(len(runs)):
        t1, h1 = statistics.median(walls[i][1]), statistics.median(hosts[i][1])
        steps = [(tn - t1) / (new_tokens - 1) * 1e3 for tn in walls[i][new_tokens]]
        host_steps = [(hn - h1) / (new_tokens - 1) * 1e3 for hn in hosts[i][new_tokens]]
        stats = {"host_ms_per_step": round(statistics.median(host_steps), 3), "gc_collections": collections.counts}
        results.append((outs[i], statistics.median(steps), steps, stats))
    return results


def decode_kernels(model, batch: int, context: int) -> dict:
    """Kernels, their summed GPU time and the time any of them ran (with programmatic dependent
    launch the kernels overlap) in one decode step of an accelerated model at ``batch``."""
    from profile_kernels import decode_step, kernel_table

    from attngraph.runtime.accelerate import state_of

    runner = state_of(model).runner
    step, free = decode_step(runner, batch, context, model.config.vocab_size)
    try:
        table = kernel_table(step)
    finally:
        free()
    return {"kernels": table["kernels"], "gpu_ms": round(table["gpu_ms"], 3), "gpu_busy_ms": round(table["gpu_busy_ms"], 3)}


def variant_rows(args: argparse.Namespace, error) -> list[tuple[str, ...]]:
    """The rows ``--variant`` asks for, as tuples in `VARIANT_SWITCHES` order: the switches a
    spec names take its values, the others their first value. Each named value is appended to
    its switch's list in ``args`` (so the switch's own checks cover it); ``error`` (the
    parser's) is called on an item that is no ``NAME=VALUE`` of a switch."""
    rows = []
    for spec in args.variant:
        given = {}
        for item in [] if spec.strip() == "default" else spec.split():
            key, eq, value = item.partition("=")
            attr = key.replace("-", "_")
            if not eq or attr not in VARIANT_SWITCHES or not value or "," in value:
                names = ", ".join(name.replace("_", "-") for name in VARIANT_SWITCHES)
                error(f"--variant {spec!r}: {item!r} is no NAME=VALUE of {names}")
            if attr in given:
                error(f"--variant {spec!r} names {key} twice")
            given[attr] = value
            if value not in getattr(args, attr).split(","):
                setattr(args, attr, getattr(args, attr) + "," + value)
        rows.append(tuple(given.get(attr, getattr(args, attr).split(",")[0]) for attr in VARIANT_SWITCHES))
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1b", help="1b (Llama-3.2-1B) and/or 8b (Llama-3.1-8B), comma-separated")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--backends", default="triton,flashinfer")
    p.add_argument("--hf-eager", action="store_true", help="also time HF eager generate (slow)")
    p.add_argument("--hf-static", nargs="?", const="all", default="",
                   help="also HF generate with a static cache (compiled by transformers), for these shapes (default: all)")
    p.add_argument("--loops", default="chunks",
                   help="attngraph's decoding loop: chunks (multi-step graphs: greedy without processors) and/or "
                        "steps (a step at a time, as with any logits processor), comma-separated")  # fmt: skip
    p.add_argument("--skinny", default="on", help="CompileConfig.skinny_linears: on (the default on CUDA) and/or off, comma-separated")
    p.add_argument("--dot", default="on",
                   help="3-16 token rows on the tensor-core kernel (linear_ops.DOT_MAX_ROWS): on (the default) and/or off")
    p.add_argument("--prefetch", default="default",
                   help="attngraph.weight_prefetch.ENABLED (the projections' weights asked into L2 before the PDL wait): "
                        "default (the module's), on and/or off, comma-separated")  # fmt: skip
    p.add_argument("--dot-fold-norm", default="default",
                   help="linear_ops.DOT_FOLD_NORM (RMSNorm folded into the tensor-core kernel's loads): default (the "
                        "module's), on and/or off, comma-separated")  # fmt: skip
    p.add_argument("--dot-min-rows", default="default",
                   help="linear_ops.DOT_MIN_ROWS (1: one and two rows the GEMV declines go to the tensor-core kernel, "
                        "not cuBLAS): default (the module's) and/or values, comma-separated")  # fmt: skip
    p.add_argument("--fold-rope", default="default",
                   help="CompileConfig.fold_rope (the rotary embedding into the attention op; the Triton decode kernel "
                        "applies it): default (the config's), on, off and/or linear (on with fold_rope_linear: on into "
                        "the q/k/v projection), comma-separated")  # fmt: skip
    p.add_argument("--fold-rms-norm", default="on", help="CompileConfig.fold_rms_norm: on (the default) and/or off, comma-separated")
    p.add_argument("--pdl", default="on",
                   help="programmatic dependent launch (attngraph.pdl): on (attngraph's kernels and inductor's), ours "
                        "(attngraph's kernels only) and/or off, comma-separated")  # fmt: skip
    p.add_argument("--one-row-limit", default="default",
                   help="linear_ops.KERNEL_MAX_WEIGHT_ONE_ROW: the largest weight (elements) the GEMV takes at one row, "
                        "comma-separated values (default: the module's)")  # fmt: skip
    p.add_argument("--l2-prefetch-mlp", default="0",
                   help="CompileConfig.l2_prefetch_mlp_bytes: bytes of each layer's MLP weight asked into L2 before its "
                        "decode attention, comma-separated values (0: off, the default)")  # fmt: skip
    p.add_argument("--dot-heads", default="default",
                   help="linear_ops.DOT_HEADS (output heads of 3-16 rows on the tensor-core kernel): default (the "
                        "module's), on and/or off, comma-separated")  # fmt: skip
    p.add_argument("--l2-prefetch-o", default="off",
                   help="CompileConfig.l2_prefetch_o (each layer's decode attention kernel asks L2 for the layer's "
                        "output-projection weight): off (the default) and/or on, comma-separated")  # fmt: skip
    p.add_argument("--norm-epilogue", default="default",
                   help="CompileConfig.fold_norm_epilogue (the MLP's residual add + RMSNorm in the output projection's "
                        "GEMV epilogue): default (the config's), on and/or off, comma-separated")  # fmt: skip
    p.add_argument("--gemv-table", default="tuned",
                   help="the GEMV's configurations: tuned, unpipelined and/or JSON files, comma-separated (see above)")
    p.add_argument("--decode-block-n", default="default",
                   help="keys per block of the Triton decode kernel: default and/or counts (a split holds whole "
                        "blocks; warps as decode_num_warps gives them), comma-separated")
    p.add_argument("--decode-min-split", default="default",
                   help="the Triton backend's min_split_len (a request's decode splits hold at least this many keys): "
                        "default and/or counts, comma-separated")  # fmt: skip
    p.add_argument("--decode-merge-chunk", default="default",
                   help="splits whose partials the Triton decode kernel's merging program loads together: default "
                        "(decode_attention.merge_chunk's choice) and/or counts, comma-separated")  # fmt: skip
    p.add_argument("--gated-mlp", default="default",
                   help="CompileConfig.fuse_gated_mlp (a gated MLP as one op: SiLU * up in the tensor-core gate/up "
                        "product's epilogue at 3-16 rows): default (the config's), on and/or off, comma-separated")  # fmt: skip
    p.add_argument("--gated-weight-limit", default="default",
                   help="linear_ops.DOT_MAX_GATED_WEIGHT: the largest fused gate/up weight (elements) the gated MLP op "
                        "runs on tensor cores (and skinny_linears wraps for it): default (the module's) and/or values, "
                        "comma-separated")  # fmt: skip
    p.add_argument("--rank-one", default="on",
                   help="CompileConfig.rank_one_products (matrix products over one contracted element, as HF's "
                        "rotary angles in transformers 5.17, as multiplies): on (the default) and/or off, comma-separated")  # fmt: skip
    p.add_argument("--argmax", default="kernels",
                   help="how the greedy loop picks tokens (attngraph.argmax.KERNELS): kernels (the default: the row "
                        "split over the GPU) and/or torch (torch.argmax), comma-separated")  # fmt: skip
    p.add_argument("--fuse-o", default="default",
                   help="CompileConfig.fuse_attention_o (attention and the output projection as one op; one launch "
                        "for a decode step of one request on Triton): default (the config's), off and/or on, on-sN "
                        "(at most N splits per KV head in that launch), on-oN (N weight rows per projection program), "
                        "on-sN-oM")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3,
                   help="timed generates per row (after one warm-up); the median step is reported, the range beside it")
    p.add_argument("--variant", action="append", default=[], metavar="SPEC",
                   help="instead of every combination of the switches above, one row per --variant (repeatable, in "
                        "order): SPEC is 'default' or space-separated NAME=VALUE of those switches (backends=triton "
                        "fold-rope=linear ...); a switch it does not name takes its first value")  # fmt: skip
    p.add_argument("--interleave", action="store_true",
                   help="build every variant first (each holds its model copy, KV pool and graphs on the GPU), then "
                        "time their generates in interleaved rounds, so a drift of the machine's speed meets all alike")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    variant_specs = variant_rows(args, p.error)
    if bad := [v for v in args.dot.split(",") if v not in ("on", "off")]:
        p.error(f"--dot takes on and/or off; got {', '.join(bad)}")
    if bad := [v for v in args.dot_fold_norm.split(",") if v not in ("default", "on", "off")]:
        p.error(f"--dot-fold-norm takes default, on and/or off; got {', '.join(bad)}")
    if bad := [v for v in args.dot_min_rows.split(",") if v != "default" and not (v.isdigit() and 1 <= int(v) <= 16)]:
        p.error(f"--dot-min-rows takes 'default' or row counts 1-16; got {', '.join(bad)}")
    if bad := [v for v in args.fold_rope.split(",") if v not in ("default", "on", "off", "linear")]:
        p.error(f"--fold-rope takes default, on, off and/or linear; got {', '.join(bad)}")
    if bad := [v for v in args.norm_epilogue.split(",") if v not in ("default", "on", "off")]:
        p.error(f"--norm-epilogue takes default, on and/or off; got {', '.join(bad)}")
    if bad := [v for v in args.fuse_o.split(",") if v not in ("default", "off") and not FUSE_O.fullmatch(v)]:
        p.error(f"--fuse-o takes default, off and/or on[-sSPLITS][-oROWS]; got {', '.join(bad)}")
    if bad := [v for v in args.prefetch.split(",") if v not in ("default", "on", "off")]:
        p.error(f"--prefetch takes default, on and/or off; got {', '.join(bad)}")
    if bad := [v for v in args.fold_rms_norm.split(",") if v not in ("on", "off")]:
        p.error(f"--fold-rms-norm takes on and/or off; got {', '.join(bad)}")
    if bad := [v for v in args.pdl.split(",") if v not in PDL_LABELS]:
        p.error(f"--pdl takes {', '.join(PDL_LABELS)}; got {', '.join(bad)}")
    if bad := [v for v in args.one_row_limit.split(",") if v != "default" and not (v.isdigit() and int(v) > 0)]:
        p.error(f"--one-row-limit takes 'default' or positive element counts; got {', '.join(bad)}")
    if bad := [v for v in args.decode_block_n.split(",") if v != "default" and not (v.isdigit() and int(v) >= 16
                                                                                   and int(v) & (int(v) - 1) == 0)]:
        p.error(f"--decode-block-n takes 'default' or powers of two >= 16; got {', '.join(bad)}")
    if bad := [v for v in args.gated_mlp.split(",") if v not in ("default", "on", "off")]:
        p.error(f"--gated-mlp takes default, on and/or off; got {', '.join(bad)}")
    if bad := [v for v in args.gated_weight_limit.split(",") if v != "default" and not (v.isdigit() and int(v) > 0)]:
        p.error(f"--gated-weight-limit takes 'default' or positive element counts; got {', '.join(bad)}")
    if bad := [v for v in args.rank_one.split(",") if v not in ("on", "off")]:
        p.error(f"--rank-one takes on and/or off; got {', '.join(bad)}")
    if bad := [v for v in args.argmax.split(",") if v not in ("kernels", "torch")]:
        p.error(f"--argmax takes kernels and/or torch; got {', '.join(bad)}")
    if bad := [v for v in args.dot_heads.split(",") if v not in ("default", "on", "off")]:
        p.error(f"--dot-heads takes default, on and/or off; got {', '.join(bad)}")
    if bad := [v for v in args.l2_prefetch_o.split(",") if v not in ("on", "off")]:
        p.error(f"--l2-prefetch-o takes on and/or off; got {', '.join(bad)}")
    if bad := [v for v in args.decode_merge_chunk.split(",") if v != "default" and not (v.isdigit() and 1 <= int(v) <= 64)]:
        # the kernel unrolls its merge loop this many times
        p.error(f"--decode-merge-chunk takes 'default' or split counts from 1 to 64; got {', '.join(bad)}")
    if bad := [v for v in args.decode_min_split.split(",") if v != "default" and not (v.isdigit() and int(v) >= 1)]:
        p.error(f"--decode-min-split takes 'default' or key counts >= 1; got {', '.join(bad)}")
    if bad := [v for v in args.gemv_table.split(",") if v not in ("tuned", "unpipelined") and not os.path.isfile(v)]:
        p.error(f"--gemv-table takes tuned, unpipelined and/or JSON files; no such file: {', '.join(bad)}")
    if bad := [v for v in args.l2_prefetch_mlp.split(",") if not v.isdigit()]:
        p.error(f"--l2-prefetch-mlp takes byte counts >= 0; got {', '.join(bad)}")
    if not torch.cuda.is_available():
        sys.exit("bench_generate.py needs a CUDA device (it times bf16 generate on the GPU); "
                 "on a CPU `attngraph generate llama --tiny --prompt ...` compares tokens/s")  # fmt: skip
    from bench_prefill import random_model

    from attngraph import skinny_dot, skinny_linear, weight_prefetch  # imports Triton

    tuned_config, tuned_dot_config = skinny_linear.default_config, skinny_dot.default_config
    from attngraph.attn_backends.triton_ops import decode_attention

    block_n_default = decode_attention.decode_block_n
    merge_chunk_default = decode_attention.merge_chunk
    from attngraph.attn_backends import triton_backend

    min_split_default = triton_backend.TritonBackend.__init__.__kwdefaults__["min_split_len"]
    gemv_tables = {v: gemv_table(v, tuned_config) for v in args.gemv_table.split(",")}  # a bad file fails here, before any timing
    dot_tables = {v: dot_table(v, tuned_dot_config) for v in args.gemv_table.split(",")}

    prefetch_default = weight_prefetch.ENABLED

    bw = copy_bandwidth()
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    floors = {}
    for shape in args.shapes.split(","):
        model = random_model(shape)
        weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
        floor_ms = floors[shape] = weight_bytes / bw * 1e3  # every weight read once per step
        vocab = model.config.vocab_size

        def add(impl: str, b: int, **fields) -> None:
            if "ms_per_step" in fields:
                fields["x_floor"] = round(fields["ms_per_step"] / floor_ms, 2)
            rows.append(dict(shape=shape, impl=impl, batch=b, floor_ms=round(floor_ms, 3), **fields))
            print(json.dumps(rows[-1]), flush=True)

        with torch.no_grad():
            for b in batches:
                ids, mask = prompts(vocab, b, args.prompt)
                if args.hf_eager:
                    _, ms, each, host = decode_step_ms(model, ids, mask, args.new_tokens, args.repeats)
                    add("HF eager (sdpa)", b, ms_per_step=round(ms, 3), **spread(each), **host)
                if args.hf_static in ("all", shape) or shape in args.hf_static.split(","):  # transformers compiles the forward itself for a static cache
                    try:
                        out, ms, each, host = decode_step_ms(model, ids, mask, args.new_tokens, args.repeats,
                                                             cache_implementation="static")  # fmt: skip
                        add("HF static cache + torch.compile", b, ms_per_step=round(ms, 3), **spread(each), **host,
                            teacher_forced_agreement=round(teacher_forced_agreement(model, None, out, args.prompt, mask), 4))  # fmt: skip
                    except Exception as exc:
                        add("HF static cache + torch.compile", b, error=f"{type(exc).__name__}: {exc}"[:500])
                    torch._dynamo.reset()
        variants = [(name, skinny, fold, pdl, limit, dot, pf, dfold, dmin, rope, l2, ne, gt, dbn, dms, fo, mc, gm, l2o, dh, gw, r1, am) for name in args.backends.split(",") if name
                    for skinny in args.skinny.split(",") for fold in args.fold_rms_norm.split(",") for pdl in args.pdl.split(",")
                    for limit in args.one_row_limit.split(",") for dot in args.dot.split(",")
                    for pf in args.prefetch.split(",") for dfold in args.dot_fold_norm.split(",")
                    for dmin in args.dot_min_rows.split(",") for rope in args.fold_rope.split(",")
                    for l2 in args.l2_prefetch_mlp.split(",") for ne in args.norm_epilogue.split(",")
                    for gt in args.gemv_table.split(",") for dbn in args.decode_block_n.split(",")
                    for dms in args.decode_min_split.split(",") for fo in args.fuse_o.split(",")
                    for mc in args.decode_merge_chunk.split(",") for gm in args.gated_mlp.split(",")
                    for l2o in args.l2_prefetch_o.split(",") for dh in args.dot_heads.split(",")
                    for gw in args.gated_weight_limit.split(",") for r1 in args.rank_one.split(",")
                    for am in args.argmax.split(",")]  # fmt: skip
        if variant_specs:  # --variant: the named rows only, in their order
            variants = variant_specs

        def apply(variant: tuple) -> tuple[str, dict]:
            """Set the module settings of ``variant`` (read at compile and capture); its label and
            `attngraph.accelerate`'s keywords."""
            name, skinny, fold, pdl, limit, dot, pf, dfold, dmin, rope, l2, ne, gt, dbn, dms, fo, mc, gm, l2o, dh, gw, r1, am = variant
            label = f"attngraph[{name}]" + ("" if skinny == "on" else " skinny_linears=False") + PDL_LABELS[pdl]
            label += "" if fold == "on" else " fold_rms_norm=False"
            label += "" if limit == "default" else f" one-row GEMV <= {limit}"
            label += "" if dot == "on" else " dot=off"
            label += "" if pf == "default" else f" prefetch={pf}"
            label += "" if dfold == "default" else f" dot-fold-norm={dfold}"
            label += "" if dmin == "default" else f" dot-min-rows={dmin}"
            label += "" if rope == "default" else f" fold-rope={rope}"
            label += "" if int(l2) == 0 else f" l2-prefetch-mlp={int(l2) >> 20}MiB"
            label += "" if ne == "default" else f" norm-epilogue={ne}"
            label += "" if gt == "tuned" else f" gemv-table={gt}"
            label += "" if dbn == "default" else f" decode-block-n={dbn}"
            label += "" if dms == "default" else f" decode-min-split={dms}"
            label += "" if fo == "default" else f" fuse-o={fo}"
            label += "" if mc == "default" else f" decode-merge-chunk={mc}"
            label += "" if gm == "default" else f" gated-mlp={gm}"
            label += "" if l2o == "off" else " l2-prefetch-o=on"
            label += "" if dh == "default" else f" dot-heads={dh}"
            label += "" if gw == "default" else f" gated-weight-limit={gw}"
            label += "" if r1 == "on" else " rank-one=off"
            label += "" if am == "kernels" else " argmax=torch"
            attngraph.argmax.KERNELS = am == "kernels"  # read at capture (the multi-step graphs)
            # the constructor's default, read when accelerate makes the backend
            triton_backend.TritonBackend.__init__.__kwdefaults__["min_split_len"] = (
                min_split_default if dms == "default" else int(dms))  # fmt: skip
            decode_attention.decode_block_n = block_n_default if dbn == "default" else (lambda *a, n=int(dbn): n)
            decode_attention.merge_chunk = merge_chunk_default if mc == "default" else (lambda *a, n=int(mc): n)
            skinny_linear.default_config = gemv_tables[gt]  # read at capture
            skinny_dot.default_config = dot_tables[gt]
            options = {} if rope == "default" else {"fold_rope": rope != "off", "fold_rope_linear": rope == "linear"}
            options["rank_one_products"] = r1 == "on"
            if ne != "default":
                options["fold_norm_epilogue"] = ne == "on"
            if fo != "default":
                options["fuse_attention_o"] = fo != "off"
            if gm != "default":
                options["fuse_gated_mlp"] = gm == "on"
            on = FUSE_O.fullmatch(fo)  # the fused launch's splits and weight rows per program (read at capture)
            triton_backend.TritonBackend.fused_o_max_splits = int(on.group(2)) if on and on.group(2) else None
            triton_backend.TritonBackend.fused_o_block_o = int(on.group(4)) if on and on.group(4) else 4
            linear_ops.DOT_FOLD_NORM = DOT_FOLD_NORM_DEFAULT if dfold == "default" else dfold == "on"
            linear_ops.DOT_MIN_ROWS = DOT_MIN_ROWS_DEFAULT if dmin == "default" else int(dmin)
            linear_ops.DOT_HEADS = DOT_HEADS_DEFAULT if dh == "default" else dh == "on"  # read at capture
            # read by skinny_linears and fuse_gated_mlp at compile, by the gated op at capture
            linear_ops.DOT_MAX_GATED_WEIGHT = GATED_WEIGHT_DEFAULT if gw == "default" else int(gw)
            weight_prefetch.ENABLED = prefetch_default if pf == "default" else pf == "on"  # read at capture
            # off: no row count runs the tensor-core kernel, and the pass wraps no linear for it
            linear_ops.DOT_MAX_ROWS, linear_ops.DOT_MAX_WEIGHT = (DOT_DEFAULTS if dot == "on" else (0, 0))
            if dot != "on":
                linear_ops.DOT_MAX_GATED_WEIGHT = 0
            attngraph.pdl.ENABLED, attngraph.pdl.INDUCTOR = pdl != "off", pdl == "on"  # read at compile and capture
            linear_ops.KERNEL_MAX_WEIGHT_ONE_ROW = ONE_ROW_DEFAULT if limit == "default" else int(limit)
            options.update(attention_backend=name, kv_cache_tokens=1 << 15, skinny_linears=skinny == "on",
                           fold_rms_norm=fold == "on", l2_prefetch_mlp_bytes=int(l2), l2_prefetch_o=l2o == "on")  # fmt: skip
            return label, options

        def build(variant: tuple):
            """``(label, accelerated copy or None, setup seconds, kernels per batch)``: the copy's
            decode graphs of every batch captured under the variant's settings."""
            label, options = apply(variant)
            m = copy.deepcopy(model)
            t0 = time.perf_counter()
            try:
                attngraph.accelerate(m, **options)
            except Exception as exc:  # report and go on with the next variant
                add(label, 0, error=f"{type(exc).__name__}: {exc}"[:500])
                return label, None, 0.0, {}
            setup_s = time.perf_counter() - t0
            return label, m, setup_s, {b: decode_kernels(m, b, args.prompt) for b in batches}

        def report(label: str, m, b: int, loop: str, timed: tuple, mask, setup_s: float, kernels: dict) -> None:
            out, ms, each, host = timed
            add(label + ("" if loop == "chunks" else " step loop"), b, ms_per_step=round(ms, 3), **spread(each), **host,
                **kernels, teacher_forced_agreement=round(teacher_forced_agreement(model, m, out, args.prompt, mask), 4),
                setup_s=round(setup_s, 1))  # fmt: skip

        if not args.interleave:
            for variant in variants:
                label, m, setup_s, kernels = build(variant)
                if m is None:
                    continue
                for b in batches:
                    ids, mask = prompts(vocab, b, args.prompt)
                    for loop in args.loops.split(","):
                        timed = decode_step_ms(m, ids, mask, args.new_tokens, args.repeats, **LOOPS[loop])
                        report(label, m, b, loop, timed, mask, setup_s, kernels[b])
                attngraph.restore(m)
                del m  # freed before the next variant's copy is made
                torch.cuda.empty_cache()
        else:  # every variant built first, then their generates interleaved
            built = [(variant, *build(variant)) for variant in variants]
            built = [entry for entry in built if entry[2] is not None]
            for b in batches:
                ids, mask = prompts(vocab, b, args.prompt)
                for loop in args.loops.split(","):
                    runs = [dict(model=m, ids=ids, mask=mask, extra=LOOPS[loop], apply=functools.partial(apply, variant))
                            for variant, _, m, _, _ in built]  # fmt: skip
                    for (_, label, m, setup_s, kernels), timed in zip(built, interleaved_steps(runs, args.new_tokens,
                                                                                               args.repeats)):  # fmt: skip
                        report(label, m, b, loop, timed, mask, setup_s, kernels[b])
            for entry in built:
                attngraph.restore(entry[2])
            built = runs = entry = m = None  # no name holds a copy (some may never have been bound)
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
    result = dict(
        command="python benchmarks/bench_generate.py " + shlex.join(sys.argv[1:]),
        device=torch.cuda.get_device_name(), torch=torch.__version__, transformers=transformers.__version__,
        prompt=args.prompt, new_tokens=args.new_tokens, copy_bandwidth_GBps=round(bw / 1e9),
        weight_read_floor_ms=floors, rows=rows,
    )
    print(markdown_table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def markdown_table(result: dict) -> str:
    lines = ["| shape | impl | batch | ms / step | x floor | host ms / step | kernels / step | GPU ms / step "
             "| GPU busy ms / step | teacher-forced agreement |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['impl']} | {r['batch']} | error: {r['error'][:80]} | | | | | | |")
            continue
        tf = r.get("teacher_forced_agreement")
        lines.append(
            f"| {r['shape']} | {r['impl']} | {r['batch']} | {r['ms_per_step']:.3f} | {r['x_floor']:.2f} | "
            f"{r.get('host_ms_per_step', '')} | {r.get('kernels', '')} | {r.get('gpu_ms', '')} | {r.get('gpu_busy_ms', '')} | "
            f"{'' if tf is None else f'{100 * tf:.1f}%'} |"
        )
    for shape, ms in result["weight_read_floor_ms"].items():
        lines.append(f"| {shape} | floor (weights once at {result['copy_bandwidth_GBps']} GB/s) | | {ms:.3f} | 1.00 | | | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
