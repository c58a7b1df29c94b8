"""Hand-written MoE blocks whose experts are an ``nn.ModuleList`` looped over in Python, in the shapes
of the code people load with ``trust_remote_code=True`` or from transformers 4.x (for ``ep_fuse.prepare``):

* ``DeepseekV3MoE``: DeepSeek-V3's ``modeling_deepseek.py`` -- ``MoEGate`` with ``topk_method="noaux_tc"``
  (sigmoid scores, ``scores.view(T, -1) + e_score_correction_bias.unsqueeze(0)`` selects, groups viewed
  ``[T, G, -1]``, experts outside the kept groups ``masked_fill``-ed with 0.0 (``cfg.mask_fill``; the
  remote code's value, transformers 5 uses -inf), ``norm_topk_prob`` with ``+ 1e-20``,
  ``routed_scaling_factor``) returning ``(topk_idx, topk_weight)``; ``moe_infer`` sorts the slots with
  ``argsort``, counts ``tokens_per_expert`` on the host and runs the experts one by one; shared experts;
* ``MixtralSparseMoeBlock``: ``block_sparse_moe.experts[i].w1/w2/w3``, softmax top-k in ``forward``,
  ``one_hot`` expert mask, ``index_add_``; returns ``(out, router_logits)``;
* ``Qwen2MoeSparseMoeBlock``: the same loop with ``norm_topk_prob`` and a shared expert scaled by
  ``sigmoid(shared_expert_gate(x))``.

* ``RemoteRoutedMoE``: DeepSeek-style remote code with no gate module: the routing is a method of the block
  (``route``: sigmoid of a raw ``weight`` parameter, ``e_score_correction_bias``, group-limited top-k), the
  argsort / ``tokens_per_expert.cpu().tolist()`` loop in a plain method (``loop``), shared experts added.
  Variants: ``GateModuleLoopMoE`` (DeepSeek's ``MoEGate`` as the router module), ``SoftmaxMethodMoE``
  (softmax top-k in a method returning ``(weights, ids)``, Mixtral's ``index_add_`` loop inline),
  ``RenamedListMoE`` (the expert list named ``mlps``), ``LogitsReturningMoE`` (returns ``(out,
  router_logits)``). Look-alikes: ``UnweightedRemoteMoE`` (expert outputs averaged, not weighted),
  ``EarlyExitRemoteMoE`` (the loop stops at the first expert without tokens), ``InlineRouterMoE`` (routing
  inline in ``forward``), ``NormedOutputMoE`` (an RMSNorm on the output), ``DenseBranches`` (MLPs run on
  all tokens, no routing);
* expert MLPs ``WiWoMLP`` (``wi_0``/``wi_1``/``wo``: roles found by computation) and its look-alike
  ``WiWoReluMLP``.

``LoopModel`` stacks blocks as residual layers (``x = x + block(norm(x))``), like a decoder without attention.
Sizes are tiny; all parameters are seeded.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


def config(**overrides) -> SimpleNamespace:
    cfg = {"hidden_size": 32, "moe_intermediate_size": 16, "intermediate_size": 16, "n_routed_experts": 8,
           "num_local_experts": 8, "num_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 2,
           "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "hidden_act": "silu",
           "shared_expert_intermediate_size": 24, "router_jitter_noise": 0.0, "topk_method": "noaux_tc",
           "scoring_func": "sigmoid", "mlp_bias": False, "mask_fill": 0.0}
    cfg.update(overrides)
    return SimpleNamespace(**cfg)


ACT = {"silu": nn.SiLU, "gelu": nn.GELU}


# --------------------------------------------------------------------------- DeepSeek-V3 remote code
class DeepseekV3MLP(nn.Module):
    def __init__(self, cfg, hidden_size=None, intermediate_size=None):
        super().__init__()
        self.hidden_size = hidden_size or cfg.hidden_size
        self.intermediate_size = intermediate_size or cfg.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=cfg.mlp_bias)
        self.act_fn = ACT[cfg.hidden_act]()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MoEGate(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.n_routed_experts = cfg.n_routed_experts
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.scoring_func = cfg.scoring_func
        self.topk_method = cfg.topk_method
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.mask_fill = cfg.mask_fill
        self.weight = nn.Parameter(torch.randn(self.n_routed_experts, cfg.hidden_size) / cfg.hidden_size**0.5)
        self.e_score_correction_bias = nn.Parameter(0.1 * torch.randn(self.n_routed_experts))

    def forward(self, hidden_states):
        bsz, seq_len, h = hidden_states.shape
        hidden_states = hidden_states.view(-1, h)
        logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32), None)
        scores = logits.sigmoid()
        assert self.topk_method == "noaux_tc" and not self.training
        choice = scores.view(bsz * seq_len, -1) + self.e_score_correction_bias.unsqueeze(0)
        group_scores = choice.view(bsz * seq_len, self.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(
            bsz * seq_len, self.n_group, self.n_routed_experts // self.n_group).reshape(bsz * seq_len, -1)
        masked = choice.masked_fill(~score_mask.bool(), self.mask_fill)
        _, topk_idx = torch.topk(masked, k=self.top_k, dim=-1, sorted=False)
        topk_weight = scores.gather(1, topk_idx)
        if self.top_k > 1 and self.norm_topk_prob:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        topk_weight = topk_weight * self.routed_scaling_factor
        return topk_idx, topk_weight


class DeepseekV3MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.num_experts_per_tok = cfg.num_experts_per_tok
        self.ep_size, self.experts_per_rank, self.ep_rank = 1, cfg.n_routed_experts, 0
        self.experts = nn.ModuleList([DeepseekV3MLP(cfg, intermediate_size=cfg.moe_intermediate_size)
                                      for _ in range(cfg.n_routed_experts)])
        self.gate = MoEGate(cfg)
        if cfg.n_shared_experts is not None:
            self.shared_experts = DeepseekV3MLP(cfg, intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, hidden_states):
        identity = hidden_states
        orig_shape = hidden_states.shape
        topk_idx, topk_weight = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)
        if self.config.n_shared_experts is not None:
            y = y + self.shared_experts(identity)
        return y

    @torch.no_grad()
    def moe_infer(self, x, topk_ids, topk_weight):
        cnts = topk_ids.new_zeros((topk_ids.shape[0], len(self.experts)))
        cnts.scatter_(1, topk_ids, 1)
        tokens_per_expert = cnts.sum(dim=0)
        idxs = topk_ids.view(-1).argsort()
        sorted_tokens = x[idxs // topk_ids.shape[1]]
        tokens_per_expert = tokens_per_expert.cpu().numpy()
        outputs, start = [], 0
        for i, num_tokens in enumerate(tokens_per_expert):
            end = start + num_tokens
            if num_tokens == 0:
                continue
            expert = self.experts[i + self.ep_rank * self.experts_per_rank]
            outputs.append(expert(sorted_tokens[start:end]))
            start = end
        outs = torch.cat(outputs, dim=0) if len(outputs) else sorted_tokens.new_empty(0)
        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        return (new_x.view(*topk_ids.shape, -1).type(topk_weight.dtype).mul_(topk_weight.unsqueeze(dim=-1))
                .sum(dim=1).type(new_x.dtype))


# --------------------------------------------------------------------------- routing in a method, raw weight
class RemoteRoutedMoE(nn.Module):
    """Routing in ``route`` from the block's own ``weight``; the per-expert loop in ``loop`` (no ``moe_infer``)."""

    UNWEIGHTED = False  # look-alike: average the experts' outputs instead of weighting them
    EARLY_EXIT = False  # look-alike: stop at the first expert that gets no tokens

    def __init__(self, cfg):
        super().__init__()
        self.top_k, self.n_routed_experts = cfg.num_experts_per_tok, cfg.n_routed_experts
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.routed_scaling_factor, self.norm_topk_prob = cfg.routed_scaling_factor, cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.randn(self.n_routed_experts, cfg.hidden_size) / cfg.hidden_size**0.5)
        self.e_score_correction_bias = nn.Parameter(0.1 * torch.randn(self.n_routed_experts))
        self.experts = nn.ModuleList([DeepseekV3MLP(cfg, intermediate_size=cfg.moe_intermediate_size)
                                      for _ in range(self.n_routed_experts)])
        self.shared_experts = DeepseekV3MLP(cfg, intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts)

    def route(self, hidden_states):
        tokens = hidden_states.view(-1, hidden_states.shape[-1])
        n = tokens.shape[0]
        scores = F.linear(tokens.type(torch.float32), self.weight.type(torch.float32)).sigmoid()
        choice = scores.view(n, -1) + self.e_score_correction_bias.unsqueeze(0)
        group_scores = choice.view(n, self.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(n, self.n_group, self.n_routed_experts // self.n_group)
        masked = choice.masked_fill(~score_mask.reshape(n, -1).bool(), 0.0)
        _, topk_idx = torch.topk(masked, k=self.top_k, dim=-1, sorted=False)
        topk_weight = scores.gather(1, topk_idx)
        if self.top_k > 1 and self.norm_topk_prob:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_idx, topk_weight * self.routed_scaling_factor

    def forward(self, hidden_states):
        identity, orig_shape = hidden_states, hidden_states.shape
        topk_idx, topk_weight = self.route(hidden_states)
        x = hidden_states.view(-1, hidden_states.shape[-1])
        return self.loop(x, topk_idx, topk_weight).view(*orig_shape) + self.shared_experts(identity)

    def loop(self, x, topk_idx, topk_weight):
        cnts = topk_idx.new_zeros((topk_idx.shape[0], len(self.experts)))
        cnts.scatter_(1, topk_idx, 1)
        idxs = topk_idx.view(-1).argsort()
        sorted_tokens = x[idxs // topk_idx.shape[1]]
        tokens_per_expert = cnts.sum(dim=0).cpu().tolist()
        outputs, start = [], 0
        for i, num_tokens in enumerate(tokens_per_expert):
            if num_tokens == 0:
                if self.EARLY_EXIT:
                    break
                continue
            outputs.append(self.experts[i](sorted_tokens[start:start + num_tokens]))
            start += num_tokens
        outs = torch.cat(outputs, dim=0)
        new_x = torch.zeros(idxs.shape[0], x.shape[-1], dtype=outs.dtype, device=outs.device)
        new_x[idxs[:outs.shape[0]]] = outs
        per_slot = new_x.view(*topk_idx.shape, -1)
        if self.UNWEIGHTED:
            return per_slot.mean(dim=1)
        return per_slot.type(topk_weight.dtype).mul_(topk_weight.unsqueeze(dim=-1)).sum(dim=1).type(x.dtype)


class UnweightedRemoteMoE(RemoteRoutedMoE):
    UNWEIGHTED = True


class EarlyExitRemoteMoE(RemoteRoutedMoE):
    EARLY_EXIT = True


class NormedOutputMoE(RemoteRoutedMoE):
    """Look-alike: an RMSNorm on the block's output (a child of a role the trace does not place)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.post_norm = RMSNorm(cfg.hidden_size)

    def forward(self, hidden_states):
        return self.post_norm(super().forward(hidden_states))


class InlineRouterMoE(RemoteRoutedMoE):
    """The same routing written inline in ``forward`` (no method or submodule returns the top-k)."""

    def forward(self, hidden_states):
        orig_shape = hidden_states.shape
        x = hidden_states.view(-1, hidden_states.shape[-1])
        scores = F.linear(x.float(), self.weight.float()).softmax(dim=-1)
        topk_weight, topk_idx = torch.topk(scores, self.top_k, dim=-1)
        return self.loop(x, topk_idx, topk_weight).view(*orig_shape) + self.shared_experts(hidden_states)


class GateModuleLoopMoE(RemoteRoutedMoE):
    """DeepSeek's ``MoEGate`` as a child module (no ``moe_infer``): the router is that module's call."""

    def __init__(self, cfg):
        super().__init__(cfg)
        del self.weight, self.e_score_correction_bias
        self.gate = MoEGate(cfg)

    def forward(self, hidden_states):
        topk_idx, topk_weight = self.gate(hidden_states)
        x = hidden_states.view(-1, hidden_states.shape[-1])
        return self.loop(x, topk_idx, topk_weight).view(*hidden_states.shape) + self.shared_experts(hidden_states)


class RenamedListMoE(RemoteRoutedMoE):
    """The experts registered as ``mlps`` (found by the trace, not by the name ``experts``)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.mlps = self._modules.pop("experts")

    @property
    def experts(self):
        return self.mlps


class DenseBranches(nn.Module):
    """Look-alike: a list of MLPs each run on every token and averaged (no routing)."""

    def __init__(self, cfg):
        super().__init__()
        self.branches = nn.ModuleList([DeepseekV3MLP(cfg) for _ in range(3)])

    def forward(self, hidden_states):
        return sum(branch(hidden_states) for branch in self.branches) / len(self.branches)


class SoftmaxMethodMoE(nn.Module):
    """Mixtral's routing in a method from a raw ``router_weight`` returning ``(weights, ids)``; the one_hot /
    ``where`` / ``index_add_`` loop inline in ``forward``; no shared expert; rows ``[T, H]`` in and out."""

    def __init__(self, cfg):
        super().__init__()
        self.top_k, self.num_experts = cfg.num_experts_per_tok, cfg.num_local_experts
        self.router_weight = nn.Parameter(torch.randn(self.num_experts, cfg.hidden_size) / cfg.hidden_size**0.5)
        self.experts = nn.ModuleList([MixtralBlockSparseTop2MLP(cfg) for _ in range(self.num_experts)])

    def select(self, rows):
        probs = F.softmax(F.linear(rows, self.router_weight), dim=1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        return (weights / weights.sum(dim=-1, keepdim=True)).to(rows.dtype), ids

    def forward(self, hidden_states):
        rows = hidden_states.view(-1, hidden_states.shape[-1])
        routing_weights, selected_experts = self.select(rows)
        final = torch.zeros_like(rows)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            idx, top_x = torch.where(expert_mask[expert_idx])
            current = self.experts[expert_idx](rows[top_x]) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, current.to(rows.dtype))
        return final


class LogitsReturningMoE(SoftmaxMethodMoE):
    """``select`` also returns the router logits, which the block returns after its output (4.x style)."""

    def select(self, rows):
        logits = F.linear(rows, self.router_weight)
        weights, ids = torch.topk(F.softmax(logits, dim=1, dtype=torch.float), self.top_k, dim=-1)
        return (weights / weights.sum(dim=-1, keepdim=True)).to(rows.dtype), ids, logits

    def forward(self, hidden_states):
        rows = hidden_states.view(-1, hidden_states.shape[-1])
        routing_weights, selected_experts, router_logits = self.select(rows)
        final = torch.zeros_like(rows)
        for expert_idx in range(self.num_experts):
            top_x, idx = torch.where(selected_experts == expert_idx)
            current = self.experts[expert_idx](rows[top_x]) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, current.to(rows.dtype))
        return final.view(hidden_states.shape), router_logits


# --------------------------------------------------------------------------- Mixtral / Qwen2-MoE (4.x)
class MixtralBlockSparseTop2MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ffn_dim, self.hidden_dim = cfg.intermediate_size, cfg.hidden_size
        self.w1 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=cfg.mlp_bias)
        self.w2 = nn.Linear(self.ffn_dim, self.hidden_dim, bias=cfg.mlp_bias)
        self.w3 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=cfg.mlp_bias)
        self.act_fn = ACT[cfg.hidden_act]()

    def forward(self, hidden_states):
        return self.w2(self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states))


