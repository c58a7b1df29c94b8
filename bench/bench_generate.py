"""The serving loop on one GPU: HF ``generate()`` with a static cache, greedy, three ways in one run.

    python bench/bench_generate.py [--models qwen3_30b_a3b,mixtral_8x7b,deepseek_v3] [--batches 1,8,64]
                                   [--prompt 64] [--new 48] [--repeats 2] [--profile-first] [--ep-off OPTION,...]

For each real-sized model (``hf_models.py``, random weights) and batch size:

* ``eager``: ``generate(..., disable_compile=True)``;
* ``inductor``: HF's own default compile of the decode step (``CompileConfig()``: Inductor,
  ``mode="reduce-overhead"``, i.e. CUDA graphs);
* ``ep_fuse``: ``CompileConfig(backend="ep_fuse", mode="reduce-overhead")``.

Reported: generate time (best of ``--repeats`` after the first call) and tokens/s (batch x new tokens /
time), the first call's time (compile included), host µs per decode step spent inside the compiled
call (wall time of the call; with CUDA graphs the GPU work runs asynchronously, so this is the
runtime wrappers' and guards' overhead), Inductor's CUDA-graph skips, and the logits error: the
compiled run is forced onto eager's greedy tokens (a logits processor; raw logits are compared) and
the relative L2 of every step's logits against eager's is taken (max and mean over steps). Greedy
tokens of random models flip on near ties, so tokens are not compared. Writes ``$OUT/generate.json``
and ``generate.md``. ``--profile-first``: where the first call's time goes, per mode -- ep_fuse's capture
and passes (its report), Dynamo's/Inductor's timed phases, and a cProfile of the first call
(``$OUT/first_call_<model>_b<batch>_<mode>.txt``). The profiler slows the call, so the table's first call is
taken without it, after a reset; the profiled compile has warmed Inductor's and Triton's on-disk caches by
then, so with this flag the table's first call is a warm-cache one.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import torch

import hf_models
from common import bench_parser, env_info, markdown_table, out_dir, start, write_json  # noqa: E402

import ep_fuse
from ep_fuse.report import compile_totals  # noqa: E402


def log(*a: Any) -> None:
    print(*a, flush=True)


class ForceTokens:
    """A logits processor that makes generate() follow ``seq`` (eager's greedy tokens)."""

    def __init__(self, seq: torch.Tensor, start: int) -> None:
        self.seq, self.start = seq, start

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        tok = self.seq[:, input_ids.shape[1]]
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, tok.unsqueeze(1), 0.0)


class HostTimer:
    """Wraps the model's compiled decode call and accumulates its wall time per call."""

    def __init__(self, model: Any) -> None:
        self.model, self.calls, self.seconds = model, 0, 0.0
        self._orig = model.get_compiled_call

        def get_compiled_call(cfg: Any) -> Any:
            fn = self._orig(cfg)

            def timed(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                out = fn(*a, **k)
                self.seconds += time.perf_counter() - t0
                self.calls += 1
                return out

            return timed

        model.get_compiled_call = get_compiled_call

    def reset(self) -> None:
        self.calls, self.seconds = 0, 0.0

    def us_per_call(self) -> float | None:
        return 1e6 * self.seconds / self.calls if self.calls else None

    def remove(self) -> None:
        self.model.get_compiled_call = self._orig


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def compile_config(kind: str, device: str) -> Any:
    import transformers as tf

    if kind == "inductor":
        cc = tf.CompileConfig()  # HF's default: Inductor, mode="reduce-overhead"
    elif kind == "ep_fuse":
        cc = tf.CompileConfig(backend="ep_fuse", mode="reduce-overhead")
    else:  # "ep_fuse, OPTION off" (--ep-off): torch.compile takes a mode or options, so the mode is an option here
        off = kind.split(", ")[1].removesuffix(" off")
        cc = tf.CompileConfig(backend="ep_fuse", mode=None, options={"mode": "reduce-overhead", off: False})
    if device != "cuda":  # smoke runs on a CPU: HF compiles the decode step on CUDA only unless told
        if cc.options:
            cc.options["mode"] = "default"
        else:
            cc.mode = "default"
        cc._compile_all_devices = True
    return cc


def reset_compiled(model: Any) -> None:
    for attr in ("_compiled_call", "_last_compile_config"):
        if hasattr(model, attr):
            delattr(model, attr)
    torch._dynamo.reset()
    ep_fuse.reset_reports()
    sync()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed_generate(model: Any, ids: torch.Tensor, **kw: Any) -> tuple[float, Any]:
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, **kw)
    sync()
    return time.perf_counter() - t0, out


def profile_first_call(model: Any, ids: torch.Tensor, cc: Any, path: Path, **kw: Any) -> None:
    """One first call under cProfile, with Dynamo's/Inductor's phase times and ep_fuse's pass times."""
    import cProfile
    import io
    import pstats

    from torch._dynamo.utils import compile_times

    prof = cProfile.Profile()
    prof.enable()
    t, _ = timed_generate(model, ids, compile_config=cc, **kw)
    prof.disable()
    text = io.StringIO()
    text.write(f"first call under cProfile: {t:.2f} s\n\n")
    for rep in ep_fuse.reports():
        text.write(f"ep_fuse graph {rep.graph}: " + ", ".join(f"{p.name} {p.seconds:.3f} s" for p in rep.passes)
                   + "\n")
    text.write(f"\n{compile_times(repr='str', aggregate=True)}\n\n")
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(70)
    stats.sort_stats("tottime").print_stats(30)
    path.write_text(text.getvalue())


