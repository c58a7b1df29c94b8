"""Triton kernel for router gating: softmax/sigmoid/sqrt(softplus)/top-k-then-softmax/sigmoid, selection bias,
group-limited top-k (masked experts at -inf or 0.0), renorm (``+ eps`` or ``clamp(min=eps)``), scale, per-expert
scale; and Inkling's shared-expert sink router (``_sink_kernel``).

One program handles ``BLOCK_T`` tokens; a token's ``E`` logits sit in registers (``BLOCK_E`` =
next power of two), are upcast to fp32 right after the load, and never leave the chip until the
``[T, K]`` weights and ids are stored. Every top-k is an unrolled loop of arg-max steps in which the
**lowest index wins among equal values** (a max, then a min over the indices that reach it), i.e. a
stable descending top-k -- the tie order of ``npu_moe_gating_top_k`` and of
:func:`ep_fuse.ops.moe_gating.moe_gating_stable_ref`. Only Triton 3.x core ops are used
(``max``/``min``/``maximum``/``sum``/``where``/``exp``/``static_range``), nothing newer than Triton 3.6 offers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ep_fuse.providers.triton.jit_helpers import DTYPE_CODES, INTERPRET, for_store

SCORES = {"softmax": 0, "sigmoid": 1, "topk_softmax": 2, "topk_sigmoid": 3, "sqrt_softplus": 4}
GROUP_SCORES = {"none": 0, "max": 1, "sum_top2": 2, "sum_top2_fill0": 3}


@triton.jit
def _argmax_lowest(vals, taken, cols, BIG: tl.constexpr):
    """Per row: (best value, lowest column reaching it) among the columns not yet ``taken``."""
    cand = tl.where(taken, float("-inf"), vals)
    best = tl.max(cand, axis=1)
    idx = tl.min(tl.where((~taken) & (cand == best[:, None]), cols, BIG), axis=1)
    return best, idx


@triton.jit
def _sqrt_softplus(x):
    """``sqrt(softplus(x))`` as torch computes softplus (``x`` above 20, else ``log1p(exp(x))``); ``log1p`` by
    Goldberg's ``u * log(1 + u) / ((1 + u) - 1)``, exact to a few ulps where ``1 + u`` rounds."""
    u = tl.exp(tl.minimum(x, 20.0))
    v = 1.0 + u
    lp = tl.where(v == 1.0, u, tl.log(v) * (u / tl.where(v == 1.0, 1.0, v - 1.0)))
    return tl.sqrt(tl.where(x > 20.0, x, lp))


