"""Ascend providers of the MoE stage ops (conventions: ``docs/npu.md``).

The routed-expert block runs as::

    npu_moe_init_routing_v2 -> npu_grouped_matmul(w13) -> npu_swiglu -> npu_grouped_matmul(w2)
        -> npu_moe_finalize_routing

one provider per canonical stage op (``moe_permute``, ``grouped_gemm_swiglu``, ``grouped_gemm``,
``moe_unpermute``), converting between ep_fuse's conventions (:mod:`ep_fuse.ops.moe`) and
the documented torch_npu ones (op-plugin ``docs/context/torch_npu-*.md``; **not run on Ascend
hardware by this project** -- calls checked against torch_npu 2.14.0's schemas and meta functions, numerics
against ``tests/support/npu_double.py``: ``docs/npu.md``):

* **permute** -- ``npu_moe_init_routing_v2`` dropless (``drop_pad_mode=0``), unquantised
  (``quant_mode=-1``, passed explicitly: the schema default, though older docs gave 0), ``active_num = T*K`` (the only value
  the op accepts), ``expert_num = E``, ``active_expert_range=[0, E]``, ``row_idx_type=0`` (gather
  index: slot ``t*K+k`` -> row, the layout of ``src2dst``), ``expert_tokens_num_type=1`` with
  ``expert_tokens_num_flag=True`` (int64 counts; ``seg_indptr = [0, cumsum(counts)]``). The docs
  forbid ids >= E, so every invalid id is sent as -1 (outside the active range: sorted last,
  inactive); ``src2dst`` is re-masked with our own validity so either documented meaning of the
  inactive entries gives -1. ``expanded_x`` rows past the valid ones are "invalid data": zeroed.
* **grouped GEMMs** -- ``npu_grouped_matmul`` single x / single weight / single y
  (``group_type=0``, ``split_item=2``): weight [E, K, N] = ``w.transpose(1, 2)`` of the HF
  [E, N, K] weight. The docs require the groups to cover **all** rows of x, so ``group_list`` is
  ``seg_indptr[1:]`` (cumsum, ``group_list_type=0``) with its last entry set to ``S``: the tail rows
  (zero by the contract) join the last expert, and the output tail is re-zeroed. That computes the
  invalid slots' rows too (no waste without -1 slots; up to (R-1)/R of the rows after an EP dispatch
  over R ranks -- drop the padding if the op is confirmed to accept groups summing to less than M,
  which EP users of ``active_expert_range`` seem to rely on). Cumsum rather than
  counts because it *is* ``seg_indptr`` (no ``diff``) and because a count list may not have length 1.
  The [K, N] weight is a contiguous copy made once per weight tensor (cache below), or -- with
  the config's ``npu_gmm_weight="view"`` (default from ``EP_FUSE_NPU_GMM_WEIGHT``) -- the transposed view itself, which the current op-plugin page
  allows for this case ("支持weight转置") and which avoids holding the expert weights twice.
* **SwiGLU** -- ``npu_swiglu(h, dim=-1)`` = silu(A)·B, A (gate) first: fp32 inside, rounded once;
  the HF/reference order rounds ``silu(gate)`` before the multiply, so results differ by about one
  bf16/fp16 ulp; for ``act="silu_fp32"`` (Beam) it is the reference's rounding. Other activations
  (:data:`NPU_ACTS`: clamped, soft-capped; the GeGLUs, :data:`NPU_GELU_DECLINED`) are declined.
* **unpermute** -- ``npu_moe_finalize_routing(y, None, None, None, scales, src2dst_i32, None,
  drop_pad_mode=2)`` (row-major ``n*K+k``; modes 0/1 are column-major ``k*N+n``). Dropless modes
  document indices in ``[0, N*K-1]`` only, so invalid slots point at row ``S-1`` with scale 0
  (row ``S-1`` is a zero tail row whenever any slot is invalid). ``scales`` must have the rows'
  dtype: fp32 router weights are **rounded to the activation dtype** when the call's output is in
  that dtype (the output is rounded there anyway; each weight gains a relative error <= 2^-9 in
  bf16, about one output ulp unless the top-k terms cancel -- the same trade as the NPU norms), and
  the rows are **upcast to fp32** instead (one extra pass over ``y``) when the call produces fp32,
  where rounded weights would be visible. Unweighted calls use 1 (0 for invalid slots).

Calls outside these documented limits are declined with a reason (the reference runs).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ep_fuse import runtime
from ep_fuse.ops import moe as ops
from ep_fuse.ops.registry import CanonicalOp, register_provider
from ep_fuse.providers.npu.provider import available, contracts, devices, torch_npu
from ep_fuse.symbolic import known, sym_eq

log = logging.getLogger("ep_fuse.providers.npu.moe")

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
MAX_EXPERTS_ROUTING = 10240  # npu_moe_init_routing_v2: expert_num in [0, 10240] (count mode)
MAX_GROUPS = 1024  # npu_grouped_matmul single/single/single: at most 1024 groups
INNER_LIMIT = 65536  # npu_grouped_matmul: last dims of x and weight < 65536
ROW_MAJOR_DROPLESS = 2  # npu_moe_finalize_routing drop_pad_mode: dropless, indices n*K + k
WEIGHT_LAYOUT_ENV = "EP_FUSE_NPU_GMM_WEIGHT"
"""The environment variable that sets the default of the config's ``npu_gmm_weight``."""


