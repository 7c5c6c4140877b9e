"""How far a quantized KV cache moves the logits: the same token sequence run with an f16
cache and with each other type (-ctk / -ctv), compared position by position.

    python tools/kv_fidelity.py                          # default model, 4096 tokens of text
    python tools/kv_fidelity.py -m model.gguf -c 1024 -ngl 99 --types q8_0,bf16
    python tools/kv_fidelity.py --random -c 512 -n 32

The first c - n tokens go in as prompts (micro-batches of -ub: the batch kernels), the last n
one at a time (the decoding kernels). For each type it prints the largest |logit - f16's|
over all positions and vocabulary, that error relative to the largest f16 logit, the mean
per-position maximum, and the share of positions whose top-1 token equals f16's. Text: the
project's README and docs, tokenized and repeated to fill -c (or --text FILE).
"""
import argparse
import glob
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nbmoe.cli.common import add_placement_args, placement_kwargs, resolve_model  # noqa: E402
from nbmoe.model.kv_cache import KV_TYPES, check_kv_type  # noqa: E402


def token_ids(path, n, args):
    from nbmoe.loader.gguf_file import GGUFFile
    from nbmoe.text.tokenizer import Tokenizer
    tok = Tokenizer.from_meta(GGUFFile(path).meta)
    if args.random:
        return np.random.default_rng(args.seed).integers(0, tok.n_vocab, n).tolist()
    files = [args.text] if args.text else [os.path.join(ROOT, "README.md")] + sorted(
        glob.glob(os.path.join(ROOT, "docs", "*.md")))
    text = "\n\n".join(open(f, encoding="utf-8").read() for f in files)
    ids = tok.encode(text, add_bos=True, parse_special=False)
    while len(ids) < n:
        ids = ids + ids[1:]
    return ids[:n]


def run(path, ids, n_gen, ctk, ctv, args):
    """All positions' logits [len(ids), V] float32 with this cache type, and the cache's line."""
    from nbmoe.engine import load
    llm = load(path, n_ctx=len(ids), threads=args.threads, n_ubatch=args.ubatch_size,
               cache_type_k=ctk, cache_type_v=ctv, **placement_kwargs(args))
    n_prompt = len(ids) - n_gen
    t0 = time.perf_counter()
    out = [llm.eval(ids[:n_prompt])] if n_prompt else []
    out += [llm.eval([t]) for t in ids[n_prompt:]]
    print(f"  {llm.kv.summary()}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return np.concatenate(out).astype(np.float32)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default=None, help="GGUF file (default: the default model)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="tokens in the sequence")
    p.add_argument("-n", "--n-gen", type=int, default=64, help="of them, the last N one at a time")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, help="micro-batch size for prompts")
    p.add_argument("-t", "--threads", type=int, default=None, help="threads (default: all cores)")
    p.add_argument("--types", default="q8_0,bf16",
                   help="cache types to compare with f16, comma list; K/V pairs as k:v (q8_0:f16)")
    p.add_argument("--random", action="store_true", help="random token ids instead of text")
    p.add_argument("--text", default=None, help="a text file to tokenize (default: README and docs)")
    p.add_argument("--seed", type=int, default=0, help="seed of --random")
    add_placement_args(p)
    args = p.parse_args(argv)
    pairs = []
    for item in args.types.split(","):
        k, _, v = item.strip().partition(":")
        try:
            pairs.append((check_kv_type(k, "-ctk"), check_kv_type(v or k, "-ctv")))
        except Exception as e:
            p.error(f"--types: {e} ({', '.join(KV_TYPES)})")
    if not 0 <= args.n_gen <= args.ctx_size or args.ctx_size < 1:
        p.error("need 0 <= -n <= -c and -c >= 1")
    path = resolve_model(args.model)
    ids = token_ids(path, args.ctx_size, args)
    print(f"{os.path.basename(path)}: {len(ids)} tokens ({'random ids' if args.random else 'text'}), "
          f"the last {args.n_gen} one at a time", file=sys.stderr)
    ref = run(path, ids, args.n_gen, "f16", "f16", args)
    top_ref = ref.argmax(axis=1)
    scale = float(np.abs(ref).max())
    print(f"{'-ctk/-ctv':12s} {'max |err|':>10s} {'rel':>9s} {'mean max':>9s} {'top-1 agree':>12s}"
          f" {'(prompt / decode)':>18s}")
    for ctk, ctv in pairs:
        got = run(path, ids, args.n_gen, ctk, ctv, args)
        err = np.abs(got - ref).max(axis=1)                # per position
        same = got.argmax(axis=1) == top_ref
        n_p = len(ids) - args.n_gen
        split = f"{same[:n_p].mean():.4f} / {same[n_p:].mean():.4f}" if args.n_gen and n_p else ""
        print(f"{ctk + '/' + ctv:12s} {err.max():10.4f} {err.max() / scale:9.2e} {err.mean():9.4f} "
              f"{same.mean():12.4f} {split:>18s}")


if __name__ == "__main__":
    main()
