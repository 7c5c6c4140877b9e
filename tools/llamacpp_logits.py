"""llama.cpp's teacher-forced logits for a GGUF, through our small C++ program
(tools/llamacpp/logits.cpp) built against a llama.cpp build with shared libraries.

    python tools/llamacpp_logits.py model.gguf --tokens 1,2,3 -o logits.npy
    python tools/llamacpp_logits.py model.gguf --random 24 --compare      # vs reference.py

The llama.cpp tree (--llama-cpp, else $LLAMA_CPP_DIR, else the one tools/llamacpp_bench.sh
builds) must hold include/, ggml/include/ and build/bin/libllama.so (cmake with
-DBUILD_SHARED_LIBS=ON, the default).
"""
import argparse
import hashlib
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "llamacpp", "logits.cpp")
WORK = os.path.expanduser("~/.cache/nbmoe/llamacpp")
DEFAULT_TREE = os.path.join(WORK, "llama_cpp_python-0.3.36", "vendor", "llama.cpp")


def llama_cpp_dir(path=None):
    tree = os.path.abspath(path or os.environ.get("LLAMA_CPP_DIR") or DEFAULT_TREE)
    lib = os.path.join(tree, "build", "bin", "libllama.so")
    if not os.path.exists(os.path.join(tree, "include", "llama.h")) or not os.path.exists(lib):
        sys.exit(f"llamacpp_logits: {tree} has no include/llama.h and build/bin/libllama.so "
                 "(give --llama-cpp or LLAMA_CPP_DIR)")
    return tree


def build(tree):
    """Compile logits.cpp against `tree` once (keyed by the source and the library); the path."""
    lib_dir = os.path.join(tree, "build", "bin")
    key = hashlib.sha256(open(SOURCE, "rb").read() + tree.encode()
                         + str(os.path.getmtime(os.path.join(lib_dir, "libllama.so"))).encode())
    exe = os.path.join(WORK, f"nbmoe-logits-{key.hexdigest()[:12]}")
    if not os.path.exists(exe):
        os.makedirs(WORK, exist_ok=True)
        cmd = ["g++", "-O2", "-std=c++17", SOURCE, "-I", os.path.join(tree, "include"),
               "-I", os.path.join(tree, "ggml", "include"), "-L", lib_dir, "-lllama",
               f"-Wl,-rpath,{lib_dir}", "-o", exe + ".tmp"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"llamacpp_logits: g++ failed:\n{r.stderr}")
        os.replace(exe + ".tmp", exe)
    return exe


def logits(model, tokens, tree=None, threads=2, mode="batch", flash_attn=False):
    """float32 [T, n_vocab]: llama.cpp's logits after each of `tokens` (from position 0)."""
    exe = build(llama_cpp_dir(tree))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "logits.bin")
        r = subprocess.run([exe, os.fspath(model), out, str(threads), mode, str(int(flash_attn)),
                            *map(str, tokens)], capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"llamacpp_logits: {r.stderr.strip()}")
        T, V = map(int, r.stdout.split())
        return np.fromfile(out, np.float32).reshape(T, V)


def compare(a, b):
    """(worst per-position cosine, top-1 agreement) of logits a and b [T, V]."""
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return float(cos.min()), float((a.argmax(1) == b.argmax(1)).mean())


def main(argv=None):
    ap = argparse.ArgumentParser(description="llama.cpp's teacher-forced logits of a GGUF.")
    ap.add_argument("model")
    ap.add_argument("--tokens", help="comma-separated token ids")
    ap.add_argument("--random", type=int, metavar="N", help="N random token ids instead")
    ap.add_argument("--seed", type=int, default=0, help="seed of --random (default 0)")
    ap.add_argument("--llama-cpp", help="llama.cpp tree with build/bin/libllama.so")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", choices=("batch", "seq"), default="batch",
                    help="all tokens in one decode call, or one per call")
    ap.add_argument("--flash-attn", action="store_true")
    ap.add_argument("--compare", action="store_true",
                    help="print cosine and top-1 agreement with nbmoe's float64 reference")
    ap.add_argument("-o", "--output", help="write the logits here (.npy)")
    args = ap.parse_args(argv)
    if args.tokens:
        tokens = [int(t) for t in args.tokens.split(",")]
    elif args.random:
        sys.path.insert(0, os.path.dirname(HERE))
        from nbmoe.model import reference
        cfg, _ = reference.load(args.model)
        tokens = np.random.default_rng(args.seed).integers(0, cfg.n_vocab, args.random).tolist()
    else:
        ap.error("give --tokens or --random")
    got = logits(args.model, tokens, args.llama_cpp, args.threads, args.mode, args.flash_attn)
    print(f"{got.shape[0]} positions x {got.shape[1]} logits")
    if args.output:
        np.save(args.output, got)
    if args.compare:
        sys.path.insert(0, os.path.dirname(HERE))
        from nbmoe.model import reference
        cfg, tensors = reference.load(args.model)
        cos, top1 = compare(got.astype(np.float64), reference.forward(cfg, tensors, tokens))
        print(f"vs reference.py: worst cosine {cos:.6f}, top-1 agreement {top1:.1%}")


if __name__ == "__main__":
    main()
