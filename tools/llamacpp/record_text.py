"""Record what llama.cpp does with gpt-oss's tokenizer and chat template, for nbmoe's tests.

    python tools/llamacpp/record_text.py --llama-cpp DIR      # or LLAMA_CPP_DIR=DIR

No o200k vocabulary is at hand offline, so the test vocabulary is llama.cpp's GPT-2 one
(models/ggml-vocab-gpt-2.gguf: byte-level BPE, 50k tokens) with `tokenizer.ggml.pre` set to
"gpt-4o" and the harmony control tokens appended, written to tests/data/vocab-gpt4o.gguf.
tokenize.cpp, built here against llama.cpp's CPU build (libllama, libllama-common), then gives
  - the ids of many texts, special tokens parsed or not  -> tests/data/gpt4o_tokenizer.json
  - its end-of-generation set and token attributes       -> the same file
  - the gpt-oss template rendered by its Jinja engine     -> tests/data/gpt_oss_chat.json
"""
import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DATA = os.path.join(ROOT, "tests", "data")
LLAMA_CPP = os.environ.get("LLAMA_CPP_DIR")       # a llama.cpp source tree with build/bin

# o200k_harmony's special tokens, in their id order there
HARMONY = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
           "<|start|>", "<|end|>", "<|message|>", "<|call|>"]

TEXTS = [
    "", " ", "  ", "\t", "\n", "\n\n\n", " \n", "\r\n", "Hello world", " Hello world",
    "Hello World HELLO wORLD hELLO", "I'm you're he's they've we'd I'll it's",
    "I'M YOU'RE HE'S THEY'VE WE'D I'LL IT'S", "don't DON'T Don'T", "'s 's' ''s",
    "CamelCaseWords and snake_case_words and SCREAMING_CASE", "JSONParser XMLHttpRequest iPhone",
    "1 12 123 1234 12345 123456 1234567 12345678 123456789 1234567890",
    "3.14159 -42 +7 1,000,000 0x1F 1e-10 2024-06-01", "٣٤٥ ١٢٣٤ ⅻ ½ ²³",
    "über naïve café résumé ÉCOLE Ünïcödé", "Straße ΑΒΓ αβγ Ωmega ǅungla",
    "Привет мир ПРИВЕТ", "日本語のテキスト、東京。", "中文测试：你好，世界！", "한국어 텍스트",
    "emoji 😀🚀 test 👍🏽 👨‍👩‍👧", "e\u0301 a\u0300b\u0327 Z\u0351\u0352",
    "नमस्ते दुनिया", "ภาษาไทย", "مرحبا بالعالم",
    "def f(x):\n    return x**2  # square\n", "if (a && b) { c = d->e[0]; }\n\treturn;",
    "<p>a> </b> <div class=\"x\">", "https://example.com/a/b?c=1&d=2#frag",
    "   leading and trailing   ", "tabs\tand\nnewlines\n\n\n", "a  b   c    d", "x\r\ny\rz",
    "!!!??? ... --- ***", "$100 + 50% = <=> ^ ~ |", "path/to/file.txt /usr/bin/",
    "\u00a0nbsp\u00a0 \u3000ideo\u3000 \u2028line\u2029 \u200bzw\ufeff", "\x1c\x1d\x1e\x1f sep",
    "\u0085nel\u0085", "ends with space ", "a\n\n b\n \n c", "word.\nNext", "x\n\ty",
    "<|start|>user<|message|>Hi<|end|>",
    "<|start|>assistant<|channel|>analysis<|message|>Think.<|end|>",
    "<|channel|>final<|message|>Answer!<|return|>", "<|call|><|constrain|>json",
    "<|endoftext|>text<|startoftext|>", "a<|end|>b<|start|>c", "<|end|><|end|>",
    "ඞ𓀀\U000e0041 \U0001f9d1\u200d\U0001f4bb",
]

# the random texts draw pieces from here: letters of both cases and scripts, digits, marks,
# contraction quotes, whitespace of every kind, symbols, CJK, emoji
ALPHABET = (list("aAbBzZ09'’ \t\n\r.,;:!?-_/\\\"()[]{}<>$+=^~|`@#%&*")
            + ["é", "É", "ß", "Ω", "ω", "ǅ", "\u0301", "\u0300", "日", "本", "の", "한",
               "😀", "👍🏽", "\u00a0", "\u3000", "٣", "½", "ⅻ", "'s", "'LL", "'Re", " the",
               "HTTP", "Json", "  ", "\n\n", "123", "4567", "<|end|>", "<|start|>", "<|message|>"])


def make_texts(n_random=200, seed=0):
    rng = random.Random(seed)
    randoms = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 24)))
               for _ in range(n_random)]
    return TEXTS + randoms


