"""``report.html``: one self-contained page per dump folder (matches with before/after drawings, near misses)."""

from __future__ import annotations

import datetime
import html
import json
from pathlib import Path
from typing import Any

from ep_fuse.debug.svg import draw

STYLE = """body{font-family:Helvetica,Arial,sans-serif;margin:24px;color:#222}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left}
th{background:#f3f3f3}.region{display:flex;gap:24px;align-items:flex-start;overflow-x:auto;margin:6px 0 18px}
.region div{flex:none}h3{margin-bottom:2px}code{background:#f6f6f6;padding:1px 3px}.miss{color:#a33}"""


def _load(folder: Path) -> tuple[dict[str, Any], dict[str, dict], dict[str, dict]] | None:
    try:
        report = json.loads((folder / "report.json").read_text())
        before = {n["name"]: n for n in json.loads((folder / "graph_before.json").read_text())}
        after = {n["name"]: n for n in json.loads((folder / "graph_after.json").read_text())}
    except (OSError, ValueError):
        return None
    return report, before, after


def _region(graph: dict[str, dict], core: list[str]) -> list[dict]:
    """``core`` nodes plus their direct inputs and users, in graph order."""
    keep = set(n for n in core if n in graph)
    for name in list(keep):
        keep.update(graph[name]["inputs"])
        keep.update(u for u, n in graph.items() if name in n["inputs"])
    return [n for name, n in graph.items() if name in keep]


def _after_core(after: dict[str, dict], fused: str, stages: list[str] | None = None) -> list[str]:
    """The fused node (or a block's stage nodes) and their ``getitem`` projections in the final graph."""
    heads = [n for n in (stages or [fused]) if n in after]
    return heads + [u for u, n in after.items() if n["target"] == "getitem" and any(h in n["inputs"] for h in heads)]


def _esc(v: Any) -> str:
    return html.escape(str(v))


def render(root: Path) -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>ep_fuse report</title><style>{STYLE}</style>"
             "</head><body>", "<h1>ep_fuse report</h1>",
             f"<p>{_esc(root)} &middot; written {datetime.datetime.now().isoformat(timespec='seconds')}</p>"]
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("graph_")):
        loaded = _load(folder)
        if loaded is None:
            continue
        rep, before, after = loaded
        parts.append(f"<h2>graph {_esc(rep['graph'])} ({_esc(rep['device'])}, executor {_esc(rep['executor'])})</h2>")
        if rep.get("skipped"):
            parts.append(f"<p>not rewritten: {_esc(rep['skipped'])}</p>")
        parts.append("<table><tr><th>pattern</th><th>variant</th><th>module</th><th>provider</th>"
                     "<th>declined</th><th>replaced nodes</th><th>fused node</th></tr>")
        for m in rep["matches"]:
            declined = "; ".join(f"{p}: {r}" for p, r in m.get("declined", []))
            parts.append(f"<tr><td>{_esc(m['pattern'])}</td><td>{_esc(m['variant'])}</td><td>{_esc(m['module_path'])}</td>"
                         f"<td>{_esc(m['provider'])}</td><td>{_esc(declined)}</td><td>{_esc(', '.join(m['nodes']))}</td>"
                         f"<td>{_esc(m['fused_node'])}</td></tr>")
        parts.append("</table>")
        for m in rep["matches"]:
            parts.append(f"<h3>{_esc(m['pattern'])}[{_esc(m['variant'])}] at {_esc(m['module_path'] or m['root'])}</h3>")
            core = _after_core(after, m["fused_node"], m.get("stage_nodes"))
            after_svg = draw(_region(after, core), core) if core else (
                "<p>inlined: no fused provider was taken, the original ATen ops went to Inductor</p>")
            parts.append(f"<div class='region'><div><b>before</b><br>{draw(_region(before, m['nodes']), m['nodes'])}</div>"
                         f"<div><b>after</b><br>{after_svg}</div></div>")
        if rep["near_misses"]:
            parts.append("<h3 class='miss'>near misses</h3><table><tr><th>anchor</th><th>module</th>"
                         "<th>pattern</th><th>failed at</th><th>reason</th></tr>")
            for nm in rep["near_misses"]:
                rows = nm["attempts"] or [{"pattern": "-", "failed_at": "-", "reason": nm["note"]}]
                for a in rows:
                    parts.append(f"<tr><td>{_esc(nm['anchor'])}</td><td>{_esc(nm['module_path'])}</td>"
                                 f"<td>{_esc(a['pattern'])}</td><td>{_esc(a['failed_at'])}</td><td>{_esc(a['reason'])}</td></tr>")
            parts.append("</table>")
        changed = sorted(k for k in set(rep["ops_before"]) | set(rep["ops_after"])
                         if rep["ops_before"].get(k, 0) != rep["ops_after"].get(k, 0))
        if changed:
            parts.append("<h3>op counts</h3><table><tr><th>op</th><th>before</th><th>after</th></tr>")
            parts += [f"<tr><td><code>{_esc(k)}</code></td><td>{rep['ops_before'].get(k, 0)}</td>"
                      f"<td>{rep['ops_after'].get(k, 0)}</td></tr>" for k in changed]
            parts.append("</table>")
        if rep.get("unlowered"):
            parts.append(f"<p>left unlowered: {_esc(', '.join(rep['unlowered']))}</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_html(root: Path) -> Path:
    path = Path(root) / "report.html"
    path.write_text(render(Path(root)))
    return path
