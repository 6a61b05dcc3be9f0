#!/usr/bin/env bash
# One GPU session, time-boxed: kernel benchmark, end-to-end generate benchmark, all GPU tests.
# Run on the GPU machine from the project root, after `source .gpu/setup.sh`; results go to $OUT.
#   QUICK=1 bash benchmarks/run_gpu.sh      # shorter: quick kernel shapes, batch 1 only
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/device.txt" 2>&1
if [ "${QUICK:-0}" = 1 ]; then ATT="--quick"; BATCHES=1; else ATT=""; BATCHES=1,8; fi
timeout 150 python3 benchmarks/bench_attention.py $ATT --backends flashinfer,triton \
    --out "$OUT/attention.json" > "$OUT/bench_attention.md" 2>&1
timeout 300 python3 benchmarks/bench_generate.py --backends flashinfer,triton --batches $BATCHES --hf-static \
    --out "$OUT/generate.json" > "$OUT/bench_generate.md" 2>&1
timeout 240 python3 -m pytest -q -m gpu --durations=10 tests/ > "$OUT/gpu_tests.log" 2>&1
echo "done" >> "$OUT/device.txt"
