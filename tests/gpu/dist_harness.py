"""Run named scenario functions of a test module on several GPUs, one NCCL process per GPU.

``run_ranks("module", ["sc_a", "sc_b"], world=2)`` spawns ``world`` processes; each sets its device,
joins an NCCL group, runs the scenarios in order (``fn(world)``) and writes ``{name: "ok" | traceback}``;
a rank that hangs or dies shows up as a missing entry. NVLink multicast stays off in every process.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import os
import socket
import sys
import tempfile
import time
import traceback

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _worker(rank: int, world: int, port: int, module: str, names: list[str], out_dir: str) -> None:
    os.environ.update(MULTICAST_OFF)
    sys.path.insert(0, os.path.dirname(__file__))
    import torch
    import torch.distributed as dist

    import ep_fuse

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", rank))
    mod = importlib.import_module(module)
    results: dict[str, str] = {}
    for name in names:
        torch._dynamo.reset()
        ep_fuse.reset_reports()
        t0 = time.perf_counter()
        try:
            getattr(mod, name)(world)
            results[name] = "ok"
        except BaseException:  # noqa: BLE001 - reported per scenario
            results[name] = traceback.format_exc()
        results[name + ":seconds"] = f"{time.perf_counter() - t0:.1f}"
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        with contextlib.suppress(Exception):
            dist.barrier()
    with contextlib.suppress(Exception):
        from ep_fuse.ep import release_buffers

        release_buffers()
        dist.barrier()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def run_ranks(module: str, names: list[str], world: int = 2, timeout_s: float = 600.0) -> list[dict[str, str]]:
    import torch.multiprocessing as mp

    os.environ.update(MULTICAST_OFF)
    out_dir = tempfile.mkdtemp(prefix=f"ep_fuse_gpu{world}_")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(_worker, args=(world, port, module, names, out_dir), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                break
    except Exception as exc:  # a worker died: report what it wrote
        print(f"worker failure: {exc}", file=sys.stderr)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = []
    for r in range(world):
        path = os.path.join(out_dir, f"rank{r}.json")
        results.append(json.load(open(path)) if os.path.exists(path) else {})
    return results


def check(results: list[dict[str, str]], name: str) -> None:
    for rank, res in enumerate(results):
        assert name in res, f"rank {rank} never finished {name} (hang or crash): {sorted(res)}"
        assert res[name] == "ok", f"rank {rank}:\n{res[name]}"
