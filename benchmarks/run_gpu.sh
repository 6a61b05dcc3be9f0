#!/usr/bin/env bash
# The GPU tests and benchmarks in stages of under 10 minutes each on an H200. Run from the
# project root on a machine with an NVIDIA GPU after the set-up of benchmarks/BENCHMARKS.md
# (`pip install torch==2.11.0` and `pip install -e ".[flashinfer,triton,bench,test]"`);
# results go to $OUT (default benchmarks/results):
#   bash benchmarks/run_gpu.sh e2e     # the `gpu` tests against HF eager generate (about 7.5 minutes on an H200;
#                                      # longer where the host compiles slowly), or in two halves:
#   bash benchmarks/run_gpu.sh e2e-generate  # tests/runtime/test_generate_gpu.py: architectures and folds
#   bash benchmarks/run_gpu.sh e2e-exact     # tests/runtime/test_exact_copy_gpu.py: token-identical copies
#   bash benchmarks/run_gpu.sh runtime # the other `gpu` tests of the runtime, soak included (ATTNGRAPH_GPU_SOAK_STEPS)
#   bash benchmarks/run_gpu.sh tests   # every other `gpu` test (kernels, backends, passes)
#   bash benchmarks/run_gpu.sh bench   # kernel benchmark, then end-to-end generate benchmark
#   bash benchmarks/run_gpu.sh prefill # prefill steps per CUDA-graph mode, then accelerate() alone
#   bash benchmarks/run_gpu.sh kernels # kernels per prefill / decode step, by class and name
#   bash benchmarks/run_gpu.sh decode  # the 1B decode step: exposed time per kernel (and per launch in
#                                      # order); its kernels without the model (with and without PDL), the
#                                      # GEMVs' weight before or after the PDL wait, attention and the o
#                                      # projection in one launch, timestamps inside decode attention and
#                                      # the o projection (about 6 minutes)
#   bash benchmarks/run_gpu.sh decode-step  # the step in generate with the GEMVs' weight loaded before
#                                      # or after the PDL wait (gemv_tables/), interleaved (about 5 minutes)
#   bash benchmarks/run_gpu.sh targets # the decode step's defaults against the floor: 1B and 8B at
#                                      # batches 1 and 16 (Triton), then the 1B batch-1 step's kernels
#                                      # by exposed time (about 4 minutes)
#   bash benchmarks/run_gpu.sh gated-mlp  # CompileConfig.fuse_gated_mlp: its gpu tests, then the 1B steps of
#                                      # batches 16 and 4 with it (the default) and without it, interleaved (about 4 minutes)
#   bash benchmarks/run_gpu.sh dot-rows  # the tensor-core kernel at 16 and 4 rows alone: plain, q/k/v rotated,
#                                      # behind the norm's launch or with the norm in its loads, the gate/up with
#                                      # SiLU * up in its epilogue over a few tiles, LM heads (about 2 minutes)
#   bash benchmarks/run_gpu.sh accept  # the decode targets: 1B at batches 1 and 16 with the one-row gate/up on
#                                      # cuBLAS beside the defaults, then 8B at 1 and 16 (stopped at 330 s and 220 s)
#   QUICK=1 ...                        # shorter benchmark: quick kernel shapes, batch 1 only
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
stage=${1:-all}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/device.txt" 2>&1
E2E=(tests/runtime/test_generate_gpu.py tests/runtime/test_exact_copy_gpu.py)
gpu_tests() {  # name, then pytest's arguments
    local name=$1
    shift
    ATTNGRAPH_GPU_SOAK_STEPS=${ATTNGRAPH_GPU_SOAK_STEPS:-4000} timeout ${TEST_TIMEOUT:-540} \
        python3 -m pytest -q -m gpu -rfEs --durations=15 -p no:cacheprovider "$@" > "$OUT/gpu_$name.log" 2>&1
    echo "$name tests rc=$?" >> "$OUT/device.txt"
}
if [ "$stage" = e2e ] || [ "$stage" = all ]; then gpu_tests e2e "${E2E[@]}"; fi
if [ "$stage" = e2e-generate ]; then gpu_tests e2e_generate "${E2E[0]}"; fi
if [ "$stage" = e2e-exact ]; then gpu_tests e2e_exact "${E2E[1]}"; fi
if [ "$stage" = runtime ] || [ "$stage" = all ]; then
    gpu_tests runtime tests/runtime --deselect "${E2E[0]}" --deselect "${E2E[1]}"
