"""Shared by the EP test doubles (``deepep_double``, ``npu_ep_double``): a variable-size exchange of row
payloads over ``torch.distributed`` (the transport the doubles emulate their engines with)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def exchange(group: Any, per_dest: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """per_dest[r] = payload tensors (same row count) for rank r -> per_source[s] = payloads from rank s."""
    world = group.size()
    counts = torch.tensor([p[0].shape[0] for p in per_dest], dtype=torch.int64)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    out: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for j in range(len(per_dest[0])):
        send = torch.cat([p[j] for p in per_dest])
        recv = send.new_empty((int(recv_counts.sum()), *send.shape[1:]))
        dist.all_to_all_single(recv, send, recv_counts.tolist(), counts.tolist(), group=group)
        for s, chunk in enumerate(recv.split(recv_counts.tolist())):
            out[s].append(chunk)
    return out
