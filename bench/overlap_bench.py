"""``bench/bench_ep.py --overlap``: each ``ep_overlap`` mode against ``none`` and against one device.

Per MoE layer (the routed block plus, where the model has one, its shared expert: the work independent of the
routing) and engine, every rank runs its own tokens; for each mode the EP layer time per rank, its ratio to the
same layer on one device (all experts, this rank's tokens), to ``none``, and the **overlap efficiency**

    (time(none) - time(mode)) / time(dispatch + combine)

with dispatch + combine timed alone (the engine's ops back to back). End to end: a 4-layer Qwen3-30B-A3B-sized
HF model (``--tiny``: the tiny HF Qwen2-MoE), tokens/s per mode; its efficiency uses the layer's dispatch +
combine time x the model's MoE layers, where that shape was measured in the same run.

``--tiny`` runs small sizes with the eager executor (the CPU with gloo: a check that everything runs; CPU times
say nothing about GPUs). Imported by ``bench_ep.py``; run it through that script.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

import ep_fuse
from ep_fuse.ep import handles
from ep_fuse.passes.ep import ep_sites

BF16 = torch.bfloat16
MODES = ("none", "shared", "two_batch")
SHAPES = [  # (name, tokens per rank, H, I, E, K, shared-expert I (0: none))
    ("DeepSeek-V3 decode", 128, 7168, 2048, 256, 8, 2048),
    ("DeepSeek-V3 prefill", 4096, 7168, 2048, 256, 8, 2048),
    ("Qwen3-30B-A3B decode", 128, 2048, 768, 128, 8, 0),
    ("Qwen3-30B-A3B prefill", 4096, 2048, 768, 128, 8, 0),
]
TINY = [("tiny decode", 8, 64, 32, 8, 2, 32), ("tiny prefill", 32, 64, 32, 8, 2, 0)]
ENGINES = {"decode": [("all_to_all", True), ("deepep", True), ("deepep_low_latency", True)],
           "prefill": [("all_to_all", True), ("deepep", True), ("deepep", False)]}


class SharedLayer(torch.nn.Module):
    """The canonical routed block (bf16) plus an optional shared SwiGLU expert on the same tokens."""

    def __init__(self, e: int, h: int, i: int, shared: int, device: torch.device) -> None:
        super().__init__()
        self.num_experts = e
        p = lambda *s: torch.nn.Parameter(torch.randn(*s, device=device, dtype=BF16) / s[-1] ** 0.5,  # noqa: E731
                                          requires_grad=False)
        self.w13, self.w2 = p(e, 2 * i, h), p(e, h, i)
        self.shared = shared
        if shared:
            self.gate_up, self.down = p(2 * shared, h), p(h, shared)

    def forward(self, x, ids, w):
        out = torch.ops.ep_fuse.moe_experts(x, ids, w, self.w13, self.w2, BF16)
        if self.shared:
            gate, up = torch.nn.functional.linear(x, self.gate_up).chunk(2, dim=-1)
            out = out + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, self.down)
        return out


def _efficiency(t_none: float, t_mode: float, t_dc: float | None) -> float | None:
    return round((t_none - t_mode) / t_dc, 3) if t_dc else None


def run_layers(shapes: list[tuple], keep: set[str] | None, iters: int, device: torch.device, executor: str,
               loop_seconds: Any, routing: Any, log: Any) -> list[dict[str, Any]]:
    """One row per (shape, engine, mode); ``loop_seconds`` / ``routing`` / ``log`` are ``bench_ep``'s."""
    world, rank = dist.get_world_size(), dist.get_rank()
    rows: list[dict[str, Any]] = []
    group_name = dist.group.WORLD.group_name
    for name, t, h, inter, e, k, shared in shapes:
        if e % world:
            continue
        x, ids, w = routing(t, h, e, k, device, seed=rank)
        w = w.to(BF16)
        torch.manual_seed(1234)
        full = SharedLayer(e, h, inter, shared, device)
        one = torch.compile(full, backend="ep_fuse", options={"executor": executor})
        with torch.no_grad():
            ref = full(x, ids, w)
            one(x, ids, w)
            base_us = loop_seconds(lambda: one(x, ids, w), iters, device, True) * 1e6
        torch._dynamo.reset()
        engines = ENGINES["decode" if t <= 512 else "prefill"]
        for engine, use_cap in [m for m in engines if keep is None or m[0] in keep]:
            cap = t if use_cap else 0
            t_none = t_dc = None
            for mode in MODES:
                row: dict[str, Any] = dict(shape=name, engine=f"{engine} ({'capacity' if cap else 'data-dependent'})",
                                           overlap=mode, world=world, tokens_per_rank=t, one_gpu_us=round(base_us, 1))
                try:
                    model = ep_fuse.shard_experts(copy.deepcopy(full))
                    opts = ep_fuse.ep_options(model, engine=engine, capacity=cap or None)
                    fn = torch.compile(model, backend="ep_fuse",
                                       options={**opts, "executor": executor, "ep_overlap": mode})
                    with torch.no_grad():
                        out = fn(x, ids, w)
                    sites = ep_sites(ep_fuse.last_report())
                    row["ran"] = f"{sites[0].engine}, {sites[0].overlap}" if sites else "no EP (world size 1)"
                    err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()
                    row["rel_l2_vs_one_gpu"] = f"{err:.1e}"
                    if not err < 2e-2:
                        raise AssertionError(f"rank {rank}: EP output differs from one device (rel L2 {err:.2e})")
                    graph = bool(cap) and device.type == "cuda"
                    with torch.no_grad():
                        sec = loop_seconds(lambda: fn(x, ids, w), iters, device, graph)
                    torch._dynamo.reset()
                    if mode == "none" and sites and world > 1:
                        t_none, t_dc = sec, _dispatch_combine(sites[0], x, ids, w, e, group_name, cap, iters, device,
                                                              graph, loop_seconds)
                    row.update(layer_us=round(sec * 1e6, 1), vs_one_gpu=round(sec * 1e6 / base_us, 3), graph=graph)
                    if t_none:
                        row.update(vs_none=round(sec / t_none, 3), dispatch_combine_us=round(t_dc * 1e6, 1),
                                   efficiency=_efficiency(t_none, sec, t_dc))
                except Exception as exc:  # one engine or mode failing must not hide the others
                    row["failed"] = f"{type(exc).__name__}: {exc}"[:300]
                log(row)
                rows.append(row)
                torch._dynamo.reset()
    return rows


