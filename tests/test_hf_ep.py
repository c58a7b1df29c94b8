"""transformers' native expert parallelism on ep_fuse's engines (``ep_implementation="ep_fuse"``, ``docs/ep.md``).

Two gloo ranks load a tiny Qwen3-MoE checkpoint (safetensors shards) with
``DistributedConfig(ep_size=2, fsdp_size=2, ep_implementation="ep_fuse")``: each rank holds only its experts;
eager, compiled (``backend="ep_fuse"``: one graph, ep_fuse's own dispatch/combine) and ``generate()`` in lock-step
(``synced_gpus=True``, uneven batches, prompt lengths and EOS steps) must equal the whole model loaded in one process
on the same rank's inputs. A rank killed inside a MoE layer gives its peer an ``EpError`` within ``ep_timeout_s``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

import ep_fuse

F32 = torch.float32
CAPACITY = 32
"""Tokens per rank per forward in the generate scenarios (uneven batches need a static capacity)."""


# =========================================================================== helpers (run in the workers)
_PATH: list[str] = []


def _checkpoint() -> str:
    """A tiny Qwen3-MoE (8 experts, fp32) saved by rank 0 as several safetensors shards; the path on every rank."""
    if not _PATH:
        path = [None]
        if dist.get_rank() == 0:
            from ep_fuse.testing import tiny

            d = tempfile.mkdtemp(prefix="ep_fuse_hf_ep_")
            tiny.build("qwen3_moe", dtype=F32).save_pretrained(d, max_shard_size="100KB")
            path = [d]
        dist.broadcast_object_list(path, src=0)
        _PATH.append(path[0])
    return _PATH[0]


def _load(ep: bool, implementation: str = "ep_fuse"):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    kw = {}
    if ep:
        world = dist.get_world_size()
        kw["distributed_config"] = DistributedConfig(ep_size=world, fsdp_size=world, ep_implementation=implementation)
    return AutoModelForCausalLM.from_pretrained(_checkpoint(), dtype=F32, **kw).eval()


def _expert_bytes(model) -> tuple[int, int]:
    """(bytes of expert parameters, bytes of all parameters) this rank holds (DTensors: their local shard)."""
    from torch.distributed.tensor import DTensor

    experts = total = 0
    for name, p in model.named_parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        n = t.numel() * t.element_size()
        total += n
        experts += n if ".experts." in name else 0
    return experts, total


def _tokens(seed: int, batch: int = 2, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _compile(model, **options):
    """Eager executor, reference kernels (the Triton interpreter would dominate on CPU; the rewrite is the same)."""
    return torch.compile(model, backend="ep_fuse",
                         options={"executor": "eager", "providers": {"cpu": ["reference"]}, **options})


# =========================================================================== scenarios
def sc_registered(world):
    from transformers.distributed.expert_parallel import EPImplementationInterface

    assert "ep_fuse" in EPImplementationInterface()


def sc_load_eager_compiled(world):
    """HF's EP loading with the ep_fuse implementation: only this rank's experts, outputs equal, one graph."""
    from ep_fuse.hf import expert_parallel as hf_ep
    from ep_fuse.passes.ep import ep_sites

    rank = dist.get_rank()
    full = _load(ep=False)
    model = _load(ep=True)
    full_experts, full_total = _expert_bytes(full)
    experts, total = _expert_bytes(model)
    assert experts * world == full_experts, (experts, full_experts)  # only this rank's experts were loaded
    assert total < full_total
    ids = _tokens(rank)
    with torch.no_grad():
        ref = full(input_ids=ids).logits
        out_fsdp = model(input_ids=ids).logits  # as loaded (FSDP hooks on): correct already
        hf_ep.for_inference(model)
        out = model(input_ids=ids).logits
    torch.testing.assert_close(out_fsdp, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    local_experts, local_total = _expert_bytes(model)
    assert local_experts == experts and local_total == full_total - full_experts + experts
    assert model.ep_fuse_ep["world"] == world and len(model.ep_fuse_ep["modules"]) == 2
    print(f"rank {rank}: parameter bytes as loaded {total} (experts {experts}) of {full_total} "
          f"(experts {full_experts}); after for_inference {local_total}", file=sys.stderr)

    # compiled: as many graphs and fused sites as the whole model, ep_fuse's dispatch/combine per MoE layer
    from ep_fuse.testing import tiny

    full_counts = tiny.EXPECTED_SITES["qwen3_moe"][0]  # the whole model's one graph (tests/test_hf_models.py)
    torch._dynamo.reset()
    ep_fuse.reset_reports()
    with torch.no_grad():
        out_c = _compile(model)(input_ids=ids).logits
    reports = ep_fuse.reports()
    assert len(reports) == 1, f"{len(reports)} graph pieces"
    rep = reports[-1]
    # the local blocks are placed as ep_fuse::moe_experts by the implementation (not matched): reported as EP sites
    assert rep.counts() == {k: v for k, v in full_counts.items() if k != "moe_experts"}, (rep.counts(), full_counts)
    assert full_counts["moe_experts"] == 2
    assert sum(v for k, v in rep.ops_after.items() if k.endswith(".moe_permute.default")) == 2  # the local blocks
    assert rep.ops_after.get("ep_fuse.ep_dispatch.default") == 2
    assert rep.ops_after.get("ep_fuse.ep_combine.default") == 2
    sites = ep_sites(rep)
    assert len(sites) == 2, sites
    assert {s.engine for s in sites} == {"all_to_all"} and {s.world for s in sites} == {world}, sites
    torch.testing.assert_close(out_c, ref, rtol=1e-4, atol=1e-4)

    # EP options on top: the placed blocks are rewritten once (not nested), with the options' capacity
    torch._dynamo.reset()
    ep_fuse.reset_reports()
    with torch.no_grad():
        out_o = _compile(model, **ep_fuse.ep_options(model, capacity=CAPACITY, timeout_s=60))(input_ids=ids).logits
    rep = ep_fuse.last_report()
    assert rep.ops_after.get("ep_fuse.ep_dispatch.default") == 2
    assert rep.ops_after.get("ep_fuse.ep_combine.default") == 2
    assert {s.capacity for s in ep_sites(rep)} == {CAPACITY}
    torch.testing.assert_close(out_o, ref, rtol=1e-4, atol=1e-4)


def sc_unfused_experts_not_nested(world):
    """Experts the implementation does not place as ``moe_experts`` (their own forward on the received rows, here
    forced): the pattern still fuses them, the EP pass leaves them local (one dispatch per layer, not two)."""
    from ep_fuse.hf import expert_parallel as hf_ep
    from ep_fuse.passes.ep import ep_sites

    rank = dist.get_rank()
    full = _load(ep=False)
    model = hf_ep.for_inference(_load(ep=True))
    for impl in hf_ep.ep_implementations(model):
        impl.fused = False
    ids = _tokens(rank + 5)
    with torch.no_grad():
        ref = full(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, ref, rtol=1e-5, atol=1e-5)
        out = _compile(model, **ep_fuse.ep_options(model, timeout_s=60))(input_ids=ids).logits
    rep = ep_fuse.last_report()
    assert rep.ops_after.get("ep_fuse.ep_dispatch.default") == 2
    assert rep.ops_after.get("ep_fuse.ep_combine.default") == 2
    assert rep.counts().get("moe_experts") == 2 and ep_sites(rep) == []  # fused by the pattern, not adopted
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def sc_prepare_is_for_inference(world):
    """``ep_fuse.prepare`` (the documented entry) on an HF-EP-loaded model does what ``for_inference`` does: the
    compiled forward is one graph (not FSDP's pieces), with ep_fuse's dispatch/combine, equal to the whole model."""
    rank = dist.get_rank()
    full = _load(ep=False)
    model = _load(ep=True)
    assert ep_fuse.prepare(model) is model and model.ep_fuse_ep["world"] == world
    assert ep_fuse.prepare(model) is model  # a second prepare runs no second collective
    ids = _tokens(rank + 3)
    torch._dynamo.reset()
    ep_fuse.reset_reports()
    with torch.no_grad():
        ref = full(input_ids=ids).logits
        out = _compile(model)(input_ids=ids).logits
    reports = ep_fuse.reports()
    assert len(reports) == 1, f"{len(reports)} graph pieces"
    assert reports[0].ops_after.get("ep_fuse.ep_dispatch.default") == 2
    assert reports[0].ops_after.get("ep_fuse.ep_combine.default") == 2
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def _prompts(rank: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rank 0: three prompts of lengths 5, 3, 7 (left-padded), 6 new tokens; rank 1: one of 4, 3 new tokens."""
    lengths, new = ((5, 3, 7), 6) if rank == 0 else ((4,), 3)
    seq = max(lengths)
    g = torch.Generator().manual_seed(10 + rank)
    ids = torch.randint(1, 128, (len(lengths), seq), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, : seq - n] = 0
        mask[i, seq - n:] = 1
    return ids, mask, new


def _generate(model, ids, mask, new, eos, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                          eos_token_id=eos, pad_token_id=0, **kw)


def _eos_for(full, ids, mask, new) -> int:
    """A token the first sequence greedily produces at step 2: with it as EOS that sequence ends early."""
    with torch.no_grad():
        free = _generate(full, ids, mask, new, eos=None)
    return int(free[0, ids.shape[1] + 1])


def sc_generate_lockstep(world):
    """Every rank generates its own prompts (uneven batches, lengths, EOS steps, new-token counts); the ranks step
    together (``synced_gpus=True``): a rank whose sequences ended keeps running its batch through the MoE layers."""
    from ep_fuse.hf import expert_parallel as hf_ep

    rank = dist.get_rank()
    full = _load(ep=False)
    model = hf_ep.for_inference(_load(ep=True))
    assert hf_ep.configure(model, capacity=CAPACITY, timeout_s=60) == 2
    ids, mask, new = _prompts(rank)
    eos = _eos_for(full, ids, mask, new)
    calls = [0]
    impl = hf_ep.ep_implementations(model)[0]
    inner = impl.local_experts

    def counted(*a):
        calls[0] += 1
        return inner(*a)

    impl.local_experts = counted
    with torch.no_grad():
        ref = _generate(full, ids, mask, new, eos)
        out = _generate(model, ids, mask, new, eos, synced_gpus=True)
    assert torch.equal(out, ref), (out, ref)
    assert (ref[0] == eos).any()  # the first sequence ended before its last step
    steps = torch.tensor([calls[0]])
    both = [torch.zeros_like(steps) for _ in range(world)]
    dist.all_gather(both, steps)
    assert len({int(s) for s in both}) == 1, f"ranks ran different numbers of MoE steps: {both}"


def sc_generate_compiled(world):
    """The same lock-step generate with the forward compiled by ``backend="ep_fuse"`` (Inductor off)."""
    from ep_fuse.hf import expert_parallel as hf_ep

    rank = dist.get_rank()
    full = _load(ep=False)
    model = hf_ep.for_inference(_load(ep=True))
    hf_ep.configure(model, capacity=CAPACITY, timeout_s=60)
    ids, mask, new = _prompts(rank)
    eos = _eos_for(full, ids, mask, new)
    model.forward = _compile(model.forward, **ep_fuse.ep_options(model, capacity=CAPACITY, timeout_s=60))
    with torch.no_grad():
        ref = _generate(full, ids, mask, new, eos)
        out = _generate(model, ids, mask, new, eos, synced_gpus=True)
    assert torch.equal(out, ref), (out, ref)


def sc_other_models(world):
    """Mixtral (bf16) and DeepSeek-V3 (a dense layer, a MoE layer with a shared expert; fp32) loaded with HF's EP:
    one graph with the whole model's fused sites (its routed blocks as EP sites), equal outputs."""
    from ep_fuse.hf import expert_parallel as hf_ep
    from ep_fuse.testing import tiny
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    for name, dtype, tol in (("mixtral", torch.bfloat16, 2e-2), ("deepseek_v3", F32, 1e-4)):
        path = [tempfile.mkdtemp(prefix="ep_fuse_hf_ep_") if dist.get_rank() == 0 else None]
        if path[0]:
            tiny.build(name, dtype=dtype).save_pretrained(path[0])
        dist.broadcast_object_list(path, src=0)
        full = AutoModelForCausalLM.from_pretrained(path[0], dtype=dtype).eval()
        model = hf_ep.for_inference(AutoModelForCausalLM.from_pretrained(path[0], dtype=dtype, distributed_config=(
            DistributedConfig(ep_size=world, fsdp_size=world, ep_implementation="ep_fuse"))).eval())
        ids = _tokens(dist.get_rank() + 20)
        torch._dynamo.reset()
        ep_fuse.reset_reports()
        with torch.no_grad():
            ref = full(input_ids=ids).logits.float()
            out = _compile(model)(input_ids=ids).logits.float()
        assert len(ep_fuse.reports()) == 1, name
        rep = ep_fuse.last_report()
        expected = dict(tiny.EXPECTED_SITES[name][0])
        blocks = expected.pop("moe_experts")
        assert rep.counts() == expected and len(rep.ep) == blocks, (name, rep.counts(), rep.ep)
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol * ref.abs().max().item())


