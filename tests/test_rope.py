"""RoPE: every traced form on hand-written modules, q/k pairing, look-alikes, kernels vs reference."""


import pytest
import torch
from support.norm_cases import ulp_close
from hypothesis import given, settings
from hypothesis import strategies as st
from support.rope_cache_modules import CacheRope, cache_inputs
from torch import nn

import ep_fuse
from ep_fuse.ops import choose
from ep_fuse.ops import rope as rope_ops
from ep_fuse.ops.rope import rope_qk_ref, rope_ref
from ep_fuse.providers.npu import rope as npu_rope
from ep_fuse.providers.triton import rope as triton_rope
from support.compiling import compile_and_run

BF16 = torch.bfloat16


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rotate_pairs(x):
    """HF GLM / Cohere ``rotate_half``: the GPT-J pairs as a rotated copy of the head."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


class Attn(nn.Module):
    """q/k projections viewed as [B, S, H, D] and transposed to [B, H, S, D], then one RoPE form."""

    def __init__(self, form, d=16, hq=4, hk=2, rot=None):
        super().__init__()
        self.form, self.d, self.hq, self.hk, self.rot = form, d, hq, hk, rot or d
        self.q = nn.Linear(32, hq * d, bias=False)
        self.k = nn.Linear(32, hk * d, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.hq, self.d)
        k = self.k(x).view(b, s, self.hk, self.d)
        if self.form == "complex_bshd":  # Llama4: before the transpose, freqs_cis [1, S, 1, D/2]
            return tuple(self._complex(t, cos.unsqueeze(2)).transpose(1, 2) for t in (q, k))
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        return tuple(self._one(t, cos.unsqueeze(1), None if sin is None else sin.unsqueeze(1)) for t in (q, k))

    def _complex(self, t, f):
        tc = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
        return torch.view_as_real(tc * f).flatten(3).type_as(t)

    def _one(self, t, cos, sin):
        if self.form == "half":
            return t * cos + rotate_half(t) * sin
        if self.form == "partial":
            tr, tp = t[..., : self.rot], t[..., self.rot:]
            return torch.cat((tr * cos + rotate_half(tr) * sin, tp), dim=-1)
        if self.form == "chunk":
            t1, t2 = torch.chunk(t, 2, dim=-1)
            return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), dim=-1)
        if self.form == "deinterleave":
            te, to = t[..., 0::2], t[..., 1::2]
            return torch.cat((te * cos - to * sin, to * cos + te * sin), dim=-1)
        if self.form == "interleave":  # GPT-J
            te, to = t[..., 0::2], t[..., 1::2]
            return torch.stack((te * cos - to * sin, to * cos + te * sin), dim=-1).flatten(-2)
        if self.form == "complex":
            return self._complex(t, cos)
        if self.form.endswith("rotate_pairs"):  # HF GLM: cos[..., :R/2].repeat_interleave(2, -1)
            c = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
            s = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
            if self.form == "rotate_pairs":
                return t * c + rotate_pairs(t) * s
            tr, tp = t[..., : c.shape[-1]], t[..., c.shape[-1]:]
            return torch.cat((tr * c + rotate_pairs(tr) * s, tp), dim=-1)
        raise ValueError(self.form)


def _trig(form, s=7, d=16, rot=None, dtype=BF16):
    rot = rot or d
    g = torch.Generator().manual_seed(3)
    if form.startswith("complex"):
        freqs = torch.randn(1, s, d // 2, generator=g)
        return torch.polar(torch.ones_like(freqs), freqs), None
    full = form in ("half", "partial", "rotate_pairs", "partial_rotate_pairs")  # cat((f, f), -1) layout
    width = rot if full else rot // 2
    ang = torch.randn(1, s, width // 2 if full else width, generator=g)
    if full:
        ang = torch.cat((ang, ang), -1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


FORMS = [("half", "half", None), ("partial", "partial", 8), ("chunk", "chunk", None),
         ("deinterleave", "deinterleave", None), ("interleave", "interleave", None), ("complex", "complex", None),
         ("complex_bshd", "complex", None), ("rotate_pairs", "rotate_pairs", None),
         ("partial_rotate_pairs", "partial_rotate_pairs", 8)]


def _setup(form, rot):
    torch.manual_seed(0)
    mod = Attn(form, rot=rot).to(BF16)
    x = torch.randn(2, 7, 32).to(BF16)
    cos, sin = _trig(form, rot=rot)
    return mod, (x, cos, sin)


@pytest.mark.parametrize("form, variant, rot", FORMS, ids=[f[0] for f in FORMS])
def test_form_matches_pairs_and_is_bitwise_with_reference(form, variant, rot):
    mod, args = _setup(form, rot)
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager", providers={"cpu": ["reference"]})
    rep = ep_fuse.last_report()
    assert [(m.pattern, m.variant) for m in rep.matches] == [("rope", variant)] * 2, rep
    assert rep.ops_after.get("ep_fuse.rope_qk.default") == 1, "q and k run as one call"
    assert rep.ops_after.get("aten.neg.default", 0) == 0 and rep.ops_after.get("aten.view_as_complex.default", 0) == 0
    assert not rep.near_misses
    for o, e in zip(out, ref):
        assert o.stride() == e.stride() and torch.equal(o, e)


@pytest.mark.parametrize("form, variant, rot", FORMS, ids=[f[0] for f in FORMS])
def test_form_with_triton_kernel(form, variant, rot):
    mod, args = _setup(form, rot)
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager")
    rep = ep_fuse.last_report()
    assert {m.provider for m in rep.matches} == {"triton"}
    assert rep.ops_after.get("ep_fuse_triton.rope_qk.default") == 1
    for o, e in zip(out, ref):
        assert o.stride() == e.stride()
        ulp_close(o, e, BF16)


class SwappedRotation(nn.Module):
    """cat(x1, -x2): the opposite rotation; not rotate-half."""

    def forward(self, q, cos, sin):
        h = q.shape[-1] // 2
        return q * cos + torch.cat((q[..., :h], -q[..., h:]), -1) * sin


class UnevenHalves(nn.Module):
    def forward(self, q, cos, sin):
        return q * cos + torch.cat((-q[..., 6:], q[..., :6]), -1) * sin


class CosGrowsTheHeads(nn.Module):
    """cos [2, H, S, D] broadcast against q [1, H, S, D]: the result is bigger than q."""

    def forward(self, q, cos, sin):
        return q * cos + rotate_half(q) * sin


class ChunkWithPlus(nn.Module):
    def forward(self, q, cos, sin):
        q1, q2 = torch.chunk(q, 2, dim=-1)
        return torch.cat((q1 * cos + q2 * sin, q2 * cos + q1 * sin), dim=-1)


@pytest.mark.parametrize(
    "mod, shapes, why",
    [
        (SwappedRotation(), ((1, 2, 5, 16), (1, 1, 5, 16)), "expected aten.neg.default"),
        (UnevenHalves(), ((1, 2, 5, 16), (1, 1, 5, 16)), "halves of 6 do not split 16 channels in two"),
        (CosGrowsTheHeads(), ((1, 2, 5, 16), (2, 2, 5, 16)), "does not broadcast to [1, 2, 5, 16]"),
        (ChunkWithPlus(), ((1, 2, 5, 16), (1, 1, 5, 8)), None),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "",
)
def test_look_alikes_do_not_match(mod, shapes, why):
    q = torch.randn(shapes[0]).to(BF16)
    cos, sin = torch.randn(shapes[1]).to(BF16), torch.randn(shapes[1]).to(BF16)
    with torch.no_grad():
        ref = mod(q, cos, sin)
    out = compile_and_run(mod, q, cos, sin, executor="eager")
    rep = ep_fuse.last_report()
    assert not [m for m in rep.matches if m.pattern == "rope"], rep
    assert torch.equal(out, ref)
    if why:
        text = "\n".join(m.explain() for m in rep.near_misses)
        assert why in text, text


class CohereRope(nn.Module):
    """HF Cohere / Cohere2-MoE: cos/sin of ``repeat_interleave``-d angles (in the rotary module), heads
    upcast to fp32, bf16 cos/sin, the rotated copy ``stack((-x2, x1), -1).flatten(-2)``, one cast back."""

    def __init__(self, d=16):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), persistent=False)

    def forward(self, q, k, pos):
        emb = torch.repeat_interleave(pos[..., None].float() * self.inv_freq, 2, dim=-1)
        cos, sin = (emb.cos() * 1.0).to(q.dtype).unsqueeze(1), (emb.sin() * 1.0).to(q.dtype).unsqueeze(1)
        qf, kf = q.float(), k.float()
        return (qf * cos + rotate_pairs(qf) * sin).to(q.dtype), (kf * cos + rotate_pairs(kf) * sin).to(k.dtype)


def _cohere_args(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 4, 7, 16, generator=g).to(BF16), torch.randn(2, 2, 7, 16, generator=g).to(BF16)
    return q, k, torch.arange(7).expand(2, 7)


def test_rotate_pairs_from_repeated_angles_is_bitwise_eager():
    mod, args = CohereRope(), _cohere_args()
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager", providers={"cpu": ["reference"]})
    rep = ep_fuse.last_report()
    assert [(m.pattern, m.variant) for m in rep.matches] == [("rope", "rotate_pairs")] * 2, rep
    assert rep.ops_after.get("ep_fuse.rope_qk.default") == 1 and rep.ops_after.get("aten.neg.default", 0) == 0
    assert not rep.near_misses
    for o, e in zip(out, ref):
        assert torch.equal(o, e)


class FullWidthCos(nn.Module):
    """The rotated copy with cos/sin given at full width: nothing says cos[2j] == cos[2j+1]."""

    def forward(self, q, cos, sin):
        return q * cos + rotate_pairs(q) * sin


class CatCos(nn.Module):
    """The rotated pairs with a rotate-half cos layout, ``cat((c, c), -1)``: a different rotation."""

    def forward(self, q, cos, sin):
        c, s = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
        return q * torch.cat((c, c), -1) + rotate_pairs(q) * torch.cat((s, s), -1)


class SwappedPairs(nn.Module):
    """``stack((x2, -x1))``: the opposite rotation."""

    def forward(self, q, cos, sin):
        c = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, -1)
        s = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, -1)
        return q * c + torch.stack((q[..., 1::2], -q[..., 0::2]), -1).flatten(-2) * s


@pytest.mark.parametrize("mod, why", [
    (FullWidthCos(), "cos is not provably repeated in pairs: arg1_1 is not computed in the graph"),
    (CatCos(), "cos is not provably repeated in pairs: cat"),
    (SwappedPairs(), "expected aten.neg.default"),
], ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "")
def test_rotate_pairs_look_alikes_do_not_match(mod, why):
    g = torch.Generator().manual_seed(0)
    q, cos, sin = (torch.randn(shape, generator=g).to(BF16) for shape in ((1, 2, 5, 16), (1, 1, 5, 16), (1, 1, 5, 16)))
    with torch.no_grad():
        ref = mod(q, cos, sin)
    out = compile_and_run(mod, q, cos, sin, executor="eager")
    rep = ep_fuse.last_report()
    assert not [m for m in rep.matches if m.pattern == "rope"], rep
    assert torch.equal(out, ref)
    text = "\n".join(m.explain() for m in rep.near_misses)
    assert why in text, text


class ErnieRope(nn.Module):
    """HF Ernie 4.5 / Ernie 4.5-MoE / HY-V4-VL ``apply_rotary_pos_emb`` ("glm rope style (with full dim) and full
    precision"): fp32 cos/sin of ``cat((freqs, freqs))``, ``cos[..., :D/2].repeat_interleave(2)``, each term upcast
    (``q.float() * cos + rotate_half(q).float() * sin``, ``rotate_half`` = the GPT-J pairs), one cast back."""

    def __init__(self, d=16, swap=False, full_cos=False):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), persistent=False)
        self.swap, self.full_cos = swap, full_cos

    def _rot(self, x):
        if self.swap:  # look-alike: stack((x2, -x1)), the opposite rotation
            return torch.stack((x[..., 1::2], -x[..., 0::2]), dim=-1).flatten(-2)
        return rotate_pairs(x)

    def forward(self, q, k, pos):
        freqs = pos[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * 1.0, emb.sin() * 1.0
        original_dtype = q.dtype
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if not self.full_cos:  # look-alike: the rotate-half layout cos used as it is
            cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
            sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
        q_embed = (q.float() * cos) + (self._rot(q).float() * sin)
        k_embed = (k.float() * cos) + (self._rot(k).float() * sin)
        return q_embed.to(original_dtype), k_embed.to(original_dtype)


def _ernie_args(dtype=BF16, transposed=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    if transposed:  # [B, H, S, D] views of the projections' [B, S, H, D]
        q = torch.randn(2, 7, 4, 16, generator=g).to(dtype).transpose(1, 2)
        k = torch.randn(2, 7, 2, 16, generator=g).to(dtype).transpose(1, 2)
    else:
        q, k = torch.randn(2, 4, 7, 16, generator=g).to(dtype), torch.randn(2, 2, 7, 16, generator=g).to(dtype)
    return q, k, torch.arange(7).expand(2, 7)


ERNIE = [(BF16, False, "rotate_pairs_fp32"), (BF16, True, "rotate_pairs_fp32"), (torch.float16, False, "rotate_pairs_fp32"),
         (torch.float32, False, "rotate_pairs")]  # fp32 heads: no casts, the plain form


@pytest.mark.parametrize("dtype, transposed, variant", ERNIE, ids=lambda v: str(v))
def test_rotate_pairs_fp32_is_bitwise_eager(dtype, transposed, variant):
    mod, args = ErnieRope(), _ernie_args(dtype, transposed)
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager", providers={"cpu": ["reference"]})
    rep = ep_fuse.last_report()
    assert [(m.pattern, m.variant) for m in rep.matches] == [("rope", variant)] * 2, rep
    assert rep.ops_after.get("ep_fuse.rope_qk.default") == 1 and rep.ops_after.get("aten.neg.default", 0) == 0
    assert rep.ops_after.get("aten.stack.default", 0) == 0
    assert not rep.near_misses
    for o, e in zip(out, ref):
        assert o.dtype == e.dtype and o.stride() == e.stride() and torch.equal(o, e)


@pytest.mark.parametrize("dtype, transposed, variant", ERNIE, ids=lambda v: str(v))
def test_rotate_pairs_fp32_with_triton_kernel(dtype, transposed, variant):
    mod, args = ErnieRope(), _ernie_args(dtype, transposed, seed=1)
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager")
    rep = ep_fuse.last_report()
    assert [(m.pattern, m.variant) for m in rep.matches] == [("rope", variant)] * 2, rep
    if variant == "rotate_pairs_fp32":
        assert {m.provider for m in rep.matches} == {"triton"}, rep
        assert rep.ops_after.get("ep_fuse_triton.rope_qk.default") == 1
    for o, e in zip(out, ref):
        assert o.dtype == e.dtype and o.stride() == e.stride()
        ulp_close(o, e, dtype)


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 3), h=st.integers(1, 5), s=st.integers(1, 9),
    d=st.sampled_from([8, 16, 32, 64, 128]),
    dtype=st.sampled_from([BF16, torch.float16, torch.float32]),
    cos_fp32=st.booleans(),
    cast_back=st.booleans(),
    layout=st.sampled_from(["bhsd_view", "bshd", "bhsd"]),
    seed=st.integers(0, 2**16),
)
def test_triton_rotate_pairs_fp32_matches_reference(b, h, s, d, dtype, cos_fp32, cast_back, layout, seed):
    """fp32 products and sum, one rounding at the store: bitwise under the interpreter (no FMA contraction)."""
    x, cos, sin = _args("interleave", b, h, s, d, d, dtype, layout, 1, seed)
    if cos_fp32:
        cos, sin = cos.float(), sin.float()
    out_dtype = dtype if cast_back else None
    k = x[:, :1] if layout != "bshd" else x[:, :, :1]
    args = (x, k, cos, sin, "rotate_pairs_fp32", d, out_dtype)
    assert choose(rope_ops.rope_qk, args, "cpu").provider == "triton"
    for o, e in zip(torch.ops.ep_fuse_triton.rope_qk(*args), rope_qk_ref(*args)):
        assert o.dtype == e.dtype == (out_dtype or torch.float32) and o.shape == e.shape
        assert [st for st, n in zip(o.stride(), o.shape) if n > 1] == [st for st, n in zip(e.stride(), e.shape) if n > 1]
        assert torch.equal(o, e)


def test_rotate_pairs_fp32_providers_decline_what_they_cannot_do():
    x, cos, sin = _args("interleave", 1, 2, 5, 16, 16, BF16, "bhsd", 1, 0)
    args = (x, cos.float(), sin.float(), "rotate_pairs_fp32", 16, BF16)
    assert "rotate_pairs_fp32 form (fp32 math): not measured against Inductor" in choose(
        rope_ops.rope, args, "cpu", executor="inductor").declined[0][1]
    assert "neither fp32 nor the heads'" in triton_rope.check_rope_call((x, cos.half(), sin.half(), *args[3:]))
    assert "no documented torch_npu op" in npu_rope.rope_supports(args)
    with pytest.raises(ValueError, match="rotates the whole head"):
        rope_ref(x, cos[..., :4], sin[..., :4], "rotate_pairs_fp32", 8, None)


@pytest.mark.parametrize("mod, check", [
    (ErnieRope(swap=True), "expected aten.neg.default"),
    (ErnieRope(full_cos=True), "cos is not provably repeated in pairs"),
], ids=["SwappedPairsFp32", "FullWidthCosFp32"])
def test_rotate_pairs_fp32_look_alikes_name_the_deepest_variant(mod, check):
    """The fp32 GPT-J form with one op changed: no rope, and the near miss names ``rope[rotate_pairs_fp32]``
    (the variant that matched most nodes) first, with its failing check."""
    args = _ernie_args()
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager")
    rep = ep_fuse.last_report()
    assert not [m for m in rep.matches if m.pattern == "rope"], rep
    assert all(torch.equal(o, e) for o, e in zip(out, ref))
    assert len(rep.near_misses) == 2, rep.near_misses  # the neg of q and the neg of k
    for nm in rep.near_misses:
        depths = [a.depth for a in nm.attempts]
        assert depths == sorted(depths, reverse=True), nm.explain()
        assert nm.best.pattern == "rope[rotate_pairs_fp32]" and check in nm.best.reason, nm.explain()
        text = nm.explain()
        assert f"closest: rope[rotate_pairs_fp32] ({nm.best.depth} nodes matched)" in text, text
        # a variant rooted below the anchor that failed before reaching it is listed too, after the deepest
        assert "rope[rotate_pairs]: failed at" in text, text
        assert text.index("rope[rotate_pairs_fp32]: failed at") < min(
            (text.index(f"{a.pattern}: failed at") for a in nm.attempts[1:]), default=len(text)), text


def test_q_and_k_with_different_cos_are_not_paired():
    class TwoCos(nn.Module):
        def forward(self, q, k, cq, ck, s):
            return q * cq + rotate_half(q) * s, k * ck + rotate_half(k) * s

    q, k = torch.randn(1, 4, 5, 16).to(BF16), torch.randn(1, 2, 5, 16).to(BF16)
    cq, ck, s = (torch.randn(1, 1, 5, 16).to(BF16) for _ in range(3))
    compile_and_run(TwoCos(), q, k, cq, ck, s, executor="eager")
    rep = ep_fuse.last_report()
    assert rep.count("rope") == 2 and rep.ops_after.get("ep_fuse_triton.rope.default") == 2
    assert "ep_fuse_triton.rope_qk.default" not in rep.ops_after


def test_k_computed_from_rotated_q_is_not_paired():
    class Chained(nn.Module):
        def forward(self, q, c, s):
            q2 = q * c + rotate_half(q) * s
            k = q2 * 2
            return q2, k * c + rotate_half(k) * s

    q = torch.randn(1, 2, 5, 16).to(BF16)
    c, s = torch.randn(1, 1, 5, 16).to(BF16), torch.randn(1, 1, 5, 16).to(BF16)
    with torch.no_grad():
        ref = Chained()(q, c, s)
    out = compile_and_run(Chained(), q, c, s, executor="eager", providers={"cpu": ["reference"]})
    rep = ep_fuse.last_report()
    assert rep.count("rope") == 2 and rep.ops_after.get("ep_fuse.rope.default") == 2
    assert all(torch.equal(o, e) for o, e in zip(out, ref))


# --------------------------------------------------------------------------- kernel vs reference
def _args(form, b, h, s, d, rot, dtype, layout, cos_batch, seed):
    g = torch.Generator().manual_seed(seed)
    if layout == "bhsd_view":
        x = torch.randn(b, s, h, d, generator=g).to(dtype).transpose(1, 2)
    elif layout == "bshd":
        x = torch.randn(b, s, h, d, generator=g).to(dtype)
    else:
        x = torch.randn(b, h, s, d, generator=g).to(dtype)
    seq_dim = 1 if layout == "bshd" else 2
    lead = [cos_batch, 1, 1]
    lead[seq_dim] = s
    if form == "complex":
        f = torch.randn(*lead, rot // 2, generator=g)
        return x, torch.polar(torch.ones_like(f), f), None
    width = rot if form == "half" else rot // 2
    ang = torch.randn(*lead, width, generator=g)
    return x, ang.cos().to(dtype), ang.sin().to(dtype)


@settings(max_examples=40, deadline=None)
@given(
    form=st.sampled_from(["half", "chunk", "deinterleave", "interleave", "complex"]),
    b=st.integers(1, 3), h=st.integers(1, 5), s=st.integers(1, 9),
    d=st.sampled_from([8, 16, 32, 64, 128]),
    partial=st.booleans(),
    dtype=st.sampled_from([BF16, torch.float16, torch.float32]),
    layout=st.sampled_from(["bhsd_view", "bshd", "bhsd"]),
    cos_per_batch=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_triton_rope_matches_reference(form, b, h, s, d, partial, dtype, layout, cos_per_batch, seed):
    rot = d // 2 if partial and d >= 16 else d
    x, cos, sin = _args(form, b, h, s, d, rot, dtype, layout, b if cos_per_batch else 1, seed)
    out_dtype = dtype if form == "complex" else None
    k = x[:, :1] if layout != "bshd" else x[:, :, :1]
    q_out, k_out = torch.ops.ep_fuse_triton.rope_qk(x, k, cos, sin, form, rot, out_dtype)
    q_ref, k_ref = rope_qk_ref(x, k, cos, sin, form, rot, out_dtype)
    for o, e in ((q_out, q_ref), (k_out, k_ref)):
        assert o.dtype == e.dtype and o.shape == e.shape
        # the layout of the reference (strides of size-1 dims carry no meaning)
        assert [st for st, n in zip(o.stride(), o.shape) if n > 1] == [st for st, n in zip(e.stride(), e.shape) if n > 1]
        if form == "complex":
            ulp_close(o, e, o.dtype)  # fp32 complex products may differ in the last bit
        else:
            assert torch.equal(o, e), "every rounding of the model code is reproduced"


@pytest.mark.parametrize("op", ["rope", "rope_qk"])
@pytest.mark.parametrize("form", ["half", "complex"])
def test_opcheck(op, form):
    x, cos, sin = _args(form, 2, 3, 5, 16, 16, BF16, "bhsd_view", 1, 0)
    out_dtype = BF16 if form == "complex" else None
    args = (x, x[:, :1], cos, sin, form, 16, out_dtype) if op == "rope_qk" else (x, cos, sin, form, 16, out_dtype)
    torch.library.opcheck(getattr(torch.ops.ep_fuse, op).default, args)
    torch.library.opcheck(getattr(torch.ops.ep_fuse_triton, op).default, args)


def test_reference_rejects_bad_arguments():
    x = torch.randn(1, 2, 3, 16)
    with pytest.raises(ValueError, match="rot_dim 7 must be even"):
        rope_ref(x, x, x, "half", 7, None)
    with pytest.raises(ValueError, match="takes no sin"):
        rope_ref(x, x, x, "complex", 16, None)
    with pytest.raises(ValueError, match="not one of"):
        rope_ref(x, x, x, "gptj", 16, None)


# --------------------------------------------------------------------------- cos/sin cache + positions (vLLM form)
CACHE_CASES = [(True, 16, "index_select", "chunk"), (True, 8, "index", "partial_chunk"),
               (False, 16, "index", "interleave"), (False, 8, "index_select", "partial_interleave")]


@pytest.mark.parametrize("neox, rot, gather, variant", CACHE_CASES, ids=[c[3] + "-" + c[2] for c in CACHE_CASES])
@pytest.mark.parametrize("provider", ["reference", "triton"])
def test_cache_form_absorbs_the_gather_and_pairs(neox, rot, gather, variant, provider):
    mod = CacheRope(neox=neox, rot=rot, gather=gather)
    args = cache_inputs()
    with torch.no_grad():
        ref = mod(*args)
    providers = {"providers": {"cpu": ["reference"]}} if provider == "reference" else {}
    out = compile_and_run(mod, *args, executor="eager", **providers)
    rep = ep_fuse.last_report()
    assert [(m.pattern, m.variant, m.provider) for m in rep.matches] == [("rope", variant, provider)] * 2, rep
    op_name = "ep_fuse.rope_qk_cache.default" if provider == "reference" else "ep_fuse_triton.rope_qk_cache.default"
    assert rep.ops_after.get(op_name) == 1, "q and k with one cache gather run as one call"
    for gone in ("aten.index_select.default", "aten.index.Tensor", "aten.split.Tensor", "aten.mul.Tensor"):
        assert rep.ops_after.get(gone, 0) == 0, (gone, rep.ops_after)
    for o, e in zip(out, ref):
        assert torch.equal(o, e)


def test_cache_form_under_dynamic_token_count():
    mod = CacheRope(neox=True, rot=8)
    f = torch.compile(mod, backend="ep_fuse", dynamic=True, options={"executor": "eager"})
    with torch.no_grad():
        for t in (5, 11):
            args = cache_inputs(t=t, seed=t)
            assert all(torch.equal(o, e) for o, e in zip(f(*args), mod(*args)))
    assert ep_fuse.last_report().ops_after.get("ep_fuse_triton.rope_qk_cache.default") == 1


class TwoCaches(CacheRope):
    """cos from one cache, sin from another: not one cache gather (stays the tensor form)."""

    def forward(self, positions, q, k):
        cos = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)[0]
        sin = (self.cos_sin_cache * 1).index_select(0, positions).chunk(2, dim=-1)[1]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


class SwappedHalves(CacheRope):
    """sin taken from the first half of the cache row: not vLLM's layout."""

    def forward(self, positions, q, k):
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        return self._rotate(q, sin, cos), self._rotate(k, sin, cos)


@pytest.mark.parametrize("mod", [TwoCaches(), SwappedHalves()], ids=lambda m: type(m).__name__)
def test_cache_look_alikes_keep_the_tensor_form(mod):
    args = cache_inputs()
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager", providers={"cpu": ["reference"]})
    rep = ep_fuse.last_report()
    assert rep.count("rope") == 2
    assert not [k for k in rep.ops_after if "cache" in k], rep.ops_after
    assert rep.ops_after.get("ep_fuse.rope.default", 0) + 2 * rep.ops_after.get("ep_fuse.rope_qk.default", 0) == 2
    assert all(torch.equal(o, e) for o, e in zip(out, ref))


@settings(max_examples=30, deadline=None)
@given(form=st.sampled_from(["chunk", "interleave"]), t=st.integers(1, 12), hq=st.integers(1, 4),
       hk=st.integers(1, 2), d=st.sampled_from([8, 16, 64]), partial=st.booleans(),
       dtype=st.sampled_from([BF16, torch.float16, torch.float32]),
       pos_dtype=st.sampled_from([torch.int32, torch.int64]), batched=st.booleans(), seed=st.integers(0, 2**16))
def test_triton_rope_cache_matches_reference(form, t, hq, hk, d, partial, dtype, pos_dtype, batched, seed):
    g = torch.Generator().manual_seed(seed)
    rot = d // 2 if partial else d
    lead = (2, t) if batched else (t,)
    q = torch.randn(*lead, hq, d, generator=g).to(dtype)
    k = torch.randn(*lead, d, hk, generator=g).to(dtype).transpose(-1, -2)  # strided heads
    cache = torch.randn(17, rot, generator=g).to(dtype)
    positions = torch.randint(0, 17, lead, generator=g).to(pos_dtype)  # repeats, any order
    out = torch.ops.ep_fuse_triton.rope_qk_cache(q, k, cache, positions, form, rot)
    ref = torch.ops.ep_fuse.rope_qk_cache(q, k, cache, positions, form, rot)
    for o, e in zip(out, ref):
        assert o.shape == e.shape and o.dtype == e.dtype
        assert torch.equal(o, e)


def test_triton_rope_cache_declines_a_cast_per_call():
    from ep_fuse.providers.triton.rope import check_rope_cache_call

    q, cache, pos = torch.randn(3, 2, 8).to(BF16), torch.randn(9, 8), torch.tensor([0, 4, 8])
    assert "differs from the heads'" in check_rope_cache_call((q, q, cache, pos, "chunk", 8))
    assert "do not broadcast" in check_rope_cache_call((q, q, cache.to(BF16), torch.zeros(2, 3, dtype=torch.long),
                                                        "chunk", 8))
    assert check_rope_cache_call((q, q, cache.to(BF16), pos, "chunk", 8)) is None


def test_perf_rule_uses_the_kernel_only_where_measured_faster():
    from ep_fuse.providers.triton.rope import rope_cache_prefers, rope_prefers

    x, c = torch.randn(2, 3, 4, 16).to(BF16), torch.randn(1, 1, 4, 16).to(BF16)
    assert rope_prefers((x, x, c, c, "half", 16, None), "inductor") is None
    cache, pos = torch.randn(9, 16).to(BF16), torch.zeros(2, 3, dtype=torch.long)
    assert rope_cache_prefers((x, cache, pos, "interleave", 16), "inductor") is None
    assert "float32 heads" in rope_cache_prefers((x.float(), cache.float(), pos, "chunk", 16), "inductor")
    assert "float32 heads" in rope_prefers((x.float(), c.float(), c.float(), "half", 16, None), "inductor")
    assert "complex form" in rope_prefers((x, x, c, None, "complex", 16, BF16), "inductor")
    assert rope_prefers((x.float(), c.float(), c.float(), "half", 16, None), "eager") is None


def test_cache_opcheck():
    q, k, cache, pos = torch.randn(3, 2, 8).to(BF16), torch.randn(3, 1, 8).to(BF16), torch.randn(9, 8).to(BF16), \
        torch.tensor([0, 4, 8])
    for ns in (torch.ops.ep_fuse, torch.ops.ep_fuse_triton):
        torch.library.opcheck(ns.rope_qk_cache.default, (q, k, cache, pos, "interleave", 8))
        torch.library.opcheck(ns.rope_cache.default, (q, cache, pos, "chunk", 8))


# --------------------------------------------------------------------------- Ascend provider (test double)
@pytest.mark.parametrize("form", ["half", "chunk", "interleave", "complex"])
def test_npu_rope_matches_reference(torch_npu_double, form):
    x, cos, sin = _args(form, 2, 3, 5, 16, 16, BF16, "bhsd_view", 1, 1)
    out_dtype = BF16 if form == "complex" else None
    args = (x, x[:, :1], cos, sin, form, 16, out_dtype)
    assert npu_rope.rope_supports(args) is None
    assert choose(rope_ops.rope_qk, args, "npu").provider == "npu"
    for o, e in zip(npu_rope.rope_qk_kernel(*args), rope_qk_ref(*args)):
        ulp_close(o, e, BF16)  # the NPU op rounds once; HF rounds each product


def test_npu_rope_declines_undocumented_layouts(torch_npu_double):
    x, cos, sin = _args("deinterleave", 1, 2, 5, 16, 16, BF16, "bhsd", 1, 0)
    assert "no documented torch_npu op" in npu_rope.rope_supports((x, cos, sin, "deinterleave", 16, None))
    x, cos, sin = _args("half", 1, 2, 5, 16, 8, BF16, "bhsd", 1, 0)
    assert "partial rotary" in npu_rope.rope_supports((x, cos, sin, "half", 8, None))


# --------------------------------------------------------------------------- gpt-fast: pairs taken with select
class SelectPairsRope(nn.Module):
    """gpt-fast's ``apply_rotary_emb``: ``xs = x.float().reshape(..., D/2, 2)``, a ``[S, D/2, 2]`` (cos, sin) table
    viewed ``[1, S, 1, D/2, 2]``, ``stack([x0·c − x1·s, x1·c + x0·s], -1).flatten(3).type_as(x)``; q and k are
    ``[B, S, H, D]``. ``look_alike`` changes one thing (the module must then not become a rope)."""

    def __init__(self, look_alike=None):
        super().__init__()
        self.look_alike = look_alike

    def _rotate(self, x, table):
        if self.look_alike == "halves_as_pairs":  # (x[j], x[j + D/2]) paired: another rotation
            xs = x.float().reshape(*x.shape[:-1], 2, -1).transpose(-1, -2)
        else:
            xs = x.float().reshape(*x.shape[:-1], -1, 2)
        t = table.view(-1, xs.size(1), 1, xs.size(3), 2)
        x0, x1, c, s = xs[..., 0], xs[..., 1], t[..., 0], t[..., 1]
        if self.look_alike == "sign_swapped":
            pair = [x0 * c + x1 * s, x1 * c - x0 * s]
        elif self.look_alike == "pairs_exchanged":
            pair = [x1 * c - x0 * s, x0 * c + x1 * s]
        elif self.look_alike == "cos_sin_exchanged":
            pair = [x0 * s - x1 * c, x1 * s + x0 * c]
        else:
            pair = [xs[..., 0] * t[..., 0] - xs[..., 1] * t[..., 1], xs[..., 1] * t[..., 0] + xs[..., 0] * t[..., 1]]
        return torch.stack(pair, -1).flatten(3).type_as(x)

    def forward(self, q, k, table):
        return self._rotate(q, table), self._rotate(k, table)


def _select_pairs_args(dtype, table_dtype=torch.float32, table_batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, 7, 4, 16, generator=g).to(dtype), torch.randn(1, 7, 2, 16, generator=g).to(dtype)
    ang = torch.randn(table_batch * 7, 8, generator=g) * 3
    return q, k, torch.stack([ang.cos(), ang.sin()], -1).to(table_dtype)


SELECT_PAIRS = [(torch.float32, torch.float32), (BF16, torch.float32), (BF16, BF16), (torch.float16, torch.float32)]


@pytest.mark.parametrize("providers", [{"cpu": ["reference"]}, None], ids=["reference", "default"])
@pytest.mark.parametrize("dtype, table_dtype", SELECT_PAIRS, ids=lambda v: str(v).removeprefix("torch."))
def test_select_pairs_is_interleave_and_bitwise_eager(dtype, table_dtype, providers):
    """Both heads become ``rope[select_pairs]``, one ``rope_qk`` (interleave, cos/sin the table's halves); the
    selects, products and stacks are gone; the result is eager's bit for bit (fp32 pairs, and bf16/fp16 heads
    upcast to fp32 with the cast back left to ATen), in eager's dtype and layout."""
    mod, args = SelectPairsRope(), _select_pairs_args(dtype, table_dtype)
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager", **({"providers": providers} if providers else {}))
    rep = ep_fuse.last_report()
    assert [(m.pattern, m.variant) for m in rep.matches] == [("rope", "select_pairs")] * 2, rep
    assert rep.ops_before.get("aten.stack.default") == 2 and rep.ops_before.get("aten.select.int", 0) >= 16
    qk = [k for k in rep.ops_after if k.endswith("rope_qk.default")]
    assert len(qk) == 1 and rep.ops_after[qk[0]] == 1, rep.ops_after
    for gone in ("aten.stack.default", "aten.sub.Tensor", "aten.mul.Tensor", "aten.add.Tensor"):
        assert rep.ops_after.get(gone, 0) == 0, (gone, rep.ops_after)
    assert not rep.near_misses, [m.explain() for m in rep.near_misses]
    if providers is None:  # the Triton kernel takes unit-stride cos/sin in the heads' dtype: these are neither
        why = "cos/sin channels are not contiguous" if table_dtype == torch.float32 else "differs from the heads'"
        assert all(m.provider == "reference" and why in dict(m.declined)["triton"] for m in rep.matches), rep
    for o, e in zip(out, ref):
        assert o.dtype == e.dtype and o.stride() == e.stride() and torch.equal(o, e)


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_select_pairs_at_symbolic_sequence_lengths(dtype):
    """The sequence length symbolic (in the heads and in the table's view; heads and head dim static, as a
    projection makes them): the sites fuse, the rewrite adds no shape guard, each length is eager's bit for bit."""
    mod = SelectPairsRope()
    f = torch.compile(mod, backend="ep_fuse", options={"executor": "eager"})
    with torch.no_grad():
        for s in (5, 11):
            g = torch.Generator().manual_seed(s)
            q, k = torch.randn(1, s, 4, 16, generator=g).to(dtype), torch.randn(1, s, 2, 16, generator=g).to(dtype)
            ang = torch.randn(s, 8, generator=g)
            args = (q, k, torch.stack([ang.cos(), ang.sin()], -1))
            for t in args:
                torch._dynamo.mark_dynamic(t, 1 if t.dim() == 4 else 0)
            assert all(torch.equal(o, e) for o, e in zip(f(*args), mod(*args)))
    reps = ep_fuse.reports()
    assert len(reps) == 1, "one graph for both lengths"
    assert reps[0].count("rope", "select_pairs") == 2 and not reps[0].shape_guards, reps[0]


def test_select_pairs_under_inductor():
    """The Inductor executor compiles the inlined reference: eager's values within fp32 rounding."""
    mod, args = SelectPairsRope(), _select_pairs_args(torch.float32, seed=2)
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="inductor")
    assert ep_fuse.last_report().count("rope", "select_pairs") == 2
    for o, e in zip(out, ref):
        torch.testing.assert_close(o, e, rtol=2e-6, atol=2e-6)


