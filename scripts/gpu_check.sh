#!/usr/bin/env bash
# The GPU check of the CuPy kernels (issue: CuPy kernels on the GPU), for a bare GPU machine with
# torch and CuPy preinstalled and no network: installs gravac with its `cuda` extra (offline:
# what the machine already has), runs the `cuda` tests, `gravac bench kernels` at 64M elements,
# a 1-GPU `gravac demo` and `gravac bench step` (what gravac adds to a step) on two models.
# Logs go to $OUT (or ./gpu-check) as gpu_*.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
nvidia-smi -L | tee "$OUT/gpu_env.log"
"$PY" -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__, torch.cuda.get_device_name(0))" | tee -a "$OUT/gpu_env.log"
"$PY" -m pip install --no-index --no-build-isolation -q -e '.[cuda]' 2>&1 | tail -3 \
  || { echo "install failed: running from the source tree"; export PYTHONPATH="$PWD"; }
"$PY" -c "import importlib.metadata as m; print('cuda extra requires', [r for r in m.requires('gravac') if 'cuda' in r])" | tee -a "$OUT/gpu_env.log"
status=0
# cuBLAS deterministic for the deterministic-mode test (not for the timings below)
CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 240 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests/kernels/test_cupy.py tests/test_buckets.py tests/test_optimizer.py --maxfail=60 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 || status=1
timeout 150 "$PY" -m gravac bench kernels --size 64M --repeats 7 2>&1 | tee "$OUT/gpu_bench.log" || status=1
timeout 120 "$PY" -m gravac demo --device cuda --workers 1 --max-steps 100 --log-dir /tmp/gravac-demo-runs 2>&1 | tee "$OUT/gpu_demo.log" | tail -15 || status=1
for w in vgg-digits mlp-digits; do
  timeout 45 "$PY" -m gravac bench step --device cuda --workload $w 2>&1 | tee "$OUT/gpu_step_$w.log" || status=1
done
timeout 45 "$PY" -m gravac bench step --device cuda --workers 2 2>&1 | tee "$OUT/gpu_step_2w.log" || status=1
timeout 90 "$PY" scripts/gpu_profile.py > "$OUT/gpu_profile.log" 2>&1 || status=1
exit $status
