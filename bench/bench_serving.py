"""HF continuous batching (the engine behind ``transformers serve --continuous-batching``), three ways in one run.

    python bench/bench_serving.py [--models qwen3_30b_a3b,mixtral_8x7b] [--requests 256] [--concurrency 1,16,64]
                                  [--prompt 32-512] [--new 64-256] [--modes eager,hf,inductor,ep_fuse]
                                  [--cuda-graph auto|on|off] [--profile] [--ep-fuse-option KEY=VALUE ...] [--tiny]
                                  [--reference MODE]

For each real-sized model (``hf_models.py``: Qwen3-30B-A3B with 4 layers, Mixtral-8x7B with 2, random
weights, bf16) and mode, one ``ContinuousBatchingManager`` (``model.init_continuous_batching``) serves
``--requests`` greedy requests of random tokens (prompt and new-token lengths uniform in the ranges, EOS off,
one seed for every mode) at each concurrency: at most C requests in flight, a new one submitted as one ends.
``--requests`` is one count for every concurrency or a list, one per concurrency (``8,64,256``).

* ``eager``: no compile;
* ``hf``: HF's own default compile, as HF ships it (``default_compile_level=1``: ``CompileConfig(mode="default",
  fullgraph=False, dynamic=True)`` on both paths, Inductor), its paged attention a graph break per layer
  (ep_fuse's in-graph cache update uninstalled for this mode);
* ``inductor``: Inductor over the one graph per forward that ``ep_fuse.prepare``'s cache-update op makes,
  ``CompileConfig(fullgraph=False, mode="default")``, HF's SDPA over its dense mask: what the op alone gives;
* ``ep_fuse``: ``ep_fuse.serve.with_ep_fuse_compile`` (the configs ``ep-fuse serve`` uses) and what
  ``ep_fuse.prepare`` sets up (the cache-update op, ``ep_fuse::varlen_attention`` with no mask built).

CUDA graphs are HF's own capture: ``--cuda-graph auto`` leaves ``use_cuda_graph`` to HF (off for attention that
needs a mask, such as ``paged|sdpa``), ``on`` / ``off`` set it for every mode, and a mode named ``MODE+graphs``
(``ep_fuse+graphs``, ``hf+graphs``) turns it on for that mode alone; reported as kept per path. ``+async`` /
``+sync`` set HF's asynchronous batching on / off (``ep_fuse+graphs+sync``); unset, HF decides, and the ``ep_fuse``
mode takes ``with_ep_fuse_compile``'s default (on with CUDA graphs and no mask). Every row gets the host time per
step of HF's loop by phase (:class:`StepPhases`). ``--reference MODE`` compares the others with that mode instead
of eager (``--reference ep_fuse+graphs+sync``: the same kernels, another loop).
``--profile``: one more round per mode at the largest concurrency under ``torch.profiler``; the rows get the GPU
busy fraction of that round and ``$OUT/serving_profile_<model>_<mode>.txt`` the top kernels. Reported per
(model, mode, concurrency), after one warm-up round (its time is the ``first_s`` column: compile included):
output tokens/s (generated tokens / wall time), time to first token and inter-token latency p50/p99 (from
HF's per-token timestamps), and accuracy against eager: the fraction of requests whose tokens equal eager's
and the largest |logprob difference| of the chosen tokens over the steps where tokens agree
(``return_logprobs``; greedy tokens of random models may flip on near ties, so a flip is not an error by
itself). Free-running outputs part at the first flip, so after the timed rounds every mode also serves the same
teacher-forced requests (16 of eager's outputs, cut at 0, 1/4, 1/2 and 3/4 of its tokens, two new tokens: one
from the varlen path over the forced prefix, one decode step): the forced column gives the argmax flips, the
largest and the mean |logprob difference| against eager on identical prefixes, and the mean as a multiple of
the ``hf`` mode's (HF's Inductor compile: the bound is 1.25x). Writes ``$OUT/serving.json`` and ``serving.md``.

``--tiny``: ep_fuse's tiny 1-layer Qwen3-MoE (``--models qwen3_moe,mixtral`` adds Mixtral), fp32, on CPU, 6
short requests at 1 and 4 concurrent, modes eager and ep_fuse with ``executor="eager"`` (Inductor's CPU compile
alone takes minutes): a check that the bench runs (about 20 s of CPU time per model, most of it ep_fuse's
compile of the 8 graph pieces).

GPU machine with an older transformers: the image's transformers fails under any compile backend in
continuous batching, so carry a newer wheel. On a machine with network access run
``pip download 'transformers==5.24.*' --no-deps -d .whl`` in the repository root (``.whl/`` is ignored by
git); ``tools/run_on_device.sh`` installs every ``.whl/*.whl`` into ``/tmp/site`` (``--no-deps``) and puts it
first on ``PYTHONPATH``, so ``bash tools/run_on_device.sh bench/bench_serving.py`` measures with it (with the
device tool: ``carry=[".whl"]``). The bench prints the transformers version it ran with.
"""