def write_vocab(src, dst, template):
    """llama.cpp's GPT-2 vocab with pre "gpt-4o", the harmony specials (control, type 3) and
    gpt-oss's chat template, as a gpt-oss GGUF carries them."""
    r = GGUFReader(src)

    def array(key):
        f = r.fields[key]
        return [f.parts[i] for i in f.data]

    tokens = [bytes(p).decode() for p in array("tokenizer.ggml.tokens")]
    types = [int(p[0]) for p in array("tokenizer.ggml.token_type")]
    merges = [bytes(p).decode() for p in array("tokenizer.ggml.merges")]
    ids = {}
    for t in HARMONY:
        if t not in tokens:
            tokens.append(t)
            types.append(3)
        ids[t] = tokens.index(t)
    w = GGUFWriter(dst, "gpt2")
    w.add_name("gpt-2 vocab, gpt-4o pre-tokenizer, harmony specials")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(ids["<|startoftext|>"])
    w.add_eos_token_id(ids["<|return|>"])   # as gpt-oss's GGUFs have it
    w.add_pad_token_id(ids["<|endoftext|>"])
    w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def build(llama_cpp, exe):
    cmd = ["g++", "-std=c++17", "-O1", os.path.join(HERE, "tokenize.cpp"), "-o", exe,
           f"-I{llama_cpp}/include", f"-I{llama_cpp}/ggml/include", f"-I{llama_cpp}/common",
           f"-I{llama_cpp}/vendor", f"-L{llama_cpp}/build/bin", "-lllama-common", "-lllama",
           "-lggml", "-lggml-base", f"-Wl,-rpath,{llama_cpp}/build/bin"]
    subprocess.run(cmd, check=True)


def run(exe, *args):
    return subprocess.run([exe, *args], check=True, capture_output=True).stdout


def nul_file(tmp, name, strings):
    path = os.path.join(tmp, name)
    with open(path, "wb") as f:
        for s in strings:
            f.write(s.encode("utf-8") + b"\0")
    return path


# a system + user + assistant + user conversation
CHAT = [{"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3? Answer in one word, ünïcödé ok."}]

# one user message and a function tool with required, optional, enum and default parameters
TOOL_CHAT = [{"role": "user", "content": "Weather in Oslo?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "name of the city"},
        "days": {"type": "integer", "default": 1},
        "unit": {"type": "string", "enum": ["C", "F"], "default": "C"},
        "tags": {"type": "array", "items": {"type": "string"}}}}}}]


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", default=LLAMA_CPP, required=LLAMA_CPP is None,
                    help="llama.cpp source dir with build/bin (default: $LLAMA_CPP_DIR)")
    args = ap.parse_args()
    vocab = os.path.join(DATA, "vocab-gpt4o.gguf")
    template_path = os.path.join(args.llama_cpp, "models", "templates", "openai-gpt-oss-120b.jinja")
    with open(template_path) as f:
        template = f.read()
    write_vocab(os.path.join(args.llama_cpp, "models", "ggml-vocab-gpt-2.gguf"), vocab, template)
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "tokenize")
        build(args.llama_cpp, exe)
        texts = make_texts()
        inp = nul_file(tmp, "texts", texts)
        cases = []
        for parse_special in (1, 0):
            lines = run(exe, vocab, "ids", inp, str(parse_special), "1").decode().split("\n")
            for text, line in zip(texts, lines):
                cases.append({"text": text, "parse_special": bool(parse_special),
                              "ids": [int(x) for x in line.split()]})
        info = run(exe, vocab, "info").decode().split("\n")
        eog = [int(x) for x in info[1].split()[1:]]
        attrs = [int(x) for x in info[2].split()[1:]]
        first = min(eog + [50256])
        out = {"tool": "tools/llamacpp/tokenize.cpp, llama.cpp from llama-cpp-python 0.3.36",
               "vocab": "vocab-gpt4o.gguf", "eog": eog,
               "attr_from": first, "attr": attrs[first:], "cases": cases}
        with open(os.path.join(DATA, "gpt4o_tokenizer.json"), "w") as f:
            json.dump(out, f, ensure_ascii=False, indent=0)

        msgs = nul_file(tmp, "chat", [s for m in CHAT for s in (m["role"], m["content"])])
        prompt = run(exe, vocab, "chat", template_path, msgs).decode()
        # the template writes today's date (strftime_now); the test renders with this one
        date = re.search(r"Current date: (\S+)", prompt).group(1)
        msgs = nul_file(tmp, "tool_chat", [s for m in TOOL_CHAT for s in (m["role"], m["content"])])
        tools = nul_file(tmp, "tools", [s for t in TOOLS for s in (
            t["function"]["name"], t["function"]["description"],
            json.dumps(t["function"]["parameters"]))])
        tool_prompt = run(exe, vocab, "chat", template_path, msgs, tools).decode()
        with open(os.path.join(DATA, "gpt_oss_chat.json"), "w") as f:
            json.dump({"tool": out["tool"] + ", common_chat_templates_apply (its Jinja engine)",
                       "template": "models/templates/openai-gpt-oss-120b.jinja",
                       "date": date, "messages": CHAT, "prompt": prompt,
                       "tool_messages": TOOL_CHAT, "tools": TOOLS, "tool_prompt": tool_prompt},
                      f, ensure_ascii=False, indent=1)
    print(f"{len(cases)} cases, eog {eog}; prompt:\n{prompt}", file=sys.stderr)


if __name__ == "__main__":
    main()