def run_case(model: Any, name: str, batch: int, prompt: int, new: int, repeats: int,
             profile: bool = False, extra: list[str] | None = None) -> list[dict[str, Any]]:
    from torch._dynamo.utils import counters
    from transformers import LogitsProcessorList

    vocab = model.config.vocab_size
    device = model.device.type
    g = torch.Generator(device=device).manual_seed(batch)
    ids = torch.randint(1, vocab, (batch, prompt), device=device, generator=g)
    base = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static")
    rows = []
    # eager: reference tokens and logits
    timed_generate(model, ids, disable_compile=True, **base)
    t_eager = min(timed_generate(model, ids, disable_compile=True, **base)[0] for _ in range(repeats))
    _, ref = timed_generate(model, ids, disable_compile=True, return_dict_in_generate=True, output_logits=True,
                            **base)
    ref_logits = [lg.float() for lg in ref.logits]
    rows.append(dict(model=name, batch=batch, mode="eager", generate_s=t_eager, tokens_s=batch * new / t_eager,
                     first_call_s=None, host_us_per_step=None, cudagraph_skips=None, rel_l2_max=0.0,
                     rel_l2_mean=0.0, note=""))
    for kind in ("inductor", "ep_fuse", *(extra or ())):
        reset_compiled(model)
        counters.clear()
        timer = HostTimer(model)
        cc = compile_config(kind, device)
        if profile:
            profile_first_call(model, ids, cc, out_dir() / f"first_call_{name}_b{batch}_{kind}.txt", **base)
            reset_compiled(model)
            counters.clear()
        try:
            t_first, _ = timed_generate(model, ids, compile_config=cc, **base)
            times = []
            for _ in range(repeats):
                timer.reset()
                times.append(timed_generate(model, ids, compile_config=cc, **base)[0])
            host = timer.us_per_call()
            force = LogitsProcessorList([ForceTokens(ref.sequences, prompt)])
            _, out = timed_generate(model, ids, compile_config=cc, return_dict_in_generate=True, output_logits=True,
                                    logits_processor=force, **base)
        except Exception as exc:  # one failing mode must not hide the others
            log(f"{name} b{batch} {kind}: failed: {type(exc).__name__}: {exc}")
            rows.append(dict(model=name, batch=batch, mode=kind, note=f"failed: {type(exc).__name__}: {exc}"[:200]))
            timer.remove()
            continue
        timer.remove()
        errs = [rel_l2(a, b) for a, b in zip(out.logits, ref_logits)]
        skips = sum(counters["inductor"].get(k, 0) for k in counters["inductor"] if "cudagraph_skips" in k)
        note = ""
        if kind.startswith("ep_fuse"):
            reps = ep_fuse.reports()
            note = " | ".join(r.summary() for r in reps)
            phases, analyses = compile_totals(reps)
            note += " | compile: " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
            note += f" | Triton access analyses: {analyses['computed']} computed, {analyses['served']} from " \
                    "ep_fuse's memo"
            hand = [r.inductor for r in reps if r.inductor is not None]
            if hand:
                note += f" | hand-off direct={all(h.direct for h in hand)}, mutated inputs static=" \
                        f"{all(h.cudagraph_safe_mutations for h in hand)}"
        t = min(times)
        rows.append(dict(model=name, batch=batch, mode=kind, generate_s=t, tokens_s=batch * new / t,
                         first_call_s=t_first, host_us_per_step=host, cudagraph_skips=skips,
                         rel_l2_max=max(errs), rel_l2_mean=sum(errs) / len(errs), note=note))
        log({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()})
    reset_compiled(model)
    return rows


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--models", default=",".join(hf_models.MODELS))
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="smoke run: ep_fuse's tiny models (CPU works)")
    ap.add_argument("--ep-off", default="", help="comma-separated boolean ep_fuse options: one more mode each, "
                    "ep_fuse with that option off (e.g. pack_gqa), to measure what it is worth in the loop")
    ap.add_argument("--profile-first", action="store_true",
                    help="also profile each mode's first call (an extra compile per mode; files in $OUT)")
    args = ap.parse_args()
    start(args, needs_cuda=not args.tiny)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = env_info()
    log(info)
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        if args.tiny:
            from ep_fuse.testing import tiny as tiny_models

            model = ep_fuse.prepare(tiny_models.build(name, dtype=torch.float32, device=device))
            model.generation_config.pad_token_id = 0
        else:
            model = hf_models.build(name, device=device)
        for batch in (int(b) for b in args.batches.split(",")):
            rows += run_case(model, name, batch, args.prompt, args.new, args.repeats, args.profile_first,
                             [f"ep_fuse, {o} off" for o in args.ep_off.split(",") if o])
            write_json("generate.json", dict(env=info, args=vars(args), rows=rows))
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    table = []
    by_case: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_case.setdefault((r["model"], r["batch"]), {})[r["mode"]] = r
    for (name, batch), modes in by_case.items():
        ind = modes.get("inductor", {})
        for mode, r in modes.items():
            vs = (r["tokens_s"] / ind["tokens_s"]) if r.get("tokens_s") and ind.get("tokens_s") else None
            first = (r["first_call_s"] / ind["first_call_s"]) if r.get("first_call_s") and ind.get("first_call_s") \
                else None
            table.append([name, batch, mode, r.get("tokens_s"), vs and f"{vs:.2f}x", r.get("first_call_s"),
                          first and f"{first:.2f}x", r.get("host_us_per_step"), r.get("cudagraph_skips"),
                          r.get("rel_l2_max") is not None and f"{r['rel_l2_max']:.2e}" or None,
                          r.get("note", "")[:80]])
    md = markdown_table(["model", "batch", "mode", "tokens/s", "vs HF compile", "first call s", "first vs HF",
                         "host µs/step", "cg skips", "logits rel-L2 max", "note"], table)
    (out_dir() / "generate.md").write_text(f"{info}\n\n{md}\n")
    log(md)


if __name__ == "__main__":
    main()
