# Sourced by the device-call scripts: the editable install, and what the machine and versions are.
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1 \
    || { echo "editable install failed:"; tail -5 /tmp/install.log; }
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
