"""The structure the package promises (docs/architecture.md): registration flows downward, no import cycles, no
module reads another's private names, the op registry and the config load on their own, module-level state is a short
allow-list, every family of the catalog has its files in every layer, and the docs name only modules that exist.

The import graph is built from the sources with ``ast``: every ``import`` / ``from ... import`` of a package module,
at module level or inside a function, is an edge. Python's implicit import of a parent package is not an edge
(the package roots are lazy: ``ep_fuse/__init__.py`` imports nothing of the package at import time).
"""

from __future__ import annotations

import ast
import functools
import re
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



def _import_base(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a ``from ... import`` in ``package`` names (relative levels resolved)."""
    base = node.module or ""
    if node.level:
        anchor = package
        for _ in range(node.level - 1):
            anchor = anchor.rpartition(".")[0]
        base = f"{anchor}.{base}" if base else anchor
    return base

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
            base = _import_base(node, package)
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


def test_model_surgery_hf_integrations_and_testing_sit_above_the_compiler():
    """``surgery`` (what ``prepare`` does to a model), ``hf`` (transformers integrations) and ``testing`` (tiny models,
    the sweep) work on models: the compiler below them (ops, matching, passes, pipeline, backend, providers, engines)
    imports none of them, and only the CLI's targets (and the old ``models`` names) reach ``testing``."""
    model_level = ("ep_fuse.surgery", "ep_fuse.hf", "ep_fuse.testing", "ep_fuse.models")
    for module, targets in GRAPH.items():
        if not module.startswith((*model_level, "ep_fuse.serve", "ep_fuse.debug", "ep_fuse.cli", "ep_fuse.__init__")) \
                and module != "ep_fuse":
            up = [t for t in targets if t.startswith(model_level)]
            assert up == [], f"{module} imports {up}"
    users = sorted(m for m, t in GRAPH.items() if any(x.startswith("ep_fuse.testing") for x in t)
                   and not m.startswith(("ep_fuse.testing", "ep_fuse.models")))
    assert users == ["ep_fuse.debug.targets"], users


def test_no_private_name_crosses_modules():
    crossing = []
    for module in MODULES:
        for target, name, line in _imports(module):
            if name.startswith("_") and not name.startswith("__"):
                crossing.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {target}.{name}")
    assert crossing == []


def test_importing_the_registry_a_pass_or_the_config_loads_no_provider_or_engine():
    code = ("import sys, ep_fuse.ops.registry as r\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('ep_fuse'))\n"
            "assert loaded == ['ep_fuse', 'ep_fuse.ops', 'ep_fuse.ops.registry'], loaded\n"
            "assert r.canonical_ops() == {} and r.known_providers() == ['reference']\n"
            "import ep_fuse.passes.quant, ep_fuse.passes.ep_overlap, ep_fuse.config\n"  # a pass and the config: no catalog
            "bad = sorted(m for m in sys.modules if m.startswith(('ep_fuse.providers.', 'ep_fuse.patterns', "
            "'ep_fuse.catalog', 'ep_fuse.ep.all_to_all', 'ep_fuse.ep.deepep', 'ep_fuse.ep.symm_mem')))\n"
            "assert bad == [], bad\n"
            "import ep_fuse.catalog\n"
            "assert {'triton', 'npu', 'deepgemm'} <= set(r.known_providers())\n"
            "assert 'rms_norm' in r.canonical_ops() and 'ep_dispatch' in r.canonical_ops()\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _literal_tuple(path: Path, name: str) -> tuple[str, ...]:
    """The tuple of strings assigned to ``name`` at the top of ``path`` (read without importing it)."""
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError(f"{path}: no {name} = (...)")


FAMILIES = _literal_tuple(ROOT / "ep_fuse" / "catalog.py", "FAMILIES")
DOCS = sorted((ROOT / "docs").glob("*.md"))


def _bench_run() -> dict[str, list[str]]:
    """``bench/run.py``'s families -> their scripts (it imports neither torch nor ep_fuse)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ep_fuse_bench_run", ROOT / "bench" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return {fam: [b.script for b in benches] for fam, benches in mod.FAMILIES.items()}


def test_the_family_list_is_the_catalogs():
    from ep_fuse import catalog

    assert FAMILIES == catalog.FAMILIES and "moe_masked" in FAMILIES


def _mentions(text: str, word: str) -> bool:
    import re

    return re.search(rf"(?<![\w.]){re.escape(word)}(?!\w)", text) is not None


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_has_one_name_in_every_layer(family):
    from ep_fuse import catalog

    assert (ROOT / "ep_fuse" / "ops" / f"{family}.py").exists(), f"{family}: no ep_fuse/ops/{family}.py"
    layers = [ROOT / "patterns" / f"{family}.py", *(ROOT / "ep_fuse" / "providers" / p / f"{family}.py"
                                                   for p in catalog.PROVIDERS)]
    if family == "ep":  # its implementations are the engines
        layers = [ROOT / "ep_fuse" / "ep" / f"{engine}.py" for engine in catalog.ENGINES]
        assert all(p.exists() for p in layers), layers
    assert any(p.exists() for p in layers), f"{family}: no pattern or provider module"
    assert list((ROOT / "tests").glob(f"test_{family}*.py")), f"{family}: no tests/test_{family}*.py"
    assert (ROOT / "bench" / f"bench_{family}.py").exists(), f"{family}: no bench/bench_{family}.py"
    assert f"bench_{family}.py" in _bench_run().get(family, []), f"{family}: bench_{family}.py not in bench/run.py"
    assert _mentions((ROOT / "README.md").read_text(), family), f"{family}: not in README.md"
    assert any(_mentions(d.read_text(), family) for d in DOCS), f"{family}: not in docs/"


def test_every_bench_of_a_family_is_run():
    families = _bench_run()
    listed = {script for scripts in families.values() for script in scripts}
    benches = {p.name for p in (ROOT / "bench").glob("bench_*.py")}
    assert benches - listed == set(), f"benches bench/run.py does not run: {sorted(benches - listed)}"


def test_the_readme_lists_every_pattern():
    from ep_fuse import catalog

    readme = (ROOT / "README.md").read_text()
    missing = [name for name in catalog.pattern_names() if not _mentions(readme, name)]
    assert missing == []


# --------------------------------------------------------------------------- private names, attribute access too
def _module_aliases(tree: ast.AST, module: str) -> dict[str, str]:
    """Local name -> the package module it is bound to by an import in ``module``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in MODULES:
                    out[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _import_base(node, package)
            if base.startswith("patterns"):
                base = "ep_fuse." + base
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    out[alias.asname or alias.name] = f"{base}.{alias.name}"
    return out


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def private_reads(path: Path, module: str | None) -> list[str]:
    """``mod._name`` reads in ``path`` where ``mod`` is another package module (by alias or dotted path)."""
    tree = _tree(path)
    aliases = _module_aliases(tree, module) if module else {}
    out = []
    if module is None:  # a test: every ``import ep_fuse.x as y`` / ``from ep_fuse.x import y``, and private imports
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in MODULES})
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                base = ("ep_fuse." + node.module) if node.module.startswith("patterns") else node.module
                aliases.update({a.asname or a.name: f"{base}.{a.name}" for a in node.names
                                if f"{base}.{a.name}" in MODULES})
                out += [f"{path}:{node.lineno} reads {base}.{a.name}" for a in node.names
                        if base in MODULES and a.name.startswith("_") and not a.name.startswith("__")]
    for node in sorted(ast.walk(tree), key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0))):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        owner = _dotted(node.value)
        if owner is None:
            continue
        head, _, rest = owner.partition(".")
        target = aliases.get(head)
        target = f"{target}.{rest}" if target and rest else target or owner
        if target in MODULES and target != module:
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            out.append(f"{where}:{node.lineno} reads {target}.{node.attr}")
    return out


