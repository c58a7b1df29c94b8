"""Hand-written MoE expert blocks in the styles of other code bases (not Hugging Face), for pattern tests.

Each module takes ``(x [T, H], topk_ids [T, K], topk_weights [T, K])`` and holds ``w13`` [E, 2I, H]
and ``w2`` [E, H, I]; all compute ``sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t))``.
They differ in how tokens are ordered, counted and combined:

* ``ArgsortIndexAdd``: stable ``argsort`` of the flat ids, counts from ``one_hot(...).sum(0)``,
  combine with ``index_add_`` on the token index (Megatron/DeepSpeed style);
* ``ScatterAddCombine``: ``argsort``, counts via ``scatter_add_`` of ones, combine with ``scatter_add_``
  of the weighted rows into ``[T, H]``;
* ``SentinelMasked``: the HF 5.17 CUDA form, ``masked_fill`` of slots routed to ids >= E around each GEMM;
* ``SglangLayout``: explicit ``src2dst`` (inverse permutation) and ``seg_indptr``, rows scattered by
  ``src2dst``, outputs gathered back by it and summed over the top-k slots.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from support.compiling import compile_and_run


class _Experts(torch.nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.num_experts = num_experts
        self.w13 = torch.nn.Parameter((torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype))
        self.w2 = torch.nn.Parameter((torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5).to(dtype))

    def _experts(self, rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        h = torch._grouped_mm(rows, self.w13.transpose(1, 2), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, self.w2.transpose(1, 2), offs=offs)


class ArgsortIndexAdd(_Experts):
    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // k
        counts = F.one_hot(flat, self.num_experts).sum(0)
        offs = counts.cumsum(0).to(torch.int32)
        y = self._experts(x[token], offs)
        y = y * topk_weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros(x.shape, dtype=y.dtype, device=x.device)
        out.index_add_(0, token, y)
        return out.to(x.dtype)


class ScatterAddCombine(_Experts):
    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        token = order // k
        y = self._experts(x.index_select(0, token), offs)
        y = y * topk_weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        out = torch.zeros_like(x)
        out.scatter_add_(0, token.unsqueeze(-1).expand(-1, x.shape[1]), y)
        return out


class SglangLayout(_Experts):
    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        t, k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        src2dst = torch.empty_like(order)
        src2dst[order] = torch.arange(t * k, device=x.device)
        counts = F.one_hot(flat, self.num_experts).sum(0)
        offs = counts.cumsum(0).to(torch.int32)
        rows = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
        rows[src2dst] = x.repeat_interleave(k, dim=0)
        y = self._experts(rows, offs)
        out = (y[src2dst].view(t, k, -1).float() * topk_weights.unsqueeze(-1)).sum(1)
        return out.to(x.dtype)


class SentinelMasked(_Experts):
    """The HF 5.17 CUDA form: slots with ids >= E (EP sentinels) zeroed around each GEMM."""

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        k = topk_ids.shape[1]
        ids_sorted, perm = torch.sort(topk_ids.reshape(-1))
        rows = x[perm // k]
        w_sorted = topk_weights.reshape(-1)[perm]
        counts = torch.histc(ids_sorted.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        sentinel = (ids_sorted >= self.num_experts).unsqueeze(-1)
        rows = rows.masked_fill(sentinel, 0.0)
        h = torch._grouped_mm(rows, self.w13.transpose(-2, -1), offs=offs).masked_fill(sentinel, 0.0)
        gate, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.w2.transpose(-2, -1), offs=offs).masked_fill(sentinel, 0.0)
        y = y * w_sorted.unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0))
        return y[inv].view(x.shape[0], k, -1).sum(1).to(x.dtype)


class ClampedBatched(_Experts):
    """The HF 5.17 CUDA ``batched_mm`` form: ids clamped into range, weights gathered per slot, ``bmm``."""

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        k = topk_ids.shape[1]
        rows = x.repeat_interleave(k, dim=0)
        ids = topk_ids.reshape(-1).clamp(0, self.num_experts - 1)
        h = torch.bmm(self.w13[ids], rows.unsqueeze(-1)).squeeze(-1)
        gate, up = h.chunk(2, dim=-1)
        y = torch.bmm(self.w2[ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        y = y * topk_weights.reshape(-1).unsqueeze(-1)
        return y.view(x.shape[0], k, -1).sum(1).to(x.dtype)


class RoutedClampedBatched(ClampedBatched):
    """``ClampedBatched`` with its own softmax top-k router (the ids are a top-k output)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(num_experts, hidden, inter, dtype)
        self.gate = torch.nn.Linear(hidden, num_experts, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        w, ids = self.gate(x).float().softmax(-1).topk(topk_ids.shape[1])
        return super().forward(x, ids, w / w.sum(-1, keepdim=True))


MODULES = {"argsort_index_add": ArgsortIndexAdd, "scatter_add": ScatterAddCombine, "sglang_layout": SglangLayout,
           "sentinel_masked": SentinelMasked}


def routed_case(t: int = 13, h: int = 64, e: int = 4, i: int = 32, k: int = 2
                ) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """An :class:`ArgsortIndexAdd` block and its inputs: bf16 tokens, distinct experts per token, softmax weights."""
    mod = ArgsortIndexAdd(e, h, i)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    return mod, (x, ids, w)


def compile_routed_case(t: int, device: str, **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(compiled output, eager output)`` of :func:`routed_case` (t tokens, H256 E8 I128 top-2) on ``device``,
    compiled by ep_fuse with ``options``; :func:`ep_fuse.last_report` describes the compile."""
    mod, inputs = routed_case(t=t, h=256, e=8, i=128, k=2)
    mod, inputs = mod.to(device), tuple(a.to(device) for a in inputs)
    with torch.no_grad():
        ref = mod(*inputs)
    return compile_and_run(mod, *inputs, **options), ref


# --------------------------------------------------------------------------- HF experts with other gates
class HFExperts(torch.nn.Module):
    """An experts module with the attributes transformers' experts functions read (``gate_up_proj`` [E, 2I, H],
    ``down_proj`` [E, H, I]), run through its ``grouped_mm`` or ``batched_mm`` function, so the traced code is
    HF's; subclasses override ``_apply_gate`` as the models do (transformers 5.24)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype = torch.bfloat16,
                 impl: str = "grouped_mm", scale: float = 1.0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.num_experts, self.impl = num_experts, impl
        self.gate_up_proj = torch.nn.Parameter(
            (scale * torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype))
        self.down_proj = torch.nn.Parameter((torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5).to(dtype))
        self.act_fn = torch.nn.SiLU()
        self.has_gate, self.has_bias, self.is_transposed = True, False, False
        self.has_post_expert_norm, self._is_expert_parallel = False, False

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        from transformers.integrations import moe as hf_moe

        fn = {"grouped_mm": hf_moe.grouped_mm_experts_forward, "batched_mm": hf_moe.batched_mm_experts_forward}
        return fn[self.impl](self, x, topk_ids, topk_weights)


class ClampedSwiGLU(HFExperts):
    """DeepSeek-V4 / GLM-5-Next / HY-V4: both halves clamped by ``swiglu_limit``, then SwiGLU."""

    limit = 0.75

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return self.act_fn(gate) * up


class ClampedAfterSiLU(HFExperts):
    """Step-3.7: the SiLU output clamped (max), the up half clamped both ways (``inf`` on unclamped layers)."""

    limit = 0.5

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = self.act_fn(gate).clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return gate * up


class Fp32SwiGLU(HFExperts):
    """Beam: SwiGLU in fp32, cast back before the down projection."""

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return (self.act_fn(gate.float()) * up.float()).to(gate.dtype)


class SoftcappedSwiGLU(HFExperts):
    """Inkling-2: ``softcap(g) * sigmoid(g) * softcap(u)`` in fp32, ``softcap(v) = tanh(v / c) * c``."""

    gate_cap, up_cap = 0.5, 0.8

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        dtype = gate.dtype
        gate, up = gate.float(), up.float()
        capped_gate = torch.tanh(gate / self.gate_cap) * self.gate_cap
        return (capped_gate * torch.sigmoid(gate) * (torch.tanh(up / self.up_cap) * self.up_cap)).to(dtype)


class AsymmetricClamp(ClampedSwiGLU):
    """Look-alike: the up half clamped to ``[-L/2, L]`` (not one limit)."""

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit / 2, max=self.limit)