def _loop_experts(experts, hidden_states, routing_weights, selected_experts, num_experts):
    """The transformers 4.x expert loop: one_hot mask, ``where`` per expert, ``index_add_``."""
    final = torch.zeros_like(hidden_states)
    expert_mask = F.one_hot(selected_experts, num_classes=num_experts).permute(2, 1, 0)
    for expert_idx in range(num_experts):
        idx, top_x = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[None, top_x].reshape(-1, hidden_states.shape[-1])
        current = experts[expert_idx](current_state) * routing_weights[top_x, idx, None]
        final.index_add_(0, top_x, current.to(hidden_states.dtype))
    return final


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, cfg, mlp=MixtralBlockSparseTop2MLP):
        super().__init__()
        self.hidden_dim, self.num_experts, self.top_k = cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok
        self.gate = nn.Linear(self.hidden_dim, self.num_experts, bias=False)
        self.experts = nn.ModuleList([mlp(cfg) for _ in range(self.num_experts)])
        self.jitter_noise = cfg.router_jitter_noise

    def routing(self, router_logits, dtype):
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        return routing_weights.to(dtype), selected_experts

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights, selected_experts = self.routing(router_logits, hidden_states.dtype)
        final = _loop_experts(self.experts, hidden_states, routing_weights, selected_experts, self.num_experts)
        return final.reshape(batch_size, sequence_length, hidden_dim), router_logits


