#!/usr/bin/env bash
# One device call: the GPU test tier (`pytest -m gpu`), the CPU tests that run compiled on a GPU for the
# kernels changed lately, and forge-test over the built-in specs, side by side on one GPU (correctness
# only: nothing here is timed against anything else).
#   [TIER_TIMEOUT=540] [FORGE_TEST_ARGS=--quick] bash forge_dsl/bench/device/gpu_tier.sh
# Logs: $OUT/gpu-tier.log, $OUT/compiled-tests.log, $OUT/forge-test{,-b}.log; their last lines are printed.
set -u
source "$(dirname "$0")/gpu_setup.sh"
limit=${TIER_TIMEOUT:-540}
start=$(date +%s)
timeout "$limit" python3 -m pytest -q -m gpu -n "${TIER_WORKERS:-6}" -p no:cacheprovider > "$OUT/gpu-tier.log" 2>&1 &
tier=$!
timeout "$limit" python3 -m pytest -q -n 3 -p no:cacheprovider ${COMPILED_TESTS:-tests/kernels/test_numerics.py \
    tests/spec/test_variants.py tests/kernels/test_idioms.py} > "$OUT/compiled-tests.log" 2>&1 &
compiled=$!
# forge-test in two processes (each compiles its specs' kernels; the machine has CPUs to spare)
timeout "$limit" forge-test ${FORGE_TEST_A:-adagrad adamw lion nadam} --device cuda ${FORGE_TEST_ARGS:---quick} \
    > "$OUT/forge-test.log" 2>&1 &
ftest=$!
timeout "$limit" forge-test ${FORGE_TEST_B:-radam rmsprop sgd sgd_momentum} --device cuda ${FORGE_TEST_ARGS:---quick} \
    > "$OUT/forge-test-b.log" 2>&1 &
ftest_b=$!
wait $tier; echo "== GPU tier: exit $?"; tail -n 12 "$OUT/gpu-tier.log"
wait $compiled; echo "== compiled tests: exit $?"; tail -n 6 "$OUT/compiled-tests.log"
wait $ftest; echo "== forge-test A: exit $?"; grep -E "cases|FAIL|rror" "$OUT/forge-test.log" | tail -n 12
wait $ftest_b; echo "== forge-test B: exit $?"; grep -E "cases|FAIL|rror" "$OUT/forge-test-b.log" | tail -n 12
echo "all in $(( $(date +%s) - start )) s"