@triton.jit
def _gating_kernel(
    L, B, S, W, I, T, E, stride_l, eps, scale,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP: tl.constexpr, N_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    RENORM: tl.constexpr, HAS_EPS: tl.constexpr, CLAMP: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_ESCALE: tl.constexpr,
    OUT_CODE: tl.constexpr, EMULATE_RTNE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    cols = tl.arange(0, BLOCK_E)[None, :]
    cmask = cols < E
    x = tl.load(L + rows[:, None].to(tl.int64) * stride_l + cols, mask=rmask[:, None] & cmask,
                other=float("-inf")).to(tl.float32)
    x = tl.where(rmask[:, None], x, 0.0)  # rows past T: finite values, never stored
    if SCORE == 0:
        ex = tl.exp(x - tl.max(x, axis=1)[:, None])
        ex = tl.where(cmask, ex, 0.0)
        p = ex / tl.sum(ex, axis=1)[:, None]
    elif SCORE == 1:
        p = 1.0 / (1.0 + tl.exp(-x))
    elif SCORE == 4:
        p = _sqrt_softplus(x)
    else:  # topk_softmax / topk_sigmoid: select on the logits, the score of the K values follows the top-k
        p = x
    sel = p
    if HAS_BIAS:
        sel = p + tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
    src = p
    pad = (cols >= E) | (rows[:, None] < 0)  # [BLOCK_T, BLOCK_E]: padding columns
    if GROUP != 0:
        gcols = tl.arange(0, BLOCK_G)[None, :]
        gid = cols // GROUP_SIZE
        gscore = tl.full([BLOCK_T, BLOCK_G], float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            in_g = (gid == g) & cmask
            first, i1 = _argmax_lowest(sel, pad | ~in_g, cols, BLOCK_E)
            s = first
            if GROUP >= 2:  # sum of the two largest values of the group
                second, _i2 = _argmax_lowest(sel, pad | ~in_g | (cols == i1[:, None]), cols, BLOCK_E)
                s = first + second
            gscore = tl.where(gcols == g, s[:, None], gscore)
        gtaken = (gcols >= N_GROUP) | (rows[:, None] < 0)
        picked = (gcols < 0) | (rows[:, None] < 0)
        for j in tl.static_range(TOPK_GROUP):
            _best, gi = _argmax_lowest(gscore, gtaken, gcols, BLOCK_G)
            hit = gcols == gi[:, None]
            gtaken = gtaken | hit
            picked = picked | hit
        keep = (cols < 0) | (rows[:, None] < 0)
        for g in tl.static_range(N_GROUP):
            kept_g = tl.sum(tl.where((gcols == g) & picked, 1, 0), axis=1) > 0
            keep = keep | ((gid == g) & kept_g[:, None])
        if GROUP == 2:
            sel = tl.where(keep, sel, float("-inf"))
        elif GROUP == 3:  # DeepSeek-V3 remote code: masked experts compete at 0.0, weights stay the scores
            sel = tl.where(keep, sel, 0.0)
        else:
            sel = tl.where(keep, sel, 0.0)
            if HAS_BIAS:
                src = tl.where(keep, p, 0.0)
            else:
                src = sel
    kcols = tl.arange(0, BLOCK_K)[None, :]
    w = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int64)
    total = tl.zeros([BLOCK_T], tl.float32)
    taken = pad
    for j in tl.static_range(K):
        _best, idx = _argmax_lowest(sel, taken, cols, BLOCK_E)
        hit = cols == idx[:, None]
        wj = tl.sum(tl.where(hit, src, 0.0), axis=1)
        taken = taken | hit
        total = total + wj  # slot order, as the reference's row sum
        w = tl.where(kcols == j, wj[:, None], w)
        ids = tl.where(kcols == j, idx[:, None].to(tl.int64), ids)
    if SCORE == 2:
        kmask = kcols < K
        ex = tl.where(kmask, tl.exp(w - tl.max(tl.where(kmask, w, float("-inf")), axis=1)[:, None]), 0.0)
        w = ex / tl.sum(ex, axis=1)[:, None]
        total = tl.sum(w, axis=1)
    elif SCORE == 3:
        w = tl.where(kcols < K, 1.0 / (1.0 + tl.exp(-w)), 0.0)
        total = tl.sum(w, axis=1)
    if RENORM:
        if CLAMP:
            total = tl.maximum(total, eps)
        elif HAS_EPS:
            total = total + eps
        w = w / total[:, None]
    if HAS_SCALE:
        w = w * scale
    omask = rmask[:, None] & (kcols < K)
    if HAS_ESCALE:  # Gemma-4's ``per_expert_scale[ids]``, after the renormalisation and the scale
        w = w * tl.load(S + ids, mask=omask, other=0.0).to(tl.float32)
    out = rows[:, None].to(tl.int64) * K + kcols
    tl.store(W + out, for_store(w, OUT_CODE, EMULATE_RTNE), mask=omask)
    tl.store(I + out, ids, mask=omask)


def launch(logits, bias, weights, ids, top_k, score, n_group, topk_group, group_score, renormalize, renorm_eps,
           scale, renorm_clamp=False, expert_scale=None, wrap=None) -> None:  # noqa: ANN001 - tensors, schema scalars
    """Launch the gating kernel writing ``weights`` and ``ids`` (both contiguous [T, K])."""
    t, e = logits.shape
    block_e = triton.next_power_of_2(int(e))
    block_t = max(1, min(16, 2048 // block_e))
    kernel = wrap(_gating_kernel) if wrap is not None else _gating_kernel
    grouped = group_score != "none"
    kernel[(triton.cdiv(t, block_t),)](
        logits, bias if bias is not None else logits, expert_scale if expert_scale is not None else logits,
        weights, ids, t, e, logits.stride(0),
        float(renorm_eps), float(scale),
        K=int(top_k), BLOCK_K=triton.next_power_of_2(int(top_k)), BLOCK_T=block_t, BLOCK_E=block_e,
        SCORE=SCORES[score], HAS_BIAS=bias is not None, GROUP=GROUP_SCORES[group_score],
        N_GROUP=int(n_group) if grouped else 1, GROUP_SIZE=int(e) // int(n_group) if grouped else int(e),
        TOPK_GROUP=int(topk_group) if grouped else 1,
        BLOCK_G=triton.next_power_of_2(int(n_group)) if grouped else 1,
        RENORM=bool(renormalize), HAS_EPS=float(renorm_eps) != 0.0, CLAMP=bool(renorm_clamp), HAS_SCALE=float(scale) != 1.0,
        HAS_ESCALE=expert_scale is not None,
        OUT_CODE=DTYPE_CODES[weights.dtype], EMULATE_RTNE=1 if INTERPRET else 2, num_warps=4,
    )


@triton.jit
def _sink_kernel(
    L, B, G, W, I, T, E, C, stride_l, scale,
    K: tl.constexpr, S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_O: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_GSCALE: tl.constexpr,
    OUT_CODE: tl.constexpr, EMULATE_RTNE: tl.constexpr,
):
    """Inkling's sink router (:func:`ep_fuse.ops.moe_gating.moe_gating_sink_stable_ref`): a row's ``C = E + S``
    logits in registers; stable top-k of ``sigmoid + bias`` over the ``E`` routed columns; the K chosen and the S
    shared logits normalised as ``exp(ls - logsumexp(ls))``, ``ls = logsigmoid``; weights ``[T, K + S]``."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    cols = tl.arange(0, BLOCK_C)[None, :]
    x = tl.load(L + rows[:, None].to(tl.int64) * stride_l + cols, mask=rmask[:, None] & (cols < C),
                other=0.0).to(tl.float32)
    x = tl.where(rmask[:, None], x, 0.0)
    routed = cols < E
    sel = 1.0 / (1.0 + tl.exp(-x))
    if HAS_BIAS:
        sel = sel + tl.load(B + cols, mask=routed, other=0.0).to(tl.float32)
    taken = (~routed) | (rows[:, None] < 0)
    ocols = tl.arange(0, BLOCK_O)[None, :]
    kcols = tl.arange(0, BLOCK_K)[None, :]
    v = tl.zeros([BLOCK_T, BLOCK_O], tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int64)
    for j in tl.static_range(K):
        _best, idx = _argmax_lowest(sel, taken, cols, BLOCK_C)
        hit = cols == idx[:, None]
        taken = taken | hit
        v = tl.where(ocols == j, tl.sum(tl.where(hit, x, 0.0), axis=1)[:, None], v)
        ids = tl.where(kcols == j, idx[:, None].to(tl.int64), ids)
    for s in tl.static_range(S):
        v = tl.where(ocols == K + s, tl.sum(tl.where(cols == E + s, x, 0.0), axis=1)[:, None], v)
    live = ocols < K + S
    # logsigmoid(v) = min(v, 0) - log1p(exp(-|v|)); log1p by Goldberg's u * log(1 + u) / ((1 + u) - 1)
    u = tl.exp(-tl.abs(v))
    one_u = 1.0 + u
    lp = tl.where(one_u == 1.0, u, tl.log(one_u) * (u / tl.where(one_u == 1.0, 1.0, one_u - 1.0)))
    ls = tl.where(live, tl.minimum(v, 0.0) - lp, float("-inf"))
    m = tl.max(ls, axis=1)
    lse = m + tl.log(tl.sum(tl.where(live, tl.exp(ls - m[:, None]), 0.0), axis=1))
    w = tl.exp(ls - lse[:, None])
    if HAS_SCALE:
        w = w * scale
    if HAS_GSCALE:
        w = w * tl.load(G).to(tl.float32)
    wmask = rmask[:, None] & live
    tl.store(W + rows[:, None].to(tl.int64) * (K + S) + ocols, for_store(w, OUT_CODE, EMULATE_RTNE), mask=wmask)
    tl.store(I + rows[:, None].to(tl.int64) * K + kcols, ids, mask=rmask[:, None] & (kcols < K))


def launch_sink(logits, bias, global_scale, weights, ids, top_k, n_shared, scale,
                wrap=None) -> None:  # noqa: ANN001 - tensors, schema scalars
    """Launch the sink router kernel writing ``weights`` [T, K + S] and ``ids`` [T, K] (both contiguous)."""
    t, c = logits.shape
    block_c = triton.next_power_of_2(int(c))
    block_t = max(1, min(16, 2048 // block_c))
    kernel = wrap(_sink_kernel) if wrap is not None else _sink_kernel
    kernel[(triton.cdiv(t, block_t),)](
        logits, bias if bias is not None else logits, global_scale if global_scale is not None else logits,
        weights, ids, t, int(c) - int(n_shared), c, logits.stride(0), float(scale),
        K=int(top_k), S=int(n_shared), BLOCK_T=block_t, BLOCK_C=block_c,
        BLOCK_O=triton.next_power_of_2(int(top_k) + int(n_shared)), BLOCK_K=triton.next_power_of_2(int(top_k)),
        HAS_BIAS=bias is not None, HAS_SCALE=float(scale) != 1.0, HAS_GSCALE=global_scale is not None,
        OUT_CODE=DTYPE_CODES[weights.dtype], EMULATE_RTNE=1 if INTERPRET else 2, num_warps=4,
    )
