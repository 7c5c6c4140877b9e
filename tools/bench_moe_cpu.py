"""The CPU side of a hybrid decode token: every layer's expert products, nothing else.

    python tools/bench_moe_cpu.py -m model.gguf -t 16 [-n 16]

With `-ot exps=CPU` a decoding token spends most of its time in two CPU calls a layer:
fused.glu_id (the chosen experts' gate and up rows, then the GLU) and fused.down_combine
(their down rows, summed with the router's weights). This runs exactly those calls on the
model's own expert tensors (read from the GGUF mapping, as the engine reads them) for every
layer, with random routing (A distinct experts a token), and reports microseconds a token
and the expert bytes read a second, against the streaming read measured in the same run at
the same thread count (cpu/membw). The gap between the two is what the kernels leave on the
table; the GPU's part and the turn-taking are not in it (tools/hybrid_trace.py has those).
The same products as one parallel region (fused.expert_ffn, what decoding runs) are timed
beside them, layer by layer, in alternating order: the second region's wake-up is the gap.
"""
import argparse
import time

import numba
import numpy as np
from gguf import GGMLQuantizationType

import nbmoe  # noqa: F401  (Numba settings before the kernels compile)
from nbmoe.cpu import fused, matmul
from nbmoe.cpu.membw import read_bandwidth
from nbmoe.loader.gguf_file import GGUFFile


def layers(path):
    """(gate, up, down, gate/up type, down type) of each MoE layer (leading dense layers are
    skipped), as zero-copy views of the file."""
    f = GGUFFile(path)
    out = []
    for i in range(int(f.meta.get(f"{f.architecture}.block_count", 0))):
        if f"blk.{i}.ffn_gate_exps.weight" not in f.tensors:
            continue
        g, u, d = (f.tensors[f"blk.{i}.ffn_{k}_exps.weight"] for k in ("gate", "up", "down"))
        if g.ggml_type != u.ggml_type:
            raise SystemExit(f"blk.{i}: gate and up experts in different types: not measured here")
        out.append((g.data, u.data, d.data, int(g.ggml_type), int(d.ggml_type)))
    if not out:
        raise SystemExit(f"{path}: no expert tensors (blk.N.ffn_gate_exps.weight)")
    return out, int(f.meta.get(f"{f.architecture}.expert_used_count", 8))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    ap.add_argument("-n", "--tokens", type=int, default=16, help="tokens timed (after 2 warm)")
    ap.add_argument("--read-mb", type=int, default=0, help="buffer of the streaming read (0: membw.default_read_bytes)")
    a = ap.parse_args(argv)
    numba.set_num_threads(a.threads)
    lay, A = layers(a.model)
    E, F, _ = lay[0][0].shape
    D = lay[0][2].shape[1]
    qtype, qdown = lay[0][3], lay[0][4]
    K = matmul.row_values(qtype, lay[0][0].shape[2])
    int8, int8_down = matmul._int8(qtype), matmul._int8(qdown)
    step_g = matmul.expert_item_rows(F, lay[0][0].shape[2], 1, qtype)
    step_d = matmul.expert_item_rows(D, A * lay[0][2].shape[2], 1, qdown)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 1, K), dtype=np.float32)
    g = np.empty((1, A, F), np.float32)
    out = np.empty((1, D), np.float32)
    wts = np.full((1, A), 1.0 / A, np.float32)
    glu_bytes = sum(A * (w[0].nbytes + w[1].nbytes) // E for w in lay)   # a token's
    down_bytes = sum(A * w[2].nbytes // E for w in lay)
    per_token = glu_bytes + down_bytes
    t_glu = t_down = t_one = 0.0
    for tok in range(a.tokens + 2):                 # the first two warm up, untimed
        for wg, wu, wd, qt, qd in lay:
            ids = rng.choice(E, A, replace=False).astype(np.int32).reshape(1, A)
            for one in ((False, True) if tok % 2 else (True, False)):
                t0 = time.perf_counter()
                if one:
                    fused.expert_ffn(out, g, wg, wu, wd, x, ids, wts, (qt, qd), (int8, int8_down),
                                     (step_g, step_d), fused.ACT_SILU)
                    t1 = t2 = time.perf_counter()
                else:
                    fused.glu_id(g, wg, wu, x, ids, qt, int8, step_g, fused.ACT_SILU)
                    t1 = time.perf_counter()
                    fused.down_combine(out, wd, g, ids, wts, fused.EMPTY, qd, int8_down, step_d,
                                       numba.get_num_threads())
                    t2 = time.perf_counter()
                if tok >= 2 and one:
                    t_one += t2 - t0
                elif tok >= 2:
                    t_glu, t_down = t_glu + t1 - t0, t_down + t2 - t1
    n = a.tokens
    if n == 0:                                   # -n 0: compile and warm only
        return None
    bw = read_bandwidth(a.read_mb << 20)
    total = (t_glu + t_down) / n
    names = "/".join(GGMLQuantizationType(q).name for q in dict.fromkeys((qtype, qdown)))
    print(f"{len(lay)} layers, {E} experts ({A} a token) of {F}x{K} {names}, threads {a.threads}; "
          f"streaming read {bw:.1f} GB/s")
    print(f"gate/up/GLU   {t_glu / n / len(lay) * 1e6:7.1f} us a layer  "
          f"{glu_bytes / (t_glu / n) / 1e9:6.1f} GB/s")
    print(f"down + sum    {t_down / n / len(lay) * 1e6:7.1f} us a layer  "
          f"{down_bytes / (t_down / n) / 1e9:6.1f} GB/s")
    print(f"token         {total * 1e3:7.2f} ms  {per_token / 1e6:.1f} MB  "
          f"{per_token / total / 1e9:6.1f} GB/s = {per_token / total / 1e9 / bw:.0%} of the read")
    one = t_one / n
    print(f"one region    {one * 1e3:7.2f} ms  {per_token / one / 1e9:6.1f} GB/s = "
          f"{per_token / one / 1e9 / bw:.0%} of the read (fused.expert_ffn)")
    return dict(bytes_per_token=per_token, glu_s=t_glu / n, down_s=t_down / n, one_s=one, read_gbs=bw)


if __name__ == "__main__":
    main()
