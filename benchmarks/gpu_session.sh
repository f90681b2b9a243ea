#!/usr/bin/env bash
# One GPU-machine session: install the carried wheels, run the GPU tests, profile, benchmark.
# Run from the project root on the device machine (logs under $OUT):
#   bash benchmarks/gpu_session.sh [tests] [profile] [bench]
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/gpu.txt"
steps=${*:-tests profile bench}
for step in $steps; do
  case $step in
    tests)
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_attention.py \
        tests/test_engine_backends.py tests/test_engine.py tests/test_cuda_graph_gpu.py tests/test_engine_gpu.py \
        tests/test_models_gpu.py tests/test_overlap.py 2>&1 | tail -25 | tee "$OUT/tests.log" ;;
    profile)
      for cfg in "llama3-8b 1" "smollm2-135m 1"; do
        set -- $cfg
        timeout 150 python3 benchmarks/profile_decode.py --model-config "$1" --batch-size "$2" --out "$OUT" 2>&1 \
          | grep -v "^\s*$" | tail -45 | tee -a "$OUT/profile.log"
      done ;;
    bench)
      timeout 150 python3 -m minisgl bench offline --device cuda --model-config llama3-8b --batch-sizes 1,8 \
        --min-input-len 256 --max-input-len 256 --output-len 256 --repeats 1 2>&1 | grep -v "it/s\]" | tail -30 | tee "$OUT/bench_8b.log"
      timeout 90 python3 -m minisgl bench offline --device cuda --model-config smollm2-135m --batch-sizes 1,64 \
        --min-input-len 256 --max-input-len 256 --output-len 256 --repeats 1 2>&1 | grep -v "it/s\]" | tail -30 | tee "$OUT/bench_135m.log" ;;
    workload)  # the throughput issue's offline workload: 256 requests, input and output uniform in [100, 1024]
      for cfg in llama3-8b smollm2-135m; do
        timeout 120 python3 -m minisgl bench offline --device cuda --model-config $cfg --num-prompts 256 --skip-hf \
          --min-input-len 100 --max-input-len 1024 --output-len 100 --max-output-len 1024 --repeats 1 2>&1 \
          | grep -v "it/s\]" | tail -12 | tee -a "$OUT/workload.log"
      done ;;
  esac
done
