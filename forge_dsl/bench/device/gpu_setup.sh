# Sourced by the device-call scripts beside it: from the repository's root (three folders above this one), the
# editable install, and what the machine and versions are. OUT (default bench/results) is a folder named from
# where the caller stands, made absolute before the move to the root.
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd); fi
cd "$(dirname "${BASH_SOURCE[0]}")/../../.." || exit 1
OUT=${OUT:-$PWD/bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1 \
    || { echo "editable install failed:"; tail -5 /tmp/install.log; }
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

# The step configurations of issue K, by name: the options `forge-bench model` and `forge_dsl.bench.step_anatomy`
# both take (gpu_anatomy.sh, gpu_targets.sh). Prints nothing and fails for an unknown name.
step_config() {
    case $1 in
        eager512) echo "--seq 512 --checkpointing off" ;;
        compiled512) echo "--seq 512 --checkpointing off --compile on --warmup 3" ;;
        ckpt2048) echo "--seq 2048 --checkpointing on" ;;
        ckpt8192) echo "--seq 8192 --checkpointing on" ;;
        *) return 1 ;;
    esac
}
