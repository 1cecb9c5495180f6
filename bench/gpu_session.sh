#!/usr/bin/env bash
# One GPU session's run (device machine: torch and triton preinstalled, nothing else): the wheels
# in .whl/ (fla-core, liger-kernel, torchao for the float8 cases, pytest and its dependencies;
# `pip download --no-deps -d .whl fla-core==0.6.0 liger-kernel==0.8.5 torchao==0.18.0 pytest
# pluggy iniconfig pygments`) into /tmp/site, then the
# prepared checks (arguments passed on to bench/gpu_check.py) and the `gpu` test tier.
# Writes $OUT/gpu_check.json, $OUT/gpu_check.log and $OUT/pytest_gpu.log. Cold, the gpu tier takes
# minutes (Triton compiles and autotunes its kernels): PYTEST_TIMEOUT_S (default 300) bounds it.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
set -o pipefail
if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl; then
  export PYTHONPATH=/tmp/site
else
  echo "gpu_session: installing .whl/ failed: fla-core, liger-kernel (and pytest) may be missing"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 bench/gpu_check.py --out "$OUT/gpu_check.json" "$@" 2>&1 | tee "$OUT/gpu_check.log"
checks=$?
timeout "${PYTEST_TIMEOUT_S:-300}" python3 -m pytest -m gpu -p no:cacheprovider -q \
  --durations=15 tests/model/test_gpu.py 2>&1 | tee "$OUT/pytest_gpu.log"
tests=$?
echo "gpu_session: gpu_check exit $checks, gpu tests exit $tests (124: timed out)"
exit $(( checks != 0 ? checks : tests ))
