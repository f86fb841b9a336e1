#!/usr/bin/env bash
# One device call: the model step before and after a host-side change, the trees alternated in one run on one GPU
# (after, before, after, before): each run is `python -m forge_dsl.bench.captured_step` with the same methods, so each
# tree's ratios to torch are measured side by side with torch in its own process. BASE holds the earlier tree as
# gpu_before_after.sh says (forge_dsl/{generated,optimizers,grammars} linked to its top-level folders).
#   BASE=.old STEP_ARGS="--seq 512 --rounds 2 --steps 5 --methods torch-adamw,forge-bf16" \
#       bash forge_dsl/bench/device/gpu_step_before_after.sh
set -u
base=$(cd "${BASE:-base}" && pwd)
source "$(dirname "$0")/gpu_setup.sh"
args=${STEP_ARGS:---seq 512 --rounds 2 --steps 5 --methods torch-adamw,forge-bf16}
for run in after before after2 before2; do
    dir=.
    case $run in before*) dir=$base ;; esac
    start=$(date +%s)
    (cd "$dir" && python3 -m forge_dsl.bench.captured_step $args --out "$OUT/step-$run.json") > "$OUT/step-$run.log" 2>&1
    echo "== $run: exit $?, $(( $(date +%s) - start )) s"
    grep -E "^\|" "$OUT/step-$run.log" | tail -n 8
done