def test_select_pairs_is_the_interleave_reference():
    """The canonical call the site becomes, on the table's halves, is the model's rotation (fp32, bitwise)."""
    q, _k, table = _select_pairs_args(torch.float32, seed=4)
    t = table.view(1, 7, 1, 8, 2)
    want = SelectPairsRope()._rotate(q, table)
    assert torch.equal(rope_ref(q, t[..., 0], t[..., 1], "interleave", 16, None), want)


@pytest.mark.parametrize("look_alike, why", [
    ("sign_swapped", "the pair is (x0·c + x1·s, x1·c − x0·s), not the rotation (x0·c − x1·s, x1·c + x0·s)"),
    ("pairs_exchanged", "expected 0, got 1"),
    ("cos_sin_exchanged", "expected 0, got 1"),
    ("table_grows_heads", "cos/sin of shape [2, 7, 1, 8] do not broadcast to the 8 channel pairs of [1, 7, "),
    ("halves_as_pairs", None),
])
def test_select_pairs_look_alikes_do_not_match(look_alike, why):
    """One thing changed -- a sign, the pairs' roles, cos and sin exchanged, a table with a batch the heads do not
    have -- no rope, the model's values, and a near miss at each pair view naming ``rope[select_pairs]`` and the
    failing check. Halves paired instead of neighbours (``reshape(..., 2, D/2)``, transposed) is not even a
    candidate: no channel-pair view."""
    mod = _GrowingTable() if look_alike == "table_grows_heads" else SelectPairsRope(look_alike)
    args = _select_pairs_args(torch.float32, table_batch=2 if look_alike == "table_grows_heads" else 1)
    with torch.no_grad():
        ref = mod(*args)
    out = compile_and_run(mod, *args, executor="eager")
    rep = ep_fuse.last_report()
    assert not [m for m in rep.matches if m.pattern == "rope"], rep
    assert all(torch.equal(o, e) for o, e in zip(out, ref))
    if why is None:
        assert not rep.near_misses, [m.explain() for m in rep.near_misses]
        return
    assert len(rep.near_misses) == 2, [m.explain() for m in rep.near_misses]  # the pair views of q and of k
    for nm in rep.near_misses:
        assert nm.best.pattern == "rope[select_pairs]" and why in nm.best.reason, nm.explain()


