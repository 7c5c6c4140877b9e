#!/usr/bin/env bash
# nbmoe revisions against each other (and llama.cpp's llama-bench), alternated in one run.
#
#   bash tools/gpu_ab.sh prepare REV...          # here, with git: a package copy of each REV in .ab/REV
#   bash tools/gpu_ab.sh run ROUNDS MODEL ARGS... # there: the tree and every .ab/REV, ROUNDS times
#
# Add /.ab/ to .git/info/exclude and carry .ab to the GPU machine (its copy of the tree has no
# usable git). Each variant runs from its own folder, since `python -m` puts the current folder
# first on sys.path (a PYTHONPATH alone still imports the tree's nbmoe), and with a kernel cache
# of its own. ARGS go to `python -m nbmoe.bench` as they are (e.g. -ngl 99 -ub 2048 -p 512,2048
# -n 0 -r 3); with LLAMA_BENCH=path, llama-bench runs each round too, on the same ARGS plus
# -fa 1 -b 2048. Each run prints every repetition (`-o json`'s samples_ts).
set -euo pipefail
cd "$(dirname "$0")/.."
AB=${AB:-.ab}

samples() {   # a bench's JSON rows (after whatever it printed before them) as one line each
    python3 -c '
import json, sys
text = sys.stdin.read()
rows = json.loads(text[text.find("[\n"):])
for r in rows:
    test = ("pp%d" % r["n_prompt"]) if r["n_prompt"] else ("tg%d" % r["n_gen"])
    ub, avg, each = r["n_ubatch"], r["avg_ts"], " ".join(f"{x:.1f}" for x in r["samples_ts"])
    print(f"  {test} ub={ub}: {avg:.1f} t/s, each: {each}")'
}

bench() {     # variant dir, args...
    local dir=$1; shift
    echo "== nbmoe $dir"
    (cd "$dir" && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" NBMOE_CACHE="${TMPDIR:-/tmp}/nbmoe-ab-$(basename "$dir")" \
        python -m nbmoe.bench "$@" -o json | samples)
}

case "${1:-}" in
    prepare)
        shift
        for rev in "$@"; do
            rm -rf "$AB/$rev" && mkdir -p "$AB/$rev"
            git archive "$rev" nbmoe | tar -x -C "$AB/$rev"
            echo "$AB/$rev: $(git log -1 --format='%h %s' "$rev")"
        done ;;
    run)
        [ $# -ge 3 ] || { echo "usage: gpu_ab.sh run ROUNDS MODEL ARGS..." >&2; exit 2; }
        rounds=$2 model=$(realpath "$3"); shift 3
        variants=("$PWD")
        for d in "$AB"/*/; do [ -d "$d/nbmoe" ] && variants+=("$(realpath "$d")"); done
        for r in $(seq "$rounds"); do
            echo "=== round $r"
            for v in "${variants[@]}"; do bench "$v" -m "$model" "$@"; done
            if [ -n "${LLAMA_BENCH:-}" ]; then
                echo "== llama.cpp"
                "$LLAMA_BENCH" -m "$model" "$@" -fa 1 -b 2048 -o json 2>/dev/null | samples
            fi
        done ;;
    *) echo "usage: gpu_ab.sh prepare REV... | run ROUNDS MODEL ARGS..." >&2; exit 2 ;;
esac
