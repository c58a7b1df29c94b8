"""Run named scenario functions of a test module on several processes: gloo on the CPU, NCCL on GPUs.

``run_ranks("module", ["sc_a", "sc_b"], world=2)`` spawns ``world`` processes; each joins one process
group, runs the scenarios in order (``fn(world)``) and writes ``{name: "ok" | traceback}`` after each,
so a rank that hangs or dies shows up as a missing entry. Scenario processes stay up between scenarios
(one group per run keeps multi-rank tests within minutes). NCCL: one GPU per rank, NVLink multicast off in
every process, EP buffers released before the group is destroyed.
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
from typing import Any

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _worker(rank: int, world: int, port: int, backend: str, module: str, names: list[str], out_dir: str,
            no_barrier: tuple[str, ...]) -> None:
    import warnings

    os.environ.update(MULTICAST_OFF)
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    import ep_fuse
    import ep_fuse.catalog  # noqa: F401  (defines every op and provider)

    extra = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        extra["device_id"] = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120), **extra)
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
        if name not in no_barrier:
            with contextlib.suppress(Exception):
                dist.barrier()
    if backend == "nccl":
        with contextlib.suppress(Exception):
            from ep_fuse.ep import release_buffers

            release_buffers()
            dist.barrier()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def run_ranks(module: str, names: list[str], world: int = 2, backend: str = "gloo", timeout_s: float = 400.0,
              no_barrier: tuple[str, ...] = ()) -> list[dict[str, str]]:
    """Per-rank ``{scenario: "ok" | traceback}`` of running ``names`` (functions of ``module``) on ``world``
    ranks; ``no_barrier``: scenarios after which a rank may be left waiting (no barrier after them)."""
    import torch.multiprocessing as mp

    os.environ.update(MULTICAST_OFF)
    out_dir = tempfile.mkdtemp(prefix=f"ep_fuse_{backend}{world}_")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(_worker, args=(world, port, backend, module, names, out_dir, tuple(no_barrier)),
                             nprocs=world, join=False, start_method="spawn")
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
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
        else:
            results.append({})
    return results


def check(results: list[dict[str, str]], name: str) -> None:
    """Every rank finished ``name`` and passed it."""
    for rank, res in enumerate(results):
        assert name in res, f"rank {rank} never finished {name} (hang or crash): {sorted(res)}"
        assert res[name] == "ok", f"rank {rank}:\n{res[name]}"


def rank_tests(fixture: str, world: int, scenarios: list[Any], *, slow: bool = False,
               timeout_s: float = 400.0) -> tuple[Any, Any]:
    """A module-scoped pytest fixture named ``fixture`` that runs ``scenarios`` (functions of one test module) once on
    ``world`` gloo ranks, and a test parametrised over the scenarios that checks each (marked slow if ``slow``).
    In the test module: ``fx, test_two_ranks = rank_tests("ov2", 2, SCENARIOS_2)``."""
    import pytest

    names = [f.__name__ for f in scenarios]

    @pytest.fixture(scope="module", name=fixture)
    def results() -> list[dict[str, str]]:
        return run_ranks(scenarios[0].__module__, names, world, "gloo", timeout_s)

    @pytest.mark.parametrize("name", names)
    def test(request: Any, name: str) -> None:
        check(request.getfixturevalue(fixture), name)

    return results, (pytest.mark.slow(test) if slow else test)
