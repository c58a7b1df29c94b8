"""Quant: rewrite each routed-expert block to W8A8 int8 (``quant="w8a8_int8"``) or FP8 (``quant="fp8_block"``).

Runs after EP and before expand. Each ``ep_fuse::moe_experts(x, ids, w, w13, w2, out_dtype)`` becomes
``ep_fuse::moe_experts_w8a8(x, ids, w, w13_q, w13_scale, w2_q, w2_scale, out_dtype)``
(:mod:`ep_fuse.ops.w8a8`), which expand turns into ``moe_permute -> quant_per_token ->
grouped_gemm_w8a8_swiglu_quant -> grouped_gemm_w8a8 -> moe_unpermute``. Dense layers are untouched.

Where the int8 weights come from:

* **Already-quantized models** (used as they are, nothing is made at compile time): the expert weight
  the block reads is a dequantization ``q * s`` of an int8 tensor ``q`` [E, N, K] by a per-output-channel
  scale ``s`` ([E, N, 1], or ``s.unsqueeze(-1)`` of [E, N]), optionally with dtype casts around either
  operand or the product. The accepted module convention (see ``tests/test_w8a8.py::Int8Experts``)::

      gate_up_proj int8 [E, 2I, H], gate_up_proj_scale fp32 [E, 2I]   (gate rows, then up rows)
      down_proj    int8 [E, H, I],  down_proj_scale    fp32 [E, H]
      w13 = self.gate_up_proj.to(x.dtype) * self.gate_up_proj_scale.unsqueeze(-1).to(x.dtype)

  (int8 parameters with ``requires_grad=False`` or buffers; any routing/combine form the
  ``moe_experts`` pattern matches).
* **Everything else**: the weight's real value is computed from the graph's *static* inputs
  (parameters and buffers; :attr:`PassContext.inputs`, filled by the backend from Dynamo's example
  inputs) and quantized per output channel (:func:`ep_fuse.ops.w8a8.quantize_weight`) once:
  the result is cached by a weak reference to the source parameter(s) plus their ``_version``, so a
  recompile (or a second graph over the same weights) reuses it and an in-place weight update
  requantizes. The codes and scales enter the graph as constants (``get_attr`` of non-persistent
  buffers of the GraphModule): the eager executor reads them, Inductor (which then compiles behind
  AOT's wrapper: :func:`ep_fuse.backend._not_direct` refuses graphs with constants) embeds them.

A block whose weights depend on activations, or whose weights the backend could not see (e.g.
``run_passes`` called without inputs), is left in bf16 with a warning.

**FP8** (``quant="fp8_block"``): each block becomes ``ep_fuse::moe_experts_fp8(x, ids, w, w13_q,
w13_scale, w2_q, w2_scale, block_n, block_k, out_dtype)`` (:mod:`ep_fuse.ops.fp8`), expanded into
``moe_permute_fp8 -> grouped_gemm_fp8_swiglu_quant -> grouped_gemm_fp8 -> moe_unpermute``. Weights
that are ``ep_fuse::fp8_block_dequant(q, scale_inv, bn, bk, dtype)`` of an fp8 tensor (what
:func:`ep_fuse.prepare` emits for transformers' ``FP8Experts``, optionally behind casts) are used as
they are, with their own block; every other weight is evaluated from the static inputs as above and
quantized once to E4M3 with 128 x 128 block scales
(:func:`ep_fuse.ops.fp8.quantize_weight_fp8`). Both weights of a block must share one
block shape (the activation group is its ``block_k``); otherwise the block stays unquantized. On CUDA, bf16
weights are quantized only where the FP8 experts measured faster (:func:`ep_fuse.providers.triton.perf.
fp8_block_quant_rule`). Behind an ``all_to_all`` or DeepEP-normal EP dispatch the activation quantization moves
before the dispatch (:func:`_fp8_dispatch`: fp8 codes + scales on the wire) and the block becomes
``moe_experts_fp8_q`` on the received codes and scales.
"""

from __future__ import annotations

import logging
import operator
import threading
from typing import Any

import torch
from torch import fx
from torch.utils.weak import WeakIdKeyDictionary

from ep_fuse.ops import ep as ep_ops
from ep_fuse.ops import fp8 as fp8_ops
from ep_fuse.ops import moe as moe_ops
from ep_fuse.ops import w8a8 as w8a8_ops
from ep_fuse.ops.fp8 import BLOCK, FP8, cdiv, quantize_weight_fp8
from ep_fuse.ops.w8a8 import quantize_weight
from ep_fuse.passes.base import GraphPass, PassContext

