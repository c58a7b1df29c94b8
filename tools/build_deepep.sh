#!/usr/bin/env bash
# Build DeepEP (V1 API, e.g. commit 29d31c0) from a checkout you provide, for ep_engine="deepep".
#   bash tools/build_deepep.sh SRC_DIR [DEST_DIR]        then: export PYTHONPATH=DEST_DIR:$PYTHONPATH
# Needs nvcc, the CUDA build of torch, and NVSHMEM (the nvidia-nvshmem-cu13 / -cu12 wheel or NVSHMEM_DIR).
# ep_fuse does not ship DeepEP's code; this only drives its own setup.py. ~70 s with 32 cores.
set -euo pipefail
src=$(cd "${1:?usage: build_deepep.sh SRC_DIR [DEST_DIR]}" && pwd)
dest=${2:-$src/install}
# NVLink multicast stays off (NCCL, PyTorch symmetric memory, NVSHMEM): it can take shared GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cuda=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
# NVSHMEM's nvshmem_tensor.h includes <cuda/std/tuple>: CUDA 13 keeps libcu++ under targets/*/include/cccl
for cccl in "$cuda"/targets/*/include/cccl; do
  [ -d "$cccl" ] && export CPATH="$cccl${CPATH:+:$CPATH}"
done
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
cd "$src"
python3 setup.py build >build.log 2>&1 || { tail -40 build.log; echo "DeepEP build failed (full log: $src/build.log)" >&2; exit 1; }
so=$(find build -name 'deep_ep_cpp*.so' | head -1)
[ -n "$so" ] || { echo "no deep_ep_cpp*.so under $src/build" >&2; exit 1; }
mkdir -p "$dest"
cp -r deep_ep "$dest/"
cp "$so" "$dest/"
echo "DeepEP built: $dest (export PYTHONPATH=$dest:\$PYTHONPATH)"
