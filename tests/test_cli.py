"""The ep-fuse command line, run as a subprocess: dumps, catalog, explanations, diffs, errors."""

import json
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

import ep_fuse

HERE = Path(__file__).resolve().parent
NEAR_MISS = f"{HERE / 'support' / 'cli_targets.py'}:near_miss"


def run(*args, cwd=None):
    proc = subprocess.run([sys.executable, "-m", "ep_fuse.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.names, self.text = [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.names += [v for k, v in attrs if k == "data-name"]

    def handle_data(self, data):
        self.text.append(data)


@pytest.fixture(scope="module")
def mixtral_dump(tmp_path_factory):
    out = tmp_path_factory.mktemp("dump")
    code, stdout, stderr = run("dump", "hf:mixtral", "--executor", "eager", "--out", str(out))
    assert code == 0, stderr
    return out, stdout, stderr


@pytest.mark.hf
def test_dump_writes_every_stage_and_prints_the_table(mixtral_dump):
    out, stdout, stderr = mixtral_dump
    assert re.search(r"add_rms_norm +llama +model\.layers\.0\.post_attention_layernorm", stdout), stdout
    assert re.search(r"moe_experts +grouped_mm +model\.layers\.0\.mlp\.experts", stdout), stdout
    # 5 norms, 4 RoPE sites, 2 routers, 2 expert blocks
    assert "compiling with backend='ep_fuse'" in stderr and "canonicalize: 13 change(s)" in stderr
    assert "pair: 2 change(s)" in stderr
    g = out / "graph_0_0"
    for name in ("00_dynamo.py", "01_aten.py", "02_attention_mask.py", "03_attention_gqa.py",
                 "04_canonicalize.py", "05_pair.py", "06_cleanup.py", "07_ep.py", "08_drop_zero_slots.py",
                 "09_expand.py", "10_lower.py", "11_cleanup.py",
                 "graph_before.json", "graph_after.json", "report.json", "summary.txt", "unlowered.txt"):
        assert (g / name).is_file(), name
    assert "aten.rsqrt.default" in (g / "01_aten.py").read_text()
    assert "ep_fuse.add_rms_norm.default" in (g / "04_canonicalize.py").read_text()
    assert "bf16[2, 16, 64]" in (g / "01_aten.py").read_text(), "shapes and dtypes are shown"
    rep = json.loads((g / "report.json").read_text())
    assert [m["pattern"] for m in rep["matches"]].count("add_rms_norm") == 4
    assert {m["module_path"] for m in rep["matches"]} >= {"model.norm", "model.layers.0.input_layernorm"}


@pytest.mark.hf
def test_html_report_parses_and_shows_the_rewritten_nodes(mixtral_dump):
    out, _, _ = mixtral_dump
    page = _Collect()
    page.feed((out / "report.html").read_text())
    assert page.tags.count("svg") == 2 * 13, "a before and an after drawing per fused site (5 norms, 4 RoPE, 4 MoE)"
    rep = json.loads((out / "graph_0_0" / "report.json").read_text())
    for m in rep["matches"]:
        assert m["fused_node"] in page.names
        assert set(m["nodes"]) <= set(page.names)


@pytest.mark.hf
def test_diff_shows_op_counts_per_pass(mixtral_dump):
    out, _, _ = mixtral_dump
    code, stdout, _ = run("diff", str(out))
    assert code == 0
    assert "aten.rsqrt.default 5->0" in stdout and "ep_fuse.add_rms_norm.default 0->4" in stdout
    assert "fused: rms_norm x1, rope x4, add_rms_norm x4" in stdout


def test_explain_names_the_failed_check_and_node():
    code, stdout, _ = run("explain", NEAR_MISS, "--pattern", "rms_norm", "--quiet")
    assert code == 0
    assert "0 site(s) fused, 1 candidate site(s) not fused" in stdout
    assert "rsqrt_1 (aten.rsqrt.default): not fused" in stdout
    assert "rms_norm[llama]: failed at slice_1: eps must be a number or a 0-d floating tensor" in stdout


ROPE_LOOK_ALIKE = """
import torch
from torch import nn


class SwappedPairsFp32(nn.Module):
    \"\"\"HF Ernie 4.5's fp32 GPT-J RoPE with one op changed: the rotated copy is stack((x2, -x1)).\"\"\"

    def forward(self, q, cos, sin):
        cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
        rotated = torch.stack((q[..., 1::2], -q[..., 0::2]), dim=-1).flatten(-2)
        return ((q.float() * cos) + (rotated.float() * sin)).to(q.dtype)


def build(device="cpu"):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 5, 16, generator=g).to(torch.bfloat16)
    return SwappedPairsFp32(), (q, torch.randn(1, 1, 5, 16, generator=g), torch.randn(1, 1, 5, 16, generator=g))
"""


def test_explain_names_the_deepest_variant_first(tmp_path):
    target = tmp_path / "rope_look_alike.py"
    target.write_text(ROPE_LOOK_ALIKE)
    code, stdout, stderr = run("explain", f"{target}:build", "--pattern", "rope", "--executor", "eager", "--quiet")
    assert code == 0, stderr
    assert "0 site(s) fused, 1 candidate site(s) not fused" in stdout, stdout
    lines = stdout.splitlines()
    closest = [ln for ln in lines if ln.strip().startswith("closest:")]
    assert len(closest) == 1 and closest[0].strip().startswith("closest: rope[rotate_pairs_fp32] ("), stdout
    assert "expected aten.neg.default" in closest[0], stdout
    tried = [ln.strip().split(":")[0] for ln in lines if ": failed at " in ln]
    assert tried[0] == "rope[rotate_pairs_fp32]" and "rope[rotate_pairs]" in tried[1:], stdout
    depths = [int(ln.rsplit("(", 1)[1].split()[0]) for ln in lines if ": failed at " in ln]
    assert depths == sorted(depths, reverse=True), stdout


def test_explain_with_prepare_shows_what_it_rebuilt_and_why_not():
    target = f"{HERE / 'support' / 'cli_targets.py'}"
    code, stdout, stderr = run("explain", f"{target}:semantic_moe", "--pattern", "moe_experts", "--prepare",
                               "--executor", "eager", "--quiet")
    assert code == 0, stderr
    assert "moe_experts on" in stdout and ": 1 site(s) fused" in stdout, stdout
    assert "recognised by what it computes and rebuilt: router: linear(rows, router), softmax top-2" in stdout
    code, stdout, stderr = run("explain", f"{target}:input_scaled_moe", "--pattern", "moe", "--prepare",
                               "--executor", "eager", "--quiet")
    assert code == 0, stderr
    assert "WARNING GeneratedMoE" not in stdout and "WARNING InputScaledMoE (InputScaledMoE) holds 8 experts but is " \
        "not rebuilt as a MoE block: combine: no binding reproduces" in stdout, stdout
    for pattern in ("moe_experts", "moe"):  # a pattern or its family
        code, stdout, _ = run("explain", f"{target}:semantic_moe", "--pattern", pattern, "--executor", "eager",
                              "--quiet")
        assert ": 0 site(s) fused, 1 candidate site(s) not fused" in stdout and "prepare:" not in stdout, \
            "without --prepare the block stays as written"
        assert "getitem_3 (routed experts): not fused" in stdout and "ep_fuse.prepare(model)" in stdout, stdout
    code, stdout, _ = run("explain", f"{target}:semantic_moe", "--pattern", "rms_norm", "--executor", "eager",
                          "--quiet")
    assert "routed experts" not in stdout, "the experts' note belongs to moe_experts"


def test_explain_a_fused_node():
    code, stdout, _ = run("explain", NEAR_MISS, "--pattern", "add_rms_norm", "--node", "rsqrt", "--quiet")
    assert code == 0 and "rsqrt was fused: add_rms_norm[llama]" in stdout


def test_dump_of_a_module_with_a_near_miss(tmp_path):
    code, stdout, _ = run("dump", NEAR_MISS, "--executor", "eager", "--out", str(tmp_path), "--quiet")
    assert code == 0
    assert "1 candidate site(s) not fused: ep-fuse explain" in stdout
    html = (tmp_path / "report.html").read_text()
    assert "near misses" in html and "eps must be a number" in html


def test_patterns_lists_variants_guards_and_providers():
    code, stdout, _ = run("patterns", "--family", "rms_norm")
    assert code == 0
    assert "pattern add_rms_norm -> ep_fuse::add_rms_norm" in stdout and "pattern rope" not in stdout
    assert "variants: llama, gemma, weight_fp32, none" in stdout
    assert "add_is_plain: The residual add" in stdout
    assert "cuda: triton > reference" in stdout and "npu: npu > reference" in stdout


def test_patterns_lists_the_stage_providers_of_a_block():
    code, stdout, _ = run("patterns", "--family", "moe")
    assert code == 0
    assert "variants: grouped_mm, weights_after_gather, index_add, scatter_add, batched_mm" in stdout
    assert "anchors:  aten.sort.default (where _expert_gemm)" in stdout
    assert ("cuda: moe_permute: triton > reference; grouped_gemm_swiglu: triton > reference; "
            "grouped_gemm: triton > reference; moe_unpermute: triton > reference") in stdout
    assert "npu: moe_permute: npu > reference" in stdout


def test_option_names_are_checked_against_the_catalog(capsys):
    """The CLI checks option names against the catalog's registries (here the EP engines, through the option's old
    name ``ep_backend``) before it builds anything (in process: no model is loaded)."""
    from ep_fuse import cli

    assert cli.main(["dump", str(NEAR_MISS), "--option", "ep_backend=deepe", "--quiet"]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("ep-fuse:")]
    assert "ep_engine='deepe' is not one of auto, all_to_all" in line and "Did you mean 'deepep'" in line


@pytest.mark.parametrize(
    "args, code, message",
    [
        (("dump", "nothing"), 2, "is not 'path/to/file.py:factory'"),
        (("dump", "hf:llama9"), 2, "unknown built-in model 'hf:llama9'"),
        (("dump", "no/such/file.py:f"), 2, "no such file: no/such/file.py"),
        (("dump", f"{HERE / 'support' / 'cli_targets.py'}:broken"), 3, "raised ValueError: factory failed on purpose"),
        (("dump", f"{HERE / 'support' / 'cli_targets.py'}:missing"), 2, "has no callable 'missing'"),
        (("explain", NEAR_MISS, "--pattern", "ropee"), 2, "unknown pattern 'ropee'"),
        (("dump", NEAR_MISS, "--option", "executr=eager"), 2, "unknown option 'executr'"),
        (("patterns", "--family", "nope"), 2, "unknown family 'nope'"),
        (("diff", "/nonexistent"), 2, "holds no ep_fuse dump"),
    ],
)
def test_errors_are_one_line_with_documented_exit_codes(args, code, message, capsys):
    """In process (each error comes before any model is built); the exit status of ``python -m ep_fuse.cli`` is
    checked once below."""
    from ep_fuse import cli

    argv = [str(a) for a in args] + (["--quiet"] if args[0] in ("dump", "explain") else [])
    assert cli.main(argv) == code
    stderr = capsys.readouterr().err
    lines = [line for line in stderr.strip().splitlines() if line.startswith("ep-fuse:")]
    assert len(lines) == 1 and message in lines[0], stderr


def test_the_module_exits_with_the_error_code():
    got, _stdout, stderr = run("dump", "nothing", "--quiet")
    assert got == 2 and "ep-fuse: " in stderr and "is not 'path/to/file.py:factory'" in stderr


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "ep-fuse"
    assert script.exists(), "pip install puts the ep-fuse command next to python"


def test_env_switch_dumps_plain_torch_compile(tmp_path, monkeypatch):
    import torch
    from support.cli_targets import near_miss

    monkeypatch.setenv("EP_FUSE_DUMP_DIR", str(tmp_path))
    mod, args = near_miss()
    with torch.no_grad():
        torch.compile(mod, backend="ep_fuse", options={"executor": "eager"})(*args)
    assert (tmp_path / "graph_0_0" / "report.json").is_file()
    assert "near misses" in (tmp_path / "report.html").read_text()
    assert ep_fuse.last_report().near_misses[0].anchor == "rsqrt_1"