log = logging.getLogger("ep_fuse.passes.quant")

aten = torch.ops.aten
_CASTS = {aten._to_copy.default, torch.ops.prims.convert_element_type.default}
_MAX_CHAIN = 16
"""At most this many ops between a parameter and the expert weight that is evaluated at compile time."""


class _WeightCache:
    """Codes + scales per source weight and format, held by weak reference to the source tensor(s)."""

    def __init__(self) -> None:
        self._entries: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._lock = threading.Lock()
        self.quantized = 0
        """How many weights were quantized (tests check a recompile adds none)."""

    def get(self, sources: list[torch.Tensor], chain: tuple[Any, ...], value: torch.Tensor, fmt: str = "int8"
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """``fmt``: ``"int8"`` (per output channel) or ``"fp8_block"`` (E4M3, 128 x 128 blocks)."""
        key = sources[0]
        sig = (fmt, chain, tuple(id(s) for s in sources[1:]))
        versions = tuple(s._version for s in sources)
        with self._lock:
            per_source = self._entries.get(key)
            if per_source is None:
                per_source = {}
                self._entries[key] = per_source
            hit = per_source.get(sig)
            if hit is not None and hit[0] == versions:
                return hit[1], hit[2]
        with torch.no_grad():
            q, s = quantize_weight_fp8(value.detach(), BLOCK) if fmt == "fp8_block" else quantize_weight(value.detach())
        with self._lock:
            per_source[sig] = (versions, q, s)
            self.quantized += 1
        log.info("ep_fuse: quantized expert weight %s %s to %s", tuple(value.shape), value.dtype,
                 "fp8 e4m3 (128x128 block scales)" if fmt == "fp8_block" else "int8 (per-channel scales)")
        return q, s

    def clear(self) -> None:
        with self._lock:
            self._entries = WeakIdKeyDictionary()
            self.quantized = 0

    def __len__(self) -> int:
        return sum(len(v) for v in self._entries.values())


WEIGHT_CACHE = _WeightCache()


class QuantizeExperts(GraphPass):
    name = "quant"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        if ctx.config.quant is None:
            return 0

        block = moe_ops.moe_experts.op
        fp8 = ctx.config.quant == "fp8_block"
        target = fp8_ops.moe_experts_fp8.op if fp8 else w8a8_ops.moe_experts_w8a8.op
        changes = 0
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target is not block:
                continue
            x, ids, w, w13, w2, out_dtype = node.args
            with gm.graph.inserting_before(node):
                if fp8:
                    align = _fp8_align(ctx, node, w13, w2)
                    found = _fp8_weights(gm, ctx, node, w13, w2, deepgemm=align > 1)
                    if found is None:
                        continue
                    (q13, s13), (q2, s2), (bn, bk) = found
                    sent = _fp8_dispatch(gm, ctx, node, bk)
                    if sent is not None:  # the block on the received codes and scales
                        xq, xs, act_dtype = sent
                        new = gm.graph.call_function(fp8_ops.moe_experts_fp8_q.op,
                                                     (xq, xs, ids, w, q13, s13, q2, s2, bn, bk, act_dtype,
                                                      out_dtype))
                    else:
                        from ep_fuse.providers.deepgemm.fp8 import BLOCK as DG

                        extra = (align,) if align > 1 and (bn, bk) == (DG, DG) else ()
                        new = gm.graph.call_function(target, (x, ids, w, q13, s13, q2, s2, bn, bk, out_dtype, *extra))
                else:
                    q13 = _int8_weight(gm, ctx, w13, node, "w13")
                    q2 = _int8_weight(gm, ctx, w2, node, "w2") if q13 is not None else None
                    if q13 is None or q2 is None:
                        continue
                    new = gm.graph.call_function(target, (x, ids, w, q13[0], q13[1], q2[0], q2[1], out_dtype))
            new.meta.update(node.meta)
            for rec in ctx.report.ep:
                if rec.block == node.name:
                    rec.block = new.name
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            if node.name in ctx.match_by_node:
                ctx.match_by_node[new.name] = ctx.match_by_node.pop(node.name)
            changes += 1
        if changes:
            gm.graph.eliminate_dead_code()
            gm.recompile()
            if fp8:
                _warn_fp8_reference(ctx.device)
        return changes


FP8_DISPATCH = True
"""Quantize before an ``all_to_all`` EP dispatch under ``quant="fp8_block"`` (tests turn it off to compare)."""

FP8_DISPATCH_BACKENDS = ("all_to_all", "deepep")
"""Dispatch engines that move rows of any element size bit for bit: ``all_to_all``'s packed rows take 1-byte
elements, and DeepEP's normal (intranode) dispatch copies rows as 16-byte words whatever their dtype (its host
checks: 2-D, contiguous, ``H * element_size % 16 == 0``; DeepEP V1 ``csrc/deep_ep.cpp``), so the codes + scales
row crosses it as one uint8 row, the same bytes its own ``(x_fp8, x_scales)`` form would send. The
``expert``-layout engines (DeepEP low-latency, Ascend) have their own row formats, and ``symm_mem`` checks bf16
tokens."""

def _fp8_dispatch(gm: fx.GraphModule, ctx: PassContext, block: fx.Node, bk: int
                  ) -> tuple[fx.Node, fx.Node, torch.dtype] | None:
    """Move the 1 x ``bk`` activation quantization of an FP8 block before its EP dispatch.

    ``recv_x = ep_dispatch(x, ...)[0]`` feeding ``block`` becomes ``ep_dispatch(cat(codes, scales as
    bytes), ...)[0]``: each token crosses the wire as ``H`` fp8 bytes + ``4 * ceil(H / bk)`` scale bytes
    instead of ``2H`` (bf16), and the receiver's rows are the codes and scales the block would have computed
    itself (the quantization is per token, so the result is bit for bit the same). Returns ``(received codes,
    received scales, the tokens' dtype)``, or ``None`` when the dispatch is not one this applies to."""
    from ep_fuse.ep.deepep import ROW_BYTES
    from ep_fuse.fx_utils import val
    from ep_fuse.providers.triton.unverified import cleared

    recv = block.args[0]
    d = _dispatch_of(recv) if FP8_DISPATCH else None
    if d is None:
        return None
    x, backend, layout = d.args[0], d.args[5], d.args[6]
    xv = val(x)
    static_width = isinstance(xv, torch.Tensor) and xv.dim() == 2 and isinstance(xv.shape[1], int)
    h = int(xv.shape[1]) if static_width else 0
    ng = cdiv(h, bk)
    row_bytes = h + 4 * ng  # the codes, then the fp32 scales
    why = None
    if ctx.device == "cuda" and not cleared("ep:fp8_dispatch"):
        why = "FP8 dispatch has not run over NCCL yet (ep:fp8_dispatch in providers/triton/unverified.py)"
    elif backend not in FP8_DISPATCH_BACKENDS or layout != "rank":
        why = (f"the {backend} dispatch sends the tokens as they are (FP8 dispatch: "
               f"{', '.join(FP8_DISPATCH_BACKENDS)})")
    elif not static_width or h % 4:
        why = "the token width is not a static multiple of 4 (the scales must start 4-byte aligned)"
    elif backend == "deepep" and row_bytes % ROW_BYTES:
        why = f"DeepEP moves rows in {ROW_BYTES}-byte words and the codes + scales row of {row_bytes} bytes is not"
    elif len(recv.users) != 1:
        why = "the received tokens have other users than the block"
    if why is not None:
        log.info("ep_fuse: quant: %s: bf16 dispatch: %s", block.name, why)
        return None
    graph = gm.graph
    with graph.inserting_before(d):
        qn = _call(ctx, gm, fp8_ops.quant_fp8_group.op, (x, bk))
        as_bytes = [_call(ctx, gm, aten.view.dtype, (_call(ctx, gm, operator.getitem, (qn, i)), torch.uint8))
                    for i in range(2)]
        packed = _call(ctx, gm, aten.cat.default, (as_bytes, 1))
    d.args = (packed, *d.args[1:])
    with _fake_mode(ctx):  # the dispatch and its outputs, now over the packed rows
        d.meta["val"] = d.target(*fx.node.map_arg(d.args, val))
        for out in d.users:
            out.meta["val"] = d.meta["val"][out.args[1]]
    with graph.inserting_before(block):
        rcodes, rscales = (_call(ctx, gm, aten.view.dtype, (_call(ctx, gm, aten.slice.Tensor, (recv, 1, lo, hi)), dt))
                           for lo, hi, dt in ((0, h, FP8), (h, row_bytes, torch.float32)))
    for rec in ctx.report.ep:
        if rec.block == block.name:
            rec.payload = f"fp8 e4m3 + 1x{bk} fp32 scales"
    log.info("ep_fuse: quant: %s: the %s dispatch sends fp8 codes + 1x%d scales (%d + %d bytes per token, "
             "bf16 would be %d)", block.name, backend, bk, h, 4 * ng, 2 * h)
    return rcodes, rscales, xv.dtype


def _warn_fp8_reference(device: str) -> None:
    """Say once per graph when the FP8 expert GEMMs will run the pure-torch reference."""
    from ep_fuse.providers.triton.unverified import ENV, cleared

    if device == "cuda" and not cleared("fp8:triton"):
        log.warning("ep_fuse: quant='fp8_block' on CUDA: the Triton FP8 kernels are not cleared for GPUs (%s=1 "
                    "enables them); the FP8 experts run the pure-torch reference (fp32 dequantize + matmul per "
                    "expert), which is correct but SLOW", ENV)
    elif device == "npu":
        log.warning("ep_fuse: quant='fp8_block' on Ascend: torch_npu documents no FP8 grouped matmul for Atlas "
                    "A2/A3 (docs/npu.md); the FP8 experts run the pure-torch reference, unverified on an NPU "
                    "(use quant='w8a8_int8' there)")


# --------------------------------------------------------------------------- weights
def _int8_weight(gm: fx.GraphModule, ctx: PassContext, weight: fx.Node, block: fx.Node, label: str
                 ) -> tuple[fx.Node, fx.Node] | None:
    """``(codes node int8 [E, N, K], scale node fp32 [E, N])`` for an expert weight node, or ``None``."""
    pre = _prequantized(gm, ctx, weight)
    if pre is not None:
        log.info("ep_fuse: %s at %s: using the model's int8 %s and its scales", block.name, weight.name, label)
        return pre
    return _quantized_parameters(gm, ctx, weight, block, label, "int8", ("q", "scale"))


def _quantized_parameters(gm: fx.GraphModule, ctx: PassContext, weight: fx.Node, block: fx.Node, label: str,
                          fmt: str, suffixes: tuple[str, str]) -> tuple[fx.Node, fx.Node] | None:
    """``(codes, scales)`` constant nodes of ``weight`` evaluated from the parameters it is computed from and
    quantized once in ``fmt`` (cached per source tensors), or ``None`` when it is not computed from parameters."""
    sources: list[torch.Tensor] = []
    chain: list[Any] = []
    value = _evaluate(gm, ctx, weight, sources, chain, 0)
    if value is None or not sources:
        log.warning("ep_fuse: quant: %s at %s: %s is not computed from parameters the backend can read "
                    "(pass the model's weights as parameters or buffers); the block stays unquantized",
                    block.name, weight.name, label)
        return None
    q, s = WEIGHT_CACHE.get(sources, tuple(chain), value, fmt)
    return _constant(gm, ctx, q, f"{label}_{suffixes[0]}"), _constant(gm, ctx, s, f"{label}_{suffixes[1]}")


def _fp8_align(ctx: PassContext, block: fx.Node, w13: fx.Node, w2: fx.Node) -> int:
    """The permuted layout's alignment for an FP8 block (:func:`ep_fuse.providers.deepgemm.align_for`: 128 where
    DeepGEMM takes its GEMMs, else 1). Behind an EP dispatch the block keeps 1."""
    if ctx.device != "cuda" or _dispatch_of(block.args[0]) is not None:
        return 1
    from ep_fuse.providers.deepgemm.fp8 import align_for

    x, ids, a13, a2 = (_val(a) for a in (block.args[0], block.args[1], w13, w2))
    if not isinstance(ids, torch.Tensor):
        return 1
    return align_for(x, int(ids.shape[-1]), a13, a2)


def _fp8_weights(gm: fx.GraphModule, ctx: PassContext, block: fx.Node, w13: fx.Node, w2: fx.Node,
                 deepgemm: bool = False
                 ) -> tuple[tuple[fx.Node, fx.Node], tuple[fx.Node, fx.Node], tuple[int, int]] | None:
    """``((w13 codes, scales), (w2 codes, scales), (block_n, block_k))`` of a block, or ``None`` (left as is)."""
    pre = {label: _fp8_prequantized(gm, ctx, wt) for label, wt in (("w13", w13), ("w2", w2))}
    shapes = {p[2] for p in pre.values() if p is not None}
    if len(shapes) > 1:
        log.warning("ep_fuse: quant: %s: the model's fp8 w13 and w2 have different blocks %s; the block stays "
                    "unquantized (the activation group must be one block_k)", block.name, sorted(shapes))
        return None
    bn, bk = shapes.pop() if shapes else BLOCK
    if ctx.device == "cuda" and ctx.config.perf_guard and any(p is None for p in pre.values()):
        reason = _fp8_not_faster(block, w13, deepgemm)
        if reason is not None:
            log.info("ep_fuse: quant: %s stays bf16: %s", block.name, reason)
            for match in ctx.match_by_node.get(block.name, []):
                match.declined.append(("quant fp8_block", reason))
            return None
    out = []
    for label, wt in (("w13", w13), ("w2", w2)):
        if pre[label] is not None:
            log.info("ep_fuse: %s at %s: using the model's fp8 %s and its block scales", block.name, wt.name, label)
            out.append(pre[label][:2])
            continue
        if (bn, bk) != BLOCK:
            log.warning("ep_fuse: quant: %s: %s is not fp8 while the other weight has %sx%s blocks; the block stays "
                        "unquantized", block.name, label, bn, bk)
            return None
        made = _quantized_parameters(gm, ctx, wt, block, label, "fp8_block", ("fp8", "fp8_scale"))
        if made is None:
            return None
        out.append(made)
    return out[0], out[1], (bn, bk)


def _fp8_not_faster(block: fx.Node, w13: fx.Node, deepgemm: bool = False) -> str | None:
    """The measured rule (:func:`ep_fuse.providers.triton.perf.fp8_block_quant_rule`) for a block that would
    quantize bf16 weights on CUDA. Behind an EP dispatch the block's input is the receive buffer (a row per
    token and destination, padded to the capacity), whose rows x top-k overcount the rows its local experts
    get; the rule then counts the tokens this rank sends instead: with ranks sending alike, each rank's experts
    receive ``T * k`` rows in all, ``T * k / E_local`` each."""
    from ep_fuse.providers.triton.fp8 import fp8_block_quant_rule

    x_node, ids_node = block.args[:2]
    sent = _dispatch_of(x_node)
    if sent is not None:
        x_node, ids_node = sent.args[0], sent.args[1]
    x, ids = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in (x_node, ids_node))
    weight = w13.meta.get("val") if isinstance(w13, fx.Node) else None
    if x is None or ids is None or weight is None:
        return "the block's shapes are unknown"
    return fp8_block_quant_rule(x, int(ids.shape[-1]), int(weight.shape[0]), deepgemm)


