#!/usr/bin/env bash
# One device call: the fused kernel's time and a spec's first-call cost, before and after a change, in
# one run on one GPU. BASE is a folder holding the earlier tree (`git archive REV forge_dsl grammars
# optimizers generated pyproject.toml README.md | tar -x -C base`, with forge_dsl/{generated,optimizers,
# grammars} linked to its top-level folders); the earlier tree runs from its own folder (`python -m` puts the
# working directory before PYTHONPATH: run from the repository, it would import the current tree), the current
# one installed. Order: after, before, after (the spread of the two "after" runs is the noise).
#   BASE=base KERNEL_ARGS="--specs adamw,lion --shapes llama3.1-8b --tokens 512,2048 --layouts bf16" \
#       bash bench/gpu_before_after.sh
set -u
source "$(dirname "$0")/gpu_setup.sh"
base=$(cd "${BASE:-base}" && pwd)
OUT=$(cd "$OUT" && pwd)
args=${KERNEL_ARGS:---specs adamw,lion --shapes llama3.1-8b --tokens 512,2048 --layouts bf16}
run() {  # run NAME [the earlier tree's folder]
    echo "== $1"
    env ${2:+PYTHONPATH=$2:${PYTHONPATH:-}} TRITON_CACHE_DIR="$(mktemp -d)" FORGE_DSL_CACHE="$(mktemp -d)" \
        python3 bench/first_call.py --specs adamw,lion,rmsprop 2>&1 | tail -n 5
    (cd "${2:-.}" && python3 -m forge_dsl.bench kernel $args --out "/tmp/bench-$1") > "$OUT/kernel-$1.log" 2>&1
    tail -n 14 "$OUT/kernel-$1.log"
}
run after ""
run before "$base"
run after2 ""
