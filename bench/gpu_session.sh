#!/usr/bin/env bash
# One device call: the GPU test tier, then the measurements, each under its own time limit.
# Run from the repository root on the GPU machine; logs and JSON go to ${OUT:-bench/results}.
set -u
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 || echo "editable install failed (see install.log)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

echo "== GPU test tier"
timeout "${TEST_LIMIT:-330}" python3 -m pytest -q -n 8 -p no:cacheprovider ${TESTS:-tests/test_kernels.py tests/test_triton_lib.py tests/test_optim.py} \
    > "$OUT/pytest.log" 2>&1
echo "pytest exit $?"; grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3; grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20

echo "== tile sweep (adamw, bf16 state, 4096x4096)"
timeout "${SWEEP_LIMIT:-150}" python3 bench/sweep_tiles.py --json "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1
echo "sweep exit $?"; tail -40 "$OUT/sweep.log"
