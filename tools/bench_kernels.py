"""Kernel benchmark: matrix-vector GB/s per weight type against the streaming read bandwidth
measured in the same run, the expert product of one token, and batched GFLOP/s at T=512
(dequantize + BLAS, and with AVX-512 VNNI the integer product gemm_i8: "int8 VNNI").

    python tools/bench_kernels.py -t 2                       # every CPU type, rich table
    python tools/bench_kernels.py -t 2 --types Q4_K,Q8_0 -o json
    python tools/bench_kernels.py -t 2 --types Q4_0,Q8_0 --rtr    # + the repacked layout (-rtr)

Every case is checked against gguf-py's dequantization + a float64 product before it is
timed. T=1 calls walk through weight copies larger than the L3, so every call reads its
weights from memory (the min over single calls would pick calls whose copies were still in
the L3 from being written). Ratio = weight bytes per second / streaming read. On a shared
machine both swing: the walk is the best of --reps, the streaming read the best of one
measurement before each type; --rounds N repeats the pass over the types, keeping each case's
best (--reps 3 --rounds 3 for comparisons: the 2-core VM has spells of seconds at half speed).
"""
import argparse
import json
import time

import numba
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from rich.console import Console
from rich.table import Table

import nbmoe  # noqa: F401  (Numba settings before the kernels compile)
from nbmoe import load_order
from nbmoe.cpu import gemm_i8, matmul
from nbmoe.cpu.membw import read_bandwidth
from nbmoe.cpu.quants import TYPES
from nbmoe.cpu.quants_int8 import HAS_VNNI, INT8_TYPES
from nbmoe.cpu.quants_rtr import R16, repack_tensor

ALL_TYPES = ("F32,F16,BF16,Q8_0,Q4_0,Q4_1,Q5_0,Q5_1,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,IQ4_NL,IQ4_XS,"
             "MXFP4,IQ2_XXS,IQ2_XS,IQ2_S,IQ3_XXS,IQ3_S,IQ1_S,IQ1_M")


def best_time(fn, n):
    best = float("inf")
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        best = min(best, time.perf_counter() - t0)
    return best


REPS = 2  # walks per case (--reps)


def walk_time(fn, n, reps=None):
    """Seconds per call of fn(0..n-1) (each on other weight copies): best of `reps` walks."""
    for i in range(n):
        fn(i)
    best = float("inf")
    for _ in range(reps or REPS):
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def weights(rng, qtype, M, K):
    """Quantized random weights; random bytes below 64 (finite f16 scales) for the types gguf-py
    cannot quantize. Read-only, as the mmap'd GGUF views are."""
    from gguf.quants import quantize
    try:
        w = quantize(rng.standard_normal((M, K), dtype=np.float32), qtype).view(np.uint8)
    except NotImplementedError:
        w = rng.integers(0, 64, (M, matmul.row_size(qtype, K)), dtype=np.uint8)
    w = np.ascontiguousarray(w)
    w.flags.writeable = False
    return w


def check(out, w, x, qtype, bound):
    """Max relative error of out against gguf-py dequantization + float64; raise past bound."""
    ref = x.astype(np.float64) @ gguf_dequantize(w, qtype).astype(np.float64).T
    err = float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))
    if not err <= bound:
        raise SystemExit(f"error: {GGMLQuantizationType(qtype).name} {w.shape}: relative error {err:.2e} > {bound}")
    return err


