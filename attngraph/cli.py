"""The ``attngraph`` command line (also ``python -m attngraph``).

    attngraph explain llama --tiny                      # attention sites of a random-weight model
    attngraph explain ./my-checkpoint --seq-len 64      # a local transformers checkpoint folder
    attngraph generate qwen2 --tiny --prompt "Hello"    # tokens/s against HF eager, same tokens?
    attngraph bench generate --batches 1                # the GPU benchmarks of the repository

MODEL is a local checkpoint folder (``config.json``, weights, optionally a tokenizer) or a
transformers model type (``llama``, ``qwen2``, ``mistral``, ``gpt2``...) built from its default
config with random weights; ``--tiny`` shrinks it to a few layers of width 64 and ``--set
KEY=VALUE`` overrides any config field. Progress bars show on long waits (loading, compiling)
when stderr is a terminal; otherwise only the results are printed.
"""

from __future__ import annotations

import argparse
import ast
import copy
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

#: ``--tiny``: config fields of a model small enough to build and compile on a laptop CPU in seconds.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=512,
)

#: ``attngraph bench NAME`` -> script under the repository's ``benchmarks/`` folder.
BENCHMARKS = {
    "generate": "bench_generate.py",
    "attention": "bench_attention.py",
    "profile-decode": "profile_decode.py",
    "prefill": "bench_prefill.py",
}


# ----------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="attngraph",
        description="Find, lower and serve the attention of Hugging Face models (a torch.compile backend "
        "and a paged-KV runtime).",
    )
    parser.add_argument("--version", action="version", version=f"attngraph {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what attngraph does (INFO level)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    explain = sub.add_parser("explain", help="list the attention sites of a model: lowered or why not")
    _model_arguments(explain)
    explain.add_argument("--batch", type=int, default=1, help="rows of the random input (default 1)")
    explain.add_argument("--seq-len", type=int, default=16, help="tokens per row of the random input (default 16)")
    explain.set_defaults(run=run_explain)

    generate = sub.add_parser("generate", help="greedy generate with HF eager and with attngraph: tokens/s, same tokens?")
    _model_arguments(generate)
    generate.add_argument("--prompt", required=True, help="prompt text (without a tokenizer its UTF-8 bytes are the token ids)")
    generate.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per row (default 32)")
    generate.add_argument("--batch", type=int, default=1, help="copies of the prompt in the batch (default 1)")
    generate.add_argument("--backend", default="auto", help="attention backend: auto, torch_native, triton, flashinfer")
    generate.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    generate.set_defaults(run=run_generate)

    bench = sub.add_parser(
        "bench",
        help="run a GPU benchmark of the repository (needs CUDA)",
        description="Run one of the repository's GPU benchmarks; arguments after NAME go to the script "
        "(`attngraph bench generate --help`).",
    )
    bench.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark script")
    bench.set_defaults(run=run_bench)
    return parser


def _model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="a local checkpoint folder, or a transformers model type (llama, qwen2, ...)")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: " + ", ".join(f"{k}={v}" for k, v in TINY.items()))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field (repeatable)")
    p.add_argument(
        "--attn-implementation", default=None, choices=["sdpa", "eager"],
        help="transformers attention (default: transformers' choice, sdpa where the model has it)",
    )  # fmt: skip
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs (default 0)")


def _overrides(pairs: Sequence[str]) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"attngraph: error: --set takes KEY=VALUE, got {pair!r}")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value  # a plain string such as a model type or an activation name
    return out


# ----------------------------------------------------------------------------- models
def load_model(args: argparse.Namespace):
    """``(model, tokenizer or None)`` for MODEL, on ``args.device`` in ``args.dtype``, eval mode."""
    import torch
    import transformers

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    fields = {**(TINY if args.tiny else {}), **_overrides(args.set)}
    torch.manual_seed(args.seed)
    tokenizer = None
    attn = {} if args.attn_implementation is None else {"attn_implementation": args.attn_implementation}
    if os.path.isdir(args.model):
        config = transformers.AutoConfig.from_pretrained(args.model, **fields)
        has_weights = any(Path(args.model).glob("*.safetensors")) or any(Path(args.model).glob("*.bin"))
        if has_weights and not fields:
            model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, **attn)
        else:  # a config alone, or sizes changed: random weights
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, **attn)
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        except (OSError, ValueError, KeyError):
            tokenizer = None
    else:
        try:
            config = transformers.AutoConfig.for_model(args.model, **fields)
        except ValueError:
            raise SystemExit(
                f"attngraph: error: {args.model!r} is neither a local folder nor a transformers model type; "
                "give a checkpoint folder or a model type such as llama, qwen2, mistral, gemma, gpt2"
            ) from None
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, **attn)
    return model.to(device).eval(), tokenizer


def _random_ids(vocab: int, batch: int, seq: int, seed: int, device):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(min(3, vocab - 1), vocab, (batch, seq), generator=g).to(device)


def _prompt_ids(prompt: str, tokenizer, vocab: int, batch: int, device):
    """``[batch, S]`` token ids of ``prompt`` and a note saying how they were made."""
    import torch

    if tokenizer is not None:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        note = "tokenizer of the checkpoint"
    else:
        # No tokenizer for a random-weight model: its UTF-8 bytes, folded into the vocabulary.
        ids = torch.tensor([[3 + b % max(1, vocab - 3) for b in prompt.encode()]], dtype=torch.long)
        note = "no tokenizer: the prompt's UTF-8 bytes as token ids"
    if ids.shape[1] == 0:
        raise SystemExit("attngraph: error: --prompt is empty; give at least one character")
    return ids.repeat(batch, 1).to(device), note


