"""Compile the int8 tensor-core kernels (nbmoe/cuda/matmul_mma.py), or with --flash the f16 flash
attention kernel (nbmoe/cuda/flash.py, per KV cache type: --kv), or with --mmv the int8 decode matrix-vector kernels
(matmul.py, fused.py, on mmv_q8.row_dot_fn), to PTX for sm_90 on a machine without a GPU, and
assemble them with ptxas: catches typing and inline-asm errors, and prints registers, spills and
shared memory per kernel.

Needs libnvvm, nvrtc and ptxas, e.g. from the pip wheels (a development aid only, not a
dependency of nbmoe):
    pip install --target /tmp/nvtools nvidia-cuda-nvcc-cu12 nvidia-cuda-nvrtc-cu12
    LD_LIBRARY_PATH=/tmp/nvtools/nvidia/cuda_nvrtc/lib:/tmp/nvtools/nvidia/cuda_nvcc/nvvm/lib64 \
    PYTHONPATH=$PWD:/tmp/nvtools python tools/cuda_ptx_check.py --ptxas /tmp/nvtools/nvidia/cuda_nvcc/bin/ptxas
--loops lists each loop's PTX instructions (the fill's unit loop, the K loop, the mma loop): a
count of what an iteration issues, and of its 64-bit integer operations (Numba types int32
arithmetic as int64; each such PTX operation is two machine instructions).
With --keep DIR --cuobjdump BIN (BIN from the nvidia-cuda-cuobjdump wheel: unzip it and
chmod +x its bin/cuobjdump) each kernel's machine code goes to DIR/*.sass too.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

import nbmoe.cuda  # noqa: F401  (numpy shim before numba.cuda)
from numba import cuda, types
from numba.cuda import dispatcher


class _Device:
    compute_capability = (9, 0)


# Device functions compile for the current device's CC, which needs a driver: pretend sm_90.
dispatcher.get_current_device = lambda: _Device()

from gguf import GGMLQuantizationType as Q  # noqa: E402

from nbmoe.cuda import matmul_mma as mm  # noqa: E402

SIG = (types.float32[:, ::1], types.uint8[:, ::1], types.int32[::1], types.float32[::1], types.int64,
       types.int64, types.int64, types.int64, types.int32[::1], types.int32[::1], types.int64, types.int64, types.int64,
       types.float32[::1])                                                       # (the bias)
SIG_ID = (types.float32[:, :, ::1],) + SIG[1:]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default="Q4_0,Q8_0,Q4_K,Q6_K,IQ4_XS,MXFP4")
    ap.add_argument("--ptxas", default="ptxas")
    ap.add_argument("--keep", default="", help="directory to keep the .ptx files in")
    ap.add_argument("--cuobjdump", default="", help="cuobjdump binary: also write each kernel's "
                    "machine code (SASS) beside its .ptx in --keep, e.g. to see the order of its loads")
    ap.add_argument("--tile", default="", help="TMxTTxWMxWTxKBxMIN_BLOCKS instead of the default")
    ap.add_argument("--loops", action="store_true", help="each loop's PTX instructions (its body, run "
                    "once an iteration): all, 64-bit integer ones (two machine instructions each), mma")
    ap.add_argument("--glu", action="store_true", help="the expert tiles that apply the GLU of a "
                    "merged gate_up (-muge) too")
    ap.add_argument("--flash", default="", help="flash attention instead: head dims, e.g. 64,128 (Hkv = 4)")
    ap.add_argument("--kv", default="f16/f16,q8_0/q8_0,bf16/bf16",
                    help="with --flash: the KV cache's key/value types, comma-separated")
    ap.add_argument("--mmv", action="store_true", help="the int8 decode matrix-vector kernels instead "
                    "(--types; the decode model's shapes: K = 2048, 768, 4096)")
    a = ap.parse_args()
    if a.mmv:
        sys.exit(check_mmv(a))
    if a.flash:
        sys.exit(check_flash(a))
    if a.tile:
        mm.TM, mm.TT, mm.WM, mm.WT, mm.KB, mm.MIN_BLOCKS = (int(v) for v in a.tile.split("x"))
        mm.ID_TILES = ((0, (mm.TM, mm.TT, mm.WM, mm.WT, mm.MIN_BLOCKS)),)
    bad = 0
    tiles = [(False, None, (mm.TM, mm.TT, mm.WM, mm.WT, mm.MIN_BLOCKS))] + [
        (True, glu, t) for _, t in mm.ID_TILES for glu in ((None, 2) if a.glu else (None,))]
    for name in a.types.split(","):
        for gather, glu, (tm, tt, wm, wt, mb) in tiles:
            wm = mm.glu_warps_along_rows(tm, wm) if glu is not None else wm
            kern, nth = mm._mma_kernel(int(Q[name]), tm, tt, wm, wt, mm.KB, gather, min_blocks=mb, glu=glu)
            w = types.uint8[:, :, ::1] if gather else types.uint8[:, ::1]
            sig = (SIG_ID[0] if gather else SIG[0], w) + SIG[2:]
            ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0), launch_bounds=kern.targetoptions.get("launch_bounds"))
            path = os.path.join(a.keep or tempfile.mkdtemp(), f"mma_{name}_{'id' if gather else 'plain'}{'' if glu is None else '_glu'}_{tm}x{tt}.ptx")
            ok, info = assemble(ptx, path, a.ptxas, a.cuobjdump)
            print(f"{name:6s} {'id+glu' if glu is not None else 'id    ' if gather else 'plain '} {tm}x{tt} {nth} threads, {ptx.count('mma.sync')} mma in PTX: "
                  f"{'OK' if ok else 'FAILED'} {info}", flush=True)
            if a.loops:
                for first, last, n, n64, mma, ldg in ptx_loops(ptx):
                    print(f"    loop of PTX lines {first}-{last}: {n} instructions, {n64} 64-bit integer, "
                          f"{mma} mma, {ldg} global loads")
            bad += not ok
    sys.exit(1 if bad else 0)


def ptx_loops(ptx):
    """(first, last, instructions, 64-bit integer ones, mma, global loads) of each loop of a
    kernel's PTX (a branch back to a label), first and last as instruction numbers."""
    body, labels = [], {}
    for line in (s.strip() for s in ptx.splitlines()):
        if not line or line.startswith(("//", ".", "{", "}")):
            continue
        if line.endswith(":"):
            labels[line[:-1]] = len(body)
        else:       # (the opcode, after a predicate if any; the line)
            body.append((line.split()[1] if line.startswith("@") else line.split()[0], line))
    loops = sorted({(labels[m.group(1)], k) for k, (_, line) in enumerate(body)
                    for m in [re.search(r"bra(?:\.uni)?\s+(\S+);", line)] if m and labels.get(m.group(1), k + 1) <= k})
    out = []
    for first, last in loops:
        ops = [op for op, _ in body[first:last + 1]]
        n64 = sum(bool(re.search(r"\.[sub]64$", op)) and not op.startswith(("ld", "st", "mov", "cvta")) for op in ops)
        out.append((first, last, len(ops), n64, sum(op.startswith("mma") for op in ops),
                    sum(op.startswith("ld.global") for op in ops)))
    return out


