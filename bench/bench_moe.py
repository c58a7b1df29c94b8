"""GPU benchmark of a whole routed-expert MoE layer: eager vs Inductor vs ep_fuse, one run.

    python bench/bench_moe.py [--quick] [--fp8] [--only NAME,...] [--shape NAME=T,H,I,E,K ...] [--no-checks]
        [--tma-before] [--tma-variant FIELD=VALUE,...] [--repeat N]

The layer is the Hugging Face transformers 5.x ``grouped_mm`` experts code (sort, histc, cumsum,
``_grouped_mm`` x2, SwiGLU, weights in sorted order, index_put inverse permutation, top-k sum), with
fp32 routing weights from a softmax top-k router (Mixtral/DeepSeek style). ep_fuse compiles it with
the Inductor executor; the report says which provider ran each stage. Shapes: DeepSeek-V3 routed
experts (H7168 I2048 E256 k8) at decode (T128) and prefill (T4096) sizes, and a Qwen3-30B-A3B-sized
layer (H2048 I768 E128 k8, T4096); ``--shape`` adds a layer (``--only`` still filters by name). Each row also
has the layer's floor (``roofline.moe_layer_cost``: ``max(FLOPs / peak, bytes / bandwidth)`` with the dense bf16
GEMM peak and the copy bandwidth measured in the same run; the router is not part of the layer). Writes
``$OUT/moe.json`` / ``moe.md``.
``--fp8``: also ep_fuse with ``options={"quant": "fp8_block"}`` (its rel-L2 is against the bf16 eager layer, so
it includes the FP8 quantization error). ``--only``: layers whose name contains one of the strings.
``--no-checks``: skip the tiny-model checks and the router table (``bench_moe_gating.py``'s). ``--tma-before``: also ep_fuse with the Hopper TMA
grouped GEMM walking as before 2026-12-01 (no expert-aligned groups, no swapped last tiles), compiled and timed
in the same process; ``--tma-variant``: the same with any ``TmaGemmConfig`` fields set on every config the
provider asks for (``flatten=0``: the K loop not fused with the walk). ``--repeat N``: the variant and the shipped
layer timed alternately N times each (medians reported).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import statistics
from collections.abc import Iterator
from typing import Any

import torch

from bench_moe_gating import HEAD as ROUTER_HEAD
from bench_moe_gating import bench_routers
from common import (
    bench_graph_us,
    check_hf_models,
    copy_bandwidth_gbs,
    dense_gemm_tflops,
    env_info,
    markdown_table,
    out_dir,
    tma_config_fields,
    bench_parser,
    start,
    write_json,
)

from roofline import moe_layer_cost

import ep_fuse  # noqa: E402

BF16 = torch.bfloat16
SHAPES = [  # (name, T, H, I, E, K)
    ("DeepSeek-V3 decode", 128, 7168, 2048, 256, 8),
    ("DeepSeek-V3 prefill", 4096, 7168, 2048, 256, 8),
    ("Qwen3-30B-A3B prefill", 4096, 2048, 768, 128, 8),
]


def log(*a: Any) -> None:
    print(*a, flush=True)


TMA_BEFORE = "expert_groups=0,small_bm=0"
"""``--tma-before``: the walk before 2026-12-01."""


@contextlib.contextmanager
def tma_variant(spec: str) -> Iterator[list[Any]]:
    """The TMA grouped GEMM's configs with ``spec``'s fields replaced, for a same-process comparison; the
    launches look ``config_for`` up when they run. Inductor's caches key on the graph before ep_fuse's lowering,
    so a cache tag of its own keeps the first compile's kernels from being served again."""
    tk = importlib.import_module("ep_fuse.providers.triton.grouped_gemm_tma_kernel")
    current = tk.config_for
    fields = tma_config_fields([f for f in spec.split(",") if f])
    asked: list[Any] = []

    def variant(*a: Any, **kw: Any) -> Any:
        asked.append(a)
        return dataclasses.replace(current(*a, **kw), **fields)

    tk.config_for = variant
    try:
        with torch.compiler.config.patch(cache_key_tag=f"tma-variant-{spec}"):
            yield asked
    finally:
        tk.config_for = current