def test_private_name_finder_sees_attribute_access(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import ep_fuse.ops.registry as r\nfrom ep_fuse.ops import registry\nimport ep_fuse.ops.registry\n"
                   "r._OPS\nregistry._PRIORITY\nep_fuse.ops.registry._SPARSE\nregistry.canonical_ops\nr.__name__\n")
    reads = [line.split(" reads ")[1] for line in private_reads(src, None)]
    assert reads == ["ep_fuse.ops.registry._OPS", "ep_fuse.ops.registry._PRIORITY", "ep_fuse.ops.registry._SPARSE"]


def test_no_module_reads_another_modules_private_names():
    reads = [r for module, path in MODULES.items() for r in private_reads(path, module)]
    assert reads == []


TEST_SEAMS = {
    "ep_fuse.ep.deepep._BUFFERS", "ep_fuse.ep.symm_mem._BUFFERS", "ep_fuse.ep.all_to_all._splits",
    "ep_fuse.ep.all_to_all._remember_splits", "ep_fuse.ep.all_to_all._dispatch_kernels", "ep_fuse.ops.ep._ASYNC",
    "ep_fuse.ops.registry._warn_once", "ep_fuse.kernel_analysis._memo", "ep_fuse.kernel_analysis._ANALYSES",
    "ep_fuse.passes.quant._warn_fp8_reference", "ep_fuse.passes.canonicalize._same_result",
    "ep_fuse.passes.canonicalize._same_strides", "ep_fuse.backend._WARNED", "ep_fuse.providers.triton.moe._tma_takes",
    "ep_fuse.providers.triton.moe._grouped_prefers", "ep_fuse.providers.npu.rms_norm._ones",
    "ep_fuse.providers.triton.provider._unbacked", "ep_fuse.providers.triton.provider._inline_rule",
    "ep_fuse.serve._assembly", "ep_fuse.testing.sweep._keep_layers", "ep_fuse.testing.sweep._tiny_layer_value",
}
"""Private names tests still read (caches they clear, helpers they call). The list only shrinks: give the name a
public function (or make it public) and drop it here; a new private read fails."""


