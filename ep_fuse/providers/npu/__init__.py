"""Ascend provider (``torch_npu``): one module per op family (``rms_norm``, ``rope``, ``gemm_swiglu``, ``moe``,
``moe_gating``, ``w8a8``, ``fp8``) registers that family's ops; :mod:`.provider` holds the shared pieces.

Conventions used (from the op-plugin docs; **not run on Ascend hardware by this project**; every call is checked
against torch_npu 2.14.0's schema and meta function: ``docs/npu.md``):

* ``npu_rms_norm(x, gamma, epsilon) -> (y, rstd)``: statistics in fp32, ``y = cast(x * rstd * gamma)``
  rounded once; (x, gamma) dtypes fp16/fp16, bf16/bf16, fp32/fp32, fp16/fp32, bf16/fp32.
* ``npu_add_rms_norm(x1, x2, gamma, epsilon) -> (y, rstd, x1 + x2)``; gamma has x1's dtype; it
  normalises the unrounded fp32 sum.

* ``npu_mrope(positions, q, k, cos_sin_cache, head_size, mrope_section=[0,0,0], rotary_mode)``: cos/sin
  gathered by 1-D positions, q/k ``[T, heads*head_size]``, cache in q's dtype, rounded once (assumed).

* ``npu_swiglu(x, dim=-1)``: ``silu(A)·B`` over the halves of x (A first), after one GEMM over the
  gate|up weights concatenated once per weight pair.

So the NPU result can differ from the HF ``llama`` order (round ``n``, then multiply) by one bf16/fp16
ulp; calls whose output dtype or gamma dtype the ops cannot produce are declined (reference runs).
"""
