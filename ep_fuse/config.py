"""Typed, validated configuration behind ``torch.compile(..., backend="ep_fuse", options={...})``.

A leaf: it imports only :mod:`ep_fuse.runtime` (which declares the behaviour switches, :class:`Switches`, that
:class:`EpFuseConfig` inherits). Values are checked when a config is built; the names that only the loaded
registry knows (patterns, providers, EP engines) are checked by :meth:`EpFuseConfig.check_names`, which the
backend calls with the catalog's names when it builds its config (:func:`ep_fuse.backend.build_config`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import os
from collections.abc import Collection, Mapping
from typing import Any

from ep_fuse import runtime
from ep_fuse.runtime import ENV_DEFAULTS, NPU_GMM_WEIGHTS, SWITCHES, Switches  # noqa: F401  (re-exported)

EXECUTORS = ("auto", "inductor", "eager")
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
DEVICES = ("cpu", "cuda", "npu")
QUANT_MODES = (None, "w8a8_int8", "fp8_block")


EP_OVERLAP_MODES = ("none", "shared", "two_batch", "auto")
"""Values of ``ep_overlap`` (:mod:`ep_fuse.passes.ep_overlap`)."""


ALIASES = {"ep_backend": "ep_engine"}
"""Option names kept for compatibility -> the field they set."""


class ConfigError(ValueError):
    """An ep_fuse option is unknown or has a bad value."""


def _suggest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


@dataclasses.dataclass(frozen=True)
class EpFuseConfig(Switches):
    """Options of the ep_fuse backend (the behaviour switches are inherited from :class:`Switches`).

    Attributes:
        executor: ``"inductor"`` compiles the rewritten ATen graph with Inductor, ``"eager"`` runs it
            op by op (NPU, debugging), ``"auto"`` picks Inductor where it supports the device.
        patterns: pattern names to run (``None``: every pattern in the catalog).
        disable: pattern names to skip.
        providers: per-device provider priority, e.g. ``{"cuda": ("reference",)}``; ``"reference"``
            is always appended last.
        perf_guard: providers decline shapes where they measured slower than Inductor.
        mode: ``torch.compile`` mode for the Inductor executor (``torch.compile`` refuses ``mode``
            together with ``options``, so it can be given here too).
        inductor_config: extra Inductor config patches for the Inductor executor.
        dump_dir: write graphs before/after each pass and the match table under this folder
            (also ``EP_FUSE_DUMP_DIR``).
        ep: expert parallelism over the default (world) group; see ``docs/ep.md`` and
            :func:`ep_fuse.ep_options`. EP runs only where the group has more than one rank.
        ep_group: the EP ``torch.distributed`` process group (or its name); setting it enables EP.
        ep_engine: the EP engine: ``auto`` or a registered engine (``all_to_all``, ``deepep``, ``deepep_low_latency``,
            ``npu``, ``symm_mem``; :func:`ep_fuse.ops.ep.engine_names`). Also given as ``ep_backend`` (its first
            name, kept as an alias option and a read-only property).
        ep_capacity: ``None``: receive sizes are data-dependent (a host sync per layer); an int:
            static capacity in tokens per rank (no sync, CUDA-graph capturable; every rank's batch
            must fit).
        ep_timeout_s: seconds any EP collective may wait before it raises.
        ep_overlap: ``"none"``, ``"shared"`` (work independent of the routed tokens runs between the start and
            the wait of each dispatch/combine), ``"two_batch"`` (the decoder-layer range split along the batch into
            two interleaved micro-batches, else each EP block's tokens) or ``"auto"`` (per block from measured
            rules); see :mod:`ep_fuse.passes.ep_overlap`.
        quant: ``None`` (no quantization), ``"w8a8_int8"``: routed-expert weights int8 with
            per-output-channel fp32 scales (made once at compile time), activations quantized per
            token; see :mod:`ep_fuse.passes.quant`. ``"fp8_block"``: routed-expert weights E4M3 with
            128 x 128 block scales (DeepSeek-V3's format; a model's own fp8 experts are used as they are),
            activations quantized per token and 128-channel group. Dense layers stay in their dtype.
        ep_fp8_dispatch: under ``quant="fp8_block"`` behind an ``all_to_all`` / ``deepep`` dispatch, the tokens
            are quantized before the dispatch (FP8 codes + scales on the wire); ``False`` sends them in their dtype
            and quantizes after (same result bit for bit; :mod:`ep_fuse.passes.ep_fp8_dispatch`).
        fold_attention_masks: an SDPA mask computed from sizes alone and proved causal (or true everywhere) becomes
            SDPA's own ``is_causal`` flag (or no mask), as in the model's eager path; see
            :mod:`ep_fuse.passes.attention_mask`.
        pack_gqa: one-query-row SDPA (decode) over K/V heads repeated for grouped-query attention (HF's
            ``repeat_kv`` or a reference implementation's repeat on ``[B, N, H, D]``) runs on the un-repeated K/V,
            each K/V head's query heads as its query rows (same rows, no repeat copy); see
            :mod:`ep_fuse.passes.attention_gqa`.
        ep_overlap_rules: extra measured rules (:class:`ep_fuse.passes.ep_overlap.OverlapRule`) that
            ``ep_overlap="auto"`` tries before the built-in :data:`ep_fuse.passes.ep_overlap.MEASURED_RULES`.
    """

    executor: str = "auto"
    patterns: tuple[str, ...] | None = None
    disable: tuple[str, ...] = ()
    providers: tuple[tuple[str, tuple[str, ...]], ...] = ()
    perf_guard: bool = True
    mode: str | None = None
    inductor_config: tuple[tuple[str, Any], ...] = ()
    dump_dir: str | None = None
    ep: bool = False
    ep_group: str | None = None
    ep_engine: str = "auto"
    ep_capacity: int | None = None
    ep_timeout_s: float = 300.0
    ep_overlap: str = "none"
    quant: str | None = None
    ep_fp8_dispatch: bool = True
    fold_attention_masks: bool = True
    pack_gqa: bool = True
    ep_overlap_rules: tuple[Any, ...] = ()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None, mode: str | None = None) -> EpFuseConfig:
        """Build a config from ``options`` (and ``torch.compile``'s ``mode``); fail on anything unknown."""
        options = dict(options or {})
        valid = [f.name for f in dataclasses.fields(cls)]
        for alias, name in ALIASES.items():
            if alias in options:
                if name in options and options[name] != options[alias]:
                    raise ConfigError(f"ep_fuse: {alias} is another name of {name}; give one of them "
                                      f"(got {alias}={options[alias]!r} and {name}={options[name]!r}).")
                options[name] = options.pop(alias)
        for key in options:
            if key not in valid:
                raise ConfigError(
                    f"ep_fuse: unknown option {key!r}.{_suggest(key, valid)} Valid options: {', '.join(valid)}."
                )
        if mode is not None and options.get("mode") not in (None, mode):
            raise ConfigError(f"ep_fuse: mode given twice ({mode!r} and options['mode']={options['mode']!r}).")
        if mode is not None:
            options["mode"] = mode
        options = {**env_defaults(skip=options), **options}
        return cls(**_normalise(options))

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ConfigError(f"ep_fuse: executor={self.executor!r} is not one of {', '.join(EXECUTORS)}.")
        if self.mode not in MODES:
            raise ConfigError(
                f"ep_fuse: mode={self.mode!r} is not one of {', '.join(repr(m) for m in MODES)}."
            )
        flags = ("perf_guard", "ep_fp8_dispatch", "fold_attention_masks", "pack_gqa")
        for flag in (*flags, *(name for name in SWITCHES if name != "npu_gmm_weight")):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"ep_fuse: {flag} must be True or False, got {getattr(self, flag)!r}.")
        if self.npu_gmm_weight not in NPU_GMM_WEIGHTS:
            raise ConfigError(f"ep_fuse: npu_gmm_weight={self.npu_gmm_weight!r} is not one of "
                              f"{', '.join(repr(m) for m in NPU_GMM_WEIGHTS)}.")
        for device, _order in self.providers:
            if device not in DEVICES:
                raise ConfigError(f"ep_fuse: providers has unknown device {device!r}; devices: {', '.join(DEVICES)}.")
        if not isinstance(self.ep_overlap_rules, tuple):
            raise ConfigError(f"ep_fuse: ep_overlap_rules must be a list of OverlapRule, got {self.ep_overlap_rules!r}.")
        if self.inductor_config:
            import torch._inductor.config as inductor_config

            known = list(inductor_config.get_config_copy())
            for key, _value in self.inductor_config:
                if key not in known:
                    raise ConfigError(
                        f"ep_fuse: unknown Inductor config {key!r} in inductor_config.{_suggest(key, known)} "
                        "See torch._inductor.config for the valid keys."
                    )
        if self.dump_dir is not None and not isinstance(self.dump_dir, str):
            raise ConfigError(f"ep_fuse: dump_dir must be a path string, got {self.dump_dir!r}.")
        self._validate_ep()
        if self.quant not in QUANT_MODES:
            raise ConfigError(
                f"ep_fuse: quant={self.quant!r} is not one of {', '.join(repr(q) for q in QUANT_MODES)}."
                f"{_suggest(str(self.quant), [q for q in QUANT_MODES if q])}"
            )

    def _validate_ep(self) -> None:
        if self.ep_group is not None and not isinstance(self.ep_group, str):
            if not hasattr(self.ep_group, "group_name"):
                raise ConfigError(f"ep_fuse: ep_group must be a torch.distributed ProcessGroup, got {self.ep_group!r}.")
            object.__setattr__(self, "ep_group", self.ep_group.group_name)
        if not isinstance(self.ep, bool):
            raise ConfigError(f"ep_fuse: ep must be True or False, got {self.ep!r}.")
        if not isinstance(self.ep_engine, str):
            raise ConfigError(f"ep_fuse: ep_engine must be an EP engine name, got {self.ep_engine!r}.")
        cap = self.ep_capacity
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
            raise ConfigError(f"ep_fuse: ep_capacity must be None or a positive number of tokens per rank, got {cap!r}.")
        t = self.ep_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise ConfigError(f"ep_fuse: ep_timeout_s must be a positive number of seconds, got {t!r}.")
        if self.ep_overlap not in EP_OVERLAP_MODES:
            raise ConfigError(
                f"ep_fuse: ep_overlap={self.ep_overlap!r} is not one of {', '.join(repr(m) for m in EP_OVERLAP_MODES)}."
                f"{_suggest(str(self.ep_overlap), list(EP_OVERLAP_MODES))}"
            )

    def check_names(self, *, patterns: Collection[str], providers: Collection[str],
                    engines: Collection[str]) -> EpFuseConfig:
        """Check the names only the loaded registry knows: ``patterns`` / ``disable`` against ``patterns``, the
        ``providers`` priority lists against ``providers``, ``ep_engine`` against ``"auto"`` and ``engines``
        (:func:`ep_fuse.catalog.known_names` gives all three). Returns ``self``; raises :class:`ConfigError`."""
        names = list(patterns)
        for field in ("patterns", "disable"):
            for name in getattr(self, field) or ():
                if name not in names:
                    raise ConfigError(
                        f"ep_fuse: {field} names unknown pattern {name!r}.{_suggest(name, names)} "
                        f"Known patterns: {', '.join(names)}."
                    )
        provs = list(providers)
        for device, order in self.providers:
            for p in order:
                if p not in provs:
                    raise ConfigError(
                        f"ep_fuse: providers[{device!r}] names unknown provider {p!r}.{_suggest(p, provs)} "
                        f"Known providers: {', '.join(provs)}."
                    )
        valid = ["auto", *engines]
        if self.ep_engine not in valid:
            raise ConfigError(
                f"ep_fuse: ep_engine={self.ep_engine!r} is not one of {', '.join(valid)}."
                f"{_suggest(str(self.ep_engine), valid)}"
            )
        return self

    @property
    def ep_backend(self) -> str:
        """The first name of :attr:`ep_engine` (kept for code written against it)."""
        return self.ep_engine

    @property
    def ep_requested(self) -> bool:
        """EP was asked for (``ep=True`` or an ``ep_group``); it runs where the group has > 1 rank."""
        return self.ep or self.ep_group is not None

    # ------------------------------------------------------------------ queries
    def pattern_enabled(self, name: str) -> bool:
        if name in self.disable:
            return False
        return self.patterns is None or name in self.patterns

    def provider_order(self, device: str) -> tuple[str, ...] | None:
        """User-given provider priority for ``device`` (``None``: the registry default)."""
        for dev, order in self.providers:
            if dev == device:
                return order
        return None

    def inductor_patches(self) -> dict[str, Any]:
        return dict(self.inductor_config)

    def cache_key(self) -> str:
        """The part of the config that changes how Inductor traces a rewritten graph beyond the graph's code
        (which launches it inlines, and how), for Inductor's cache keys: ``""`` at the defaults, else
        ``-no-<switch>...`` and/or ``-unverified`` (:data:`TRACE_SWITCHES`)."""
        off = [short for name, short in TRACE_SWITCHES if not getattr(self, name)]
        return (f"-no-{'-'.join(off)}" if off else "") + ("-unverified" if self.unverified_kernels else "")

    def compute_hash(self) -> str:
        """Stable hash of every option; part of cache keys and dump names."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True, default=repr)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


TRACE_SWITCHES = (("inline_in_inductor", "inline"), ("inline_symbolic", "symbolic"), ("size_branches", "branches"))
"""Switches that change what Inductor traces from a graph's ep_fuse ops, with their tag in
:meth:`EpFuseConfig.cache_key` (``unverified_kernels`` too: a launch's host code may pick a variant by it)."""


def env_defaults(skip: Collection[str] = ()) -> dict[str, Any]:
    """The option values the environment variables of :data:`ENV_DEFAULTS` set now (but for the fields in
    ``skip``, given explicitly)."""
    try:
        return runtime.env_defaults(skip)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def default_config() -> EpFuseConfig:
    """``EpFuseConfig.from_options({})``: the config run-time code follows outside any compile (direct op
    calls) -- the defaults, with the environment variables read now (one config per set of their values)."""
    return _default_config(tuple(os.environ.get(var) for var, _parse in ENV_DEFAULTS.values()))


@functools.lru_cache(maxsize=8)
def _default_config(_env: tuple[str | None, ...]) -> EpFuseConfig:
    return EpFuseConfig.from_options({})


def _normalise(options: dict[str, Any]) -> dict[str, Any]:
    """Turn user-friendly values (lists, dicts, single strings) into the frozen field types."""
    out = dict(options)
    for key in ("patterns", "disable"):
        if key in out and out[key] is not None:
            val = out[key]
            if isinstance(val, str):
                val = (val,)
            if not isinstance(val, (list, tuple, set, frozenset)):
                raise ConfigError(f"ep_fuse: {key} must be a list of pattern names, got {val!r}.")
            out[key] = tuple(val)
    if "providers" in out:
        val = out["providers"]
        if not isinstance(val, Mapping):
            raise ConfigError(
                f"ep_fuse: providers must map a device to a priority list, e.g. {{'cuda': ['triton', 'reference']}}; got {val!r}."
            )
        items = []
        for dev, order in val.items():
            if isinstance(order, str):
                order = (order,)
            if not isinstance(order, (list, tuple)):
                raise ConfigError(f"ep_fuse: providers[{dev!r}] must be a list of provider names, got {order!r}.")
            items.append((dev, tuple(order)))
        out["providers"] = tuple(sorted(items))
    if "inductor_config" in out:
        val = out["inductor_config"]
        if not isinstance(val, Mapping):
            raise ConfigError(f"ep_fuse: inductor_config must be a dict of Inductor config patches, got {val!r}.")
        out["inductor_config"] = tuple(sorted(val.items()))
    if isinstance(out.get("ep_overlap_rules"), list):
        out["ep_overlap_rules"] = tuple(out["ep_overlap_rules"])
    if out.get("mode") == "default":
        out["mode"] = None
    return out


def parse_key_values(pairs: list[str], flag: str) -> dict[str, Any]:
    """Command-line ``KEY=VALUE`` options (``flag``: the option's name, for the error) -> ep_fuse options; values
    are parsed as JSON where they are JSON, else kept as strings. Raises :class:`ConfigError` on a pair without
    ``=``."""
    import json

    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"{flag} takes KEY=VALUE (JSON values allowed), got {pair!r}")
        key, value = pair.split("=", 1)
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out