class Fp64Up(Fp32SwiGLU):
    """Look-alike: the up half upcast to fp64, not fp32 (another rounding of the product)."""

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return (self.act_fn(gate.float()) * up.double()).to(gate.dtype)


class MiscappedSwiGLU(SoftcappedSwiGLU):
    """Look-alike: ``tanh(g / c) * 2c`` (the scale is not the cap)."""

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        dtype = gate.dtype
        gate, up = gate.float(), up.float()
        capped_gate = torch.tanh(gate / self.gate_cap) * (2 * self.gate_cap)
        return (capped_gate * torch.sigmoid(gate) * (torch.tanh(up / self.up_cap) * self.up_cap)).to(dtype)


GATED = {"silu_clamp": ClampedSwiGLU, "silu_clamp_post": ClampedAfterSiLU, "silu_fp32": Fp32SwiGLU,
         "softcap_fp32": SoftcappedSwiGLU}
"""The gated activations of ``ep_fuse.ops.moe.ACTS`` besides plain SwiGLU, by name."""


class RoutedBlock(torch.nn.Module):
    """A MoE block around :class:`HFExperts`-style experts: softmax top-k router, then one of the layouts of
    the 5.24 models: ``scaled`` (Beam / Laguna / Step-3.7: ``routed_scaling_factor`` on the experts' output,
    then an RMSNorm), ``parallel`` (a dense SwiGLU MLP on the same normed input, summed with the MoE branch),
    ``shared_bmm`` (Inkling: shared experts as 3-D ``[S, I, H]`` tensors run with ``bmm``, summed)."""

    def __init__(self, experts: torch.nn.Module, hidden: int, layout: str, top_k: int = 2) -> None:
        super().__init__()
        dtype = experts.down_proj.dtype
        g = torch.Generator().manual_seed(5)
        self.experts, self.layout, self.top_k = experts, layout, top_k
        self.router = torch.nn.Parameter(torch.randn(experts.num_experts, hidden, generator=g).to(dtype))
        self.norm_w = torch.nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.scale = 2.5
        s, i = 2, 16
        self.dense = torch.nn.Parameter((torch.randn(3, i, hidden, generator=g) / hidden**0.5).to(dtype))
        self.shared_gate = torch.nn.Parameter((torch.randn(s, i, hidden, generator=g) / hidden**0.5).to(dtype))
        self.shared_up = torch.nn.Parameter((torch.randn(s, i, hidden, generator=g) / hidden**0.5).to(dtype))
        self.shared_down = torch.nn.Parameter((torch.randn(s, hidden, i, generator=g) / i**0.5).to(dtype))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        v = x.float()
        return self.norm_w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, ids = F.linear(x, self.router).float().softmax(-1).topk(self.top_k)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        if self.layout == "scaled":
            return self._norm(self.experts(x, ids, w) * self.scale)
        if self.layout == "parallel":
            h = self._norm(x)
            dense = F.linear(F.silu(F.linear(h, self.dense[0])) * F.linear(h, self.dense[1]), self.dense[2].T)
            return x + dense + self.experts(h, ids, w)
        hs = x.reshape(1, -1, x.shape[-1]).expand(self.shared_gate.shape[0], -1, -1)
        gate = torch.bmm(hs, self.shared_gate.transpose(1, 2))
        up = torch.bmm(hs, self.shared_up.transpose(1, 2))
        shared = torch.bmm(F.silu(gate) * up, self.shared_down.transpose(1, 2)).float().sum(0).to(x.dtype)
        return self.experts(x, ids, w) + shared
