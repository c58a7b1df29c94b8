"""CPU test double of PyTorch's NVSHMEM symmetric-memory all-to-all ops (the torch 2.11 contract of
``torch/csrc/distributed/c10d/symm_mem/nvshmem_extension.cu`` and ``torch/distributed/_symmetric_memory``),
emulated over ``torch.distributed`` (gloo). Run the engine on it ``with installed():``
(``ep_fuse.ep.symm_mem.use_runtime(runtime())``).

What it enforces, like the real ops (host ``TORCH_CHECK`` s and device asserts):

* ``empty`` needs the NVSHMEM backend (``set_backend("NVSHMEM")``; the default backend is ``CUDA``, and
  the backend cannot change after an allocation) and the world group registered; it is a collective over
  the whole world with equal sizes (NVSHMEM's symmetric heap).
* Every tensor an op touches must come from ``empty``; the op rendezvouses it on the group (collective,
  once per (allocation, group)), with equal allocation sizes on every rank.
* ``all_to_all_vdev_2d(input, out, in_splits, out_splits_offsets, group_name, major_align=None)``:
  contiguous tensors, int64 splits, ``input``/``out`` of one dtype and dim-0 stride, ``in_splits``
  ``[W * ne]`` rank-major (index ``p * ne + e``), ``out_splits_offsets`` ``[2, W * ne]``, ``W <= 32``,
  ``ne <= 16``, ``major_align > 0`` (``None`` = 1), splits >= 0, ``sum(in_splits) <= input.size(0)``.
  Input chunks are packed (offsets = prefix sums of ``in_splits``). Output: expert-major
  (index ``e * W + s``), chunks of one expert contiguous in source order, each expert's block starting
  at a multiple of ``major_align`` and taking at least ``major_align`` rows even when empty;
  ``out_splits_offsets[0]`` = received splits, ``[1]`` = their row offsets (exclusive). Rows not written
  keep their old content.
* ``all_to_all_vdev_2d_offset(input, out, in_splits_offsets, out_splits_offsets, group_name)``: the reverse:
  ``in_splits_offsets`` ``[2, ne * W]`` expert-major (index ``e * W + p``) with explicit row offsets
  (gaps allowed, not sent), ``W <= 16``, ``ne <= 32``; output rank-major (index ``s * ne + e``) packed
  from row 0 (no alignment).

Stricter than the real ops (which would write or read out of bounds silently): ``out`` too small or an
input chunk past ``input`` raise here.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist

A2AV_TILE = 32  # A2AV_TILE_SIZE (= warp size)
NUM_TILES = 16  # THREADS_PER_BLOCK (512) / A2AV_TILE_SIZE
BACKENDS = ("NVSHMEM", "CUDA", "NCCL")


class SymmMemError(RuntimeError):
    """What the real op raises (``TORCH_CHECK``) or where a device assert would fire."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise SymmMemError(f"symm_mem double: {msg}")


def _group(name: str) -> Any:
    return dist.distributed_c10d._resolve_process_group(name)


