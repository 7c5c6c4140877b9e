"""Flash attention for prompts on f16 tensor cores (mma.sync m16n8k16, mma.py): attention.py calls
it for T > SPLIT_MAX_T tokens unless -fa is off, when Dh is a multiple of 16 (at most MAX_DH),
over a KV cache of any type (f16, bf16, q8_0: its tiles are converted to f16 as they are staged).

Letters as in attention.py: T tokens, H query heads, Hkv kv heads, G = H // Hkv query heads per kv
head, Dh head dim (of q and the keys), Dv the values' (out's; Dh but for MLA's expanded form,
Dh 192 and Dv 128 over f16 arrays: cpu/mla.py), C cache slots; BQ query rows and BK keys a tile.

    out[t, h] = softmax_j(scale * q[t, h] . k[j, h // G]) @ v[j, h // G]
    over keys j <= pos0 + t, and j > pos0 + t - window when window > 0; with sinks, one more
    logit sinks[h] (not scaled) of value 0 in each softmax (gpt-oss)

Layouts: q, out float32 [T, H, Dh] ([T, H, Dv]; out may alias q); k_cache, v_cache [C, Hkv, row] of the
cache's type (model/kv_cache.py: f16 uint16 [C, Hkv, Dh], bf16 int16 [C, Hkv, Dh], q8_0 uint8
[C, Hkv, Dh/32 * 34]); pos int32 [T] on the device, pos[t] = pos[0] + t. Shared memory holds
tiles in f16 whatever the cache's type: a row is Dh / 2 32-bit words of 2 f16, the lower dim in
the low half, which is the order of an mma register (kv_rows.pair_fn makes a word from a row
of each type). The kernel is compiled per (key type, value type): no type test in its loops.
Rounding: q * scale, the probabilities P and bf16 / q8_0 cache values (d * q) go to f16
(relative error 2^-11 each; a bf16 value past f16's range, |x| > 65504, would become inf);
S, the softmax statistics and O are float32.
"""
import numpy as np
from numba import cuda

from . import SIM, device_fn, device_id, expf, ld_f32, ld_u32, or_empty, shfl_xor, st_f32
from .kv_rows import kv_type_of, pair_fn, row_fns
from .mma import mma_f16_16x8x16, pack_f16x2

f32 = np.float32
u32 = np.uint32
NEG_INF = f32(-np.inf)

# WARPS warps a block, 16 query rows each (BQ = 16 WARPS); BK = KEYS keys a step. The
# simulator runs every thread as a Python thread: small tiles there, so tests cross tiles.
WARPS, KEYS = (2, 16) if SIM else (4, 64)
# Registers a lane: O is Dh / 2 floats, Q's fragments Dh / 4 words, S BK / 2 floats; Dh 256
# would spill, and falls back to the warp-per-query kernel.
MAX_DH = 128
# Keys up to WIDE_DH wide (f16) with values up to MAX_DH: Q's fragments take 3/2 of the
# registers, so a step takes WIDE_KEYS keys (S and the staging registers halve).
WIDE_DH = 192
WIDE_KEYS = 16 if SIM else 32
# Blocks an SM must hold at once (launch bounds: ptxas keeps registers to 64K / (MIN_BLOCKS * 32
# WARPS)); unbounded, Dh 128 took 242 registers (2 blocks an SM).
MIN_BLOCKS = 2

# Decoding (one token, DECODE_MIN_CACHE cache slots or more): the G query heads of a kv head
# fill half an m16 tile, so the keys are split instead, DECODE_SPLIT_KEYS a split (at most
# MAX_SPLITS splits, grid z), each split's (O, m, l) merged by attention.merge_splits_kernel.
# Below DECODE_MIN_CACHE the warp kernel, which also norms, rotates and stores the new key
# in the same launch, is as fast.
DECODE_MIN_CACHE = 2048
DECODE_SPLIT_KEYS = 64

_kernels = {}


