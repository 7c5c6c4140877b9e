"""The Python API: load a GGUF, tokenize, evaluate tokens into logits, generate text.

    llm = nbmoe.load()          # the default model; or nbmoe.load("model.gguf", n_ctx=2048, threads=2)
    logits = llm.eval(llm.tokenize("text"))     # [T, V] float32, appended to the KV cache
    for piece in llm.generate("prompt", max_tokens=64, temperature=0.0): print(piece, end="")
"""
import itertools
import os
import time
import warnings

import numba
import numpy as np

from nbmoe import config, load_order
from nbmoe.model.arch import config_from_meta
from nbmoe.backends.cpu import CPUBackend
from nbmoe.cpu import matmul as cpu_matmul
from nbmoe.cpu.blas import set_blas_threads
from nbmoe.errors import NbmoeError
from nbmoe.loader.gguf_file import GGUFFile
from nbmoe.model.kv_cache import KVCache
from nbmoe.model.forward import build_graph, check_tensors
from nbmoe.sched.placement import is_rank, moe_overrides, parse_overrides, place_tensors
from nbmoe.loader.merge import merge_up_gate as merge_tensors
from nbmoe.loader.mla import add_expansion_weights, upgrade_kv_b_layout
from nbmoe.loader.repack import repack_weights
from nbmoe.text.sampling import Sampler, SamplingParams
from nbmoe.sched import scheduler
from nbmoe.sched.scheduler import OffloadPolicy, make_plan
from nbmoe.text.tokenizer import Tokenizer
from nbmoe.sched.zero_copy import ShareBalancer, measured_times, sampled_layers, split_expert_slots


class _State:
    """What changes between runs of a bound graph: the cache (the active slot's) and where
    in it this batch starts. The bound steps read both at run time."""

    def __init__(self, kv):
        self.kv, self.pos0 = kv, 0


class Slot:
    """One sequence of a shared engine: its part of the KV cache and the tokens it holds."""

    def __init__(self, kv):
        self.kv, self.tokens = kv, []


