"""GPU benchmark of MoE routers (the ``moe_gating`` family): eager vs Inductor vs ep_fuse, one run.

    python bench/bench_moe_gating.py [--quick] [--only NAME,...]

Each router is written as the models write it: Mixtral / Qwen3-MoE (fp32 softmax, top-k, renormalise) and
DeepSeek-V3 (sigmoid, biased selection, group sum of the top-2, kept groups, renormalise, scale). The same
function runs eagerly, under ``torch.compile`` (Inductor) and under ``torch.compile(backend="ep_fuse")`` (the
router matched as ``ep_fuse::moe_gating``, lowered to the Triton gating kernel; the table names the provider
the report shows). Checked first: ep_fuse selects the same expert sets as eager, and its weights' largest
difference. Times are CUDA-graph replays (µs). Writes ``$OUT/moe_gating.json`` / ``moe_gating.md``.
"""

from __future__ import annotations

from typing import Any

import torch
from common import bench_graph_us, bench_parser, env_info, markdown_table, out_dir, start, write_json

import ep_fuse

BF16 = torch.bfloat16
ROUTERS = [  # (name, tokens, experts, top-k)
    ("Mixtral softmax", 4096, 8, 2),
    ("Qwen3-MoE softmax", 4096, 128, 8),
    ("DeepSeek-V3 sigmoid group", 4096, 256, 8),
    ("DeepSeek-V3 decode", 128, 256, 8),
]


def log(*a: Any) -> None:
    print(*a, flush=True)


def softmax_router(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral / Qwen3-MoE: fp32 softmax, top-k, renormalise."""
    w, ids = logits.float().softmax(-1).topk(k)
    return w / w.sum(-1, keepdim=True), ids


def deepseek_router(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int, topk_group: int,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3: sigmoid, biased selection, group sum of top-2, kept groups, renormalise, scale."""
    scores = logits.float().sigmoid()
    sel = scores + bias
    t, e = sel.shape
    group = sel.view(t, n_group, -1).topk(2, -1)[0].sum(-1)
    keep = torch.zeros_like(group).scatter_(1, group.topk(topk_group, -1, sorted=False)[1], 1)
    mask = keep.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e).bool()
    ids = sel.masked_fill(~mask, float("-inf")).topk(k, -1, sorted=False)[1]
    w = scores.gather(1, ids)
    return w / (w.sum(-1, keepdim=True) + 1e-20) * scale, ids


def same_sets(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> tuple[bool, float]:
    """Whether two routings select the same expert set per token, and the largest weight difference (each
    routing's weights in the order of its sorted ids)."""
    (wa, ia), (wb, ib) = a, b
    same = torch.equal(ia.sort(-1)[0], ib.sort(-1)[0])
    diff = (wa.gather(1, ia.sort(-1)[1]) - wb.gather(1, ib.sort(-1)[1])).abs().max().item()
    return same, diff


def bench_routers(only: list[str] | None = None) -> list[list[Any]]:
    """One row per router: eager, Inductor and ep_fuse µs, the provider ep_fuse ran, the check against eager."""
    rows = []
    for name, t, e, k in ROUTERS:
        if only and not any(o in name for o in only):
            continue
        g = torch.Generator(device="cuda").manual_seed(2)
        logits = torch.randn(t, e, device="cuda", generator=g).to(BF16)
        if "DeepSeek" in name:
            bias = torch.randn(e, device="cuda", generator=g) * 0.1

            def router(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return deepseek_router(x, bias, k, 8, 4, 2.5)
        else:

            def router(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return softmax_router(x, k)
        torch._dynamo.reset()
        ep_fuse.reset_reports()
        inductor = torch.compile(router)
        fused = torch.compile(router, backend="ep_fuse", options={"executor": "inductor"})
        with torch.no_grad():
            ref, out = router(logits), fused(logits)
        rep = ep_fuse.last_report()
        providers = sorted({m.provider or "-" for m in rep.matches if m.pattern == "moe_gating"}) if rep else []
        same, diff = same_sets(ref, out)
        us = {"eager": bench_graph_us(lambda: router(logits)), "inductor": bench_graph_us(lambda: inductor(logits)),
              "ep_fuse": bench_graph_us(lambda: fused(logits))}
        log(f"router {name} T{t} E{e} k{k}: {us} provider {providers or 'not matched'} same ids {same} "
            f"max weight diff {diff:.2e}")
        rows.append([name, f"T{t} E{e} k{k}", us["eager"], us["inductor"], us["ep_fuse"],
                     f"{us['inductor'] / us['ep_fuse']:.2f}x", ", ".join(providers) or "not matched",
                     "yes" if same else "NO", f"{diff:.1e}"])
    return rows


HEAD = ["router", "shape", "eager µs", "Inductor µs", "ep_fuse µs", "vs Inductor", "provider", "same expert sets",
        "max weight diff"]


def main(quick: bool = False, only: list[str] | None = None) -> None:
    rows = bench_routers(only or (["decode"] if quick else None))
    md = markdown_table(HEAD, rows)
    (out_dir() / "moe_gating.md").write_text(md + "\n")
    write_json("moe_gating.json", {"env": env_info(), "rows": rows})
    log(md)


if __name__ == "__main__":
    ap = bench_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="the decode router only")
    ap.add_argument("--only", default="", help="routers whose name contains one of these strings")
    a = ap.parse_args()
    start(a)
    main(quick=a.quick, only=[o for o in a.only.split(",") if o])
