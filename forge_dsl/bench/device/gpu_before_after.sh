#!/usr/bin/env bash
# One device call: the fused kernel's time and a spec's first-call cost, before and after a change, in
# one run on one GPU. BASE is a folder holding the earlier tree (`git archive REV forge_dsl grammars
# optimizers generated pyproject.toml README.md | tar -x -C base`, with forge_dsl/{generated,optimizers,
# grammars} linked to its top-level folders); each tree runs from its own folder (`python -m` and `python -`
# put the working directory first on sys.path: run from the repository, the earlier tree would import the
# current one), the current one installed. first_call.py is this tree's for both (an earlier tree may not have
# it), read on stdin. Order: after, before, after (the spread of the two "after" runs is the noise).
#   BASE=base KERNEL_ARGS="--specs adamw,lion --shapes llama3.1-8b --tokens 512,2048 --layouts bf16" \
#       bash forge_dsl/bench/device/gpu_before_after.sh
set -u
base=$(cd "${BASE:-base}" && pwd)
source "$(dirname "$0")/gpu_setup.sh"
first_call="$PWD/forge_dsl/bench/first_call.py"
args=${KERNEL_ARGS:---specs adamw,lion --shapes llama3.1-8b --tokens 512,2048 --layouts bf16}
run() {  # run NAME [the earlier tree's folder]
    echo "== $1"
    (cd "${2:-.}" && TRITON_CACHE_DIR="$(mktemp -d)" FORGE_DSL_CACHE="$(mktemp -d)" \
        python3 - --specs adamw,lion,rmsprop < "$first_call") 2>&1 | tail -n 5
    (cd "${2:-.}" && python3 -m forge_dsl.bench kernel $args --out "/tmp/bench-$1") > "$OUT/kernel-$1.log" 2>&1
    tail -n 14 "$OUT/kernel-$1.log"
}
run after ""
run before "$base"
run after2 ""