class LLM:
    def __init__(self, path, n_ctx=2048, threads=None, n_ubatch=512, n_gpu_layers=0,
                 override_tensors=(), offload_policy=None, cpu_moe=False, n_cpu_moe=0, repack=False,
                 zero_copy_experts="auto", flash_attn=None, expert_parallel=1, ep_gpu=False,
                 fused_moe=True, upload_all_experts=False, merge_up_gate=False, n_slots=1,
                 cache_type_k="f16", cache_type_v="f16"):
        self.path = os.fspath(path)
        self.fused_moe, self.upload_all_experts = bool(fused_moe), bool(upload_all_experts)
        self.merge_up_gate = bool(merge_up_gate)
        self.file = GGUFFile(self.path)
        meta = self.file.meta
        upgrade_kv_b_layout(meta, self.file.tensors)     # older MLA files (loader/mla.py)
        emb = self.file.tensors.get("token_embd.weight")
        self.cfg = config_from_meta(meta, emb.ne[1] if emb is not None else None, self.file.tensors)
        check_tensors(self.cfg, self.file.tensors, cpu_matmul.is_supported)
        load_order.preload()     # callees before their callers, as when they compiled
        self.ep = None           # --ep: the experts shared over MPI ranks (nbmoe/parallel)
        if expert_parallel and expert_parallel > 1:
            from nbmoe.parallel.expert_parallel import ExpertParallel
            self.ep = ExpertParallel(self.file, self.cfg, expert_parallel, override_tensors, ep_gpu)
            zero_copy_experts = 0
        # A tied output reads the embedding matrix; under its own name it can be placed
        # like any output layer (llama.cpp duplicates it the same way).
        # (a NextN block's tensors stay in the file, unread, unplaced, never uploaded)
        self.weights = {n: t for n, t in self.file.tensors.items() if self.cfg.runs_tensor(n)}
        self.weights.setdefault("output.weight", self.weights["token_embd.weight"])
        self.placement = self._place(n_gpu_layers, override_tensors, cpu_moe, n_cpu_moe)
        add_expansion_weights(self.cfg, self.weights, self.placement)    # MLA prompts (loader/mla.py)
        self.threads = usable_threads(threads)
        # -muge: gate and up experts as one tensor, merged where they live (loader/merge.py)
        self.merge_notes = None
        if self.merge_up_gate and self.cfg.is_moe:
            self.merge_notes = merge_tensors(self.file, self.cfg, self.weights, self.placement,
                                            "--ep" if self.ep else None)
        # the layers whose graph takes the merged product (-muge, or a file that ships it)
        self.merged_layers = frozenset(il for il in range(self.cfg.n_layer)
                                       if f"blk.{il}.ffn_gate_up_exps.weight" in self.weights)
        if self.ep and self.merged_layers:
            raise NbmoeError("--ep does not read merged ffn_gate_up_exps tensors (this file ships them)")
        set_blas_threads(1)      # numpy's BLAS threads would spin on Numba's cores (cpu/blas.py)
        auto = str(zero_copy_experts) == "auto"
        split = self._split_layers()
        n_zc = round(config.ZERO_COPY_SHARE * self.cfg.n_expert_used) if auto else int(zero_copy_experts)
        self.gpu_slots = self._zero_copy_layers(split, n_zc, auto)
        # -rtr: RAM-resident Q4_0 / Q4_1 / Q8_0 / Q4_K / IQ4_* / MXFP4 matrices rewritten for the
        # CPU kernels (repack.py)
        self.repacked, self.repack_stats = {}, None
        if repack:
            numba.set_num_threads(self.threads)
            mine = {n: t for n, t in self.weights.items()   # --ep: rank 0 reads only its share
                    if not (self.ep and self.placement[n][1].startswith("--ep"))}
            self.repacked, self.repack_stats = repack_weights(self.file, mine, self.placement)
        self.flash_attn = flash_attn_mode(flash_attn)
        cpu = (self.ep.backend(self.weights, self.repacked, self.flash_attn) if self.ep
               else CPUBackend(self.weights, self.repacked, self.flash_attn))
        self.backends = {"CPU": cpu, **self._gpu_backends()}
        self._lock_ram_for_zero_copy(auto)
        # the GPU share in use; -zce auto balances it while generating (zero_copy.py)
        self.zce_share = max((s for _, s in self.gpu_slots.values()), default=0)
        self.shared_ahead = self._shared_ahead_layers(split)
        self.balancer = None
        if auto and self.zce_share and not _simulated(self.backends):
            self.balancer = ShareBalancer(self.zce_share, self.cfg.n_expert_used)
        self.policy = offload_policy if isinstance(offload_policy, OffloadPolicy) else OffloadPolicy.parse(offload_policy)
        if self.ep:              # the experts are the ranks': never uploaded for a prompt
            self.policy = self.policy.without_experts()
        self.tokenizer = Tokenizer.from_meta(meta)
        self.n_ubatch = max(1, int(n_ubatch))
        if n_ctx is not None and n_ctx < 0:
            raise NbmoeError(f"context size must be 0 or more (0 = the model's "
                             f"{self.cfg.n_ctx_train}), got {n_ctx}")
        n_ctx = n_ctx or self.cfg.n_ctx_train      # as llama.cpp's -c 0
        kv_role = "attn_kv_a_mqa" if self.cfg.is_mla else "attn_q"     # where the layer's keys are made
        kv_place = [self.placement[f"blk.{il}.{kv_role}.weight"][0] for il in range(self.cfg.n_layer)]
        self.kv = KVCache(self.cfg, n_ctx, {b: be.alloc for b, be in self.backends.items()}, kv_place,
                          cache_type_k, cache_type_v)     # f16, bf16 or q8_0 (kv_cache.py)
        # n_slots sequences share the cache, n_ctx // n_slots positions each (use_slot)
        self.slots = [Slot(view) for view in self.kv.slot_views(max(1, int(n_slots)))]
        self.n_ctx = self.slots[0].kv.n_ctx     # a sequence's context
        self.slot = 0
        self.state = _State(self.slots[0].kv)
        # a recorded CUDA graph holds the cache's addresses: one small-batch plan per slot then
        self._plan_per_slot = len(self.slots) > 1 and any(
            getattr(getattr(be, "graphs", None), "ENABLED", False) for be in self.backends.values())
        self._plans = {}
        self._no_flash_warned = set()
        self.last_stats = {}

    def _place(self, n_gpu_layers, override_tensors, cpu_moe, n_cpu_moe):
        """{tensor: (buffer type, cause)}; GPU buffer types only where a GPU backend exists."""
        devices = []
        if n_gpu_layers or override_tensors:
            from nbmoe.backends.cuda import device_names
            devices = device_names()
            if self.ep and self.ep.devices[0] is not None:    # --ep-gpu: one GPU per rank
                devices = [f"CUDA{self.ep.devices[0]}"]
            if n_gpu_layers and not devices:
                warnings.warn(f"no usable CUDA GPU: -ngl {n_gpu_layers} is ignored, every layer "
                              "runs on the CPU", stacklevel=3)
        buftypes = ["CPU"] + devices
        user = parse_overrides(override_tensors, buftypes, n_ranks=self.ep.n_ranks if self.ep else 1)
        rules = ((self.ep.overrides() if self.ep else []) + [o for o in user if not is_rank(o)]
                 + moe_overrides(cpu_moe, n_cpu_moe))     # (the ep's layout has the RANKn rules)
        return place_tensors(self.weights, self.cfg.n_layer, n_gpu_layers, rules, devices)

    def _split_layers(self):
        """{layer: GPU}: the MoE layers whose router runs on a GPU while their experts stay in
        RAM, in types that GPU reads in place (model.moe_ffn: not with post-FFN norms)."""
        place = lambda name: self.placement[name][0]
        if not self.cfg.is_moe or self.cfg.flags.post_norms:
            return {}
        from nbmoe.cuda.quants import is_supported
        layers = {}
        for il in filter(self.cfg.is_moe_layer, range(self.cfg.n_layer)):
            exps = self.expert_tensors(il)
            router = place(f"blk.{il}.ffn_gate_inp.weight")
            if (router != "CPU" and all(place(e) == "CPU" for e in exps)
                    and all(is_supported(int(self.weights[e].ggml_type)) for e in exps)):
                layers[il] = router
        return layers

    def _zero_copy_layers(self, split, n, auto=False):
        """{layer: (GPU, slots)}: the split layers (`split`, _split_layers) where, for one-token
        batches, that GPU computes `slots` = min(n, A - 1) of the chosen experts, reading their
        weights in place (model.moe_ffn, -zce). auto: none is no error."""
        if n <= 0:
            return {}
        layers = {il: (gpu, min(n, self.cfg.n_expert_used - 1))
                  for il, gpu in split.items()}
        if (not layers or max(s for _, s in layers.values()) == 0) and not auto:
            raise NbmoeError("-zce needs a MoE layer whose router is on a GPU and whose experts "
                             "are in RAM (e.g. -ngl 99 -ot exps=CPU), and more than one active expert")
        return {il: v for il, v in layers.items() if v[1] > 0}

    def _shared_ahead_layers(self, split):
        """The split layers (`split`, _split_layers) whose shared experts live on the routing
        GPU: for one-token batches that GPU computes them while the CPU computes the routed experts."""
        if not self.cfg.n_shared_expert:
            return frozenset()
        return frozenset(il for il, gpu in split.items()
                         if all(b == gpu for name, (b, _) in self.placement.items()
                                if name.startswith(f"blk.{il}.") and "_shexp." in name))

    def expert_tensors(self, il):
        """Layer il's expert matrices: gate and up (or their merge, -muge), down."""
        roles = ("gate_up", "down") if il in self.merged_layers else ("gate", "up", "down")
        return [f"blk.{il}.ffn_{k}_exps.weight" for k in roles]

    def buffer_of(self, name):
        """The buffer type of a file's tensor, also of one merged into ffn_gate_up_exps (-muge)."""
        if name not in self.placement:
            from nbmoe.loader.merge import merged_name
            name = merged_name(name)
        return self.placement[name][0]

    def explain_lines(self):
        """--explain's lines about how the engine loaded the model (-muge, or a file that ships
        merged up and gate experts)."""
        if self.merge_notes is None and not self.merged_layers:
            return []
        from nbmoe.loader.merge import explain_line
        merged, notes = self.merge_notes or ((), {})
        return [explain_line(merged, notes, sorted(self.merged_layers - set(merged)))]

    def _lock_ram_for_zero_copy(self, auto):
        """Page-lock the file's RAM matrices now (the GPUs read the experts in place); if the
        driver refuses, -zce auto quietly keeps every expert on the CPU."""
        for be in self.backends.values():
            if getattr(be, "zero_copy", None):
                try:
                    be.lock_ram()
                except NbmoeError:
                    if not auto:
                        raise
                    self.gpu_slots = {}
                    return

    def _gpu_backends(self):
        """One CUDA backend per GPU that holds weights (none: the CPU-only engine)."""
        on_gpu = {t: b for t, (b, _) in self.placement.items() if b != "CPU"}
        if not on_gpu:
            return {}
        from nbmoe.backends.cuda import CUDABackend
        from nbmoe.cuda.quants import is_supported
        for name, buftype in on_gpu.items():   # before anything is uploaded
            if not is_supported(int(self.weights[name].ggml_type)):
                raise NbmoeError(f"tensor {name} has type {self.weights[name].type_name}, "
                                 f"which the {buftype} backend does not support")
        # matrices in RAM that a GPU may upload (offload) or read in place (-zce); never the
        # embedding (its rows are looked up on the CPU)
        in_ram = [t for t, (b, _) in self.placement.items()
                  if b == "CPU" and len(self.weights[t].ne) > 1 and t != "token_embd.weight"]
        in_place = {gpu: [name for il, (g, _) in self.gpu_slots.items() if g == gpu
                          for name in self.expert_tensors(il)]
                    for gpu in set(on_gpu.values())}
        return {n: CUDABackend(n, self.weights, [t for t, b in on_gpu.items() if b == n], in_ram,
                               in_place[n], self.flash_attn, upload_all=self.upload_all_experts)
                for n in sorted(set(on_gpu.values()))}

    # ---- tokens -------------------------------------------------------------------------
    def tokenize(self, text, add_bos=None, special=True):
        return self.tokenizer.encode(text, add_bos=add_bos, parse_special=special)

    def detokenize(self, ids):
        return self.tokenizer.decode(list(ids))

    # ---- slots --------------------------------------------------------------------------
    @property
    def tokens(self):
        """Token ids whose keys/values are in the active slot's cache."""
        return self.slots[self.slot].tokens

    @tokens.setter
    def tokens(self, ids):
        self.slots[self.slot].tokens = list(ids)

    def use_slot(self, i):
        """Make slot i the active sequence: eval / generate continue its cache and tokens."""
        if not 0 <= i < len(self.slots):
            raise NbmoeError(f"slot {i} does not exist (the engine has {len(self.slots)})")
        self.slot, self.state.kv = i, self.slots[i].kv

    # ---- evaluation ---------------------------------------------------------------------
    def reset(self):
        """Empty the active slot's KV cache."""
        self.tokens = []

    def plan(self, n_tokens, n_logits, per_row=False):
        """The bound plan of a micro-batch (made once per shape). per_row: each row is another
        slot's next token (decode_slots); it reads the whole cache, so one plan (one CUDA graph
        per batch size) serves every mix of slots."""
        one = n_tokens == 1 and not per_row
        share, ahead = (self.zce_share, self.shared_ahead) if one else (0, ())
        graphed = self._plan_per_slot and n_tokens <= scheduler.GRAPH_MAX_T
        key = (n_tokens, n_logits, share, "rows" if per_row else self.slot if graphed else 0)
        if key not in self._plans:
            g = build_graph(self.cfg, n_tokens, n_logits, "output.weight", self.fused_moe,
                            self.merged_layers, per_row, self.mla_expands(n_tokens, per_row))
            if share or ahead:   # -zce: a GPU computes part of each layer's experts
                split_expert_slots(g, [share if il in self.gpu_slots else 0
                                       for il in range(self.cfg.n_layer)], ahead)
            # several slots: prompt plans launch kernel by kernel (a recording holds one
            # slot's cache: a plan a slot would multiply their activation buffers)
            self._plans[key] = make_plan(g, self.backends, self.state,
                                         lambda name: self.placement[name][0], self.policy, self.cfg,
                                         prompt_graphs=len(self.slots) == 1)
            self._warn_no_flash()
        return self._plans[key]

    def mla_expands(self, n_tokens, per_row=False):
        """Whether a batch's MLA attention takes the expanded form (model/forward.py): a prompt
        batch of config.MLA_EXPAND_MIN_TOKENS or more, with flash attention, over an f16 cache,
        where every backend has a flash kernel for its key and value widths."""
        c = self.cfg
        return (c.is_mla and not per_row and n_tokens >= config.MLA_EXPAND_MIN_TOKENS
                and self.flash_attn != "off" and self.kv.type_k == "f16"
                and all(be.attn.flash_used(n_tokens, c.qk_nope_dim + c.n_rot, ("f16", "f16"),
                                           c.v_head_dim) for be in self.backends.values()))

    def _warn_no_flash(self):
        """-fa on: one warning per backend and head dim whose prompts have no flash kernel."""
        for name, be in self.backends.items():
            for dh in sorted(be.no_flash - self._no_flash_warned):
                warnings.warn(f"-fa on: {name} has no flash attention kernel for head dim {dh}; "
                              f"its prompts use the plain kernel", stacklevel=4)
            self._no_flash_warned |= be.no_flash

    def _decode(self, ids, all_logits, timings=None):
        """Run `ids` through the model after the cached tokens, in micro-batches of n_ubatch.
        Returns logits of every position (all_logits) or of the last one only."""
        ids = [int(i) for i in ids]
        if not ids:
            raise NbmoeError("nothing to evaluate: empty token list")
        if len(self.tokens) + len(ids) > self.n_ctx:
            raise NbmoeError(f"{len(ids)} tokens after {len(self.tokens)} cached exceed the "
                             f"context of {self.n_ctx} (use a larger -c / n_ctx)")
        bad = [i for i in ids if not 0 <= i < self.cfg.n_vocab]
        if bad:
            raise NbmoeError(f"token id {bad[0]} outside the vocabulary of {self.cfg.n_vocab}")
        numba.set_num_threads(self.threads)
        out = []
        for start in range(0, len(ids), self.n_ubatch):
            chunk = ids[start:start + self.n_ubatch]
            last = start + len(chunk) == len(ids)
            n_logits = len(chunk) if all_logits else (1 if last else 0)
            plan = self.plan(len(chunk), n_logits)
            plan.buffers["tokens"][:] = chunk
            plan.buffers["pos"][:] = np.arange(len(self.tokens), len(self.tokens) + len(chunk))
            self.state.pos0 = len(self.tokens)
            if timings is not None:
                plan.run_timed(timings)
            elif len(chunk) == 1 and self.balancer is not None and self.balancer.due():
                self._run_balancing(plan)
            else:
                plan.run()
            self.tokens.extend(chunk)
            if n_logits:
                out.append(plan.buffers["logits"].copy())
        return np.concatenate(out) if all_logits else out[-1][-1]

    def _run_balancing(self, plan):
        """Run a one-token plan with its GPU and CPU expert shares timed, then let the
        balancer pick the share the next tokens use (zero_copy.py)."""
        steps = sampled_layers(plan)
        for s in steps:
            s.measure, s.cpu_share_seconds = True, None
        try:
            plan.run()
        finally:
            for s in steps:
                s.measure = False
        self.zce_share = self.balancer.update(*measured_times(steps))

    def decode_slots(self, rows):
        """One token for each of several slots as one batch: rows [(slot, token id), ...], a
        slot at most once. Every weight is read once for all rows; only rope, the KV write and
        attention are per row (each over its own slot's cache). Returns logits [B, n_vocab]
        float32, row b for rows[b]; each token is appended to its slot's tokens."""
        rows = [(int(s), int(t)) for s, t in rows]
        slots = [s for s, _ in rows]
        if not rows:
            raise NbmoeError("nothing to evaluate: no slot given")
        if len(set(slots)) != len(slots):
            raise NbmoeError(f"decode_slots: a slot appears twice in {slots}")
        for s, tok in rows:
            if not 0 <= s < len(self.slots):
                raise NbmoeError(f"slot {s} does not exist (the engine has {len(self.slots)})")
            if len(self.slots[s].tokens) + 1 > self.n_ctx:
                raise NbmoeError(f"slot {s} is full: its context of {self.n_ctx} tokens holds no "
                                 f"more (use a larger -c / n_ctx)")
            if not 0 <= tok < self.cfg.n_vocab:
                raise NbmoeError(f"token id {tok} outside the vocabulary of {self.cfg.n_vocab}")
        if len(rows) == 1:           # one slot: the one-token path and its fused kernels
            active = self.slot
            self.use_slot(slots[0])
            try:
                return self._decode([rows[0][1]], all_logits=True)
            finally:
                self.use_slot(active)
        numba.set_num_threads(self.threads)
        B = len(rows)
        plan = self.plan(B, B, per_row=True)
        pos = np.array([len(self.slots[s].tokens) for s in slots], np.int32)
        plan.buffers["tokens"][:] = [t for _, t in rows]
        plan.buffers["pos"][:] = pos
        plan.buffers["kv_row"][:] = pos + np.array([self.slots[s].kv.start for s in slots], np.int32)
        view, self.state.kv = self.state.kv, self.kv     # the per-row kernels address the whole cache
        try:
            plan.run()
        finally:
            self.state.kv = view
        for s, tok in rows:
            self.slots[s].tokens.append(tok)
        return plan.buffers["logits"].copy()

    def eval(self, ids):
        """Logits [len(ids), n_vocab] float32 for `ids`, appended after the cached tokens."""
        return self._decode(ids, all_logits=True)

    def eval_last(self, ids):
        """Logits [n_vocab] of the last of `ids` only, appended after the cached tokens."""
        return self._decode(ids, all_logits=False)

    # ---- generation ---------------------------------------------------------------------
    def reuse_prefix(self, ids):
        """Keep the cached tokens that `ids` starts with; return the ids still to evaluate."""
        n = 0
        limit = min(len(self.tokens), len(ids) - 1)   # always evaluate at least one token
        while n < limit and self.tokens[n] == ids[n]:
            n += 1
        del self.tokens[n:]
        return ids[n:]

    def generate_ids(self, prompt_ids, max_tokens=128, sampler=None, stop_ids=None):
        """Yield generated token ids. The cache keeps the longest common prefix of the
        previous sequence and this prompt (so a chat pays only for its new turn).
        max_tokens < 0: until a stop token or the context's end. last_stats["stop"] says why
        it ended: "stop" (a stop token), "length" (max_tokens), "context" (the context is
        full), None while running or when the caller stopped reading."""
        sampler = sampler or Sampler(SamplingParams(temperature=0.0))
        stop = self.tokenizer.stop_ids if stop_ids is None else stop_ids
        prompt_ids = list(prompt_ids)
        t0 = time.perf_counter()
        todo = self.reuse_prefix(prompt_ids)
        logits = self._decode(todo, all_logits=False)
        t1 = time.perf_counter()
        stats = self.last_stats = dict(n_prompt=len(todo), t_prompt=t1 - t0, n_gen=0, t_gen=0.0,
                                       stop=None if max_tokens else "length")
        for i in range(max_tokens) if max_tokens >= 0 else itertools.count():
            tok = sampler.sample(logits, self.tokens)
            if tok in stop:
                stats["stop"] = "stop"
                break
            stats["n_gen"] += 1
            yield tok
            if i + 1 == max_tokens or len(self.tokens) >= self.n_ctx:
                stats["stop"] = "length" if i + 1 == max_tokens else "context"
                break
            logits = self._decode([tok], all_logits=False)
            stats["t_gen"] = time.perf_counter() - t1

    def generate(self, prompt, max_tokens=128, temperature=0.8, top_k=40, top_p=0.95,
                 min_p=0.05, repeat_penalty=1.0, seed=None, add_bos=None):
        """Yield text pieces as they are generated (UTF-8 characters are never split)."""
        ids = self.tokenize(prompt, add_bos=add_bos) if isinstance(prompt, str) else list(prompt)
        params = SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty, seed=seed)
        stream = self.tokenizer.stream()
        for tok in self.generate_ids(ids, max_tokens, Sampler(params)):
            piece = stream.push(tok)
            if piece:
                yield piece
        rest = stream.flush()
        if rest:
            yield rest


