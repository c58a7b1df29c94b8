"""Small DAG drawings as inline SVG: graphviz ``dot`` when installed, a layered layout otherwise."""

from __future__ import annotations

import html
import shutil
import subprocess
from collections.abc import Iterable

BOX_W, BOX_H, GAP_X, GAP_Y, PAD = 190, 44, 60, 18, 10
HIGHLIGHT, CONTEXT = "#ffd966", "#eeeeee"


def _short(target: str) -> str:
    return target.removeprefix("aten.").removesuffix(".default")


def draw(nodes: list[dict], highlight: Iterable[str]) -> str:
    """SVG of ``nodes`` (dicts with name/op/target/inputs/value); edges between listed nodes only."""
    hl = set(highlight)
    if shutil.which("dot"):
        try:
            return _dot(nodes, hl)
        except (OSError, subprocess.SubprocessError):
            pass
    return _layered(nodes, hl)


def _label(n: dict) -> tuple[str, str]:
    what = _short(n["target"]) if n["op"] == "call_function" else n["op"]
    return n["name"], f"{what} {n.get('value', '')}".strip()


def _dot(nodes: list[dict], hl: set[str]) -> str:
    names = {n["name"] for n in nodes}
    lines = ["digraph G { rankdir=LR; node [shape=box, style=filled, fontname=Helvetica, fontsize=10];"]
    for n in nodes:
        a, b = _label(n)
        color = HIGHLIGHT if n["name"] in hl else CONTEXT
        lines.append(f'"{n["name"]}" [label="{a}\\n{b}", fillcolor="{color}"];')
    for n in nodes:
        for i in n["inputs"]:
            if i in names:
                lines.append(f'"{i}" -> "{n["name"]}";')
    lines.append("}")
    out = subprocess.run(["dot", "-Tsvg"], input="\n".join(lines), capture_output=True, text=True,
                         timeout=30, check=True).stdout
    return out[out.index("<svg"):]


def _layered(nodes: list[dict], hl: set[str]) -> str:
    names = [n["name"] for n in nodes]
    index = {name: i for i, name in enumerate(names)}
    depth: dict[str, int] = {}
    for n in nodes:  # nodes are in graph (topological) order
        ins = [depth[i] for i in n["inputs"] if i in index and i in depth]
        depth[n["name"]] = 1 + max(ins) if ins else 0
    columns: dict[int, list[str]] = {}
    for name in names:
        columns.setdefault(depth[name], []).append(name)
    top = PAD + 40  # room for edges that arc over skipped columns
    pos = {}
    for d, col in columns.items():
        for r, name in enumerate(col):
            pos[name] = (PAD + d * (BOX_W + GAP_X), top + r * (BOX_H + GAP_Y))
    width = PAD * 2 + (max(columns) + 1) * (BOX_W + GAP_X) if columns else 2 * PAD
    height = top + PAD + max((len(c) for c in columns.values()), default=0) * (BOX_H + GAP_Y)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="Helvetica" '
        'font-size="10"><defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" '
        'markerHeight="6" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>'
    ]
    for n in nodes:
        x2, y2 = pos[n["name"]]
        for i in n["inputs"]:
            if i in pos:
                x1, y1 = pos[i]
                sx, sy, ex, ey = x1 + BOX_W, y1 + BOX_H / 2, x2, y2 + BOX_H / 2
                span = depth[n["name"]] - depth[i]
                if span <= 1:
                    d = f"M{sx},{sy} L{ex},{ey}"
                else:  # arc above the boxes in between instead of running behind them
                    lift = min(sy, ey) - BOX_H / 2 - 8 - 6 * min(span, 5)
                    d = f"M{sx},{sy} C{sx + 40},{lift} {ex - 40},{lift} {ex},{ey}"
                parts.append(f'<path d="{d}" fill="none" stroke="#555" marker-end="url(#arrow)"/>')
    for n in nodes:
        x, y = pos[n["name"]]
        a, b = _label(n)
        color = HIGHLIGHT if n["name"] in hl else CONTEXT
        parts.append(f'<g class="node" data-name="{html.escape(n["name"])}"><rect x="{x}" y="{y}" width="{BOX_W}" '
                     f'height="{BOX_H}" rx="4" fill="{color}" stroke="#888"/>'
                     f'<text x="{x + 6}" y="{y + 17}" font-weight="bold">{html.escape(a)}</text>'
                     f'<text x="{x + 6}" y="{y + 33}">{html.escape(b[:34])}</text></g>')
    parts.append("</svg>")
    return "".join(parts)
