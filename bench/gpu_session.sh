#!/usr/bin/env bash
# One GPU session (device machine: torch and triton preinstalled, no network): the wheels in
# .whl/ (`make gpu-wheels` where there is an index: fla-core, liger-kernel, torchao for the float8
# cases, pytest and its dependencies) into /tmp/site, then bench/gpu_plan.py's plan (arguments
# passed on: --budget-s, --only, --resume). Writes $OUT/gpu_session.json (after every case),
# cases/*.json and logs/*.log. A device call runs at most 10 minutes: a session is one call of
# `--budget-s 480` and, while the machine is warm, a second of `--budget-s 300 --resume`
# (which continues from /tmp/gpu_session_state.json; on a fresh machine: --resume PATH).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl; then
  export PYTHONPATH=/tmp/site
else
  echo "gpu_session: installing .whl/ failed: fla-core, liger-kernel, torchao (and pytest) may be missing"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# the session's state outlives a call's $OUT while the machine stays warm: `--resume` reads it
python3 bench/gpu_plan.py --out "$OUT" --state /tmp/gpu_session_state.json "$@"