def sc_killed_rank(world):
    """Rank 1 dies inside its third MoE layer call: rank 0 gets an EpError within ep_timeout_s (no hang)."""
    from ep_fuse.hf import expert_parallel as hf_ep

    rank = dist.get_rank()
    model = hf_ep.for_inference(_load(ep=True))
    hf_ep.configure(model, capacity=CAPACITY, timeout_s=3)
    ids, mask, new = _prompts(rank)
    if rank == 1:
        impl = hf_ep.ep_implementations(model)[0]
        inner, calls = impl.local_experts, [0]

        def dying(*a):
            calls[0] += 1
            if calls[0] == 3:
                os._exit(0)
            return inner(*a)

        impl.local_experts = dying
    t0 = time.monotonic()
    with pytest.raises(ep_fuse.EpError), torch.no_grad():
        _generate(model, ids, mask, 8, eos=None, synced_gpus=True)
    assert time.monotonic() - t0 < 30


SCENARIOS = [sc_registered, sc_load_eager_compiled, sc_unfused_experts_not_nested, sc_prepare_is_for_inference,
             sc_generate_lockstep, sc_killed_rank]
SLOW_SCENARIOS = [sc_generate_compiled, sc_other_models]
NO_BARRIER = ("sc_killed_rank",)


# =========================================================================== process management
def _run(scenarios, timeout_s=300.0):
    from support.dist_harness import run_ranks

    return run_ranks(scenarios[0].__module__, [f.__name__ for f in scenarios], 2, "gloo", timeout_s, NO_BARRIER)


