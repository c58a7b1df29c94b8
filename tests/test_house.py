"""The structure the package promises (docs/architecture.md): registration flows downward, no import cycles, no
module imports another's private names, and the op registry loads on its own.

The import graph is built from the sources with ``ast``: every ``import`` / ``from ... import`` of a package module,
at module level or inside a function, is an edge. Python's implicit import of a parent package is not an edge
(the package roots are lazy: ``ep_fuse/__init__.py`` imports nothing of the package at import time).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = {"ep_fuse": ROOT / "ep_fuse", "ep_fuse.patterns": ROOT / "patterns"}


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg, base in TREES.items():
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([pkg, *parts])] = path
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The package module ``name`` refers to (an attribute of a module resolves to that module)."""
    if name.startswith("patterns"):
        name = "ep_fuse." + name
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str) -> list[tuple[str, str, int]]:
    """``(target module, imported name, line)`` for every import of a package module in ``module``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name)
                if target:
                    out.append((target, "", node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                target = _resolve(f"{base}.{alias.name}")
                if target:
                    sub = f"{base}.{alias.name}"
                    out.append((target, "" if _resolve(sub) == sub or target != _resolve(base) else alias.name,
                                node.lineno))
    return [(t, n, line) for t, n, line in out if t != module]


GRAPH = {m: sorted({t for t, _, _ in _imports(m)}) for m in MODULES}


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read_from_the_sources():
    assert len(MODULES) > 60
    assert "ep_fuse.ops.rms_norm" in GRAPH["ep_fuse.providers.triton.rms_norm"]
    assert "ep_fuse.ops.registry" in GRAPH["ep_fuse.catalog"]


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]


def test_no_import_cycle():
    assert _cycles(GRAPH) == []


def test_the_op_floor_imports_nothing_above_it():
    for module, targets in GRAPH.items():
        if module.startswith("ep_fuse.ops."):
            above = [t for t in targets if not t.startswith("ep_fuse.ops.")]
            assert above == [], f"{module} imports {above} (ops/ is the floor)"
    assert GRAPH["ep_fuse.ops.registry"] == [], "the registry imports nothing of the package"


def test_only_the_catalog_loads_families_providers_engines_and_patterns():
    registration = ("ep_fuse.providers.", "ep_fuse.ep.all_to_all", "ep_fuse.ep.deepep", "ep_fuse.ep.npu",
                    "ep_fuse.ep.symm_mem", "ep_fuse.patterns.")
    upper = ("ep_fuse.passes.", "ep_fuse.pipeline", "ep_fuse.backend", "ep_fuse.cli", "ep_fuse.config",
             "ep_fuse.report", "ep_fuse.dump")
    for module, targets in GRAPH.items():
        if module.startswith(upper):
            loaded = [t for t in targets if t.startswith(registration)]
            assert loaded == [], f"{module} imports {loaded}: provider, engine and pattern modules load through ep_fuse.catalog"


def test_no_private_name_crosses_modules():
    crossing = []
    for module in MODULES:
        for target, name, line in _imports(module):
            if name.startswith("_") and not name.startswith("__"):
                crossing.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {target}.{name}")
    assert crossing == []


def test_importing_the_registry_loads_no_provider_or_engine():
    code = ("import sys, ep_fuse.ops.registry as r\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('ep_fuse'))\n"
            "assert loaded == ['ep_fuse', 'ep_fuse.ops', 'ep_fuse.ops.registry'], loaded\n"
            "assert r.canonical_ops() == {} and r.known_providers() == ['reference']\n"
            "import ep_fuse.catalog\n"
            "assert {'triton', 'npu', 'deepgemm'} <= set(r.known_providers())\n"
            "assert 'rms_norm' in r.canonical_ops() and 'ep_dispatch' in r.canonical_ops()\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize("family", ["rms_norm", "rope", "gemm_swiglu", "moe", "moe_gating", "w8a8", "fp8", "ep",
                                    "varlen_attention"])
def test_a_family_has_one_name_in_every_layer(family):
    from ep_fuse import catalog

    assert family in catalog.FAMILIES
    assert (ROOT / "ep_fuse" / "ops" / f"{family}.py").exists()
    layers = [ROOT / "patterns" / f"{family}.py", *(ROOT / "ep_fuse" / "providers" / p / f"{family}.py"
                                                   for p in catalog.PROVIDERS)]
    assert any(p.exists() for p in layers) or family == "ep", f"{family}: no pattern or provider module"
    assert list((ROOT / "tests").glob(f"test_{family}*.py")), f"{family}: no tests/test_{family}*.py"
