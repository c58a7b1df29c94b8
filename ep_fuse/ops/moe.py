"""The routed-expert (MoE) family: ``ep_fuse::moe_permute``, ``moe_unpermute``, ``grouped_gemm``,
``grouped_gemm_swiglu`` and their block ``moe_experts`` (schemas and pure-torch references).

Conventions shared by every MoE op and provider:

* ``topk_ids`` [T, K] (any integer dtype): a slot is *valid* when ``0 <= id < num_experts``; -1 (or any
  id outside the range, e.g. an expert owned by another EP rank) is skipped.
* permuted rows are in **stable expert-major order**: expert 0's slots first, and within an expert in
  flat slot order ``t*K + k`` (token-ascending). ``S = T*K`` rows are always allocated (static shapes);
  rows past ``seg_indptr[E]`` (one per invalid slot) are zero.
* ``src2dst`` [T*K] int64: the permuted row of each slot, ``-1`` for an invalid slot.
* ``seg_indptr`` [E+1] int64: exclusive prefix sum of per-expert counts (``[0] == 0``); expert ``e``
  owns rows ``[seg_indptr[e], seg_indptr[e+1])``. ``torch._grouped_mm``'s ``offs`` is
  ``seg_indptr[1:]`` as int32; NPU ``group_list_type=1`` counts are ``diff(seg_indptr)``.
* expert weights are in Hugging Face layout: ``w13`` [E, 2I, H] (gate rows, then up rows), ``w2`` [E, H, I].
* the gated activation ``act`` (:data:`ACTS`, with its parameters ``limit``, ``gate_cap``, ``up_cap``) of the
  gate|up GEMM's halves ``g``, ``u`` (each rounded to the activation dtype), in the models' op order:

  - ``"silu"``: ``silu(g) * up`` in the activation dtype (Mixtral, Qwen, DeepSeek-V3, ...);
  - ``"silu_clamp"``: ``silu(g.clamp(max=limit)) * u.clamp(-limit, limit)`` (DeepSeek-V4, GLM-5-Next, HY-V4);
  - ``"silu_clamp_post"``: ``silu(g).clamp(max=limit) * u.clamp(-limit, limit)`` (Step-3.7);
  - ``"silu_fp32"``: ``(silu(g.float()) * u.float()).to(dtype)`` (Beam);
  - ``"softcap_fp32"``: ``(c(g, gate_cap) * sigmoid(g) * c(u, up_cap)).to(dtype)`` in fp32, where
    ``c(v, cap) = tanh(v / cap) * cap`` (``v`` itself for a ``None`` cap) (Inkling-2);
  - ``"swigluoai"``: ``g' = g.clamp(max=limit)``, ``(u.clamp(-limit, limit) + 1) * (g' * sigmoid(g' * a))`` with
    ``a`` = :data:`SWIGLUOAI_ALPHA`, each op rounded to the activation dtype (MiniMax-M3 on gate|up halves;
    GPT-OSS writes it on interleaved halves with biases);
  - ``"gelu_tanh"``: ``gelu(g, approximate="tanh") * u`` in the activation dtype (GeGLU: Gemma-4's experts,
    transformers' ``gelu_pytorch_tanh``; ``gelu_new``, ``gelu_fast`` and ``gelu_python_tanh`` write the tanh
    formula out in Python ops, which round differently, and are not this act);
  - ``"gelu"``: ``gelu(g) * u`` (erf GELU, transformers' ``gelu``; not ``gelu_python``, written out with ``erf``);
  - the non-gated ``"relu2"`` (:data:`UNGATED_ACTS`): ``relu(u) ** 2`` in the activation dtype, where ``w13`` is
    the up projection alone, [E, I, H] (NemotronH).

Numerics follow the Hugging Face ``grouped_mm`` experts exactly: each GEMM output is rounded to the
activation dtype, ``silu(gate) * up`` in that dtype, the routing weight multiplies the expert output in
the promoted dtype (fp32 when the router kept fp32 weights), the top-k sum accumulates in fp32 and is
rounded once.
"""

from __future__ import annotations

import torch

from ep_fuse.ops.registry import define_canonical