def assemble(ptx, path, ptxas, cuobjdump=""):
    """(ok, 'Used .. registers ..') of ptxas -arch=sm_90 on ptx, written to path (and with
    cuobjdump, the machine code beside it: path.sass)."""
    # ptxas may be older than the NVVM that wrote the PTX: mma.sync needs only PTX 7.0
    ptx = re.sub(r"^\.version \d+\.\d+", ".version 7.8", ptx, flags=re.M)
    with open(path, "w") as f:
        f.write(ptx)
    r = subprocess.run([ptxas, "-arch=sm_90", "-v", path, "-o", path + ".cubin"], capture_output=True, text=True)
    out = r.stderr + r.stdout
    info = " ".join(re.findall(r"Used \d+ registers|\d+ bytes spill \w+|\d+ bytes smem", out))
    if r.returncode:
        print(r.stderr[-2000:])
    elif cuobjdump:
        with open(path + ".sass", "w") as f:
            subprocess.run([cuobjdump, "-sass", path + ".cubin"], stdout=f, stderr=subprocess.DEVNULL)
    return r.returncode == 0, info


def check_flash(a):
    from nbmoe.cuda import flash
    f32 = types.float32[:, :, ::1]
    cache = {"f16": types.uint16[:, :, ::1], "bf16": types.int16[:, :, ::1], "q8_0": types.uint8[:, :, ::1]}
    bad = 0
    for Dh in (int(v) for v in a.flash.split(",")):
        for kt, vt in (tuple(p.split("/")) for p in a.kv.split(",")):
            kern, nth, _ = flash._flash_kernel(Dh, 4, kt, vt, flash.WARPS, flash.KEYS, flash.MIN_BLOCKS)
            sig = (f32, f32, cache[kt], cache[vt], types.int32[::1], types.float32, types.int64,
                   types.float32[::1])
            ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0),
                                      launch_bounds=kern.targetoptions.get("launch_bounds"))
            ok, info = assemble(ptx, os.path.join(a.keep or tempfile.mkdtemp(), f"flash_{Dh}_{kt}_{vt}.ptx"),
                                a.ptxas, a.cuobjdump)
            print(f"flash Dh={Dh} {kt}/{vt} {nth} threads, {ptx.count('mma.sync')} mma, "
                  f"{ptx.count('ld.local')} ld.local in PTX: {'OK' if ok else 'FAILED'} {info}", flush=True)
            bad += not ok
    return 1 if bad else 0


