"""Expert parallelism on several GPUs, side by side with the same work on one GPU, in one run.

    torchrun --nproc-per-node 2 bench/bench_ep.py [--quick] [--engines all_to_all,symm_mem,deepep,...]
        [--shapes "DeepSeek-V3 decode,..."] [--iters 20] [--e2e] [--deepep-config SMS,CHUNK,SMS,CHUNK]
    python bench/bench_ep.py --quick          # one process: world size 1 (loopback; says so)

Per MoE layer shape and EP provider (every rank runs its own tokens, ``ep_fuse.shard_experts`` +
``ep_fuse.ep_options``, Inductor executor, Triton stage providers):

* **dispatch** and **combine** times, separately (combine = dispatch+combine - dispatch), and GB/s per
  rank two ways: ``recv`` = rows this rank receives (its own included) x H x 2 B over the time -- the
  way DeepEP's own tests count -- and ``remote`` = rows that cross to another rank;
* the EP **layer** time per rank against the **same layer on one GPU** (all experts, this rank's T
  tokens; and W x T tokens, the same total work) in the same process, and its relative L2 against
  that one-GPU layer;
* capacity modes (static shapes) are captured in a CUDA graph and replayed (what serving runs);
  data-dependent modes sync the host and are timed from launches. Every rank replays the same fixed
  number of iterations between two events after a barrier.

``--fp8-wire``: for the ``rank``-layout engines (``all_to_all``, DeepEP normal) also the dispatch of the same tokens
as fp8 codes + 1 x 128 fp32 scales in one uint8 row (what ``quant="fp8_block"`` sends, 1.03 B per element instead
of 2), timed like the bf16 dispatch: ``dispatch_fp8_us`` and its speed against the bf16 dispatch.

``--e2e``: a 4-layer Qwen3-30B-A3B-sized HF model (``hf_models.py``): tokens/s of the pair (prefill,
4096 tokens per rank, DeepEP normal; decode 128 x 1 per rank, low-latency under CUDA graphs) against one
GPU running the whole model on one rank's tokens, logits checked per rank.

Keep ``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1`` (set here too).
Writes ``$OUT/ep.json`` and ``$OUT/ep.md`` (rank 0). Exits 0 when every rank finished.
"""

from __future__ import annotations

import os

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v  # NVLink multicast off in every process (device README)

import copy
import datetime  # noqa: E402
import socket
import time
from pathlib import Path  # noqa: E402
from typing import Any

import torch
import torch.distributed as dist  # noqa: E402


from common import bench_parser, start, write_json

import ep_fuse
import ep_fuse.catalog  # noqa: F401  (defines every op and provider)
from ep_fuse.ep import deepep, handles, release_buffers
from ep_fuse.passes.ep import ep_sites  # noqa: E402

BF16 = torch.bfloat16
SHAPES = [  # (name, tokens per rank, H, I, E, K)
    ("DeepSeek-V3 decode", 128, 7168, 2048, 256, 8),
    ("DeepSeek-V3 prefill", 4096, 7168, 2048, 256, 8),
    ("Qwen3-30B-A3B decode", 128, 2048, 768, 128, 8),
    ("Qwen3-30B-A3B prefill", 4096, 2048, 768, 128, 8),
]
QUICK = [("small", 256, 2048, 512, 32, 4)]
# (engine, capacity: True = T, False = data-dependent)
DECODE_MODES = [("deepep_low_latency", True), ("deepep", True), ("symm_mem", True), ("all_to_all", True),
                ("all_to_all", False)]
PREFILL_MODES = [("deepep", True), ("deepep", False), ("deepep_low_latency", True), ("symm_mem", True),
                 ("all_to_all", True), ("all_to_all", False)]


def log(*a: Any) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*a, flush=True)


def init() -> torch.device:
    cuda = torch.cuda.is_available()
    if "RANK" in os.environ:
        local = int(os.environ.get("LOCAL_RANK", 0))
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=180),
                                device_id=torch.device("cuda", local) if cuda else None)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