def _valid(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    return (ids >= 0) & (ids < num_experts)


def moe_permute_ref(
    x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rows [T*K, H], src2dst [T*K] int64, seg_indptr [E+1] int64)``: tokens gathered in expert order."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1).to(torch.int64)
    valid = _valid(flat, num_experts)
    key = torch.where(valid, flat, num_experts)  # invalid slots sort last
    sorted_key, order = torch.sort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=x.device).scatter_add(
        0, key, torch.ones_like(key))
    seg_indptr = torch.cat([counts.new_zeros(1), torch.cumsum(counts[:num_experts], 0)])
    positions = torch.arange(t * k, device=x.device, dtype=torch.int64)
    inverse = torch.empty_like(order).scatter(0, order, positions)
    src2dst = torch.where(valid, inverse, -1)
    rows = x.reshape(t, x.shape[-1])[order // k]  # (not -1: an empty batch has no inferable width)
    rows = torch.where((sorted_key < num_experts).unsqueeze(-1), rows, torch.zeros((), dtype=x.dtype, device=x.device))
    return rows, src2dst, seg_indptr


def moe_unpermute_ref(
    y: torch.Tensor,
    src2dst: torch.Tensor,
    topk_weights: torch.Tensor | None,
    top_k: int,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    """``out[t] = sum_{valid k} w[t,k] * y[src2dst[t*K+k]]`` (product in the promoted dtype, sum over k)."""
    s, h = src2dst.numel(), y.shape[-1]
    t = s // top_k
    valid = (src2dst >= 0).reshape(t, top_k, 1)
    g = y[src2dst.clamp(min=0)].reshape(t, top_k, h)
    if topk_weights is not None:
        g = g * topk_weights.reshape(t, top_k, 1)
    g = torch.where(valid, g, torch.zeros((), dtype=g.dtype, device=g.device))
    out = g.sum(1)
    return out.to(out_dtype) if out_dtype is not None else out


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """``torch._grouped_mm`` runs ``x @ w[e].T`` here (otherwise the reference loops over experts on the host)."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return False  # torch._grouped_mm's fake kernel accepts bf16 only
    if (x.shape[-1] * 2) % 16 or (w.shape[1] * 2) % 16:
        return False  # its operands' row strides must be multiples of 16 bytes
    if x.device.type == "cuda":
        return torch.cuda.get_device_capability(x.device)[0] >= 9
    return x.device.type == "cpu"


def _zero_tail(out: torch.Tensor, seg_indptr: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(out.shape[0], device=out.device)
    return torch.where((rows < seg_indptr[-1]).unsqueeze(-1), out, torch.zeros((), dtype=out.dtype,
                                                                                 device=out.device))


def grouped_gemm_ref(x: torch.Tensor, w: torch.Tensor, seg_indptr: torch.Tensor) -> torch.Tensor:
    """Rows of expert ``e`` times ``w[e].T`` (``w`` [E, N, K], torch Linear layout); tail rows zero."""
    if grouped_mm_supported(x, w):
        offs = seg_indptr[1:].to(torch.int32)
        return _zero_tail(torch._grouped_mm(x, w.transpose(-2, -1), offs), seg_indptr)
    out = x.new_zeros(x.shape[0], w.shape[1])
    bounds = seg_indptr.tolist()
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = x[lo:hi] @ w[e].transpose(0, 1)
    return out


def grouped_gemm_fake(x: torch.Tensor, w: torch.Tensor, seg_indptr: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


def grouped_gemm_traceable(args: tuple) -> bool:
    """The reference traces to ATen ops (``_grouped_mm``) only for bf16; other dtypes keep the opaque op."""
    return grouped_mm_supported(args[0], args[1])


UNGATED_ACTS = ("relu2",)
"""Activations of the up projection alone (no gate): ``w13`` is [E, I, H] and the output is [.., I]."""

GELU_ACTS = {"gelu_tanh": "tanh", "gelu": "none"}
"""The GeGLU activations and the ``approximate`` argument of ``torch.nn.functional.gelu`` each one is."""

HF_GELU_NAMES = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
"""transformers' ``ACT2FN`` names that are exactly one of :data:`GELU_ACTS` (``F.gelu`` itself); the other GELU names
(``gelu_new``, ``gelu_fast``, ``gelu_python``, ``gelu_python_tanh``, ``gelu_accurate``, ...) are Python formulas that
round differently."""

ACTS = ("silu", "silu_clamp", "silu_clamp_post", "silu_fp32", "softcap_fp32", "swigluoai", *GELU_ACTS) + UNGATED_ACTS
"""The activations of the ``act`` argument (module docstring): gated, then :data:`UNGATED_ACTS`."""

LIMIT_ACTS = ("silu_clamp", "silu_clamp_post", "swigluoai")
"""The activations that take a ``limit``."""

SWIGLUOAI_ALPHA = 1.702
"""The sigmoid's scale of ``"swigluoai"`` (GPT-OSS's constant; MiniMax-M3's ``swiglu_alpha`` default)."""

ACT_SCHEMA = 'str act="silu", float? limit=None, float? gate_cap=None, float? up_cap=None'
"""The activation arguments shared by ``grouped_gemm_swiglu`` and ``moe_experts`` (defaults: plain SwiGLU)."""


def act_args(act: str = "silu", limit: float | None = None, gate_cap: float | None = None,
             up_cap: float | None = None) -> tuple:
    """The trailing call arguments of an activation: none for plain SwiGLU (the calls written before the
    activation arguments existed), else all four."""
    if act == "silu" and limit is None and gate_cap is None and up_cap is None:
        return ()
    return (act, limit, gate_cap, up_cap)


def full_act(rest: tuple) -> tuple[str, float | None, float | None, float | None]:
    """The four activation arguments from a call's trailing arguments (traced calls drop trailing defaults)."""
    return tuple(rest) + ("silu", None, None, None)[len(rest):]


def act_problem(act: str, limit: float | None, gate_cap: float | None, up_cap: float | None) -> str | None:
    """Why these activation arguments describe no activation of :data:`ACTS` (``None``: they do)."""
    if act not in ACTS:
        return f"unknown activation {act!r} (one of {', '.join(ACTS)})"
    if (limit is not None) != (act in LIMIT_ACTS):
        return f"act={act!r} with limit={limit!r} (a limit goes with the clamped acts only)"
    if act != "softcap_fp32" and (gate_cap is not None or up_cap is not None):
        return f"act={act!r} with soft caps (softcap_fp32 only)"
    if any(v is not None and not v > 0 for v in (limit, gate_cap, up_cap)):
        return "limit and caps must be positive"
    return None


def act_width(w13_rows: int, act: str = "silu") -> int:
    """The activation's output columns from the ``w13`` rows: ``I`` of gate|up ``2I``, or all rows when
    ``act`` has no gate."""
    return w13_rows if act in UNGATED_ACTS else w13_rows // 2


def ungated_act(up: torch.Tensor, act: str) -> torch.Tensor:
    """The activation ``act`` of :data:`UNGATED_ACTS` on the up projection, in the activation dtype."""
    if act != "relu2":
        raise ValueError(f"ep_fuse: {act!r} is not an activation without a gate ({', '.join(UNGATED_ACTS)})")
    return torch.square(torch.relu(up))


def _softcap(v: torch.Tensor, cap: float | None) -> torch.Tensor:
    return v if cap is None else torch.tanh(v / cap) * cap


def gated_act(gate: torch.Tensor, up: torch.Tensor, act: str = "silu", limit: float | None = None,
              gate_cap: float | None = None, up_cap: float | None = None) -> torch.Tensor:
    """The activation ``act`` of the gate and up halves, in the op order of the models that write it."""
    reason = act_problem(act, limit, gate_cap, up_cap)
    if reason is not None:
        raise ValueError(f"ep_fuse: {reason}")
    silu = torch.nn.functional.silu
    if act == "silu":
        return silu(gate) * up
    if act == "silu_clamp":
        return silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
    if act == "silu_clamp_post":
        return silu(gate).clamp(max=limit) * up.clamp(min=-limit, max=limit)
    if act == "swigluoai":
        g = gate.clamp(max=limit)
        return (up.clamp(min=-limit, max=limit) + 1.0) * (g * torch.sigmoid(g * SWIGLUOAI_ALPHA))
    if act in GELU_ACTS:
        return torch.nn.functional.gelu(gate, approximate=GELU_ACTS[act]) * up
    g, u = gate.float(), up.float()
    if act == "silu_fp32":
        return (silu(g) * u).to(gate.dtype)
    return (_softcap(g, gate_cap) * torch.sigmoid(g) * _softcap(u, up_cap)).to(gate.dtype)


def grouped_gemm_swiglu_ref(x: torch.Tensor, w13: torch.Tensor, seg_indptr: torch.Tensor, act: str = "silu",
                            limit: float | None = None, gate_cap: float | None = None,
                            up_cap: float | None = None) -> torch.Tensor:
    """The gated activation ``act`` (default ``silu(gate) * up``) of the gate|up GEMM (``w13`` [E, 2I, H]),
    or the activation of an up GEMM (``w13`` [E, I, H], ``act`` of :data:`UNGATED_ACTS`); tail rows zero."""
    h = grouped_gemm_ref(x, w13, seg_indptr)
    if act in UNGATED_ACTS:
        reason = act_problem(act, limit, gate_cap, up_cap)
        if reason is not None:
            raise ValueError(f"ep_fuse: {reason}")
        return ungated_act(h, act)
    inter = w13.shape[1] // 2
    gate, up = h.split(inter, -1)
    return gated_act(gate, up, act, limit, gate_cap, up_cap)


def grouped_gemm_swiglu_fake(x: torch.Tensor, w13: torch.Tensor, seg_indptr: torch.Tensor, act: str = "silu",
                             limit: float | None = None, gate_cap: float | None = None,
                             up_cap: float | None = None) -> torch.Tensor:
    reason = act_problem(act, limit, gate_cap, up_cap)
    if reason is not None:
        raise ValueError(f"ep_fuse: {reason}")
    return x.new_empty(x.shape[0], act_width(w13.shape[1], act))


def moe_experts_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    out_dtype: torch.dtype | None,
    act: str = "silu",
    limit: float | None = None,
    gate_cap: float | None = None,
    up_cap: float | None = None,
) -> torch.Tensor:
    """The routed-expert block: permute -> grouped GEMM + activation ``act`` (default SwiGLU) -> grouped GEMM
    -> weighted unpermute.

    Written with the canonical stage ops, so that expanding the block leaves one node per stage for
    the providers (and the EP pass) to work on.
    """
    ops = torch.ops.ep_fuse
    rows, src2dst, seg_indptr = ops.moe_permute(x, topk_ids, w13.shape[0])
    h = ops.grouped_gemm_swiglu(rows, w13, seg_indptr, *act_args(act, limit, gate_cap, up_cap))
    y = ops.grouped_gemm(h, w2, seg_indptr)
    return ops.moe_unpermute(y, src2dst, topk_weights, topk_ids.shape[1], out_dtype)


moe_permute = define_canonical(
    "moe_permute", "(Tensor x, Tensor topk_ids, int num_experts) -> (Tensor, Tensor, Tensor)", moe_permute_ref)
"""``moe_permute(x, topk_ids, E) -> (rows, src2dst, seg_indptr)``: see :mod:`ep_fuse.ops.moe`."""

moe_unpermute = define_canonical(
    "moe_unpermute",
    "(Tensor y, Tensor src2dst, Tensor? topk_weights, int top_k, ScalarType? out_dtype) -> Tensor",
    moe_unpermute_ref)
"""``moe_unpermute(y, src2dst, w, K, out_dtype)``: weighted top-k sum of permuted rows back per token."""

grouped_gemm = define_canonical(
    "grouped_gemm", "(Tensor x, Tensor w, Tensor seg_indptr) -> Tensor", grouped_gemm_ref,
    fake=grouped_gemm_fake, traceable=grouped_gemm_traceable)
"""``grouped_gemm(x, w [E, N, K], seg_indptr)``: per-expert ``x @ w[e].T`` over row segments."""

grouped_gemm_swiglu = define_canonical(
    "grouped_gemm_swiglu", f"(Tensor x, Tensor w13, Tensor seg_indptr, {ACT_SCHEMA}) -> Tensor",
    grouped_gemm_swiglu_ref,
    fake=grouped_gemm_swiglu_fake, traceable=grouped_gemm_traceable)
"""``grouped_gemm_swiglu(x, w13 [E, 2I, H], seg_indptr, act=...)``: the gated activation (default
``silu(gate) * up``) of the gate|up grouped GEMM (or, for an act without a gate, of the up GEMM, ``w13`` [E, I, H])."""

moe_experts = define_canonical(
    "moe_experts",
    "(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2, ScalarType? out_dtype, "
    f"{ACT_SCHEMA}) -> Tensor",
    moe_experts_ref, block=True, stages=("moe_permute", "grouped_gemm_swiglu", "grouped_gemm", "moe_unpermute"))
"""The routed-expert block; expanded into the four stage ops above before lowering."""
