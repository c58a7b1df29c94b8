"""A test double of ``torch_npu``: the documented semantics of the ops ep_fuse calls, on the CPU.

Written from the op-plugin documentation summarised in ``docs/npu.md`` -- not from
running Ascend hardware. It checks the documented input constraints so a provider that passes an
argument the real op rejects fails here too. :func:`make_module` registers each function as the CPU
kernel of ``npu::<op>`` defined from torch_npu's real schema (``npu_conformance.py``), so every call
is bound to that schema first: each function takes exactly the schema's arguments (names, keyword-only
ones, defaults; ``tests/test_npu_conformance.py`` checks) and returns its outputs.
"""

from __future__ import annotations

import importlib.machinery
import types

import torch
from support.npu_conformance import bound, scalar_type

_RMS_DTYPES = {
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
}


def _rstd(xf: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
    """(y, rstd): fp32 statistics, y = cast(x * rstd * gamma) rounded once to x's dtype."""
    x = self
    if not 1 <= x.dim() <= 8:
        raise RuntimeError("npu_rms_norm: x must be 1-D to 8-D")
    if (x.dtype, gamma.dtype) not in _RMS_DTYPES:
        raise RuntimeError(f"npu_rms_norm: unsupported (x, gamma) dtypes {(x.dtype, gamma.dtype)}")
    if tuple(gamma.shape) != tuple(x.shape[x.dim() - gamma.dim():]):
        raise RuntimeError("npu_rms_norm: gamma must equal the trailing dims of x")
    if x.numel() == 0:
        raise RuntimeError("npu_rms_norm: empty input")
    xf = x.float()
    rstd = _rstd(xf, epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def npu_add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
    """(y, rstd, x1 + x2): normalises the unrounded fp32 sum; gamma has x1's dtype."""
    if gamma.dtype != x1.dtype or x2.dtype != x1.dtype:
        raise RuntimeError("npu_add_rms_norm: x1, x2 and gamma must share a dtype")
    if x1.shape != x2.shape or x1.numel() == 0:
        raise RuntimeError("npu_add_rms_norm: x1 and x2 must have one non-empty shape")
    s = x1.float() + x2.float()
    rstd = _rstd(s, epsilon)
    return (s * rstd * gamma.float()).to(x1.dtype), rstd, s.to(x1.dtype)


def npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1,
                         group_select_mode=0, renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0,
                         eps=1e-20):
    """(y, ids int32, norm_out fp32): documented gating -- p = softmax/sigmoid(x) in fp32; sel = p + bias;
    groups by max (mode 0) / sum of top-2 (mode 1), the best k_group kept (stable), others -inf; top-k by a
    stable argsort; y = p[ids] (no bias); sigmoid only: y /= sum(y) + eps; y *= routed_scaling_factor."""
    if x.dim() != 2 or x.shape[1] > 2048:
        raise RuntimeError("npu_moe_gating_top_k: x must be 2-D with at most 2048 experts")
    t, e = x.shape
    per = e // group_count
    if e % group_count or per <= 2 or k > per * k_group or renorm != 0 or input_ids is not None:
        raise RuntimeError("npu_moe_gating_top_k: needs E/group_count > 2, k <= (E/group_count)*k_group, renorm=0")
    p = torch.softmax(x.float(), -1) if norm_type == 0 else torch.sigmoid(x.float())
    sel = p + bias.float() if bias is not None else p
    grouped = sel.view(t, group_count, per)
    if group_select_mode == 0:
        gscore = grouped.max(-1).values
    else:
        gscore = grouped.sort(-1, descending=True).values[..., :2].sum(-1)
    gidx = torch.sort(gscore, dim=-1, descending=True, stable=True).indices[:, :k_group]
    keep = torch.zeros_like(gscore, dtype=torch.bool).scatter(1, gidx, True).repeat_interleave(per, 1)
    ids = torch.sort(sel.masked_fill(~keep, float("-inf")), dim=-1, descending=True, stable=True).indices[:, :k]
    y = p.gather(1, ids)
    if norm_type == 1:
        y = y / (y.sum(-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    return y.to(x.dtype), ids.to(torch.int32), p  # norm_out fp32 [T, E] is always returned (schema, meta)


def kernels() -> dict[str, object]:
    """``{op: double}`` for every op this double models."""
    return {
        "npu_rms_norm": npu_rms_norm, "npu_add_rms_norm": npu_add_rms_norm, "npu_rotary_mul": npu_rotary_mul,
        "npu_swiglu": npu_swiglu, "npu_mrope": npu_mrope, "npu_moe_init_routing_v2": npu_moe_init_routing_v2,
        "npu_grouped_matmul": npu_grouped_matmul, "npu_moe_finalize_routing": npu_moe_finalize_routing,
        "npu_moe_gating_top_k": npu_moe_gating_top_k, "npu_dynamic_quant": npu_dynamic_quant,
        "npu_dequant_swiglu_quant": npu_dequant_swiglu_quant,
    }


def make_module() -> types.ModuleType:
    """A ``torch_npu`` stand-in whose ``npu_*`` are ``torch.ops.npu.*`` (as in torch_npu), with the doubles as
    CPU kernels under the real schemas and torch_npu's meta functions for fake tensors."""
    mod = types.ModuleType("torch_npu")
    for name, op in bound(kernels()).items():
        setattr(mod, name, op)
    mod.__ep_fuse_test_double__ = True
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)  # find_spec() callers (transformers) expect one
    return mod


def npu_rotary_mul(self: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half",
                   rotate: torch.Tensor | None = None):
    """x·r1 + rotate(x)·r2 in fp32, rounded once; half: (−x2, x1); interleave: (−x[2i+1], x[2i])."""
    x = self
    if rotate is not None:
        raise NotImplementedError("test double: the rotate matrix is not modelled")
    if x.dim() not in (3, 4) or x.shape[-1] % 2 or x.shape[-1] >= 896:
        raise RuntimeError("npu_rotary_mul: 3-D/4-D input with an even head dim < 896")
    if not (r1.dtype == r2.dtype == x.dtype):
        raise RuntimeError("npu_rotary_mul: x, r1, r2 must share a dtype")
    xf = x.float()
    if rotary_mode == "half":
        h = x.shape[-1] // 2
        rot = torch.cat((-xf[..., h:], xf[..., :h]), -1)
    elif rotary_mode == "interleave":
        rot = torch.stack((-xf[..., 1::2], xf[..., 0::2]), -1).flatten(-2)
    else:
        raise RuntimeError(f"npu_rotary_mul: rotary_mode {rotary_mode!r}")
    return (xf * r1.float() + rot * r2.float()).to(x.dtype)


def npu_mrope(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
              head_size: int, *, mrope_section=None, rotary_mode: str = "half", cache_mode: str = "default"):
    """(q', k') [T, heads*head_size]: rows cos||sin of ``cos_sin_cache[max_pos, rot]`` picked by 1-D positions;
    per head, the first ``rot`` channels become x*r1 + rotate(x)*r2 (c, s repeated to ``rot`` wide: halves for
    "half", pairs for "interleave"), the rest pass through; fp32, rounded once. M-RoPE is not modelled."""
    if mrope_section is not None and list(mrope_section) != [0, 0, 0]:
        raise NotImplementedError("test double: M-RoPE sections not modelled")
    if cache_mode != "default":
        raise NotImplementedError(f"test double: cache_mode {cache_mode!r} not modelled")
    if rotary_mode not in ("half", "interleave"):
        raise RuntimeError(f"npu_mrope: rotary_mode {rotary_mode!r}")
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        raise RuntimeError("npu_mrope: 1-D rope (mrope_section None/[0,0,0]) takes 1-D integer positions")
    if query.dim() != 2 or key.dim() != 2 or query.shape[0] != positions.shape[0] or key.shape[0] != query.shape[0]:
        raise RuntimeError("npu_mrope: query/key must be [T, heads*head_size] with T = len(positions)")
    if query.shape[1] > 4096:
        raise RuntimeError("npu_mrope: query.shape[1] must be <= 4096")
    if cos_sin_cache.dtype != query.dtype or key.dtype != query.dtype:
        raise RuntimeError("npu_mrope: cos_sin_cache, query and key must share a dtype")
    rot = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or rot % 2 or rot > head_size:
        raise RuntimeError("npu_mrope: cos_sin_cache must be [max_pos, rotary_dim], rotary_dim even <= head_size")
    if query.shape[1] % head_size or key.shape[1] % head_size:
        raise RuntimeError("npu_mrope: query/key widths must be multiples of head_size")
    row = cos_sin_cache.float()[positions.long()]  # [T, rot]
    c, s = row[:, : rot // 2], row[:, rot // 2:]
    if rotary_mode == "half":
        r1, r2 = torch.cat((c, c), -1), torch.cat((s, s), -1)
    else:
        r1, r2 = c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)
    r1, r2 = r1[:, None], r2[:, None]  # broadcast over heads

    def apply(x: torch.Tensor) -> torch.Tensor:
        xf = x.float().reshape(x.shape[0], -1, head_size)
        xr = xf[..., :rot]
        if rotary_mode == "half":
            rotated = torch.cat((-xr[..., rot // 2:], xr[..., : rot // 2]), -1)
        else:
            rotated = torch.stack((-xr[..., 1::2], xr[..., 0::2]), -1).flatten(-2)
        out = torch.cat((xr * r1 + rotated * r2, xf[..., rot:]), -1)
        return out.reshape(x.shape).to(x.dtype)

    return apply(query), apply(key)


def npu_swiglu(self: torch.Tensor, dim: int = -1):
    """silu(A) * B over the two halves of ``dim`` (A first), in fp32, rounded once."""
    x = self
    if x.shape[dim] % 2 or x.numel() == 0:
        raise RuntimeError("npu_swiglu: the split dim must be even and the input non-empty")
    a, b = x.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(a) * b).to(x.dtype)


# --------------------------------------------------------------------------- MoE routing / grouped GEMM
# Written from the op-plugin pages (docs/context/torch_npu-npu_moe_init_routing_v2.md,
# -npu_grouped_matmul.md, -npu_moe_finalize_routing.md). Only the
# non-quantised dropless paths are modelled; other modes raise NotImplementedError.
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                            expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False,
                            quant_mode=-1, active_expert_range=(), row_idx_type=0, x_dtype=None):
    """(expanded_x, expanded_row_idx, expert_token_cumsum_or_count, expanded_scale), dropless, unquantised.

    Stable sort of the **row-major** flat ids (slot i = n*K + k, token i // K); ids outside
    ``active_expert_range`` [start, end) go last and are inactive. ``expanded_x`` [N*K, H]: the first
    ``available`` rows are x[token of the i-th sorted slot], the rest are invalid (NaN here, so a caller
    that reads them notices). ``row_idx_type`` 0 (gather): out[slot] = position, -1 when inactive;
    1 (scatter): out[position] = slot, -1 past ``available``. Counts (type 1) or cumsum (type 0) over
    [start, end), int64.
    """
    if x.dim() != 2 or x.dtype not in (*_FLOATS, torch.int8):
        raise RuntimeError("npu_moe_init_routing_v2: x must be 2-D float16/bfloat16/float32/int8")
    if expert_idx.dim() != 2 or expert_idx.dtype != torch.int32 or expert_idx.shape[0] != x.shape[0]:
        raise RuntimeError("npu_moe_init_routing_v2: expert_idx must be int32 [NUM_ROWS, K]")
    n, k = expert_idx.shape
    if active_num != n * k:
        raise RuntimeError("npu_moe_init_routing_v2: active_num is checked to equal NUM_ROWS*K")
    if drop_pad_mode != 0:
        raise RuntimeError("npu_moe_init_routing_v2: only drop_pad_mode=0 (dropless) is supported")
    if quant_mode not in (-1, 1):
        raise RuntimeError("npu_moe_init_routing_v2: quant_mode must be -1 or 1 (static quant unsupported)")
    if quant_mode == 1 or scale is not None or offset is not None or x_dtype is not None:
        raise NotImplementedError("test double: quantisation / scale / x_dtype not modelled")
    if expert_tokens_num_type not in (1, 2) or not expert_tokens_num_flag:
        raise RuntimeError("npu_moe_init_routing_v2: expert_tokens_num_type 1/2 with expert_tokens_num_flag=True")
    if expert_tokens_num_type == 2:
        raise NotImplementedError("test double: key_value expert token counts not modelled")
    if not 0 <= expert_num <= 10240:
        raise RuntimeError("npu_moe_init_routing_v2: expert_num must be in [0, 10240]")
    start, end = (0, expert_num) if len(active_expert_range) == 0 else tuple(active_expert_range)
    if not 0 <= start < end <= expert_num:
        raise RuntimeError("npu_moe_init_routing_v2: active_expert_range needs 0 <= start < end <= expert_num")
    if row_idx_type not in (0, 1):
        raise RuntimeError("npu_moe_init_routing_v2: row_idx_type must be 0 or 1")
    flat = expert_idx.reshape(-1).to(torch.int64)
    if bool((flat >= expert_num).any()):
        raise RuntimeError("npu_moe_init_routing_v2: expert ids must not exceed expert_num")
    active = (flat >= start) & (flat < end)
    key = torch.where(active, flat, end)  # inactive slots sort after every active expert
    _, order = torch.sort(key, stable=True)
    available = int(active.sum())
    positions = torch.arange(n * k, dtype=torch.int64)
    fill = float("nan") if x.dtype in _FLOATS else 0
    expanded_x = torch.full((n * k, x.shape[1]), fill, dtype=x.dtype)
    expanded_x[:available] = x[order[:available] // k]
    if row_idx_type == 0:
        row_idx = torch.full((n * k,), -1, dtype=torch.int64)
        row_idx[order[:available]] = positions[:available]
    else:
        row_idx = torch.where(positions < available, order, -1)
    counts = torch.bincount(flat[active] - start, minlength=end - start).to(torch.int64)
    tokens = counts if expert_tokens_num_type == 1 else torch.cumsum(counts, 0)
    expanded_scale = torch.zeros(n * k, dtype=torch.float32)  # meaningless without scale
    return expanded_x, row_idx.to(torch.int32), tokens, expanded_scale


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                       activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
                       group_list_type=0, act_type=0, tuning_config=None, output_dtype=None, x_dtype=None,
                       weight_dtype=None, scale_dtype=None, per_token_scale_dtype=None):
    """``[y]`` with ``y[rows of group g] = x[rows] @ weight[g]`` (weight **[E, K, N]**, i.e. [K, N] per group).

    Only the unquantised "single x, single weight, single y" M-split case (``group_type=0``,
    ``split_item`` 2/3, tensor ``group_list``) is modelled: fp32 accumulation rounded once to x's dtype.
    A weight may be a transposed view (strides of [E, N, K] storage), as the docs allow for this case.
    """
    if not isinstance(x, (list, tuple)) or not isinstance(weight, (list, tuple)):
        raise TypeError("npu_grouped_matmul: x and weight are lists of tensors")
    output_dtype = scalar_type(output_dtype)  # the schema's ``int? output_dtype``: torch.bfloat16 arrives as 15
    if any(d is not None for d in (x_dtype, weight_dtype, scale_dtype, per_token_scale_dtype)):
        raise NotImplementedError("test double: x/weight/scale dtype overrides (hifloat8, fp4) not modelled")
    if len(x) == 1 and x[0].dtype == torch.int8:
        return _grouped_matmul_int8(x, weight, scale, per_token_scale, group_list, split_item, group_type,
                                    group_list_type, output_dtype, (bias, offset, antiquant_scale, antiquant_offset,
                                                                    activation_input, tuning_config), act_type)
    if len(x) > 128 or len(weight) > 128:
        raise RuntimeError("npu_grouped_matmul: x / weight lists hold at most 128 tensors")
    quant = (bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale, activation_input,
             activation_quant_scale, activation_quant_offset, tuning_config)
    if any(q is not None for q in quant) or act_type != 0:
        raise NotImplementedError("test double: bias / quantisation / activation not modelled")
    if len(x) != 1 or len(weight) != 1 or group_type != 0 or not isinstance(group_list, torch.Tensor):
        raise NotImplementedError("test double: only single x / single weight / tensor group_list, group_type=0")
    if split_item not in (2, 3):
        raise RuntimeError("npu_grouped_matmul: single-tensor weight with group_type=0 needs split_item 2 or 3")
    a, w = x[0], weight[0]
    if a.dim() != 2 or w.dim() != 3:
        raise RuntimeError("npu_grouped_matmul: x must be 2-D and weight 3-D [E, K, N]")
    if a.dtype not in _FLOATS or w.dtype != a.dtype:
        raise RuntimeError(f"npu_grouped_matmul: unquantised x/weight must share a float dtype ({a.dtype}, {w.dtype})")
    if output_dtype not in (None, a.dtype):
        raise RuntimeError(f"npu_grouped_matmul: unquantised {a.dtype} input gives {a.dtype}, not {output_dtype}")
    if w.shape[1] != a.shape[1]:
        raise RuntimeError(f"npu_grouped_matmul: weight must be [E, K, N] with K = x.shape[1] = {a.shape[1]}, "
                           f"got {tuple(w.shape)}")
    if not a.is_contiguous():
        raise RuntimeError("npu_grouped_matmul: x cannot be transposed")
    if not (w.is_contiguous() or w.transpose(1, 2).is_contiguous()):
        raise RuntimeError("npu_grouped_matmul: weight must be ND contiguous or a transposed view")
    if a.shape[1] >= 65536 or w.shape[2] >= 65536:
        raise RuntimeError("npu_grouped_matmul: inner dims must be < 65536")
    e = w.shape[0]
    if group_list.dim() != 1 or group_list.dtype != torch.int64 or group_list.numel() != e:
        raise RuntimeError("npu_grouped_matmul: group_list must be int64 [E], E = weight.shape[0]")
    if e > 1024:
        raise RuntimeError("npu_grouped_matmul: at most 1024 groups")
    if group_list_type == 0:
        bounds = group_list
        if bool((bounds < 0).any()) or bool((bounds.diff() < 0).any()):
            raise RuntimeError("npu_grouped_matmul: cumsum group_list must be non-negative and non-decreasing")
    elif group_list_type == 1:
        if e == 1 or bool((group_list < 0).any()):
            raise RuntimeError("npu_grouped_matmul: count group_list must be non-negative with length != 1")
        bounds = torch.cumsum(group_list, 0)
    else:
        raise RuntimeError("npu_grouped_matmul: group_list_type 2 needs int8 x/weight")
    if int(bounds[-1]) != a.shape[0]:
        raise RuntimeError("npu_grouped_matmul: the groups must cover x's rows exactly "
                           f"({int(bounds[-1])} != {a.shape[0]})")
    y = torch.empty(a.shape[0], w.shape[2], dtype=a.dtype)
    lo = 0
    for g, hi in enumerate(bounds.tolist()):
        y[lo:hi] = (a[lo:hi].float() @ w[g].float()).to(a.dtype)
        lo = hi
    return [y]


def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             export_for_source_row, drop_pad_mode=0, k=1):
    """out[n] = skip1[n] + skip2[n] + sum_k scales[n,k] * (rows[idx(n,k)] + bias[expert[n,k]]), fp32, rounded once.

    ``idx(n,k)`` = ``expanded_src_to_dst_row[k*N + n]`` (column-major, modes 0/1) or ``[n*K + k]``
    (row-major, modes 2/3). Dropless modes (0, 2) take indices in [0, N*K-1]; modes 1/3 ([E, C, H]
    rows, -1 contributes 0) are not modelled. ``scales`` None counts as 1.
    """
    rows = expanded_permuted_rows
    drop_pad_mode = 0 if drop_pad_mode is None else drop_pad_mode  # ``int? drop_pad_mode=0``
    if scales is None and export_for_source_row is None and k != 1:
        raise NotImplementedError("test double: the row count from k (no scales) is not modelled")
    if drop_pad_mode not in (0, 1, 2, 3):
        raise RuntimeError("npu_moe_finalize_routing: drop_pad_mode must be in [0, 3]")
    if drop_pad_mode in (1, 3):
        raise NotImplementedError("test double: drop/pad [E, C, H] rows not modelled")
    if rows.dim() != 2 or rows.dtype not in _FLOATS:
        raise RuntimeError("npu_moe_finalize_routing: expanded_permuted_rows must be 2-D float16/bfloat16/float32")
    idx = expanded_src_to_dst_row
    if idx.dim() != 1 or idx.dtype != torch.int32:
        raise RuntimeError("npu_moe_finalize_routing: expanded_src_to_dst_row must be 1-D int32")
    shaped = scales if scales is not None else export_for_source_row
    if shaped is None or shaped.dim() != 2:
        raise NotImplementedError("test double: needs scales or export_for_source_row to know [NUM_ROWS, K]")
    n, k = shaped.shape
    if idx.numel() != n * k or rows.shape[0] != n * k:
        raise RuntimeError("npu_moe_finalize_routing: rows must be [NUM_ROWS*K, H] and indices [NUM_ROWS*K]")
    if scales is not None and scales.dtype != rows.dtype:
        raise RuntimeError(f"npu_moe_finalize_routing: scales dtype {scales.dtype} must equal the rows' {rows.dtype}")
    if skip1 is None and skip2 is not None:
        raise RuntimeError("npu_moe_finalize_routing: skip2 needs skip1")
    for name, t in (("skip1", skip1), ("skip2", skip2), ("bias", bias)):
        if t is not None and (t.dtype != rows.dtype or t.dim() != 2 or t.shape[1] != rows.shape[1]):
            raise RuntimeError(f"npu_moe_finalize_routing: {name} must be 2-D with the rows' dtype and H")
    if bias is not None and export_for_source_row is None:
        raise RuntimeError("npu_moe_finalize_routing: bias needs export_for_source_row")
    if bool((idx < 0).any()) or bool((idx >= n * k).any()):
        raise RuntimeError("npu_moe_finalize_routing: dropless modes take indices in [0, NUM_ROWS*K-1]")
    idx = idx.to(torch.int64)
    idx = idx.reshape(k, n).t() if drop_pad_mode == 0 else idx.reshape(n, k)
    gathered = rows.float()[idx]  # [N, K, H]
    if bias is not None:
        gathered = gathered + bias.float()[export_for_source_row.to(torch.int64)]
    if scales is not None:
        gathered = gathered * scales.float().unsqueeze(-1)
    out = gathered.sum(1)
    for skip in (skip1, skip2):
        if skip is not None:
            out = out + skip.float()
    return out.to(rows.dtype)


# --------------------------------------------------------------------------- W8A8 int8
# Modelled from the documented semantics: rowmax/127 per-token scales, int32 GEMM, (x@W)*scale*per_token_scale.
# Code rounding: half to even (assumed; the docs do not say).
def _quant_rows(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = xf.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax.clamp(min=1e-30), torch.zeros(()))
    return torch.round(xf * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8), amax / 127.0


def npu_dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken",
                      dst_type_max=0.0):
    """(int8 y, fp32 scale [x.shape[:-1]]): per-token symmetric, scale = rowmax(|x|) / 127."""
    x = input
    if quant_mode != "pertoken" or dst_type_max != 0.0:
        raise NotImplementedError("test double: only per-token quantisation to the full int8 range")
    dst_type = scalar_type(dst_type)
    if x.dtype not in (torch.float16, torch.bfloat16) and x.dtype != torch.float32:
        raise RuntimeError("npu_dynamic_quant: x must be float16/bfloat16")
    if smooth_scales is not None or group_index is not None or dst_type not in (None, torch.int8):
        raise NotImplementedError("test double: smooth scales / groups / other dst types not modelled")
    if x.dim() < 2 or x.numel() == 0:
        raise RuntimeError("npu_dynamic_quant: x must be at least 2-D and non-empty")
    return _quant_rows(x.float())


def npu_dequant_swiglu_quant(x, *, weight_scale=None, activation_scale=None, bias=None, quant_scale=None,
                             quant_offset=None, group_index=None, activate_left=False, quant_mode=0, dst_type=None,
                             round_mode=None, activate_dim=None, swiglu_mode=0, clamp_limit=7.0, glu_alpha=1.702,
                             glu_bias=1.0):
    """(int8 y [M, H], fp32 scale [M]) from int32 x [M, 2H]: x * weight_scale[group] * activation_scale[m] in
    fp32 -> SwiGLU (silu on the left half when ``activate_left``) -> dynamic per-token quant (quant_mode=1).
    Rows past sum(group_index) are undefined (filled with garbage here)."""
    if x.dtype != torch.int32 or x.dim() != 2 or x.shape[1] % 2:
        raise RuntimeError("npu_dequant_swiglu_quant: x must be int32 [M, 2H]")
    if quant_mode != 1 or bias is not None or quant_scale is not None or quant_offset is not None:
        raise NotImplementedError("test double: only dynamic quant (quant_mode=1) without bias/static scales")
    if (scalar_type(dst_type) not in (None, torch.int8) or round_mode not in (None, 0) or activate_dim not in (None, -1)
            or swiglu_mode != 0):
        raise NotImplementedError("test double: int8 output, rint rounding, last-dim SwiGLU (swiglu_mode 0) only")
    if group_index is None or group_index.dtype != torch.int64 or group_index.dim() != 1:
        raise RuntimeError("npu_dequant_swiglu_quant: group_index must be int64 counts [E]")
    e = group_index.numel()
    if weight_scale is None or weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (e, x.shape[1]):
        raise RuntimeError("npu_dequant_swiglu_quant: weight_scale must be fp32 [E, 2H]")
    if activation_scale is None or activation_scale.dtype != torch.float32 or activation_scale.numel() != x.shape[0]:
        raise RuntimeError("npu_dequant_swiglu_quant: activation_scale must be fp32 [M]")
    if bool((group_index < 0).any()) or int(group_index.sum()) > x.shape[0]:
        raise RuntimeError("npu_dequant_swiglu_quant: group_index counts must be >= 0 and sum to <= M")
    rows_w = weight_scale.repeat_interleave(group_index, dim=0)
    n = rows_w.shape[0]
    h = x[:n].float() * activation_scale.reshape(-1)[:n].unsqueeze(-1) * rows_w
    a, b = h.chunk(2, dim=-1)
    if not activate_left:
        a, b = b, a
    q, s = _quant_rows(torch.nn.functional.silu(a) * b)
    y = torch.full((x.shape[0], x.shape[1] // 2), 127, dtype=torch.int8)
    scale = torch.full((x.shape[0],), float("nan"))
    y[:n], scale[:n] = q, s
    return y, scale


def _grouped_matmul_int8(x, weight, scale, per_token_scale, group_list, split_item, group_type, group_list_type,
                         output_dtype, unsupported, act_type):
    """int8 x / int8 weight [E, K, N]: int32 out without scales, or (x@W) * scale[g] * per_token_scale in
    bf16/fp16 (scale fp32/bf16 [E, N], per_token_scale fp32 [M])."""
    if any(u is not None for u in unsupported) or act_type != 0:
        raise NotImplementedError("test double: int8 gmm with bias/offset/antiquant/activation not modelled")
    if len(weight) != 1 or group_type != 0 or split_item not in (2, 3) or not isinstance(group_list, torch.Tensor):
        raise NotImplementedError("test double: only single x / single weight / tensor group_list, group_type=0")
    a, w = x[0], weight[0]
    if w.dtype != torch.int8 or a.dim() != 2 or w.dim() != 3 or w.shape[1] != a.shape[1]:
        raise RuntimeError("npu_grouped_matmul: int8 x [M, K] needs an int8 weight [E, K, N]")
    if not a.is_contiguous() or not (w.is_contiguous() or w.transpose(1, 2).is_contiguous()):
        raise RuntimeError("npu_grouped_matmul: x contiguous, weight ND contiguous or a transposed view")
    e = w.shape[0]
    if group_list.dtype != torch.int64 or group_list.numel() != e:
        raise RuntimeError("npu_grouped_matmul: group_list must be int64 [E]")
    bounds = group_list if group_list_type == 0 else torch.cumsum(group_list, 0)
    if group_list_type not in (0, 1) or int(bounds[-1]) != a.shape[0]:
        raise RuntimeError("npu_grouped_matmul: the groups must cover x's rows exactly")
    if output_dtype == torch.int32:
        if scale is not None or per_token_scale is not None:
            raise RuntimeError("npu_grouped_matmul: int32 output takes no scale / per_token_scale")
    elif output_dtype in (torch.bfloat16, torch.float16):
        if scale is None or per_token_scale is None:
            raise RuntimeError("npu_grouped_matmul: int8 -> float output needs scale and per_token_scale")
        (sc,), (pt,) = scale, per_token_scale
        if sc.dtype not in (torch.float32, torch.bfloat16) or tuple(sc.shape) != (e, w.shape[2]):
            raise RuntimeError("npu_grouped_matmul: scale must be fp32/bf16 [E, N]")
        if pt.dtype != torch.float32 or pt.numel() != a.shape[0]:
            raise RuntimeError("npu_grouped_matmul: per_token_scale must be fp32 [M]")
    else:
        raise RuntimeError(f"npu_grouped_matmul: int8 input gives int32, bfloat16 or float16, not {output_dtype}")
    acc = torch.zeros(a.shape[0], w.shape[2], dtype=torch.int32)
    lo = 0
    for g, hi in enumerate(bounds.tolist()):
        acc[lo:hi] = (a[lo:hi].double() @ w[g].double()).to(torch.int32)
        lo = hi
    if output_dtype == torch.int32:
        return [acc]
    group = torch.repeat_interleave(torch.arange(e), torch.diff(bounds, prepend=bounds.new_zeros(1)))
    y = acc.float() * sc.float()[group] * pt.reshape(-1, 1)
    return [y.to(output_dtype)]