class HFGroupedExperts(torch.nn.Module):
    """The op sequence of transformers' ``grouped_mm_experts_forward`` (as transformers 5.x traces it)."""

    def __init__(self, e: int, h: int, i: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.num_experts = e
        self.gate_up_proj = torch.nn.Parameter(
            (torch.randn(e, 2 * i, h, device="cuda", generator=g) / h**0.5).to(BF16), requires_grad=False)
        self.down_proj = torch.nn.Parameter(
            (torch.randn(e, h, i, device="cuda", generator=g) / i**0.5).to(BF16), requires_grad=False)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        k = topk_ids.shape[1]
        expert_ids = topk_ids.reshape(-1)
        sample_weights = topk_weights.reshape(-1)
        ids_sorted, perm = torch.sort(expert_ids)
        rows = x[perm // k]
        w_sorted = sample_weights[perm]
        counts = torch.histc(ids_sorted.int(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = torch._grouped_mm(rows, self.gate_up_proj.transpose(-2, -1), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm(torch.nn.functional.silu(gate) * up, self.down_proj.transpose(-2, -1), offs=offs)
        y = y * w_sorted.unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0), device=x.device)
        out = y[inv].view(x.shape[0], k, -1).sum(1)
        return out.to(x.dtype)


def inputs(t: int, h: int, e: int, k: int, seed: int = 1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, h, device="cuda", generator=g).to(BF16)
    w, ids = torch.randn(t, e, device="cuda", generator=g).softmax(-1).topk(k)
    return x, ids, w / w.sum(-1, keepdim=True)


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def flops(t: int, h: int, i: int, k: int) -> float:
    return 2.0 * t * k * (2 * i * h + i * h)


def check_tiny_models() -> list[str]:
    """Tiny HF MoE models on CUDA through ``backend="ep_fuse"``: one block per MoE layer, logits vs eager."""
    from ep_fuse.testing import tiny as tiny_models

    lines = []
    for name in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"):
        for impl in ("grouped_mm", "batched_mm"):
            torch._dynamo.reset()
            ep_fuse.reset_reports()
            model = tiny_models.build(name, device="cuda", experts_implementation=impl)
            inp = tiny_models.example_inputs(device="cuda")
            with torch.no_grad():
                ref = model(**inp).logits
                out = torch.compile(model, backend="ep_fuse")(**inp).logits
            rep = ep_fuse.last_report()
            blocks = [m for m in rep.matches if m.pattern == "moe_experts"]
            if len(blocks) != tiny_models.EXPECTED_SITES[name][0]["moe_experts"]:
                lines.append(f"{name} {impl}: MISSED: {rep.summary()}; "
                             + " | ".join(m.explain() for m in rep.near_misses))
                log(lines[-1])
                continue
            scale = ref.float().abs().max().item()
            torch.testing.assert_close(out.float(), ref.float(), rtol=0.04, atol=0.04 * scale)
            lines.append(f"{name} {impl}: {len(blocks)} block(s), stages {blocks[0].stages}, "
                         f"maxdiff {(out.float() - ref.float()).abs().max().item():.4f} (logit scale {scale:.2f})")
            log(lines[-1])
    return lines


def main(quick: bool = False, fp8: bool = False, only: list[str] | None = None, checks: bool = True,
         variant: str = "", repeat: int = 1, extra: list[tuple[str, int, int, int, int, int]] | None = None) -> None:
    torch.manual_seed(0)
    tiny: list[str] = []
    routers: list[list[Any]] = []
    if checks:
        tiny = check_tiny_models()
        try:  # every tiny model: exact site counts of all families on CUDA, logits vs eager
            from ep_fuse.testing.tiny import TINY_MODELS

            tiny += check_hf_models([(name, False) for name in TINY_MODELS])
        except AssertionError as exc:
            tiny.append(f"check_hf_models FAILED: {exc}")
        for line in tiny[-8:]:
            log(line)
        routers = bench_routers()  # bench_moe_gating.py's table, here too
    copy = copy_bandwidth_gbs()
    peak = dense_gemm_tflops()
    log(f"copy bandwidth {copy:.0f} GB/s, dense bf16 GEMM {peak:.0f} TF/s")
    rows, table = [], []
    pool = (SHAPES[:1] if quick else SHAPES) + list(extra or [])
    shapes = [s for s in pool if not only or any(o in s[0] for o in only)]
    for name, t, h, i, e, k in shapes:
        torch._dynamo.reset()
        ep_fuse.reset_reports()
        mod = HFGroupedExperts(e, h, i)
        x, ids, w = inputs(t, h, e, k)
        with torch.no_grad():
            ref = mod(x, ids, w)
            inductor = torch.compile(mod)
            fused = torch.compile(mod, backend="ep_fuse")
            out_ind, out_ep = inductor(x, ids, w), fused(x, ids, w)
        rep = ep_fuse.last_report()
        blocks = [m for m in rep.matches if m.pattern == "moe_experts"]
        assert len(blocks) == 1, rep.summary()
        err_ind, err_ep = rel_l2(out_ind, ref), rel_l2(out_ep, ref)
        assert err_ep < 1e-2, f"{name}: ep_fuse relative L2 error {err_ep}"
        fp8_info: dict[str, Any] = {}
        if fp8:
            ep_fuse.reset_reports()
            with torch.no_grad():
                fused8 = torch.compile(mod, backend="ep_fuse", options={"quant": "fp8_block"})
                fp8_info["rel_l2"] = rel_l2(fused8(x, ids, w), ref)
            blocks8 = [m for m in ep_fuse.last_report().matches if m.pattern == "moe_experts"]
            fp8_info["stages"] = blocks8[0].stages if blocks8 else {}
            log(f"{name}: fp8 stages {fp8_info['stages']}, rel-L2 vs bf16 eager {fp8_info['rel_l2']:.4f}")
        with torch.no_grad():
            us = {"eager": bench_graph_us(lambda: mod(x, ids, w)),
                  "inductor": bench_graph_us(lambda: inductor(x, ids, w)),
                  "ep_fuse": bench_graph_us(lambda: fused(x, ids, w))}
            if fp8:
                us["ep_fuse_fp8"] = bench_graph_us(lambda: fused8(x, ids, w))
            if variant:
                torch._dynamo.reset()
                with tma_variant(variant) as asked:
                    before = torch.compile(mod, backend="ep_fuse")
                    assert rel_l2(before(x, ids, w), ref) < 1e-2
                    assert asked, "the TMA configs were not asked for: a cached compile was served"
                    var_us = [bench_graph_us(lambda: before(x, ids, w))]
                # alternate the two, `repeat` times each (identical kernels timed in one process differed by up
                # to 13 % on 2026-12-01); the variant inside its context, in case a launch looks its config up
                # when it runs
                shipped_us = [us["ep_fuse"]]
                for _ in range(repeat - 1):
                    shipped_us.append(bench_graph_us(lambda: fused(x, ids, w)))
                    with tma_variant(variant):
                        var_us.append(bench_graph_us(lambda: before(x, ids, w)))
                shipped_us.append(bench_graph_us(lambda: fused(x, ids, w)))
                us["ep_fuse_tma_variant"] = statistics.median(var_us)
                log(f"{name}: ep_fuse with the TMA configs' {variant}: median {us['ep_fuse_tma_variant']:.1f} us "
                    f"{[round(v, 1) for v in var_us]}; shipped median {statistics.median(shipped_us):.1f} us "
                    f"{[round(v, 1) for v in shipped_us]}, "
                    f"{us['ep_fuse_tma_variant'] / statistics.median(shipped_us):.3f}x)")
        wbytes = 3 * e * i * h * 2
        cost = moe_layer_cost(t, h, i, e, k)
        floor, bound = cost.floor_us(peak, copy), cost.bound(peak, copy)
        row = {"shape": name, "T": t, "H": h, "I": i, "E": e, "K": k, "us": us, "rel_l2_inductor": err_ind,
               "rel_l2_ep_fuse": err_ep, "stages": blocks[0].stages, "declined": blocks[0].declined, "fp8": fp8_info,
               "tflops": {kk: flops(t, h, i, k) / v / 1e6 for kk, v in us.items()},
               "weight_bw_pct": {kk: 100 * wbytes / (v * 1e-6) / 1e9 / copy for kk, v in us.items()},
               "floor_us": floor, "bound": bound, "of_floor_pct": {kk: 100 * floor / v for kk, v in us.items()},
               "of_peak_pct": {kk: 100 * flops(t, h, i, k) / v / 1e6 / peak for kk, v in us.items()}}
        rows.append(row)
        log(f"{name}: eager {us['eager']:.1f} us, inductor {us['inductor']:.1f} us, ep_fuse {us['ep_fuse']:.1f} us "
            f"({us['inductor'] / us['ep_fuse']:.2f}x Inductor); stages {blocks[0].stages}; err {err_ep:.2e}")
        for p, r in blocks[0].declined:
            log(f"   declined {p}: {r}")
        table.append([name, f"T{t} H{h} I{i} E{e} k{k}", us["eager"], us["inductor"], us["ep_fuse"],
                      f"{us['inductor'] / us['ep_fuse']:.2f}x", f"{row['tflops']['ep_fuse']:.0f}",
                      f"{floor:.0f} ({bound})", f"{row['of_floor_pct']['ep_fuse']:.0f} %",
                      f"{row['of_floor_pct']['inductor']:.0f} %", ", ".join(f"{s}={p}" for s, p in blocks[0].stages.items())])
        if fp8:
            log(f"{name}: ep_fuse fp8_block {us['ep_fuse_fp8']:.1f} us ({us['inductor'] / us['ep_fuse_fp8']:.2f}x "
                f"Inductor bf16, {us['ep_fuse'] / us['ep_fuse_fp8']:.2f}x ep_fuse bf16)")
            table.append([f"{name}, quant=fp8_block", f"T{t} H{h} I{i} E{e} k{k}", None, us["inductor"],
                          us["ep_fuse_fp8"], f"{us['inductor'] / us['ep_fuse_fp8']:.2f}x",
                          f"{row['tflops']['ep_fuse_fp8']:.0f}", None, None, None,
                          ", ".join(f"{s}={p}" for s, p in fp8_info["stages"].items())])
        if variant:
            table.append([f"{name}, TMA configs with {variant}", f"T{t} H{h} I{i} E{e} k{k}", None, us["inductor"],
                          us["ep_fuse_tma_variant"], f"{us['inductor'] / us['ep_fuse_tma_variant']:.2f}x",
                          f"{row['tflops']['ep_fuse_tma_variant']:.0f}", None,
                          f"{row['of_floor_pct']['ep_fuse_tma_variant']:.0f} %", None, ""])
        mod = inductor = fused = fused8 = before = None  # free the layer before the next shape
        torch.cuda.empty_cache()
    md = markdown_table(["layer", "shape", "eager µs", "Inductor µs", "ep_fuse µs", "vs Inductor", "ep_fuse TF/s",
                         "floor µs (bound)", "ep_fuse of floor", "Inductor of floor", "stage providers"], table)
    md += f"\n\nCeilings measured in this run: copy {copy:.0f} GB/s, dense bf16 GEMM {peak:.0f} TF/s."
    if routers:
        md += "\n\n" + markdown_table(ROUTER_HEAD, routers)
    (out_dir() / "moe.md").write_text(md + "\n")
    write_json("moe.json", {"env": env_info(), "copy_gbs": copy, "gemm_tflops": peak, "rows": rows, "tiny_models": tiny,
                            "routers": routers})
    log(md)


if __name__ == "__main__":
    ap = bench_parser(__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--only", default="")
    ap.add_argument("--shape", action="append", default=[], help="NAME=T,H,I,E,K: an extra layer (repeatable)")
    ap.add_argument("--no-checks", action="store_true")
    ap.add_argument("--tma-before", action="store_true", help=f"--tma-variant {TMA_BEFORE}")
    ap.add_argument("--tma-variant", default="", help="FIELD=VALUE,...: TmaGemmConfig fields set on every config")
    ap.add_argument("--repeat", type=int, default=1, help="time the variant and the shipped layer this many times")
    a = ap.parse_args()
    start(a)
    main(quick=a.quick, fp8=a.fp8, only=[o for o in a.only.split(",") if o], checks=not a.no_checks,
         variant=a.tma_variant or (TMA_BEFORE if a.tma_before else ""), repeat=a.repeat,
         extra=[(n, *(int(v) for v in dims.split(","))) for n, dims in (spec.split("=") for spec in a.shape)])
