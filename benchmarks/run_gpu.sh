#!/usr/bin/env bash
# One GPU session, time-boxed: kernel benchmark, end-to-end generate benchmark, GPU tests.
# Run on the GPU machine from the project root, after `source .gpu/setup.sh`; results go to $OUT.
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/device.txt" 2>&1
timeout 70 python3 benchmarks/bench_attention.py --quick --backends flashinfer,triton \
    --out "$OUT/attention.json" > "$OUT/bench_attention.md" 2>&1
timeout 200 python3 benchmarks/bench_generate.py --backends flashinfer,triton --batches 1,8 \
    --out "$OUT/generate.json" > "$OUT/bench_generate.md" 2>&1
timeout 100 python3 -m pytest -q -m gpu --durations=8 tests/attn_backends/test_flashinfer_backend.py \
    tests/runtime/test_generate_gpu.py -k "flashinfer or llama" > "$OUT/gpu_tests.log" 2>&1
echo "exit codes done" >> "$OUT/device.txt"
