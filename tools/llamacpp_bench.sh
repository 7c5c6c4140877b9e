#!/usr/bin/env bash
# llama.cpp and nbmoe on the same machine, back to back: builds llama.cpp's llama-bench (CPU,
# -march=native, OpenMP) from the llama.cpp sources that the llama-cpp-python package ships
# on PyPI, then runs both benchmarks on each model with the same prompt / generation / threads.
# The machines here swing in memory bandwidth from hour to hour, so only figures taken
# together compare.
#
#   bash tools/llamacpp_bench.sh model.gguf [model2.gguf ...]       # pp512, tg128, 2 threads
#   P=512 N=128 T=2 R=3 bash tools/llamacpp_bench.sh model.gguf
#
# The build (~10 min on 2 cores) is kept in $WORK (default ~/.cache/nbmoe/llamacpp).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: bash tools/llamacpp_bench.sh model.gguf [...]" >&2; exit 2; }
P=${P:-512} N=${N:-128} T=${T:-2} R=${R:-3}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}       # the one measured in the README
WORK=${WORK:-$HOME/.cache/nbmoe/llamacpp}
SRC=$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp
BENCH=$SRC/build/bin/llama-bench

build() {     # extra cmake arguments
    cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
          -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF "$@" > "$WORK/cmake.log"
    cmake --build "$SRC/build" --target llama-bench -j "$(nproc)" > "$WORK/build.log"
}
if [ ! -x "$BENCH" ]; then
    mkdir -p "$WORK"
    pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
    tar xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
    build
fi
# Some VMs list AMX among the CPU's features but fault on its tile instructions (SIGILL in
# ggml's AMX kernels): then build again without AMX.
if ! "$BENCH" -m "$1" -p 16 -n 2 -r 1 -t "$T" > /dev/null 2>&1; then
    echo "llama-bench failed a probe run: building it again without AMX" >&2
    NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    build -DCMAKE_C_FLAGS="$NOAMX" -DCMAKE_CXX_FLAGS="$NOAMX"
fi

for m in "$@"; do
    echo "== $m"
    "$BENCH" -m "$m" -p "$P" -n "$N" -t "$T" -r "$R" 2>/dev/null | grep -E "^\| (model|[^-])"
    python -m nbmoe.bench -m "$m" -p "$P" -n "$N" -t "$T" -r "$R" | grep -E "^[│┃]"
done