@pytest.fixture(scope="module")
def hf_ep2():
    pytest.importorskip("transformers.distributed.expert_parallel")
    pytest.importorskip("accelerate", reason="transformers' distributed loading needs accelerate (the test extra)")
    return _run(SCENARIOS)


@pytest.mark.parametrize("name", [f.__name__ for f in SCENARIOS if f is not sc_killed_rank])
def test_two_ranks(hf_ep2, name):
    from support.dist_harness import check

    check(hf_ep2, name)


def test_killed_rank_raises_on_its_peer(hf_ep2):
    res = hf_ep2[0]
    assert "sc_killed_rank" in res, f"rank 0 never finished sc_killed_rank (hang): {sorted(res)}"
    assert res["sc_killed_rank"] == "ok", res["sc_killed_rank"]
    assert "sc_killed_rank" not in hf_ep2[1]  # rank 1 really died


@pytest.mark.slow
def test_slow_scenarios():
    pytest.importorskip("transformers.distributed.expert_parallel")
    pytest.importorskip("accelerate", reason="transformers' distributed loading needs accelerate (the test extra)")
    from support.dist_harness import check

    results = _run(SLOW_SCENARIOS)
    for f in SLOW_SCENARIOS:
        check(results, f.__name__)


# =========================================================================== single process
def test_registered_on_import():
    """Importing ep_fuse registers the implementation once transformers' EP module is imported (here: already)."""
    pytest.importorskip("transformers.distributed.expert_parallel")
    from transformers.distributed.expert_parallel import EPImplementationInterface

    assert "ep_fuse" in EPImplementationInterface()