def test_tests_read_no_private_names_of_the_package():
    reads = [r for path in sorted((ROOT / "tests").rglob("*.py")) for r in private_reads(path, None)]
    names = {r.split(" reads ")[1] for r in reads}
    assert [r for r in reads if r.split(" reads ")[1] not in TEST_SEAMS] == []
    assert TEST_SEAMS - names == set(), "no longer read: drop them from TEST_SEAMS"


# --------------------------------------------------------------------------- module-level state
MUTABLE_CALLS = {"list", "dict", "set", "defaultdict", "OrderedDict", "WeakKeyDictionary", "WeakValueDictionary",
                 "WeakSet", "deque", "Counter"}
MUTATORS = {"append", "extend", "add", "update", "clear", "pop", "remove", "setdefault", "insert", "discard",
            "popitem"}

STATE = {
    # registries filled once at import by the modules that register
    "ep_fuse.ops.registry": {"_LIBS", "_OPS", "_PROVIDER_NAMES", "_PRIORITY", "_SPARSE", "_RULES", "_warned"},
    "ep_fuse.ops.ep": {"_ENGINES", "_ASYNC", "_PENDING", "_BY_PTR"},
    "ep_fuse.ep.handles": {"_entries", "_by_ptr"},
    "ep_fuse.providers.triton.provider": {"SYMBOLIC_INLINE"},
    "ep_fuse.patterns.moe_gating": {"_FORMS"},
    # per-process resources and caches (communication buffers, memo tables, weights made once)
    "ep_fuse.ep.deepep": {"_BUFFERS"},
    "ep_fuse.ep.symm_mem": {"_BUFFERS"},
    "ep_fuse.ep.all_to_all": {"_SPLITS"},
    "ep_fuse.kernel_analysis": {"_memo"},
    "ep_fuse.providers.npu.gemm_swiglu": {"_CONCAT"},
    # what the process did: reports, warnings said once, installed HF hooks
    "ep_fuse.report": {"_reports"},
    "ep_fuse.backend": {"_WARNED"},
    "ep_fuse.log": {"_configured"},
    "ep_fuse.hf.paged_attention": {"_ORIGINALS"},
    "ep_fuse.hf.varlen_attention": {"_ENABLED", "_FORCED", "_ORIGINALS"},
}
"""The module-level state the package keeps, and why (``docs/architecture.md``, "What is declared where"). Behaviour
switches are never module state: they are config fields or arguments."""


def _module_state(module: str) -> set[str]:
    """Names ``module`` binds at its top level to a mutable container and mutates, and names it rebinds with
    ``global``."""
    tree = _tree(MODULES[module])
    containers = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
        v = getattr(node, "value", None)
        call = isinstance(v, ast.Call) and getattr(v.func, "id", getattr(v.func, "attr", None)) in MUTABLE_CALLS
        if call or isinstance(v, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
            containers |= {t.id for t in targets if isinstance(t, ast.Name)}
    mutated, rebound = set(), set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in MUTATORS \
                and isinstance(n.func.value, ast.Name):
            mutated.add(n.func.value.id)
        elif isinstance(n, (ast.Assign, ast.AugAssign, ast.Delete)):
            for t in n.targets if isinstance(n, (ast.Assign, ast.Delete)) else [n.target]:
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name):
                    mutated.add(t.value.id)
        elif isinstance(n, ast.Global):
            rebound |= set(n.names)
    return (containers & mutated) | rebound


