"""A generality sweep over the MoE causal-LM families of the installed transformers.

:func:`discover` lists every model type of ``transformers.models`` whose modeling file defines a
``*ForCausalLM`` class and either an experts class (``class ...Experts``) or a config with an expert count;
:func:`tiny_config` shrinks a family's own config class generically (hidden 64, 2+ layers, 4 heads / 2 KV
heads, head_dim 16, 8 experts, top-2, vocabulary 128); :func:`sweep_family` builds it with random weights,
prepares it (:func:`ep_fuse.prepare`), compiles it with ``backend="ep_fuse"`` (and optionally
``backend="inductor"``) and compares with eager. ``tools/sweep_models.py`` is the command line;
``tests/test_sweep.py`` pins the fused-site counts it measures (``tests/support/sweep_expected.py``).

Nothing is downloaded: each model is built from its config class with seeded random weights.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import re
import time
from typing import Any

import torch

import ep_fuse
from ep_fuse.surgery.expert_loops import unfused_experts
from ep_fuse.surgery.prepare import prepare

log = logging.getLogger("ep_fuse")

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
"""Config attributes that hold a family's routed-expert count (the first present one is set to ``EXPERTS``)."""

EXPERTS = 8
TOP_K = 2
LAYERS = 2
MAX_LAYERS = 6
"""Layer-type lists are cut to the fewest layers that keep each distinct (per-list) layer kind, at most this many."""

SIZES: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 128, "intermediate_size": 96, "moe_intermediate_size": 48,
    "shared_expert_intermediate_size": 96, "shared_intermediate_size": 64, "shared_experts_intermediate_size": 48,
    "moe_shared_expert_intermediate_size": 48, "intermediate_size_mlp": 96, "dense_intermediate_size": 96,
    "first_dense_intermediate_size": 96,
    "expert_ffn_hidden_size": 48, "ffn_hidden_size": 96, "num_experts_per_tok": TOP_K, "moe_topk": TOP_K,
    "top_k_experts": TOP_K, "q_lora_rank": 48, "kv_lora_rank": 32, "o_lora_rank": 32, "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16, "v_head_dim": 16, "qk_head_dim": 32, "index_head_dim": 32, "index_n_heads": 2,
    "index_topk": 8, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_value_heads": 4,
    "linear_num_key_heads": 2, "linear_head_dim": 16, "linear_num_heads": 4, "mamba_n_heads": 4,
    "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 16, "mamba_num_heads": 8, "mamba_head_dim": 16,
    "ssm_state_size": 16, "chunk_size": 16, "mamba_dt_rank": 8, "sliding_window": 64, "sliding_window_size": 64,
    "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16, "kv_channels": 16,
    "loop_gate_rank": 16, "rel_extent": 64, "log_scaling_n_floor": 64, "unpadded_vocab_size": 128,
    "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 16, "router_hidden_size": 32,
    "d_model": 64, "n_heads": 4, "max_seq_len": 128, "attention_chunk_size": 64, "model_max_length": 128,
}
"""Generic tiny sizes, applied to whichever of these attributes a family's config has (as an ``int``)."""

DERIVED_WHEN_NONE = ("head_dim", "moe_intermediate_size", "num_experts_per_tok")
"""Sizes a default config leaves ``None`` (derived, or required later) that are set anyway."""

LAYER_PLACEMENT: dict[str, Any] = {
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "moe_layer_start_index": 0, "expert_layer_period": 1, "expert_layer_offset": 0, "attn_layer_period": 2,
    "attn_layer_offset": 1, "num_nextn_predict_layers": 0, "n_layers_per_attn_res_block": 1,
}
"""MoE/dense layer placement: every layer routed (DeepSeek-style dense prefixes keep one dense layer)."""

FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    # one decoder layer (index 1) run twice between a plain first and last layer
    "inkling2_loop": {"keep_layers": [0, 5, 6], "loop_layer_index_start": 1, "loop_layer_index_end": 2,
                      "loop_num_passes": 2},
    "longcat_flash": {"num_layers": 2, "zero_expert_num": 2},
    # conv and attention layers, one dense layer first
    "lfm2_moe": {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"], "num_dense_layers": 1},
    "deepseek_v2": {"n_group": 2, "topk_group": 1},  # as tiny.py: its default group-less router has no top_k
    "mistral4": {"head_dim": 32},  # MLA: qk_nope_head_dim + qk_rope_head_dim
    "zaya": {"num_experts_per_tok": 1},  # ZAYA supports top-1 only
    "granitemoehybrid": {"mamba_n_heads": 8},  # mamba_expand * hidden == heads * head dim
    "dbrx": {"d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 128, "vocab_size": 128,
             "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 96, "moe_num_experts": EXPERTS, "moe_top_k": TOP_K}},
    "dots1": {"n_shared_experts": 1},  # its default None fails in Dots1MoE (moe_intermediate_size * None)
    # MLA sliding layers check head_dim == qk_nope_head_dim + qk_rope_head_dim
    "dots3_note": {"head_dim": 32},
    # query-sparse attention: the indexer's sizes have no default (None // None in its __init__)
    "qwen4_exp": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                  "indexer_compress_ratio": 4, "hc_lowrank": 16},
    # sliding and indexed-attention layers (one indexer), one dense layer first; the indexer's pool and top-k
    # smaller than the 16 tokens, so that its sparse path runs
    "kolibri1_1": {"num_hidden_layers": 3,
                   "layer_types": ["sliding_attention", "sliding_attention", "indexed_attention"], "mlp_only_layers": [0], "index_layers": [2], "kv_source_layers": [0, 1, 2], "index_num_heads": 2,
                   "index_topk": 4, "index_pool_size": 8, "index_compression": 4, "index_num_local_tokens": 4,
                   "index_num_sink_tokens": 2, "mlp_only_intermediate_size": 96},
    "gemma4": {"enable_moe_block": True, "num_experts": EXPERTS, "top_k_experts": TOP_K, "moe_intermediate_size": 48},
}
"""Settings a family needs beyond the generic rules (applied last); ``keep_layers``: the indices of the default
config's layers to keep (its layer-type lists are cut to them)."""


def transformers_models_dir() -> str:
    import transformers  # optional dependency

    return os.path.join(os.path.dirname(transformers.__file__), "models")


def discover() -> list[str]:
    """Model types of the installed transformers with a ``*ForCausalLM`` class and routed experts (sorted)."""
    root = transformers_models_dir()
    out = []
    for family in sorted(os.listdir(root)):
        path = os.path.join(root, family, f"modeling_{family}.py")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            src = f.read()
        if not re.search(r"^class \w+ForCausalLM\b", src, re.M):
            continue
        if re.search(r"^class \w*Experts\b", src, re.M) or _config_has_experts(family):
            out.append(family)
    return out


def _config_has_experts(family: str) -> bool:
    try:
        cfg = causal_lm_class(family).config_class()
    except Exception:
        return False
    return any(isinstance(getattr(cfg, k, None), int) and getattr(cfg, k) > 1 for k in EXPERT_COUNT_KEYS)


def causal_lm_class(family: str) -> type:
    """The family's ``*ForCausalLM`` class (the first one its modeling file defines)."""
    path = os.path.join(transformers_models_dir(), family, f"modeling_{family}.py")
    with open(path, encoding="utf-8") as f:
        names = re.findall(r"^class (\w+ForCausalLM)\b", f.read(), re.M)
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return getattr(module, names[0])


def _layer_lists(cfg: Any, layers: int) -> dict[str, list[Any]]:
    return {k: v for k, v in vars(cfg).items() if isinstance(v, list) and layers and len(v) == layers}


def _keep_layers(lists: dict[str, list[Any]], layers: int) -> list[int]:
    """Indices of the fewest layers (at least ``LAYERS``) that keep every distinct kind of layer."""
    if not lists:
        return list(range(min(LAYERS, layers)))
    kinds = [tuple(repr(v[i]) for v in lists.values()) for i in range(layers)]
    keep: list[int] = []
    seen: set[tuple[str, ...]] = set()
    for i, kind in enumerate(kinds):
        if kind not in seen and len(keep) < MAX_LAYERS:
            seen.add(kind)
            keep.append(i)
    for i in range(layers):
        if len(keep) >= LAYERS:
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep)