def test_registration_is_lazy():
    """``import ep_fuse`` imports neither transformers nor the integration module; importing transformers' EP
    module afterwards registers ``ep_fuse``."""
    import subprocess

    code = ("import sys, ep_fuse\n"
            "assert 'transformers' not in sys.modules and 'ep_fuse.hf.expert_parallel' not in sys.modules\n"
            "from transformers.distributed.expert_parallel import EPImplementationInterface as I\n"
            "assert 'ep_fuse' in I(), list(I())\n")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})


def test_plain_swiglu_look_alikes():
    from ep_fuse.hf.expert_parallel import plain_swiglu

    class Experts(torch.nn.Module):
        def __init__(self, e=4, h=8, i=6, up=None):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(e, up or 2 * i, h))
            self.down_proj = torch.nn.Parameter(torch.zeros(e, h, i))
            self.act_fn = torch.nn.SiLU()

    assert plain_swiglu(Experts())
    assert not plain_swiglu(Experts(up=5))  # not a gate|up pair
    gelu = Experts()
    gelu.act_fn = torch.nn.GELU()
    assert not plain_swiglu(gelu)
    tr = Experts()
    tr.is_transposed = True
    assert not plain_swiglu(tr)
    biased = Experts()
    biased.has_bias = True
    assert not plain_swiglu(biased)


def test_for_inference_needs_the_implementation():
    with pytest.raises(ep_fuse.EpError, match="ep_implementation"):
        from ep_fuse.hf.expert_parallel import for_inference

        for_inference(torch.nn.Linear(2, 2))
