#!/usr/bin/env bash
# One call on an offline GPU machine (the device tool): install ep_fuse, build DeepEP if a source tree
# is carried, then run the named steps. Output for each step lands in $OUT/<step>.log.
#   bash tools/device_run.sh STEP [STEP ...]
# Steps: deepep (build from .deepep/, or reuse a carried .deepep_build/), deepep_test (DeepEP's own
# intranode + low-latency tests, 2 GPUs), gpu_single / gpu_multi (python -m pytest tests/gpu: one-GPU
# checks / the rest), ep (bench_ep.py on every GPU, with --e2e), generate[:MODELS[:BATCHES]]
# (bench_generate.py), accuracy (experiments/2026-12/accuracy_decode.py), dynamic[:TAG] (experiments/2026-12/check_dynamic.py with $DYN_ARGS or
# $DYN_ARGS_TAG), gg_tma (tests/gpu/test_gpu_moe_grouped_gemm_tma.py, then bench/bench_moe_grouped_gemm_tma.py with $GG_ARGS; gg_bench: the bench alone),
# profile_dynamic (experiments/2026-12/profile_dynamic.py static and --dynamic, $PROF_ARGS), fp8 (tests/gpu/test_gpu_fp8.py,
# then bench_fp8.py with $FP8_ARGS), fp8_dispatch (tests/gpu/test_gpu_fp8_dispatch.py, 2 GPUs), dense
# (bench_gemm_swiglu.py --part prefill with $DENSE_ARGS), moe (bench_moe.py), forward (bench_forward.py with
# $FWD_ARGS), moe_experts (bench_moe_experts.py with $MOE_EXP_ARGS, e.g. --shape NAME=T,H,I,E,K --no-sweep),
# host_overhead (experiments/2026-12/host_overhead.py with $HOST_ARGS), host_per_call (experiments/2026-12/host_per_call.py with $HPC_ARGS), attention_mask (experiments/2026-12/attention_mask_cost.py), attention_gqa (experiments/2026-12/attention_gqa_cost.py), ep_fp8 (bench_ep.py --fp8-wire on DeepSeek-V3 decode
# and prefill, DeepEP normal and all_to_all; needs the deepep step first), pack (tar every log and
# result into $OUT), gpu_tests (python -m pytest on the tests/gpu files named in $GPU_TESTS, extra pytest
# arguments in $GPU_TESTS_ARGS), deepgemm (build DeepGEMM from a
# carried .deepgemm/ source tree, or reuse a carried .deepgemm_build/; JIT cache in .deepgemm_cache/),
# deepgemm_pack (the build and JIT cache as $OUT/deepgemm_build.tgz, to carry next time), deepgemm_bench
# (bench_deepgemm.py with $DG_ARGS), ncu_gg (Nsight Compute counters of the TMA grouped GEMMs: experiments/2026-12/profile_grouped_gemm_tma.py
# with $NCU_GG_ARGS), all (bench/run.py: every bench family at its default size, $RUN_ARGS, results in
# $OUT/run), serving (bench_serving.py with $SERVING_ARGS, $SERVING_TIMEOUT), varlen_attention
# (bench_varlen_attention.py with $VA_ARGS), sweep (tools/sweep_models.py on CUDA in bf16 against backend="inductor", $SWEEP_SHARDS processes). Wheels
# in .whl/ are installed first (--no-deps). Bench scripts are under bench/, build scripts under tools/, past one-off
# investigations under experiments/<date>/ (run with bench/ on PYTHONPATH for bench/common.py and bench/hf_models.py).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# a fresh Inductor cache per call: a warm machine keeps the last call's, and Inductor's FX cache keys on the
# graph before ep_fuse's lowering, so it would serve kernels compiled from the previous call's code
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d /tmp/inductor_cache.XXXXXX)}
repo=$PWD
# every log and result goes to RESULTS (bench scripts write there through OUT); pack it with `pack`
RESULTS=${RESULTS:-/tmp/ep_fuse_results}
final_out=${OUT:-$repo/bench_out}
export OUT=$RESULTS
mkdir -p "$OUT"
if [ -z "${SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation . >"$OUT/install.log" 2>&1 || tail -5 "$OUT/install.log"
fi
# wheels the machine lacks (it is offline), carried in .whl/: e.g. a newer pure-Python transformers
#   pip download --no-deps -d .whl transformers==5.24.0     (then carry=[".whl"] in the device call)
if ls "$repo"/.whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps "$repo"/.whl/*.whl >"$OUT/wheels.log" 2>&1 || tail -5 "$OUT/wheels.log"
fi
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
echo "GPUs: $ngpu; $(python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)')"
deepep_dest=$repo/.deepep_build
if [ -d "$deepep_dest/deep_ep" ]; then export PYTHONPATH=$deepep_dest${PYTHONPATH:+:$PYTHONPATH}; fi
deepgemm_dest=$repo/.deepgemm_build
export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-$repo/.deepgemm_cache}
if [ -d "$deepgemm_dest/deep_gemm" ]; then export PYTHONPATH=$deepgemm_dest${PYTHONPATH:+:$PYTHONPATH}; fi
status=0
step() {  # name, command...
  local name=$1; shift
  local t0=$SECONDS
  echo "=== $name"
  ( cd /tmp && "$@" ) >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc, $((SECONDS - t0)) s"
  tail -${TAIL:-25} "$OUT/$name.log"
  [ $rc -eq 0 ] || status=1
  # keep one up-to-date archive in the device tool's $OUT after every step: a later step that runs past
  # the call's time limit no longer loses the logs of the steps before it
  mkdir -p "$final_out" && tar czf "$final_out/results-latest.tgz" -C "$OUT" . 2>/dev/null
}
for s in "$@"; do
  case $s in
    deepep)
      if [ ! -d "$deepep_dest/deep_ep" ]; then
        step deepep_build bash "$repo/tools/build_deepep.sh" "$repo/.deepep" "$deepep_dest"
        so=$(ls "$deepep_dest"/deep_ep_cpp*.so 2>/dev/null | head -1)
        [ -n "$so" ] && strip -o "$OUT/$(basename "$so")" "$so" 2>/dev/null
      fi
      export PYTHONPATH=$deepep_dest${PYTHONPATH:+:$PYTHONPATH}
      python3 -c 'import deep_ep; print("deep_ep imports:", deep_ep.Buffer.is_sm90_compiled())' ;;
    varlen_attention)  # bench_varlen_attention.py with $VA_ARGS
      step varlen_attention python3 "$repo/bench/bench_varlen_attention.py" ${VA_ARGS:-} ;;
    serving)  # bench_serving.py with $SERVING_ARGS, stopped after $SERVING_TIMEOUT s (default 540) so that the
      # JSON of the modes that finished still comes back
      step serving timeout "${SERVING_TIMEOUT:-540}" python3 "$repo/bench/bench_serving.py" ${SERVING_ARGS:-} ;;
    deepgemm)  # build DeepGEMM from .deepgemm/ (or reuse a carried .deepgemm_build/); the build and the JIT
      # cache come back in $OUT/deepgemm_build.tgz, to be unpacked at the repo root and carried next time
      if [ ! -d "$deepgemm_dest/deep_gemm" ]; then
        step deepgemm_build bash "$repo/tools/build_deepgemm.sh" "$repo/.deepgemm" "$deepgemm_dest"
        export PYTHONPATH=$deepgemm_dest${PYTHONPATH:+:$PYTHONPATH}
      fi
      python3 -c 'import deep_gemm; print("deep_gemm imports:", deep_gemm.__file__)' ;;
    deepgemm_pack)
      mkdir -p "$final_out" && tar czf "$final_out/deepgemm_build.tgz" -C "$repo" .deepgemm_build .deepgemm_cache \
        --exclude='*.pyi' 2>/dev/null; ls -la "$final_out" ;;
    deepgemm_bench)
      step deepgemm_bench timeout ${DG_TIMEOUT:-400} python3 "$repo/bench/bench_deepgemm.py" ${DG_ARGS:-} ;;
    deepep_test)
      step deepep_intranode timeout 240 python3 "$repo/.deepep/tests/test_intranode.py" --num-processes "$ngpu"
      grep -E "Best (dispatch|combine)" "$OUT/deepep_intranode.log"
      step deepep_low_latency timeout 180 python3 "$repo/.deepep/tests/test_low_latency.py" --num-processes "$ngpu" \
        --num-tokens 128 --hidden 7168 --num-topk 8 --num-experts 256 ;;
    gpu_single)
      step gpu_single timeout 300 python3 -m pytest -q -p no:cacheprovider "$repo/tests/gpu/test_gpu_serving.py" ;;
    gpu_tests)
      step gpu_tests timeout ${GPU_TESTS_TIMEOUT:-360} python3 -m pytest -q -p no:cacheprovider \
        $(for f in ${GPU_TESTS:-}; do echo "$repo/tests/gpu/$f"; done) ${GPU_TESTS_ARGS:-} ;;
    gpu_multi)
      step gpu_multi timeout 540 python3 -m pytest -q -p no:cacheprovider "$repo/tests/gpu" \
        --ignore "$repo/tests/gpu/test_gpu_serving.py" ${MULTI_ARGS:-} ;;
    ncu_gg)  # Nsight Compute counters of the TMA grouped GEMMs (experiments/2026-12/profile_grouped_gemm_tma.py with $NCU_GG_ARGS)
      step ncu_gg timeout ${NCU_TIMEOUT:-240} ncu --clock-control none -k regex:_grouped_gemm_tma_kernel \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        env PYTHONPATH="$repo/bench${PYTHONPATH:+:$PYTHONPATH}" python3 "$repo/experiments/2026-12/profile_grouped_gemm_tma.py" ${NCU_GG_ARGS:-}
      grep -E "us$|_grouped_gemm_tma_kernel|Duration|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Compute \(SM\) Throughput|Memory Throughput|L2 Hit Rate|Mem Busy|Max Bandwidth|Executed Ipc A|SM Busy" \
        "$OUT/ncu_gg.log" | tail -${NCU_LINES:-120} ;;
    gg_bench)  # bench_moe_grouped_gemm_tma.py alone ($GG_ARGS)
      step gg_tma_bench timeout ${GG_BENCH_TIMEOUT:-340} python3 "$repo/bench/bench_moe_grouped_gemm_tma.py" ${GG_ARGS:-} ;;
    gg_tma)  # the Hopper TMA grouped GEMM: GPU correctness first, then the one-run comparison
      step gg_tma_test timeout ${GG_TEST_TIMEOUT:-220} python3 -m pytest -q -p no:cacheprovider \
        "$repo/tests/gpu/test_gpu_moe_grouped_gemm_tma.py"
      step gg_tma_bench timeout ${GG_BENCH_TIMEOUT:-340} python3 "$repo/bench/bench_moe_grouped_gemm_tma.py" ${GG_ARGS:-} ;;
    fp8)  # the Triton FP8 kernels: GPU correctness, then bench_fp8.py ($FP8_ARGS)
      step fp8_test timeout 150 python3 -m pytest -q -p no:cacheprovider "$repo/tests/gpu/test_gpu_fp8.py"
      step fp8_bench env EP_FUSE_UNVERIFIED_KERNELS=1 timeout ${FP8_TIMEOUT:-240} python3 "$repo/bench/bench_fp8.py" \
        ${FP8_ARGS:-} ;;
    fp8_dispatch)
      step fp8_dispatch timeout 200 python3 -m pytest -q -p no:cacheprovider "$repo/tests/gpu/test_gpu_fp8_dispatch.py" ;;
    dense)
      step dense timeout ${DENSE_TIMEOUT:-300} python3 "$repo/bench/bench_gemm_swiglu.py" --part prefill ${DENSE_ARGS:-} ;;
    forward)
      step forward timeout ${FWD_TIMEOUT:-400} python3 "$repo/bench/bench_forward.py" ${FWD_ARGS:-} ;;
    moe)
      step moe timeout ${MOE_TIMEOUT:-300} python3 "$repo/bench/bench_moe.py" ${MOE_ARGS:-} ;;
    moe_experts)
      step moe_experts timeout ${MOE_EXP_TIMEOUT:-330} python3 "$repo/bench/bench_moe_experts.py" ${MOE_EXP_ARGS:-} ;;
    attention_mask)  # experiments/2026-12/attention_mask_cost.py: SDPA with HF's materialised mask vs without
      step attention_mask timeout 120 env PYTHONPATH="$repo/bench${PYTHONPATH:+:$PYTHONPATH}" python3 "$repo/experiments/2026-12/attention_mask_cost.py" ;;
    host_overhead)
      step host_overhead timeout 120 env PYTHONPATH="$repo/bench${PYTHONPATH:+:$PYTHONPATH}" python3 "$repo/experiments/2026-12/host_overhead.py" ${HOST_ARGS:-} ;;
    attention_gqa)  # experiments/2026-12/attention_gqa_cost.py: decode attention, repeated K/V against packed query heads
      step attention_gqa timeout 120 env PYTHONPATH="$repo/bench${PYTHONPATH:+:$PYTHONPATH}" python3 "$repo/experiments/2026-12/attention_gqa_cost.py" ;;
    host_per_call)  # experiments/2026-12/host_per_call.py: host time of a compiled forward, ep_fuse vs Inductor
      step host_per_call timeout ${HPC_TIMEOUT:-300} env PYTHONPATH="$repo/bench${PYTHONPATH:+:$PYTHONPATH}" python3 "$repo/experiments/2026-12/host_per_call.py" ${HPC_ARGS:-} ;;
    ep_fp8)
      step ep_fp8 timeout 330 torchrun --nproc-per-node "$ngpu" "$repo/bench/bench_ep.py" \
        --shapes "DeepSeek-V3 decode,DeepSeek-V3 prefill" --backends deepep,all_to_all --fp8-wire ;;
    profile_dynamic)  # host time per call, ep_fuse vs Inductor, static and dynamic (issue 14)
      step profile_static timeout 200 env PYTHONPATH="$repo/bench${PYTHONPATH:+:$PYTHONPATH}" python3 "$repo/experiments/2026-12/profile_dynamic.py" ${PROF_ARGS:-}
      step profile_dynamic timeout 200 env PYTHONPATH="$repo/bench${PYTHONPATH:+:$PYTHONPATH}" python3 "$repo/experiments/2026-12/profile_dynamic.py" --dynamic ${PROF_ARGS:-} ;;
    all)  # every bench family at its default size: bench/run.py ($RUN_ARGS, e.g. --only rms_norm,moe)
      step all timeout ${RUN_TIMEOUT:-580} python3 "$repo/bench/run.py" --out "$OUT/run" ${RUN_ARGS:-} ;;
    pack)  # one archive back through the device tool (it returns at most 8 files)
      mkdir -p "$final_out" && tar czf "$final_out/results-$(date +%H%M%S).tgz" -C "$OUT" . && ls -la "$final_out" ;;
    ep)
      step bench_ep timeout 580 torchrun --nproc-per-node "$ngpu" "$repo/bench/bench_ep.py" --e2e ${EP_ARGS:-} ;;
    generate*)
      IFS=: read -r _ models batches <<<"$s"
      step "generate_${models:-all}" timeout 580 python3 "$repo/bench/bench_generate.py" \
        ${models:+--models $models} ${batches:+--batches $batches} ${GEN_ARGS:-} ;;
    accuracy)
      step accuracy timeout 400 env PYTHONPATH="$repo/bench${PYTHONPATH:+:$PYTHONPATH}" python3 "$repo/experiments/2026-12/accuracy_decode.py" ${ACC_ARGS:-} ;;
    dynamic*)  # dynamic[:TAG]: check_dynamic.py with $DYN_ARGS (or $DYN_ARGS_<TAG>), log dynamic[_TAG].log
      IFS=: read -r _ tag <<<"$s"
      var=DYN_ARGS${tag:+_$tag}
      [ -f "$repo/experiments/2026-12/check_dynamic.py" ] && step "dynamic${tag:+_$tag}" timeout ${DYN_TIMEOUT:-400} \
        env PYTHONPATH="$repo/bench${PYTHONPATH:+:$PYTHONPATH}" python3 "$repo/experiments/2026-12/check_dynamic.py" ${!var:-} ;;
    sweep)  # the generality sweep on the GPU, bf16, ep_fuse (inductor executor) vs backend="inductor",
      # $SWEEP_SHARDS processes side by side (Inductor's compile is CPU-bound); JSON per shard in $OUT
      fams=$(python3 -c 'from ep_fuse.models import sweep; print(" ".join(sweep.discover()))')
      n=${SWEEP_SHARDS:-8}; i=0; pids=()
      for sh in $(seq 0 $((n - 1))); do
        only=$(echo $fams | tr ' ' '\n' | awk -v n=$n -v k=$sh 'NR % n == k' | paste -sd, -)
        [ -n "$only" ] || continue
        ( cd /tmp && timeout ${SWEEP_TIMEOUT:-540} python3 "$repo/tools/sweep_models.py" --device cuda --only "$only" \
            --dtype ${SWEEP_DTYPE:-bf16} --executor inductor --inductor --json "$OUT/sweep_$sh.json" \
            >"$OUT/sweep_$sh.log" 2>&1 ) &
        pids+=($!)
      done
      for p in "${pids[@]}"; do wait $p || status=1; done
      grep -h "blocks=" "$OUT"/sweep_*.log
      mkdir -p "$final_out" && tar czf "$final_out/results-latest.tgz" -C "$OUT" . 2>/dev/null ;;
    *) echo "unknown step $s" ;;
  esac
done
exit $status