def flash_attn_mode(value):
    """-fa as llama.cpp names it: "auto", "on" or "off" (also 1 / 0, True / False); None:
    config.FLASH_ATTN."""
    from nbmoe import config
    v = config.FLASH_ATTN if value is None else value
    v = {True: "on", False: "off", 1: "on", 0: "off", "1": "on", "0": "off"}.get(v, v)
    v = v.strip().lower() if isinstance(v, str) else v
    if v not in config.FLASH_ATTN_MODES:
        raise NbmoeError(f"flash attention must be one of auto, on, off (or 1, 0), got {value!r}")
    return v


def _simulated(backends):
    """The CUDA simulator has no device clock to balance the shares by."""
    return any(getattr(be, "sim", False) for be in backends.values())


def usable_threads(threads):
    """The thread count to run: all cores for None; above Numba's pool (NUMBA_NUM_THREADS,
    by default the core count) a warning and the pool's size, since Numba cannot run more."""
    if threads is None:
        return default_threads()
    if threads < 1:
        raise NbmoeError(f"threads must be at least 1, got {threads}")
    pool = numba.config.NUMBA_NUM_THREADS
    if threads > pool:
        warnings.warn(f"{threads} threads asked, but Numba's pool has {pool} (NUMBA_NUM_THREADS, "
                      f"by default the core count): using {pool}", stacklevel=2)
        return pool
    return threads