from __future__ import annotations

import gc
import random
import time
from pathlib import Path
from typing import Any

import torch

import hf_models
from common import bench_parser, env_info, markdown_table, out_dir, start, write_json  # noqa: E402

import ep_fuse
from ep_fuse.serve import parse_options, with_ep_fuse_compile  # noqa: E402

MODES = ("eager", "hf", "inductor", "ep_fuse")


def log(*a: Any) -> None:
    print(*a, flush=True)


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def workload(n: int, vocab: int, prompt: tuple[int, int], new: tuple[int, int],
             seed: int = 0) -> list[tuple[list[int], int]]:
    """``n`` requests ``(prompt ids, max_new_tokens)``, the same for every mode."""
    rng = random.Random(seed)
    return [([rng.randrange(1, vocab) for _ in range(rng.randint(*prompt))], rng.randint(*new)) for _ in range(n)]


def cb_config(mode: str, base: dict[str, Any], options: dict[str, Any], model: Any = None) -> Any:
    import transformers as tf

    mode, *suffixes = mode.split("+")
    cfg = tf.ContinuousBatchingConfig(return_logprobs=True, **base)
    for suffix in suffixes:
        if suffix == "graphs":
            cfg.use_cuda_graph = True
        elif suffix in ("async", "sync"):
            cfg.use_async_batching = suffix == "async"
        else:
            raise ValueError(f"mode {mode}+{suffix}: the suffixes are +graphs, +async and +sync")
    if mode == "hf":
        cfg.default_compile_level = 1
    elif mode == "inductor":
        cfg.varlen_compile_config = tf.CompileConfig(fullgraph=False, mode="default")
        cfg.decode_compile_config = tf.CompileConfig(fullgraph=False, mode="default")
    elif mode == "ep_fuse":
        cfg = with_ep_fuse_compile(cfg, options, model=model)
    return cfg


def serve_requests(manager: Any, reqs: list[tuple[list[int], int]], concurrency: int,
                   timeout: float = 1800) -> tuple[float, dict[int, Any]]:
    """Submit ``reqs`` keeping at most ``concurrency`` in flight; returns wall seconds and outputs by index."""
    pending = list(enumerate(reqs))[::-1]
    ids: dict[str, int] = {}
    done: dict[int, Any] = {}

    def submit() -> None:
        i, (prompt, new) = pending.pop()
        rid = manager.add_request(prompt, request_id=f"r{i}_{time.monotonic_ns()}", max_new_tokens=new,
                                  record_timestamps=True)
        ids[rid] = i

    t0 = time.perf_counter()
    while pending and len(ids) - len(done) < concurrency:
        submit()
    deadline = t0 + timeout
    while len(done) < len(reqs):
        out = manager.get_result(timeout=1.0)
        if out is None:
            if manager.background_thread_status.fatal_error is not None:
                raise RuntimeError(f"continuous batching stopped: {manager.background_thread_status.fatal_error}")
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{len(reqs) - len(done)} requests unfinished after {timeout} s")
            continue
        if not out.is_finished() or out.request_id not in ids:
            continue
        if out.error is not None:
            raise RuntimeError(f"request {out.request_id} failed: {out.error}")
        done[ids[out.request_id]] = out
        if pending:
            submit()
    return time.perf_counter() - t0, done


