#!/usr/bin/env bash
# Install ep_fuse (and carried wheels, e.g. liger-kernel) on an offline GPU machine, then run a bench.
#   bash bench/run_on_device.sh bench/bench_rms_norm.py [args...]
set -euo pipefail
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation . 2>&1 | tail -2
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=1
script=$1; shift
cd /tmp && python3 "$OLDPWD/$script" "$@"