# --------------------------------------------------------------------------- helpers
def rows_mask(rows: int, seg_indptr: torch.Tensor) -> torch.Tensor:
    """[rows, 1] bool: row r holds an expert's row (r < seg_indptr[-1])."""
    r = torch.arange(rows, device=seg_indptr.device)
    return (r < seg_indptr[-1]).unsqueeze(-1)


def _zero_tail(out: torch.Tensor, seg_indptr: torch.Tensor) -> torch.Tensor:
    """``out`` with rows past ``seg_indptr[-1]`` set to 0 (``where`` also clears NaN garbage)."""
    return torch.where(rows_mask(out.shape[0], seg_indptr), out, torch.zeros((), dtype=out.dtype,
                                                                             device=out.device))


def cumsum_group_list(seg_indptr: torch.Tensor, rows: int) -> torch.Tensor:
    """Cumsum ``group_list`` (type 0) covering all ``rows``: ``seg_indptr[1:]`` with the last entry ``rows``."""
    head = seg_indptr[1:-1].to(torch.int64)
    return torch.cat((head, head.new_full((1,), rows)))


class _TransposedWeights:
    """Once-per-weight contiguous ``w.transpose(1, 2)`` copies ([E, N, K] -> [E, K, N]).

    Keyed on the weight's storage (a weak reference, so a freed weight's address is never mistaken
    for a new one), offset, shape, stride and dtype; an in-place update (``_version``) remakes the
    copy. Least-recently-used entries beyond ``capacity`` and entries of freed weights are dropped.
    """

    def __init__(self, capacity: int = 512) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[tuple[Any, ...], tuple[int, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()
        self.copies = 0
        """How many copies were made (tests check one per weight)."""

    @staticmethod
    def _version(w: torch.Tensor) -> int:
        return -1 if w.is_inference() else w._version  # inference tensors track no version

    def get(self, w: torch.Tensor) -> torch.Tensor:
        wt = w.transpose(1, 2)
        if wt.is_contiguous():  # the weight already is a [K, N]-per-group view of contiguous storage
            return wt
        key = (StorageWeakRef(w.untyped_storage()), w.storage_offset(), tuple(w.shape), w.stride(), w.dtype)
        version = self._version(w)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and hit[0] == version:
                self._entries.move_to_end(key)
                return hit[1]
        copy = wt.contiguous()
        log.debug("ep_fuse: npu grouped GEMM: transposed copy of a %s %s weight", tuple(w.shape), w.dtype)
        with self._lock:
            self.copies += 1
            self._entries[key] = (version, copy)
            self._entries.move_to_end(key)
            for stale in [k for k in self._entries if k[0].expired()]:
                del self._entries[stale]
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return copy

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.copies = 0


TRANSPOSED = _TransposedWeights()


def gmm_weight(w: torch.Tensor) -> torch.Tensor:
    """``w`` [E, N, K] (torch Linear layout) as the [E, K, N] weight ``npu_grouped_matmul`` takes."""
    if runtime.active_config().npu_gmm_weight == "view":  # (validated by the config: "copy" or "view")
        return w.transpose(1, 2)
    return TRANSPOSED.get(w)


# --------------------------------------------------------------------------- permute
def permute_supports(args: tuple[Any, ...]) -> str | None:
    x, topk_ids, num_experts = args
    if x.dim() != 2:
        return f"npu_moe_init_routing_v2 takes a 2-D x, got {x.dim()}-D"
    if x.dtype not in FLOATS:
        return f"x dtype {x.dtype} (unquantised routing takes float16/bfloat16/float32)"
    if topk_ids.dim() != 2 or not sym_eq(topk_ids.shape[0], x.shape[0]):
        return "topk_ids is not [T, K] for x [T, H]"
    if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool:
        return f"topk_ids dtype {topk_ids.dtype} is not an integer type"
    if known(x.numel() == 0) or known(topk_ids.numel() == 0):  # symbolic: re-checked per call
        return "empty input"
    if not 1 <= num_experts <= MAX_EXPERTS_ROUTING:
        return f"{num_experts} experts (npu_moe_init_routing_v2 takes 1..{MAX_EXPERTS_ROUTING})"
    return None


def moe_permute_kernel(
    x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t, k = topk_ids.shape
    valid = (topk_ids >= 0) & (topk_ids < num_experts)
    ids = torch.where(valid, topk_ids, -1).to(torch.int32).contiguous()  # the docs forbid ids >= expert_num
    expanded_x, row_idx, counts, _scale = torch_npu().npu_moe_init_routing_v2(
        x.contiguous(), ids, active_num=t * k, expert_num=num_experts, drop_pad_mode=0,
        expert_tokens_num_type=1, expert_tokens_num_flag=True, quant_mode=-1,
        active_expert_range=[0, num_experts], row_idx_type=0)
    seg_indptr = torch.cat((counts.new_zeros(1), torch.cumsum(counts, 0))).to(torch.int64)
    src2dst = torch.where(valid.reshape(-1), row_idx.to(torch.int64), -1)
    return _zero_tail(expanded_x, seg_indptr), src2dst, seg_indptr


# --------------------------------------------------------------------------- grouped GEMM (+ SwiGLU)
def _gemm_reason(x: torch.Tensor, w: torch.Tensor, seg_indptr: torch.Tensor) -> str | None:
    if x.dim() != 2 or w.dim() != 3:
        return "npu_grouped_matmul (single tensors) takes a 2-D x and a 3-D weight"
    if x.dtype not in FLOATS or w.dtype != x.dtype:
        return f"dtypes x {x.dtype} / weight {w.dtype} (unquantised: one of float16/bfloat16/float32)"
    if not sym_eq(w.shape[2], x.shape[1]):
        return f"weight {tuple(w.shape)} is not [E, N, H] for x [S, {x.shape[1]}]"
    e = w.shape[0]
    if not 1 <= e <= MAX_GROUPS:
        return f"{e} experts (npu_grouped_matmul takes at most {MAX_GROUPS} groups)"
    if seg_indptr.dim() != 1 or seg_indptr.shape[0] != e + 1 or seg_indptr.dtype.is_floating_point:
        return "seg_indptr is not an integer [E+1] tensor"
    if known(x.shape[0] == 0) or known(x.shape[1] == 0) or known(w.shape[1] == 0):
        return "empty input"
    if not (known(x.shape[1] < INNER_LIMIT) and known(w.shape[1] < INNER_LIMIT)):
        return f"inner dim >= {INNER_LIMIT} (npu_grouped_matmul InnerLimit)"
    return None


def gemm_supports(args: tuple[Any, ...]) -> str | None:
    return _gemm_reason(*args)


NPU_ACTS = ("silu", "silu_fp32")
"""The gated activations ``npu_swiglu`` computes: SwiGLU (fp32 inside, rounded once: about one ulp from the
reference's rounded ``silu(gate)``) and Beam's fp32 SwiGLU, which rounds exactly so. The clamped forms have no
torch_npu op that clamps the halves before (or the SiLU after) the product, and no torch_npu op soft-caps them:
declined (the reference runs)."""

NPU_GELU_DECLINED = ("npu_swiglu computes SwiGLU only; torch_npu 2.14's npu_gelu_mul (gelu of the left half times "
                     "the right half) is not called: it takes at most 1024 gate|up columns (Gemma-4 26B-A4B has 1408) "
                     "and 200000 rows (Atlas A2/A3), and this provider declares one fixed set of torch_npu calls")
"""Why the GeGLU activations (``ops.moe.GELU_ACTS``) keep the reference on Ascend."""


def gemm_swiglu_supports(args: tuple[Any, ...]) -> str | None:
    reason = _gemm_reason(*args[:3])
    if reason is None and args[1].shape[1] % 2:
        reason = "odd gate|up width (npu_swiglu splits the last dim in two halves)"
    act = args[3] if len(args) > 3 else "silu"
    if reason is None and act in ops.GELU_ACTS:
        reason = f"act={act}: {NPU_GELU_DECLINED}"
    elif reason is None and act not in NPU_ACTS:
        reason = f"act={act}: npu_swiglu computes plain SwiGLU only (no clamp or soft cap of the halves)"
    return reason


def _grouped_matmul(x: torch.Tensor, w: torch.Tensor, seg_indptr: torch.Tensor) -> torch.Tensor:
    (y,) = torch_npu().npu_grouped_matmul(
        [x.contiguous()], [gmm_weight(w)], group_list=cumsum_group_list(seg_indptr, x.shape[0]), group_list_type=0,
        group_type=0, split_item=2, output_dtype=x.dtype)
    return y


def grouped_gemm_kernel(x: torch.Tensor, w: torch.Tensor, seg_indptr: torch.Tensor) -> torch.Tensor:
    return _zero_tail(_grouped_matmul(x, w, seg_indptr), seg_indptr)


def grouped_gemm_swiglu_kernel(x: torch.Tensor, w13: torch.Tensor, seg_indptr: torch.Tensor, act: str = "silu",
                               limit: float | None = None, gate_cap: float | None = None,
                               up_cap: float | None = None) -> torch.Tensor:
    if act not in NPU_ACTS:
        raise ValueError(f"ep_fuse: npu grouped_gemm_swiglu: act={act} is declined (gemm_swiglu_supports)")
    h = _grouped_matmul(x, w13, seg_indptr)
    return _zero_tail(torch_npu().npu_swiglu(h, dim=-1), seg_indptr)  # mask the narrower [S, I] output


# --------------------------------------------------------------------------- unpermute
def _unpermute_dtypes(
    y: torch.Tensor, w: torch.Tensor | None, out_dtype: torch.dtype | None
) -> tuple[torch.dtype, torch.dtype]:
    """(rows dtype for the NPU op, result dtype of the call)."""
    product = torch.promote_types(y.dtype, w.dtype) if w is not None else y.dtype
    result = out_dtype if out_dtype is not None else product
    rows = y.dtype if product == y.dtype or result == y.dtype else torch.float32
    return rows, result


def unpermute_supports(args: tuple[Any, ...]) -> str | None:
    y, src2dst, w, top_k, out_dtype = args
    if y.dim() != 2 or y.dtype not in FLOATS:
        return f"npu_moe_finalize_routing takes 2-D float16/bfloat16/float32 rows, got {y.dim()}-D {y.dtype}"
    s = src2dst.numel()
    if src2dst.dim() != 1 or src2dst.dtype.is_floating_point:
        return "src2dst is not a 1-D integer tensor"
    if top_k < 1 or known(s == 0) or not known(s % top_k == 0):
        return f"{s} slots do not make [T, {top_k}] with T >= 1"
    if not sym_eq(y.shape[0], s):
        return f"rows {y.shape[0]} != T*K = {s} (dropless finalize takes [T*K, H] rows)"
    if known(y.shape[1] == 0):
        return "empty hidden dim"
    if w is not None and (not sym_eq(w.numel(), s) or not w.dtype.is_floating_point):
        return "topk_weights is not a float [T, K] tensor"
    rows, result = _unpermute_dtypes(y, w, out_dtype)
    if rows not in FLOATS or result not in FLOATS:
        return f"result dtype {result} (finalize computes float16/bfloat16/float32)"
    return None


def moe_unpermute_kernel(
    y: torch.Tensor, src2dst: torch.Tensor, topk_weights: torch.Tensor | None, top_k: int,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    s = src2dst.numel()
    t = s // top_k
    rows_dtype, result = _unpermute_dtypes(y, topk_weights, out_dtype)
    valid = src2dst >= 0
    index = torch.where(valid, src2dst, s - 1).to(torch.int32)  # dropless modes take [0, T*K-1] only
    weights = topk_weights.reshape(s) if topk_weights is not None else torch.ones((), dtype=rows_dtype,
                                                                                  device=y.device)
    scales = torch.where(valid, weights.to(rows_dtype), torch.zeros((), dtype=rows_dtype, device=y.device))
    out = torch_npu().npu_moe_finalize_routing(y.to(rows_dtype).contiguous(), None, None, None, scales.reshape(t, top_k),
                                          index, None, ROW_MAJOR_DROPLESS)
    return out.to(result)


# --------------------------------------------------------------------------- registration
def _register(op: CanonicalOp, kernel: Callable[..., Any], supports: Callable[[tuple[Any, ...]], str | None],
              *calls: str) -> None:
    register_provider(op, "npu", kernel, devices=devices, available=available, supports=supports,
                      contracts=contracts(*calls))


_register(ops.moe_permute, moe_permute_kernel, permute_supports, "npu_moe_init_routing_v2")
_register(ops.grouped_gemm_swiglu, grouped_gemm_swiglu_kernel, gemm_swiglu_supports, "npu_grouped_matmul",
          "npu_swiglu")
_register(ops.grouped_gemm, grouped_gemm_kernel, gemm_supports, "npu_grouped_matmul")
_register(ops.moe_unpermute, moe_unpermute_kernel, unpermute_supports, "npu_moe_finalize_routing")
