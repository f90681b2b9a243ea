#!/usr/bin/env bash
# One GPU-machine session: install the carried wheels, run the GPU tests, profile, benchmark.
# Run from the project root on the device machine (logs under $OUT):
#   bash benchmarks/gpu_session.sh [tests] [profile] [bench] [workload] [ab] [splits] [linear] [gemv] [pprof] [wprof] [bs256] [serve] [tp] [dp] [moe] [moe-tp]
#     [fp8tests] [fp8linear] [fp8attn] [fp8bench] [fp8workload] [fp8acc] [fp8prof] [moetests] [moe1] [moeb1] [moewl]
#     [fp8tests] [fp8linear] [fp8attn] [fp8attn2] [fp8wl2] [fp8attn2x] [fp8bench] [fp8workload] [fp8acc] [fp8trained] [fp8prof] [moetests] [moe1] [moewl] [qknorm] [wltrace] [skinny] [skinnywl] [skinny16] [extend] [ncuattn] [vpages] [vpages2] [silu] [siluwl] [swapped]
# (`ab` compares this tree with a copy of an earlier one's src/ carried in .ab/src)
# The structured-output tests need llguidance, which ../shared/device/stage.sh does not stage:
#   .venv/bin/pip download llguidance --python-version 3.12 --only-binary :all: --no-deps -d .whl
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/gpu.txt"
wait_healthy() {  # until the server on the default port answers /health, at most $1 seconds
  for _ in $(seq "$1"); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:1919/health', timeout=2)" 2>/dev/null && return
    sleep 1
  done
}
steps=${*:-tests profile bench}
for step in $steps; do
  case $step in
    tests)
      timeout 420 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_kernels.py tests/attention/test_attention.py \
        tests/engine/test_engine_backends.py tests/engine/test_engine.py tests/engine/test_cuda_graph_gpu.py tests/engine/test_engine_gpu.py \
        tests/models/test_models_gpu.py tests/scheduler/test_overlap.py tests/engine/test_features_gpu.py 2>&1 | tail -40 | tee "$OUT/tests.log" ;;
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
          --min-input-len 100 --max-input-len 1024 --output-len 100 --max-output-len 1024 --repeats 2 2>&1 \
          | grep -v "it/s\]" | tail -12 | tee -a "$OUT/workload.log"
      done ;;
    ab)  # decode at batch 1 and 8 (8B shapes; AB_ARGS: other bench flags): .ab/src (an earlier tree's, carried) against this tree, in turn
      for v in old new old new; do
        pp=$PYTHONPATH
        [ $v = old ] && pp=/tmp/site:$PWD/.ab/src
        echo "== $v" | tee -a "$OUT/ab.log"
        PYTHONPATH=$pp timeout 150 python3 -m minisgl bench offline --device cuda --model-config llama3-8b \
          --min-input-len 256 --max-input-len 256 --output-len 256 --repeats 2 --skip-hf \
          ${AB_ARGS:---batch-sizes 1,8 --cuda-graph-max-bs 8} 2>&1 | grep -E "^(---|minisgl|  prefill|  decode|  roofline)" | tee -a "$OUT/ab.log"
      done ;;
    splits)  # decode at batch 1 and 8 (8B shapes) by the most split-KV programs per (request, KV head)
      for sp in 16 8 4 2; do
        echo "== max splits $sp" | tee -a "$OUT/splits.log"
        MINISGL_DECODE_MAX_SPLITS=$sp timeout 150 python3 -m minisgl bench offline --device cuda --model-config llama3-8b \
          --batch-sizes 1,8 --min-input-len 256 --max-input-len 256 --output-len 256 --repeats 2 --skip-hf \
          --cuda-graph-max-bs 8 2>&1 | grep -E "^(---|minisgl|  decode)" | tee -a "$OUT/splits.log"
      done ;;
    linear)  # the ways of calling cuBLAS for a decode projection (8B shapes), under CUDA graphs
      timeout 200 python3 benchmarks/bench_linear.py --rows 1,8 2>&1 | tee "$OUT/linear.log" ;;
    gemv)  # the Triton GEMV's launch shapes against cuBLAS for the decode projections, under CUDA graphs
      timeout 400 python3 benchmarks/bench_linear.py --sweep --model-config llama3-8b,smollm2-135m --rows ${GEMV_ROWS:-1,4,8,16} \
        --only "${GEMV_ONLY:-}" 2>&1 \
        | tee "$OUT/gemv.log" ;;
    pprof)  # host time of eager prefill steps, by function and by op (135M shapes)
      timeout 200 python3 benchmarks/profile_prefill.py --out "$OUT" 2>&1 | grep -v "it/s\]" | tee "$OUT/pprof.log" ;;
    wprof)  # where the throughput workload's time goes (135M shapes)
      timeout 200 python3 benchmarks/profile_workload.py --model-config smollm2-135m --out "$OUT" 2>&1 \
        | grep -v "it/s\]" | tail -60 | tee "$OUT/wprof.log" ;;
    tp)  # on nvidia-h200-x2: 8B shapes at TP=1 then TP=2, transformers' greedy tokens on the same random
      # weights in each run (decode at batch 1 and 64), then the throughput workload; NCCL logits test
      timeout 120 python3 -m pytest -q -p no:cacheprovider tests/models/test_models_tp.py -k nccl 2>&1 | tail -3 | tee "$OUT/tp.log"
      for tp in 1 2; do
        timeout 200 python3 -m minisgl bench offline --device cuda --model-config llama3-8b --batch-sizes 1,64 --tp $tp \
          --min-input-len 256 --max-input-len 256 --output-len 256 --repeats 1 --kv-cache-memory 40 2>&1 \
          | grep -v "it/s\]" | tail -16 | tee -a "$OUT/tp.log"
        timeout 150 python3 -m minisgl bench offline --device cuda --model-config llama3-8b --num-prompts 256 --skip-hf \
          --min-input-len 100 --max-input-len 1024 --output-len 100 --max-output-len 1024 --repeats 2 --tp $tp 2>&1 \
          | grep -v "it/s\]" | tail -6 | tee -a "$OUT/tp.log"
      done ;;
    dp)  # on nvidia-h200-x2: minisgl serve with 8B shapes, --dp 2 (a replica per GPU) against one replica;
      # 512 requests of 400 random in-vocabulary words, output 256, concurrency 256
      python3 -c "from pathlib import Path; from minisgl.benchmark.presets import preset_config, write_model_dir; write_model_dir(preset_config('llama3-8b'), Path('/tmp/m8b'))"
      python3 -c "import random; r = random.Random(0); print('\n'.join(' '.join(f'<{r.randrange(300, 128000)}>' for _ in range(400)) for _ in range(600)))" > /tmp/prompts8b.txt
      for dp in 1 2; do
        echo "== minisgl serve --dp $dp" | tee -a "$OUT/dp.log"
        python3 -m minisgl serve --model /tmp/m8b --dummy-weights --device cuda --dp $dp >> "$OUT/dp_server.log" 2>&1 &
        spid=$!
        wait_healthy 240
        timeout 200 python3 -m minisgl bench serve --concurrency 256 --num-prompts 512 --prompts-file /tmp/prompts8b.txt \
          --output-len 256 2>&1 | tail -12 | tee -a "$OUT/dp.log"
        kill -INT $spid; wait $spid
      done ;;
    bs256)  # input 256 / output 256 at batch 256 against transformers
      for cfg in ${BS256_CFGS:-smollm2-135m llama3-8b}; do  # 8B: transformers' generate needs ~40 GiB of the GPU
        timeout 240 python3 -m minisgl bench offline --device cuda --model-config $cfg --batch-sizes 256 --kv-cache-memory 40 \
          --min-input-len 256 --max-input-len 256 --output-len 256 --repeats ${BS256_REPEATS:-2} 2>&1 | grep -v "it/s\]" | tail -14 \
          | tee -a "$OUT/bs256.log"
      done ;;
    serve)  # minisgl serve with 135M shapes (random weights), bench serve at concurrency 1 and 256; prompts
      # of 200 random in-vocabulary words (the preset's tokenizer has one word per id; ids < 32000, the dummy
      # engine's vocabulary), all different.
      # SERVE_ARGS: extra server flags, one set per run, separated by ';' (default: none)
      python3 -c "from pathlib import Path; from minisgl.benchmark.presets import preset_config, write_model_dir; write_model_dir(preset_config('smollm2-135m'), Path('/tmp/m135'))"
      python3 -c "import random; r = random.Random(0); print('\n'.join(' '.join(f'<{r.randrange(300, 32000)}>' for _ in range(200)) for _ in range(1100)))" > /tmp/prompts135.txt
      IFS=';' read -ra variants <<< "${SERVE_ARGS:- }"
      for extra in "${variants[@]}"; do
        echo "== minisgl serve $extra" | tee -a "$OUT/serve.log"
        python3 -m minisgl serve --model /tmp/m135 --dummy-weights --device cuda $extra >> "$OUT/serve_server.log" 2>&1 &
        spid=$!
        wait_healthy 180
        for c in ${SERVE_CONC:-1:64 256:1024}; do  # concurrency:requests
          set -- ${c/:/ }
          # CPU use of each server process during the run (100 = one core busy)
          python3 benchmarks/proc_cpu.py $spid --delay 2 --seconds 5 >> "$OUT/serve_cpu.log" 2>&1 &
          timeout 150 python3 -m minisgl bench serve --concurrency $1 --num-prompts $2 --prompts-file /tmp/prompts135.txt \
            --output-len 128 2>&1 | tail -12 | tee -a "$OUT/serve.log"
        done
        kill -INT $spid; wait $spid
      done
      [ -n "${MINISGL_CPROFILE:-}" ] && python3 benchmarks/print_profiles.py "$MINISGL_CPROFILE" --top 30 > "$OUT/sprof.log" 2>&1
      ;;
    moe)  # mixtures of experts: the GPU tests (bf16 against transformers, CUDA graphs), the fused MoE's
      # launch shapes, then issue 26's targets on Qwen3-30B-A3B shapes (batch 1 decode against the
      # floor; batch 64 against transformers' generate; the 256-request workload) and Mixtral-8x7B's
      # (too large for transformers beside minisgl on one H200: --skip-hf)
      timeout 400 python3 -m pytest -q -p no:cacheprovider tests/models/test_moe_gpu.py tests/models/test_moe.py -k "not llm_tp2" 2>&1 \
        | tail -30 | tee "$OUT/moe_tests.log"
      for cfg in qwen3-30b-a3b mixtral-8x7b; do
        timeout 300 python3 benchmarks/bench_moe.py --model-config $cfg --tokens 1,8,64,256,2048 --sweep 2>&1 \
          | tee -a "$OUT/moe_kernel.log"
      done
      timeout 500 python3 -m minisgl bench offline --device cuda --model-config qwen3-30b-a3b --batch-sizes 1,64 \
        --min-input-len 256 --max-input-len 256 --output-len 256 --repeats 1 --kv-cache-memory 8 2>&1 \
        | grep -v "it/s\]" | tail -24 | tee "$OUT/moe_bench.log"
      timeout 300 python3 -m minisgl bench offline --device cuda --model-config qwen3-30b-a3b --num-prompts 256 --skip-hf \
        --min-input-len 100 --max-input-len 1024 --output-len 100 --max-output-len 1024 --repeats 2 2>&1 \
        | grep -v "it/s\]" | tail -12 | tee -a "$OUT/moe_bench.log"
      timeout 400 python3 -m minisgl bench offline --device cuda --model-config mixtral-8x7b --batch-sizes 1,64 --skip-hf \
        --min-input-len 256 --max-input-len 256 --output-len 256 --repeats 1 --kv-cache-memory 16 2>&1 \
        | grep -v "it/s\]" | tail -16 | tee -a "$OUT/moe_bench.log" ;;
    moetests)  # the MoE GPU tests, the Triton kernels' tests (compiled), the dense models against transformers
      # (360 s cut it short on a fresh machine on 2026-12-04, after about 130 results)
      timeout 560 python3 -m pytest -q -s -p no:cacheprovider ${MOE_TESTS:-tests/models/test_moe_gpu.py tests/kernels/test_triton_kernels.py \
        tests/models/test_models_gpu.py tests/models/test_moe.py} -k "${MOE_K:-not llm_tp2 and not gguf and not two_ranks and not cpu_kernel}" 2>&1 \
        | tee "$OUT/moe_tests.log" | tail -40 ;;
    moe1)  # issue 26 at batch 1 (Qwen3-30B-A3B shapes): the MoE op against the path it replaced and the
      # launch shapes, decode at batch 1 against the floor, where a decode step goes
      timeout 150 python3 benchmarks/bench_moe.py --model-config qwen3-30b-a3b --tokens ${MOE_TOKENS:-1,2,4,8,64} ${MOE_SWEEP---sweep} 2>&1 \
        | tee "$OUT/moe_kernel.log"
      timeout 240 python3 -m minisgl bench offline --device cuda --model-config qwen3-30b-a3b --batch-sizes 1 --skip-hf \
        --min-input-len 256 --max-input-len 256 --output-len 256 --repeats 2 --kv-cache-memory 8 --cuda-graph-max-bs 8 2>&1 \
        | grep -v "it/s\]" | tail -14 | tee "$OUT/moe_bs1.log"
      timeout 200 python3 benchmarks/profile_decode.py --model-config qwen3-30b-a3b --batch-size 1 --skip-eager 2>&1 \
        | grep -v "^\s*$" | tail -55 | tee "$OUT/moe_profile.log"
      [ -n "${MOE_SWEEP---sweep}" ] && timeout 120 python3 benchmarks/bench_linear.py --sweep --model-config qwen3-30b-a3b \
        --rows 1 --only qkv,o 2>&1 | tee -a "$OUT/moe_kernel.log" ;;
    qknorm)  # Qwen3's q/k norms inside the decode kernel: its tests (compiled), the Qwen3 models against
      # transformers, then batch 1 of Qwen3-30B-A3B shapes with the norms in rope_qkv's kernel (off) and in
      # the decode kernel (on), alternated QKNORM_ROUNDS (1) times
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_kernels.py -k "decode or rope" 2>&1 \
        | tail -4 | tee "$OUT/qknorm_tests.log"
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/models/test_models_gpu.py tests/models/test_moe_gpu.py \
        tests/engine/test_cuda_graph_gpu.py -k "qwen3 or cuda_graph_gpu" 2>&1 | tail -6 | tee -a "$OUT/qknorm_tests.log"
      for _ in $(seq "${QKNORM_ROUNDS:-1}"); do
        for v in 0 1; do
          echo "== MINISGL_QK_NORM_IN_ATTENTION=$v" | tee -a "$OUT/qknorm_bs1.log"
          MINISGL_QK_NORM_IN_ATTENTION=$v timeout 200 python3 -m minisgl bench offline --device cuda --model-config qwen3-30b-a3b \
            --batch-sizes 1 --skip-hf --min-input-len 256 --max-input-len 256 --output-len 256 --repeats 2 --kv-cache-memory 8 \
            --cuda-graph-max-bs 8 2>&1 | grep -E "^(---|minisgl|  prefill|  decode|  roofline)" | tee -a "$OUT/qknorm_bs1.log"
        done
      done ;;
    moeb1)  # issue 26 at batch 1: one token's experts as row GEMVs (kernels/triton/moe/experts.py) and one bf16 row
      # of qkv / o in the row GEMV (MINISGL_BF16_ROW). Their tests and the MoE tests (compiled); the MoE op's
      # one-token variants with the row GEMVs' launch shapes; qkv / o before and after; then decode at batch 1
      # with the defaults (row experts off since the 2026-12-03 run) and variants (MOEB1_VARIANTS, ';'-separated env settings; "-" = the defaults),
      # each within what is left of MOEB1_END_S seconds from the script's start (skipped under 60)
      timeout ${MOEB1_TEST_S:-140} python3 -m pytest -q -p no:cacheprovider tests/models/test_moe_gpu.py tests/models/test_moe.py \
        tests/kernels/test_fp8_kernels.py::test_gemv_rows_of_an_unscaled_16bit_weight tests/kernels/test_fp8_kernels.py::test_gemv_fp8_rows_matches_the_dequantized_weight \
        tests/kernels/test_triton_kernels.py::test_cuda_ops_take_the_gemv_for_few_rows_only \
        -k "${MOEB1_K:-(moe_gpu or triton or route or align or from_router or one_token or rows) and not two_gpus and not llm and not gguf and not two_ranks and not cpu_kernel}" 2>&1 \
        | tee "$OUT/moeb1_tests.log" | tail -25
      timeout 110 python3 benchmarks/bench_moe.py --model-config qwen3-30b-a3b --tokens 1 --sweep-rows 2>&1 | tee "$OUT/moeb1_kernel.log"
      timeout 60 python3 benchmarks/bench_bf16_rows.py --model-config qwen3-30b-a3b 2>&1 | tee -a "$OUT/moeb1_kernel.log"
      IFS=';' read -ra variants <<< "${MOEB1_VARIANTS:--;MINISGL_BF16_ROW=0;MINISGL_MOE_B1=1;MINISGL_MOE_B1=1 MINISGL_MOE_B1_ROUTE=0}"
      for v in "${variants[@]}"; do
        left=$(( ${MOEB1_END_S:-530} - SECONDS ))
        [ $left -lt 60 ] && { echo "== skipped (time): $v" | tee -a "$OUT/moeb1_bench.log"; continue; }
        echo "== $v (at ${SECONDS} s)" | tee -a "$OUT/moeb1_bench.log"
        [ "$v" = - ] && v=""
        env $v timeout $(( left < 150 ? left : 150 )) python3 -m minisgl bench offline --device cuda --model-config qwen3-30b-a3b --batch-sizes 1 --skip-hf \
          --min-input-len 256 --max-input-len 256 --output-len 256 --repeats 2 --kv-cache-memory 8 --cuda-graph-max-bs 8 2>&1 \
          | grep -E "^(---|minisgl|  prefill|  decode|  roofline)" | tee -a "$OUT/moeb1_bench.log"
      done ;;
    moewl)  # issue 26's throughput workload (Qwen3-30B-A3B shapes, 256 requests, lengths uniform in [100, 1024])
      timeout 400 python3 -m minisgl bench offline --device cuda --model-config qwen3-30b-a3b --num-prompts 256 --skip-hf \
        --min-input-len 100 --max-input-len 1024 --output-len 100 --max-output-len 1024 --repeats 1 2>&1 \
        | grep -v "it/s\]" | tail -12 | tee "$OUT/moe_workload.log" ;;
    moe-tp)  # on nvidia-h200-x2: the MoE NCCL test, then Qwen3-30B-A3B shapes at TP=2 (tokens of TP=1 on the
      # same random weights: transformers' greedy tokens in each run)
      timeout 120 python3 -m pytest -q -p no:cacheprovider tests/models/test_moe_gpu.py -k two_gpus 2>&1 | tail -3 | tee "$OUT/moe_tp.log"
      for tp in 1 2; do
        timeout 500 python3 -m minisgl bench offline --device cuda --model-config qwen3-30b-a3b --batch-sizes 1,64 --tp $tp \
          --min-input-len 256 --max-input-len 256 --output-len 256 --repeats 1 --kv-cache-memory 8 2>&1 \
          | grep -v "it/s\]" | tail -16 | tee -a "$OUT/moe_tp.log"
      done ;;
    fp8tests)  # the fp8 weights and KV cache tests, compiled (the whole log kept)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_kernels.py tests/engine/test_fp8_gpu.py \
        tests/engine/test_fp8_kv.py ${FP8_TESTS_MORE:-} > "$OUT/fp8tests.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/fp8tests.log" | tail -20 ;;
    fp8linear)  # fp8 projections (8B shapes) against bf16, per row count; the fp8 GEMV's launch shapes
      timeout 200 python3 benchmarks/bench_fp8_linear.py --rows ${FP8_ROWS:-1,8,16,64,256,2048} ${FP8_LINEAR_ARGS:---sweep} 2>&1 \
        | tee "$OUT/fp8linear.log" ;;
    fp8attn)  # the decode attention kernel over a bf16 and an fp8 pool (8B heads, batch 256); fp8's dots in
      # fp16 (the default) and in bf16 (MINISGL_FP8_ATTN_DOT=bf16)
      for v in "bf16 fp16" "fp8 fp16" "fp8 bf16"; do
        set -- $v
        echo "== KV $1, dots $2" | tee -a "$OUT/fp8attn.log"
        MINISGL_FP8_ATTN_DOT=$2 timeout 100 python3 benchmarks/bench_decode_attention.py --batch 256 --context ${FP8_CONTEXT:-1024} \
          --splits ${FP8_SPLITS:-1} --new --kv-dtype $1 --launches ${FP8_ATTN_LAUNCHES:-64:4:2,32:4:3,64:8:2,128:4:2} 2>&1 \
          | tee -a "$OUT/fp8attn.log"
      done ;;
    fp8attn2|fp8attn2x)  # issue 28, decode attention over an fp8 pool at large batches and the fused activation quantization.
      # fp8attn2: their tests and the decode ones compiled, then bench_decode_attention at batch 256, one split, launches
      # BLOCK_N:warps:stages:kv_heads:maxnreg (kv_heads 0: the one-head kernel, >= 1: decode/packed.py's; maxnreg 0: unbounded;
      # 64:4:2:0:0 is main's default). fp8attn2x: 3 stages, batch 96, lazy rescaling, a bf16 pool. Each ends by FP8_END (410) s.
      cfgs=("0 fp8 256 64:4:2:0:0,64:4:2:0:80,64:4:2:0:72,64:8:2:0:64,32:4:2:4:96,32:4:2:4:0,64:4:2:2:128")
      if [ $step = fp8attn2 ]; then
        timeout "${FP8_ATTN2_TEST_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_kernels.py \
          tests/kernels/test_fp8_kernels.py tests/engine/test_fp8_kv.py tests/engine/test_fp8_gpu.py \
          -k "packed or lazy or quantized_in or rounded or fp8_cache or fp8_and_attends or rotates" > "$OUT/fp8attn2_tests.log" 2>&1
        grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/fp8attn2_tests.log" | tail -20
      else
        cfgs=("0 fp8 256 64:4:2:0:0,64:4:3:0:80,32:4:3:0:80,32:4:3:4:96" "0 fp8 96 64:4:2:0:0,64:4:2:0:80,32:4:2:4:96,64:4:2:2:128"
              "8 fp8 256 64:4:2:0:0,64:4:2:0:80" "0 bf16 256 64:4:2:0:0,64:4:2:0:96,32:4:2:4:0")
      fi
      for v in "${cfgs[@]}"; do
        set -- $v
        left=$(( ${FP8_END:-410} - SECONDS )); [ $left -gt 100 ] && left=100
        [ $left -lt 30 ] && { echo "== $v: skipped at ${SECONDS}s" | tee -a "$OUT/fp8attn2.log"; break; }
        echo "== KV $2, batch $3, MINISGL_DECODE_LAZY=$1" | tee -a "$OUT/fp8attn2.log"
        MINISGL_DECODE_LAZY=$1 timeout $left python3 benchmarks/bench_decode_attention.py --batch $3 --context ${FP8_CONTEXT:-1024} \
          --splits 1 --new --kv-dtype $2 --launches $4 2>&1 | tee -a "$OUT/fp8attn2.log"
      done ;;
    fp8wl2)  # the fp8 weights + fp8 KV throughput workload (FP8_WL_REPEATS, default 1): this tree's defaults, then main's
      # behaviour before gpu28f (MINISGL_FP8_FUSED_QUANT=0 MINISGL_FP8_ATTN_V2=0 MINISGL_FP8_FAST_ACCUM=0) if the session is under FP8_WL_OLD_BY (330) s; each
      # run ends by FP8_END (410) s
      for v in new old; do
        envs=""
        if [ $v = old ]; then
          [ $SECONDS -ge "${FP8_WL_OLD_BY:-330}" ] && { echo "== fp8kv old: skipped at ${SECONDS}s" | tee -a "$OUT/fp8wl2.log"; break; }
          envs="MINISGL_FP8_ATTN_MAXNREG=0 MINISGL_FP8_FUSED_QUANT=0 MINISGL_FP8_ATTN_V2=0 MINISGL_FP8_FAST_ACCUM=0"
        fi
        left=$(( ${FP8_END:-410} - SECONDS )); [ $left -gt 150 ] && left=150
        echo "== fp8kv $v $envs (at ${SECONDS}s)" | tee -a "$OUT/fp8wl2.log"
        env $envs timeout $left python3 -m minisgl bench offline --device cuda --model-config llama3-8b --num-prompts 256 \
          --skip-hf --min-input-len 100 --max-input-len 1024 --output-len 100 --max-output-len 1024 --repeats ${FP8_WL_REPEATS:-1} \
          --quantization fp8 --kv-cache-dtype fp8_e4m3 2>&1 | grep -E "^(---|model|minisgl|  prefill|  decode|  roofline)" | tee -a "$OUT/fp8wl2.log"
      done ;;
    fp8bench)  # decode at batch 1 and 8, 8B shapes: bf16, fp8 weights, fp8 weights + fp8 KV (one engine each)
      IFS=';' read -ra qs <<< "${FP8_BENCH:-bf16;--quantization fp8;--quantization fp8 --kv-cache-dtype fp8_e4m3}"
      for q in "${qs[@]}"; do
        echo "== $q" | tee -a "$OUT/fp8bench.log"
        [ "$q" = bf16 ] && q=""
        timeout 150 python3 -m minisgl bench offline --device cuda --model-config llama3-8b --batch-sizes 1,8 --skip-hf \
          --min-input-len 256 --max-input-len 256 --output-len 256 --repeats 2 --cuda-graph-max-bs 8 $q 2>&1 \
          | grep -E "^(---|model|minisgl|  prefill|  decode|  roofline)" | tee -a "$OUT/fp8bench.log"
      done ;;
    fp8workload)  # the throughput workload (256 requests, lengths uniform in [100, 1024]), 8B shapes
      for q in ${FP8_WORKLOADS:-bf16 fp8kv}; do
        case $q in bf16) flags="" ;; fp8) flags="--quantization fp8" ;; fp8kv) flags="--quantization fp8 --kv-cache-dtype fp8_e4m3" ;; esac
        echo "== $q ${FP8_WL_LABEL:-}" | tee -a "$OUT/fp8workload.log"
        timeout "${FP8_WL_TIMEOUT:-200}" python3 -m minisgl bench offline --device cuda --model-config llama3-8b --num-prompts 256 --skip-hf \
          --min-input-len 100 --max-input-len 1024 --output-len 100 --max-output-len 1024 --repeats ${FP8_WL_REPEATS:-2} $flags 2>&1 \
          | grep -E "^(---|model|minisgl|  prefill|  decode|  roofline)" | tee -a "$OUT/fp8workload.log"
      done ;;
    skinny)  # the fp8 decode-batch matmul: its tests, then its launch shapes swept against cuBLASLt (SKINNY_ROWS)
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_kernels.py -k "skinny or scaled_mm or norm_and_silu" 2>&1 \
        | tail -5 | tee "$OUT/skinny.log"
      timeout "${SKINNY_TIMEOUT:-400}" python3 benchmarks/bench_fp8_skinny.py --rows "${SKINNY_ROWS:-32,64,128,192,256}" \
        ${SKINNY_ARGS:---sweep} --json "$OUT/skinny_best.json" 2>&1 | grep -v "^\s*$" | tee -a "$OUT/skinny.log" ;;
    skinnywl)  # the fp8 (weights + KV) throughput workload with the skinny matmul on / off / on (SKINNY_WL: the order)
      for v in ${SKINNY_WL:-1 0 1}; do
        echo "== MINISGL_FP8_SKINNY=$v" | tee -a "$OUT/skinnywl.log"
        MINISGL_FP8_SKINNY=$v timeout 200 python3 -m minisgl bench offline --device cuda --model-config llama3-8b --num-prompts 256 \
          --skip-hf --min-input-len 100 --max-input-len 1024 --output-len 100 --max-output-len 1024 --repeats 1 \
          --quantization fp8 --kv-cache-dtype fp8_e4m3 ${SKINNY_WL_ARGS:-} 2>&1 | grep -E "^(---|model|minisgl|  prefill|  decode|  roofline)" \
          | tee -a "$OUT/skinnywl.log"
      done ;;
    skinny16)  # the unscaled skinny kernel on bf16 weights swept against cuBLAS (SKINNY_ROWS)
      timeout "${SKINNY_TIMEOUT:-400}" python3 benchmarks/bench_fp8_skinny.py --bf16 --rows "${SKINNY_ROWS:-64,128,192,256}" 2>&1 \
        | grep -v "^\s*$" | tee -a "$OUT/skinny16.log" ;;
    extend)  # the prefill attention kernel by launch shape, bf16 and fp8 pools
      timeout 200 python3 benchmarks/bench_extend_attention.py ${EXTEND_ARGS:-} 2>&1 | tee -a "$OUT/extend.log" ;;
    wltrace)  # the throughput workload step by step (TRACE_FLAGS, e.g. "--quantization fp8 --kv-cache-dtype fp8_e4m3"), then its kernels with PDL off
      timeout "${TRACE_TIMEOUT:-240}" python3 benchmarks/trace_workload.py --model-config llama3-8b ${TRACE_FLAGS:-} 2>&1 \
        | grep -v "^[0-9:]* I \[" | tail -30 | tee -a "$OUT/wltrace.log"
      MINISGL_PDL=0 timeout "${TRACE_TIMEOUT:-240}" python3 benchmarks/trace_workload.py --model-config llama3-8b ${TRACE_FLAGS:-} \
        --no-warmup --repeats 0 --kernel-windows "${TRACE_WINDOWS:-256,128,32}" 2>&1 | grep -v "^[0-9:]* I \[" | tail -200 \
        | tee -a "$OUT/wltrace.log" ;;
    fp8acc)  # fp8 (weights + KV) and float32 (the control) against bf16 by teacher forcing, 8B shapes, 64 prompts
      timeout 200 python3 benchmarks/bench_fp8_accuracy.py --model-config llama3-8b --compare ${FP8_ACC_COMPARE:-fp8,fp32} \
        --weight-scales ${FP8_ACC_SCALES:-1,0.5} 2>&1 | grep -v "^[0-9:]* I \[" | grep -v "^\[transformers\]" | tee -a "$OUT/fp8acc.log" ;;
    fp8trained)  # fp8 against bf16 on trained weights: the embedded SmolLM2-135M GGUF, carried in two parts
      # (build/gga: its first 58,000,000 bytes, build/ggb: the rest; one part a call, the machine kept warm)
      cat build/gga build/ggb > /tmp/smollm2.gguf || exit 1
      timeout 300 python3 benchmarks/bench_fp8_accuracy.py --model /tmp/smollm2.gguf --prompt-source chat,random \
        --compare ${FP8_ACC_COMPARE:-fp8,fp8w,kv,fp32} 2>&1 | grep -v "^[0-9:]* I \[" | grep -v "^\[transformers\]" \
        | grep -v "Loading weights" | tee -a "$OUT/fp8trained.log" ;;
    ncuattn)  # Nsight Compute on the decode attention kernel (8B heads, batch 256, context 1024, one split): fp8 pool
      # packed and one-head, bf16 pool (NCU_ATTN: "kv launch kernel-regex;..."); the Triton cache's files of the kernels kept
      IFS=';' read -ra cfgs <<< "${NCU_ATTN:-fp8 64:4:2:2:128 _decode_packed;fp8 64:4:2:0:0 _decode_kernel;bf16 64:4:2:0:0 _decode_kernel}"
      for cfg in "${cfgs[@]}"; do
        set -- $cfg
        echo "== KV $1, launch $2, kernel $3" | tee -a "$OUT/ncuattn.log"
        timeout 180 ncu --clock-control none -k "regex:$3" -c 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
          --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
          --section InstructionStats --section SourceCounters python3 benchmarks/bench_decode_attention.py --batch 256 \
          --context ${NCU_CONTEXT:-1024} --splits 1 --new --kv-dtype $1 --launches $2 2>&1 | grep -v "^==PROF==" >> "$OUT/ncuattn.log"
      done
      mkdir -p "$OUT/triton_cache"
      find ~/.triton/cache -name "_decode*" \( -name "*.ttgir" -o -name "*.ptx" \) -exec cp {} "$OUT/triton_cache/" \; 2>/dev/null
      for f in $(find ~/.triton/cache -name "_decode*.cubin"); do cuobjdump -sass "$f" > "$OUT/triton_cache/$(basename "$f").sass"; done ;;
    vpages)  # V by page read in page rows (kernels/triton/kv_pages.py): the attention kernels' tests compiled, then decode
      # attention over an fp8 pool and the extend kernel, .ab/src (the tree before, carried) and this tree in turn
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_kernels.py tests/kernels/test_triton_kernels.py \
        -k "attention or packed" 2>&1 | tail -3 | tee -a "$OUT/vpages.log"
      for v in old new; do
        pp=$PYTHONPATH
        [ $v = old ] && pp=/tmp/site:$PWD/.ab/src
        echo "== $v" | tee -a "$OUT/vpages.log"
        for args in "--batch 256 --context 1024 --splits 1 --launches 64:4:2:2:128,64:4:2:0:0" \
          "--batch 256 --context-range 151:1074 --order desc --splits 1" "--batch 128 --context-range 300:1300 --order desc" \
          "--batch 48 --context-range 900:1900 --order desc"; do
          PYTHONPATH=$pp timeout 100 python3 benchmarks/bench_decode_attention.py --new --kv-dtype fp8 $args 2>&1 | tee -a "$OUT/vpages.log"
        done
        PYTHONPATH=$pp timeout 100 python3 benchmarks/bench_extend_attention.py --kv-dtype fp8 2>&1 | tail -4 | tee -a "$OUT/vpages.log"
      done ;;
    vpages2)  # the one-head decode kernel over an fp8 pool reading V in page rows (MINISGL_FP8_V_PAGES): its tests compiled,
      # decode attention by batch with it off / on, then the fp8 (weights + KV) workload on / off (VP_WL: the order)
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_kernels.py -k "attention or packed" 2>&1 \
        | tail -3 | tee -a "$OUT/vpages2.log"
      for bs in ${VP_BATCHES:-16 32 64 96 128}; do
        for v in 0 1; do
          echo "== batch $bs MINISGL_FP8_V_PAGES=$v" | tee -a "$OUT/vpages2.log"
          MINISGL_FP8_V_PAGES=$v timeout 100 python3 benchmarks/bench_decode_attention.py --new --kv-dtype fp8 --batch $bs \
            --context-range 300:1300 --order desc --splits 1,2,4 --launches 64:4:2,32:2:4 2>&1 | grep "launch" | tee -a "$OUT/vpages2.log"
        done
      done
      for v in ${VP_WL:-1 0}; do
        echo "== workload MINISGL_FP8_V_PAGES=$v" | tee -a "$OUT/vpages2.log"
        MINISGL_FP8_V_PAGES=$v timeout 200 python3 -m minisgl bench offline --device cuda --model-config llama3-8b --num-prompts 256 \
          --skip-hf --min-input-len 100 --max-input-len 1024 --output-len 100 --max-output-len 1024 --repeats 1 \
          --quantization fp8 --kv-cache-dtype fp8_e4m3 2>&1 | grep -E "^(minisgl|  prefill|  decode|  roofline)" | tee -a "$OUT/vpages2.log"
      done ;;
    silu)  # SiLU x up quantized over row chunks and the Triton greedy argmax: their tests compiled, their launches
      # against the old ones, then the fp8 (weights + KV) workload by SILU_WL's variants in turn: new (both on),
      # old (both off, the row kernel's 16 warps), silu (argmax off), argmax (the split off), bf16new / bf16old
      # (bf16 weights and KV, the argmax on / off)
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_kernels.py tests/kernels/test_triton_kernels.py \
        tests/engine/test_cuda_graph_gpu.py -k "silu or argmax or graph" 2>&1 | tail -5 | tee "$OUT/silu.log"
      timeout 150 python3 benchmarks/bench_fused_quant.py --silu --rows "${SILU_ROWS:-32,64,128,192,256,512,1024,4096}" 2>&1 \
        | tee -a "$OUT/silu.log"
      timeout 60 python3 benchmarks/bench_argmax.py 2>&1 | tee -a "$OUT/silu.log" ;&
    siluwl)  # the workload part of `silu` alone
      for v in ${SILU_WL:-new old new}; do
        old="MINISGL_FP8_SILU_SPLIT_ROWS=0 MINISGL_TRITON_ARGMAX=0 MINISGL_FP8_SILU_ROW_WARPS=16"
        q="--quantization fp8 --kv-cache-dtype fp8_e4m3"
        case $v in new) e="" ;; old) e=$old ;; silu) e="MINISGL_TRITON_ARGMAX=0" ;; argmax) e="MINISGL_FP8_SILU_SPLIT_ROWS=0" ;;
          bf16new) e=""; q="" ;; bf16old) e="MINISGL_TRITON_ARGMAX=0"; q="" ;; esac
        echo "== $v: $e $(date +%T)" | tee -a "$OUT/siluwl.log"
        env $e timeout 200 python3 -m minisgl bench offline --device cuda --model-config llama3-8b --num-prompts 256 \
          --skip-hf --min-input-len 100 --max-input-len 1024 --output-len 100 --max-output-len 1024 --repeats 1 \
          $q 2>&1 | grep -E "^(minisgl|  prefill|  decode|  roofline)" | tee -a "$OUT/siluwl.log"
      done ;;
    swapped)  # cuBLASLt's fp8 matmul x @ W^T against W @ x^T (8B shapes, decode batches)
      timeout 200 python3 benchmarks/bench_fp8_skinny.py --swapped --rows "${SWAP_ROWS:-80,128,160,192,224,256}" \
        --only "${SWAP_ONLY:-gate_up,qkv}" 2>&1 | tee -a "$OUT/swapped.log" ;;
    fp8prof)  # where an fp8 decode step's time goes (8B shapes): kernels of the graph replay
      IFS=';' read -ra cfgs <<< "${FP8_PROF:-1 --quantization fp8;256 --quantization fp8 --kv-cache-dtype fp8_e4m3}"
      for cfg in "${cfgs[@]}"; do
        set -- $cfg
        bs=$1; shift
        timeout 150 python3 benchmarks/profile_decode.py --model-config llama3-8b --batch-size $bs --skip-eager "$@" \
          --input-len 512 --output-len 32 --kv-cache-gib 40 2>&1 | grep -v "^\s*$" | grep -v "^[0-9:]* I \[" | tail -32 | tee -a "$OUT/fp8prof.log"
      done ;;
  esac
done