def metrics(wall: float, outs: dict[int, Any]) -> dict[str, Any]:
    tokens = sum(len(o.generated_tokens) for o in outs.values())
    ttft = [(o.timestamps[0] - o.created_time) * 1e3 for o in outs.values() if o.timestamps]
    itl = [(b - a) * 1e3 for o in outs.values() if o.timestamps for a, b in zip(o.timestamps, o.timestamps[1:])]
    return dict(tokens_s=tokens / wall, wall_s=wall, ttft_ms_p50=percentile(ttft, 50),
                ttft_ms_p99=percentile(ttft, 99), itl_ms_p50=percentile(itl, 50), itl_ms_p99=percentile(itl, 99))


def agreeing_diffs(o: Any, r: Any) -> tuple[list[float], bool]:
    """|logprob differences| of the chosen tokens of ``o`` against ``r`` up to their first differing token, and
    whether there was one (after it the two saw different prefixes)."""
    diffs = []
    for a, b, ta, tb in zip(o.logprobs, r.logprobs, o.generated_tokens, r.generated_tokens):
        if ta != tb:
            return diffs, True
        diffs.append(abs(float(a) - float(b)))
    return diffs, False


def accuracy(outs: dict[int, Any], ref: dict[int, Any]) -> dict[str, Any]:
    same = sum(o.generated_tokens == ref[i].generated_tokens for i, o in outs.items())
    worst = max((d for i, o in outs.items() for d in agreeing_diffs(o, ref[i])[0]), default=0.0)
    return dict(tokens_equal=f"{same}/{len(outs)}", logprob_diff_max=worst)


def forced_requests(reqs: list[tuple[list[int], int]], ref: dict[int, Any], n: int = 16,
                    cuts: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75)) -> list[tuple[list[int], int]]:
    """Teacher-forced requests: the first ``n`` prompts extended by eager's own tokens up to each cut of its
    output, two new tokens each (one from the varlen path over the forced prefix, one decode step)."""
    out = []
    for i in sorted(ref)[:n]:
        prompt, toks = reqs[i][0], list(ref[i].generated_tokens)
        for c in cuts:
            out.append((prompt + toks[: int(c * len(toks))], 2))
    return out


def forced_accuracy(outs: dict[int, Any], ref: dict[int, Any]) -> dict[str, Any]:
    """Chosen-token logprobs of the same forced prefixes against eager's: the first token (prefix prefilled) and
    the second (a decode step, compared where the first tokens agree, so both saw the same prefix)."""
    diffs: list[float] = []
    flips = total = 0
    for i, o in outs.items():
        d, flipped = agreeing_diffs(o, ref[i])
        diffs += d
        flips += flipped
        total += len(d) + flipped
    return dict(forced_steps=total, forced_flips=flips, forced_logprob_diff_max=max(diffs, default=0.0),
                forced_logprob_diff_mean=sum(diffs) / max(len(diffs), 1))


