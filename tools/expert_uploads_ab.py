"""Hybrid prompt speed by how offloaded experts reach the GPU, one mode a process:

    python tools/expert_uploads_ab.py -m MODEL -ub 512 --mode kernel   # the engine's way
    python tools/expert_uploads_ab.py -m MODEL -ub 512 --mode host     # host reads each router
    python tools/expert_uploads_ab.py -m MODEL -ub 512 --mode whole    # --upload-all-experts

Experts in RAM (`-ngl 99 -ot exps=CPU`); pp512 and pp2048 as nbmoe.bench times them (two runs
to warm up, then three), with the bytes uploaded a micro-batch and the experts the last
plan's uploads held ahead per tensor (-1: the whole tensor). `host` drops the mapped view of
the file, so the chosen experts an upload lacks come from the host after it read the layer's
choice (backends/expert_uploads.py).
"""
import argparse

import numpy as np

import nbmoe
from nbmoe.backends import expert_uploads
from nbmoe.cli.bench import run_pp


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-ub", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=16)
    ap.add_argument("--mode", choices=("kernel", "host", "whole"), default="kernel")
    ap.add_argument("--recent", type=int, default=None,
                    help="runs whose choices an upload holds, at every batch (default: the "
                         "engine's, RECENT_RUNS / RECENT_RUNS_LARGE by the batch)")
    a = ap.parse_args()
    if a.recent:
        expert_uploads.RECENT_RUNS = expert_uploads.RECENT_RUNS_LARGE = a.recent
    if a.mode == "host":
        add = expert_uploads.ExpertUploads.add
        expert_uploads.ExpertUploads.add = lambda self, host, ids, n, layer, view=None: add(
            self, host, ids, n, layer, None)
    llm = nbmoe.load(a.model, n_ctx=4096, threads=a.threads, n_ubatch=a.ub, n_gpu_layers=99,
                     override_tensors=["exps=CPU"], upload_all_experts=a.mode == "whole")
    gpu = llm.backends["CUDA0"]
    rng = np.random.default_rng(0)
    for n in (512, 2048):
        run_pp(llm, n, 2048, rng)
        run_pp(llm, n, 2048, rng)
        before, missed = gpu.uploaded_bytes, gpu.last_expert_uploads.missed_bytes
        ts = [n / run_pp(llm, n, 2048, rng) for _ in range(3)]
        batches = 3 * max(1, n // a.ub)
        per_batch = (gpu.uploaded_bytes - before) / batches / 1e9
        missed = (gpu.last_expert_uploads.missed_bytes - missed) / batches / 1e9
        held = [-1 if t.held is None else len(t.held) for t in gpu.last_expert_uploads.tensors]
        print(f"ub {a.ub} {a.mode} recent {a.recent or 'default'} pp{n}: {np.mean(ts):.1f} +- {np.std(ts):.1f} t/s, "
              f"{per_batch:.2f} GB uploaded a micro-batch ({missed:.2f} GB after the router); "
              f"held ahead, per tensor: {held}")


if __name__ == "__main__":
    main()
