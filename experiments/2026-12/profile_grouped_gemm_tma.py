"""Launch the TMA grouped GEMMs of one shape once per config, for Nsight Compute (``ncu``) to read counters.

    ncu --clock-control none -k regex:_grouped_gemm_tma_kernel --section SpeedOfLight ... \\
        PYTHONPATH=bench python experiments/2026-12/profile_grouped_gemm_tma.py [--shape deepseek_v3_T4096] [--config GEMM:BM,BN,...]

Each config runs twice (a warm-up for Triton's compile, then the launch to profile: give ncu
``--launch-skip`` accordingly or read the second of each pair). Without ``--config``: the default configs of
both GEMMs. Rows are routed as in ``bench/bench_moe_grouped_gemm_tma.py`` (top-k of random logits, or ``--balanced``).
Prints one line per launch: GEMM, config, µs from CUDA events (under ncu these include its replays).
"""

from __future__ import annotations

import argparse
import os

import torch

os.environ.setdefault("EP_FUSE_UNVERIFIED_KERNELS", "1")
from bench_moe_grouped_gemm_tma import SHAPES, parse_config, tk  # noqa: E402
from bench_moe_experts import make_weights, routed_rows  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="deepseek_v3_T4096", choices=sorted(SHAPES))
    ap.add_argument("--config", action="append", default=[], help="as bench/bench_moe_grouped_gemm_tma.py --config")
    ap.add_argument("--balanced", action="store_true")
    opts = ap.parse_args()
    t, h, i, e, k = SHAPES[opts.shape]
    w13, w2 = make_weights(h, i, e)
    rows, seg = routed_rows(t, h, e, k, opts.balanced)
    m = rows.shape[0]
    act = torch.empty(m, i, device="cuda", dtype=rows.dtype)
    out = torch.empty(m, h, device="cuda", dtype=rows.dtype)
    runs = [parse_config(c) for c in opts.config] or [
        ("gate_up_swiglu", tk.config_for(m, i, h, e, swiglu=True)), ("down", tk.config_for(m, h, i, e))]
    for gemm, cfg in runs:
        for _ in range(2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if gemm == "gate_up_swiglu":
                tk.launch_grouped_gemm_swiglu_tma(rows, w13, seg, act, config=cfg)
            else:
                tk.launch_grouped_gemm_tma(act, w2, seg, out, config=cfg)
            end.record()
            torch.cuda.synchronize()
        print(f"{opts.shape} {gemm} [{cfg}] {start.elapsed_time(end) * 1e3:.1f} us", flush=True)


if __name__ == "__main__":
    main()
