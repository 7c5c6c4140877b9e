"""llama.cpp's teacher-forced logits for a GGUF, through our small C++ program
(tools/llamacpp/logits.cpp) built against a llama.cpp build with shared libraries.

    python tools/llamacpp_logits.py model.gguf --tokens 1,2,3 -o logits.npy
    python tools/llamacpp_logits.py model.gguf --random 24 --compare      # vs reference.py
    python tools/llamacpp_logits.py --record tests/data/llamacpp_tiny      # the tests' numbers
    python tools/llamacpp_logits.py --record tests/data/llamacpp_deepseek

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


# Tiny random-weight models (tools/make_model.py arguments) whose llama.cpp logits the tests
# keep: gpt-oss with every part it has, in F32 and as the published files are typed (MXFP4
# experts, Q8_0 matrices), two controls (qwen3moe, a Mixtral-style llama), and glm4moe.
_OSS = dict(arch="gpt-oss", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=64,
            n_expert=8, n_expert_used=4, n_ff_exp=64, sliding_window=8, yarn=[32.0, 4096],
            rope_base=150000.0, tie_embeddings=False)
_GLM = dict(arch="glm4moe", n_layer=3, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128,
            n_expert=8, n_expert_used=4, n_ff_exp=64, n_shared=1, n_leading_dense=1, n_nextn=1,
            routed_scale=2.5, rope_base=1e6, tie_embeddings=False)
CASES = {
    "gpt-oss-f32": dict(_OSS, default_type="F32"),
    "gpt-oss-mxfp4": dict(_OSS, default_type="Q8_0", types=[["_exps", "MXFP4"]]),
    "qwen3moe-f32": dict(arch="qwen3moe", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32,
                         n_ff=128, n_expert=8, n_expert_used=2, n_ff_exp=64, default_type="F32"),
    "mixtral-f32": dict(arch="llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128,
                        n_expert=4, n_expert_used=2, default_type="F32"),
    # glm4moe as GLM-4.5-Air (a NextN block that llama.cpp skips too), with GLM-4.5's q/k norms,
    # and with Q4_K experts (down projections fall back to Q5_0) on 256-wide rows
    "glm4moe-f32": dict(_GLM, default_type="F32"),
    "glm4moe-qknorm-f32": dict(_GLM, qk_norm=True, default_type="F32"),
    "glm4moe-q4k": dict(_GLM, n_embd=256, default_type="Q8_0", types=[["_exps", "Q4_K"]]),
}
# deepseek2 (kept in llamacpp_deepseek.*): V2-Lite's shape (plain attn_q, softmax gating,
# 2 shared experts) and V3's (q through q_lora_rank, sigmoid gating with exp_probs_b, expert
# groups, routed scale, norm_topk), both with MLA, a leading dense layer and YaRN with the
# log multiplier, in F32 and Q8_0.
_MLA = dict(kv_lora_rank=64, rope_dim=16, nope_dim=32, v_dim=32, n_dense=1)
_LITE = dict(arch="deepseek2", n_layer=2, n_embd=64, n_head=4, n_head_kv=1, n_ff=128, n_expert=8,
             n_expert_used=2, n_ff_exp=32, yarn=[40.0, 4096], tie_embeddings=False,
             mla=dict(_MLA, q_lora_rank=0, n_shared=2, mscale_all_dim=0.707))
_V3 = dict(arch="deepseek2", n_layer=2, n_embd=64, n_head=4, n_head_kv=1, n_ff=128, n_expert=16,
           n_expert_used=4, n_ff_exp=32, yarn=[40.0, 4096], tie_embeddings=False,
           mla=dict(_MLA, q_lora_rank=32, n_shared=1, gating="sigmoid", n_group=4, topk_group=2,
                    routed_scale=2.5, norm_topk=True, mscale_all_dim=1.0))
DEEPSEEK_CASES = {
    "deepseek-v2-lite-f32": dict(_LITE, default_type="F32"),
    "deepseek-v2-lite-q8_0": dict(_LITE, default_type="Q8_0"),
    "deepseek-v3-f32": dict(_V3, default_type="F32"),
    "deepseek-v3-q8_0": dict(_V3, default_type="Q8_0"),
}
# deepseek2 (V3) and glm4moe in the weight types their files ship, on tests/test_family_types.py's
# shapes: rows of 256 wherever the real models' take the K-quants (kept in llamacpp_types.*)
_V3_WIDE = dict(_V3, n_embd=256, n_ff=256, n_ff_exp=256,
                mla=dict(_V3["mla"], kv_lora_rank=256, q_lora_rank=256, v_dim=64))
_GLM_WIDE = dict(_GLM, n_layer=2, n_embd=256, head_dim=64, n_ff=256, n_ff_exp=256)
SHIPPED_TYPES = ("Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "BF16")
TYPE_CASES = {f"{family}-{t.lower()}": dict(shape, default_type=t)
              for family, shape in (("deepseek-v3", _V3_WIDE), ("glm4moe", _GLM_WIDE))
              for t in SHIPPED_TYPES}
# --record PREFIX writes the cases of the file PREFIX names
CASE_SETS = {"llamacpp_tiny": CASES, "llamacpp_deepseek": DEEPSEEK_CASES, "llamacpp_types": TYPE_CASES}
N_TOKENS, TOKEN_SEED, MODEL_SEED = 24, 0, 0
# A router whose A-th and (A+1)-th best scores nearly tie flips on any rounding, moving a
# whole position: the recorded prompts keep every layer's gap above this.
MIN_ROUTER_GAP = 0.01


def router_gap(cfg, tensors, tokens):
    """Smallest gap, over layers and tokens, between the router scores of the last chosen
    expert and the best one left out, in the float64 reference; and its logits."""
    from nbmoe.model import reference
    gaps, route = [], reference.route

    def spy(logits, cfg, select_bias=None):
        # softmax and sigmoid keep the logits' order: measure the gap where rounding happens
        s = logits if select_bias is None else reference.scores(logits, cfg, select_bias)[1]
        if cfg.n_group > 1:   # the groups' scores choose first, then experts of the kept groups
            g = s.reshape(len(s), cfg.n_group, -1)
            score = np.sort(g, -1)[..., -2:].sum(-1)                     # [T, n_group]
            ranked = np.sort(score, -1)[:, ::-1]
            gaps.append((ranked[:, cfg.topk_group - 1] - ranked[:, cfg.topk_group]).min())
            keep = score >= ranked[:, cfg.topk_group - 1:cfg.topk_group]
            s = np.where(keep[..., None], g, -np.inf).reshape(len(s), -1)
        choose = np.sort(s, -1)[:, ::-1]
        gaps.append((choose[:, cfg.n_expert_used - 1] - choose[:, cfg.n_expert_used]).min())
        return route(logits, cfg, select_bias)
    reference.route = spy
    try:
        want = reference.forward(cfg, tensors, tokens)
    finally:
        reference.route = route
    return float(min(gaps)), want


def fingerprint(path):
    """sha256 of a GGUF's metadata values and tensors (names, types, shapes, bytes): equal
    files of make_model's give equal prints, whatever the writer's layout."""
    from nbmoe.loader.gguf_file import GGUFFile
    f, h = GGUFFile(path), hashlib.sha256()
    for key in sorted(f.meta):
        h.update(f"{key}={f.meta[key]!r};".encode())
    for name in sorted(f.tensors):
        t = f.tensors[name]
        h.update(f"{name}:{t.type_name}:{tuple(t.ne)};".encode())
        h.update(np.ascontiguousarray(t.data).tobytes())
    return h.hexdigest()


def record(prefix, tree=None, threads=2):
    """Write prefix.json (cases, token ids, fingerprints, provenance) and prefix.npz (llama.cpp's
    logits per case, float16) for tests/test_llamacpp_logits.py: the cases of CASE_SETS named
    by prefix's file name."""
    import json
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.dirname(HERE))
    from make_model import make_model
    from nbmoe.model import reference
    tree = llama_cpp_dir(tree)
    commit = subprocess.run(["git", "-C", tree, "log", "-1", "--format=%h"], capture_output=True,
                            text=True).stdout.strip()
    meta = {"tool": f"tools/llamacpp/logits.cpp on llama.cpp {commit or tree} (CPU, f16 KV cache, "
                    "no flash attention, one batch of all tokens)",
            "model_seed": MODEL_SEED, "cases": {}}
    arrays = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in CASE_SETS[os.path.basename(prefix)].items():
            kw = {k: v for k, v in spec.items() if k != "arch"}
            path = make_model(os.path.join(tmp, name + ".gguf"), spec["arch"], seed=MODEL_SEED, **kw)
            cfg, tensors = reference.load(path)
            for token_seed in range(TOKEN_SEED, TOKEN_SEED + 100):   # the first prompt without ties
                tokens = np.random.default_rng(token_seed).integers(0, cfg.n_vocab, N_TOKENS).tolist()
                gap, want = router_gap(cfg, tensors, tokens)
                if gap >= MIN_ROUTER_GAP:
                    break
            got = logits(path, tokens, tree, threads)
            cos, top1 = compare(got.astype(np.float64), want)
            diff = float(np.abs(got - want).max())
            meta["cases"][name] = {"make_model": spec, "fingerprint": fingerprint(path),
                                   "token_seed": token_seed, "router_gap": round(gap, 5),
                                   "tokens": tokens, "llamacpp_vs_reference":
                                   {"worst_cosine": float(f"{cos:.8f}"), "top1": round(top1, 4),
                                    "max_abs_diff": float(f"{diff:.3g}")}}
            arrays[name] = got.astype(np.float16)
            print(f"{name}: worst cosine {cos:.6f}, top-1 {top1:.1%}, max |diff| {diff:.2g}")
    with open(prefix + ".json", "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    np.savez_compressed(prefix + ".npz", **arrays)


def compare(a, b):
    """(worst per-position cosine, top-1 agreement) of logits a and b [T, V]."""
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return float(cos.min()), float((a.argmax(1) == b.argmax(1)).mean())


def main(argv=None):
    ap = argparse.ArgumentParser(description="llama.cpp's teacher-forced logits of a GGUF.")
    ap.add_argument("model", nargs="?")
    ap.add_argument("--record", metavar="PREFIX",
                    help="write the tests' llama.cpp numbers to PREFIX.json / PREFIX.npz")
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
    if args.record:
        return record(args.record, args.llama_cpp, args.threads)
    if not args.model:
        ap.error("give a model (or --record)")
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
