"""The hardware floor of one model forward, per stage, and the split of a measured forward into those stages.

``forward_costs(model, batch, seq)`` counts the least work a forward of ``batch x seq`` tokens must do
(``use_cache=False``), from the model's own parameters and config:

* **dense**: every 2-D weight outside the routed experts, the embedding and the LM head (attention
  projections, dense MLPs, shared experts, router weights): read once, ``2 * tokens * numel`` FLOPs;
* **experts**: the routed experts. Under uniform random top-k routing a layer of ``E`` experts hit by ``T``
  tokens reads ``E * (1 - (1 - k/E)**T)`` experts' weights (the expected number of distinct experts) and does
  ``2 * T * k * per_expert_numel`` FLOPs;
* **attention**: causal ``softmax(q k^T) v`` of each sequence: ``2 * heads * S(S+1)/2 * (d_qk + d_v)``
  FLOPs per sequence and layer (no KV bytes: no cache);
* **lm_head**: the output projection, read once, ``2 * tokens * numel`` FLOPs;
* **norms/RoPE**, **router**, **other**: no floor is counted (their bytes are activations of a few MB).

The floor of a stage is ``max(FLOPs / peak, bytes / bandwidth)`` with the peak and bandwidth measured in the
same run (``bench/common.py``: a device copy and a large dense GEMM). ``classify(kernel)`` puts a profiled
CUDA kernel into one of those stages: ep_fuse's Triton kernels by the module that defines them, Inductor's
by the ops in their fused names, library kernels by name (``torch._grouped_mm``'s CUTLASS kernels are experts);
the last dense GEMM of a forward is the LM head, and expert kernels before its first router kernel are dense.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

STAGES = ("attention", "dense", "experts", "router", "norms/RoPE", "lm_head", "other")


@dataclass
class Cost:
    """The least FLOPs and bytes of one stage."""

    flops: float = 0.0
    bytes: float = 0.0

    def floor_us(self, peak_tflops: float, bandwidth_gbs: float) -> float:
        """The stage's time at the measured peak or bandwidth, whichever binds."""
        return 1e6 * max(self.flops / (peak_tflops * 1e12), self.bytes / (bandwidth_gbs * 1e9))

    def bound(self, peak_tflops: float, bandwidth_gbs: float) -> str:
        """``"compute"`` or ``"memory"``: which of the two sets the floor."""
        return "compute" if self.flops / (peak_tflops * 1e12) >= self.bytes / (bandwidth_gbs * 1e9) else "memory"


def expected_experts_hit(experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts ``tokens`` uniformly routed tokens hit (top-k without repeats)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def moe_layer_cost(tokens: int, hidden: int, inter: int, experts: int, top_k: int, elem: int = 2) -> Cost:
    """The least work of one routed-expert layer (router not included) on ``tokens`` uniformly routed tokens:
    ``2 T k * 3 H I`` FLOPs (gate, up, down); bytes: the weights of the expected number of distinct experts hit,
    the layer's input and output rows, and the ``T k`` permuted rows and activations written and read once."""
    weights = expected_experts_hit(experts, top_k, tokens) * 3 * hidden * inter * elem
    rows = (2 * tokens * hidden + 2 * tokens * top_k * (hidden + inter)) * elem
    return Cost(flops=2.0 * tokens * top_k * 3 * hidden * inter, bytes=weights + rows)


def _routed_experts(model: torch.nn.Module) -> list[tuple[str, int, int, int]]:
    """``(name, experts, per_expert_numel, itemsize)`` of each routed-expert container of ``model``.

    A container is a module named ``experts`` (not a shared expert) holding either 3-D parameters whose leading
    dimension is the expert count, or a ``ModuleList`` of expert MLPs."""
    found = []
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] != "experts":
            continue
        params = list(mod.parameters())
        if not params:
            continue
        if isinstance(mod, torch.nn.ModuleList):
            per = sum(p.numel() for p in mod[0].parameters())
            found.append((name, len(mod), per, params[0].element_size()))
            continue
        stacked = [p for p in mod.parameters(recurse=False) if p.dim() == 3]
        if stacked:
            e = stacked[0].shape[0]
            per = sum(p.numel() for p in stacked) // e
            found.append((name, e, per, stacked[0].element_size()))
    return found


def _attention_dims(config: Any) -> tuple[int, int, int]:
    """``(heads, d_qk, d_v)`` of the model's attention."""
    heads = config.num_attention_heads
    if getattr(config, "qk_nope_head_dim", None):
        d_qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        return heads, d_qk, config.v_head_dim
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, d, d


def forward_costs(model: torch.nn.Module, batch: int, seq: int) -> dict[str, Cost]:
    """The least FLOPs and bytes of ``model(input_ids[batch, seq], use_cache=False)``, per stage."""
    config = model.config
    tokens = batch * seq
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    costs = {s: Cost() for s in STAGES}
    expert_names = []
    for name, e, per, size in _routed_experts(model):
        expert_names.append(name + ".")
        hit = expected_experts_hit(e, top_k, tokens)
        costs["experts"].bytes += hit * per * size
        costs["experts"].flops += 2.0 * tokens * top_k * per
    head = model.get_output_embeddings()
    head_w = head.weight if head is not None else None
    embeds = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for name, p in model.named_parameters():
        if any(name.startswith(x) for x in expert_names):
            continue
        if head_w is not None and p is head_w:
            costs["lm_head"] = Cost(2.0 * tokens * p.numel(), p.numel() * p.element_size())
        elif id(p) in embeds:
            costs["other"].bytes += tokens * p.shape[-1] * p.element_size()  # the rows looked up
        elif p.dim() == 2:
            costs["dense"].bytes += p.numel() * p.element_size()
            costs["dense"].flops += 2.0 * tokens * p.numel()
    heads, d_qk, d_v = _attention_dims(config)
    pairs = seq * (seq + 1) / 2
    costs["attention"].flops = config.num_hidden_layers * batch * 2.0 * heads * pairs * (d_qk + d_v)
    return costs


