"""Every setting of nbmoe that the environment can change, in one place, one line each.

Read once at import (the cache folder at each call). The defaults are the fast paths; the
variables choose exact arithmetic or step around a driver that refuses a feature. Kernel
constants (block sizes, thresholds) live beside their kernels, where tests patch them.
"""
import os


def env_int(name, default):
    """An integer from the environment, or default when unset or empty."""
    text = os.environ.get(name, "")
    return int(text) if text.strip() else default


def env_flag(name, default):
    """A boolean from the environment ("1" on, "0" off), or default when unset or empty."""
    text = os.environ.get(name, "").strip()
    return default if not text else text not in ("0", "false", "no", "off")


def cache_dir():
    """Kernel cache and default model: $NBMOE_CACHE, else $XDG_CACHE_HOME/nbmoe, else ~/.cache/nbmoe."""
    if os.environ.get("NBMOE_CACHE"):
        return os.environ["NBMOE_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "nbmoe")


# ---- CPU
# NBMOE_NO_VNNI=1: the portable kernels even where the CPU has AVX-512 VNNI (changes compiled code).
NO_VNNI = env_flag("NBMOE_NO_VNNI", False)
# NBMOE_INT8_DOT=0: matrix-vector products in exact float dots, not against x rounded to 8 bits.
INT8_DOT = env_flag("NBMOE_INT8_DOT", True)
# NBMOE_GEMM_I8=0: batched products (prompts) by dequantize + BLAS (exact), not gemm_i8's 8-bit x.
GEMM_I8 = env_flag("NBMOE_GEMM_I8", True)

# NBMOE_COMPILE_AHEAD=0: a cold start compiles in one process (else a second one compiles the
# prompt path, or a bench's generation, beside it: nbmoe/compiling.py).
COMPILE_AHEAD = env_flag("NBMOE_COMPILE_AHEAD", True)

# ---- Attention
# -fa / LLM(flash_attn=...): prompts on the flash (tiled) attention kernels where a backend has
# one ("auto", "on": and a warning where it has none) or on the plain ones ("off").
FLASH_ATTN_MODES = ("auto", "on", "off")
# NBMOE_FLASH_ATTN: the default mode.
FLASH_ATTN = os.environ.get("NBMOE_FLASH_ATTN", "").strip().lower() or "auto"

# ---- Threads
# OMP_WAIT_POLICY / GOMP_SPINCOUNT, unless either is set: idle threads sleep at once (PASSIVE).
# NBMOE_SPIN_POLLS=N (3000 is ~150 us, across a hybrid layer's GPU part) makes them poll first on
# a machine of at least SPIN_MIN_CPUS CPUs whose 1-minute load is below SPIN_MAX_LOAD of them.
# Off by default: one other busy process made 16 polling threads 3x slower (docs/kernels.md).
OMP_WAIT_POLICY = "PASSIVE"
SPIN_POLLS = env_int("NBMOE_SPIN_POLLS", 0)
SPIN_MIN_CPUS = env_int("NBMOE_SPIN_MIN_CPUS", 8)
SPIN_MAX_LOAD = float(os.environ.get("NBMOE_SPIN_MAX_LOAD", "0.5"))
# Between the phases of one parallel region (work_queue.wait_for), a waiting thread polls this
# many times (~50-100 ns each: a PAUSE and an atomic read) before it sleeps 20 us between looks.
PHASE_POLLS = env_int("NBMOE_PHASE_POLLS", 500)
# A decoding MoE layer's CPU experts (gate / up / GLU, then down and the weighted sum) in one
# parallel region (fused.expert_ffn); off: two regions, to compare.
EXPERT_FFN = env_flag("NBMOE_EXPERT_FFN", True)
# NUMBA_THREADING_LAYER(_PRIORITY): unless set, Numba's threading layers are tried in this order.
THREADING_LAYERS = ("omp", "tbb", "workqueue")

# ---- Model graphs
# MLA prompt batches of at least this many tokens attend in the expanded form (a key and value
# per head and cached token, made once a batch): per cached token it costs R (Dn + Dv) products
# a head, and saves the batch's tokens (R + R - Dn - Dv) each; even near 170 tokens (DeepSeek).
MLA_EXPAND_MIN_TOKENS = env_int("NBMOE_MLA_EXPAND_MIN_TOKENS", 128)

# ---- Placement
# -zce auto: the share of a token's chosen experts that a GPU computes from RAM in place, to start
# with (zero_copy.ShareBalancer moves it while generating; tools/zce_sweep.py finds the best fixed one).
ZERO_COPY_SHARE = 3 / 8

# ---- Expert parallelism over MPI (--ep, nbmoe/parallel)
# NBMOE_EP_TIMEOUT: seconds rank 0 waits for a rank's partial sums of a layer before it names the
# rank as lost and ends the run (a dead, hung or unreachable rank; longer than any layer's work).
EP_TIMEOUT = env_int("NBMOE_EP_TIMEOUT", 60)
# NBMOE_EP_START_TIMEOUT: seconds rank 0 waits at load for every rank to open the file and compile.
EP_START_TIMEOUT = env_int("NBMOE_EP_START_TIMEOUT", 600)
# A rank waiting for a message polls without pause this long, then sleeps between polls, from
# EP_PAUSE[0] doubling to EP_PAUSE[1] seconds (MPI's blocking waits spin a core at 100 %).
EP_SPIN_S = 0.05
EP_PAUSE = (5e-5, 2e-3)
# Seconds rank 0 lives on after printing why it ends the run with a rank lost: mpiexec forwards
# a rank's last output lines only while the rank lives, and the abort ends them all.
EP_ABORT_GRACE_S = 0.5
# NBMOE_EP_OVERLAP=0: rank 0 computes a layer's shared expert after the ranks' sums are in, not
# while they compute (to measure what the overlap gains).
EP_OVERLAP = env_flag("NBMOE_EP_OVERLAP", True)

# ---- CUDA: fallbacks for a driver that refuses a feature
# NBMOE_NO_GRAPHS=1: launch decoding's kernels one by one instead of replaying CUDA graphs.
GRAPHS = not env_flag("NBMOE_NO_GRAPHS", False)
# NBMOE_NO_PROMPT_GRAPHS=1: prompt batches launch their kernels one by one (decoding's graphs stay).
PROMPT_GRAPHS = not env_flag("NBMOE_NO_PROMPT_GRAPHS", False)
# NBMOE_NO_OFFLOADED_PROMPT_GRAPHS=1: prompt batches with offloaded products (weights in RAM) launch
# all their kernels one by one (to measure what the graphs between those products gain).
OFFLOADED_PROMPT_GRAPHS = not env_flag("NBMOE_NO_OFFLOADED_PROMPT_GRAPHS", False)
# NBMOE_NO_PIN=1: upload offloaded weights from the pageable file mapping (no page-locking).
PIN = not env_flag("NBMOE_NO_PIN", False)
# NBMOE_PROFILE_TIMED=1: the bench's timed repetitions run inside cuProfilerStart/Stop, so
# `ncu --profile-from-start off` profiles those alone (tools/ncu_summary.py).
PROFILE_TIMED = env_flag("NBMOE_PROFILE_TIMED", False)
# NBMOE_NO_MAPPED=1: hybrid decoding copies its small crossings instead of mapping host memory.
MAPPED = not env_flag("NBMOE_NO_MAPPED", False)

# The settings above that change compiled code, for the kernel cache's folder name.
KERNEL_KEY = f"novnni={int(NO_VNNI)}-polls={PHASE_POLLS}"