def _stages(names: Sequence[str]):
    """A progress bar over the named long waits (shown only when stderr is a terminal)."""
    from tqdm.auto import tqdm

    return tqdm(total=len(names), desc=names[0], unit="step", leave=False, disable=None, file=sys.stderr)


def _advance(bar, name: str | None) -> None:
    bar.update(1)
    if name is not None:
        bar.set_description(name)


# ----------------------------------------------------------------------------- commands
def run_explain(args: argparse.Namespace) -> int:
    import attngraph

    if args.batch < 1 or args.seq_len < 1:
        raise SystemExit("attngraph: error: --batch and --seq-len must be >= 1")
    bar = _stages(["loading the model", "tracing through the passes"])
    model, _ = load_model(args)
    _advance(bar, "tracing through the passes")
    ids = _random_ids(model.config.vocab_size, args.batch, args.seq_len, args.seed, next(model.parameters()).device)
    report = attngraph.explain(model, ids)
    _advance(bar, None)
    bar.close()
    print(f"{type(model).__name__} ({args.model}), input_ids [{args.batch}, {args.seq_len}], "
          f"attn_implementation={model.config._attn_implementation}")  # fmt: skip
    print(report)
    return 0


def run_generate(args: argparse.Namespace) -> int:
    import attngraph

    if args.max_new_tokens < 1 or args.batch < 1:
        raise SystemExit("attngraph: error: --max-new-tokens and --batch must be >= 1")
    bar = _stages(["loading the model", "HF eager generate", "attngraph.accelerate (compile, capture)",
                   "attngraph generate"])  # fmt: skip
    model, tokenizer = load_model(args)
    device = next(model.parameters()).device
    ids, note = _prompt_ids(args.prompt, tokenizer, model.config.vocab_size, args.batch, device)
    reference = copy.deepcopy(model)
    _advance(bar, "HF eager generate")
    want, t_hf = _timed_generate(reference, ids, args.max_new_tokens)
    _advance(bar, "attngraph.accelerate (compile, capture)")
    t0 = time.perf_counter()
    attngraph.accelerate(model, attention_backend=args.backend, page_size=args.page_size)
    t_setup = time.perf_counter() - t0
    _advance(bar, "attngraph generate")
    got, t_ag = _timed_generate(model, ids, args.max_new_tokens)
    _advance(bar, None)
    bar.close()

    n = args.batch * args.max_new_tokens
    backend = type(attngraph.runtime.accelerate.state_of(model).runner.backend).__name__
    print(f"{type(model).__name__} ({args.model}) on {device}, {model.dtype}; prompt of {ids.shape[1]} tokens "
          f"({note}), batch {args.batch}, {args.max_new_tokens} new tokens, greedy")  # fmt: skip
    print(f"HF eager generate:     {n / t_hf:10.1f} tokens/s")
    print(f"attngraph generate:    {n / t_ag:10.1f} tokens/s  ({backend}; accelerate() took {t_setup:.1f} s)")
    same = bool((got == want).all()) if got.shape == want.shape else False
    if same:
        print("tokens identical to HF eager: yes")
    else:
        new_got, new_want = got[:, ids.shape[1]:], want[:, ids.shape[1]:]
        width = min(new_got.shape[1], new_want.shape[1])
        differ = (new_got[:, :width] != new_want[:, :width]).any(0).nonzero()
        first = int(differ[0]) if differ.numel() else width
        print(f"tokens identical to HF eager: no (first difference at new token {first})")
    if tokenizer is not None:
        print("text:", tokenizer.decode(got[0, ids.shape[1]:], skip_special_tokens=True))
    return 0


def _timed_generate(model, ids, new_tokens: int):
    import torch

    pad = getattr(model.generation_config, "pad_token_id", None)
    pad = 0 if pad is None else pad
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
        _sync(ids)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kw)
        _sync(ids)
    return out, time.perf_counter() - t0


def _sync(t) -> None:
    if t.is_cuda:
        import torch

        torch.cuda.synchronize()


def run_bench(args: argparse.Namespace) -> int:
    import torch

    script = benchmarks_dir() / BENCHMARKS[args.name]
    if not script.is_file():
        raise SystemExit(
            f"attngraph: error: {script} not found: the benchmarks ship with the source repository, not the "
            "installed package; run `attngraph bench` from a clone installed with `pip install -e \".[bench]\"`"
        )
    if not torch.cuda.is_available():
        raise SystemExit(
            "attngraph: error: `attngraph bench` needs a CUDA GPU (the benchmarks time GPU kernels and CUDA "
            "graphs). On this machine `attngraph generate MODEL --tiny --prompt ...` compares tokens/s on the CPU."
        )
    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    return subprocess.call([sys.executable, str(script), *rest])


def benchmarks_dir() -> Path:
    """``benchmarks/`` of the source tree this package was imported from."""
    return Path(__file__).resolve().parent.parent / "benchmarks"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``attngraph`` script; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(format="%(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("attngraph").setLevel(logging.INFO if args.verbose else logging.WARNING)
    from .errors import AttnGraphError

    try:
        return args.run(args)
    except AttnGraphError as exc:
        print(f"attngraph: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
