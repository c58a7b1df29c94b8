"""A test double of ``deep_ep`` (V1 ``Buffer`` API) over ``torch.distributed`` -- NOT DeepEP.

Implements the documented contract summarised in ``docs/ep.md`` (layout, normal
dispatch/combine, low-latency dispatch/combine, size hints, ``clean_low_latency_buffer``) on CPU with
gloo, so ep_fuse's DeepEP adapter can be checked for its calls, layouts and weight handling. It
checks the documented preconditions (BF16 tokens, int64 ids, fp32 weights, layout tensors equal to
the recomputed layout, config-table group sizes, clean buffer before LL kernels, T <= M) and makes
the places the contract leaves open visible: rows past the real counts are NaN (uninitialised), and
low-latency blocks are placed in *descending* source-rank order (real placement is decided by atomics).

Bound to the real library (DeepEP V1, commit 29d31c0) where it was read or run against it: the size-hint
formulas of ``csrc/config.hpp``, ``Config``'s defaults, the per-group-size config tables, the host
asserts of ``Buffer`` creation (128-byte-aligned sizes, ``bytes / 16 < INT_MAX``), of low-latency
kernels (``SWITCH_HIDDEN`` sizes, hidden % 128, top-k <= 11, ``NVSHMEM_QP_DEPTH >= (M + 1) * 2``) and of
combine (one row per received token, ``num_worst_tokens`` rows included), uninitialised top-k weights
in padded rows, a destroyed ``Buffer`` failing with ``AttributeError`` (its runtime is ``None``), and
the two low-latency result buffers that the kernel after next overwrites.

Internode (``Buffer.dispatch`` / ``combine`` route to ``internode_dispatch`` / ``internode_combine`` when the
runtime has more than one RDMA rank): ranks ``[n * P, (n + 1) * P)`` form node ``n``, ``P`` =
``NUM_MAX_NVL_PEERS`` (8 in DeepEP, compiled in; ``make_module(nvl_peers=2)`` makes 4 gloo ranks a 2 x 2 node
split). Bound to the real host asserts: group sizes ``< P`` or multiples of ``P``, an RDMA buffer only when the
group spans nodes (or low-latency), node counts DeepEP's kernels are built for, ``num_tokens_per_rdma_rank``
given and equal to the layout, buffers at least the ``Config`` size hints of the calls' hidden bytes, the
internode RDMA buffer under ``INT_MAX``, the 10-tuple internode handle, combine's channel matrices from a
config with the same SM count, and combine's NVL-chunk asserts. The double does not model channels or the
RDMA/NVLink forwarding: received rows arrive in source-rank order, as the real ``recv_gbl_rank_prefix_sum``
describes; the channel matrices are zero-filled tensors of the real shapes. ``num_worst_tokens`` stays
intranode only, as ``Buffer.dispatch`` documents it.
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch
import torch.distributed as dist
from support.dist_exchange import exchange

CONFIG_RANKS = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)
DISPATCH_NVL_CHUNK = {2: 24, 4: 6, 8: 6, 16: 36, 24: 32, 32: 32, 48: 32, 64: 32, 96: 20, 128: 20, 144: 32, 160: 28}
COMBINE_NVL_CHUNK = {2: 10, 4: 9, 8: 4, 16: 4, 24: 1, 32: 1, 48: 1, 64: 1, 96: 1, 128: 1, 144: 2, 160: 2}
LL_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
INT_MAX = 2**31 - 1
ALIGN = 128
SOURCE_META_BYTES = 8
topk_idx_t = torch.int64
NUM_MAX_NVL_PEERS = 8
"""Ranks per node (DeepEP: ``csrc/kernels/configs.cuh``, a compile-time 8); set by :func:`make_module`."""
RDMA_NODE_COUNTS = (2, 3, 4, 6, 8, 12, 16, 18, 20)
"""Node counts the internode kernels are instantiated for (``SWITCH_RDMA_RANKS``); others assert."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Config:
    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        nvl_send, nvl_recv = num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens
        rdma_send = num_max_rdma_chunked_send_tokens
        rdma_recv = -(-num_max_rdma_chunked_recv_tokens // rdma_send) * rdma_send
        assert num_sms >= 0 and 0 < nvl_send < nvl_recv and rdma_send <= rdma_recv // 2
        self.num_sms, self.nvl_send, self.nvl_recv, self.rdma_recv = num_sms, nvl_send, nvl_recv, rdma_recv
        self.rdma_send = rdma_send

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        p = NUM_MAX_NVL_PEERS
        assert num_ranks < p or num_ranks % p == 0
        rdma_ranks, nvl_ranks, ch = max(num_ranks // p, 1), min(num_ranks, p), self.num_sms // 2
        per_token = hidden_bytes + SOURCE_META_BYTES + 128 * 8 + 128 * 4 + 128 * 4
        return _align(ch * nvl_ranks * (2 * rdma_ranks + 3) * 4 + ch * nvl_ranks * self.nvl_recv * per_token)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        p = NUM_MAX_NVL_PEERS
        if num_ranks <= p:
            return 0
        assert num_ranks % p == 0 and self.num_sms % 2 == 0
        rdma_ranks, ch = num_ranks // p, self.num_sms // 2
        per_token = 2 * (hidden_bytes + SOURCE_META_BYTES + 128 * 8 + 128 * 4 + 128 * 4 + 16)
        return _align(ch * rdma_ranks * (p * 2 + 2) * 2 * 4 + ch * rdma_ranks * self.rdma_recv * per_token)


class EventOverlap:
    def current_stream_wait(self) -> None:
        pass

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _check_deterministic() -> None:
    if torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory:
        raise RuntimeError("DeepEP (double): deterministic algorithms with fill_uninitialized_memory")


class _Runtime:
    """The C++ runtime's rank queries (``deep_ep_cpp.Buffer``): node = RDMA rank, GPU in node = NVL rank."""

    def __init__(self, rank: int, num_ranks: int) -> None:
        p = NUM_MAX_NVL_PEERS
        self.rank, self.num_ranks = rank, num_ranks
        self.rdma_rank, self.nvl_rank = rank // p, rank % p
        self.num_rdma_ranks, self.num_nvl_ranks = max(1, num_ranks // p), min(num_ranks, p)

    def get_num_rdma_ranks(self) -> int:
        return self.num_rdma_ranks

    def get_rdma_rank(self) -> int:
        return self.rdma_rank

    def get_root_rdma_rank(self, global_: bool) -> int:
        return self.nvl_rank if global_ else 0

    def is_internode_available(self) -> bool:
        return self.num_ranks > NUM_MAX_NVL_PEERS


class Buffer:
    num_sms = 20
    created: list[Buffer] = []
    """Every Buffer constructed in this process (tests count them)."""

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Any = None) -> None:
        self.group, self.rank, self.num_ranks = group, group.rank(), group.size()
        for n in (num_nvl_bytes, num_rdma_bytes):  # deep_ep.cpp Buffer::Buffer host asserts
            assert n % ALIGN == 0 and n // 16 < INT_MAX, f"DeepEP buffer size {n} (128-aligned, /16 < INT_MAX)"
        assert num_nvl_bytes <= INT_MAX or num_rdma_bytes == 0
        assert low_latency_mode or num_rdma_bytes <= INT_MAX
        p = NUM_MAX_NVL_PEERS
        assert self.num_ranks < p or self.num_ranks % p == 0, f"{self.num_ranks} ranks: < {p} or a multiple of {p}"
        if num_rdma_bytes > 0:
            assert self.num_ranks > p or low_latency_mode, "an RDMA buffer needs > NUM_MAX_NVL_PEERS ranks or LL"
        if low_latency_mode or self.num_ranks > p:
            assert num_qps_per_rank > 0
        self.nvshmem_qp_depth = int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))
        self.runtime: Any = _Runtime(self.rank, self.num_ranks)
        self._ll_buffers: list[torch.Tensor | None] = [None, None]
        self._ll_phase = 0
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.num_qps_per_rank = low_latency_mode, num_qps_per_rank
        self.explicitly_destroy = explicitly_destroy
        ids = [torch.zeros(1) for _ in range(self.num_ranks)]
        dist.all_gather(ids, torch.tensor([float(self.rank)]), group=group)  # collective, like the IPC handshake
        self.calls: list[str] = []
        self.normal_used_since_clean = False
        self.destroyed = False
        Buffer.created.append(self)

    # ------------------------------------------------------------------ configs and hints
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        assert num_ranks in CONFIG_RANKS, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, DISPATCH_NVL_CHUNK[num_ranks], 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        assert num_ranks in CONFIG_RANKS, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, COMBINE_NVL_CHUNK[num_ranks], 256, 6, 128)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        m, scales = num_max_dispatch_tokens_per_rank, hidden // 128
        dispatch_msg = 16 + max(hidden * 2, hidden + scales * 4)
        combine_msg = scales * 4 + hidden * 2
        send = max(m * dispatch_msg, num_experts * m * combine_msg)
        recv = max(num_experts * m * dispatch_msg, num_experts * m * combine_msg)
        total = 2 * send + 2 * recv + 2 * _align(num_experts * 4)
        return (total + ALIGN) // ALIGN * ALIGN

    def _ll_result(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """LL results live in one of two buffers; the kernel after next overwrites (poisons) them."""
        self._ll_phase ^= 1
        buf = torch.full(shape, float("nan"), dtype=dtype)
        old = self._ll_buffers[self._ll_phase]
        if old is not None and old.dtype.is_floating_point:
            old.fill_(float("nan"))
        self._ll_buffers[self._ll_phase] = buf
        return buf

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        self.calls.append("clean_low_latency_buffer")
        self.normal_used_since_clean = False

    def destroy(self) -> None:
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        if self.runtime is None:  # the real Buffer: self.runtime.destroy() on None
            raise AttributeError("'NoneType' object has no attribute 'destroy'")
        self.runtime = None
        self.destroyed = True

    def _alive(self, what: str = "get_dispatch_layout") -> None:
        if self.runtime is None:
            raise AttributeError(f"'NoneType' object has no attribute '{what}'")

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: Any = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        self._alive()
        assert topk_idx.dtype == topk_idx_t and topk_idx.dim() == 2
        assert num_experts % self.num_ranks == 0
        per_rank = num_experts // self.num_ranks
        t = topk_idx.shape[0]
        is_token_in_rank = torch.zeros(t, self.num_ranks, dtype=torch.bool)
        per_expert = torch.zeros(num_experts, dtype=torch.int32)
        for i in range(t):
            for e in topk_idx[i].tolist():
                if e >= 0:
                    per_expert[e] += 1
                    is_token_in_rank[i, e // per_rank] = True
        p = NUM_MAX_NVL_PEERS
        per_rdma = None if self.num_ranks <= p else is_token_in_rank.view(t, -1, p).any(-1).sum(0).int()
        return is_token_in_rank.sum(0).int(), per_rdma, per_expert, is_token_in_rank, EventOverlap()

    # ------------------------------------------------------------------ normal
    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                 num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1,
                 num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        internode = self.runtime is not None and self.runtime.get_num_rdma_ranks() > 1
        self._alive("internode_dispatch" if internode else "intranode_dispatch")
        _check_deterministic()
        if isinstance(x, tuple):
            raise NotImplementedError("deepep_double: FP8 dispatch is not implemented")
        # the real intranode dispatch is dtype-agnostic: 2-D, contiguous rows of 16-byte words (csrc/deep_ep.cpp)
        assert x.dim() == 2 and x.is_contiguous(), "dispatch takes a contiguous [T, H]"
        assert x.shape[1] * x.element_size() % 16 == 0, "dispatch rows must be a multiple of 16 bytes"
        assert handle is None, "deepep_double: cached dispatch is not implemented"
        assert (topk_idx is None) == (topk_weights is None)
        assert topk_idx.dtype == topk_idx_t and topk_weights.dtype == torch.float32
        num_experts = num_tokens_per_expert.numel()
        expect = self.get_dispatch_layout(topk_idx, num_experts)
        assert torch.equal(num_tokens_per_rank, expect[0]), "num_tokens_per_rank differs from the layout"
        assert torch.equal(is_token_in_rank, expect[3]), "is_token_in_rank differs from the layout"
        assert torch.equal(num_tokens_per_expert, expect[2]), "num_tokens_per_expert differs from the layout"
        if internode:
            self._check_internode(x, num_tokens_per_rdma_rank, expect[1], config)
        else:
            assert num_tokens_per_rdma_rank is None, "num_tokens_per_rdma_rank is for internode groups"
        if num_worst_tokens:
            assert not internode, "num_worst_tokens is intranode only (Buffer.dispatch's contract)"
        self.normal_used_since_clean = True
        self.calls.append("internode_dispatch" if internode else "dispatch")
        w, me = self.num_ranks, self.rank
        per_rank = num_experts // w
        per_dest = []
        for r in range(w):
            tok = is_token_in_rank[:, r].nonzero().flatten()
            per_dest.append([x[tok], topk_idx[tok], topk_weights[tok], tok])
        got = exchange(self.group, per_dest)
        recv_x = torch.cat([g[0] for g in got])
        idx = torch.cat([g[1] for g in got])
        weights = torch.cat([g[2] for g in got])
        src_idx = torch.cat([g[3] for g in got]).int()
        local = (idx >= me * per_rank) & (idx < (me + 1) * per_rank)
        recv_idx = torch.where(local, idx - me * per_rank, -1)
        recv_w = torch.where(local, weights, 0.0)
        matrix = [torch.zeros(w, dtype=torch.int32) for _ in range(w)]
        dist.all_gather(matrix, num_tokens_per_rank.int(), group=self.group)
        rank_prefix_matrix = torch.stack(matrix).cumsum(0).int()  # [src, dst]
        n = recv_x.shape[0]
        counts = [int((recv_idx == e).sum()) for e in range(per_rank)]
        counts = [-(-c // expert_alignment) * expert_alignment for c in counts]
        native = (rank_prefix_matrix, torch.zeros(1), torch.zeros(1), src_idx, is_token_in_rank.clone(),
                  torch.zeros(1))
        if internode:
            native = self._internode_handle(is_token_in_rank, rank_prefix_matrix, num_tokens_per_rdma_rank, n, config)
        if num_worst_tokens:
            assert n <= num_worst_tokens
            pad = num_worst_tokens - n
            junk = float("nan") if x.dtype.is_floating_point else 0xFF  # uninitialised rows (0xFF.. is NaN too)
            recv_x = torch.cat([recv_x, torch.full((pad, x.shape[1]), junk, dtype=x.dtype)])
            recv_idx = torch.cat([recv_idx, torch.full((pad, idx.shape[1]), -1, dtype=idx.dtype)])
            recv_w = torch.cat([recv_w, torch.full((pad, idx.shape[1]), float("nan"))])  # torch::empty
            src_idx = torch.cat([src_idx, torch.full((pad,), -1, dtype=torch.int32)])
            native = (rank_prefix_matrix, torch.zeros(1), torch.zeros(1), src_idx, is_token_in_rank.clone(),
                      torch.zeros(1))
            counts = []
        return recv_x, recv_idx, recv_w, counts, native, EventOverlap()

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        internode = self.runtime is not None and self.runtime.get_num_rdma_ranks() > 1
        self._alive("internode_combine" if internode else "intranode_combine")
        _check_deterministic()
        assert x.dtype == torch.bfloat16 and x.dim() == 2, "combine takes BF16 [N, H]"
        w = self.num_ranks
        if internode:
            assert isinstance(handle, (tuple, list)) and len(handle) == 10, "internode combine takes the 10-tuple handle"
            is_token_in_rank, _r, _g, rdma_matrix, _rs, gbl_matrix, gbl_prefix, src_meta, rdma_head, nvl_head = handle
            assert x.is_contiguous() and x.shape[0] == src_meta.shape[0], "combine: one row per received token"
            cfg = config or self.get_combine_config(w)
            rdma = self.runtime.get_num_rdma_ranks()
            assert rdma_matrix.shape == (rdma, cfg.num_sms // 2) and gbl_matrix.shape == (w, cfg.num_sms // 2), \
                "the handle's channel matrices come from a dispatch config with the combine config's SM count"
            assert rdma_head.shape == (is_token_in_rank.shape[0], rdma) and nvl_head.shape[1] == NUM_MAX_NVL_PEERS
            assert cfg.nvl_recv % rdma == 0 and cfg.nvl_recv // rdma > max(cfg.rdma_send, cfg.nvl_send), \
                "internode combine: NVL receive chunk % RDMA ranks == 0 and large enough for the send chunks"
            bounds = [0] + gbl_prefix.tolist()
        else:
            rank_prefix_matrix, _c, _r, src_idx, is_token_in_rank, _h = handle
            assert x.shape[0] == src_idx.numel(), "combine: src_idx.size(0) == num_tokens (x rows)"
            bounds = [0] + rank_prefix_matrix[:, self.rank].tolist()
        self.normal_used_since_clean = True
        self.calls.append("internode_combine" if internode else "combine")
        per_dest = [[x[bounds[s]:bounds[s + 1]]] for s in range(w)]
        got = exchange(self.group, per_dest)
        t = is_token_in_rank.shape[0]
        acc = torch.zeros(t, x.shape[1], dtype=torch.float32)
        for r in range(w):
            tok = is_token_in_rank[:, r].nonzero().flatten()
            acc.index_add_(0, tok, got[r][0].float())
        for b in (bias if isinstance(bias, tuple) else (bias,) if bias is not None else ()):
            acc += b.float()
        return acc.to(torch.bfloat16), None, EventOverlap()

    def _check_internode(self, x: torch.Tensor, per_rdma: Any, expect_rdma: torch.Tensor, config: Any) -> None:
        """The host asserts of ``internode_dispatch`` and its kernels."""
        rdma = self.runtime.get_num_rdma_ranks()
        assert rdma in RDMA_NODE_COUNTS, f"Unsupported RDMA ranks: {rdma}"
        assert per_rdma is not None and per_rdma.dtype == torch.int32, "internode: num_tokens_per_rdma_rank (int32)"
        assert torch.equal(per_rdma, expect_rdma), "num_tokens_per_rdma_rank differs from the layout"
        cfg = config or self.get_dispatch_config(self.num_ranks)
        assert cfg.num_sms % 2 == 0
        hidden_bytes = x.shape[1] * x.element_size()
        assert self.num_rdma_bytes >= cfg.get_rdma_buffer_size_hint(hidden_bytes, self.num_ranks), \
            "the RDMA buffer is smaller than Config.get_rdma_buffer_size_hint for these rows"
        assert self.num_nvl_bytes >= cfg.get_nvl_buffer_size_hint(hidden_bytes, self.num_ranks), \
            "the NVL buffer is smaller than Config.get_nvl_buffer_size_hint for these rows"
        assert self.num_rdma_bytes < INT_MAX, "internode kernels: num_rdma_bytes < INT_MAX"

    def _internode_handle(self, is_token_in_rank: torch.Tensor, rank_prefix_matrix: torch.Tensor,
                          per_rdma: torch.Tensor, n: int, config: Any) -> tuple:
        """``internode_dispatch``'s handle: the real tuple's order and shapes; prefix sums filled in."""
        w, p, rdma = self.num_ranks, NUM_MAX_NVL_PEERS, self.runtime.get_num_rdma_ranks()
        ch = (config or self.get_dispatch_config(w)).num_sms // 2
        gathered = [torch.zeros(rdma, dtype=torch.int32) for _ in range(w)]
        dist.all_gather(gathered, per_rdma, group=self.group)
        node, gpu = self.runtime.get_rdma_rank(), self.rank % p
        from_nodes = torch.stack([gathered[s * p + gpu][node] for s in range(rdma)])  # rows this GPU gets over RDMA
        recv_rdma_prefix = from_nodes.cumsum(0).int()
        recv_gbl_prefix = rank_prefix_matrix[:, self.rank].clone().int()  # inclusive, per global source rank
        t = is_token_in_rank.shape[0]

        def z(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32)

        return (is_token_in_rank.clone(), z(rdma, ch), z(w, ch), z(rdma, ch), recv_rdma_prefix, z(w, ch),
                recv_gbl_prefix, torch.zeros(n, SOURCE_META_BYTES, dtype=torch.uint8), z(t, rdma),
                z(int(recv_rdma_prefix[-1]), p))

    # ------------------------------------------------------------------ low latency
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False,
                             return_recv_hook=False):
        self._alive("low_latency_dispatch")
        _check_deterministic()
        assert self.low_latency_mode, "low-latency kernels need Buffer(low_latency_mode=True)"
        assert not self.normal_used_since_clean, "call clean_low_latency_buffer() after normal kernels, before LL"
        if use_fp8:
            raise NotImplementedError("deepep_double: FP8 low-latency dispatch is not implemented")
        m = num_max_dispatch_tokens_per_rank
        assert self.nvshmem_qp_depth >= (m + 1) * 2, "nvshmem_qp_depth >= (num_max_dispatch_tokens_per_rank + 1) * 2"
        assert x.dtype == torch.bfloat16 and x.shape[0] <= m, "LL dispatch: BF16 and T <= num_max_dispatch_tokens"
        assert x.shape[1] % 128 == 0 and x.shape[1] in LL_HIDDEN, "Unsupported hidden"
        assert topk_idx.dtype == topk_idx_t and topk_idx.shape[1] <= 11, "num_topk <= kNumMaxTopK (11)"
        assert num_experts % self.num_ranks == 0
        self.calls.append("low_latency_dispatch")
        w, me = self.num_ranks, self.rank
        per_rank = num_experts // w
        t, k = topk_idx.shape
        per_dest = [[], [], []]
        pairs = [(ti, e) for ti in range(t) for e in topk_idx[ti].tolist() if e >= 0]
        per_dest = []
        for r in range(w):
            mine = [(ti, e) for ti, e in pairs if e // per_rank == r]
            tok = torch.tensor([p[0] for p in mine], dtype=torch.int64)
            exp = torch.tensor([p[1] for p in mine], dtype=torch.int64)
            per_dest.append([x[tok] if mine else x.new_empty(0, x.shape[1]), tok, exp])
        got = exchange(self.group, per_dest)
        h = x.shape[1]
        recv_x = self._ll_result((per_rank, w * m, h), x.dtype)
        src_info = torch.full((per_rank, w * m), -1, dtype=torch.int32)
        layout_range = torch.zeros(per_rank, w, dtype=torch.int64)
        recv_count = torch.zeros(per_rank, dtype=torch.int32)
        for s in reversed(range(w)):  # placement order is not rank order in the real kernel either
            rows, tok, exp = got[s]
            for e in range(per_rank):
                sel = (exp - me * per_rank == e).nonzero().flatten()
                begin, cnt = int(recv_count[e]), sel.numel()
                recv_x[e, begin:begin + cnt] = rows[sel]
                src_info[e, begin:begin + cnt] = tok[sel].int()
                layout_range[e, s] = (begin << 32) | cnt
                recv_count[e] += cnt
        native = (src_info, layout_range, m, h, num_experts)
        return recv_x, recv_count, native, EventOverlap(), (lambda: None)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False,
                            async_finish=False, return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None):
        self._alive("low_latency_combine")
        assert self.low_latency_mode and not self.normal_used_since_clean
        src_info, layout_range, m, h, num_experts = handle
        assert self.nvshmem_qp_depth >= (m + 1) * 2
        w, me = self.num_ranks, self.rank
        per_rank = num_experts // w
        assert x.dtype == torch.bfloat16 and tuple(x.shape) == (per_rank, w * m, h), "x must be BF16 [E_r, W*M, H]"
        assert topk_weights.dtype == torch.float32 and topk_weights.shape == topk_idx.shape
        self.calls.append("low_latency_combine")
        per_dest = []
        for s in range(w):
            rows, tok, exp = [], [], []
            for e in range(per_rank):
                rng = int(layout_range[e, s])
                begin, cnt = rng >> 32, rng & 0xFFFFFFFF
                rows.append(x[e, begin:begin + cnt])
                tok.append(src_info[e, begin:begin + cnt].long())
                exp.append(torch.full((cnt,), me * per_rank + e, dtype=torch.int64))
            per_dest.append([torch.cat(rows), torch.cat(tok), torch.cat(exp)])
        got = exchange(self.group, per_dest)
        t = topk_idx.shape[0]
        acc = torch.zeros(t, h, dtype=torch.float32)
        for rows, tok, exp in got:
            for i in range(rows.shape[0]):
                ti, e = int(tok[i]), int(exp[i])
                for kk in (topk_idx[ti] == e).nonzero().flatten().tolist():
                    acc[ti] += topk_weights[ti, kk] * rows[i].float()
        return acc.to(torch.bfloat16), EventOverlap(), (lambda: None)


def make_module(nvl_peers: int = 8) -> types.ModuleType:
    """A ``deep_ep`` module object: ``sys.modules["deep_ep"] = make_module()``; ``nvl_peers`` ranks per node."""
    global NUM_MAX_NVL_PEERS
    NUM_MAX_NVL_PEERS = nvl_peers
    mod = types.ModuleType("deep_ep")
    mod.Buffer = Buffer
    mod.Config = Config
    mod.EventOverlap = EventOverlap
    mod.topk_idx_t = topk_idx_t
    mod.__ep_fuse_test_double__ = True
    return mod
