"""Accuracy of the W8A8 int8 experts (``quant="w8a8_int8"``) vs bf16, on CPU or GPU.

    PYTHONPATH=bench python experiments/2026-12/accuracy_w8a8.py [--device cpu|cuda]

1. MoE layer (``moe_experts`` reference block vs ``moe_experts_w8a8`` reference block, same routing):
   relative L2 of the output vs the bf16 layer and vs an fp64 unquantized layer, per expert size,
   for random (Gaussian) activations and heavy-tailed activations (Student-t rows plus a few outlier
   channels 50x larger, as in LLM hidden states).
2. Tiny HF Mixtral: logits of ``torch.compile(backend="ep_fuse", options={"quant": "w8a8_int8"})`` vs
   the bf16 model (eager executor, reference providers), relative L2 and top-1 agreement.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


import ep_fuse
import ep_fuse.catalog  # noqa: F401  (defines every op and provider)
from ep_fuse.ops import w8a8 as R

BF16 = torch.bfloat16
SIZES = [  # (name, T, H, I, E, K)
    ("small H256 I128 E8 k2", 64, 256, 128, 8, 2),
    ("mixtral-like H1024 I512 E8 k2", 64, 1024, 512, 8, 2),
    ("deepseek-like H2048 I512 E32 k8", 32, 2048, 512, 32, 8),
]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def activations(kind: str, t: int, h: int, g: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.randn(t, h, generator=g)
    # heavy-tailed: Student-t (3 dof) entries plus 4 outlier channels 50x larger
    x = torch.distributions.StudentT(3.0).sample((t, h))
    x = x / x.std()
    cols = torch.randperm(h, generator=g)[:4]
    x[:, cols] *= 50.0
    return x


def layer_errors(t: int, h: int, i: int, e: int, k: int, kind: str, device: str) -> dict[str, float]:
    g = torch.Generator().manual_seed(h + e)
    x = activations(kind, t, h, g).to(device, BF16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device)
    w = torch.softmax(torch.randn(t, k, generator=g), -1).to(device)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(device, BF16)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(device, BF16)
    ops = torch.ops.ep_fuse
    bf16 = ops.moe_experts(x, ids, w, w13, w2, BF16)
    (q13, s13), (q2, s2) = R.quantize_weight(w13), R.quantize_weight(w2)
    w8a8 = ops.moe_experts_w8a8(x, ids, w, q13, s13, q2, s2, BF16)
    exact = torch.zeros(t, h, dtype=torch.float64, device=device)
    xd = x.double()
    for tok in range(t):
        for slot in range(k):
            ei = int(ids[tok, slot])
            hh = w13[ei].double() @ xd[tok]
            act = F.silu(hh[:i]) * hh[i:]
            exact[tok] += w[tok, slot].double() * (w2[ei].double() @ act)
    return {"w8a8_vs_bf16": rel(w8a8, bf16), "w8a8_vs_fp64": rel(w8a8, exact), "bf16_vs_fp64": rel(bf16, exact)}


def tiny_model_errors(device: str) -> dict[str, float]:
    from ep_fuse.testing import tiny as tiny_models

    model = tiny_models.build("mixtral", device=device)
    inputs = tiny_models.example_inputs(device=device)
    with torch.no_grad():
        ref = model(**inputs).logits
        torch._dynamo.reset()
        out = torch.compile(model, backend="ep_fuse", options={"executor": "eager", "quant": "w8a8_int8"})(
            **inputs).logits
    rep = ep_fuse.last_report()
    return {"blocks": rep.counts().get("moe_experts", 0), "logits_rel_l2": rel(out, ref),
            "top1_agreement": (out.argmax(-1) == ref.argmax(-1)).float().mean().item()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    print(f"device {args.device}, torch {torch.__version__}")
    print("| expert size | activations | W8A8 vs bf16 | W8A8 vs fp64 | bf16 vs fp64 |")
    print("|---|---|---|---|---|")
    for name, t, h, i, e, k in SIZES:
        for kind in ("random", "heavy-tailed"):
            r = layer_errors(t, h, i, e, k, kind, args.device)
            print(f"| {name} (T{t}) | {kind} | {r['w8a8_vs_bf16']:.4f} | {r['w8a8_vs_fp64']:.4f} | "
                  f"{r['bf16_vs_fp64']:.4f} |")
    m = tiny_model_errors(args.device)
    print(f"\ntiny HF mixtral ({m['blocks']} MoE blocks quantized): logits relative L2 vs bf16 "
          f"{m['logits_rel_l2']:.4f}, top-1 agreement {m['top1_agreement']:.3f}")


if __name__ == "__main__":
    main()
