#!/usr/bin/env bash
# One device call on a 2-GPU machine: two lanes of work side by side, one per GPU.
#   LANE0="cmd; cmd" LANE1="cmd" bash forge_dsl/bench/device/gpu_lanes.sh
# Each lane runs with CUDA_VISIBLE_DEVICES set to its GPU; its output goes to $OUT/lane<i>.log.
# Timings taken in one lane are not disturbed by the other's kernels (separate GPUs); the lanes
# share the host's CPUs, so keep launch-bound timings in one lane only.
set -u
source "$(dirname "$0")/gpu_setup.sh"
start=$(date +%s)
( export CUDA_VISIBLE_DEVICES=0; eval "${LANE0:-true}" ) > "$OUT/lane0.log" 2>&1 &
( export CUDA_VISIBLE_DEVICES=1; eval "${LANE1:-true}" ) > "$OUT/lane1.log" 2>&1 &
wait
echo "lanes done in $(( $(date +%s) - start )) s"
for i in 0 1; do echo "== lane $i"; tail -n "${TAIL:-60}" "$OUT/lane$i.log"; done
