// What llama.cpp does with a GGUF vocabulary: token ids, end-of-generation tokens, and the
// chat prompt its Jinja engine renders. tools/llamacpp/record_text.py builds and drives it, and
// writes the answers to tests/data/ for nbmoe's tests.
//
//   tokenize VOCAB.gguf ids IN PARSE_SPECIAL ADD_SPECIAL   one line of ids per text
//   tokenize VOCAB.gguf info                               EOG ids, and each token's attributes
//   tokenize VOCAB.gguf chat TEMPLATE IN [TOOLS]           the prompt for the messages in IN
//
// IN holds NUL-terminated strings: texts for `ids`, role/content pairs for `chat`; TOOLS
// holds name/description/parameters-JSON triples.
#include "llama.h"
#include "chat.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

static std::string read_file(const char * path) {
    std::ifstream f(path, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

static std::vector<std::string> split_nul(const std::string & data) {
    std::vector<std::string> out;
    size_t start = 0;
    for (size_t i = 0; i < data.size(); ++i) {
        if (data[i] == '\0') {
            out.push_back(data.substr(start, i - start));
            start = i + 1;
        }
    }
    return out;
}

static void quiet_log(enum ggml_log_level, const char *, void *) {}

int main(int argc, char ** argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s VOCAB.gguf ids|info|chat ...\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const std::string mode = argv[2];

    if (mode == "ids" && argc == 6) {
        const bool parse_special = atoi(argv[4]) != 0;
        const bool add_special = atoi(argv[5]) != 0;
        for (const std::string & text : split_nul(read_file(argv[3]))) {
            // a first call with no room returns minus the number of tokens needed
            int n = -llama_tokenize(vocab, text.data(), (int) text.size(), nullptr, 0,
                                    add_special, parse_special);
            std::vector<llama_token> ids(n > 0 ? n : 0);
            if (n > 0) {
                llama_tokenize(vocab, text.data(), (int) text.size(), ids.data(), n,
                               add_special, parse_special);
            }
            for (size_t i = 0; i < ids.size(); ++i) {
                printf(i ? " %d" : "%d", ids[i]);
            }
            printf("\n");
        }
    } else if (mode == "info") {
        const int n = llama_vocab_n_tokens(vocab);
        printf("n_tokens %d\neog", n);
        for (int i = 0; i < n; ++i) {
            if (llama_vocab_is_eog(vocab, i)) {
                printf(" %d", i);
            }
        }
        printf("\nattr");
        for (int i = 0; i < n; ++i) {
            printf(" %d", (int) llama_vocab_get_attr(vocab, i));
        }
        printf("\n");
    } else if (mode == "chat" && (argc == 5 || argc == 6)) {
        auto tmpls = common_chat_templates_init(model, read_file(argv[3]));
        common_chat_templates_inputs inputs;
        std::vector<std::string> parts = split_nul(read_file(argv[4]));
        for (size_t i = 0; i + 1 < parts.size(); i += 2) {
            common_chat_msg msg;
            msg.role = parts[i];
            msg.content = parts[i + 1];
            inputs.messages.push_back(msg);
        }
        if (argc == 6) {
            std::vector<std::string> t = split_nul(read_file(argv[5]));
            for (size_t i = 0; i + 2 < t.size(); i += 3) {
                inputs.tools.push_back({t[i], t[i + 1], t[i + 2]});
            }
        }
        inputs.add_generation_prompt = true;
        inputs.use_jinja = true;
        common_chat_params params = common_chat_templates_apply(tmpls.get(), inputs);
        fwrite(params.prompt.data(), 1, params.prompt.size(), stdout);
    } else {
        fprintf(stderr, "bad arguments for mode %s\n", mode.c_str());
        return 2;
    }
    llama_model_free(model);
    return 0;
}
