"""Run every bench family at its default (small, representative) size; collect JSON and one markdown table.

    python bench/run.py [--only FAMILY,...] [--out DIR] [--timeout S] [--check] [--list]
    bash tools/device_run.sh all                       (on the offline GPU machine; $RUN_ARGS passed on)

Each bench runs in its own subprocess with ``--json DIR/<bench>.json`` and ``OUT=DIR/<bench>/`` (where its own
``.json`` / ``.md`` files land). Afterwards ``DIR/results.json`` holds every bench's status, command, wall time
and results, and ``DIR/results.md`` a summary table plus each bench's own markdown tables. The repository root
is put first on ``PYTHONPATH``, so the benches measure this checkout's ``ep_fuse`` (the benches themselves import
the installed package, and their sibling ``common.py`` from their own folder).

``--check`` (and any machine without CUDA) runs ``--help`` of every bench only: the benchmarks need a GPU
(without one a bench exits with status 77 and says so). Families needing more than one GPU (``ep``) or an
optional package (``deepgemm``: ``deep_gemm``, built by ``tools/build_deepgemm.sh``) are skipped with the reason
when the machine lacks it.

Families (``--list`` prints the commands): one per op family of ``ep_fuse.catalog.FAMILIES`` (``moe``: layer,
permute, grouped GEMMs, Hopper TMA grouped GEMM; ``moe_gating``: the routers; ``moe_masked``: the masked expert
layout's local experts; ``rms_norm``, ``rope``, ``gemm_swiglu``, ``w8a8``, ``fp8``, ``ep``, ``varlen_attention``),
plus ``deepgemm`` and the levels ``forward``, ``generate`` and ``serving``. ``tests/test_house.py`` checks that every
catalog family has its ``bench_<family>.py`` here. Full-size runs: call the bench scripts directly
(docs/benchmarks.md lists the commands).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
NO_CUDA_EXIT = 77  # bench/common.py's NO_CUDA_EXIT (not imported: run.py needs neither torch nor ep_fuse)


@dataclass
class Bench:
    script: str
    args: list[str] = field(default_factory=list)
    gpus: int = 1  # > 1: launched by torchrun on every GPU
    needs: str | None = None  # an optional module the bench imports


FAMILIES: dict[str, list[Bench]] = {
    "rms_norm": [Bench("bench_rms_norm.py", ["--quick"])],
    "rope": [Bench("bench_rope.py", ["--quick"])],
    "gemm_swiglu": [Bench("bench_gemm_swiglu.py", [
        "--tokens", "1,32", "--shapes", "4096x11008,7168x18432", "--no-sweep",
        "--only", "llama7b,deepseek_v3_dense", "--rows", "2048", "--budget", "0"])],
    "moe": [
        Bench("bench_moe.py", ["--quick"]),  # DeepSeek-V3 decode layer, the router table, tiny-model checks
        Bench("bench_moe_permute.py", ["--quick"]),
        Bench("bench_moe_experts.py", ["--no-sweep", "--only", "decode"]),
        Bench("bench_moe_grouped_gemm_tma.py", ["--no-sweep", "--only", "deepseek_v3_T4096,qwen3_30b_a3b_T4096"]),
    ],
    "moe_gating": [Bench("bench_moe_gating.py", ["--quick"])],
    "moe_masked": [Bench("bench_moe_masked.py")],
    "w8a8": [Bench("bench_w8a8.py", ["--no-sweep", "--only", "decode"])],
    "fp8": [Bench("bench_fp8.py", ["--only", "decode,prefill", "--no-reference"])],
    "deepgemm": [Bench("bench_deepgemm.py", ["--only", "deepseek_v3_T4096", "--align", "128"], needs="deep_gemm")],
    "ep": [Bench("bench_ep.py", ["--quick"], gpus=2), Bench("bench_ep_a2a.py", ["--tokens", "128"], gpus=2)],
    "varlen_attention": [Bench("bench_varlen_attention.py")],
    "forward": [Bench("bench_forward.py", ["--models", "mixtral_8x7b"])],
    "generate": [Bench("bench_generate.py", ["--models", "qwen3_30b_a3b", "--batches", "1,8", "--new", "32",
                                             "--prompt", "32", "--repeats", "1"])],
    "serving": [Bench("bench_serving.py", ["--models", "qwen3_30b_a3b", "--requests", "64", "--concurrency", "1,16",
                                           "--new", "64-128"])],
}


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def command(b: Bench, ngpu: int, extra: list[str]) -> list[str]:
    script = str(BENCH / b.script)
    if b.gpus > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ngpu), script, *extra]
    return [sys.executable, script, *extra]


def skip_reason(b: Bench, ngpu: int, check: bool) -> str | None:
    if check:
        return None
    if ngpu == 0:
        return "no CUDA GPU (ran --help only)"
    if ngpu < b.gpus:
        return f"needs {b.gpus} GPUs, this machine has {ngpu}"
    if b.needs and importlib.util.find_spec(b.needs) is None:
        return f"{b.needs} is not importable"
    return None


def run_one(fam: str, b: Bench, out: Path, ngpu: int, check: bool, timeout: float) -> dict[str, Any]:
    name = b.script.removesuffix(".py")
    jpath = out / f"{name}.json"
    bout = out / name
    bout.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OUT=str(bout), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    help_only = check or ngpu == 0
    reason = skip_reason(b, ngpu, check)
    argv = ["--help"] if help_only else [*b.args, "--json", str(jpath)]
    cmd = command(b, max(ngpu, 1), argv) if not help_only else [sys.executable, str(BENCH / b.script), "--help"]
    rec: dict[str, Any] = {"family": fam, "bench": name, "command": shlex.join(
        ["python", f"bench/{b.script}", *b.args] if b.gpus == 1 else
        ["torchrun", "--nproc-per-node", "N", f"bench/{b.script}", *b.args])}
    if reason and not help_only:
        rec.update(status="skipped", reason=reason)
        print(f"--- {fam}/{name}: skipped ({reason})", flush=True)
        return rec
    t0 = time.time()
    print(f"--- {fam}/{name}: {shlex.join(cmd)}", flush=True)
    log = bout / ("help.txt" if help_only else "log.txt")
    try:
        with log.open("w") as f:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = None
    rec["seconds"] = round(time.time() - t0, 1)
    rec["log"] = str(log.relative_to(out))
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
    if help_only:
        rec.update(status="help ok" if rc == 0 else f"help FAILED (rc {rc})", reason=reason)
    elif rc is None:
        rec.update(status=f"timeout ({timeout:.0f} s)")
    elif rc == NO_CUDA_EXIT:
        rec.update(status="skipped", reason=tail[0] if tail else "needs CUDA")
    else:
        rec.update(status="ok" if rc == 0 else f"FAILED (rc {rc})")
    if rc not in (0, None) and tail:
        rec.setdefault("reason", tail[0][:300])
    if jpath.exists():
        rec["results"] = json.loads(jpath.read_text()).get("results", {})
    rec["markdown"] = sorted(str(p.relative_to(out)) for p in bout.glob("*.md"))
    print(f"    {rec['status']} in {rec['seconds']} s" + (f": {rec.get('reason')}" if rec.get("reason") else ""),
          flush=True)
    return rec


def write_markdown(out: Path, recs: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# Bench results ({meta['date']}; {meta['gpus']} GPU(s){'; --help only' if meta['help_only'] else ''})",
             "", "| family | bench | status | s | command |", "|---|---|---|---|---|"]
    for r in recs:
        status = r["status"] + (f" ({r['reason']})" if r.get("reason") and r["status"] != "ok" else "")
        lines.append(f"| {r['family']} | {r['bench']} | {status.replace('|', '/')} | {r.get('seconds', '—')} | "
                     f"`{r['command']}` |")
    for r in recs:
        for md in r.get("markdown", []):
            lines += ["", f"## {r['family']}: {md}", "", (out / md).read_text().strip()]
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated families (default: all)")
    ap.add_argument("--out", default="bench_out/run", help="results directory (default: bench_out/run)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per bench before it is stopped")
    ap.add_argument("--check", action="store_true", help="run --help of every bench only (what CPU machines do)")
    ap.add_argument("--list", action="store_true", help="print each family's commands and exit")
    args = ap.parse_args()
    fams = [f for f in args.only.split(",") if f] or list(FAMILIES)
    bad = [f for f in fams if f not in FAMILIES]
    if bad:
        ap.error(f"unknown families {bad}; known: {', '.join(FAMILIES)}")
    if args.list:
        for f in fams:
            for b in FAMILIES[f]:
                launcher = "torchrun --nproc-per-node N" if b.gpus > 1 else "python"
                print(f"{f:12s} {launcher} bench/{b.script} {shlex.join(b.args)}")
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ngpu = gpu_count()
    help_only = args.check or ngpu == 0
    if ngpu == 0 and not args.check:
        print("run.py: no CUDA GPU on this machine; the benchmarks need one, so only --help of each bench runs",
              flush=True)
    recs = [run_one(f, b, out, ngpu, args.check, args.timeout) for f in fams for b in FAMILIES[f]]
    meta = {"date": time.strftime("%Y-%m-%d"), "gpus": ngpu, "help_only": help_only, "python": sys.version.split()[0]}
    (out / "results.json").write_text(json.dumps({"meta": meta, "benches": recs}, indent=2, default=str))
    text = write_markdown(out, recs, meta)
    print(text.split("\n\n## ")[0])
    failed = [r for r in recs if "FAILED" in r["status"] or r["status"].startswith("timeout")]
    print(f"results: {out / 'results.json'}, {out / 'results.md'}" + (f"; {len(failed)} failed" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
