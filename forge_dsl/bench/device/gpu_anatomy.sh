#!/usr/bin/env bash
# One device call: the step anatomy (`python -m forge_dsl.bench.step_anatomy`) of torch AdamW(fused) and FORGE
# in the configurations of issue K, one process per configuration, each method in turn (a split, not a ratio:
# ratios come from `forge-bench model --rounds 3`). Outputs: $OUT/anatomy-<config>.{txt,json}.
#   [ANATOMY_CONFIGS="eager512 compiled512 ckpt8192 ckpt2048"] [ANATOMY_METHODS=...] bash forge_dsl/bench/device/gpu_anatomy.sh
set -u
source "$(dirname "$0")/gpu_setup.sh"
methods=${ANATOMY_METHODS:-torch-adamw,forge-bf16,forge-int8}
for config in ${ANATOMY_CONFIGS:-eager512 compiled512 ckpt8192}; do
    args=$(step_config "$config") || { echo "unknown configuration $config"; continue; }
    echo "== $config: $args"
    timeout "${ANATOMY_TIMEOUT:-300}" python3 -m forge_dsl.bench.step_anatomy --methods "$methods" $args \
        --json "$OUT/anatomy-$config.json" > "$OUT/anatomy-$config.txt" 2>&1
    echo "exit $?"; grep -v "^USDT\|Warning\|warn" "$OUT/anatomy-$config.txt" | tail -n 40
done
