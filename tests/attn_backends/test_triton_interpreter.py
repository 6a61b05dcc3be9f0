"""Triton's CPU interpreter through the public API: ``TRITON_INTERPRET=1`` set before import
makes ``accelerate(model, attention_backend="triton")`` serve CPU tensors; without it the
refusal names the variable. Nothing is monkeypatched: tests/conftest.py sets the variable
on a machine without CUDA, and the "without" case runs in a fresh interpreter."""

import copy
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attngraph
from attngraph.attn_backends.registry import get_backend_class

from ..hf_models import build_model

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
ROOT = Path(__file__).resolve().parents[2]
GREEDY = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="tests/conftest.py sets TRITON_INTERPRET=1 without CUDA")
@pytest.mark.parametrize(
    "arch,impl", [("llama", "sdpa"), ("gpt_oss", "eager"), ("llama4", "sdpa"), ("falcon_alibi", "eager"), ("deepseek_v3", "sdpa")]
)
def test_accelerate_with_triton_on_cpu_matches_hf(caplog, arch, impl):
    from attngraph.attn_backends.triton_ops import interpreter_problem

    model = build_model(arch, impl)
    problem = interpreter_problem()
    if problem is not None:  # an old Triton with a new numpy: refused with the fix, never run
        with pytest.raises(attngraph.BackendUnavailableError, match="triton>=3.7 or numpy<2.4"):
            attngraph.accelerate(model, attention_backend="triton", page_size=4, kv_cache_tokens=128, max_context_len=64)
        return
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="attngraph"):
        attngraph.accelerate(model, attention_backend="triton", page_size=4, kv_cache_tokens=128, max_context_len=64)
    assert any("interpreter" in r.getMessage() and "TRITON_INTERPRET=1" in r.getMessage() for r in caplog.records)
    assert type(attngraph.runtime.accelerate.state_of(model).runner.backend).__name__ == "TritonBackend"
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=g)
    with torch.no_grad():
        want = reference.generate(ids, **GREEDY)
    assert torch.equal(model.generate(ids, **GREEDY), want)
    # "auto" still picks torch_native on the CPU: the interpreter is for stepping through kernels.
    assert "cpu" in get_backend_class("triton").capabilities.device_types


_WITHOUT = """
import torch, attngraph
from tests.hf_models import build_model
for make in (lambda: attngraph.backend(attention_backend="triton"),
             lambda: attngraph.accelerate(build_model("llama", "sdpa"), attention_backend="triton")):
    try:
        make()
    except attngraph.BackendUnavailableError as exc:
        assert "TRITON_INTERPRET=1" in str(exc) and "torch_native" in str(exc), exc
        print("refused:", exc)
    else:
        raise SystemExit("not refused")
"""


def test_without_the_variable_triton_is_refused_naming_it():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _WITHOUT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("refused:") == 2
