"""Check and time the int8 decode matrix-vector kernels (T = 1) on a GPU, at the shapes of a
Qwen3-30B-A3B-like model (hidden 2048, q/k/v 4096 + 512 + 512 rows, 128 experts of 768, 8
active, experts Q4_0, the rest Q8_0):

    PYTHONUNBUFFERED=1 python tools/cuda_mmv_check.py [--reps 200] [--configs u2v4,u1v4,u4v2,...]

Per case: the max relative error against a float64 NumPy product with x on its 8-bit grid (both
then multiply the same values: ~1e-6; the check fails above 1e-3), and the device time per
launch: R launches recorded in one CUDA graph (nbmoe.cuda.graphs.GraphRun), replayed 7 times
between CUDA events, the median / R. Launches cycle through copies of the weights (dense: >=
256 MB of copies; experts: 8 copies of all 128 and random ids a launch), so they read from
memory, not the L2. GB/s = weight bytes a launch reads (chosen experts only) / time. "old" is
the kernels before this change (one unit of 8 values a lane a step), kept here only.
--configs: chunk shapes to compare, uXvY = CHUNK_UNITS X for Q4_0 and Q8_0, MMV_CHUNKS Y.
Finishes in about a minute on an H200 (compiles dominate). Exits 1 when a check fails.
"""
import argparse
import functools
import os
import sys

import numpy as np

import nbmoe.cuda  # noqa: F401  (defines np.row_stack before numba.cuda is imported)
from numba import cuda  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gguf import GGMLQuantizationType as Q  # noqa: E402
from ref_quant import random_rows  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from nbmoe.cuda import device_fn, dp4a, fused, ld_f32, ld_i32, matmul, mmv_q8, warp_sum  # noqa: E402
from nbmoe.cuda.x8 import quantize_x  # noqa: E402
from nbmoe.cuda.graphs import ENABLED as GRAPHS, GraphRun  # noqa: E402
from nbmoe.cuda.quants import qtype_info  # noqa: E402

f32 = np.float32
TOL = 1e-3
Q4_0, Q8_0 = int(Q.Q4_0), int(Q.Q8_0)


# ---------------------------------------------------------------- the kernels before this change
# Lane l dots units l, l + 32, ... of its row (one 8-value unit a step), warp-summed.

