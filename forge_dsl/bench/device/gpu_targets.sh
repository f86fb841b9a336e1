#!/usr/bin/env bash
# One device call: issue K's target table, `forge-bench model --rounds 3` (the methods interleaved, rotated each
# round) on Llama-3.1-8B for each configuration, each in its own process; the rows' step time, ratio to torch
# AdamW(fused) with the rounds' spread, and peak are printed, the JSON records copied to $OUT.
#   [TARGET_CONFIGS="eager512 ckpt2048 ckpt8192 compiled512"] [TARGET_METHODS=...] [TARGET_TIMEOUT=200] \
#       bash forge_dsl/bench/device/gpu_targets.sh
set -u
source "$(dirname "$0")/gpu_setup.sh"
methods=${TARGET_METHODS:-torch-adamw,forge-bf16,forge-int8,forge-int4}
for config in ${TARGET_CONFIGS:-eager512 ckpt2048 ckpt8192}; do
    args="$(step_config "$config") --steps 3" || { echo "unknown configuration $config"; continue; }
    start=$(date +%s)
    timeout "${TARGET_TIMEOUT:-200}" python3 -m forge_dsl.bench model --models llama3.1-8b --methods "$methods" \
        --rounds "${TARGET_ROUNDS:-3}" --out "/tmp/targets-$config" $args > "/tmp/targets-$config.log" 2>&1
    echo "== $config ($args): exit $?, $(( $(date +%s) - start )) s"
    # method, status, peak GiB, step ms, ratio to the first method (rounds' min-max)
    grep "^| *llama" "/tmp/targets-$config.log" | awk -F'|' '{print $7 "|" $9 "|" $10 "|" $12 "|" $13}'
    grep -E "Error|error:" "/tmp/targets-$config.log" | tail -n 3
    cp /tmp/targets-$config/*.json "$OUT/targets-$config.json" 2>/dev/null
done