def _dispatch_of(recv: Any) -> fx.Node | None:
    """The ``ep_dispatch`` node whose received tokens (output 0) ``recv`` is, else ``None``."""

    if not (isinstance(recv, fx.Node) and recv.target is operator.getitem and recv.args[1] == 0):
        return None
    d = recv.args[0]
    return d if isinstance(d, fx.Node) and d.target is ep_ops.ep_dispatch.op else None


def _fp8_prequantized(gm: fx.GraphModule, ctx: PassContext, weight: fx.Node
                      ) -> tuple[fx.Node, fx.Node, tuple[int, int]] | None:
    """``(codes, fp32 scales, (bn, bk))`` when ``weight`` is ``[cast](fp8_block_dequant(q fp8 [E,N,K], s, bn, bk))``
    with ``s`` [E, ceil(N/bn), ceil(K/bk)] (fp32, or another float dtype cast to fp32 in the graph)."""

    w = _strip_casts(weight)
    if not (isinstance(w, fx.Node) and w.op == "call_function" and w.target is fp8_ops.fp8_block_dequant.op):
        return None
    q, s, bn, bk = w.args[:4]
    qv, sv = _val(q), _val(s)
    if not (isinstance(qv, torch.Tensor) and isinstance(sv, torch.Tensor)) or qv.dtype != FP8 or qv.dim() != 3:
        return None
    if not (isinstance(bn, int) and isinstance(bk, int) and bn > 0 and bk > 0):
        return None
    e, n, k = qv.shape
    if tuple(sv.shape) != (e, cdiv(n, bn), cdiv(k, bk)) or not sv.dtype.is_floating_point:
        return None
    if sv.dtype != torch.float32:
        s = _call(ctx, gm, aten._to_copy.default, (s,), {"dtype": torch.float32})
    return q, s, (bn, bk)


