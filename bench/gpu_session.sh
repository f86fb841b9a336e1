#!/usr/bin/env bash
# One device call: the GPU test tier, then measurements, each under its own time limit.
# Run from the repository root on the GPU machine; logs and JSON go to ${OUT:-bench/results}.
#   TESTS=...  which test files (default: the kernel, layout and optimizer tiers)
#   STAGES=... which stages to run: tests sweep kernel model convergence (default: tests sweep kernel model)
set -u
source "$(dirname "$0")/gpu_setup.sh"
STAGES=${STAGES:-"tests sweep kernel model"}

has() { [[ " $STAGES " == *" $1 "* ]]; }

if has tests; then
    echo "== GPU test tier"
    timeout "${TEST_LIMIT:-240}" python3 -m pytest -q -n 8 -p no:cacheprovider \
        ${TESTS:-tests/test_kernels.py tests/test_triton_lib.py tests/test_optim.py} > "$OUT/pytest.log" 2>&1
    echo "pytest exit $?"; grep -E "passed|failed|error" "$OUT/pytest.log" | tail -2
    grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
fi
if has sweep; then
    echo "== tile sweep (adamw, bf16 state, 4096x4096)"
    timeout "${SWEEP_LIMIT:-150}" python3 bench/sweep_tiles.py --json "$OUT/sweep.json" > /tmp/sweep.log 2>&1
    echo "sweep exit $?"; grep -v '^{' /tmp/sweep.log | tail -46
    BEST=$(grep -o -- "--config [0-9,]*" /tmp/sweep.log | tail -1)
    [ -n "$BEST" ] && KERNEL_ARGS="${KERNEL_ARGS:---quick} $BEST" && echo "kernel benchmark uses $BEST"
fi
if has kernel; then
    echo "== forge-bench kernel ${KERNEL_ARGS:---quick}"
    timeout "${KERNEL_LIMIT:-70}" forge-bench kernel ${KERNEL_ARGS:---quick} --out "$OUT" 2>/dev/null | tail -30
fi
if has model; then
    echo "== forge-bench model ${MODEL_ARGS:---quick}"
    timeout "${MODEL_LIMIT:-90}" forge-bench model ${MODEL_ARGS:---quick} --out "$OUT" 2>/dev/null | tail -20
fi
if has convergence; then
    echo "== forge-bench convergence ${CONV_ARGS:---quick}"
    timeout "${CONV_LIMIT:-120}" forge-bench convergence ${CONV_ARGS:---quick} --out "$OUT" 2>/dev/null | tail -20
fi
