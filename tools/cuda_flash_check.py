"""Check and time flash attention (nbmoe/cuda/flash.py, f16 tensor cores) on a GPU against the
warp-per-query kernel (attention.py with fa=False), one line per case:

    PYTHONUNBUFFERED=1 python tools/cuda_flash_check.py [--tiles 4x64x2,8x64x1] [-n 5] [-ctk q8_0 -ctv q8_0]

Cases (a Qwen3-30B-A3B layer: H=32 query heads, Hkv=4 kv heads, Dh=128): prompts of T=512 and
T=2048 tokens from position 0 (context = T), and T=512 after 1000 earlier positions. Random
q, k, v (the cache, of the -ctk / -ctv types, written by store_kv). Error: max |flash - warp kernel| / max |warp kernel|
(flash rounds q * scale and P to f16: ~1e-3). TFLOP/s = 4 T n H Dh / time (n: keys a query
sees on average, pos0 + (T + 1) / 2), time the median of CUDA-event-timed calls after a
warm-up. --tiles adds flash configurations WARPSxKEYS[xMIN_BLOCKS] (query rows 16 WARPS, keys
a step, blocks an SM by registers), a compile each. Exits 1 when a check fails.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nbmoe.cuda  # noqa: E402,F401  (defines np.row_stack before numba.cuda is imported)
from numba import cuda  # noqa: E402

from nbmoe.cuda import attention as att  # noqa: E402
from nbmoe.cuda import flash  # noqa: E402
from nbmoe.model.kv_cache import KV_TYPES, row_layout  # noqa: E402
from cuda_matmul_bench import time_ms  # noqa: E402

TOL = 5e-3


def rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def main():
    ap = argparse.ArgumentParser(description="flash attention vs the warp-per-query kernel")
    ap.add_argument("--tiles", default="", help="extra flash tiles WARPSxKEYS[xMIN_BLOCKS], comma-separated")
    ap.add_argument("-n", type=int, default=5, help="timed calls per case")
    ap.add_argument("--heads", default="32,4,128", help="H,Hkv,Dh")
    ap.add_argument("--cases", default="512:0,2048:0,512:1000", help="T:pos0, comma-separated")
    ap.add_argument("--window", type=int, default=0, help="sliding window (0: none)")
    ap.add_argument("-ctk", default="f16", choices=KV_TYPES, help="KV cache type of the keys")
    ap.add_argument("-ctv", default="f16", choices=KV_TYPES, help="KV cache type of the values")
    a = ap.parse_args()
    t_start = time.time()
    name = getattr(cuda.get_current_device(), "name", "CUDA simulator")
    keys = ("WARPS", "KEYS", "MIN_BLOCKS")
    default = tuple(getattr(flash, k) for k in keys)
    configs = [default] + [tuple(int(v) for v in c.split("x")) + default[len(c.split("x")):]
                           for c in a.tiles.split(",") if c]
    H, Hkv, Dh = (int(v) for v in a.heads.split(","))
    print(f"{name.decode() if isinstance(name, bytes) else name}: H={H} Hkv={Hkv} Dh={Dh} window={a.window} "
          f"cache {a.ctk}/{a.ctv}, "
          f"flash tile {'x'.join(map(str, default))} (WARPSxKEYSxMIN_BLOCKS)", flush=True)
    rng = np.random.default_rng(0)
    scale = 1.0 / np.sqrt(Dh)
    failed = 0
    for case in a.cases.split(","):
        T, pos0 = (int(v) for v in case.split(":"))
        C = pos0 + T
        kc, vc = (cuda.to_device(np.zeros((C,) + row, dt))
                  for row, dt in (row_layout(t, Hkv, Dh) for t in (a.ctk, a.ctv)))
        kv = lambda: cuda.to_device(rng.standard_normal((C, Hkv, Dh), dtype=np.float32))   # noqa: E731
        att.store_kv(kc, vc, kv(), kv(), 0)
        q = cuda.to_device(rng.standard_normal((T, H, Dh), dtype=np.float32) * 2)
        pos = cuda.to_device(np.arange(pos0, pos0 + T, dtype=np.int32))
        out = cuda.device_array((T, H, Dh), np.float32)
        n_avg = (min(a.window, pos0 + (T + 1) / 2) if a.window else pos0 + (T + 1) / 2)
        flops = 4 * T * n_avg * H * Dh
        run = lambda i, fa=True: att.attention(out, q, kc, vc, pos, scale, a.window, fa=fa)   # noqa: E731
        run(0, False)
        ref = out.copy_to_host()
        t_w = time_ms(lambda i: run(i, False), a.n)
        for cfg in configs:
            for k, v in zip(keys, cfg):
                setattr(flash, k, v)
            label = f"T={T:5d} pos0={pos0:5d} tile {'x'.join(map(str, cfg)):8s}"
            try:
                out.copy_to_device(np.full((T, H, Dh), np.nan, np.float32))
                run(0)
                got = out.copy_to_host()
                t_f = time_ms(run, a.n)
            except Exception as e:        # a configuration over the register / shared memory limits
                print(f"{label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                failed += cfg == default
                continue
            err = rel(got, ref)
            ok = err < TOL and not np.isnan(got).any()
            failed += not ok
            print(f"{label} err {err:.1e} {'ok' if ok else 'FAILED'}  warp kernel {flops / t_w / 1e9:6.1f} TFLOP/s "
                  f"{t_w:8.3f} ms  flash {flops / t_f / 1e9:6.1f} TFLOP/s {t_f:7.3f} ms  x{t_w / t_f:.1f}", flush=True)
        for k, v in zip(keys, default):
            setattr(flash, k, v)
    print(f"{'FAILED: ' + str(failed) + ' checks' if failed else 'all checks ok'} ({time.time() - t_start:.0f} s)",
          flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
