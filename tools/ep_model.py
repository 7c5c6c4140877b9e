"""The performance model of docs/scale-out.md: DeepSeek-V3 at Q4_K over R hosts, tokens per
second of generation (TG) and of a 512-token prompt (PP), for nbmoe's expert parallelism
(--ep) and for llama.cpp's RPC backend (layers placed per host), from stated per-host rates.

    python tools/ep_model.py [--ram-gbs 80] [--cpu-tflops 4.0] [--sw-us 20] [--samples 20000]

Every input is a flag; docs/scale-out.md says which measurement each default comes from.
Generation is a read of the active weights (bytes / bandwidth); prompts are products
(FLOPs / rate); a link costs its latency plus bytes / bandwidth. Router choices are taken
as V3's group-limited routing does them (the 4 best of 8 groups of 32 experts, then the
8 best of those 128), each choice uniform; --ep's even split gives each host whole groups.
"""
import argparse

import numpy as np

# DeepSeek-V3 (671B): 61 layers, the first 3 dense; MLA attention; 256 experts of 2048
# (8 routed + 1 shared active); Q4_K = 4.5 bits a weight
D, N_LAYER, N_DENSE, N_FF, E, A, F, VOCAB = 7168, 61, 3, 18432, 256, 8, 2048, 129280
H, Q_LORA, KV_LORA, NOPE, ROPE, V = 128, 1536, 512, 128, 64, 128
BPW = 4.5 / 8
EXPERT = 3 * D * F                                                      # weights of one expert
ATTN = (D * Q_LORA + Q_LORA * H * (NOPE + ROPE) + D * (KV_LORA + ROPE)
        + KV_LORA * H * (NOPE + V) + H * V * D + D * E)                  # + the router
DENSE, OUTPUT = 3 * D * N_FF, D * VOCAB
N_MOE = N_LAYER - N_DENSE
# one token's messages per rank and MoE layer (comm.py): out header + x f32 + ids/weights, back sums
MSG_OUT, MSG_BACK = 32 + 4 * D + 8 * A, 4 + 4 * D

LINKS = {   # name: (bits/s, one-way latency s) — assumptions, see docs/scale-out.md
    "25 Gb/s (TCP)": (25e9, 15e-6),
    "100 Gb/s (RDMA)": (100e9, 3e-6),
    "400 Gb/s (RDMA)": (400e9, 2e-6),
}


