"""Every transformers family whose routed experts the sweep pins below its MoE blocks says why, in one line per
expert class (``expert_loops.UNFUSED_EXPERTS``): logged by ``prepare`` and shown by the sweep."""

import logging

import pytest
import torch
import transformers
from packaging.version import Version
from support.sweep_expected import EXPECTED, installed_sites

from ep_fuse.testing import sweep
from ep_fuse.surgery.expert_loops import UNFUSED_EXPERTS, unfused_experts

pytestmark = pytest.mark.hf

SHORT = sorted(f for f, pin in EXPECTED.items()
               if isinstance(pin, dict) and installed_sites(pin, "fp32")["moe_experts"] < pin["moe_blocks"])


def test_the_short_families_are_the_known_ones():
    # LongCat-Flash's identity experts run inside its experts loop before 5.25, outside it (a fused block) from 5.25
    before_525 = Version(transformers.__version__) < Version("5.25")
    assert SHORT == ["dbrx", "gpt_oss", "jetmoe", "llama4"] + (["longcat_flash"] if before_525 else [])


@pytest.mark.parametrize("family", SHORT)
def test_each_unfused_family_says_why(family, caplog):
    with caplog.at_level(logging.INFO, logger="ep_fuse"):
        model, _ = sweep.build_tiny(family, torch.float32)
    found = unfused_experts(model)
    assert found and all(why == UNFUSED_EXPERTS[cls] and "\n" not in why for _, cls, why in found), found
    logged = [r.getMessage() for r in caplog.records if "gets no moe_experts block" in r.getMessage()]
    assert len(logged) == len(found), caplog.text
    result = sweep.FamilyResult(family, built=True, moe_blocks=2, unfused=[f"{c}: {w}" for _, c, w in found])
    assert "no moe_experts: " + found[0][1] in sweep.markdown([result], ("fp32",), False)


def test_fused_families_log_no_reason():
    model, _ = sweep.build_tiny("mixtral", torch.float32)
    assert unfused_experts(model) == []
