#!/usr/bin/env bash
# Two-GPU checks and measurements on a machine with several GPUs (device kind nvidia-h200-x2):
#   bash tools/gpu_multi.sh        logs under $OUT (or ./gpu_report)
# 1. the real-GPU hybrid tests (test_two_gpus_equal_cpu then runs on two real GPUs, and -ngl 99
#    in test_hybrid_equals_cpu spreads the layers over both);
# 2. the Qwen3-30B-A3B-shaped model on one GPU (CUDA_VISIBLE_DEVICES=0) and spread over two.
set -u
OUT=${OUT:-gpu_report}; mkdir -p "$OUT"
MODEL=${MODEL:-/tmp/q3moe-30b.gguf}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
step() {   # name, seconds, command...
    local name=$1 secs=$2; shift 2
    echo "=== $name ($(date +%T))"
    timeout "$secs" "$@" 2>&1 | tee "$OUT/$name.log"
    echo "=== $name: exit ${PIPESTATUS[0]} ($(date +%T))"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nvidia-smi topo -m | head -5
NBMOE_REAL_GPU=1 step hybrid-tests 400 python -m pytest -q -x tests/test_hybrid.py
[ -f "$MODEL" ] || step model 300 python tools/make_model.py --preset qwen3-30b-a3b \
    --type exps=Q4_0 --type default=Q8_0 -o "$MODEL"
CUDA_VISIBLE_DEVICES=0 step one-gpu 300 python -m nbmoe.bench -m "$MODEL" -ngl 99 -p 512 -n 128 -r 2
CUDA_VISIBLE_DEVICES=0 step one-gpu-hybrid 300 python -m nbmoe.bench -m "$MODEL" -ngl 99 -ot exps=CPU \
    -t 16 -p 512 -n 128 -r 2
step two-gpus 300 python -m nbmoe.bench -m "$MODEL" -ngl 99 -p 512 -n 128 -r 2
step two-gpus-hybrid 300 python -m nbmoe.bench -m "$MODEL" -ngl 99 -ot exps=CPU -t 16 -p 512 -n 128 -r 2
step two-gpus-timings 300 python -m nbmoe.bench -m "$MODEL" -ngl 99 -p 0 -n 32 -r 1 --timings --explain
