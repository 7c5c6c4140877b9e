"""The shapes of real models that tools/make_model.py copies (--preset), from their
config.json and llama.cpp's GGUF keys."""

# deepseek2's MLA and routing (make_model's `mla` argument; defaults in MLA_DEFAULTS), from
# the models' config.json: kv_lora_rank, q_lora_rank (0: V2-Lite's plain attn_q), the roped /
# unroped dims of a q / k head, a v head's dims, leading dense layers, shared experts, gating
# (softmax; sigmoid with the exp_probs_b selection bias), expert groups, routed scale,
# norm_topk, and YaRN's mscale_all_dim (written x 0.1 as yarn_log_multiplier); kv_b: the older
# layout, one attn_kv_b a layer in place of attn_k_b / attn_v_b (nbmoe/loader/mla.py).
MLA_DEFAULTS = dict(kv_lora_rank=512, q_lora_rank=0, rope_dim=64, nope_dim=128, v_dim=128,
                    n_dense=1, n_shared=1, gating="softmax", n_group=0, topk_group=0,
                    routed_scale=1.0, norm_topk=False, mscale_all_dim=None, kv_b=False)
_V2_LITE = dict(MLA_DEFAULTS, n_shared=2, mscale_all_dim=0.707)
_V3 = dict(MLA_DEFAULTS, q_lora_rank=1536, n_dense=3, gating="sigmoid", n_group=8, topk_group=4,
           routed_scale=2.5, norm_topk=True, mscale_all_dim=1.0)

PRESETS = {
    "qwen3-30b-a3b": dict(arch="qwen3moe", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4,
                          head_dim=128, n_ff=6144, n_expert=128, n_expert_used=8, n_ff_exp=768,
                          n_vocab=151936, n_ctx=40960, rope_base=1e6, rms_eps=1e-6,
                          tie_embeddings=False),
    "mixtral-8x7b": dict(arch="llama", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8,
                         n_ff=14336, n_expert=8, n_expert_used=2, n_vocab=32000, n_ctx=32768,
                         rope_base=1e6, rms_eps=1e-5, tie_embeddings=False),
    "qwen3-0.6b": dict(arch="qwen3", n_layer=28, n_embd=1024, n_head=16, n_head_kv=8,
                       head_dim=128, n_ff=3072, n_vocab=151936, n_ctx=40960, rope_base=1e6,
                       rms_eps=1e-6, tie_embeddings=True),
    "smollm2-135m": dict(arch="llama", n_layer=30, n_embd=576, n_head=9, n_head_kv=3,
                         n_ff=1536, n_vocab=49152, n_ctx=8192, rope_base=1e5, rms_eps=1e-5,
                         tie_embeddings=True),
    # as the published GGUFs (convert_hf_to_gguf.py's GptOssModel): experts MXFP4 as released,
    # the other matrices Q8_0; norms, router, biases and sinks F32; YaRN 32x over 4096
    # positions; a 128-token window on the even layers
    "gpt-oss-20b": dict(arch="gpt-oss", n_layer=24, n_embd=2880, n_head=64, n_head_kv=8,
                        head_dim=64, n_ff=2880, n_expert=32, n_expert_used=4, n_ff_exp=2880,
                        n_vocab=201088, n_ctx=131072, rope_base=150000.0, rms_eps=1e-5,
                        tie_embeddings=False, sliding_window=128, yarn=(32.0, 4096),
                        types=(("_exps", "MXFP4"),)),
    "gpt-oss-120b": dict(arch="gpt-oss", n_layer=36, n_embd=2880, n_head=64, n_head_kv=8,
                         head_dim=64, n_ff=2880, n_expert=128, n_expert_used=4, n_ff_exp=2880,
                         n_vocab=201088, n_ctx=131072, rope_base=150000.0, rms_eps=1e-5,
                         tie_embeddings=False, sliding_window=128, yarn=(32.0, 4096),
                         types=(("_exps", "MXFP4"),)),
    # GLM-4.5-Air's config.json as convert_hf_to_gguf.py writes it: q/k/v biases, no q/k
    # norms, half of each head rotated, 1 shared expert, layer 0 dense, one NextN block after
    # the 46 layers (kept with --layers); sigmoid routing with a selection bias, scale 1
    "glm-4.5-air": dict(arch="glm4moe", n_layer=46, n_embd=4096, n_head=96, n_head_kv=8,
                        head_dim=128, n_ff=10944, n_expert=128, n_expert_used=8, n_ff_exp=1408,
                        n_shared=1, n_leading_dense=1, n_nextn=1, routed_scale=1.0,
                        qk_norm=False, n_vocab=151552, n_ctx=131072, rope_base=1e6,
                        rms_eps=1e-5, tie_embeddings=False),
    # as convert_hf_to_gguf.py writes DeepSeek (MLA split into attn_k_b / attn_v_b, one kv head);
    # attn_k_b's rows (128) fit no 256-block type: Q8_0, as llama.cpp's quantizer falls back
    "deepseek-v2-lite": dict(arch="deepseek2", n_layer=27, n_embd=2048, n_head=16, n_head_kv=1,
                             n_ff=10944, n_expert=64, n_expert_used=6, n_ff_exp=1408,
                             n_vocab=102400, n_ctx=163840, rope_base=10000.0, rms_eps=1e-6,
                             tie_embeddings=False, yarn=(40.0, 4096), mla=_V2_LITE,
                             types=(("attn_k_b", "Q8_0"),)),
    "deepseek-v3": dict(arch="deepseek2", n_layer=61, n_embd=7168, n_head=128, n_head_kv=1,
                        n_ff=18432, n_expert=256, n_expert_used=8, n_ff_exp=2048,
                        n_vocab=129280, n_ctx=163840, rope_base=10000.0, rms_eps=1e-6,
                        tie_embeddings=False, yarn=(40.0, 4096), mla=_V3,
                        types=(("attn_k_b", "Q8_0"),)),
}
