"""Ascend and the FP8 block-scaled expert stages (``quant="fp8_block"``): declined, with the reason.

What torch_npu 2.14.0 documents (its wheel's ``_op_plugin_docs.py``, the contract this project checks):

* ``npu_grouped_matmul``: x/weight in float16, bfloat16, float32 or int8 (Atlas A2/A3) -- no float8;
* ``npu_dynamic_block_quant``: 1 x 128 block quantization, but to int8 only (``dst_type=1``), A2/A3;
* ``float8_e4m3fn`` with 128-block ("perblock") scales appears only in fused communication matmuls
  (``npu_all_gather_quant_mm``, ``npu_quant_mm_reduce_scatter``, ...) and MX quant ops, and only on
  Ascend 950PR/950DT.

So no documented op runs the FP8 grouped expert GEMMs on the Atlas A2/A3 parts this project targets.
Each stage registers an ``npu`` provider that is never available: lowering records the reason in the
report and the stage runs the pure-torch reference (not run on an NPU by this project). On Ascend,
``quant="w8a8_int8"`` is the quantized expert path.
"""

from __future__ import annotations

from ep_fuse.ops import fp8 as fp8_ops
from ep_fuse.ops.registry import register_provider
from ep_fuse.providers.npu.provider import devices

NO_FP8 = ("torch_npu 2.14.0 documents no FP8 grouped matmul for Atlas A2/A3 (npu_grouped_matmul takes "
          "fp16/bf16/fp32/int8; npu_dynamic_block_quant quantizes to int8 only; fp8 per-block scales exist only "
          "in Ascend 950 fused-communication matmuls); use quant='w8a8_int8' on Ascend")


def _never() -> str:
    return NO_FP8


def _unused(args: tuple) -> str:
    return NO_FP8


_STAGES = (fp8_ops.quant_fp8_group, fp8_ops.moe_permute_fp8, fp8_ops.grouped_gemm_fp8_swiglu_quant,
           fp8_ops.grouped_gemm_fp8)
DECLINED = frozenset(op.name for op in _STAGES)
"""Canonical ops whose ``npu`` provider only declines (no torch_npu call to check against a contract)."""

for _op in _STAGES:
    register_provider(_op, "npu", _op.reference, devices=devices, available=_never, supports=_unused)