class Qwen2MoeMLP(DeepseekV3MLP):
    pass


class Qwen2MoeSparseMoeBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList([Qwen2MoeMLP(cfg, intermediate_size=cfg.moe_intermediate_size)
                                      for _ in range(self.num_experts)])
        self.shared_expert = Qwen2MoeMLP(cfg, intermediate_size=cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final = _loop_experts(self.experts, hidden_states, routing_weights, selected_experts, self.num_experts)
        shared = self.shared_expert(hidden_states)
        shared = F.sigmoid(self.shared_expert_gate(hidden_states)) * shared
        final = final + shared
        return final.reshape(batch_size, sequence_length, hidden_dim), router_logits


# --------------------------------------------------------------------------- look-alikes
class FusedGateUpMLP(nn.Module):
    """Phi-3 style expert: one ``gate_up_proj`` Linear, chunked into gate and up."""

    def __init__(self, cfg):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.activation_fn = nn.SiLU()

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.activation_fn(gate) * up)


class WiWoMLP(nn.Module):
    """T5-style gated expert names (``wi_1`` up registered before ``wi_0`` gate, ``wo`` down): the roles are
    found by what it computes, not by the names."""

    def __init__(self, cfg):
        super().__init__()
        self.wi_1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.wi_0 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.wo = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.wo(self.act(self.wi_0(x)) * self.wi_1(x))


