"""The model's static settings: `ModelConfig`, what every module of `posattn.nn` is built from.

A frozen dataclass (hashable: safe as a jit static argument and inside a graphdef) with the
settings every model has, plus `settings`, the position family's own (`posattn.families`): a
`T5Settings` for T5, a `RopeSettings` for RoPE, ... A config file's `model` section is flat: it
holds every family's keys (`model.t5_max_distance`, `model.rope_base`, ...) and `from_keys`
reads the ones the chosen family declares. `validate` checks everything, before any compute, and
raises `ConfigError` naming the key, the value and what is allowed.

No ml_collections here: loading files and command lines is `posattn.config`'s job.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from typing import Any

from posattn import families
from posattn.attention import (
    FAR_IMPLEMENTATIONS,
    IMPLEMENTATIONS,
    SOFTCAP_IMPLEMENTATIONS,
    native,
)
from posattn.nn import pattern as pattern_lib

__all__ = ["ConfigError", "ModelConfig", "config_keys", "continuous_keys", "defaults", "describe"]


class ConfigError(ValueError):
    """An invalid configuration; the message names the key, the value and what is allowed."""


def _key(default: Any, help: str, continuous: str | None = None):
    return dataclasses.field(default=default, metadata={"help": help, "continuous": continuous})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static hyperparameters of a language model.

    Shape letters: V vocab, D d_model, N query heads, K key/value heads, H head dim, F d_ff.
    Every field but `settings` is the config key `model.<field>`; the family's own keys are read
    through `settings` (`cfg.settings.max_distance` is `model.t5_max_distance` of a T5 model).
    """

    position: str = _key("rope", "the position family (posattn.families)")
    kind: str = _key("decoder", "'decoder' (causal LM) or 'encoder' (bidirectional, masked bytes)")
    vocab_size: int = _key(256, "output vocabulary (256: bytes)")
    d_model: int = _key(128, "D, the residual stream's width")
    num_layers: int = _key(4, "transformer blocks")
    num_heads: int = _key(4, "N, query heads (head dim = d_model / num_heads unless head_dim)")
    num_kv_heads: int = _key(4, "K, key/value heads; must divide num_heads (1: multi-query)")
    d_ff: int = _key(0, "feed-forward width (0: 4 * d_model)")
    kv_share: int = _key(1, "cross-layer KV sharing: groups of kv_share layers read one K/V")
    dtype: str = _key("float32", "compute dtype, 'float32' or 'bfloat16' (softmax stays float32)")
    attention_impl: str = _key("auto", "posattn.attention implementation")
    init_scale: float = _key(
        1.0,
        "multiplies the std of every weight initialiser",
        continuous="the initial parameter values only",
    )
    # Memory and compile-time settings for large models (they leave the function computed alone).
    param_dtype: str = _key(
        "float32", "storage dtype of the parameters, 'float32' or 'bfloat16' (AdamW moments: f32)"
    )
    remat: str = _key(
        "none", "recompute each block in the backward: 'none', 'full', 'dots' (keep matmul outputs)"
    )
    scan_layers: bool = _key(False, "stack the blocks' parameters and run them by one lax.scan")
    layer_pattern: tuple = _key(
        (),
        "family entries cycled over the layers, e.g. ('rope:window=128', 'nope') "
        "(docs/training.md); empty: every layer model.position",
    )
    # Architecture switches (published checkpoints, docs/checkpoints.md); the defaults are
    # posattn's own model: RMSNorm, a tanh-GELU MLP, no biases, tied logits, sqrt(D) input scale.
    head_dim: int = _key(0, "H, one head's width (0: d_model / num_heads)")
    norm: str = _key("rms", "the norms: 'rms' (RMSNorm) or 'layer' (LayerNorm)")
    norm_eps: float = _key(1e-6, "the norms' epsilon")
    norm_bias: bool = _key(False, "a learned bias in every LayerNorm (model.norm='layer')")
    norm_unit_offset: bool = _key(False, "norms scale by 1 + w (Gemma), w starting at 0")
    mlp: str = _key("plain", "'plain' act(x W1) W2 or 'gated' (act(x W1) * x W3) W2")
    activation: str = _key(
        "gelu_tanh", "the MLP's activation: 'gelu_tanh', 'gelu' (exact), 'silu', 'relu'"
    )
    bias: str = _key(
        "none", "linear-layer biases: 'none', 'qkv' (q/k/v only), 'attn' (q/k/v/o), 'all'"
    )
    parallel_residual: bool = _key(False, "x + attn(norm1(x)) + mlp(norm2(x)) (GPT-NeoX)")
    post_norms: bool = _key(
        False, "a norm on each branch's output before its residual add (Gemma 2 and 3)"
    )
    qk_norm: bool = _key(
        False, "a norm over each head's query and key, before RoPE (Gemma 3, Qwen3)"
    )
    query_pre_attn_scalar: float = _key(
        0.0, "logits scaled by this ** -0.5 instead of head_dim ** -0.5 (Gemma); 0: head_dim"
    )
    attn_logit_softcap: float = _key(
        0.0, "attention logits capped as c*tanh(s/c) before the position bias (Gemma 2); 0: none"
    )
    final_logit_softcap: float = _key(0.0, "output logits capped as c*tanh(z/c) (Gemma 2); 0: none")
    tie_embeddings: bool = _key(True, "logits from the input embedding (False: a separate head)")
    embed_scale: str = _key("sqrt_d", "input embeddings times 'sqrt_d' (sqrt(d_model)) or 'one'")
    embed_norm: bool = _key(False, "a norm right after the input embedding (BLOOM)")
    init_from: str = _key("", "start from a published checkpoint: 'hf:PATH' (posattn.hf)")
    # The family's settings, filled with its defaults when not given (not a config key itself).
    settings: families.Settings | None = dataclasses.field(default=None, metadata={"key": False})

    def __post_init__(self):
        try:
            object.__setattr__(self, "layer_pattern", pattern_lib.as_pattern(self.layer_pattern))
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e)) from None
        # `head_dim` reads as H itself; 0 (the key's default: d_model / num_heads) is kept for
        # `keys()`, so that a copy with another d_model or num_heads derives its own H.
        self.__dict__["_head_dim_key"] = self.head_dim
        d, n = self.d_model, self.num_heads
        if self.head_dim == 0 and _ints(d, n) and n > 0 and d % n == 0:
            object.__setattr__(self, "head_dim", d // n)
        family = families.get(self.position)
        if self.settings is None:
            object.__setattr__(self, "settings", family.settings())
        elif type(self.settings) is not family.settings:
            raise TypeError(
                f"model.position={self.position!r} takes {family.settings.__name__}, got "
                f"{type(self.settings).__name__}"
            )

    # ---- Derived values. ----
    @property
    def arch(self):
        """The blocks' architecture switches (`posattn.nn.layers.Arch`)."""
        from posattn.nn.layers import Arch

        return Arch(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Arch)})

    @property
    def ff_dim(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def causal(self) -> bool:
        return self.kind == "decoder"

    @property
    def family(self) -> families.Family:
        return families.get(self.position)

    @property
    def layers(self) -> tuple[pattern_lib.LayerSpec, ...]:
        """Each layer's position settings: `model.layer_pattern` cycled, or `position`'s."""
        try:
            return pattern_lib.layer_specs(
                self.layer_pattern,
                num_layers=self.num_layers,
                position=self.position,
                settings=self.settings,
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def not_continuous(self) -> dict[str, str]:
        """Continuous keys these settings make static (of the family and of every layer)."""
        out = dict(self.settings.not_continuous())
        if self.layer_pattern:
            for spec in self.layers:
                out.update(spec.settings.not_continuous())
        return out

    @property
    def context(self) -> families.Context:
        """What the family's functions may read of this model."""
        return families.Context(
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            bidirectional=not self.causal,
            init_scale=self.init_scale,
        )

    @property
    def max_positions(self) -> int | None:
        """The most positions the family gives a signal (a learned table's rows), None: any."""
        return self.settings.max_positions

    # ---- Flat config keys. ----
    @classmethod
    def from_keys(cls, values: Mapping[str, Any] | None = None, /, **more: Any) -> ModelConfig:
        """The config of a flat `model` section (or keyword arguments); does not validate.

        Keys of families other than `position`'s are known but ignored, except an `exclusive` one
        set away from its default (a user who sets `rope_scaling` means RoPE). An unknown key is a
        ConfigError with the closest known ones.
        """
        values = {**dict(values or {}), **more}
        known = config_keys()
        for name in values:
            if name not in known:
                close = difflib.get_close_matches(name, list(known), n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise ConfigError(
                    f"unknown config key config.model.{name}; known keys: "
                    f"{', '.join(sorted(known))}{hint}"
                )
        position = values.get("position", cls.position)
        if position not in families.names():
            raise ConfigError(
                f"config.model.position={position!r} is not a known position family; known: "
                f"{', '.join(families.names())}"
            )
        settings_cls = families.get(position).settings
        own = settings_cls.keys()
        for name, f in families.keys().items():
            exclusive = f.metadata.get("exclusive")
            if exclusive and name not in own and values.get(name, f.default) != f.default:
                readers = families.owners(name)
                raise ConfigError(
                    f"config.model.{name}={values[name]!r} is set but config.model.position="
                    f"{position!r} does not read it (read by {', '.join(map(repr, readers))}); "
                    f"set model.position to one of those or model.{name} to {f.default!r}"
                )
        common = {k: v for k, v in values.items() if k in _COMMON}
        try:
            settings = settings_cls.from_keys(values)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config.model ({position} settings): {e}") from None
        return cls(**common, settings=settings)

    def keys(self) -> dict[str, Any]:
        """The flat `model` section of this config (the family's keys only)."""
        common = {name: getattr(self, name) for name in _COMMON}
        common["head_dim"] = self.__dict__.get("_head_dim_key", self.head_dim)
        return {**common, **self.settings.to_keys()}

    def replace(self, **values: Any) -> ModelConfig:
        """A copy with flat config keys changed (`cfg.replace(rope_scaling=None, d_model=64)`)."""
        return ModelConfig.from_keys({**self.keys(), **values})

    # ---- Validation. ----
    def validate(self) -> ModelConfig:
        """Checks every setting (the family's through its own `validate`); returns self."""
        if self.kind not in ("decoder", "encoder"):
            _fail("kind", self.kind, "allowed: 'decoder', 'encoder'")
        for name in (
            "vocab_size",
            "d_model",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "kv_share",
        ):
            _check_int(name, getattr(self, name), allow_zero=False)
        _check_int("d_ff", self.d_ff, allow_zero=True)
        _check_int("head_dim", self.head_dim, allow_zero=True)
        if not self.head_dim and self.d_model % self.num_heads:
            _fail(
                "d_model",
                self.d_model,
                f"must be divisible by model.num_heads={self.num_heads} "
                "(head dim = d_model / num_heads), or set model.head_dim",
            )
        self._validate_arch()
        if self.num_heads % self.num_kv_heads:
            _fail(
                "num_kv_heads",
                self.num_kv_heads,
                f"must divide model.num_heads={self.num_heads} "
                "(grouped-query attention; 1 is multi-query)",
            )
        if self.num_layers % self.kv_share:
            _fail(
                "kv_share",
                self.kv_share,
                f"must divide model.num_layers={self.num_layers} "
                "(layers share K/V in groups of kv_share)",
            )
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16"):
                _fail(name, getattr(self, name), "allowed: 'float32', 'bfloat16'")
        if self.remat not in ("none", "full", "dots"):
            _fail(
                "remat",
                self.remat,
                "allowed: 'none', 'full' (recompute each block), 'dots' (keep its matmul outputs)",
            )
        if not isinstance(self.scan_layers, bool):
            _fail("scan_layers", self.scan_layers, "must be True or False")
        if self.scan_layers and self.kv_share != 1:
            raise ConfigError(
                f"config.model.kv_share={self.kv_share} is not supported with "
                "config.model.scan_layers=True (a scanned stack needs identical layers, and a "
                "layer "
                "that reads another's keys/values has no key/value projections); set "
                "model.kv_share=1 or model.scan_layers=False"
            )
        if self.attention_impl not in IMPLEMENTATIONS:
            _fail("attention_impl", self.attention_impl, "allowed: " + _listing(IMPLEMENTATIONS))
        if self.attn_logit_softcap and self.attention_impl not in SOFTCAP_IMPLEMENTATIONS:
            _fail(
                "attention_impl",
                self.attention_impl,
                f"soft-capped attention logits (model.attn_logit_softcap="
                f"{self.attn_logit_softcap}) run in {_listing(SOFTCAP_IMPLEMENTATIONS)} only",
            )
        remaps = [s.settings.remap_dict for s in self.layers if getattr(s.settings, "remap", None)]
        if remaps and self.attention_impl not in FAR_IMPLEMENTATIONS:
            _fail(
                "attention_impl",
                self.attention_impl,
                f"a RoPE remap (model.rope_remap={remaps[0]!r}) scores its far pairs with a "
                f"second query/key pair, which {_listing(FAR_IMPLEMENTATIONS)} compute",
            )
        if self.attention_impl == "native":
            if self.head_dim not in native.HEAD_DIMS:
                _fail(
                    "attention_impl",
                    "native",
                    f"the native kernel takes head dims {native.HEAD_DIMS}, this model has "
                    f"{self.head_dim}; use 'auto'",
                )
            reason = native.why_unavailable()
            if reason is not None:
                _fail("attention_impl", "native", f"cannot run here: {reason}; use 'auto'")
        value = self.init_scale
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and value > 0):
            _fail("init_scale", value, "must be a positive finite number")
        try:
            self.settings.validate(self.context)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        try:
            pattern_lib.validate(self)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return self

    def _validate_arch(self) -> None:
        choices = {
            "norm": ("rms", "layer"),
            "mlp": ("plain", "gated"),
            "activation": ACTIVATIONS,
            "bias": ("none", "qkv", "attn", "all"),
            "embed_scale": ("sqrt_d", "one"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                _fail(name, getattr(self, name), "allowed: " + _listing(allowed))
        for name in (
            "norm_bias",
            "norm_unit_offset",
            "parallel_residual",
            "post_norms",
            "qk_norm",
            "tie_embeddings",
            "embed_norm",
        ):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "must be True or False")
        for name in ("attn_logit_softcap", "final_logit_softcap"):
            cap = getattr(self, name)
            if not (_number(cap) and math.isfinite(cap) and cap >= 0):
                _fail(name, cap, "must be 0 (no soft-capping) or a positive finite number")
        scalar = self.query_pre_attn_scalar
        if not (_number(scalar) and math.isfinite(scalar) and scalar >= 0):
            _fail(
                "query_pre_attn_scalar",
                scalar,
                "must be 0 (logits scaled by head_dim ** -0.5) or a positive finite number",
            )
        eps = self.norm_eps
        if not (_number(eps) and math.isfinite(eps) and eps > 0):
            _fail("norm_eps", eps, "must be a positive finite number")
        if self.norm_bias and self.norm != "layer":
            _fail("norm_bias", self.norm_bias, "a norm bias needs model.norm='layer'")
        if not isinstance(self.init_from, str) or (
            self.init_from and not (self.init_from.startswith("hf:") and len(self.init_from) > 3)
        ):
            _fail("init_from", self.init_from, "must be '' or 'hf:PATH' (a Hugging Face directory)")

    def check_length(self, length: int, key: str) -> None:
        """Raises ConfigError naming `key` if the family cannot read `length` positions."""
        try:
            self.settings.check_length(length)
        except ValueError as e:
            raise ConfigError(
                f"config.{key}={length} is too long for model.position={self.position!r}: {e}"
            ) from None


# model.activation's values (posattn.nn.layers.ACTIVATIONS holds their functions).
ACTIVATIONS = ("gelu_tanh", "gelu", "silu", "relu")

_COMMON = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.metadata.get("key", True))


def _listing(values) -> str:
    return ", ".join(repr(v) for v in values)


def _fail(name: str, value: Any, allowed: str):
    raise ConfigError(f"config.model.{name}={value!r} is invalid: {allowed}")


def _ints(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(name: str, value: Any, *, allow_zero: bool) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not (ok and (value >= 0 if allow_zero else value > 0)):
        _fail(
            name, value, "must be an integer >= 0" if allow_zero else "must be a positive integer"
        )


def config_keys() -> dict[str, dataclasses.Field]:
    """Every `model.*` config key -> its field: the common ones, then each family's."""
    common = {f.name: f for f in dataclasses.fields(ModelConfig) if f.name in _COMMON}
    clash = set(common) & set(families.keys())
    if clash:
        raise RuntimeError(f"family settings redeclare model keys {sorted(clash)}")
    return {**common, **families.keys()}


def defaults() -> dict[str, Any]:
    """The `model` section's defaults: every key, each default written once, in its dataclass."""
    return {name: f.default for name, f in config_keys().items()}


def describe() -> dict[str, str]:
    """`model.*` key -> a help line (a family key names the families that read it)."""
    out = {}
    for name, f in config_keys().items():
        readers = families.owners(name)
        help = f.metadata.get("help", "")
        if name == "position":
            help += ": " + ", ".join(families.names())
        out[name] = f"[{', '.join(readers)}] {help}" if readers else help
    return out


def continuous_keys() -> dict[str, str]:
    """`model.*` keys a vmap sweep may stack -> why they leave the compiled program alone."""
    common = {
        name: f.metadata["continuous"]
        for name, f in config_keys().items()
        if name in _COMMON and f.metadata.get("continuous")
    }
    return {**common, **families.continuous_keys()}
