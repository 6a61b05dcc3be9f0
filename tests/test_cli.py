"""The ``attngraph`` command line on the CPU with tiny configs (``main()`` in process, and
``python -m attngraph`` once in a subprocess)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import attngraph
from attngraph.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_the_package_metadata():
    from importlib import metadata

    assert attngraph.__version__ == metadata.version("attngraph")


def test_python_m_attngraph_help_and_version():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = lambda *a: subprocess.run([sys.executable, "-m", "attngraph", *a], capture_output=True, text=True, env=env, timeout=300)  # noqa: E731
    out = run("--help")
    assert out.returncode == 0, out.stderr
    for command in ("explain", "generate", "bench"):
        assert command in out.stdout
    out = run("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"attngraph {attngraph.__version__}"


def test_explain_model_type_tiny(capsys):
    # gemma2 has no SDPA path in recent transformers: the default attention is transformers' choice
    assert main(["explain", "gemma2", "--tiny", "--set", "num_hidden_layers=3", "--seq-len", "12"]) == 0
    out = capsys.readouterr().out
    assert "3/3 attention sites lowered" in out
    assert "model.layers.2.self_attn" in out


def test_explain_checkpoint_folder(tmp_path, capsys):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128)  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    assert main(["explain", str(tmp_path), "--attn-implementation", "eager"]) == 0
    out = capsys.readouterr().out
    assert "2/2 attention sites lowered" in out and "eager" in out


def test_generate_tiny_prints_speed_and_identical_tokens(capsys):
    assert main(["generate", "llama", "--tiny", "--prompt", "Hello there", "--max-new-tokens", "8", "--batch", "2",
                 "--backend", "torch_native", "--page-size", "4"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "HF eager generate:" in out and "attngraph generate:" in out and "tokens/s" in out
    assert "tokens identical to HF eager: yes" in out


def test_errors_are_one_line_messages(capsys):
    with pytest.raises(SystemExit, match="neither a local folder nor a transformers model type"):
        main(["explain", "no_such_model_type", "--tiny"])
    if not torch.cuda.is_available():
        assert main(["generate", "llama", "--tiny", "--prompt", "x", "--backend", "flashinfer"]) == 1
        assert "BackendUnavailableError" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_bench_without_cuda_says_so():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["bench", "generate", "--batches", "1"])