def test_module_level_state_is_the_allow_list():
    found = {m: s for m in MODULES if (s := _module_state(m))}
    extra = {m: sorted(s - STATE.get(m, set())) for m, s in found.items() if s - STATE.get(m, set())}
    assert extra == {}, "new module-level state: make it a config field or an argument, or add it to STATE with why"
    stale = {m: sorted(s - found.get(m, set())) for m, s in STATE.items() if s - found.get(m, set())}
    assert stale == {}, "no longer state: drop it from STATE"


TEST_SET_GLOBALS = {
    "ep_fuse.ep.deepep.NVL_RANKS",  # ranks per node: two nodes faked on one host, with the double's topology
    "ep_fuse.ep.npu.LIMITS",  # the Ascend op's EP sizes: widened for a 2-rank double
    "ep_fuse.providers.npu.moe.TRANSPOSED",  # the per-weight transposed-copy cache, emptied around a test
    # measured thresholds lowered so a test reaches the kernel path at a small size
    "ep_fuse.providers.triton.fp8.FP8_BLOCK_MAX_ROWS_PER_EXPERT", "ep_fuse.providers.triton.fp8.FP8_TMA_MIN_ROWS_PER_EXPERT",
    "ep_fuse.providers.triton.gemm_swiglu.GEMM_SWIGLU_TMA_MIN_ROWS", "ep_fuse.providers.triton.w8a8_kernel.QUANT_BLOCK",
}
"""Module constants tests still overwrite (none is a behaviour switch: those are config fields). The list only
shrinks."""


def _globals_set(path: Path, module: str | None) -> list[str]:
    """``mod.NAME = ...``, ``mod.NAME.<mutator>(...)`` and ``monkeypatch.setattr(mod, "NAME", ...)`` on an
    UPPER_CASE name of another package module."""
    tree = _tree(path)
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in MODULES})
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            base = ("ep_fuse." + node.module) if node.module.startswith("patterns") else node.module
            aliases.update({a.asname or a.name: f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES})

    def owner(expr: ast.AST) -> str | None:
        dotted = _dotted(expr)
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        target = aliases.get(head)
        target = f"{target}.{rest}" if target and rest else target or dotted
        return target if target in MODULES and target != module else None

    out = []
    for n in sorted(ast.walk(tree), key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0))):
        hits: list[tuple[ast.AST, str]] = []
        if isinstance(n, (ast.Assign, ast.AugAssign)):
            hits = [(t.value, t.attr) for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                    if isinstance(t, ast.Attribute)]
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            f = n.func
            if f.attr in MUTATORS and isinstance(f.value, ast.Attribute):
                hits = [(f.value.value, f.value.attr)]
            elif f.attr == "setattr" and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant):
                hits = [(n.args[0], str(n.args[1].value))]
        for obj, name in hits:
            target = owner(obj)
            if target and name.isupper() and not name.startswith("_"):
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                out.append(f"{where}:{n.lineno} sets {target}.{name}")
    return out


def test_nothing_sets_another_modules_globals():
    """Behaviour is steered by config fields and arguments: neither the package nor the tests assign or mutate another
    module's UPPER_CASE globals (but for :data:`TEST_SET_GLOBALS`)."""
    found = [s for m, p in MODULES.items() for s in _globals_set(p, m)]
    found += [s for p in sorted((ROOT / "tests").rglob("*.py")) for s in _globals_set(p, None)]
    found += [s for p in sorted((ROOT / "bench").glob("*.py")) for s in _globals_set(p, None)]
    names = {s.split(" sets ")[1] for s in found}
    assert [s for s in found if s.split(" sets ")[1] not in TEST_SET_GLOBALS] == []
    assert TEST_SET_GLOBALS - names == set(), "no longer set: drop them from TEST_SET_GLOBALS"


