#!/usr/bin/env bash
# nbmoe beside llama.cpp's and ik_llama.cpp's CUDA builds, on one GPU machine.
#
#   bash tools/peers_cuda.sh build llama SRC.tar.xz|DIR      # a tarball of the tree, or the tree
#   bash tools/peers_cuda.sh run MODEL [-ot exps=CPU -t 16]  # the three engines, in turn
#
# build: cmake + ninja of llama-bench (CUDA, sm_90, -march=native, static) into $WORK/NAME;
# it takes ~5 min (llama.cpp) and ~14 min (ik_llama.cpp) at -j16, so start it in the
# background (setsid) and make the models meanwhile. AMX is left out: some VMs advertise it
# and fault on its tile instructions. The sources: llama.cpp is vendored in the
# llama-cpp-python sdist (vendor/llama.cpp), ik_llama.cpp is github.com/ikawrakow/ik_llama.cpp.
# run: -ngl 99, pp512 and pp2048 at -ub 2048, tg128, -r 3 each; extra arguments (a placement)
# go to all three. llama-bench's -fa 1 is nbmoe's default (flash where it has a kernel).
set -euo pipefail
WORK=${WORK:-$HOME/.cache/nbmoe/peers}
JOBS=${JOBS:-$(nproc)}
TESTS=${TESTS:-"-p 512,2048 -n 128 -ub 2048 -r 3"}

build() {   # name src
    local name=$1 src=$2 dir=$WORK/$1
    mkdir -p "$dir"
    if [ -d "$src" ]; then cp -r "$src"/. "$dir/src"; else
        mkdir -p "$dir/src" && tar xf "$src" -C "$dir/src" --strip-components=1; fi
    local noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" extra=()
    # llama.cpp's llama-bench is a tool; ik_llama.cpp's is an example
    [ -d "$dir/src/tools/llama-bench" ] && extra=(-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF)
    cmake -S "$dir/src" -B "$dir/build" -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF "${extra[@]}" \
        -DCMAKE_C_FLAGS="$noamx" -DCMAKE_CXX_FLAGS="$noamx" > "$dir/cmake.log"
    ninja -C "$dir/build" -j "$JOBS" llama-bench > "$dir/build.log"
    cp "$dir/build/bin/llama-bench" "$WORK/$name-bench"
    echo "$WORK/$name-bench"
}

run() {     # model placement...
    local model=$1; shift
    for name in llama ik; do
        local bench=$WORK/$name-bench
        [ -x "$bench" ] || { echo "$name: no $bench (build it first)" >&2; continue; }
        echo "== $name"
        # shellcheck disable=SC2086
        "$bench" -m "$model" -ngl 99 "$@" -fa 1 -b 2048 $TESTS 2>/dev/null | grep -E "^\|"
    done
    echo "== nbmoe"
    # shellcheck disable=SC2086
    python -m nbmoe.bench -m "$model" -ngl 99 "$@" $TESTS
}

case "${1:-}" in
    build) [ $# -eq 3 ] || { echo "usage: peers_cuda.sh build llama|ik SRC" >&2; exit 2; }; build "$2" "$3" ;;
    run) [ $# -ge 2 ] || { echo "usage: peers_cuda.sh run MODEL [placement...]" >&2; exit 2; }
         shift; run "$@" ;;
    *) echo "usage: peers_cuda.sh build NAME SRC | run MODEL [placement...]" >&2; exit 2 ;;
esac
