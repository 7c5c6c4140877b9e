#!/bin/bash
# Qwen3-30B-A3B's shape with its experts over 2 ranks, one GPU each (--ep 2 --ep-gpu), against
# one process. On a host with 2 GPUs, from the repository root:
#     bash tools/ep_gpu_bench.sh [/tmp/q3.gguf]
# Rank r takes the GPU of its local rank (rank 0: GPU 0, which also holds its -ngl layers;
# rank 1: GPU 1). Each rank uploads its half of the experts (8.1 GB) to its GPU.
set -e
M=${1:-/tmp/q3.gguf}
[ -f "$M" ] || python tools/make_model.py --preset qwen3-30b-a3b --type exps=Q4_0 --type default=Q8_0 -o "$M"
B="-p 512 -n 128 -r 3 -t 16"
echo "== one process, all on GPU 0";           python -m nbmoe.bench -m "$M" $B -ngl 99
echo "== one process, experts in RAM (hybrid)"; python -m nbmoe.bench -m "$M" $B -ngl 99 -ot exps=CPU
echo "== 2 ranks, experts on the CPUs";        mpiexec -n 2 python -m nbmoe.bench -m "$M" $B -ngl 99 --ep 2 --timings
echo "== 2 ranks, a GPU each (--ep-gpu)";      mpiexec -n 2 python -m nbmoe.bench -m "$M" $B -ngl 99 --ep 2 --ep-gpu --explain --timings