def supported(Dh, kv_types=("f16", "f16"), Dv=None):
    """Dh a multiple of 16 (the mma's k) whose Dh / 2 words a row divide a block's threads
    (staging: 16, 32, 64, 128 with 4 warps; not 48, 80, 96, 112), at most MAX_DH; a q8_0
    cache (blocks of 32 values) needs Dh % 32 == 0, as the cache itself does. Values of
    their own width Dv (a width Dh may have; at most MAX_DH): keys up to WIDE_DH, f16 only,
    staged word by word (any Dh whose words a step's threads share evenly)."""
    Dv = Dh if Dv is None else Dv
    if "q8_0" in kv_types and Dh % 32:
        return False
    if Dv != Dh:
        return (Dv <= MAX_DH and Dv % 16 == 0 and (32 * WARPS) % (Dv // 2) == 0 and Dh % 16 == 0
                and Dh <= WIDE_DH and kv_types == ("f16", "f16")
                and (WIDE_KEYS * Dh // 2) % (32 * WARPS) == 0)
    return Dh % 16 == 0 and Dh <= MAX_DH and (32 * WARPS) % (Dh // 2) == 0


# ---------------------------------------------------------------- the kernel
# Block (tile, kv head hk), tile = n_tiles - 1 - blockIdx.x (the longest causal rows first).
# Query rows: the T * G (token, head) pairs of kv head hk, row r = t * G + i for query head
# hk * G + i, so the G heads that share K / V share every staged tile. The block owns rows
# tile * BQ .. + BQ - 1; warp w rows + 16 w .. + 15 (one m16 tile); past T * G: q = 0, no store.
#
#   one key step (keys j0 .. j0 + BK - 1), shared memory in 32-bit words of 2 f16 (a thread
#   makes each word it stages from the cache's row with pair(): bf16 and q8_0 convert there,
#   once a tile; a warp's 32 threads read consecutive words of a row, coalesced):
#     Ks [BK, SK]   key jj: its Dh / 2 words               SK = Dh / 2 + 4
#     Vt [Dh, SV]   dim d: keys (2i, 2i + 1) in word i      SV = BK / 2 + 4
#   (both strides are 4 mod 8: the fragment loads of a warp, rows g = 0..7 x words t = 0..3,
#   hit 32 different banks; Vt is V transposed so that a B fragment, 2 keys of one dim,
#   is one word).
#
#   warp w, lane (g, t):   S [16, BK] = Q [16, Dh] @ K^T            mma k = dims, n = keys
#                          P = exp(S - m) (online softmax, rows g and g + 8 of the warp)
#                          O [16, Dh] += P [16, BK] @ V [BK, Dh]    mma k = keys, n = dims
#   Q fragments qa[4 kc + r] (k-step kc: dims 16 kc ..): loaded once, scaled, as f16.
#   S n-tile j (keys 8 j ..): s[4 j + e], e = (row g | g + 8) x (key 2t | 2t + 1): its
#   n-tiles 2 kc, 2 kc + 1 repacked to f16 are P's A fragment for key-step kc (mma.py).
#   O n-tile n (dims 8 n ..): o[4 n + e], the same (row, col) order.
# Rows keep their max m and sum l (l: this lane's share, summed over the 4 lanes at the end).
# Key steps run from the block's first visible key to its last; a warp skips a step that no
# row of its own sees; masked scores are -inf, keys past the last one are staged as 0 (an
# unused cache row may hold NaN, and 0 * NaN = NaN).
# out may alias q: a warp reads its rows of q before the loop and writes the same rows last.

@device_fn
def online_softmax(s, NT, o, NO, m_a, m_b, l_a, l_b):
    """One key step's online softmax for a lane's two rows of an m16 tile (g and g + 8): the
    step's scores s [4 NT] (C fragment order: s[4 j + e], e = (row g | g + 8) x (key 2t |
    2t + 1); -inf where masked) become P = exp(s - m) in place, and O's NO values (the same
    order, 4 an n-tile) are rescaled to the new maxima. The maxima are over the row's 4 lanes;
    l is this lane's share of a row's sum. Returns the new (m_a, m_b, l_a, l_b)."""
    mx_a = m_a
    mx_b = m_b
    for j in range(NT):
        mx_a = max(mx_a, max(s[4 * j], s[4 * j + 1]))
        mx_b = max(mx_b, max(s[4 * j + 2], s[4 * j + 3]))
    mx_a = max(mx_a, shfl_xor(mx_a, 1))
    mx_a = max(mx_a, shfl_xor(mx_a, 2))
    mx_b = max(mx_b, shfl_xor(mx_b, 1))
    mx_b = max(mx_b, shfl_xor(mx_b, 2))
    base_a = mx_a if mx_a != NEG_INF else f32(0.0)    # a row with no key yet: p = 0
    base_b = mx_b if mx_b != NEG_INF else f32(0.0)
    corr_a = expf(m_a - base_a)                       # 0 on a row's first keys (m = -inf)
    corr_b = expf(m_b - base_b)
    l_a *= corr_a
    l_b *= corr_b
    for j in range(NT):
        s[4 * j] = expf(s[4 * j] - base_a)
        s[4 * j + 1] = expf(s[4 * j + 1] - base_a)
        s[4 * j + 2] = expf(s[4 * j + 2] - base_b)
        s[4 * j + 3] = expf(s[4 * j + 3] - base_b)
        l_a += s[4 * j] + s[4 * j + 1]
        l_b += s[4 * j + 2] + s[4 * j + 3]
    for i in range(0, NO, 4):
        o[i] *= corr_a
        o[i + 1] *= corr_a
        o[i + 2] *= corr_b
        o[i + 3] *= corr_b
    return mx_a, mx_b, l_a, l_b


@device_fn
def p_fragment(s, kc):
    """P's A fragment (f16) for keys 16 kc .. 16 kc + 15: S's n-tiles 2 kc and 2 kc + 1."""
    e = 8 * kc
    return (pack_f16x2(s[e], s[e + 1]), pack_f16x2(s[e + 2], s[e + 3]),
            pack_f16x2(s[e + 4], s[e + 5]), pack_f16x2(s[e + 6], s[e + 7]))


@device_fn
def split_keys(lo, hi, p, Pa):
    """Keys [a, b) of split p of the Pa that share keys [lo, hi)."""
    n = hi - lo
    return lo + (p * n) // Pa, lo + ((p + 1) * n) // Pa


def _flash_kernel(Dh, Hkv, KT, VT, WARPS, KEYS, MIN_BLOCKS, SPLIT=False, Dv=None):
    Dv = Dh if Dv is None else Dv
    key = (Dh, Dv, Hkv, KT, VT, WARPS, KEYS, MIN_BLOCKS, SPLIT)
    if key in _kernels:
        return _kernels[key]
    NTH = 32 * WARPS
    BQ = 16 * WARPS
    BK = KEYS
    DW, DWV = Dh // 2, Dv // 2  # words of a key row, of a value row
    DK = Dh // 16               # k-steps of Q K^T
    DN = Dv // 8                # n-tiles of O
    NT = BK // 8                # n-tiles of S
    KC = BK // 16               # k-steps of P V
    SK = DW + 4
    SV = BK // 2 + 4
    KS, VS = BK * SK, Dv * SV   # array sizes (a shape must be a constant, not an expression)
    NQ, NO, NS = 4 * DK, 4 * DN, 4 * NT
    HBK, HBV = row_fns(Dh, KT)[0], row_fns(Dv, VT)[0]     # bytes of a (position, kv head) row
    krow, vrow = Hkv * HBK, Hkv * HBV   # bytes of a cache position (Hkv compiled in: constant offsets)
    (klane, kpair), (vlane, vpair) = pair_fn(KT), pair_fn(VT)
    WORDS = NTH % DW != 0       # key rows staged word by word (a wide Dh: its words per thread)
    RP = max(1, NTH // DW)      # staging: cache rows a pass of the block's threads covers
    NK = BK * DW // NTH         # K words a thread stages a step
    RPV = NTH // DWV            # the same for V's rows
    NV = BK // 2 // RPV         # V word pairs a thread stages a step
    # q8_0 rows are staged raw first (RAWK / RAWV): whole 32-bit words of the rows' bytes, all
    # loads of K and V in flight at once, into Raw (K's, then V's), converted from there
    RAWK, RAWV = KT == "q8_0" and HBK % 4 == 0, VT == "q8_0" and HBV % 4 == 0
    RWK, RWV = HBK // 4, HBV // 4                     # words of a raw row
    NRK = (BK * RWK + NTH - 1) // NTH if RAWK else 1  # raw words a thread loads a step
    NRV = (BK * RWV + NTH - 1) // NTH if RAWV else 1
    RAWS = max(BK * RWK if RAWK else 1, BK * RWV if RAWV else 1)
    SAME = KT == VT and Dh == Dv
    from .attention import active_splits
    assert supported(Dh, (KT, VT), Dv) and BK % 16 == 0 and NV * RPV * 2 == BK and RPV * DWV == NTH
    assert (WORDS and not RAWK and NK * NTH == BK * DW) or (not WORDS and RP * DW == NTH)

    @cuda.jit(**({} if SIM else dict(launch_bounds=(NTH, MIN_BLOCKS))))
    def flash_kernel(out, part_acc, part_ml, min_keys, q, k_cache, v_cache, pos, scale, window, sinks):
        T, H = q.shape[0], q.shape[1]
        G = H // Hkv
        R = T * G                                     # query rows of a kv head
        Ks = cuda.shared.array(KS, u32)
        Vt = cuda.shared.array(VS, u32)
        Raw = cuda.shared.array(RAWS, u32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        g = lane >> 2
        t4 = lane & 3
        hk = cuda.blockIdx.y
        r0 = (cuda.gridDim.x - 1 - cuda.blockIdx.x) * BQ
        pos0 = pos[0]
        # the block's keys: from the first row's window start to the last row's position
        lo = max(0, pos0 + r0 // G - window + 1) if window > 0 else 0
        hi = pos0 + (min(r0 + BQ, R) - 1) // G + 1
        p = cuda.blockIdx.z
        if SPLIT:                                     # one token: this split's share of the keys
            Pa = active_splits(hi - lo, cuda.gridDim.z, min_keys)
            if p >= Pa:
                return
            lo, hi = split_keys(lo, hi, p, Pa)
        # the warp's rows and the keys they see
        wr0 = r0 + 16 * warp
        active = wr0 < R
        w_lo = pos0 + wr0 // G - window + 1 if window > 0 else 0
        w_hi = pos0 + (min(wr0 + 16, R) - 1) // G + 1
        # this lane's two rows: causal limit and window start of each
        ra = wr0 + g
        rb = ra + 8
        ta = min(ra // G, T - 1)
        tb = min(rb // G, T - 1)
        lim_a = min(pos0 + ta, hi - 1)
        lim_b = min(pos0 + tb, hi - 1)
        low_a = max(pos0 + ta - window + 1 if window > 0 else 0, lo)
        low_b = max(pos0 + tb - window + 1 if window > 0 else 0, lo)
        qa_base = (ta * H + hk * G + ra % G) * Dh * 4           # byte offsets of the q rows
        qb_base = (tb * H + hk * G + rb % G) * Dh * 4
        oa_base = (ta * H + hk * G + ra % G) * Dv * 4           # and of the out rows
        ob_base = (tb * H + hk * G + rb % G) * Dv * 4

        # Q fragments, scaled, in f16 (rows past R: 0)
        qa = cuda.local.array(NQ, u32)
        for kc in range(DK):
            d = 16 * kc + 2 * t4
            for r in range(4):
                base = qb_base if r & 1 else qa_base
                ok = (rb if r & 1 else ra) < R
                dd = d + 8 * (r >> 1)
                x0 = ld_f32(q, base, 4 * dd) * scale if ok else f32(0.0)
                x1 = ld_f32(q, base, 4 * dd + 4) * scale if ok else f32(0.0)
                qa[4 * kc + r] = pack_f16x2(x0, x1)
        o = cuda.local.array(NO, f32)
        for i in range(NO):
            o[i] = f32(0.0)
        s = cuda.local.array(NS, f32)
        kst = cuda.local.array(NK, u32)
        vst0 = cuda.local.array(NV, u32)
        vst1 = cuda.local.array(NV, u32)
        rk = cuda.local.array(NRK, u32)
        rv = cuda.local.array(NRV, u32)
        m_a = NEG_INF
        m_b = NEG_INF
        l_a = f32(0.0)
        l_b = f32(0.0)
        kr = tid // DW                                # staging: key (pair) and word of this thread
        w = tid - kr * DW
        kw = klane(w)                                 # byte offsets of word w in a cache row
        krv = tid // DWV                              # (V's: rows of their own width)
        wv = tid - krv * DWV
        vw = vlane(wv)
        kfrag = 4 * (g * SK + t4)                     # byte offsets of this lane's fragment words
        vfrag = 4 * (g * SV + t4)

        for j0 in range(lo, hi, BK):
            # 1. stage K (rows) and V (transposed) of keys j0 ..: a thread takes word w of
            # keys kr + RP i (V: of key pairs kr + RP i), all loads of a matrix before its stores
            kb = (j0 * Hkv + hk) * HBK + kr * krow + kw     # key kr
            if RAWK:
                for i in range(NRK):
                    wi = tid + NTH * i
                    key = wi // RWK
                    ok = wi < BK * RWK and j0 + key < hi
                    rk[i] = ld_u32(k_cache, (j0 + key) * krow + hk * HBK, 4 * (wi - key * RWK)) if ok else u32(0)
            if RAWV:
                for i in range(NRV):
                    wi = tid + NTH * i
                    key = wi // RWV
                    ok = wi < BK * RWV and j0 + key < hi
                    rv[i] = ld_u32(v_cache, (j0 + key) * vrow + hk * HBV, 4 * (wi - key * RWV)) if ok else u32(0)
            if RAWK:
                for i in range(NRK):
                    if tid + NTH * i < BK * RWK:
                        Raw[tid + NTH * i] = rk[i]
                cuda.syncthreads()
                for i in range(NK):
                    kst[i] = kpair(Raw, kr * HBK + kw, i * RP * HBK, w)
            elif WORDS:                                   # word i of the step: key, word
                for i in range(NK):
                    wi = tid + NTH * i
                    key = wi // DW
                    wk = wi - key * DW
                    ok = j0 + key < hi
                    kst[i] = kpair(k_cache, (j0 + key) * krow + hk * HBK + klane(wk), 0, wk) if ok else u32(0)
            else:
                for i in range(NK):
                    kst[i] = kpair(k_cache, kb, i * RP * krow, w) if j0 + kr + RP * i < hi else u32(0)
            if WORDS:
                for i in range(NK):
                    wi = tid + NTH * i
                    key = wi // DW
                    Ks[key * SK + wi - key * DW] = kst[i]
            else:
                for i in range(NK):
                    Ks[(kr + RP * i) * SK + w] = kst[i]
            if RAWV:
                if RAWK:
                    cuda.syncthreads()                  # K's conversion has read Raw
                for i in range(NRV):
                    if tid + NTH * i < BK * RWV:
                        Raw[tid + NTH * i] = rv[i]
                cuda.syncthreads()
                vr = 2 * krv * HBV + vw
                for i in range(NV):
                    vst0[i] = vpair(Raw, vr, 2 * i * RPV * HBV, wv)
                    vst1[i] = vpair(Raw, vr, (2 * i * RPV + 1) * HBV, wv)
            else:
                if SAME:                                # key 2 kr (pair kr)
                    vb = kb + kr * krow
                else:
                    vb = (j0 * Hkv + hk) * HBV + 2 * krv * vrow + vw
                for i in range(NV):
                    j = j0 + 2 * (krv + RPV * i)
                    vst0[i] = vpair(v_cache, vb, 2 * i * RPV * vrow, wv) if j < hi else u32(0)
                    vst1[i] = vpair(v_cache, vb, (2 * i * RPV + 1) * vrow, wv) if j + 1 < hi else u32(0)
            for i in range(NV):
                a, b = vst0[i], vst1[i]               # dims (2wv, 2wv + 1) of keys 2 jp, 2 jp + 1
                jp = krv + RPV * i
                Vt[2 * wv * SV + jp] = (a & u32(0xFFFF)) | (b << u32(16))
                Vt[(2 * wv + 1) * SV + jp] = (a >> u32(16)) | (b & u32(0xFFFF0000))
            cuda.syncthreads()

            if active and j0 < w_hi and j0 + BK > w_lo:
                # 2. S = Q K^T, masked
                for j in range(NT):
                    c0 = c1 = c2 = c3 = f32(0.0)
                    for kc in range(DK):
                        off = 4 * (8 * j * SK + 8 * kc)
                        c0, c1, c2, c3 = mma_f16_16x8x16(
                            qa[4 * kc], qa[4 * kc + 1], qa[4 * kc + 2], qa[4 * kc + 3],
                            ld_u32(Ks, kfrag, off), ld_u32(Ks, kfrag, off + 16), c0, c1, c2, c3)
                    kj = j0 + 8 * j + 2 * t4
                    s[4 * j] = c0 if low_a <= kj <= lim_a else NEG_INF
                    s[4 * j + 1] = c1 if low_a <= kj + 1 <= lim_a else NEG_INF
                    s[4 * j + 2] = c2 if low_b <= kj <= lim_b else NEG_INF
                    s[4 * j + 3] = c3 if low_b <= kj + 1 <= lim_b else NEG_INF
                # 3. online softmax of the lane's two rows; O rescaled to the new maxima
                m_a, m_b, l_a, l_b = online_softmax(s, NT, o, NO, m_a, m_b, l_a, l_b)
                # 4. O += P V: P's A fragment of keys 16 kc .. is S n-tiles 2 kc, 2 kc + 1
                for kc in range(KC):
                    p0, p1, p2, p3 = p_fragment(s, kc)
                    for n in range(DN):
                        off = 4 * (8 * n * SV + 8 * kc)
                        o[4 * n], o[4 * n + 1], o[4 * n + 2], o[4 * n + 3] = mma_f16_16x8x16(
                            p0, p1, p2, p3, ld_u32(Vt, vfrag, off), ld_u32(Vt, vfrag, off + 16),
                            o[4 * n], o[4 * n + 1], o[4 * n + 2], o[4 * n + 3])
            cuda.syncthreads()

        # 5. out = O / l, l summed over the row's 4 lanes; a sink s joins the row's softmax
        # as a logit of value 0: M = max(m, s), out = O e^(m - M) / (l e^(m - M) + e^(s - M))
        # (split: O, m and l of the split go to the merge, which adds the sink)
        if active:
            l_a += shfl_xor(l_a, 1)
            l_a += shfl_xor(l_a, 2)
            l_b += shfl_xor(l_b, 1)
            l_b += shfl_xor(l_b, 2)
            if SPLIT:
                if ra < R:
                    ha = hk * G + ra % G
                    for n in range(DN):
                        part_acc[p, 0, ha, 8 * n + 2 * t4] = o[4 * n]
                        part_acc[p, 0, ha, 8 * n + 2 * t4 + 1] = o[4 * n + 1]
                    if t4 == 0:
                        part_ml[p, 0, ha, 0] = m_a
                        part_ml[p, 0, ha, 1] = l_a
                return
            if sinks.shape[0] > 0:
                sk_a = sinks[hk * G + ra % G]
                sk_b = sinks[hk * G + rb % G]
                mm_a = max(m_a, sk_a)
                mm_b = max(m_b, sk_b)
                corr_a = expf(m_a - mm_a)
                corr_b = expf(m_b - mm_b)
                inv_a = corr_a / (l_a * corr_a + expf(sk_a - mm_a))
                inv_b = corr_b / (l_b * corr_b + expf(sk_b - mm_b))
            else:
                inv_a = f32(1.0) / l_a
                inv_b = f32(1.0) / l_b
            for n in range(DN):
                d = 4 * (8 * n + 2 * t4)
                if ra < R:
                    st_f32(out, oa_base, d, o[4 * n] * inv_a)
                    st_f32(out, oa_base, d + 4, o[4 * n + 1] * inv_a)
                if rb < R:
                    st_f32(out, ob_base, d, o[4 * n + 2] * inv_b)
                    st_f32(out, ob_base, d + 4, o[4 * n + 3] * inv_b)

    _kernels[key] = (flash_kernel, NTH, BQ)
    return _kernels[key]


def attention(out, q, k_cache, v_cache, pos, scale, window=0, stream=0, sinks=None):
    """attention.attention for prompts: q [T, H, Dh], out [T, H, Dv] (out may alias q), pos a
    device int32 array [T], sinks float32 [H] or None / EMPTY; supported(Dh, the cache types,
    Dv) must hold."""
    T, H, Dh = q.shape
    Dv = out.shape[2]
    G = H // k_cache.shape[1]
    kern, nth, bq = _flash_kernel(Dh, k_cache.shape[1], kv_type_of(k_cache), kv_type_of(v_cache),
                                  WARPS, KEYS if Dh <= MAX_DH else WIDE_KEYS, MIN_BLOCKS, Dv=Dv)
    grid = ((T * G + bq - 1) // bq, k_cache.shape[1])
    unused = _unused_parts()
    kern[grid, nth, stream](out, unused, unused, 0, q, k_cache, v_cache, pos, f32(scale), int(window),
                            or_empty(sinks))


def decode_used(T, Dh, kv_types, cache_slots):
    """Whether one token's attention over a cache of cache_slots rows takes decode()."""
    return T == 1 and cache_slots >= DECODE_MIN_CACHE and supported(Dh, kv_types)


def decode_splits(cache_slots, window=0):
    """Splits of decode()'s grid: one per DECODE_SPLIT_KEYS keys a query can see, at most
    MAX_SPLITS (fixed by the cache's capacity, so a CUDA graph replays it)."""
    from .attention import MAX_SPLITS
    cap = cache_slots if window == 0 else min(cache_slots, window)
    return max(1, min(MAX_SPLITS, cap // DECODE_SPLIT_KEYS))


def decode(part_acc, part_ml, P, q, k_cache, v_cache, pos, scale, window=0, stream=0, sinks=None):
    """One token's attention, keys split P ways: split p writes its unnormalised O into
    part_acc[p, 0] [H, Dh] and its rows' (max, sum) into part_ml[p, 0] [H, 2], as the warp
    kernel's splits do; attention.merge_splits_kernel (min_keys DECODE_SPLIT_KEYS, every split
    count) makes out."""
    T, H, Dh = q.shape
    kern, nth, bq = _flash_kernel(Dh, k_cache.shape[1], kv_type_of(k_cache), kv_type_of(v_cache),
                                  WARPS, KEYS, MIN_BLOCKS, SPLIT=True)
    grid = (1, k_cache.shape[1], P)
    kern[grid, nth, stream](q, part_acc, part_ml, DECODE_SPLIT_KEYS, q, k_cache, v_cache, pos, f32(scale),
                            int(window), or_empty(sinks))


def _unused_parts():
    key = ("unused_parts", device_id())
    a = _kernels.get(key)
    if a is None:
        a = _kernels[key] = cuda.device_array((1, 1, 1, 2), np.float32)
    return a