class Block(torch.nn.Module):
    def __init__(self, e: int, h: int, i: int, device: torch.device) -> None:
        super().__init__()
        self.num_experts = e
        self.w13 = torch.nn.Parameter(torch.randn(e, 2 * i, h, device=device, dtype=BF16) / h**0.5,
                                      requires_grad=False)
        self.w2 = torch.nn.Parameter(torch.randn(e, h, i, device=device, dtype=BF16) / i**0.5, requires_grad=False)

    def forward(self, x, ids, w):
        return torch.ops.ep_fuse.moe_experts(x, ids, w, self.w13, self.w2, BF16)


def loop_seconds(fn, iters: int, device: torch.device, graph: bool) -> float:
    """Seconds per call of ``fn``: ``iters`` back-to-back calls (or replays of its CUDA graph) between two
    events, after a barrier; every rank runs the same count, so collectives pair up."""
    if graph and device.type == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        dist.barrier()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    else:
        run = fn
    for _ in range(3):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            run()
        b.record()
        b.synchronize()
        sec = a.elapsed_time(b) / 1e3 / iters
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        sec = (time.perf_counter() - t0) / iters
    dist.barrier()
    return sec


def routing(t: int, h: int, e: int, k: int, device: torch.device, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(device, BF16)
    w, ids = torch.randn(t, e, generator=g).softmax(-1).topk(k)
    return x, ids.to(device), w.to(device)


def traffic_rows(ids: torch.Tensor, e: int, layout: str) -> tuple[int, int]:
    """(rows this rank receives, rows crossing from this rank to others) in dispatch."""
    world, rank = dist.get_world_size(), dist.get_rank()
    per_rank = e // world
    gathered = [torch.empty_like(ids) for _ in range(world)]
    dist.all_gather(gathered, ids)
    recv = 0
    for src in gathered:
        mine = (src // per_rank) == rank
        recv += int(mine.any(1).sum()) if layout == "rank" else int(mine.sum())
    dest = ids // per_rank
    if layout == "rank":
        remote = sum(int((dest == r).any(1).sum()) for r in range(world) if r != rank)
    else:
        remote = int((dest != rank).sum())
    return recv, remote


def one_gpu_us(full: Block, x, ids, w, iters: int, device: torch.device) -> float:
    fn = torch.compile(full, backend="ep_fuse", options={"executor": "inductor" if device.type == "cuda" else "eager"})
    with torch.no_grad():
        fn(x, ids, w)
        sec = loop_seconds(lambda: fn(x, ids, w), iters, device, graph=True)
    torch._dynamo.reset()
    return sec * 1e6


def run_shape(name, t, h, inter, e, k, modes, iters, device, fp8_wire=False) -> list[dict[str, Any]]:
    world, rank = dist.get_world_size(), dist.get_rank()
    rows: list[dict[str, Any]] = []
    if e % world:
        log(f"skip {name}: {e} experts not divisible by {world} ranks")
        return rows
    x, ids, w = routing(t, h, e, k, device, seed=rank)
    torch.manual_seed(1234)  # one model: every rank holds the same expert weights before sharding
    full = Block(e, h, inter, device)
    with torch.no_grad():
        base_us = one_gpu_us(full, x, ids, w, iters, device)
        xs, idss, ws = routing(t * world, h, e, k, device, seed=100 + rank)
        base_total_us = one_gpu_us(full, xs, idss, ws, iters, device) if world > 1 else base_us
        ref = full(x, ids, w)
    log(f"{name}: one GPU, all experts: {base_us:.1f} us on T={t}; {base_total_us:.1f} us on T={t * world}")
    group_name = dist.group.WORLD.group_name
    for engine, use_cap in modes:
        cap = t if use_cap else 0
        label = f"{engine} ({'capacity ' + str(cap) if cap else 'data-dependent'})"
        row: dict[str, Any] = dict(shape=name, mode=label, world=world, tokens_per_rank=t,
                                   one_gpu_us=round(base_us, 1), one_gpu_total_us=round(base_total_us, 1))
        try:
            model = ep_fuse.shard_experts(copy.deepcopy(full))
            opts = ep_fuse.ep_options(model, engine=engine, capacity=cap or None)
            fn = torch.compile(model, backend="ep_fuse", options={**opts, "executor": "inductor"})
            with torch.no_grad():
                out = fn(x, ids, w)
            sites = ep_sites(ep_fuse.last_report())
            ran = sites[0].engine if sites else "none (world size 1)"
            layout = sites[0].layout if sites else "rank"
            row["ran"] = ran
            if sites and sites[0].declined:
                row["declined"] = "; ".join(f"{p}: {r}" for p, r in sites[0].declined)[:160]
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            row["rel_l2_vs_one_gpu"] = f"{err:.1e}"
            if not err < 2e-2:
                raise AssertionError(f"rank {rank}: EP output differs from the one-GPU layer (rel L2 {err:.2e})")
            graph = bool(cap) and device.type == "cuda" and ran != "symm_mem"  # symm_mem: not capturable yet
            with torch.no_grad():
                layer = loop_seconds(lambda: fn(x, ids, w), iters, device, graph)
            torch._dynamo.reset()
            # the dispatch / combine ops alone, with the provider the pass chose
            ops = torch.ops.ep_fuse
            common = (e, group_name, ran, layout, cap, 300.0)
            out_dt = BF16 if layout == "expert" else None

            def disp(common=common):
                return ops.ep_dispatch(x, ids, w, *common)

            def both(common=common, out_dt=out_dt, ys={}):  # noqa: B006
                rx, _i, _w, hd = ops.ep_dispatch(x, ids, w, *common)
                y = ys.setdefault("y", rx.contiguous())  # stands for the experts' contiguous output
                return ops.ep_combine(y, hd, ids, w, *common, out_dt)

            if world > 1:
                t_both = loop_seconds(both, iters, device, graph)
                recv, remote = traffic_rows(ids, e, layout)
                row.update(dispatch_combine_us=round(t_both * 1e6, 1),
                           gbs_remote=round(2 * remote * h * 2 / t_both / 1e9, 1))
                # LL dispatch must alternate with combine (DeepEP's own test splits the two from kernel
                # traces of lock-stepped ranks): only the pair is timed here
                if ran != "deepep_low_latency":
                    t_disp = loop_seconds(disp, iters, device, graph)
                    handles.clear()  # dispatch-only loops leave their handles registered
                    t_comb = t_both - t_disp
                    row.update(dispatch_us=round(t_disp * 1e6, 1), combine_us=round(t_comb * 1e6, 1),
                               dispatch_gbs_recv=round(recv * h * 2 / t_disp / 1e9, 1),
                               combine_gbs_recv=round(recv * h * 2 / t_comb / 1e9, 1))
                    if fp8_wire and layout == "rank" and ran in ("all_to_all", "deepep"):
                        q, sc = ops.quant_fp8_group(x, 128)
                        packed = torch.cat([q.view(torch.uint8), sc.view(torch.uint8)], 1).contiguous()

                        def disp8(common=common, packed=packed):
                            return ops.ep_dispatch(packed, ids, w, *common)

                        t8 = loop_seconds(disp8, iters, device, graph)
                        handles.clear()
                        row.update(dispatch_fp8_us=round(t8 * 1e6, 1), fp8_vs_bf16_dispatch=round(t_disp / t8, 2),
                                   dispatch_fp8_gbs_recv=round(recv * packed.shape[1] / t8 / 1e9, 1))
            row.update(layer_us=round(layer * 1e6, 1), layer_vs_one_gpu=round(layer * 1e6 / base_us, 3),
                       graph=graph, tokens_s_per_rank=round(t / layer))
        except Exception as exc:  # one engine failing must not hide the others
            row["failed"] = f"{type(exc).__name__}: {exc}"[:300]
            log(f"{name} {label}: failed: {row['failed']}")
        rows.append(row)
        log(row)
        torch._dynamo.reset()
    return rows


def run_e2e(iters: int, device: torch.device, cases: list[str]) -> list[dict[str, Any]]:
    """A 4-layer Qwen3-30B-A3B-sized HF model: the EP pair vs one GPU running the whole model."""
    import hf_models

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for label, (b, s), engine, cap, mode in [
        ("prefill 2 x 2048 per rank", (2, 2048), "deepep", 4096, None),
        ("decode 128 x 1 per rank", (128, 1), "deepep_low_latency", 128, "reduce-overhead"),
    ]:
        if label.split()[0] not in cases:
            continue
        row: dict[str, Any] = dict(case=label, world=world, engine=engine)
        try:
            full = hf_models.build("qwen3_30b_a3b", device=str(device))
            g = torch.Generator(device=device).manual_seed(rank)
            ids = torch.randint(1, full.config.vocab_size, (b, s), device=device, generator=g)
            opts = {"executor": "inductor", **({"mode": mode} if mode else {})}
            one = torch.compile(full, backend="ep_fuse", options=opts)
            with torch.no_grad():
                for _ in range(3 if mode else 1):  # CUDA graphs: warm-up, record, replay
                    ref = one(input_ids=ids, use_cache=False).logits.clone()  # replays overwrite outputs
                t_one = loop_seconds(lambda: one(input_ids=ids, use_cache=False), iters, device, graph=False)
            torch._dynamo.reset()
            ep_model = ep_fuse.shard_experts(full)
            ep = torch.compile(ep_model, backend="ep_fuse",
                               options={**opts, **ep_fuse.ep_options(ep_model, engine=engine, capacity=cap)})
            with torch.no_grad():
                for _ in range(3 if mode else 1):
                    out = ep(input_ids=ids, use_cache=False).logits.clone()
                t_ep = loop_seconds(lambda: ep(input_ids=ids, use_cache=False), iters, device, graph=False)
            sites = ep_sites(ep_fuse.last_report())
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            errs = [torch.zeros(1, device=device) for _ in range(world)]
            dist.all_gather(errs, torch.tensor([err], device=device))
            row.update(ran=sorted({s_.engine for s_ in sites}), rel_l2_per_rank=[f"{e.item():.1e}" for e in errs],
                       one_gpu_tokens_s=round(b * s / t_one), pair_tokens_s=round(world * b * s / t_ep),
                       speedup=round(world * t_one / t_ep, 2), one_gpu_ms=round(t_one * 1e3, 2),
                       ep_ms=round(t_ep * 1e3, 2))
            full = ep_model = one = ep = None  # free the weights before the next case
        except Exception as exc:
            row["failed"] = f"{type(exc).__name__}: {exc}"[:300]
        log(row)
        rows.append(row)
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--engines", "--backends", dest="engines", default=None,
                    help="restrict to these EP engines (default: all)")
    ap.add_argument("--shapes", default=None, help="comma-separated shape names (default: all)")
    ap.add_argument("--e2e", action="store_true", help="also the 4-layer Qwen3-30B-A3B-sized HF model")
    ap.add_argument("--fp8-wire", action="store_true", help="also time the dispatch of fp8 codes + scales rows")
    ap.add_argument("--e2e-cases", default="prefill,decode")
    ap.add_argument("--overlap", action="store_true",
                    help="each ep_overlap mode vs none and vs one device, per layer and end to end (overlap_bench.py)")
    ap.add_argument("--tiny", action="store_true", help="with --overlap: tiny sizes, eager executor (CPU check)")
    ap.add_argument("--deepep-config", default=None,
                    help="dispatch SMs,NVL chunk,combine SMs,NVL chunk for DeepEP normal (from its own tuning)")
    args = ap.parse_args()
    start(args, needs_cuda=False)
    device = init()
    world = dist.get_world_size()
    if args.deepep_config:
        ds, dc, cs, cc = (int(v) for v in args.deepep_config.split(","))
        deepep.TUNED[world] = ((ds, dc), (cs, cc))
    note = ("world size 1: no EP nodes are inserted (plain local MoE) and dispatch/combine is a loopback copy"
            if world == 1 else f"{world} ranks, {dist.get_backend()}")
    log(f"bench_ep: {note}; device {device}; deep_ep: {deepep.available() or 'available'}; "
        f"DeepEP configs: {deepep.TUNED.get(world, 'defaults')}")
    keep = set(args.engines.split(",")) if args.engines else None
    if args.overlap:
        run_overlap(args, keep, device, note)
        return
    rows: list[dict[str, Any]] = []
    shapes = QUICK if args.quick else SHAPES
    if args.shapes:
        shapes = [s for s in shapes if s[0] in args.shapes.split(",")]
    for shape in shapes:
        modes = DECODE_MODES if shape[1] <= 512 else PREFILL_MODES
        modes = [m for m in modes if keep is None or m[0] in keep]
        rows += run_shape(*shape, modes, args.iters, device, fp8_wire=args.fp8_wire)
    e2e = run_e2e(max(5, args.iters // 2), device, args.e2e_cases.split(",")) \
        if args.e2e and device.type == "cuda" else []
    if dist.get_rank() == 0:
        out = Path(os.environ.get("OUT", "bench_out"))
        out.mkdir(parents=True, exist_ok=True)
        meta = dict(note=note, torch=torch.__version__, device=str(device), date=str(datetime.date.today()),
                    gpu=torch.cuda.get_device_name() if device.type == "cuda" else None,
                    deepep_configs=deepep.TUNED.get(world))
        write_json("ep.json", dict(meta=meta, rows=rows, e2e=e2e))  # $OUT/ep.json, and --json
        head = ["shape", "mode", "ran", "layer_us", "one_gpu_us", "layer_vs_one_gpu", "one_gpu_total_us",
                "dispatch_us", "combine_us", "dispatch_combine_us", "dispatch_gbs_recv", "combine_gbs_recv",
                "gbs_remote", "dispatch_fp8_us", "fp8_vs_bf16_dispatch", "dispatch_fp8_gbs_recv", "rel_l2_vs_one_gpu",
                "graph", "declined", "failed"]
        lines = [f"EP benchmark ({note}; {meta['gpu'] or 'CPU'}; {meta['date']})", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(str(r.get(c, "")) for c in head) + " |" for r in rows]
        if e2e:
            head2 = ["case", "engine", "ran", "one_gpu_tokens_s", "pair_tokens_s", "speedup", "one_gpu_ms", "ep_ms",
                     "rel_l2_per_rank", "failed"]
            lines += ["", "| " + " | ".join(head2) + " |", "|" + "---|" * len(head2)]
            lines += ["| " + " | ".join(str(r.get(c, "")) for c in head2) + " |" for r in e2e]
        (out / "ep.md").write_text("\n".join(lines) + "\n")
        log("\n".join(lines))
    release_buffers()
    dist.barrier()
    dist.destroy_process_group()


def run_overlap(args: Any, keep: set[str] | None, device: torch.device, note: str) -> None:
    """``--overlap``: writes ``$OUT/ep_overlap.json`` and ``$OUT/ep_overlap.md`` (rank 0)."""
    import overlap_bench

    executor = "eager" if args.tiny or device.type != "cuda" else "inductor"
    shapes = overlap_bench.TINY if args.tiny else overlap_bench.SHAPES
    if args.shapes:
        shapes = [s for s in shapes if s[0] in args.shapes.split(",")]
    if args.tiny and keep is None:
        keep = {"all_to_all"}
    iters = 3 if args.tiny else args.iters
    rows = overlap_bench.run_layers(shapes, keep, iters, device, executor, loop_seconds, routing, log)
    e2e = overlap_bench.run_e2e(args.tiny, max(3, iters // 2), device, executor, rows, loop_seconds, log) \
        if args.e2e or args.tiny else []
    if dist.get_rank() == 0:
        out = Path(os.environ.get("OUT", "bench_out"))
        out.mkdir(parents=True, exist_ok=True)
        meta = dict(note=note, torch=torch.__version__, device=str(device), executor=executor, tiny=args.tiny)
        write_json("ep_overlap.json", dict(meta=meta, rows=rows, e2e=e2e))
        lines = [f"EP overlap benchmark ({note}; {device}; executor {executor})", "", *overlap_bench.table(rows, e2e)]
        (out / "ep_overlap.md").write_text("\n".join(lines) + "\n")
        log("\n".join(lines))
    release_buffers()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
