"""``ep-fuse``: see every rewrite ep_fuse makes, and why a pattern did not match.

    ep-fuse dump TARGET [--device cpu|cuda|npu] [--executor auto|inductor|eager] [--dynamic] [--prepare] [--out DIR]
    ep-fuse patterns [--family NAME]
    ep-fuse explain TARGET --pattern NAME [--node NODE] [--prepare]
    ep-fuse diff DIR                     (per graph: pass deltas, fused sites, EP overlap schedules)
    ep-fuse serve MODEL [--ep-fuse-option KEY=VALUE] [transformers serve options]   (ep_fuse/serve.py)

``--prepare`` runs ``ep_fuse.prepare`` on the model first and prints what it did per MoE block (rebuilt, or
declined with the part that failed: router / experts / combine).

TARGET is ``path/to/file.py:factory``, ``package.module:factory`` (a callable returning
``(model, inputs)``) or a built-in tiny HF model ``hf:<name>`` (``ep_fuse.testing.tiny.TINY_MODELS``).

Exit codes: 0 done; 2 bad arguments or TARGET, unknown pattern; 3 the factory raised;
4 compiling or running the model failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import ep_fuse
from ep_fuse.catalog import PATTERN_FAMILIES, all_patterns, known_names, pattern_names
from ep_fuse.config import ConfigError, EpFuseConfig, parse_key_values
from ep_fuse.debug.targets import FactoryError, TargetError, load
from ep_fuse.ops.registry import canonical_ops, default_priority

EXIT_OK, EXIT_USAGE, EXIT_FACTORY, EXIT_COMPILE = 0, 2, 3, 4


class CliError(Exception):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _err(msg: str) -> None:
    print(f"ep-fuse: {msg}", file=sys.stderr)


class _Progress:
    """Stage lines and pass timings on stderr, plus a heartbeat while a long compile runs."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self._stop = threading.Event()
        self._handler: logging.Handler | None = None

    def say(self, msg: str) -> None:
        if not self.quiet:
            print(f"ep-fuse: {msg}", file=sys.stderr, flush=True)

    def __enter__(self) -> _Progress:
        if self.quiet:
            return self
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("ep-fuse:   %(message)s"))
        logger = logging.getLogger("ep_fuse.progress")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        self._handler = handler
        start = time.time()

        def beat() -> None:
            while not self._stop.wait(10):
                print(f"ep-fuse:   ... still compiling ({time.time() - start:.0f} s)", file=sys.stderr, flush=True)

        threading.Thread(target=beat, daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._handler is not None:
            logging.getLogger("ep_fuse.progress").removeHandler(self._handler)


def _parse_options(pairs: list[str]) -> dict[str, Any]:
    try:
        return parse_key_values(pairs, "--option")
    except ConfigError as e:
        raise CliError(str(e), EXIT_USAGE) from e


def _compile(args: argparse.Namespace, options: dict[str, Any], progress: _Progress) -> tuple[Any, list[Any]]:
    try:
        EpFuseConfig.from_options(options).check_names(**known_names())
    except ConfigError as exc:
        raise CliError(str(exc).removeprefix("ep_fuse: "), EXIT_USAGE) from exc
    progress.say(f"building {args.target} on {args.device}")
    try:
        target = load(args.target, args.device)
    except TargetError as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc
    except FactoryError as exc:
        raise CliError(str(exc), EXIT_FACTORY) from exc
    args.prepared = _prepare(target.model, progress) if getattr(args, "prepare", False) else []
    torch._dynamo.reset()
    ep_fuse.reset_reports()
    progress.say("compiling with backend='ep_fuse' (Dynamo trace, AOT capture, ep_fuse passes, executor)")
    t0 = time.time()
    try:
        with progress, torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = torch.compile(target.model, backend="ep_fuse", options=options, dynamic=args.dynamic or None)
            compiled(*target.args, **target.kwargs)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CliError(f"compiling {args.target} failed: {type(exc).__name__}: {first}", EXIT_COMPILE) from exc
    progress.say(f"compiled and ran in {time.time() - t0:.1f} s")
    return target, ep_fuse.reports()


class _PrepareLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("ep_fuse.prepare: "):
            self.lines.append(("WARNING " if record.levelno >= logging.WARNING else "") + msg.removeprefix(
                "ep_fuse.prepare: "))


def _prepare(model: Any, progress: _Progress) -> list[str]:
    """``ep_fuse.prepare(model)``; returns what it said of each block (converted, or declined with the part)."""
    progress.say("ep_fuse.prepare (per-expert loops, MoE blocks recognised by what they compute)")
    handler = _PrepareLines()
    logger = logging.getLogger("ep_fuse")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(min(level or logging.INFO, logging.INFO))
    try:
        ep_fuse.prepare(model)
    except Exception as exc:
        raise CliError(f"ep_fuse.prepare failed: {type(exc).__name__}: {exc}", EXIT_COMPILE) from exc
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return handler.lines


def _prepared_lines(args: argparse.Namespace) -> list[str]:
    lines = getattr(args, "prepared", [])
    return ["prepare:", *(f"  {line}" for line in lines)] if lines else []


# --------------------------------------------------------------------------- commands
def cmd_dump(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists():
        for old in out.glob("graph_*"):
            shutil.rmtree(old)
    out.mkdir(parents=True, exist_ok=True)
    options = {"executor": args.executor, **_parse_options(args.option), "dump_dir": str(out)}
    _target, reports = _compile(args, options, _Progress(args.quiet))
    text = "\n".join(_prepared_lines(args) + ["\n\n".join(str(r) for r in reports) or "no graph was compiled"])
    (out / "summary.txt").write_text(text + "\n")
    print(text)
    misses = sum(len(r.near_misses) for r in reports)
    if misses:
        print(f"\n{misses} candidate site(s) not fused: ep-fuse explain {args.target} --pattern NAME")
    print(f"\nwrote {out}/ (per graph: 00_dynamo.py, 01_aten.py, NN_<pass>.py, report.json; report.html)")
    return EXIT_OK


def cmd_explain(args: argparse.Namespace) -> int:
    names = pattern_names()
    if args.pattern not in names and args.pattern not in PATTERN_FAMILIES:
        raise CliError(f"unknown pattern {args.pattern!r}; patterns: {', '.join(names)}", EXIT_USAGE)
    # a pattern name, else the patterns of a family (``moe``: moe_experts)
    wanted = {args.pattern} if args.pattern in names else {p.name for p in all_patterns() if p.family == args.pattern}
    options = {"executor": args.executor, **_parse_options(args.option)}
    _target, reports = _compile(args, options, _Progress(args.quiet))
    fused = [m for r in reports for m in r.matches if m.pattern in wanted]
    lines: list[str] = []
    if args.node:
        for m in fused:
            if args.node == m.root or args.node in m.nodes:
                lines.append(f"{args.node} was fused: {m.pattern}[{m.variant}] at {m.module_path or m.root} "
                             f"(provider {m.provider}; replaced {', '.join(m.nodes)})")
    sites = 0
    for r in reports:
        for nm in r.near_misses:
            attempts = [a for a in nm.attempts if a.pattern.split("[")[0] in wanted]
            if nm.attempts and not attempts or nm.patterns and not wanted.intersection(nm.patterns):
                continue
            if args.node and args.node != nm.anchor and all(args.node != a.failed_at for a in attempts):
                continue
            sites += 1
            nm = type(nm)(nm.graph, nm.anchor, nm.anchor_op, nm.module_path, attempts, nm.note)
            lines.append(f"[graph {r.graph}] " + nm.explain())
    head = (f"{args.pattern} on {args.target}: {len(fused)} site(s) fused, {sites} candidate site(s) not fused"
            + (f" (node {args.node})" if args.node else ""))
    if args.pattern in ("moe", "moe_experts", "moe_gating"):
        lines = [*lines, *_prepared_lines(args)]
    print("\n".join([head, *lines]))
    if args.node and not lines:
        print(f"no candidate site or fused node named {args.node!r} (node names are those of 01_aten.py in a dump)")
    return EXIT_OK


def cmd_patterns(args: argparse.Namespace) -> int:
    fams = PATTERN_FAMILIES
    if args.family and args.family not in fams:
        raise CliError(f"unknown family {args.family!r}; families: {', '.join(fams)}", EXIT_USAGE)
    ops = canonical_ops()
    for fam_name, mod in fams.items():
        if args.family and fam_name != args.family:
            continue
        print(f"family {fam_name}: {mod.DESCRIPTION}")
        by_name: dict[str, list[Any]] = {}
        for p in mod.PATTERNS:
            by_name.setdefault(p.name, []).append(p)
        for name, pats in by_name.items():
            first = pats[0]
            print(f"  pattern {name} -> {first.produces}")
            print(f"    variants: {', '.join(p.variant for p in pats)}")
            print(f"    anchors:  {', '.join(str(a) for a in first.anchors)}")
            print("    guards:")
            for g in first.guards:
                print(f"      {g.__name__}: {(g.__doc__ or '').strip().splitlines()[0] if g.__doc__ else ''}")
            canon = ops.get(first.produces.split("::")[-1])
            print("    providers by device (first that supports a call wins):")
            parts = [ops[n] for n in canon.stages] if canon is not None and canon.stages else [canon]
            for dev in ("cuda", "npu", "cpu"):
                chains = []
                for part in parts:
                    order = [p for p in default_priority(dev)
                             if p == "reference" or (part is not None and p in part.providers)]
                    chains.append((f"{part.name}: " if len(parts) > 1 else "") + " > ".join(order))
                print(f"      {dev}: {'; '.join(chains)}")
    return EXIT_OK


def cmd_diff(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    folders = sorted(p for p in root.glob("graph_*") if (p / "report.json").is_file()) if root.is_dir() else []
    if not folders:
        raise CliError(f"{root} holds no ep_fuse dump (expected graph_*/report.json; make one with ep-fuse dump)",
                       EXIT_USAGE)
    for folder in folders:
        rep = json.loads((folder / "report.json").read_text())
        print(f"graph {rep['graph']} ({rep['device']}, executor {rep['executor']})")
        prev = rep["ops_before"]
        print(f"  {'input':<14} {sum(prev.values())} ops")
        for p in rep["passes"]:
            cur = p["ops"]
            delta = {k: cur.get(k, 0) - prev.get(k, 0) for k in set(prev) | set(cur)}
            changes = ", ".join(f"{k} {prev.get(k, 0)}->{cur.get(k, 0)}" for k in sorted(delta) if delta[k])
            print(f"  {p['name']:<14} {sum(cur.values())} ops; {changes or 'no change'}")
            prev = cur
        counts: dict[str, int] = {}
        for m in rep["matches"]:
            counts[m["pattern"]] = counts.get(m["pattern"], 0) + 1
        fused = ", ".join(f"{k} x{v}" for k, v in counts.items()) or "nothing"
        print(f"  fused: {fused}; not fused: {len(rep['near_misses'])} candidate site(s)")
        for e in rep.get("ep", []):  # the EP overlap schedule per block (ep_overlap)
            why = f" ({e['overlap_reason']})" if e.get("overlap_reason") else ""
            engine = e.get("engine", e.get("backend"))  # dumps written before the field was renamed say backend
            print(f"  EP {e['module_path'] or e['block']}: {engine}, overlap {e.get('overlap', 'none')}{why}")
            if e.get("range_split"):
                print(f"    range split: {e['range_split']}")
            for step in e.get("schedule", []):
                print(f"    {step}")
    return EXIT_OK


# --------------------------------------------------------------------------- entry
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ep-fuse", description="Inspect ep_fuse rewrites.",
                                 epilog="exit codes: 0 ok, 2 bad arguments/TARGET/pattern, 3 factory raised, "
                                        "4 compile or run failed")
    sub = ap.add_subparsers(dest="command", required=True)

    def target_args(p: argparse.ArgumentParser, executor: str) -> None:
        p.add_argument("target", help="file.py:factory, package.module:factory or hf:<model>")
        p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "npu"])
        p.add_argument("--executor", default=executor, choices=["auto", "inductor", "eager"])
        p.add_argument("--dynamic", action="store_true", help="compile with dynamic shapes")
        p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                       help="extra ep_fuse option (JSON value), repeatable")
        p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
        p.add_argument("--prepare", action="store_true",
                       help="run ep_fuse.prepare on the model first and show what it did per MoE block (rebuilt, "
                            "or declined with the part that failed: router / experts / combine)")

    p = sub.add_parser("dump", help="compile TARGET and write every graph before/after each pass")
    target_args(p, "auto")
    p.add_argument("--out", default="ep_fuse_dump", help="output folder (default: ep_fuse_dump)")
    p.set_defaults(fn=cmd_dump)
    p = sub.add_parser("explain", help="why candidate sites of a pattern were not fused")
    target_args(p, "eager")
    p.add_argument("--pattern", required=True, help="pattern or family name (see ep-fuse patterns)")
    p.add_argument("--node", help="one ATen node name (as in 01_aten.py of a dump)")
    p.set_defaults(fn=cmd_explain)
    p = sub.add_parser("patterns", help="list the pattern catalog")
    p.add_argument("--family")
    p.set_defaults(fn=cmd_patterns)
    p = sub.add_parser("diff", help="op histogram before/after each pass of a dump")
    p.add_argument("dir")
    p.set_defaults(fn=cmd_diff)
    sub.add_parser("serve", help="HF's OpenAI-compatible server compiled by ep_fuse (ep-fuse serve --help)",
                   add_help=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # its options are transformers serve's: parsed there
        from ep_fuse import serve

        return serve.main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except CliError as exc:
        _err(str(exc))
        return exc.code
    except KeyboardInterrupt:
        _err("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
