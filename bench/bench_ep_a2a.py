"""Benchmark and check of the ``all_to_all`` EP provider's rank layout: dispatch and combine timed apart.

    torchrun --nproc-per-node 2 bench/bench_ep_a2a.py [--iters 20] [--tokens 128,4096] [--paths kernels,reference]

Per rank, for DeepSeek-V3 (H 7168, E 256, top-8) and Qwen3-30B-A3B (H 2048, E 128, top-8) shapes, bf16,
capacity (``C = T``) and data-dependent mode, Triton kernels and the torch reference: µs of
``ep_dispatch`` and of ``ep_combine``, each the mean of ``--iters`` back-to-back calls between two CUDA
events (no barrier inside the timed loop; one before it), and GB/s per rank in two definitions:

* ``remote``: bytes of the token rows leaving the rank for other ranks in dispatch (H x 2 B per row),
  the same bytes again for combine; ``pair`` = 2 x remote / (dispatch + combine);
* ``recv`` (DeepEP's tests): rows the rank receives in dispatch (its own included) x H x 2 B, for
  dispatch and for combine alike.

``--stages`` (default on) also times the local parts alone (pack = routing + scatter, the dispatch
message, unpack, the combine message, the combine sum). Before timing, every case checks
``combine(dispatch(x))`` with identity experts against ``x * #ranks(t)`` and the kernels against the
reference. NCCL on CUDA (NVLS / multicast off), gloo on CPU. Writes ``$OUT/ep_a2a.json`` / ``.md`` (rank 0).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch
import torch.distributed as dist  # noqa: E402

import ep_fuse.catalog  # noqa: F401  (defines every op and provider)
from ep_fuse import runtime
from ep_fuse.config import EpFuseConfig  # noqa: E402
from ep_fuse.ep import all_to_all as a2a
from ep_fuse.ep import groups  # noqa: E402
from ep_fuse.ops.ep_layout import HEADER, packed_row

from bench_ep import init, loop_seconds, routing
from common import bench_parser, start, write_json  # noqa: E402


def per_call(fn, iters: int, device: torch.device) -> float:
    """Seconds per call of ``fn`` over back-to-back calls (no graph): :func:`bench_ep.loop_seconds`."""
    return loop_seconds(fn, iters, device, graph=False)

BF16 = torch.bfloat16
SHAPES = [("DeepSeek-V3", 7168, 256, 8), ("Qwen3-30B-A3B", 2048, 128, 8)]  # (name, H, E, K)


def log(*a: Any) -> None:
    if dist.get_rank() == 0:
        print(*a, flush=True)


def check(x, ids, w, e: int, cap: int, name: str) -> None:
    """Identity experts: combine(dispatch(x)) = x * #ranks(t); the kernels equal the reference bitwise."""
    world = dist.get_world_size()
    ops = torch.ops.ep_fuse
    runs = []
    for use in (True, False):
        with runtime.use_config(EpFuseConfig(ep_a2a_kernels=use)):
            rx, rids, rw, hd = ops.ep_dispatch(x, ids, w, e, name, "all_to_all", "rank", cap, 300.0)
            out = ops.ep_combine(rx.contiguous(), hd, ids, w, e, name, "all_to_all", "rank", cap, 300.0, None)
        live = rids.max(1).values >= 0
        runs.append((rx[live], rids, rw, hd, out))
    for a, b in zip(*runs):
        if not torch.equal(a, b):
            raise AssertionError(f"rank {dist.get_rank()}: kernels differ from the reference (capacity {cap})")
    dest = torch.where(ids >= 0, ids // (e // world), world)
    n = torch.zeros(ids.shape[0], world + 1, device=ids.device).scatter_(1, dest, 1.0)[:, :world].sum(1, keepdim=True)
    if not torch.equal(runs[0][4].float(), (x.float() * n).to(BF16).float()):
        raise AssertionError(f"rank {dist.get_rank()}: combine(dispatch(x)) != x * #ranks")


def byte_counts(ids: torch.Tensor, e: int, h: int) -> tuple[int, int]:
    """(remote bytes leaving this rank in dispatch, rows this rank receives x H x 2 B)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dest = ids // (e // world)
    in_rank = torch.stack([(dest == r).any(1) for r in range(world)], 1)  # [T, W]
    per_dest = in_rank.sum(0)
    remote = int(per_dest.sum() - per_dest[rank])
    sent = [torch.zeros_like(per_dest) for _ in range(world)]
    dist.all_gather(sent, per_dest)
    received = int(sum(int(s[rank]) for s in sent))
    return remote * h * 2, received * h * 2


def stages(x, ids, w, e: int, cap: int, group, iters: int, device: torch.device) -> dict[str, float]:
    """µs of the local parts and of the two messages alone (kernel path)."""
    world = group.size()
    t, k = ids.shape
    h = x.shape[1]
    hp, _ = packed_row(h, x.dtype, k, w.dtype)
    rows = world * (cap or t)
    send, handle = a2a.pack_rank(x, ids, w, e, world, cap)
    recv = torch.empty(rows, hp, dtype=x.dtype, device=device)
    counts = handle[HEADER:HEADER + 2 * world]
    if cap:
        splits: tuple[Any, Any] = (None, None)
    else:
        groups.all_to_all(counts[world:], counts[:world], group, 300.0)
        both = counts.tolist()
        splits = (both[world:], both[:world])
    n = sum(splits[0]) if cap == 0 else rows
    s = sum(splits[1]) if cap == 0 else rows
    out: dict[str, float] = {}
    out["pack_us"] = per_call(lambda: a2a.pack_rank(x, ids, w, e, world, cap), iters, device)
    out["dispatch_msg_us"] = per_call(
        lambda: groups.all_to_all(recv[:n], send[:s], group, 300.0, splits[0], splits[1]), iters, device)
    out["unpack_us"] = per_call(lambda: a2a.unpack_rank(recv, n, h, k, w.dtype, handle, cap == 0), iters, device)
    y = torch.randn(rows, h, device=device).to(x.dtype)
    back = torch.empty(s, h, dtype=x.dtype, device=device)
    out["combine_msg_us"] = per_call(
        lambda: groups.all_to_all(back, y[:n], group, 300.0, splits[1], splits[0]), iters, device)
    out["combine_sum_us"] = per_call(lambda: a2a.combine_rank(back, handle, t, world, x.dtype), iters, device)
    return {key: round(v * 1e6, 1) for key, v in out.items()}


def run_case(shape, t: int, cap: int, path: str, iters: int, device: torch.device, with_stages: bool) -> dict[str, Any]:
    name, h, e, k = shape
    group = dist.group.WORLD
    gname = group.group_name
    x, ids, w = routing(t, h, e, k, device, seed=1000 + dist.get_rank())
    ops = torch.ops.ep_fuse
    with runtime.use_config(EpFuseConfig(ep_a2a_kernels=path == "kernels")):
        rx, _ids, _w, hd = ops.ep_dispatch(x, ids, w, e, gname, "all_to_all", "rank", cap, 300.0)
        y = rx.contiguous()
        sec_d = per_call(lambda: ops.ep_dispatch(x, ids, w, e, gname, "all_to_all", "rank", cap, 300.0), iters,
                         device)
        sec_c = per_call(lambda: ops.ep_combine(y, hd, ids, w, e, gname, "all_to_all", "rank", cap, 300.0, None),
                         iters, device)

        def pair():  # y stands for the experts' (contiguous) output; same routing, so the same shapes
            _rx, _, _, hd2 = ops.ep_dispatch(x, ids, w, e, gname, "all_to_all", "rank", cap, 300.0)
            return ops.ep_combine(y, hd2, ids, w, e, gname, "all_to_all", "rank", cap, 300.0, None)

        sec_p = per_call(pair, iters, device)
    remote, received = byte_counts(ids, e, h)
    row = dict(shape=name, tokens=t, mode=f"capacity {cap}" if cap else "data-dependent", path=path,
               dispatch_us=round(sec_d * 1e6, 1), combine_us=round(sec_c * 1e6, 1), pair_us=round(sec_p * 1e6, 1),
               remote_gbs_dispatch=round(remote / sec_d / 1e9, 2), remote_gbs_combine=round(remote / sec_c / 1e9, 2),
               remote_gbs_pair=round(2 * remote / (sec_d + sec_c) / 1e9, 2),
               recv_gbs_dispatch=round(received / sec_d / 1e9, 2), recv_gbs_combine=round(received / sec_c / 1e9, 2))
    if with_stages and path == "kernels" and a2a._dispatch_kernels(x, ids, w, group.size()):
        row.update(stages(x, ids, w, e, cap, group, iters, device))
    return row


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tokens", default="128,4096")
    ap.add_argument("--paths", default="kernels,reference")
    ap.add_argument("--shapes", default=None, help="comma-separated shape names (default: all)")
    ap.add_argument("--no-stages", action="store_true")
    args = ap.parse_args()
    start(args, needs_cuda=False)
    device = init()
    world = dist.get_world_size()
    log(f"bench_ep_a2a: {world} ranks, {dist.get_backend()}, device {device}, torch {torch.__version__}")
    shapes = [s for s in SHAPES if args.shapes is None or s[0] in args.shapes.split(",")]
    rows = []
    for shape in shapes:
        if shape[2] % world:
            log(f"skip {shape[0]}: {shape[2]} experts not divisible by {world} ranks")
            continue
        for t in (int(v) for v in args.tokens.split(",")):
            for cap in (t, 0):
                x, ids, w = routing(t, shape[1], shape[2], shape[3], device, seed=1000 + dist.get_rank())
                check(x, ids, w, shape[2], cap, dist.group.WORLD.group_name)
                for path in args.paths.split(","):
                    rows.append(run_case(shape, t, cap, path, args.iters, device, not args.no_stages))
                    log(rows[-1])
    if dist.get_rank() == 0:
        out = Path(os.environ.get("OUT", "bench_out"))
        out.mkdir(parents=True, exist_ok=True)
        meta = dict(world=world, torch=torch.__version__, device=str(device),
                    gpu=torch.cuda.get_device_name() if device.type == "cuda" else None)
        write_json("ep_a2a.json", dict(meta=meta, rows=rows))  # $OUT/ep_a2a.json, and --json
        head = list(rows[0]) if rows else []
        for r in rows:
            head += [c for c in r if c not in head]
        lines = [f"all_to_all EP benchmark ({world} ranks, {meta['gpu'] or 'CPU'})", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(str(r.get(c, "")) for c in head) + " |" for r in rows]
        (out / "ep_a2a.md").write_text("\n".join(lines) + "\n")
        log("\n".join(lines))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