def mmv_kernels(qt):
    """(name, kernel, signature) of every int8 decode matrix-vector kernel of type qt, built for the
    decode model's sizes (a qwen3moe of hidden 2048: q/k/v and gate/up K = 2048, expert down
    K = 768, attention output K = 4096 with split-K 4, and T = 2 with 2 tokens a weight load)."""
    from nbmoe.cuda import fused, matmul
    from nbmoe.cuda.mmv_q8 import chunks_in_flight as V
    f2, f3, u2, u3 = types.float32[:, ::1], types.float32[:, :, ::1], types.uint8[:, ::1], types.uint8[:, :, ::1]
    i1, f1, i2, n = types.int32[::1], types.float32[::1], types.int32[:, ::1], types.int64
    return [
        ("mul_mat_vec_q8 K=4096 S=4", matmul._mmv_q8_kernel(qt, 1, 4, V(qt, 4096, 4)), (f2, u2, i1, f1, f1, n, n)),
        ("mul_mat_vec_q8 K=2048 NT=2", matmul._mmv_q8_kernel(qt, 2, 1, V(qt, 2048)), (f2, u2, i1, f1, f1, n, n)),
        ("mul_mat_vec_id_q8 K=2048", matmul._mmv_id_q8_kernel(qt, V(qt, 2048)), (f3, u3, i1, f1, i2, n, n, n)),
        ("products_q8 K=2048", fused._products_kernel(qt, V(qt, 2048)), (f2, f2, f2, u2, u2, u2, f1, f1, f1, i1, f1) + (n,) * 5),
        ("glu_q8 K=2048", fused._glu_kernel(qt, False, V(qt, 2048)), (f2, u2, u2, i1, f1, n, n, n)),
        ("glu_id_q8 K=2048", fused._glu_kernel(qt, True, V(qt, 2048)), (f3, u3, u3, i1, f1, i2, n, n, n, n, n, f1, f1)),
        ("down_combine_q8 K=768", fused._down_combine_kernel(qt, V(qt, 768), False), (f2, u3, i1, f1, i2, f2, n, n, f1)),
    ]


def check_mmv(a):
    from nbmoe.cuda.mmv_q8 import chunk_units, chunks_in_flight
    bad = 0
    d = a.keep or tempfile.mkdtemp()
    for name in a.types.split(","):
        qt = int(Q[name])
        print(f"{name}: chunk = {chunk_units(qt)} units, V = {chunks_in_flight(qt, 2048)} at K = 2048, "
              f"{chunks_in_flight(qt, 768)} at K = 768", flush=True)
        for label, kern, sig in mmv_kernels(qt):
            ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0))
            ok, info = assemble(ptx, os.path.join(d, re.sub(r"\W+", "_", label) + f"_{name}.ptx"), a.ptxas,
                                a.cuobjdump)
            n_ld = len(re.findall(r"^\s*ld\.global", ptx, flags=re.M))
            print(f"  {label:28s} {n_ld:3d} ld.global in PTX: {'OK' if ok else 'FAILED'} {info}", flush=True)
            bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    main()