class StepPhases:
    """Host time of CB's generation loop per step, by phase (a context manager around timed rounds).

    Wraps the methods of the manager's ``ContinuousBatchProcessor`` that one loop iteration calls, on the instance:
    ``schedule`` (the scheduler's ``schedule_batch``), ``tensors`` (``prepare_batch_tensors``: the host-side input
    tensors of the batch), ``prepare`` (the rest of ``prepare_next_batch``: padding, offloading), ``h2d``
    (``get_model_kwargs``: the copy of those tensors to the device), ``launch`` (``compute_batch``: a CUDA-graph
    replay, or the compiled forward), ``wait`` (``retrieve_device_outputs`` and the outputs' read-back in
    ``prepare_batch_update``: where the host waits for the GPU), ``update`` (the rest of ``update_batch``: request
    bookkeeping and delivery). ``other`` is wall time outside these (the loop, idle waits for requests)."""

    PHASES = ("schedule", "tensors", "prepare", "h2d", "launch", "wait", "update")

    def __init__(self, manager: Any):
        self.bp = manager.batch_processor
        self.t = dict.fromkeys(self.PHASES, 0.0)
        self.steps = 0
        self._undo: list[tuple[Any, str, Any]] = []

    def _wrap(self, obj: Any, name: str, phase: str, minus: tuple[str, ...] = ()) -> None:
        fn = getattr(obj, name)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            inner0 = sum(self.t[m] for m in minus)
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0 - (sum(self.t[m] for m in minus) - inner0)
                self.t[phase] += dt
                if name == "compute_batch":
                    self.steps += 1

        self._undo.append((obj, name, obj.__dict__.get(name)))
        setattr(obj, name, timed)

    def __enter__(self) -> StepPhases:
        io, runner = self.bp.inputs_and_outputs, self.bp.model_runner
        self._wrap(self.bp.scheduler, "schedule_batch", "schedule")
        self._wrap(io, "prepare_batch_tensors", "tensors")
        self._wrap(self.bp, "prepare_next_batch", "prepare", minus=("schedule", "tensors"))
        self._wrap(io, "get_model_kwargs", "h2d")
        self._wrap(runner, "compute_batch", "launch")
        self._wrap(io, "retrieve_device_outputs", "wait")
        self._wrap(io, "prepare_batch_update", "wait")
        self._wrap(self.bp, "update_batch", "update", minus=("wait",))
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall = time.perf_counter() - self.t0
        for obj, name, own in reversed(self._undo):
            if own is None:
                delattr(obj, name)  # back to the class's method
            else:
                setattr(obj, name, own)

    def per_step_us(self) -> dict[str, float]:
        """Microseconds per step of each phase, ``other`` and the step's wall time."""
        n = max(self.steps, 1)
        out = {k: round(v / n * 1e6, 1) for k, v in self.t.items()}
        out["other"] = round((self.wall - sum(self.t.values())) / n * 1e6, 1)
        out["step"] = round(self.wall / n * 1e6, 1)
        out["steps"] = self.steps
        return out


def profile_round(manager: Any, reqs: list[tuple[list[int], int]], concurrency: int, path: Path) -> float:
    """Serve ``reqs`` under ``torch.profiler``; writes the top kernels to ``path``, returns GPU busy / wall."""
    from torch.profiler import ProfilerActivity, profile

    # CUDA activity alone on a GPU: CPU op events would add host time to every op of the loop being measured
    acts = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        wall, _ = serve_requests(manager, reqs, concurrency)
    events = prof.key_averages()
    busy_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    table = events.table(sort_by="self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total",
                         row_limit=40)
    path.write_text(f"wall {wall * 1e3:.1f} ms, GPU busy {busy_us / 1e3:.1f} ms\n\n{table}\n")
    return busy_us / 1e6 / wall


