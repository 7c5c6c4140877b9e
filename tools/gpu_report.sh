#!/usr/bin/env bash
# The GPU machine's hybrid measurements, in one run:
#   bash tools/gpu_report.sh [tests] [hybrid-tests] [mma] [model] [tg-ab] [pp] [ncu] [bench-gpu]
#                            [bench-hybrid] [kernels] [tiles] [profile] [trace] [tg]
# Logs go to $OUT (or ./gpu_report); the Qwen3-30B-A3B-shaped model to $MODEL
# (default /tmp/q3moe-30b.gguf, made when missing). Each step has its own time limit.
set -u
OUT=${OUT:-gpu_report}; mkdir -p "$OUT"
MODEL=${MODEL:-/tmp/q3moe-30b.gguf}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
steps=${*:-tests model bench-gpu bench-hybrid}
# the bench with every node bound on its own (fusion.ENABLED off): python -c "$UNFUSED" <bench args>
UNFUSED='from nbmoe.sched import fusion; fusion.ENABLED = False; from nbmoe.cli.bench import main; main()'

step() {   # name, seconds, command...
    local name=$1 secs=$2; shift 2
    echo "=== $name ($(date +%T))"
    timeout "$secs" "$@" 2>&1 | tee "$OUT/$name.log"
    echo "=== $name: exit ${PIPESTATUS[0]} ($(date +%T))"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for s in $steps; do case $s in
  tests) NBMOE_REAL_GPU=1 step tests 500 python -m pytest -q -x tests/test_cuda_*.py tests/test_hybrid.py ;;
  hybrid-tests) NBMOE_REAL_GPU=1 step hybrid-tests 300 python -m pytest -q -x tests/test_hybrid.py ;;
  tg-ab) # decode with and without the fused groups, all on GPU and hybrid
         step tg-gpu 200 python -m nbmoe.bench -m "$MODEL" -ngl 99 -p 0 -n 128 -r 2 --timings
         step tg-gpu-nofuse 200 python -c "$UNFUSED" -m "$MODEL" -ngl 99 -p 0 -n 128 -r 2
         step tg-hybrid 200 python -m nbmoe.bench -m "$MODEL" -ngl 99 -ot exps=CPU -t 16 -p 0 \
             -n 128 -r 2 --timings
         step tg-hybrid-nofuse 200 python -c "$UNFUSED" -m "$MODEL" -ngl 99 \
             -ot exps=CPU -t 16 -p 0 -n 128 -r 2 ;;
  trace) # a decode token step by step as the host sees it (graph launch / device / wait)
         step trace-hybrid 240 python tools/hybrid_trace.py -m "$MODEL" -ngl 99 -ot exps=CPU -t 16 -n 32
         step trace-gpu 180 python tools/hybrid_trace.py -m "$MODEL" -ngl 99 -n 32 ;;
  tg) step tg-gpu 240 python -m nbmoe.bench -m "$MODEL" -ngl 99 -p 0 -n 128 -r 3
      step tg-hybrid 300 python -m nbmoe.bench -m "$MODEL" -ngl 99 -ot exps=CPU -t 16 -p 0 -n 128 -r 3 ;;
  mma) step mma-check 240 python tools/cuda_mma_check.py
       NBMOE_REAL_GPU=1 step mma-tests 200 python -m pytest -q -x tests/test_cuda_mma.py ;;
  flash) step flash-check 200 python tools/cuda_flash_check.py
         NBMOE_REAL_GPU=1 step flash-tests 200 python -m pytest -q -x tests/test_cuda_flash.py ;;
  pp) step pp-gpu 300 python -m nbmoe.bench -m "$MODEL" -ngl 99 -p 512,2048 -n 0 -ub 512,2048 -r 2
      step pp-hybrid 300 python -m nbmoe.bench -m "$MODEL" -ngl 99 -ot exps=CPU -t 16 -p 2048 -n 0 \
          -ub 2048 -r 2 --timings ;;
  ncu) command -v ncu >/dev/null || { echo "no ncu"; continue; }
       step ncu 300 ncu --metrics gpu__time_duration.sum --csv --launch-skip 3000 --launch-count 1300 \
           python -m nbmoe.bench -m "$MODEL" -ngl 99 -p 0 -n 16 -r 1 --no-bandwidth
       python tools/ncu_summary.py "$OUT/ncu.log" --per 2 | tee "$OUT/ncu-summary.log" ;;
  model) [ -f "$MODEL" ] || step model 300 python tools/make_model.py --preset qwen3-30b-a3b \
             --type exps=Q4_0 --type default=Q8_0 -o "$MODEL" ;;
  bench-gpu) step bench-gpu 500 python -m nbmoe.bench -m "$MODEL" -ngl 99 -p 512,2048 -n 128 \
             -ub 512,2048 -r 2 -t 16 ;;
  bench-hybrid) step bench-hybrid 500 python -m nbmoe.bench -m "$MODEL" -ngl 99 -ot exps=CPU \
             -t 16 -p 512,2048 -n 128 -ub 512,2048 -r 2 --timings ;;
  kernels) step kernels 300 python tools/cuda_matmul_bench.py ;;
  tiles) step tiles 300 python tools/cuda_tile_sweep.py ;;
  profile) command -v nsys >/dev/null || { echo "no nsys"; continue; }
           # kernels inside the recorded graphs, one by one (--cuda-graph-trace=node)
           step profile 300 nsys profile -o /tmp/nbmoe-tg --force-overwrite true \
             --cuda-graph-trace=node --stats=true \
             python -m nbmoe.bench -m "$MODEL" -ngl 99 -p 0 -n 32 -r 1 --no-bandwidth ;;
  *) echo "unknown step $s"; exit 2 ;;
esac; done