def default_threads():
    """Like llama.cpp: one thread per available core (at most Numba's pool size)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(n or 1, numba.config.NUMBA_NUM_THREADS))


def load(path=None, n_ctx=2048, threads=None, n_ubatch=512, repack=False, n_slots=1,
         cache_type_k="f16", cache_type_v="f16", **placement):
    """Open a GGUF model; without a path, the default model (SmolLM2-135M-Instruct upcycled
    to 8 experts, built into the cache on first use: loader/default_model.py). n_ctx: 0 = the
    model's training context. repack: rewrite the RAM-resident Q4_0 / Q4_1 / Q8_0 / Q4_K /
    IQ4_NL / IQ4_XS / MXFP4 matrices for the CPU kernels (llama.cpp's -rtr; see repack.py). Placement
    options (hybrid CPU + GPU): n_gpu_layers, override_tensors (["REGEX=BUFTYPE", ...]),
    offload_policy ("-op" string or OffloadPolicy), cpu_moe, n_cpu_moe, zero_copy_experts
    (of each generated token's chosen experts whose weights are in RAM, how many the GPU
    computes, reading the weights in place over PCIe while the CPU computes the others;
    "auto" = from 3/8 of them, balanced while generating (zero_copy.py), where a GPU routes
    a layer whose experts are in RAM; 0 = none), flash_attn ("auto", "on", "off": prompts on
    the flash attention kernels where a backend has one, as llama.cpp's -fa), fused_moe (-fmoe:
    the experts' gate, up and GLU as one op, MUL_MAT_ID_GLU; False: three), upload_all_experts
    (an offloaded expert product uploads its whole tensor, not only the experts the router
    chose), merge_up_gate (-muge: each MoE layer's gate and up experts merged at load into one
    tensor, where they live, so one product computes both; loader/merge.py), n_slots
    (sequences that share the cache, n_ctx // n_slots positions each;
    llm.use_slot(i) picks the one eval / generate continue)., cache_type_k,
    cache_type_v (the KV cache's types, f16, bf16 or q8_0: llama.cpp's -ctk / -ctv;
    model/kv_cache.py)."""
    if path is None:
        from nbmoe.loader.default_model import default_model_path
        path = default_model_path()
    return LLM(path, n_ctx=n_ctx, threads=threads, n_ubatch=n_ubatch, repack=repack,
               n_slots=n_slots, cache_type_k=cache_type_k, cache_type_v=cache_type_v, **placement)