def _old_row_dot(qt):
    t_ = qtype_info(qt)
    idec, split = t_.idec, t_.split

    @device_fn
    def row_dot(w, base, xq, xds, xr, K, lane, first, step):
        acc = f32(0.0)
        for n in range(lane + first, K >> 3, step):
            b = n >> 2
            u = n & 3
            c0, c1, d, m4 = idec(w, base, b, u)
            w0, w1 = mmv_q8.unit_words(b, u, split)
            qb = xr * K
            isum = dp4a(c0, ld_i32(xq, qb, 4 * w0), dp4a(c1, ld_i32(xq, qb, 4 * w1), 0))
            db = xr * (K // 4)
            acc += ld_f32(xds, db, 8 * b) * (d * f32(isum)) + m4 * ld_f32(xds, db, 8 * b + 4)
        return acc
    return row_dot


OLD_PARTS = 8       # split-K partial sums a block (shared array shapes must be globals)


@functools.lru_cache(maxsize=None)
def old_kernels(qt, S):
    row_dot = _old_row_dot(qt)

    @cuda.jit
    def mmv(out, w, xq, xds, RB, K):        # T = 1, S warps a row
        part = cuda.shared.array(OLD_PARTS, f32)
        M = out.shape[1]
        lane, wy = cuda.threadIdx.x, cuda.threadIdx.y
        r = cuda.blockIdx.x * (cuda.blockDim.y // S) + wy // S
        sl = wy % S
        tot = warp_sum(row_dot(w, min(r, M - 1) * RB, xq, xds, 0, K, lane, 32 * sl, 32 * S))
        if lane == 0:
            part[wy] = tot
        cuda.syncthreads()
        if sl == 0 and lane == 0 and r < M:
            tot = part[wy]
            for q in range(1, S):
                tot += part[wy + q]
            out[0, r] = tot

    @cuda.jit
    def products(out0, out1, out2, w0, w1, w2, xq, xds, M0, M1, M2, RB, K):
        lane = cuda.threadIdx.x
        r = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
        t = cuda.blockIdx.y
        rr = min(r, M0 + M1 + M2 - 1)
        w, out, rw = w0, out0, rr
        if rr >= M0 + M1:
            w, out, rw = w2, out2, rr - M0 - M1
        elif rr >= M0:
            w, out, rw = w1, out1, rr - M0
        tot = warp_sum(row_dot(w, rw * RB, xq, xds, t, K, lane, 0, 32))
        if lane == 0 and r < M0 + M1 + M2:
            out[t, rw] = tot

    @cuda.jit
    def glu_id(out, wg, wu, xq, xds, ids, X, RB, K, act):
        M = out.shape[2]
        A = ids.shape[1]
        lane = cuda.threadIdx.x
        r = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
        t, a, base, xr = matmul.pair_row(ids, cuda.blockIdx.y, r, M, A, X, RB)
        g = warp_sum(row_dot(wg, base, xq, xds, xr, K, lane, 0, 32))
        u = warp_sum(row_dot(wu, base, xq, xds, xr, K, lane, 0, 32))
        if lane == 0 and r < M:
            out[t, a, r] = fused._act(g, act) * u

    @cuda.jit
    def down(out, w, xq, xds, ids, wts, RB, K):
        ys = cuda.shared.array(32, f32)
        M = out.shape[1]
        A = ids.shape[1]
        lane, a = cuda.threadIdx.x, cuda.threadIdx.y
        r, t = cuda.blockIdx.x, cuda.blockIdx.y
        y = warp_sum(row_dot(w, (ids[t, a] * M + r) * RB, xq, xds, t * A + a, K, lane, 0, 32))
        if lane == 0:
            ys[a] = y
        cuda.syncthreads()
        if lane == 0 and a == 0:
            acc = wts[t, 0] * ys[0]
            for q in range(1, A):
                acc += wts[t, q] * ys[q]
            out[t, r] = acc
    return mmv, products, glu_id, down


# ---------------------------------------------------------------- data

def on_grid(x):
    """x [..., K] on its 8-bit grid (as quantize_x rounds it): codes rint(x / d), d = max|x| / 127."""
    xb = x.reshape(-1, 32)
    d = (np.abs(xb).max(axis=1) / f32(127)).astype(f32)
    inv = np.where(d > 0, f32(1) / np.where(d > 0, d, 1), 0).astype(f32)
    return (np.rint(xb * inv[:, None]) * d[:, None].astype(np.float64)).reshape(x.shape)


def x8(x):
    """Device copies of x's 8-bit form (xq, xds), owned by the case (the 8-bit buffers are shared)."""
    dx = cuda.to_device(np.ascontiguousarray(x, f32))
    n_rows, K = x.size // x.shape[-1], x.shape[-1]
    xq, xds = quantize_x(dx, n_rows, K, 0)
    cuda.synchronize()
    return (cuda.to_device(xq.copy_to_host()[:n_rows * K // 4]),
            cuda.to_device(xds.copy_to_host()[:n_rows * K // 16]))


def copies(host, min_bytes, at_least=2):
    """Device copies of host, enough that cycling through them overflows the L2."""
    n = max(at_least, -(-min_bytes // host.nbytes))
    return [cuda.to_device(host) for _ in range(n)]


def rel_err(got, ref):
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / max(np.max(np.abs(ref)), 1e-30))


def device_us(launch, reps):
    """Median device time of launch(i, stream) in us: reps launches in one CUDA graph, replayed."""
    stream = cuda.stream()
    run = GraphRun([(lambda i=i: launch(i, stream)) for i in range(reps)], stream, wait=False)
    run()           # plain: compiles
    run()           # records, replays
    stream.synchronize()
    times = []
    for _ in range(7):
        e0, e1 = cuda.event(), cuda.event()
        e0.record(stream)
        run()
        e1.record(stream)
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / reps)
    return float(np.median(times))


# ---------------------------------------------------------------- cases
# Each case: (name, shape, weight bytes a launch, launch(i, stream, old), check(old) -> max rel err)

def make_cases(rng, reps, tiny=False):
    cases = []
    D, F, E, A, KO, Ms, L2 = 2048, 768, 128, 8, 4096, (4096, 512, 512), 256 << 20
    if tiny:                    # a dry run of this script in the simulator
        D, F, E, A, KO, Ms, L2 = 64, 64, 4, 2, 128, (64, 32, 32), 0

    # attention output: mul_mat_vec_q8, 2048 x 4096 Q8_0, split-K
    Ko, Mo = KO, D        # (names of their own: the closures below read them late)
    wo = random_rows(rng, Mo, Ko, "Q8_0")
    wref = dequantize(wo, Q.Q8_0).reshape(Mo, Ko).astype(np.float64)
    ws = copies(wo, L2)
    xo = rng.standard_normal((1, Ko)).astype(f32)
    xq, xds = x8(xo)
    out = cuda.device_array((1, Mo), f32)
    S = matmul._split_k(Mo, Ko)

    def launch_mmv(i, stream, old):
        rpb = matmul.MMV_WARPS // S
        grid = ((Mo + rpb - 1) // rpb, 1)
        if old:
            old_kernels(Q8_0, S)[0][grid, (32, matmul.MMV_WARPS), stream](out, ws[i % len(ws)], xq, xds, wo.shape[1], Ko)
        else:
            matmul._mmv_q8_kernel(Q8_0, 1, S, mmv_q8.chunks_in_flight(Q8_0, Ko, S))[
                grid, (32, matmul.MMV_WARPS), stream](out, ws[i % len(ws)], xq, xds, nbmoe.cuda.empty(), wo.shape[1], Ko)

    def check_mmv(old):
        launch_mmv(0, 0, old)
        return rel_err(out.copy_to_host(), on_grid(xo) @ wref.T)
    cases.append(("mul_mat_vec_q8", f"Q8_0 {Mo}x{Ko} S={S}", wo.nbytes, launch_mmv, check_mmv))

    # q, k, v: products_q8, 4096 + 512 + 512 rows x 2048 Q8_0
    Kq = D
    wq = [random_rows(rng, m, Kq, "Q8_0") for m in Ms]
    wqref = [dequantize(v, Q.Q8_0).reshape(m, Kq).astype(np.float64) for v, m in zip(wq, Ms)]
    nb = sum(v.nbytes for v in wq)
    wqs = [copies(v, 0, at_least=max(2, -(-L2 // nb))) for v in wq]    # q, k, v copies in step
    x2 = rng.standard_normal((1, Kq)).astype(f32)
    xq2, xds2 = x8(x2)
    outs = [cuda.device_array((1, m), f32) for m in Ms]

    def launch_products(i, stream, old):
        ww = [c[i % len(c)] for c in wqs]
        if old:
            rows = sum(Ms)
            old_kernels(Q8_0, 1)[1][((rows + matmul.MMV_WARPS - 1) // matmul.MMV_WARPS, 1), (32, matmul.MMV_WARPS),
                                    stream](*outs, *ww, xq2, xds2, *Ms, wq[0].shape[1], Kq)
        else:
            fused.products_q8(outs, ww, xq2, xds2, Q8_0, Kq, stream)

    def check_products(old):
        launch_products(0, 0, old)
        return max(rel_err(o.copy_to_host(), on_grid(x2) @ r.T) for o, r in zip(outs, wqref))
    cases.append(("products_q8", f"Q8_0 ({'+'.join(map(str, Ms))})x{Kq}", nb, launch_products, check_products))

    # experts: 8 copies of 128 experts, random ids a launch
    def experts(M, K):
        w = random_rows(rng, E * M, K, "Q4_0").reshape(E, M, -1)
        return w, copies(w, 0, at_least=2 if tiny else 8)
    wg, wgs = experts(F, D)
    wu, wus = experts(F, D)
    wd, wds = experts(D, F)
    ids_h = [np.sort(rng.choice(E, A, replace=False)).astype(np.int32).reshape(1, A) for _ in range(reps)]
    ids = [cuda.to_device(v) for v in ids_h]
    xg = rng.standard_normal((1, D)).astype(f32)
    xqg, xdsg = x8(xg)
    outg = cuda.device_array((1, A, F), f32)

    def deq(w, e, M, K):
        return dequantize(w[e], Q.Q4_0).reshape(M, K).astype(np.float64)

    def launch_glu(i, stream, old):
        c = i % len(wgs)
        if old:
            old_kernels(Q4_0, 1)[2][((F + matmul.MMV_WARPS - 1) // matmul.MMV_WARPS, A), (32, matmul.MMV_WARPS), stream](
                outg, wgs[c], wus[c], xqg, xdsg, ids[i], 1, wg.shape[2], D, fused.ACT_SILU)
        else:
            fused.glu_id_q8(outg, wgs[c], wus[c], xqg, xdsg, ids[i], 1, Q4_0, D, fused.ACT_SILU, stream)

    def check_glu(old):
        launch_glu(0, 0, old)
        xr = on_grid(xg)[0]
        ref = []
        for e in ids_h[0][0]:
            g, u = deq(wg, e, F, D) @ xr, deq(wu, e, F, D) @ xr
            ref.append(g / (1 + np.exp(-g)) * u)
        return rel_err(outg.copy_to_host()[0], np.stack(ref))
    cases.append(("glu_id_q8", f"Q4_0 2x{A}x{F}x{D} of {E}", 2 * A * wg.nbytes // E, launch_glu, check_glu))

    outi = cuda.device_array((1, A, F), f32)

    def launch_id(i, stream, old):
        c = i % len(wgs)
        grid = ((F + matmul.MMV_WARPS - 1) // matmul.MMV_WARPS, A)
        if old:
            return False
        matmul._mmv_id_q8_kernel(Q4_0, mmv_q8.chunks_in_flight(Q4_0, D))[grid, (32, matmul.MMV_WARPS), stream](
            outi, wgs[c], xqg, xdsg, ids[i], 1, wg.shape[2], D)

    def check_id(old):
        launch_id(0, 0, old)
        xr = on_grid(xg)[0]
        return rel_err(outi.copy_to_host()[0], np.stack([deq(wg, e, F, D) @ xr for e in ids_h[0][0]]))
    cases.append(("mul_mat_vec_id_q8", f"Q4_0 {A}x{F}x{D} of {E}", A * wg.nbytes // E, launch_id, check_id))

    xd = rng.standard_normal((1, A, F)).astype(f32)
    xqd, xdsd = x8(xd)
    wts_h = rng.uniform(0.05, 0.3, (1, A)).astype(f32)
    wts = cuda.to_device(wts_h)
    outd = cuda.device_array((1, D), f32)

    def launch_down(i, stream, old):
        c = i % len(wds)
        if old:
            old_kernels(Q4_0, 1)[3][(D, 1), (32, A), stream](outd, wds[c], xqd, xdsd, ids[i], wts, wd.shape[2], F)
        else:
            fused.down_combine_q8(outd, wds[c], xqd, xdsd, ids[i], wts, Q4_0, F, stream)

    def check_down(old):
        launch_down(0, 0, old)
        xr = on_grid(xd)[0]
        ref = sum(float(wts_h[0, a]) * (deq(wd, e, D, F) @ xr[a]) for a, e in enumerate(ids_h[0][0]))
        return rel_err(outd.copy_to_host()[0], ref)
    cases.append(("down_combine_q8", f"Q4_0 {A}x{D}x{F} of {E}", A * wd.nbytes // E, launch_down, check_down))
    return cases


def set_config(cfg):
    """uXvY: CHUNK_UNITS X for Q4_0 and Q8_0, MMV_CHUNKS Y."""
    u, v = cfg[1:].split("v")
    mmv_q8.CHUNK_UNITS[Q4_0] = mmv_q8.CHUNK_UNITS[Q8_0] = int(u)
    mmv_q8.MMV_CHUNKS = int(v)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=200, help="launches a graph (cycling weight copies)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a dry run in the CUDA simulator)")
    ap.add_argument("--configs", default="u2v4,u1v4,u4v2,u4v4,u2v8",
                    help="chunk shapes to time, the first is the default (must equal mmv_q8's defaults "
                         "to time what the engine runs)")
    a = ap.parse_args()
    name = getattr(cuda.get_current_device(), "name", "CUDA simulator")
    print(f"{name.decode() if isinstance(name, bytes) else name}, CUDA graphs "
          f"{'on' if GRAPHS else 'OFF (simulator or NBMOE_NO_GRAPHS=1): times include host launch gaps'}", flush=True)
    big = cuda.device_array(1 << (10 if a.tiny else 28), np.float32)
    big2 = cuda.device_array(big.size, np.float32)
    big2.copy_to_device(big)
    cuda.synchronize()
    e0, e1 = cuda.event(), cuda.event()
    e0.record()
    for _ in range(5):
        big2.copy_to_device(big)
    e1.record()
    e1.synchronize()
    print(f"device copy: {2 * 5 * big.nbytes / e0.elapsed_time(e1) / 1e6:.0f} GB/s (read + write)", flush=True)
    big = big2 = None
    default = f"u{mmv_q8.CHUNK_UNITS[Q4_0]}v{mmv_q8.MMV_CHUNKS}"
    rng = np.random.default_rng(0)
    cases = make_cases(rng, a.reps, a.tiny)
    print(f"data ready; engine default chunk shape {default}", flush=True)
    bad = 0
    rows = []
    for name, shape, nbytes, launch, check in cases:
        err = check(False)
        ok = err < TOL
        bad += not ok
        t = device_us(lambda i, s: launch(i, s, False), a.reps)
        old_err = check(True) if name != "mul_mat_vec_id_q8" else None
        t_old = device_us(lambda i, s: launch(i, s, True), a.reps) if old_err is not None else None
        rows.append((name, shape, nbytes, t, t_old, err, old_err))
        print(f"  {name:18s} {shape:28s} {t:7.2f} us {nbytes / t / 1e3:6.0f} GB/s"
              + (f"  old {t_old:7.2f} us {nbytes / t_old / 1e3:6.0f} GB/s x{t_old / t:4.2f}" if t_old else "")
              + f"  max rel err {err:.1e} {'OK' if ok else 'FAILED'}", flush=True)
    print("\nsummary (T = 1, device time a launch, weight bytes read / time):")
    print(f"  {'kernel':18s} {'shape':28s} {'MB':>6s} {'us':>7s} {'GB/s':>6s} {'old us':>7s} {'old GB/s':>8s}  err")
    for name, shape, nbytes, t, t_old, err, _ in rows:
        print(f"  {name:18s} {shape:28s} {nbytes / 1e6:6.1f} {t:7.2f} {nbytes / t / 1e3:6.0f} "
              + (f"{t_old:7.2f} {nbytes / t_old / 1e3:8.0f}" if t_old else f"{'-':>7s} {'-':>8s}") + f"  {err:.1e}")
    print("\nchunk shapes (uXvY: X units a chunk for Q4_0 / Q8_0, at most Y chunks a lane a step), us:")
    cfgs = a.configs.split(",")
    print(f"  {'kernel':18s} " + " ".join(f"{c:>7s}" for c in cfgs))
    for name, shape, nbytes, launch, check in cases:
        line = []
        for cfg in cfgs:
            set_config(cfg)
            err = check(False)
            if err >= TOL:
                bad += 1
                line.append("FAILED")
                continue
            line.append(f"{device_us(lambda i, s: launch(i, s, False), a.reps):7.2f}")
        print(f"  {name:18s} " + " ".join(f"{v:>7s}" for v in line), flush=True)
    set_config(default)
    print("\nALL OK" if not bad else f"\n{bad} CHECKS FAILED")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
