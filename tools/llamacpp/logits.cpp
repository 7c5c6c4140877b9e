// Teacher-forced logits of a GGUF through llama.cpp, for checking nbmoe against it.
//
//   logits MODEL OUT THREADS MODE FA TOKEN...
//
// MODE: "batch" (every token in one llama_decode) or "seq" (one token per call, as decoding
// does). FA: 0 = plain attention, 1 = flash attention. OUT receives float32 logits, row t =
// the logits after token t, [T, n_vocab] in row-major order; stdout gets "T n_vocab".
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static int fail(const std::string & msg) {
    fprintf(stderr, "logits: %s\n", msg.c_str());
    return 1;
}

int main(int argc, char ** argv) {
    if (argc < 7) {
        return fail("usage: logits MODEL OUT THREADS batch|seq FA TOKEN...");
    }
    const char * model_path = argv[1];
    const char * out_path   = argv[2];
    const int    n_threads  = atoi(argv[3]);
    const std::string mode  = argv[4];
    const int    fa         = atoi(argv[5]);
    if (mode != "batch" && mode != "seq") {
        return fail("MODE must be batch or seq, not " + mode);
    }
    std::vector<llama_token> tokens;
    for (int i = 6; i < argc; i++) {
        tokens.push_back((llama_token) atoi(argv[i]));
    }
    const int n_tokens = (int) tokens.size();

    llama_log_set([](ggml_log_level level, const char * text, void *) {
        if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);   // errors only
    }, nullptr);
    llama_backend_init();

    llama_model_params mparams = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(model_path, mparams);
    if (model == nullptr) {
        return fail(std::string("cannot load ") + model_path);
    }
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = (uint32_t) (n_tokens < 256 ? 256 : n_tokens);
    cparams.n_threads = cparams.n_threads_batch = n_threads;
    cparams.flash_attn_type = fa ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (ctx == nullptr) {
        return fail("cannot create a context");
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    for (llama_token t : tokens) {
        if (t < 0 || t >= n_vocab) {
            return fail("token id " + std::to_string(t) + " is outside the vocabulary");
        }
    }

    // batch mode: one call, logits for every row; seq mode: one row per call
    std::vector<float> logits((size_t) n_tokens * n_vocab);
    const int step = mode == "batch" ? n_tokens : 1;
    llama_batch batch = llama_batch_init(step, 0, 1);
    for (int t0 = 0; t0 < n_tokens; t0 += step) {
        batch.n_tokens = step;
        for (int i = 0; i < step; i++) {
            batch.token[i]     = tokens[t0 + i];
            batch.pos[i]       = t0 + i;
            batch.n_seq_id[i]  = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i]    = 1;
        }
        if (llama_decode(ctx, batch) != 0) {
            return fail("llama_decode failed at token " + std::to_string(t0));
        }
        for (int i = 0; i < step; i++) {
            memcpy(&logits[(size_t) (t0 + i) * n_vocab], llama_get_logits_ith(ctx, i), sizeof(float) * n_vocab);
        }
    }
    llama_batch_free(batch);

    FILE * f = fopen(out_path, "wb");
    if (f == nullptr || fwrite(logits.data(), sizeof(float), logits.size(), f) != logits.size()) {
        return fail(std::string("cannot write ") + out_path);
    }
    fclose(f);
    printf("%d %d\n", n_tokens, n_vocab);

    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
