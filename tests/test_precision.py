"""How close the int8 path's logits stay to float64 on a Mixtral-style MoE (llama, 8 experts).

The int8 path rounds the input of every block-type product to 8 bits per 32 values, as
llama.cpp does. That noise (~0.01 in router logits here) flips top-k choices that are near a
tie, and a flipped expert moves a position's logits far more than the rounding itself (below
cosine 0.9 at times; llama.cpp's logits alike). So the test holds the engine to two float64
references on the experts the 8-bit rounding picks:
  x8:    x rounded as the int8 path rounds it: the engine computes this;
  exact: no rounding, on x8's expert choices: the int8 path's distance to the exact math.
The prompt is the first of a fixed series whose x8 choices are all at least MARGIN from a
tie, so float32 differences cannot pick other experts than x8 does.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType

import nbmoe
from nbmoe.cpu import matmul
from nbmoe.model import reference as ref

MIXTRAL = dict(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=256, n_expert=8, n_expert_used=2)
T = 16          # prompt tokens: some experts get >= 6 of them, so gemm_i8 runs as well
MARGIN = 0.01   # router logits: the last chosen expert's minus the next one's
# min cosine over positions against `exact` (prompt batch and token-by-token decoding): at
# least llama.cpp's on such a model (Q4_0 0.962, Q4_1 0.987, Q5_1 0.9996). Against x8: 0.9995
# (float32 math moves a few codes across a rounding boundary, and the difference spreads).
BOUND = {"Q4_0": 0.999, "Q4_1": 0.999, "Q5_0": 0.999, "Q5_1": 0.9996, "Q8_0": 0.999, "Q4_K": 0.999}
FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def cosine_rows(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def round_x8(x):
    """x [..., K] as the int8 path sees it: per 32 values d = max|x| / 127, x = d * rint(x / d)."""
    b = x.reshape(-1, 32)
    d = np.abs(b).max(-1, keepdims=True) / 127
    return (np.rint(b / np.where(d > 0, d, 1)) * d).reshape(x.shape)


def forward(cfg, tensors, tokens, x8, routes, gaps=None):
    """reference.forward for a llama MoE. x8: the input of each block-type product (not the
    F32 router) rounded by round_x8. routes: each layer's chosen experts [T, A], appended where
    missing. gaps: gets each layer's [T] router-logit gaps between choice A and A + 1."""
    W = {}

    def w(name):
        if name not in W:
            W[name] = ref.weight(tensors, name)
        return W[name]

    def xr(x, name):                                                 # x as the product sees it
        return round_x8(x) if x8 and tensors[name].ggml_type not in FLOAT_TYPES else x

    def mm(x, name):                                                 # [.., K] @ w.T
        return xr(x, name) @ w(name).T

    n, H, Dh, A, eps = len(tokens), cfg.n_head, cfg.head_dim, cfg.n_expert_used, cfg.norm_eps
    pos = np.arange(n, dtype=np.float64)
    x = w("token_embd.weight")[np.asarray(tokens)]                   # [T, D]
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        h = ref.rms_norm(x, w(p + "attn_norm.weight"), eps)
        q, k, v = (mm(h, p + f"attn_{c}.weight").reshape(n, -1, Dh) for c in "qkv")
        q, k = (ref.rope(t, pos, cfg.rope_freqs(il), cfg.flags.rope_neox, cfg.rope_mscale) for t in (q, k))
        k, v = k.astype(np.float16).astype(np.float64), v.astype(np.float16).astype(np.float64)
        a = ref.attention(q, k, v, cfg.attn_scale, 0).reshape(n, H * Dh)
        x = x + mm(a, p + "attn_output.weight")
        h = ref.rms_norm(x, w(p + "ffn_norm.weight"), eps)
        logits = mm(h, p + "ffn_gate_inp.weight")                    # [T, E]
        if gaps is not None:
            s = -np.sort(-logits, -1)
            gaps.append(s[:, A - 1] - s[:, A])
        if len(routes) <= il:
            routes.append(np.argsort(-logits, axis=-1, kind="stable")[:, :A])   # [T, A]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        wts = np.take_along_axis(probs, routes[il], -1)
        wts /= wts.sum(-1, keepdims=True)                           # [T, A]
        gate, up, down = (p + f"ffn_{c}_exps.weight" for c in ("gate", "up", "down"))
        for t in range(n):
            ht = xr(h[t], gate)
            for e, wt in zip(routes[il][t], wts[t]):
                y = ref.glu(w(gate)[e] @ ht, w(up)[e] @ ht, cfg.flags.glu)
                x[t] += wt * (w(down)[e] @ xr(y, down))
    x = ref.rms_norm(x, w("output_norm.weight"), eps)
    return mm(x, "output.weight" if "output.weight" in tensors else "token_embd.weight")


def prompt_without_near_ties(cfg, tensors):
    """(tokens, x8 logits, x8 routes) of the first seeded random prompt whose x8 choices all
    clear MARGIN."""
    for seed in range(64):
        tokens = [int(t) for t in np.random.default_rng(seed).integers(3, cfg.n_vocab, T)]
        routes, gaps = [], []
        x8 = forward(cfg, tensors, tokens, True, routes, gaps)
        if min(g.min() for g in gaps) >= MARGIN:
            return tokens, x8, routes
    pytest.fail(f"no prompt's 8-bit expert choices clear a margin of {MARGIN}")


@pytest.mark.parametrize("qtype", list(BOUND))
def test_int8_logits_near_float64(tiny_model, qtype, monkeypatch):
    monkeypatch.setattr(matmul, "INT8_DOT", True)
    monkeypatch.setattr(matmul, "GEMM_I8", True)
    llm = nbmoe.load(tiny_model("llama", default_type=qtype, **MIXTRAL), n_ctx=64, threads=2)
    cfg, tensors = llm.cfg, llm.file.tensors
    tokens, x8, routes = prompt_without_near_ties(cfg, tensors)
    exact = forward(cfg, tensors, tokens, False, routes)
    plain = ref.forward(cfg, tensors, tokens)                       # float64's own choices
    own = []
    assert np.abs(forward(cfg, tensors, tokens, False, own) - plain).max() <= 1e-9 * np.abs(plain).max()
    flips = sum(int((np.sort(a, -1) != np.sort(b, -1)).any(-1).sum()) for a, b in zip(routes, own))
    batch = llm.eval(tokens)
    llm.reset()
    decode = np.concatenate([llm.eval([t]) for t in tokens])
    for name, got in (("batch", batch), ("decode", decode)):
        c_x8, c_exact, c_plain = (cosine_rows(got, r).min() for r in (x8, exact, plain))
        print(f"{qtype} {name}: min cosine vs x8 {c_x8:.6f}, vs float64 on x8's experts "
              f"{c_exact:.6f}, vs float64 {c_plain:.6f} ({flips} of {T * cfg.n_layer} choices differ)")
        assert c_x8 >= 0.9995
        assert c_exact >= BOUND[qtype]