class SymmetricMemory:
    """Stand-in of ``torch.distributed._symmetric_memory``."""

    def __init__(self) -> None:
        self.backend = "CUDA"
        self.in_use = False
        self.enabled: set[str] = set()
        self.allocations: dict[int, int] = {}  # storage data_ptr -> bytes
        self.alive: list[torch.Tensor] = []  # never freed (so addresses stay unique), like torch's rendezvous map
        self.rendezvoused: set[tuple[int, str]] = set()
        self.allocated = 0  # number of empty() calls (tests count them)

    def is_nvshmem_available(self) -> bool:
        return True

    def get_backend(self, device: Any) -> str | None:
        return self.backend

    def set_backend(self, name: str) -> None:
        _check(name in BACKENDS, f"SymmetricMemory does not find allocation backend {name}")
        if self.in_use and name != self.backend:
            raise SymmMemError("symm_mem double: Backend can not be changed after use.")
        self.backend = name

    def enable_symm_mem_for_group(self, group_name: str) -> None:
        _group(group_name)  # must resolve
        self.enabled.add(group_name)

    def is_symm_mem_enabled_for_group(self, group_name: str) -> bool:
        return group_name in self.enabled

    def empty(self, *size: Any, dtype: torch.dtype | None = None, device: Any = None) -> torch.Tensor:
        _check(self.backend == "NVSHMEM", f"the NVSHMEM ops need NVSHMEM allocations; backend is {self.backend} "
                                          "(call set_backend('NVSHMEM') first)")
        world = dist.group.WORLD
        _check(world.group_name in self.enabled, "get_group_info: no group info associated with the world group "
                                                 "(enable_symm_mem_for_group)")
        if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
            size = tuple(size[0])
        t = torch.empty(size, dtype=dtype or torch.get_default_dtype())
        nbytes = t.numel() * t.element_size()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(sizes, torch.tensor([nbytes]))  # nvshmem_malloc: collective over every PE
        _check(len({int(s) for s in sizes}) == 1, f"symmetric allocation sizes differ across ranks: "
                                                  f"{[int(s) for s in sizes]}")
        self.allocations[t.untyped_storage().data_ptr()] = nbytes
        self.alive.append(t)
        self.in_use = True
        self.allocated += 1
        return t.fill_(float("nan") if t.is_floating_point() else -7 if t.dtype.is_signed else 0xA7)  # garbage

    def rendezvous(self, tensor: torch.Tensor, group: Any) -> Any:
        name = group if isinstance(group, str) else group.group_name
        ptr = tensor.untyped_storage().data_ptr()
        _check(ptr in self.allocations, "rendezvous: the tensor is not allocated by symmetric memory "
                                        "(use torch.distributed._symmetric_memory.empty)")
        if (ptr, name) not in self.rendezvoused:
            _check(name in self.enabled, f"get_group_info: no group info associated with the group name {name}")
            pg = _group(name)
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(pg.size())]
            dist.all_gather(sizes, torch.tensor([self.allocations[ptr]]), group=pg)  # store exchange
            _check(len({int(s) for s in sizes}) == 1, "rendezvous: allocation sizes differ across ranks")
            self.rendezvoused.add((ptr, name))
        return types.SimpleNamespace(rank=dist.get_rank(_group(name)), world_size=_group(name).size())


