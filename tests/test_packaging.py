"""The wheel ships every engine subpackage (CI installs editable, where a missing entry would not show)."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "ep_fuse").rglob("__init__.py")}
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
    assert cfg["package-dir"]["ep_fuse.patterns"] == "patterns" and "ep_fuse.patterns" in listed


CHECKOUT_RUN = """
import sys
sys.path[1:1] = {site!r}  # the install, then this environment's dependencies without their .pth files
import torch, ep_fuse, ep_fuse.patterns
from pathlib import Path
root = Path({root!r})
assert Path(ep_fuse.__file__).resolve().parent == root / "ep_fuse", ep_fuse.__file__
assert Path(ep_fuse.patterns.__file__).resolve().parent == root / "patterns", ep_fuse.patterns.__file__
def f(x, w):
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * w
x, w = torch.randn(4, 64), torch.randn(64)
out = torch.compile(f, backend="ep_fuse", options={{"executor": "eager"}})(x, w)
torch.testing.assert_close(out, f(x, w))
print("sites", ep_fuse.last_report().counts())
"""


@pytest.mark.slow
def test_a_script_at_the_checkout_root_imports_it_over_a_non_editable_install(tmp_path):
    """``pip install .`` (not ``-e``), then a script run at the repository root: Python imports the checkout's
    ``ep_fuse/``, whose ``ep_fuse.patterns`` is the top-level ``patterns/`` (the install's copy is not used), and
    ``backend="ep_fuse"`` fuses as from the install. The child runs without ``site`` so that the editable install
    of the test environment (a ``.pth`` finder) cannot resolve ``ep_fuse.patterns`` for it."""
    import subprocess
    import sys
    import sysconfig

    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(ROOT)],
                         capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-3000:]
    assert (site / "ep_fuse" / "patterns" / "__init__.py").is_file()  # the install's layout differs from the checkout
    paths = [str(site), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    code = CHECKOUT_RUN.format(site=paths, root=str(ROOT))
    run = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "'rms_norm': 1" in run.stdout, run.stdout


def test_the_old_module_names_give_the_moved_modules():
    """``ep_fuse.models.<name>`` (the names the docs gave before model surgery, the HF integrations and the tiny
    models moved to ``surgery`` / ``hf`` / ``testing``) is the moved module itself: one set of globals."""
    import importlib

    moved = {"tiny": "ep_fuse.testing.tiny", "paged_attention": "ep_fuse.hf.paged_attention",
             "varlen_attention": "ep_fuse.hf.varlen_attention", "hf_expert_parallel": "ep_fuse.hf.expert_parallel"}
    for old, new in moved.items():
        assert importlib.import_module(f"ep_fuse.models.{old}") is importlib.import_module(new)
    from ep_fuse.models import tiny

    assert tiny.build is importlib.import_module("ep_fuse.testing.tiny").build