class WiWoReluMLP(WiWoMLP):
    """Look-alike: the same Linears under a ReLU gate (no assignment of roles gives SwiGLU)."""

    def forward(self, x):
        return self.wo(torch.relu(self.wi_0(x)) * self.wi_1(x))


class UpFirstFusedMLP(FusedGateUpMLP):
    """The fused Linear's halves in the other order (``up, gate``): not the gate|up layout."""

    def forward(self, x):
        up, gate = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.activation_fn(gate) * up)


class UnnormalisedMixtral(MixtralSparseMoeBlock):
    """Top-k softmax weights not renormalised, and no ``norm_topk_prob`` flag saying so."""

    def routing(self, router_logits, dtype):
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        return routing_weights.to(dtype), selected_experts


class RMSNorm(nn.Module):
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LoopModel(nn.Module):
    """``x = x + block(norm(x))`` per layer (the first output of blocks that return a tuple, as ``x``'s shape)."""

    def __init__(self, block_cls, cfg, layers=2):
        super().__init__()
        self.norms = nn.ModuleList([RMSNorm(cfg.hidden_size) for _ in range(layers)])
        self.layers = nn.ModuleList([block_cls(cfg) for _ in range(layers)])

    def forward(self, x):
        for norm, layer in zip(self.norms, self.layers):
            out = layer(norm(x))
            x = x + (out[0] if isinstance(out, tuple) else out).reshape(x.shape)  # rows [T, H] or [B, S, H]
        return x


def build(block_cls, seed=0, layers=2, dtype=torch.float32, **overrides) -> LoopModel:
    torch.manual_seed(seed)
    return LoopModel(block_cls, config(**overrides), layers).to(dtype).eval()