class Ops:
    """Stand-in of ``torch.ops.symm_mem`` (the two MoE all-to-all ops)."""

    def __init__(self, symm: SymmetricMemory) -> None:
        self.symm = symm
        self.calls: list[str] = []

    def _common(self, tensors: tuple[torch.Tensor, ...], group_name: str, inp: torch.Tensor,
                out: torch.Tensor) -> Any:
        for t in tensors:
            self.symm.rendezvous(t, group_name)
        _check(all(t.is_contiguous() for t in tensors), "input, out, splits and offsets must be contiguous")
        _check(inp.dtype == out.dtype and inp.stride(0) == out.stride(0),
               "input and out must have the same dtype and same stride at dim 0")
        _check(len({t.device for t in tensors}) == 1, "all tensor arguments must be on the same device")
        return _group(group_name)

    # ---------------------------------------------------------------- dispatch direction
    def all_to_all_vdev_2d(self, input: torch.Tensor, out: torch.Tensor, in_splits: torch.Tensor,
                           out_splits_offsets: torch.Tensor, group_name: str, major_align: int | None = None) -> None:
        pg = self._common((input, out, in_splits, out_splits_offsets), group_name, input, out)
        world = pg.size()
        _check(world <= A2AV_TILE, f"world_size must be smaller than A2AV_TILE_SIZE{A2AV_TILE}")
        align = 1 if major_align is None else int(major_align)
        _check(align > 0, "major_align must be positive")
        n = in_splits.shape[0]
        _check(out_splits_offsets.dim() == 2 and out_splits_offsets.shape[0] == 2
               and out_splits_offsets.shape[1] == n and n % world == 0,
               "out_splits_offsets must be 2D with 2 rows, each row must be a multiple of world_size")
        _check(in_splits.dtype == torch.int64 and out_splits_offsets.dtype == torch.int64,
               "splits and offsets must be int64")
        ne = n // world
        _check(ne <= NUM_TILES, f"Number of experts must be smaller than NUM_TILES{NUM_TILES}")
        _check(bool((in_splits >= 0).all()), "split value is negative")
        _check(int(in_splits.sum()) <= input.shape[0], "sum of splits is larger than input dim")
        self.calls.append("all_to_all_vdev_2d")
        sp = in_splits.view(world, ne)  # [dest rank, expert]
        got = torch.empty_like(sp)
        dist.all_to_all_single(got, sp.contiguous(), group=pg)  # got[s, e]: rows source s sends my expert e
        rows_in = input.reshape(input.shape[0], -1)
        rows_out = out.view(out.shape[0], -1)
        send_counts, recv_counts = sp.sum(1).tolist(), got.sum(1).tolist()
        recv = rows_in.new_empty(sum(recv_counts), rows_in.shape[1])
        dist.all_to_all_single(recv, rows_in[: sum(send_counts)], recv_counts, send_counts, group=pg)
        per_src = list(recv.split(recv_counts))
        offsets = torch.zeros(ne, world, dtype=torch.int64)
        start = 0
        for e in range(ne):
            cursor = start
            for s in range(world):
                offsets[e, s] = cursor
                cursor += int(got[s, e])
            length = cursor - start
            start += max(-(-length // align) * align, align)  # aligned up; an empty block takes `align` rows
        _check(int((offsets + got.t()).max()) <= out.shape[0], "out is too small for the received rows")
        for s in range(world):
            cursor = 0
            for e in range(ne):
                cnt = int(got[s, e])
                rows_out[int(offsets[e, s]): int(offsets[e, s]) + cnt] = per_src[s][cursor: cursor + cnt]
                cursor += cnt
        out_splits_offsets[0].copy_(got.t().reshape(-1))
        out_splits_offsets[1].copy_(offsets.reshape(-1))

    # ---------------------------------------------------------------- combine direction
    def all_to_all_vdev_2d_offset(self, input: torch.Tensor, out: torch.Tensor, in_splits_offsets: torch.Tensor,
                                  out_splits_offsets: torch.Tensor, group_name: str) -> None:
        pg = self._common((input, out, in_splits_offsets, out_splits_offsets), group_name, input, out)
        world = pg.size()
        _check(world <= NUM_TILES, f"world_size must be smaller than NUM_TILES{NUM_TILES}")
        _check(in_splits_offsets.dim() == 2 and in_splits_offsets.shape[0] == 2
               and in_splits_offsets.shape[1] % world == 0,
               "in_splits_offsets must be 2D with 2 rows, each row must be a multiple of world_size")
        _check(in_splits_offsets.dtype == torch.int64 and out_splits_offsets.dtype == torch.int64,
               "splits and offsets must be int64")
        n = in_splits_offsets.shape[1]
        ne = n // world
        _check(ne <= A2AV_TILE, f"Number of experts must be smaller than A2AV_TILE_SIZE{A2AV_TILE}")
        _check(tuple(out_splits_offsets.shape) == (2, n), "out_splits_offsets must be [2, world_size * ne] "
                                                         "(the real op writes that many entries unchecked)")
        sp = in_splits_offsets[0].view(ne, world)  # [expert, dest rank]
        off = in_splits_offsets[1].view(ne, world)
        _check(bool((sp >= 0).all()), "split value is negative")
        _check(int((sp + off).max()) <= input.shape[0] and int(off.min()) >= 0, "an input chunk lies outside input")
        self.calls.append("all_to_all_vdev_2d_offset")
        rows_in = input.reshape(input.shape[0], -1)
        rows_out = out.view(out.shape[0], -1)
        got = torch.empty(world, ne, dtype=torch.int64)
        dist.all_to_all_single(got, sp.t().contiguous(), group=pg)  # got[s, e]: rows from source s, expert e
        blocks = [torch.cat([rows_in[int(off[e, p]): int(off[e, p] + sp[e, p])] for e in range(ne)])
                  for p in range(world)]
        send_counts, recv_counts = [b.shape[0] for b in blocks], got.sum(1).tolist()
        recv = rows_in.new_empty(sum(recv_counts), rows_in.shape[1])
        dist.all_to_all_single(recv, torch.cat(blocks), recv_counts, send_counts, group=pg)
        _check(recv.shape[0] <= out.shape[0], "out is too small for the received rows")
        rows_out[: recv.shape[0]] = recv  # rank-major, experts in order, packed (no alignment)
        flat = got.reshape(-1)
        out_splits_offsets[0].copy_(flat)
        out_splits_offsets[1].copy_(torch.cumsum(flat, 0) - flat)


def runtime() -> Any:
    """A fresh :class:`ep_fuse.ep.symm_mem.Runtime` on CPU tensors."""
    from ep_fuse.ep.symm_mem import Runtime

    symm = SymmetricMemory()
    return Runtime(symm=symm, ops=Ops(symm), device_type="cpu")


def installed() -> Any:
    """A fresh double as ``ep_fuse.ep.symm_mem``'s runtime: a context manager (:func:`ep_fuse.ep.symm_mem.use_runtime`)."""
    from ep_fuse.ep import symm_mem

    return symm_mem.use_runtime(runtime())
