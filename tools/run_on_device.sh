#!/usr/bin/env bash
# Install ep_fuse (and carried wheels, e.g. liger-kernel) on an offline GPU machine, then run benches.
#   bash tools/run_on_device.sh bench/bench_rms_norm.py [--sweep]
#   bash tools/run_on_device.sh bench/bench_rope.py bench/bench_gemm_swiglu.py     (several scripts, no args)
#   bash tools/run_on_device.sh bench/run.py --out bench_out/all                   (every family, bench/run.py)
set -uo pipefail
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation . 2>&1 | tail -2
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=1
repo=$PWD
export PYTHONPATH=$repo/bench${PYTHONPATH:+:$PYTHONPATH}  # experiments/<date>/ scripts import bench/common.py
cd /tmp
if [ "$#" -ge 2 ] && [[ "$2" == *.py ]]; then
  status=0
  for script in "$@"; do python3 "$repo/$script" || status=1; done
  exit $status
fi
script=$1; shift
python3 "$repo/$script" "$@"