fi
if [ "$stage" = tests ] || [ "$stage" = all ]; then
    gpu_tests other tests --ignore=tests/runtime
fi
if [ "$stage" = bench ] || [ "$stage" = all ]; then
    if [ "${QUICK:-0}" = 1 ]; then ATT="--quick"; BATCHES=1; else ATT=""; BATCHES=1,8; fi
    timeout 200 python3 benchmarks/bench_attention.py $ATT --backends flashinfer,triton \
        --out "$OUT/attention.json" > "$OUT/bench_attention.md" 2> "$OUT/bench_attention.log"
    echo "bench_attention rc=$?" >> "$OUT/device.txt"
    timeout 360 python3 benchmarks/bench_generate.py --backends flashinfer,triton --batches $BATCHES --hf-static 1b \
        --out "$OUT/generate.json" > "$OUT/bench_generate.md" 2>&1
    echo "bench_generate rc=$?" >> "$OUT/device.txt"
fi
if [ "$stage" = prefill ]; then
    timeout 360 python3 benchmarks/bench_prefill.py --out "$OUT/prefill.json" > "$OUT/bench_prefill.md" 2> "$OUT/bench_prefill.log"
    echo "bench_prefill rc=$?" >> "$OUT/device.txt"
    for shape in 1b 8b; do
        timeout 120 python3 benchmarks/bench_prefill.py --setup-only --shape $shape --modes full_and_piecewise \
            --out "$OUT/setup_$shape.json" > "$OUT/setup_$shape.log" 2>&1
        echo "setup $shape rc=$?" >> "$OUT/device.txt"
    done
fi
if [ "$stage" = kernels ]; then
    for backend in triton flashinfer; do
        timeout 200 python3 benchmarks/profile_kernels.py --backend $backend --tokens 128,1024 \
            --out "$OUT/kernels_$backend.json" > "$OUT/kernels_$backend.txt" 2>&1
        echo "profile_kernels $backend rc=$?" >> "$OUT/device.txt"
    done
fi
if [ "$stage" = decode ]; then
    timeout 120 python3 benchmarks/profile_kernels.py --backend triton --tokens "" --decode-batch 1 \
        --out "$OUT/decode_kernels.json" > "$OUT/decode_kernels.log" 2>&1
    echo "profile_kernels rc=$?" >> "$OUT/device.txt"
    # the step's kernels without the model (GEMVs, RoPE, decode attention, norm, cuBLAS gate/up),
    # each GEMV's weight before / after the PDL wait, with timestamps inside attention and o
    timeout 150 python3 benchmarks/bench_gemv_chain.py --shape 1b --rows 1 --attention --trace --sweep qkv,o,down \
        --block-n 4 --block-k 1024 --stages 1 --preload 1,0 \
        --out "$OUT/layer_chain.json" > "$OUT/layer_chain.md" 2>&1
    echo "bench_gemv_chain --attention rc=$?" >> "$OUT/device.txt"
    timeout 150 python3 benchmarks/bench_gemv_chain.py --shape 1b --rows 1 --attention --trace --fuse-o --sweep o \
        --block-n 2,4 --block-k 2048 --stages 1 --preload 1,0 \
        --out "$OUT/layer_chain_o.json" > "$OUT/layer_chain_o.md" 2>&1
    echo "bench_gemv_chain --attention o rc=$?" >> "$OUT/device.txt"
    # the same chain without programmatic dependent launch: what PDL buys, and the gaps without it
    ATTNGRAPH_PDL=0 timeout 100 python3 benchmarks/bench_gemv_chain.py --shape 1b --rows 1 --attention --trace \
        --sweep "" --out "$OUT/layer_chain_nopdl.json" > "$OUT/layer_chain_nopdl.md" 2>&1
    echo "bench_gemv_chain --attention, no PDL rc=$?" >> "$OUT/device.txt"