def _evaluate(gm: fx.GraphModule, ctx: PassContext, node: Any, sources: list[torch.Tensor], chain: list[Any],
              depth: int) -> Any:
    """The real value of ``node`` from static inputs and constants only (``None`` if it needs anything else)."""
    if not isinstance(node, fx.Node):
        return node
    if depth > _MAX_CHAIN:
        return None
    if node.op == "placeholder":
        t = ctx.inputs.get(node.name)
        if isinstance(t, torch.Tensor):
            sources.append(t)
            chain.append(("input", node.name))
        return t
    if node.op == "get_attr":
        t = getattr(gm, str(node.target), None)
        if isinstance(t, torch.Tensor):
            sources.append(t)
            chain.append(("attr", node.target))
        return t
    if node.op != "call_function":
        return None
    missing = False

    def ev(a: Any) -> Any:
        nonlocal missing
        v = _evaluate(gm, ctx, a, sources, chain, depth + 1)
        missing |= v is None
        return v

    args = fx.node.map_aggregate(node.args, ev)
    kwargs = fx.node.map_aggregate(node.kwargs, ev)
    if missing:
        return None
    chain.append((str(node.target), tuple(a for a in node.args if not isinstance(a, fx.Node))))
    with torch.no_grad():
        return node.target(*args, **kwargs)