def expert_loads(R, samples, rng):
    """[samples, R]: how many of a token's 8 chosen experts each rank holds (even split):
    4 of the 8 groups of 32, then 8 distinct experts of those 128, uniformly."""
    groups = np.argsort(rng.random((samples, 8)), axis=1)[:, :4]          # [S, 4]
    pick = np.argsort(rng.random((samples, 128)), axis=1)[:, :A]          # [S, 8] of 4 x 32
    chosen = np.take_along_axis(groups, pick // 32, axis=1) * 32 + pick % 32
    rank = chosen * R // E
    return np.stack([(rank == r).sum(1) for r in range(R)], axis=1)


def tg(R, link, a, loads, overlap=True):
    """Seconds a token takes with --ep R: rank 0 reads the non-expert weights (a CPU, or
    a GPU with --gpu0) and its share; the ranks read theirs meanwhile."""
    bw, lat = link
    t_e = EXPERT * BPW / (a.ram_gbs * 1e9)                 # one expert from RAM
    r0 = (a.gpu_gbs if a.gpu0 else a.ram_gbs) * 1e9
    t_attn, t_sh = ATTN * BPW / r0, EXPERT * BPW / r0
    link_t = 2 * lat + a.sw_us * 1e-6 + (MSG_OUT + MSG_BACK) * 8 / (0.9 * bw)
    if R == 1:
        moe = t_sh + A * t_e
    else:
        local = loads[:, 0] * t_e
        remote = link_t + loads[:, 1:].max(1) * t_e
        moe = (np.maximum(t_sh + local, remote) if overlap else np.maximum(local, remote) + t_sh).mean()
    return N_LAYER * t_attn + N_DENSE * DENSE * BPW / r0 + N_MOE * moe + OUTPUT * BPW / r0


def pp(R, link, a, T=512):
    """Seconds a T-token prompt takes with --ep R: rank 0 computes attention, dense layers
    and the shared expert; the routed experts' products are spread evenly (a prompt uses
    them all); each layer's messages of every rank pass rank 0's link one after another."""
    bw, lat = link
    cpu, r0 = a.cpu_tflops * 1e12, (a.gpu_tflops if a.gpu0 else a.cpu_tflops) * 1e12
    routed = 2 * T * A * EXPERT / cpu                      # one layer's routed products, one host
    t_attn, t_sh = 2 * T * ATTN / r0, 2 * T * EXPERT / r0
    if R == 1:
        moe = t_sh + routed
    else:
        wire = (R - 1) * T * (MSG_OUT + MSG_BACK) * 8 / (0.9 * bw) + 2 * lat + a.sw_us * 1e-6
        moe = max(t_sh + routed / R, wire + routed / R)
    return N_LAYER * t_attn + N_DENSE * 2 * T * DENSE / r0 + N_MOE * moe + 2 * T * OUTPUT / r0


def rpc_tg(R, link, a):
    """llama.cpp RPC, layers in R contiguous runs over the hosts: a token visits them one
    after another (no two hosts read at once), one synchronous crossing per host."""
    bw, lat = link
    t1 = tg(1, link, argparse.Namespace(**{**vars(a), "gpu0": False}), None)
    return t1 + R * (2 * lat + a.rpc_us * 1e-6 + 4 * D * 8 / (0.9 * bw))


def rpc_tg_gpu0(R, link, a):
    """llama.cpp RPC with the non-expert weights on host 0's GPU and each layer's experts on
    one RPC host (-ot per layer): a layer's experts are read by one host, and each MoE
    layer crosses to it and back (two synchronous crossings)."""
    bw, lat = link
    t_e = EXPERT * BPW / (a.ram_gbs * 1e9)
    r0 = a.gpu_gbs * 1e9
    cross = 2 * lat + a.rpc_us * 1e-6 + 4 * D * 8 / (0.9 * bw)
    return (N_LAYER * ATTN * BPW / r0 + N_DENSE * DENSE * BPW / r0 + OUTPUT * BPW / r0
            + N_MOE * (EXPERT * BPW / r0 + A * t_e + 2 * cross))


def rpc_pp(R, link, a, T=512, n_ubatch=512, n_batch=2048):
    """llama.cpp RPC with pipeline parallelism (a 2048-token batch in 512-token micro-
    batches flows through the hosts): (micro-batches + R - 1) stages of 1/R of the layers.
    A 512-token prompt is one micro-batch: the hosts take turns."""
    bw, lat = link
    one = pp(1, link, argparse.Namespace(**{**vars(a), "gpu0": False}), n_ubatch)
    cross = 2 * lat + a.rpc_us * 1e-6 + n_ubatch * 4 * D * 8 / (0.9 * bw)
    m = max(1, min(n_batch, max(T, n_ubatch)) // n_ubatch)
    return ((m + R - 1) * (one / R + cross)) / m * (T / n_ubatch)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ram-gbs", type=float, default=80.0, help="a host's expert read rate, GB/s")
    p.add_argument("--cpu-tflops", type=float, default=4.0, help="a host's prompt product rate, TFLOP/s")
    p.add_argument("--gpu0", action="store_true", help="rank 0's non-expert weights on a GPU")
    p.add_argument("--gpu-gbs", type=float, default=2000.0, help="that GPU's read rate, GB/s")
    p.add_argument("--gpu-tflops", type=float, default=45.0, help="that GPU's prompt rate, TFLOP/s")
    p.add_argument("--sw-us", type=float, default=20.0,
                   help="software time of one exchange beyond the wire (measured: ep_exchange.py, T=1)")
    p.add_argument("--rpc-us", type=float, default=30.0, help="llama.cpp RPC's software time a crossing")
    p.add_argument("--samples", type=int, default=20000)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    total = (N_MOE * (E + 1) * EXPERT + N_LAYER * ATTN + N_DENSE * DENSE + 2 * OUTPUT) * BPW
    token = (N_MOE * (A + 1) * EXPERT + N_LAYER * ATTN + N_DENSE * DENSE + OUTPUT) * BPW
    print(f"DeepSeek-V3 Q4_K: {total / 1e9:.0f} GB, read a token {token / 1e9:.1f} GB "
          f"(experts {N_MOE * A * EXPERT * BPW / 1e9:.1f} GB routed)")
    one = LINKS["100 Gb/s (RDMA)"]
    print(f"one host holding it all (RAM permitting): TG {1 / tg(1, one, a, None):.2f} t/s, "
          f"PP512 {512 / pp(1, one, a):.1f} t/s")
    print("| hosts | link | --ep TG t/s | (no overlap) | --ep PP512 t/s | RPC TG t/s "
          "| RPC PP512 t/s | RPC PP2048 t/s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for R in (2, 4, 8):
        loads = expert_loads(R, a.samples, rng)
        for name, link in LINKS.items():
            print(f"| {R} | {name} | {1 / tg(R, link, a, loads):.2f} | "
                  f"{1 / tg(R, link, a, loads, False):.2f} | "
                  f"{512 / pp(R, link, a):.1f} | "
                  f"{1 / (rpc_tg_gpu0 if a.gpu0 else rpc_tg)(R, link, a):.2f} | "
                  f"{512 / rpc_pp(R, link, a):.1f} | {2048 / rpc_pp(R, link, a, T=2048):.1f} |")


if __name__ == "__main__":
    main()