fi
if [ "$stage" = decode-step ]; then
    # where the GEMVs after decode attention load their weight: before the PDL wait (the tuned
    # default: the first chunk; the whole tile; half a chunk) or after it (PRELOAD 0)
    T=benchmarks/gemv_tables
    timeout 300 python3 benchmarks/bench_generate.py --shapes 1b --batches 1 --backends triton --repeats 7 \
        --interleave --variant default --variant gemv-table=$T/o_after_wait.json \
        --variant gemv-table=$T/o_whole_tile_after_wait.json --variant gemv-table=$T/o_whole_tile.json \
        --variant gemv-table=$T/o_half_chunk.json --variant gemv-table=$T/qkv_after_wait.json --variant default \
        --out "$OUT/generate_decode.json" 2>&1 | grep -v "it/s\|s/it" > "$OUT/generate_decode.log"
    echo "bench_generate rc=$?" >> "$OUT/device.txt"
fi
if [ "$stage" = targets ]; then
    for shape in 1b 8b; do
        timeout 200 python3 benchmarks/bench_generate.py --shapes $shape --batches 1,16 --backends triton --repeats 5 \
            --interleave --variant default --variant default --out "$OUT/generate_defaults_$shape.json" 2>&1 \
            | tr '\r' '\n' | grep -v "it/s\|s/it\|size/s" > "$OUT/generate_defaults_$shape.log"
        echo "bench_generate $shape rc=${PIPESTATUS[0]}" >> "$OUT/device.txt"
    done
    timeout 100 python3 benchmarks/profile_kernels.py --shape 1b --backend triton --tokens "" --decode-batch 1 \
        --out "$OUT/decode_kernels.json" 2>&1 | tr '\r' '\n' | grep -v "size/s" > "$OUT/decode_kernels.log"
    echo "profile_kernels rc=${PIPESTATUS[0]}" >> "$OUT/device.txt"
fi
if [ "$stage" = gated-mlp ]; then
    TEST_TIMEOUT=150 gpu_tests gated tests/test_skinny_dot.py tests/runtime/test_generate_gpu.py::test_gated_mlp_fused_on_gpu
    timeout 240 python3 benchmarks/bench_generate.py --shapes 1b --batches 16,4 --backends triton --repeats 5 --interleave \
        --variant default --variant gated-mlp=off --variant default --variant gated-mlp=off \
        --out "$OUT/generate_gated_mlp.json" 2>&1 | tr '\r' '\n' | grep -v "it/s\|s/it\|size/s" > "$OUT/generate_gated_mlp.log"
    echo "bench_generate rc=${PIPESTATUS[0]}" >> "$OUT/device.txt"
fi
if [ "$stage" = dot-rows ]; then
    timeout 300 python3 benchmarks/bench_skinny_gemm.py --dot --dot-default --dot-heads --norm --rows 16,4 --no-gemv --shapes 1b,8b \
        --out "$OUT/skinny_dot_rows.json" > "$OUT/skinny_dot_rows.md" 2>&1
    echo "bench_skinny_gemm rc=$?" >> "$OUT/device.txt"
fi
if [ "$stage" = accept ]; then
    # The decode targets on this machine, each row against the floor measured in the same run: 1B at batches
    # 1 and 16 with the defaults twice around the 1B one-row gate/up on cuBLAS (a weight limit of 2**24
    # elements), then 8B at batches 1 and 16.
    timeout 330 python3 benchmarks/bench_generate.py --shapes 1b --batches 1,16 --backends triton --repeats 5 \
        --interleave --variant default --variant one-row-limit=16777216 --variant default \
        --out "$OUT/generate_accept_1b.json" 2>&1 | tr '\r' '\n' | grep -v "it/s\|s/it\|size/s" > "$OUT/generate_accept_1b.log"
    echo "bench_generate 1b rc=${PIPESTATUS[0]}" >> "$OUT/device.txt"
    timeout 220 python3 benchmarks/bench_generate.py --shapes 8b --batches 1,16 --backends triton --repeats 3 \
        --interleave --variant default --out "$OUT/generate_accept_8b.json" 2>&1 \
        | tr '\r' '\n' | grep -v "it/s\|s/it\|size/s" > "$OUT/generate_accept_8b.log"
    echo "bench_generate 8b rc=${PIPESTATUS[0]}" >> "$OUT/device.txt"
fi
echo "done" >> "$OUT/device.txt"