def _strip_casts(node: Any) -> Any:
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _CASTS:
        node = node.args[0]
    return node


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _prequantized(gm: fx.GraphModule, ctx: PassContext, weight: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """Match ``[cast](mul([cast](q int8 [E,N,K]), [cast](s [E,N,1] | unsqueeze(s [E,N], -1))))``."""
    w = _strip_casts(weight)
    if not (isinstance(w, fx.Node) and w.op == "call_function" and w.target is aten.mul.Tensor):
        return None
    wv = _val(weight)
    for a, b in (w.args, tuple(reversed(w.args))):
        q, s = _strip_casts(a), _strip_casts(b)
        qv, sv = _val(q), _val(s)
        if not (isinstance(qv, torch.Tensor) and isinstance(sv, torch.Tensor)) or qv.dtype != torch.int8:
            continue
        if wv is None or qv.dim() != 3 or tuple(qv.shape) != tuple(wv.shape):
            continue
        e, n = qv.shape[0], qv.shape[1]
        if (isinstance(s, fx.Node) and s.op == "call_function" and s.target is aten.unsqueeze.default
                and s.args[1] in (-1, 2)):
            base = _strip_casts(s.args[0])
            if tuple(_val(base).shape) == (e, n):
                s, sv = base, _val(base)
        if tuple(sv.shape) == (e, n, 1):
            s = _call(ctx, gm, aten.view.default, (s, [e, n]))
            sv = _val(s)
        if tuple(sv.shape) != (e, n) or not sv.dtype.is_floating_point:
            continue
        if sv.dtype != torch.float32:
            s = _call(ctx, gm, aten._to_copy.default, (s,), {"dtype": torch.float32})
        return q, s
    return None


def _fake_mode(ctx: PassContext) -> Any:
    if ctx.fake_mode is not None:
        return ctx.fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    ctx.fake_mode = FakeTensorMode()
    return ctx.fake_mode


def _call(ctx: PassContext, gm: fx.GraphModule, target: Any, args: tuple[Any, ...],
          kwargs: dict[str, Any] | None = None) -> fx.Node:
    node = gm.graph.call_function(target, args, kwargs or {})
    fakes = fx.node.map_arg(args, lambda a: a.meta["val"])
    with _fake_mode(ctx):
        node.meta["val"] = target(*fakes, **(kwargs or {}))
    return node


def _constant(gm: fx.GraphModule, ctx: PassContext, t: torch.Tensor, label: str) -> fx.Node:
    """A ``get_attr`` node for ``t``, a non-persistent buffer of ``gm`` (Inductor's AOT re-trace lifts
    buffers to inputs; a plain tensor attribute would reach its fake-tensor trace as a real tensor)."""
    i = 0
    while hasattr(gm, f"_ep_fuse_quant_{label}_{i}"):
        i += 1
    name = f"_ep_fuse_quant_{label}_{i}"
    gm.register_buffer(name, t, persistent=False)
    node = gm.graph.get_attr(name)
    node.meta["val"] = _fake_mode(ctx).from_tensor(t, static_shapes=True)
    return node
