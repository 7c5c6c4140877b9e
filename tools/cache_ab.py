"""Matrix-vector from memory through the engine's dispatcher (quants_int8.dot_rows_i8) vs the
per-type kernel called directly, 4096x4096, alternated in one process (medians of R rounds):

    NBMOE_CACHE=/tmp/empty python tools/cache_ab.py 6 Q4_K,Q6_K,MXFP4,Q8_0   # compiles: equal
    NBMOE_CACHE=/tmp/empty python tools/cache_ab.py 6 Q4_K,Q6_K,MXFP4,Q8_0   # from the cache

Session 15 found Q4_K 7-12% slower through dot_rows_i8 once the kernels come from Numba's disk
cache (same machine code, same results, equal speed with the weights in cache), and equal when
everything compiled in the same process; the other types equal or within 3%. Unexplained: this
tool reproduces it for whoever takes it up.
"""
import sys, time, os, numpy as np, numba
from numba import njit, prange
sys.path.insert(0, "tools")
import nbmoe
from bench_kernels import weights, copies
from nbmoe.cpu import matmul, quants_k_i8 as qk, quants_iq4 as q4, quants_int8 as qi
from nbmoe.cpu.membw import _sum_chunks
from gguf import GGMLQuantizationType as T
numba.set_num_threads(int(os.environ.get("NT", 2)))
rng = np.random.default_rng(0)

@njit(parallel=True, error_model="numpy")
def via_i8(out, w, xq, xd, xs, xb, xds, step, qt):
    M = w.shape[0]; per = (M + step - 1) // step
    for i in prange(per):
        r0, r1 = i * step, min(M, (i + 1) * step)
        qi.dot_rows_i8(qt, out[r0:r1], w[r0:r1], xq, xd, xs, xb, xds)

@njit(parallel=True, error_model="numpy")
def via_q4k(out, w, xq, xd, xs, xb, xds, step, qt):
    M = w.shape[0]; per = (M + step - 1) // step
    for i in prange(per):
        r0, r1 = i * step, min(M, (i + 1) * step)
        qk.dot_rows_q4_k_i8(out[r0:r1], w[r0:r1], xb[:xq.shape[0] // 4].view(np.int8), xd, xs)

@njit(parallel=True, error_model="numpy")
def via_q6k(out, w, xq, xd, xs, xb, xds, step, qt):
    M = w.shape[0]; per = (M + step - 1) // step
    for i in prange(per):
        r0, r1 = i * step, min(M, (i + 1) * step)
        qk.dot_rows_q6_k_i8(out[r0:r1], w[r0:r1], xq, xd, qk.sums16(xq, xd))

@njit(parallel=True, error_model="numpy")
def via_mx(out, w, xq, xd, xs, xb, xds, step, qt):
    M = w.shape[0]; per = (M + step - 1) // step
    for i in prange(per):
        r0, r1 = i * step, min(M, (i + 1) * step)
        q4.dot_rows_mxfp4_i8(out[r0:r1], w[r0:r1], xq, xd, xs, xb)

@njit(parallel=True, error_model="numpy")
def via_q8(out, w, xq, xd, xs, xb, xds, step, qt):
    M = w.shape[0]; per = (M + step - 1) // step
    for i in prange(per):
        r0, r1 = i * step, min(M, (i + 1) * step)
        qi.dot_rows_q8_0(out[r0:r1], w[r0:r1], xq, xd, xb, xds)

DIRECT = {"Q4_K": via_q4k, "Q6_K": via_q6k, "MXFP4": via_mx, "Q8_0": via_q8}
cases = []
for name in sys.argv[2].split(","):
    qt = int(T[name])
    w0 = weights(rng, qt, 4096, 4096); ws = copies(w0, 1200)
    x = rng.standard_normal((1, 4096), dtype=np.float32); out = np.empty(4096, np.float32)
    _, xi = matmul._prepare_x(x, True, qt); xi = tuple(a[0] for a in xi)
    step = matmul.item_rows(4096, w0.shape[1], 1, qt)
    def f(v, ws=ws, xi=xi, out=out, step=step, qt=qt, name=name, n=w0.nbytes):
        fn = via_i8 if v == "i8" else DIRECT[name]
        t0 = time.perf_counter()
        for w in ws: fn(out, w, *xi, step, qt)
        return n * len(ws) / (time.perf_counter() - t0) / 1e9
    cases.append((name, f))
for _, f in cases: f("i8"); f("direct")
RB = np.ones(1 << 28, np.float32); _sum_chunks(RB, 256)
R = int(sys.argv[1]); res = {}; bws = []
for r in range(R):
    best = 1e9
    for _ in range(3):
        t0 = time.perf_counter(); _sum_chunks(RB, 256); best = min(best, time.perf_counter() - t0)
    bws.append(RB.nbytes / best / 1e9)
    for name, f in cases:
        for v in (("i8", "direct") if r % 2 else ("direct", "i8")):
            res.setdefault((name, v), []).append(f(v))
bw = float(np.median(bws))
print("read median %.1f" % bw)
for name, _ in cases:
    a, b = np.median(res[(name, "i8")]), np.median(res[(name, "direct")])
    print(f"{name:6s} dot_rows_i8 {a:4.1f} ({a / bw:.0%})  direct {b:4.1f} ({b / bw:.0%})")