def total(costs: dict[str, Cost]) -> Cost:
    """All stages together."""
    return Cost(sum(c.flops for c in costs.values()), sum(c.bytes for c in costs.values()))


def _triton_kernel_stages() -> dict[str, str]:
    """Name of each of ep_fuse's Triton kernels -> its stage, from the module that defines it."""
    from ep_fuse.providers import triton as pkg

    by_module = (("rms_norm", "norms/RoPE"), ("rope", "norms/RoPE"), ("moe_gating", "router"),
                 ("moe_permute", "experts"), ("grouped_gemm", "experts"), ("moe", "experts"), ("fp8", "experts"),
                 ("w8a8", "experts"), ("gemm_swiglu", "dense"), ("attention", "attention"))
    names: dict[str, str] = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        stage = next((s for key, s in by_module if key in info.name), None)
        if stage is None:
            continue
        try:
            mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        except ImportError:
            continue
        for attr, value in vars(mod).items():
            if type(value).__name__ in ("JITFunction", "InterpretedFunction", "Autotuner", "Heuristics"):
                names.setdefault(attr, stage)
    return names


_GEMM = re.compile(r"gemm|nvjet|cutlass|xmma|cublas|triton_tem_fused_(addmm|mm|bmm)", re.I)
_GROUPED = re.compile(r"grouped|GroupProblemShape|PtrArray", re.I)  # torch._grouped_mm's CUTLASS kernels
_ATTENTION = re.compile(r"flash|fmha|attention|attn|sdpa", re.I)
_ROUTER = re.compile(r"topk|sort|gating|softmax|sigmoid", re.I)


class KernelStages:
    """``classify(name)`` -> the stage of a CUDA kernel of a forward."""

    def __init__(self) -> None:
        self.triton = _triton_kernel_stages()

    def classify(self, name: str) -> str:
        base = re.sub(r"_\d+$", "", name.split("(")[0].strip())  # Inductor suffixes user kernels with _0, _1...
        if base in self.triton:
            return self.triton[base]
        if _ATTENTION.search(name):
            return "attention"
        if _GROUPED.search(name) and _GEMM.search(name):
            return "experts"
        if _GEMM.search(name):
            return "dense"
        if name.startswith("triton_"):
            ops = name.split("fused_", 1)[-1]
            if "rsqrt" in ops or re.search(r"\b(sin|cos)\b|_(sin|cos)_", ops):
                return "norms/RoPE"
            if _ROUTER.search(ops):
                return "router"
            return "other"
        if _ROUTER.search(name):
            return "router"
        return "other"


def stage_labels(kernels: list[tuple[str, float]], stages: KernelStages) -> list[str]:
    """The stage of each kernel of one forward (launch order). Two rules by position: the last dense GEMM is the
    LM head, and an expert-stage kernel launched before the forward's first router kernel is a dense layer's (no
    routed expert runs before a router: DeepSeek-V3's dense MLP runs the TMA kernel the grouped GEMMs use)."""
    labels = [stages.classify(n) for n, _ in kernels]
    first_router = next((i for i, s in enumerate(labels) if s == "router"), len(labels))
    labels = ["dense" if s == "experts" and i < first_router else s for i, s in enumerate(labels)]
    last = max((i for i, s in enumerate(labels) if s == "dense"), default=None)
    if last is not None:
        labels[last] = "lm_head"
    return labels


def stage_split(kernels: list[tuple[str, float]], stages: KernelStages) -> dict[str, float]:
    """µs per stage of one forward's ``(kernel name, µs)`` list in launch order (:func:`stage_labels`)."""
    split = {s: 0.0 for s in STAGES}
    labels = stage_labels(kernels, stages)
    for (_, us), stage in zip(kernels, labels):
        split[stage] += us
    return split


def top_kernels(kernels: list[tuple[str, float]], stages: KernelStages, n: int = 12) -> list[list[Any]]:
    """The ``n`` longest kernels of one forward, ``[stage, µs, name]`` (summed over launches of one name)."""
    total_us: dict[tuple[str, str], float] = {}
    for (name, us), stage in zip(kernels, stage_labels(kernels, stages)):
        key = (stage, name[:160])
        total_us[key] = total_us.get(key, 0.0) + us
    return [[st, round(us, 1), name] for (st, name), us in sorted(total_us.items(), key=lambda kv: -kv[1])[:n]]


def profile_forward(fn: Callable[[], Any], calls: int = 5) -> list[tuple[str, float]]:
    """The CUDA kernels of one call of ``fn`` (launch order, µs each: the mean over ``calls`` profiled calls)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                     and not e.name.startswith(("Memcpy", "Memset"))), key=lambda e: e.time_range.start)
    per = len(events) // calls
    if per == 0 or per * calls != len(events):  # uneven calls: one list of all kernels, averaged in time
        return [(e.name, e.device_time / calls) for e in events]
    out = [(e.name, 0.0) for e in events[:per]]
    for c in range(calls):
        for i, e in enumerate(events[c * per:(c + 1) * per]):
            out[i] = (out[i][0], out[i][1] + e.device_time / calls)
    return out
