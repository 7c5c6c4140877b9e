"""How fast one expert tensor's bytes reach the GPU, by each way nbmoe could upload them.

    python tools/cuda_upload_check.py [--mb 113] [--reps 20]

A hybrid prompt batch at ubatch 2048 uploads every RAM-resident expert tensor whole (Qwen3-30B:
144 tensors of 113 MB a batch), so its speed is this copy's. Cases, each timed with events
over --reps back-to-back uploads into one device buffer:
  pinned     one cudaMemcpyAsync from cuda.pinned_array memory
  registered the same from an anonymous mapping page-locked in place (cuMemHostRegister),
             as nbmoe locks the GGUF file's mapping
  split N    the registered buffer cut into N pieces, each on its own stream (copy engines
             in parallel)
  kernel     an SM copy kernel reading the registered pages through their device mapping
Prints GB/s (10^9 bytes) for each.
"""
import argparse
import mmap

import numpy as np

if not hasattr(np, "row_stack"):      # numba-cuda 0.30 with numpy >= 2.5
    np.row_stack = np.vstack

from numba import cuda  # noqa: E402

from nbmoe.cuda import host_memory  # noqa: E402


@cuda.jit
def copy_words(dst, src):
    """dst[i] = src[i] over 8-byte words, grid-strided: every load crosses PCIe."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < dst.size:
        dst[i] = src[i]
        i += stride


def timed(label, nbytes, reps, upload, stream):
    upload()                                        # warm
    cuda.synchronize()
    t0, t1 = cuda.event(), cuda.event()
    t0.record(stream)
    for _ in range(reps):
        upload()
    t1.record(stream)
    t1.synchronize()
    cuda.synchronize()
    ms = cuda.event_elapsed_time(t0, t1)
    print(f"{label:<22} {nbytes * reps / ms / 1e6:7.1f} GB/s   {ms / reps:7.3f} ms a copy", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=113)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    n = a.mb << 20
    stream = cuda.stream()
    dev = cuda.device_array(n, np.uint8)

    pinned = cuda.pinned_array(n, np.uint8)
    pinned[:] = 1
    timed("pinned", n, a.reps, lambda: dev.copy_to_device(pinned, stream=stream), stream)

    m = mmap.mmap(-1, n)
    reg = np.frombuffer(m, np.uint8)
    reg[:] = 1                                      # pages present before they are locked
    host_memory.register_span([reg])
    timed("registered", n, a.reps, lambda: dev.copy_to_device(reg, stream=stream), stream)

    for parts in (2, 4):
        streams = [cuda.stream() for _ in range(parts)]
        cut = np.linspace(0, n, parts + 1).astype(np.int64) // 4096 * 4096
        cut[-1] = n
        start, ends = cuda.event(), [cuda.event() for _ in range(parts)]

        def split():
            start.record(stream)
            for s, lo, hi, e in zip(streams, cut[:-1], cut[1:], ends):
                start.wait(s)
                dev[lo:hi].copy_to_device(reg[lo:hi], stream=s)
                e.record(s)
            for e in ends:
                e.wait(stream)
        timed(f"registered, split {parts}", n, a.reps, split, stream)

    for chunk_mb in (4, 16):
        c = chunk_mb << 20

        def chunked():
            for lo in range(0, n, c):
                dev[lo:lo + c].copy_to_device(reg[lo:lo + c], stream=stream)
        timed(f"registered, {chunk_mb} MB pieces", n, a.reps, chunked, stream)

    src = host_memory.device_view(reg.view(np.uint64))
    dst = dev.view(np.uint64)
    for blocks in (132, 264, 1056):
        timed(f"kernel, {blocks} blocks", n, a.reps,
              lambda: copy_words[blocks, 512, stream](dst, src), stream)


if __name__ == "__main__":
    main()
