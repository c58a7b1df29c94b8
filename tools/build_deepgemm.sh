#!/usr/bin/env bash
# Build DeepGEMM (deepseek-ai/DeepGEMM, SM90 FP8/bf16 grouped GEMMs) from a source tree you provide, for the
# optional "fp8:deepgemm" provider. The tree needs CUTLASS's include/{cute,cutlass} under third-party/cutlass
# and {fmt}'s include/ under third-party/fmt (DeepGEMM's own git submodules).
#   bash tools/build_deepgemm.sh SRC_DIR [DEST_DIR]     then: export PYTHONPATH=DEST_DIR:$PYTHONPATH
# Needs nvcc and the CUDA build of torch; kernels are compiled by DeepGEMM's JIT at first use (nvcc, cached in
# $DG_JIT_CACHE_DIR or ~/.deep_gemm). ep_fuse does not ship DeepGEMM's code; this only drives its setup.py.
set -euo pipefail
src=$(cd "${1:?usage: build_deepgemm.sh SRC_DIR [DEST_DIR]}" && pwd)
dest=${2:-$src/install}
cuda=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
export CUDA_HOME=$cuda
cd "$src"
# The system C++ compiler, for the shared libstdc++: the H200 machines' default g++ (/opt/gcc/bin/g++ via CXX)
# links a static libstdc++ into the module, whose own std::locale then makes DeepGEMM's JIT include parser
# segfault in std::regex's constructor (torch 2.11.0+cu130, GCC 13.3). DG_CXX overrides the choice.
# DG_USE_LOCAL_VERSION=0: setup.py would ask git for a version suffix.
cxx=${DG_CXX:-$(command -v x86_64-linux-gnu-g++ || command -v /usr/bin/g++ || echo g++)}
cc=$(dirname "$cxx")/$(basename "$cxx" | sed 's/g++$/gcc/')
[ -x "$cc" ] || cc=gcc
CXX=$cxx CC=$cc LDSHARED="$cxx -shared" LDCXXSHARED="$cxx -shared" DG_USE_LOCAL_VERSION=0 python3 setup.py build >build.log 2>&1 \
  || { tail -40 build.log; echo "DeepGEMM build failed (full log: $src/build.log)" >&2; exit 1; }
lib=$(find build -maxdepth 1 -type d -name 'lib*' | head -1)
[ -n "$lib" ] && ls "$lib"/deep_gemm/_C*.so >/dev/null 2>&1 || { echo "no deep_gemm/_C*.so under $src/build" >&2; exit 1; }
so=$(ls "$lib"/deep_gemm/_C*.so | head -1)
if ! readelf -d "$so" | grep -q 'NEEDED.*libstdc++'; then
  echo "warning: $so does not load the shared libstdc++ (static copy: std::regex may crash)" >&2
fi
mkdir -p "$dest"
rm -rf "$dest/deep_gemm"
cp -r "$lib/deep_gemm" "$dest/"
for so in "$dest"/deep_gemm/_C*.so; do strip --strip-debug "$so"; done  # 21 MB -> 3 MB
echo "DeepGEMM built: $dest (export PYTHONPATH=$dest:\$PYTHONPATH)"