def test_the_state_finders_find_state(tmp_path):
    src = tmp_path / "t.py"
    src.write_text("import ep_fuse.passes.ep_overlap as ov\nfrom ep_fuse.ops import registry\n"
                   "ov.MEASURED_RULES.append(1)\nregistry.REFERENCE = 'x'\nmonkeypatch.setattr(registry, 'REFERENCE', 2)\n"
                   "registry.canonical_ops = None\n")
    assert [s.split(" sets ")[1] for s in _globals_set(src, None)] == [
        "ep_fuse.passes.ep_overlap.MEASURED_RULES", "ep_fuse.ops.registry.REFERENCE", "ep_fuse.ops.registry.REFERENCE"]
    assert "_OPS" in _module_state("ep_fuse.ops.registry") and _module_state("ep_fuse.config") == set()


# --------------------------------------------------------------------------- docs name what exists
def _top_names(module: str) -> set[str]:
    """What ``module`` defines or imports at its top level (and, for ``ep_fuse``, its lazy public names)."""
    names: set[str] = set()
    for node in _tree(MODULES[module]).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "_PUBLIC" for t in targets):
                names |= set(ast.literal_eval(node.value))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


PACKAGES = {".".join(["ep_fuse", *d.relative_to(ROOT / "ep_fuse").parts]) for d in (ROOT / "ep_fuse").rglob("*")
            if d.is_dir() and d.name != "__pycache__"} | {"ep_fuse", "ep_fuse.patterns"}
"""Every package folder as a dotted name (``ep_fuse/passes/`` has no ``__init__.py``)."""

DOTTED = re.compile(r"(?<![\w/.])(ep_fuse(?:\.\w+)+)")
PATHS = re.compile(r"(?<![\w/.-])((?:ep_fuse|patterns|bench|tools|tests|examples|docs|experiments)/[\w/.-]*\w)(?![\w<{*])")


def missing_names(text: str) -> list[str]:
    """``ep_fuse.x.y`` names and repository paths in ``text`` that do not exist (a line that says the thing was
    deleted or removed may name it)."""
    out = []
    for line in text.splitlines():
        if "deleted" in line or "removed" in line:
            continue
        for m in DOTTED.finditer(line):
            parts = m.group(1).split(".")
            if parts[-1].startswith("__"):
                continue
            found = next((i for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in MODULES.keys() | PACKAGES), None)
            if found is None:
                out.append(m.group(1))
            elif found < len(parts) and (".".join(parts[:found]) not in MODULES
                                         or parts[found] not in _top_names(".".join(parts[:found]))):
                out.append(m.group(1))
        out += [m.group(1) for m in PATHS.finditer(line) if not (ROOT / m.group(1).rstrip(".")).exists()]
    return out


def test_the_name_finder_finds_missing_names():
    text = ("`ep_fuse.ops.reference` and `ep_fuse.ops.registry.define_op`, `ep_fuse.prepare`, `ep_fuse.nothing.here`\n"
            "`bench/bench_<family>.py`, `bench/run.py`, `tools/gone.py`\nthe deleted `tools/old.py`\n")
    assert missing_names(text) == ["ep_fuse.ops.reference", "ep_fuse.nothing.here", "tools/gone.py"]


@pytest.mark.parametrize("doc", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_docs_name_only_modules_and_files_that_exist(doc):
    assert missing_names(doc.read_text()) == []


def test_sources_name_only_modules_that_exist():
    """Docstrings and comments of the package, the benches and tools name only modules that exist (names under a
    package folder or a module of the package: op names such as ``ep_fuse.rope.default`` and logger names are
    not modules)."""
    files = [*MODULES.values(), *sorted((ROOT / "bench").glob("*.py")), *sorted((ROOT / "tools").glob("*.py"))]
    under = tuple(f"{p}." for p in PACKAGES - {"ep_fuse"}) + tuple(f"{m}." for m in MODULES if m.count(".") == 1)
    found = [f"{p.relative_to(ROOT)}: {name}" for p in files
             for name in missing_names(p.read_text()) if name.startswith(under)]
    assert found == []


def test_scripts_import_the_installed_package():
    """Benches, tools and experiments import the installed ``ep_fuse`` (and benches their sibling ``common.py``):
    no script edits ``sys.path``."""
    scripts = [*(ROOT / "bench").glob("*.py"), *(ROOT / "tools").glob("*.py"), *(ROOT / "experiments").rglob("*.py")]
    edits = [f"{p.relative_to(ROOT)}:{n.lineno}" for p in sorted(scripts) for n in ast.walk(_tree(p))
             if isinstance(n, ast.Call) and _dotted(n.func) in ("sys.path.insert", "sys.path.append")]
    assert edits == []
