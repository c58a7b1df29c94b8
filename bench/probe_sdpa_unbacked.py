"""Which CUDA SDPA call guards on an unbacked batch (``ep_fuse.dynamic_batch``'s ``Eq(u0, 1)``)?

    python bench/probe_sdpa_unbacked.py        (GPU; writes $OUT/probe_sdpa_unbacked.md)

Compiles ``F.scaled_dot_product_attention`` with ``fullgraph=True`` (backend ``eager``: Dynamo's trace only)
for the call shapes HF's ``sdpa_attention_forward`` makes (decode and prefill, GQA through ``enable_gqa``
or repeated heads, with and without a mask, q/k/v as transposed views or contiguous), the batch dim of
every input marked unbacked, each SDPA backend forced in turn; prints which variants trace and, for the
others, the guard and the frames that raised it.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_info, out_dir  # noqa: E402

H, KV, D = 16, 4, 64


def make(batch: int, q_len: int, kv_len: int, transposed: bool, dtype=torch.bfloat16):
    def t(heads: int, length: int) -> torch.Tensor:
        if transposed:  # HF: [B, S, H, D] projections viewed and transposed to [B, H, S, D]
            return torch.randn(batch, length, heads, D, device="cuda", dtype=dtype).transpose(1, 2)
        return torch.randn(batch, heads, length, D, device="cuda", dtype=dtype)
    return t(H, q_len), t(KV, kv_len), t(KV, kv_len)


def call(q, k, v, mask, gqa: str, causal: bool):
    if gqa == "repeat":
        k = k.repeat_interleave(H // KV, dim=1)
        v = v.repeat_interleave(H // KV, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa == "enable_gqa")


def probe(q_len: int, kv_len: int, transposed: bool, gqa: str, masked: bool, backend) -> str:
    torch._dynamo.reset()
    q, k, v = make(3, q_len, kv_len, transposed)
    mask = torch.ones(3, 1, q_len, kv_len, device="cuda", dtype=torch.bool).tril(kv_len - q_len) if masked else None
    for x in (q, k, v) + ((mask,) if masked else ()):
        torch._dynamo.decorators.mark_unbacked(x, 0, shape_id="batch")
    causal = q_len > 1 and not masked
    fn = torch.compile(lambda q, k, v, m: call(q, k, v, m, gqa, causal), backend="eager", fullgraph=True)
    try:
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            fn(q, k, v, mask)
        return "traces"
    except Exception as exc:  # report the guard and where it came from
        text = f"{type(exc).__name__}: {exc}"
        frames = [ln for ln in traceback.format_exc().splitlines() if "File " in ln][-6:]
        return (text[:1500] + "\n" + "\n".join(frames)).replace("|", "/")


def main() -> None:
    rows = [f"# CUDA SDPA on an unbacked batch\n\n{env_info()}\n"]
    backends = {"auto": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    short = []
    for (q_len, kv_len), transposed, gqa, masked, (bname, b) in itertools.product(
            [(1, 64), (7, 7)], [True, False], ["enable_gqa", "repeat"], [False, True], backends.items()):
        res = probe(q_len, kv_len, transposed, gqa, masked, b)
        tag = f"q{q_len} kv{kv_len} {'transposed' if transposed else 'contiguous'} {gqa} " \
              f"{'mask' if masked else 'no-mask'} backend={bname}"
        ok = res == "traces"
        short.append(f"| {tag} | {'traces' if ok else res.splitlines()[0][:160]} |")
        if not ok:
            rows.append(f"## {tag}\n```\n{res}\n```\n")
        print(tag, "->", "traces" if ok else res.splitlines()[0][:200], flush=True)
    text = "\n".join(["| variant | result |", "|---|---|", *short, "", *rows])
    (out_dir() / "probe_sdpa_unbacked.md").write_text(text)


if __name__ == "__main__":
    main()