def _per_layer_values(cfg: Any) -> list[dict[str, Any]]:
    """Each layer's own values of the per-layer attributes of a heterogeneous config (``[]`` if homogeneous), read
    through transformers' ``config.per_layer_config[i]``."""
    attrs = sorted(getattr(cfg, "per_layer_attributes", None) or ())
    if not attrs:
        return []
    return [{a: getattr(layer, a) for a in attrs} for layer in cfg.per_layer_config]


def _tiny_layer_value(default: Any, tiny: Any, value: Any) -> Any:
    """A layer's own value of an attribute whose global ``default`` shrinks to ``tiny``: scaled by the same integer
    factor where it is a whole multiple or divisor of the default (Gemma-4's 512 vs 256 head dim: 2 x tiny), else
    the global tiny value (the layer then differs only in kind, not in size)."""
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (default, tiny, value)) or default == tiny:
        return value if default == tiny else tiny
    if value == default or value <= 0 or default <= 0:
        return tiny
    if value % default == 0:
        return tiny * (value // default)
    if default % value == 0 and tiny % (default // value) == 0:
        return tiny // (default // value)
    return tiny


def tiny_overrides(family: str, cfg: Any) -> dict[str, Any]:
    """The attribute values that shrink ``cfg`` (a default config of ``family``).

    A heterogeneous config (transformers' ``per_layer_config``: e.g. Gemma-4's ``head_dim`` of its full-attention
    layers) is read through its global values, and the kept layers' own values are shrunk by
    :func:`_tiny_layer_value` into a new ``per_layer_config``."""
    new: dict[str, Any] = {}
    if getattr(cfg, "is_heterogeneous", False):
        cfg.allow_global_per_layer_attribute_access = True  # our own default instance: read the global values
    for k, v in SIZES.items():
        old = getattr(cfg, k, False)
        if (isinstance(old, int) and not isinstance(old, bool)) or (old is None and k in DERIVED_WHEN_NONE):
            new[k] = v
    heads, kv = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    if isinstance(heads, int) and heads == kv:  # MLA and other full-KV designs keep KV heads == heads
        new["num_key_value_heads"] = SIZES["num_attention_heads"]
    for k in EXPERT_COUNT_KEYS:  # None: set later from another attribute, or required (Dots1's defaults)
        if hasattr(cfg, k) and (getattr(cfg, k) is None or isinstance(getattr(cfg, k), int)):
            new[k] = EXPERTS
    if isinstance(getattr(cfg, "n_group", None), int) and cfg.n_group > 1:
        new.update(n_group=2, topk_group=1)
    for k in ("n_shared_experts", "num_shared_experts"):
        if isinstance(getattr(cfg, k, None), int) and getattr(cfg, k) > 1:
            new[k] = 1
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        v = getattr(cfg, k, None)
        if isinstance(v, int) and v >= SIZES["vocab_size"]:
            new[k] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[k]
        elif isinstance(v, list):
            new[k] = [t if t < SIZES["vocab_size"] else 2 for t in v]
    for k, v in LAYER_PLACEMENT.items():
        old = getattr(cfg, k, None)
        if old is not None and type(old) is type(v):
            new[k] = min(old, v) if k == "first_k_dense_replace" else v
    family_new = dict(FAMILY_OVERRIDES.get(family, {}))
    layers = getattr(cfg, "num_hidden_layers", None)
    if isinstance(layers, int):
        lists = _layer_lists(cfg, layers)
        per_layer = _per_layer_values(cfg)
        kinds = {**lists, "per_layer_config": per_layer} if per_layer else lists
        keep = family_new.pop("keep_layers", None) or _keep_layers(kinds, layers)
        new["num_hidden_layers"] = len(keep)
        for k, v in lists.items():
            new[k] = [v[i] for i in keep]
        if per_layer:
            new["per_layer_config"] = {}  # explicit even when empty: Gemma-4 would otherwise derive its defaults
            for j, i in enumerate(keep):
                values = {a: _tiny_layer_value(getattr(cfg, a), new.get(a, getattr(cfg, a)), v)
                          for a, v in per_layer[i].items()}
                values = {a: v for a, v in values.items() if v != new.get(a, getattr(cfg, a))}
                if values:
                    new["per_layer_config"][j] = values
    for k in ("moe_layers",):
        if isinstance(getattr(cfg, k, None), list):
            new[k] = list(range(new.get("num_hidden_layers", LAYERS)))
    if isinstance(getattr(cfg, "moe_layer_end_index", None), int):
        new["moe_layer_end_index"] = new.get("num_hidden_layers", LAYERS) - 1
    new.update(family_new)
    return new


def tiny_config(family: str) -> Any:
    """The family's own config class, shrunk (sub-configs such as ``text_config`` shrunk the same way)."""
    cls = causal_lm_class(family).config_class
    cfg = cls()
    new = tiny_overrides(family, cfg)
    for k, v in vars(cfg).items():
        if k not in new and hasattr(v, "to_dict") and hasattr(type(v), "model_type") and not k.startswith("_"):
            sub = tiny_overrides(family, v)
            new[k] = type(v)(**{**v.to_dict(), **sub})
    try:  # through __init__, so that derived attributes (layer types, rope parameters) follow the sizes
        return cls(**new)
    except TypeError:  # an attribute its __init__ does not take
        for k, v in new.items():
            setattr(cfg, k, v)
        return cfg


def routed_expert_modules(model: torch.nn.Module) -> list[str]:
    """Paths of the routed-experts modules (class ``...Experts``, not ``shared_*`` ones; outermost only)."""
    out: list[str] = []
    for name, mod in model.named_modules():
        cls, leaf = type(mod).__name__, name.rsplit(".", 1)[-1]
        if cls.endswith("Experts") and "shared" not in leaf.lower() and not any(name.startswith(p + ".") for p in out):
            out.append(name)
    return out


@dataclasses.dataclass
class Run:
    """One compile of one family in one dtype."""

    backend: str
    dtype: str
    max_abs: float | None = None
    rel: float | None = None
    """``max |compiled - eager| / max |eager|`` of the logits."""
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    variants: dict[str, int] = dataclasses.field(default_factory=dict)
    """Matches per ``pattern[variant]``."""
    graphs: int = 0
    fallbacks: list[str] = dataclasses.field(default_factory=list)
    """Graphs that ran unrewritten because a pass failed (``GraphReport.skipped``)."""
    error: str | None = None
    seconds: float = 0.0
    eager_finite: bool = True
    """The eager logits are finite (fp16 overflows in some families: then the dtype is not pinned)."""


@dataclasses.dataclass
class FamilyResult:
    family: str
    built: bool = False
    skip: str | None = None
    """Why the family could not be built (or run eagerly) tiny."""
    attn: str = ""
    moe_blocks: int = 0
    params: int = 0
    runs: list[Run] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    unfused: list[str] = dataclasses.field(default_factory=list)
    """Why known expert forms get no ``moe_experts`` (``expert_loops.UNFUSED_EXPERTS``), one line per class."""

    def run(self, backend: str, dtype: str) -> Run | None:
        return next((r for r in self.runs if r.backend == backend and r.dtype == dtype), None)


def build_tiny(family: str, dtype: torch.dtype, seed: int = 0) -> tuple[torch.nn.Module, str]:
    """The tiny model in eval mode, prepared; returns it with the attention implementation it got."""
    cls = causal_lm_class(family)
    cfg = tiny_config(family)
    last: Exception | None = None
    for attn in ("sdpa", "eager"):
        torch.manual_seed(seed)
        try:
            model = cls._from_config(cfg, dtype=dtype, attn_implementation=attn)
        except (ValueError, ImportError) as exc:  # no SDPA for this family
            last = exc
            continue
        _randomize_zero_weights(model, seed)
        prepare(model)
        return model.eval(), attn
    assert last is not None
    raise last


def _randomize_zero_weights(model: torch.nn.Module, seed: int) -> None:
    """Give random values to the matrices a family's init leaves at zero (router gates: afmoe), so that routing is
    not an exact tie everywhere: the order of tied experts is unspecified (``torch.topk`` and the stable kernels
    break ties differently), which would make every family's comparison a coin toss instead of a check."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.dim() >= 2 and p.is_floating_point() and not p.any():
                p.copy_((torch.randn(p.shape, generator=g) / max(p.shape[-1], 1) ** 0.5).to(p.dtype))


def example_inputs(batch: int = 2, seq: int = 16, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, SIZES["vocab_size"], (batch, seq), generator=g), "use_cache": False}


def _first_line(exc: BaseException, limit: int = 400) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return " | ".join(line.strip() for line in text.splitlines() if line.strip())[:limit]


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]


def compile_once(model: torch.nn.Module, inputs: dict[str, Any], ref: torch.Tensor, backend: str, dtype: str,
                 executor: str, providers: dict[str, list[str]] | None = None) -> Run:
    """Compile ``model`` with ``backend`` (fresh Dynamo state), run it once and compare with ``ref``.

    ``providers`` (ep_fuse's option, e.g. ``{"cpu": ["reference"]}``) does not change which sites fuse: on a CPU
    the reference alone is several times faster than the Triton interpreter, which is enough for site counts."""
    run = Run(backend=backend if backend == "inductor" else f"ep_fuse/{executor}", dtype=dtype)
    torch._dynamo.reset()
    ep_fuse.reset_reports()
    t0 = time.perf_counter()
    try:
        opts: dict[str, Any] | None = None
        if backend == "ep_fuse":
            opts = {"executor": executor, **({"providers": providers} if providers else {})}
        with torch.no_grad():
            out = _logits(torch.compile(model, backend=backend, options=opts)(**inputs))
        diff = (out.float() - ref.float()).abs()
        run.max_abs = diff.max().item()
        run.rel = run.max_abs / max(ref.float().abs().max().item(), 1e-30)
    except Exception as exc:
        run.error = _first_line(exc)
        log.info("ep_fuse.sweep: %s %s %s failed", backend, dtype, type(model).__name__, exc_info=exc)
    run.seconds = time.perf_counter() - t0
    if backend == "ep_fuse":
        reports = ep_fuse.reports()
        run.graphs = len(reports)
        for rep in reports:
            for k, v in rep.counts().items():
                run.counts[k] = run.counts.get(k, 0) + v
            for match in rep.matches:
                key = f"{match.pattern}[{match.variant}]"
                run.variants[key] = run.variants.get(key, 0) + 1
            if rep.skipped and "rewrite failed" in rep.skipped:
                run.fallbacks.append(rep.skipped)
    torch._dynamo.reset()
    return run


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

REFERENCE_ONLY = {"cpu": ["reference"], "cuda": ["reference"]}
"""ep_fuse's ``providers`` option that lowers every site to its reference (the counts are the same)."""


def sweep_family(family: str, dtypes: tuple[str, ...] = ("fp32",), executor: str = "eager",
                 inductor: bool = False, device: str = "cpu",
                 providers: dict[str, dict[str, list[str]]] | None = None) -> FamilyResult:
    """Build ``family`` tiny in each dtype on ``device``, compile it with ep_fuse (and Inductor) and compare with
    eager. ``providers``: dtype -> ep_fuse's ``providers`` option for that dtype's compile (default: every
    provider)."""
    res = FamilyResult(family)
    t0 = time.perf_counter()
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in example_inputs().items()}
    for dt in dtypes:
        try:
            model, res.attn = build_tiny(family, DTYPES[dt])
            model = model.to(device)
            res.moe_blocks = len(routed_expert_modules(model))
            res.unfused = sorted({f"{cls}: {why}" for _, cls, why in unfused_experts(model)})
            res.params = sum(p.numel() for p in model.parameters())
            with torch.no_grad():
                ref = _logits(model(**inputs))
        except Exception as exc:
            res.skip = _first_line(exc)
            log.info("ep_fuse.sweep: %s cannot be built tiny", family, exc_info=exc)
            break
        res.built = True
        res.runs.append(compile_once(model, inputs, ref, "ep_fuse", dt, executor, (providers or {}).get(dt)))
        res.runs[-1].eager_finite = bool(torch.isfinite(ref).all())
        if inductor:
            res.runs.append(compile_once(model, inputs, ref, "inductor", dt, executor))
        del model
    res.seconds = time.perf_counter() - t0
    return res


def totals(results: list[FamilyResult], dtype: str = "fp32") -> dict[str, int]:
    """Routed MoE blocks over the built families, and how many got ``moe_experts`` / ``moe_gating``."""
    blocks = experts = gating = 0
    for r in results:
        run = next((x for x in r.runs if x.backend.startswith("ep_fuse") and x.dtype == dtype), None)
        if not r.built or run is None:
            continue
        blocks += r.moe_blocks
        experts += min(run.counts.get("moe_experts", 0), r.moe_blocks)
        gating += min(run.counts.get("moe_gating", 0), r.moe_blocks)
    return {"moe_blocks": blocks, "moe_experts": experts, "moe_gating": gating}


MOE_SITES = ("moe_experts", "moe_gating")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def markdown(results: list[FamilyResult], dtypes: tuple[str, ...], inductor: bool) -> str:
    """One row per family: MoE blocks, fused MoE sites, other sites, graphs, max |Δ| per backend/dtype, errors."""
    head = ["family", "attn", "MoE blocks", "moe_experts", "moe_gating", "other sites", "graphs"]
    backends = [r for r in ("ep_fuse", "inductor") if r == "ep_fuse" or inductor]
    for dt in dtypes:
        head += [f"{b} max|Δ| {dt}" for b in backends]
    head += ["s", "errors"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        first = next((x for x in r.runs if x.backend.startswith("ep_fuse")), None)
        counts = first.counts if first else {}
        other = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k not in MOE_SITES) or "-"
        row = [r.family, r.attn or "-", str(r.moe_blocks) if r.built else "-",
               str(counts.get("moe_experts", 0)) if first else "-", str(counts.get("moe_gating", 0)) if first else "-",
               other if first else "-", str(first.graphs) if first else "-"]
        errors = []
        for dt in dtypes:
            for b in backends:
                run = next((x for x in r.runs if x.backend.startswith(b) and x.dtype == dt), None)
                row.append(_fmt(run.max_abs) if run else "-")
                if run and run.error:
                    errors.append(f"{run.backend} {dt}: {run.error[:160]}")
                if run and run.fallbacks:
                    errors.append(f"{run.backend} {dt}: fallback: {run.fallbacks[0][:160]}")
        if r.skip:
            errors.append(f"not built: {r.skip[:200]}")
        errors += [f"no moe_experts: {why}" for why in r.unfused]
        row += [f"{r.seconds:.0f}", "; ".join(errors).replace("|", "/") or ""]
        lines.append("| " + " | ".join(row) + " |")
    t = totals(results, dtypes[0])
    lines.append("")
    lines.append(f"{t['moe_experts']} of {t['moe_blocks']} routed MoE blocks get moe_experts, "
                 f"{t['moe_gating']} of {t['moe_blocks']} get moe_gating ({dtypes[0]}).")
    return "\n".join(lines)


PINNED = ("moe_experts", "moe_gating", "add_rms_norm", "rms_norm", "rope", "gemm_swiglu")
"""Patterns pinned per dtype by ``tests/test_sweep.py`` (with whatever else a run counts)."""


def pins(res: FamilyResult) -> dict[str, Any] | str:
    """``tests/support/sweep_expected.py``'s entry for one family: the routed MoE blocks and, per dtype, every
    pattern's site count (``PINNED`` at least, 0 included), or ``"skip: <why>"`` for a dtype the family does not
    run in (a compile error, or eager logits that are not finite) and for a family that does not build."""
    if not res.built:
        return f"skip: {res.skip}"
    out: dict[str, Any] = {"moe_blocks": res.moe_blocks}
    if res.skip:  # a later dtype failed eagerly (built in the first)
        out["skip"] = res.skip[:160]
    for run in res.runs:
        if not run.backend.startswith("ep_fuse"):
            continue
        if run.error or not run.eager_finite:
            out[run.dtype] = f"skip: {run.error or 'eager logits not finite (overflow)'}"[:160]
        else:
            out[run.dtype] = {**{k: run.counts.get(k, 0) for k in PINNED},
                              **{k: v for k, v in sorted(run.counts.items()) if k not in PINNED}}
    return out


def to_json(results: list[FamilyResult]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(r) for r in results]