def run_mode(model: Any, name: str, mode: str, reqs: list[tuple[list[int], int]], concurrency: list[int],
             base: dict[str, Any], options: dict[str, Any], ref: dict[Any, dict[int, Any]],
             counts: list[int] | None = None, profile: bool = False,
             reference: str = "eager") -> list[dict[str, Any]]:
    import transformers as tf

    from ep_fuse.hf import paged_attention

    from ep_fuse.hf import varlen_attention
    from ep_fuse.report import compile_totals

    if mode.partition("+")[0] == "hf":
        paged_attention.uninstall()  # HF as it ships: its compiler-disabled cache update
    else:
        paged_attention.install()
    if mode.partition("+")[0] == "ep_fuse":
        varlen_attention.enable(model)  # what ep_fuse.prepare sets up: varlen attention, no host-built mask
    else:
        varlen_attention.uninstall()  # HF's SDPA over its dense mask
    counts = counts or [len(reqs)] * len(concurrency)
    torch._dynamo.reset()
    ep_fuse.reset_reports()
    from torch._dynamo.utils import compilation_time_metrics, counters

    compilation_time_metrics.clear()
    graphs0 = counters["stats"]["unique_graphs"]
    gen = tf.GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(n for _, n in reqs),
                              pad_token_id=0)
    cls = type(model)  # the class method: ep_fuse.serve.prepare_for_serving may have wrapped the instance's
    manager = cls.init_continuous_batching(model, generation_config=gen,
                                           continuous_batching_config=cb_config(mode, base, options, model))
    rows = []
    manager.start()
    try:
        warm = reqs[: max(concurrency)]
        t_first, _ = serve_requests(manager, warm, max(concurrency))
        graphs = manager.continuous_batching_config.cuda_graph_booleans
        for c, n in zip(concurrency, counts):
            with StepPhases(manager) as phases:
                wall, outs = serve_requests(manager, reqs[:n], c)
            row = dict(model=name, mode=mode, concurrency=c, first_s=t_first,
                       async_batching=manager.continuous_batching_config.use_async_batching,
                       host_us_per_step=phases.per_step_us(),
                       dynamo_graphs=counters["stats"]["unique_graphs"] - graphs0,
                       compile_times={k: round(sum(v), 2) for k, v in compilation_time_metrics.items()},
                       cuda_graphs=f"varlen={graphs[0]} decode={graphs[1]}", **metrics(wall, outs))
            if mode == reference:
                ref[c] = outs
            if c in ref:
                row.update(accuracy(outs, ref[c]))
            if mode.startswith("ep_fuse"):
                reps = ep_fuse.reports()
                counts: dict[str, int] = {}
                for r in reps:
                    for k, v in r.counts().items():
                        counts[k] = counts.get(k, 0) + v
                attn: dict[str, int] = {}
                for r in reps:
                    for op, n in r.ops_after.items():
                        if op.endswith(".varlen_attention.default"):
                            ns = op.split(".")[0]
                            prov = "reference" if ns == "ep_fuse" else ns.removeprefix("ep_fuse_")
                            attn[prov] = attn.get(prov, 0) + n
                row["compile_s"] = {k: round(v, 1) for k, v in compile_totals(reps)[0].items()}
                row["note"] = (f"{len(reps)} graphs; " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
                               + "".join(f", varlen_attention:{p} {n}" for p, n in sorted(attn.items())))
            rows.append(row)
            log({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})
        c = max(concurrency)
        if c in ref:  # teacher-forced logprobs: every mode on the same prefixes (eager's tokens)
            forced = forced_requests(reqs, ref[c])
            _, fouts = serve_requests(manager, forced, c)
            if mode == reference:
                ref["forced"] = fouts
            else:
                acc = forced_accuracy(fouts, ref["forced"])
                for row in rows:
                    row.update(acc)
                log(f"{name} {mode}: forced prefixes {acc}")
        if profile and mode != "eager":
            busy = profile_round(manager, reqs[:c], c, out_dir() / f"serving_profile_{name}_{mode}.txt")
            for row in rows:
                row["gpu_busy"] = round(busy, 3)
            log(f"{name} {mode}: GPU busy {busy:.1%} of the profiled round")
    except Exception as exc:  # one failing mode must not hide the others
        log(f"{name} {mode}: failed: {type(exc).__name__}: {exc}")
        rows.append(dict(model=name, mode=mode, note=f"failed: {type(exc).__name__}: {exc}"[:200]))
    finally:
        manager.stop(block=True, timeout=30)
        paged_attention.install()
    return rows


def forced_cell(r: dict[str, Any], rows: list[dict[str, Any]]) -> str | None:
    """The forced-prefix accuracy of a row, its mean difference also as a multiple of the ``hf`` row's."""
    if "forced_steps" not in r:
        return None
    hf = next((x for x in rows if x["model"] == r["model"] and x["mode"].partition("+")[0] == "hf"
               and "forced_steps" in x), None)
    ratio = (f" ({r['forced_logprob_diff_mean'] / hf['forced_logprob_diff_mean']:.2f}x)"
             if hf and hf["forced_logprob_diff_mean"] > 0 else "")
    return (f"{r['forced_flips']}/{r['forced_steps']}, {r['forced_logprob_diff_max']:.2e} / "
            f"{r['forced_logprob_diff_mean']:.2e}{ratio}")