def copies(w, copy_mb):
    out = [w] + [w.copy() for _ in range(int(copy_mb * 1e6 // w.nbytes))]
    for c in out:
        c.flags.writeable = False
    return out


def variants(qt, ws, rtr):
    """(path label, int8, qtype, weight copies): the int8 / float paths, and with --rtr the
    repacked layout (quants_rtr) of the same copies."""
    out = [("int8", True, qt, ws)] if HAS_VNNI and qt in INT8_TYPES else []
    if rtr and qt in R16:
        out.append(("int8 rtr", True, R16[qt], copies_of([repack_tensor(w, qt)[0] for w in ws])))
    return out + [("float", False, qt, ws)]


def copies_of(ws):
    for w in ws:
        w.flags.writeable = False
    return ws


def bench_type(name, a, bw, rng):
    qt = int(GGMLQuantizationType[name])
    rows = []
    for shape in filter(None, a.shapes.split(",")):
        M, K = (int(v) for v in shape.split("x"))
        if K % TYPES[qt][0]:
            continue  # rows of 576 do not hold 256-value super-blocks
        w0 = weights(rng, qt, M, K)
        x, out = rng.standard_normal((1, K), dtype=np.float32), np.empty((1, M), np.float32)
        for path, int8, q, ws in variants(qt, copies(w0, a.copy_mb), a.rtr):
            step = matmul.item_rows(M, w0.shape[1], 1, q)
            matmul.mat_vec(out, ws[0], x, q, int8, step)
            err = check(out, w0, x, qt, 1.5e-2 if int8 else 1e-4)
            t = walk_time(lambda i: matmul.mat_vec(out, ws[i], x, q, int8, step), len(ws))  # as mul_mat_step
            gbs = ws[0].nbytes / t / 1e9
            rows.append(dict(type=name, test=f"mat-vec {M}x{K}", path=path,
                             ms=t * 1e3, gbs=gbs, ratio=gbs / bw, gflops=2 * M * K / t / 1e9, rel_err=err))
    for shape in filter(None, a.moe.split(",")):   # one token through 8 experts; calls walk through all E
        E, M, K = (int(v) for v in shape.split("x"))
        if K % TYPES[qt][0]:
            continue
        w1 = weights(rng, qt, M, K)
        wsp = copies(np.ascontiguousarray(np.broadcast_to(w1, (E,) + w1.shape)), a.copy_mb)
        x, out = rng.standard_normal((1, 8, K), dtype=np.float32), np.empty((1, 8, M), np.float32)
        ids = [np.arange(8 * i, 8 * i + 8, dtype=np.int32).reshape(1, 8) % E for i in range(E // 8)]
        for path, int8, q, ws in variants(qt, wsp, a.rtr):
            step = matmul.expert_item_rows(M, w1.shape[1], 1, q)
            nw = numba.get_num_threads()
            matmul._mul_mat_id_vec(out, ws[0], x, ids[0], q, 9, int8, step, ws[0], 0, matmul.ACT_NONE,
                                   matmul.EMPTY, matmul.EMPTY, nw)
            err = check(out[0, 0:1], w1, x[0, 0:1], qt, 1.5e-2 if int8 else 1e-4)
            t = walk_time(lambda i: matmul._mul_mat_id_vec(
                out, ws[i // len(ids) % len(ws)], x, ids[i % len(ids)], q, 9, int8, step,
                ws[0], 0, matmul.ACT_NONE, matmul.EMPTY, matmul.EMPTY, nw), len(ids) * len(ws))
            gbs = 8 * w1.nbytes / t / 1e9
            rows.append(dict(type=name, test=f"experts {E}x{M}x{K} A=8", path=path,
                             ms=t * 1e3, gbs=gbs, ratio=gbs / bw, gflops=16 * M * K / t / 1e9, rel_err=err))
    for shape in filter(None, a.gemm.split(",")):
        M, K = (int(v) for v in shape.split("x"))
        if K % TYPES[qt][0]:
            continue
        w0 = weights(rng, qt, M, K)
        x, out = rng.standard_normal((512, K), dtype=np.float32), np.empty((512, M), np.float32)
        cases = [("dequant+BLAS", qt, w0)] + ([("dequant+BLAS rtr", R16[qt], repack_tensor(w0, qt)[0])]
                                               if a.rtr and qt in R16 else [])
        for path, q, w in cases + [(label.replace("dequant+BLAS", "int8 VNNI"), q, w)
                                   for label, q, w in cases if matmul.batched_int8(q)]:
            run = matmul._mul_mat_blas if path.startswith("dequant") else gemm_i8.mul_mat
            run(out, w, x, q)
            err = check(out, w0, x, qt, 1e-4 if path.startswith("dequant") else 1.5e-2)
            t = best_time(lambda i: run(out, w, x, q), 5)
            rows.append(dict(type=name, test=f"batch 512 x {M}x{K}", path=path, ms=t * 1e3,
                             gbs=None, ratio=None, gflops=2 * 512 * M * K / t / 1e9, rel_err=err))
    return rows


def main(argv=None):
    global REPS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-t", "--threads", type=int, default=numba.config.NUMBA_NUM_THREADS, help="Numba threads")
    p.add_argument("--types", default=ALL_TYPES, help="comma-separated GGUF types")
    p.add_argument("--shapes", default="4096x4096,2048x768", help="MxK list, matrix-vector")
    p.add_argument("--moe", default="128x2048x768", help="ExMxK list, one token's 8 experts")
    p.add_argument("--gemm", default="4096x4096", help="MxK list, T=512 batched product")
    p.add_argument("--copy-mb", type=float, default=400, help="MB of weight copies walked through")
    p.add_argument("--reps", type=int, default=2, help="walks per case (the best is kept)")
    p.add_argument("--rounds", type=int, default=1,
                   help="passes over all the types, each case keeping its best: a slow spell of a shared "
                        "machine then spoils one pass of a type, not all its walks")
    p.add_argument("--rtr", action="store_true", help="also the repacked layout (-rtr) of the types that have one")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    a = p.parse_args(argv)
    REPS = a.reps
    numba.set_num_threads(a.threads)
    load_order.preload()     # the kernels' own code, as in the run that compiled them
    rng = np.random.default_rng(0)
    best, bws = {}, []
    console = Console(stderr=True)
    for r in range(a.rounds):
        for name in a.types.split(","):
            with console.status(f"{name}" + (f" (round {r + 1} of {a.rounds})" if a.rounds > 1 else "")):
                bws.append(read_bandwidth())
                for row in bench_type(name.strip(), a, bws[-1], rng):
                    key = (row["type"], row["test"], row["path"])
                    if key not in best or row["ms"] < best[key]["ms"]:
                        best[key] = row
    rows, bw = list(best.values()), max(bws)
    for r in rows:
        r["ratio"] = None if r["gbs"] is None else r["gbs"] / bw
    if a.output == "json":
        print(json.dumps(dict(threads=a.threads, read_bw_gbs=bw, rows=rows), indent=2))
        return
    t = Table(title=f"CPU kernels, {a.threads} threads, streaming read {bw:.1f} GB/s", title_justify="left")
    for col in ("type", "test", "path", "ms", "GB/s", "of read bw", "GFLOP/s", "rel err"):
        t.add_column(col, justify="left" if col in ("type", "test", "path") else "right")
    for r in rows:
        t.add_row(r["type"], r["test"], r["path"], f"{r['ms']:.3f}",
                  "" if r["gbs"] is None else f"{r['gbs']:.1f}",
                  "" if r["ratio"] is None else f"{r['ratio']:.0%}", f"{r['gflops']:.1f}", f"{r['rel_err']:.1e}")
    Console(width=max(Console().width, 120)).print(t)


if __name__ == "__main__":
    main()