def _dispatch_combine(site: Any, x, ids, w, e, group_name, cap, iters, device, graph, loop_seconds) -> float:
    ops = torch.ops.ep_fuse
    common = (e, group_name, site.engine, site.layout, cap, 300.0)
    out_dt = BF16 if site.layout == "expert" else None
    ys: dict[str, torch.Tensor] = {}

    def both():
        rx, _i, _w, hd = ops.ep_dispatch(x, ids, w, *common)
        y = ys.setdefault("y", rx.contiguous())  # stands for the experts' output
        return ops.ep_combine(y, hd, ids, w, *common, out_dt)

    sec = loop_seconds(both, iters, device, graph)
    handles.clear()
    return sec


def run_e2e(tiny: bool, iters: int, device: torch.device, executor: str, layer_rows: list[dict[str, Any]],
            loop_seconds: Any, log: Any) -> list[dict[str, Any]]:
    """The 4-layer Qwen3-30B-A3B-sized model (``tiny``: tiny HF Qwen2-MoE) per overlap mode vs one device."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    cases = [("prefill", (2, 16), "all_to_all", 32), ("decode", (8, 1), "all_to_all", 8)] if tiny else [
        ("prefill", (2, 2048), "deepep", 4096), ("decode", (128, 1), "all_to_all", 128)]
    for label, (b, s), engine, cap in cases:
        t_none = None
        base = None
        for mode in MODES:
            row: dict[str, Any] = dict(case=f"{label} {b} x {s} per rank", engine=engine, overlap=mode, world=world)
            try:
                full = _e2e_model(tiny, device)
                g = torch.Generator(device=device).manual_seed(rank)
                ids = torch.randint(1, full.config.vocab_size, (b, s), device=device, generator=g)
                if base is None:
                    one = torch.compile(full, backend="ep_fuse", options={"executor": executor})
                    with torch.no_grad():
                        ref = one(input_ids=ids, use_cache=False).logits.clone()
                        base = (ref, loop_seconds(lambda: one(input_ids=ids, use_cache=False), iters, device, False))
                    torch._dynamo.reset()
                ref, t_one = base
                model = ep_fuse.shard_experts(full)
                opts = {"executor": executor, "ep_overlap": mode,
                        **ep_fuse.ep_options(model, engine=engine, capacity=cap)}
                ep = torch.compile(model, backend="ep_fuse", options=opts)
                with torch.no_grad():
                    out = ep(input_ids=ids, use_cache=False).logits.clone()
                    sec = loop_seconds(lambda: ep(input_ids=ids, use_cache=False), iters, device, False)
                sites = ep_sites(ep_fuse.last_report())
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                if not err < 3e-2:
                    raise AssertionError(f"rank {rank}: EP logits differ from one device (rel L2 {err:.2e})")
                row.update(ran=sorted({f"{x.engine}, {x.overlap}" for x in sites}), rel_l2=f"{err:.1e}",
                           ms=round(sec * 1e3, 3), one_gpu_ms=round(t_one * 1e3, 3),
                           pair_tokens_s=round(world * b * s / sec), speedup=round(world * t_one / sec, 2))
                if mode == "none":
                    t_none = sec
                elif t_none:
                    row["vs_none"] = round(sec / t_none, 3)
                    dc = _layer_dc(layer_rows, label, engine)
                    if dc is not None and sites:
                        row["efficiency"] = _efficiency(t_none, sec, dc * 1e-6 * len(sites))
            except Exception as exc:
                row["failed"] = f"{type(exc).__name__}: {exc}"[:300]
            log(row)
            rows.append(row)
            torch._dynamo.reset()
    return rows


def _e2e_model(tiny: bool, device: torch.device) -> Any:
    if tiny:
        from ep_fuse.testing import tiny as tiny_models

        return tiny_models.build("qwen2_moe", dtype=torch.float32).to(device)
    import hf_models

    return hf_models.build("qwen3_30b_a3b", device=str(device))


def _layer_dc(rows: list[dict[str, Any]], label: str, engine: str) -> float | None:
    """The dispatch + combine time (us) this run measured for the e2e model's layer shape and engine."""
    want = ("tiny " if rows and rows[0]["shape"].startswith("tiny") else "Qwen3-30B-A3B ") + label
    for r in rows:
        if r["shape"] == want and r["engine"].startswith(engine) and r.get("dispatch_combine_us"):
            return r["dispatch_combine_us"]
    return None


def table(rows: list[dict[str, Any]], e2e: list[dict[str, Any]]) -> list[str]:
    """Markdown lines of both tables."""
    head = ["shape", "engine", "overlap", "ran", "layer_us", "one_gpu_us", "vs_one_gpu", "vs_none",
            "dispatch_combine_us", "efficiency", "rel_l2_vs_one_gpu", "graph", "failed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in head) + " |" for r in rows]
    if e2e:
        head2 = ["case", "engine", "overlap", "ran", "ms", "one_gpu_ms", "speedup", "pair_tokens_s", "vs_none",
                 "efficiency", "rel_l2", "failed"]
        lines += ["", "| " + " | ".join(head2) + " |", "|" + "---|" * len(head2)]
        lines += ["| " + " | ".join(str(r.get(c, "")) for c in head2) + " |" for r in e2e]
    return lines
