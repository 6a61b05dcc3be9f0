"""`accelerate` on a model sharded by transformers' tensor parallelism, two gloo ranks on CPU.

Each model is saved with `save_pretrained` to a temporary folder and loaded on every rank with
``tp_plan="auto"`` (`tp_worker.py` under torchrun). Greedy generate of a left-padded batch on
the accelerated sharded model must equal the unsharded model's on both ranks, and each rank
must attend over its own share of the heads, with a KV pool of that share and of the same
number of pages as every other rank's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ..hf_models import build_model

pytest.importorskip("accelerate")  # transformers' tp_plan loading needs it (the test extra installs it)
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("tp_worker.py")


def launch(path: Path, nproc: int, backend: str = "torch_native", *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "0")}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(WORKER), str(path), backend, *extra]  # fmt: skip
    # A session of its own: on a timeout the ranks (torchrun's children) are killed with it.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the ranks did not finish in 600 s\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_ranks(path: Path, nproc: int = 2, backend: str = "torch_native") -> list[dict]:
    proc = launch(path, nproc, backend)
    # The ranks share one stdout: lines may run into each other, so match the records themselves.
    results = [json.loads(m) for m in re.findall(r"RESULT (\{[^{}]*\})", proc.stdout)]
    assert len(results) == nproc, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return sorted(results, key=lambda r: r["rank"])


@pytest.mark.parametrize("arch,impl", [("llama", "sdpa"), ("qwen2", "eager")])
def test_sharded_greedy_equals_unsharded_on_every_rank(tmp_path, arch, impl):
    model = build_model(arch, impl)
    model.save_pretrained(tmp_path)
    hq, hkv = model.config.num_attention_heads, model.config.num_key_value_heads
    for r in run_ranks(tmp_path):
        assert "error" not in r, r
        assert r["equal"], r
        assert (r["q_heads"], r["kv_heads"], r["pool_kv_heads"]) == (hq // 2, hkv // 2, hkv // 2), r
        assert r["pool_pages"] == 512 // 4, r  # the smaller of the ranks' pools (512 and 768 tokens)
        assert r["used_pages"] == 0 and r["compilations"] == 1, r


def test_a_rank_count_that_does_not_divide_the_heads_is_refused_on_every_rank(tmp_path):
    model = build_model("llama", "sdpa")  # 4 query / 2 KV heads
    model.save_pretrained(tmp_path)
    results = run_ranks(tmp_path, nproc=3)
    for r in results:
        assert "UnsupportedModelError" in r.get("error", ""), r
        assert "does not divide" in r["error"] and "--nproc-per-node" in r["error"], r


def test_a_rank_failing_mid_step_stops_every_rank(tmp_path):
    """Rank 1 raises in its third step while rank 0 waits in a collective of that step: torchrun
    stops the other ranks at the first failure, so the job ends with rank 1's error, no hang."""
    model = build_model("llama", "sdpa")
    model.save_pretrained(tmp_path)
    start = time.monotonic()
    proc = launch(tmp_path, 2, "torch_native", "fail-rank-1")
    assert proc.returncode != 0
    assert "rank 1 failed during a step" in proc.stdout + proc.stderr
    assert "RESULT" not in proc.stdout  # neither rank finished generate
    assert time.monotonic() - start < 300