class _GrowingTable(SelectPairsRope):
    """A ``[2, S, 1, D/2, 2]`` table against ``[1, S, H, D]`` heads: the products would be twice the heads."""

    def forward(self, q, k, table):
        out = []
        for x in (q, k):
            xs = x.float().reshape(*x.shape[:-1], -1, 2)
            t = table.view(2, xs.size(1), 1, xs.size(3), 2)
            out.append(torch.stack([xs[..., 0] * t[..., 0] - xs[..., 1] * t[..., 1],
                                    xs[..., 1] * t[..., 0] + xs[..., 0] * t[..., 1]], -1).flatten(3))
        return tuple(out)


def test_select_pairs_npu_takes_fp32_heads_and_table(torch_npu_double):
    """The canonical call of an fp32 site (stride-2 cos/sin views of the table) on the Ascend provider (test
    double): ``npu_rotary_mul`` in interleave mode, within rounding of the reference; a bf16 table against fp32
    heads declines."""
    q, k, table = _select_pairs_args(torch.float32, seed=5)
    t = table.view(1, 7, 1, 8, 2)
    args = (q, k, t[..., 0], t[..., 1], "interleave", 16, None)
    assert npu_rope.rope_supports(args) is None
    assert choose(rope_ops.rope_qk, args, "npu").provider == "npu"
    for o, e in zip(npu_rope.rope_qk_kernel(*args), rope_qk_ref(*args)):
        ulp_close(o, e, torch.float32)
    tb = t.to(BF16)
    assert "dtype differs" in npu_rope.rope_supports((q, k, tb[..., 0], tb[..., 1], "interleave", 16, None))