def host_cell(r: dict[str, Any]) -> str | None:
    h = r.get("host_us_per_step")
    if not h:
        return None
    return " / ".join(f"{h[k]:.0f}" for k in (*StepPhases.PHASES, "other")) + f" = {h['step']:.0f}"


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--models", default="qwen3_30b_a3b,mixtral_8x7b")
    ap.add_argument("--requests", default="256", help="one count, or one per concurrency")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--prompt", default="32-512", help="prompt lengths, uniform in LO-HI")
    ap.add_argument("--new", default="64-256", help="new tokens per request, uniform in LO-HI")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--cuda-graph", choices=("auto", "on", "off"), default="auto",
                    help="HF's own CUDA graphs (use_cuda_graph) for every mode; auto: HF decides")
    ap.add_argument("--profile", action="store_true", help="one profiled round per mode (GPU busy, top kernels)")
    ap.add_argument("--ep-fuse-option", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--tiny", action="store_true", help="CPU check: tiny models, a few short requests")
    ap.add_argument("--reference", default="eager", help="the mode the others' tokens and logprobs are compared "
                    "with (one of --modes; run first)")
    args = ap.parse_args()
    start(args, needs_cuda=not args.tiny)
    options = parse_options(args.ep_fuse_option)
    if args.tiny:
        args.models = "qwen3_moe" if args.models == ap.get_default("models") else args.models
        args.requests = "6" if args.requests == "256" else args.requests
        args.concurrency = "1,4" if args.concurrency == "1,16,64" else args.concurrency
        args.prompt = "8-24" if args.prompt == "32-512" else args.prompt
        args.new = "4-8" if args.new == "64-256" else args.new
        args.modes = "eager,ep_fuse" if args.modes == ",".join(MODES) else args.modes
        options.setdefault("executor", "eager")
        base = dict(num_blocks=32, page_size=32, max_batch_tokens=64)
    else:
        base = {}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = env_info()
    log(info)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    counts = [int(n) for n in args.requests.split(",")]
    counts = counts * len(concurrency) if len(counts) == 1 else counts
    if len(counts) != len(concurrency):
        ap.error(f"--requests: {len(counts)} counts for {len(concurrency)} concurrency levels")
    if args.cuda_graph != "auto":
        base["use_cuda_graph"] = args.cuda_graph == "on"
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        if args.tiny:
            from ep_fuse.testing import tiny as tiny_models

            model = tiny_models.build(name, dtype=torch.float32, device=device, num_hidden_layers=1)
        else:
            model = hf_models.build(name, device=device)
        reqs = workload(max(counts + concurrency), model.config.vocab_size, span(args.prompt), span(args.new))
        ref: dict[Any, dict[int, Any]] = {}
        modes = args.modes.split(",")
        for mode in sorted(modes, key=lambda m: m != args.reference):  # the reference first
            rows += run_mode(model, name, mode, reqs, concurrency, base, options, ref, counts, args.profile,
                             args.reference)
            write_json("serving.json", dict(env=info, args=vars(args), rows=rows))
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    table = []
    for r in rows:
        hf = next((x for x in rows if x["model"] == r["model"] and x.get("concurrency") == r.get("concurrency")
                   and x["mode"] == "hf" and x.get("tokens_s")), None)
        vs = r["tokens_s"] / hf["tokens_s"] if hf and r.get("tokens_s") else None
        table.append([r["model"], r.get("concurrency"), r["mode"], r.get("tokens_s"), vs and f"{vs:.2f}x",
                      r.get("ttft_ms_p50"), r.get("itl_ms_p50"), r.get("itl_ms_p99"), r.get("first_s"),
                      r.get("cuda_graphs"), r.get("async_batching"), host_cell(r), r.get("gpu_busy"),
                      r.get("tokens_equal"),
                      r.get("logprob_diff_max") is not None and f"{r['logprob_diff_max']:.2e}" or None,
                      forced_cell(r, rows),
                      r.get("note", "")[:80]])
    md = markdown_table(["model", "concurrent", "mode", "tokens/s", "vs hf", "TTFT p50 ms", "ITL p50 ms",
                         "ITL p99 ms", "first s", "CUDA graphs", "async",
                         "host µs/step: schedule / tensors / prepare / h2d / launch / wait / update / other = step", "GPU busy", "tokens = reference", "logprob diff max",
                         "forced: flips, diff max / mean (vs hf)", "note"],
                        table)
    (out_dir() / "serving.md").write_text(f"{info}\n\n{md}\n")
    log(md)


if __name__ == "__main__":
    main()
