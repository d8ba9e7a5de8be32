"""The registry: where a position family's name becomes its functions and its settings.

A family is some combination of three things, and the attention core never knows which:
  * an input embedding added to the token embeddings (`"sinusoidal"`, `"learned"`);
  * a q/k transform (`rotary=True`: RoPE and its scalings, applied by the attention layer);
  * an additive bias function of positions, `BiasFn(params, q_pos: int[t], k_pos: int[s]) ->
    float32[N, t, s]`, passed to `posattn.attention.attention` as `(fn, params)` so the core can
    evaluate it tile by tile and gradients reach `params`.

Each family owns its settings: a frozen `Settings` dataclass whose fields are config keys under
`model.` (`T5Settings.num_buckets` is `model.t5_num_buckets`), with their defaults, help texts, and
a `validate` that names the key, the value and what is allowed. Adding a family means writing its
pure functions, its settings class and one `register(...)` call here; the config defaults, the
command-line help and the keys a sweep may stack are derived from the registry, and nothing else
in the code branches on a family's name.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from posattn import positions, rotary

__all__ = [
    "AlibiSettings",
    "BiasSpec",
    "BoundBias",
    "Context",
    "Family",
    "FireSettings",
    "ForgetSpec",
    "LearnedSettings",
    "RopeSettings",
    "NORMALIZERS",
    "PathSettings",
    "SandwichSettings",
    "Settings",
    "StickBreakingSettings",
    "CopeSettings",
    "T5Settings",
    "continuous_keys",
    "get",
    "keys",
    "names",
    "owners",
    "register",
    "setting",
]

Array = jax.Array
Params = Mapping[str, Array]
BiasFn = Callable[[Params, Array, Array], Array]


# ----------------------------------------------------------------------------------------------
# Settings.


@dataclasses.dataclass(frozen=True)
class Context:
    """What a family may read of the model around it (hashable). N = num_heads, H = head_dim.

    Attributes:
      num_heads: N, query heads (one bias row per head).
      head_dim: H.
      bidirectional: an encoder (T5's buckets then distinguish past and future).
      init_scale: multiplies the std of every weight initialiser (`model.init_scale`).
    """

    num_heads: int
    head_dim: int
    bidirectional: bool = False
    init_scale: float = 1.0


def setting(
    default: Any,
    *,
    help: str,
    continuous: str | None = None,
    exclusive: bool = False,
    key: str | None = None,
):
    """A field of a `Settings` class: its default and what the command-line help says about it.

    Args:
      default: the value a config takes unless it sets the key.
      help: one line for `--help`.
      continuous: why a vmap sweep may stack different values of it in one compiled program (it
        only changes array values: a constant in the state, an initial value), or None when it
        changes shapes or the traced program.
      exclusive: a value other than the default is refused while another family is in use (it
        would be silently ignored, and a user who sets it means this family).
      key: the config key (under `model.`) when it is not the class's prefix + the field's name:
        a key another family declares too (`max_len`), read here with the same default.
    """
    return dataclasses.field(
        default=default,
        metadata={"help": help, "continuous": continuous, "exclusive": exclusive, "key": key},
    )


def _invalid(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"config.model.{key}={value!r} is invalid: {allowed}")


@dataclasses.dataclass(frozen=True)
class Settings:
    """A family's static settings (hashable: they reach the model's graph, which keys jit caches).

    Field `f` of a subclass is the config key `model.<prefix><f>`, or the key its `setting` names.
    The base class has no fields: the settings of a family that has nothing to set.
    """

    prefix: ClassVar[str] = ""

    @classmethod
    def keys(cls) -> dict[str, dataclasses.Field]:
        """Config key (under `model.`) -> its dataclass field."""
        return {cls._field_key(f): f for f in dataclasses.fields(cls)}

    @classmethod
    def _field_key(cls, f: dataclasses.Field) -> str:
        return f.metadata.get("key") or cls.prefix + f.name

    @classmethod
    def from_keys(cls, values: Mapping[str, Any]) -> Settings:
        """The settings read from flat `model.*` values; keys it does not declare are ignored."""
        return cls(**{f.name: values[key] for key, f in cls.keys().items() if key in values})

    def to_keys(self) -> dict[str, Any]:
        """Config key (under `model.`) -> value, as a config file would write it."""
        return {key: getattr(self, f.name) for key, f in self.keys().items()}

    def validate(self, ctx: Context) -> None:
        """Raises ValueError naming the config key, the value and what is allowed."""
        del ctx

    @property
    def max_positions(self) -> int | None:
        """The most positions this family gives a signal (0..max_positions-1); None: any."""
        return None

    def check_length(self, length: int) -> None:
        """Raises ValueError if this family cannot give positions 0..length-1 a signal."""
        del length

    def not_continuous(self) -> dict[str, str]:
        """Keys marked continuous that these particular settings make static, with the reason."""
        return {}

    # Checks for subclasses' validate.
    def _key(self, name: str) -> str:
        return self._field_key(next(f for f in dataclasses.fields(self) if f.name == name))

    def _positive_int(self, name: str) -> None:
        value = getattr(self, name)
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise _invalid(self._key(name), value, "must be a positive integer")

    def _positive_number(self, name: str) -> None:
        value = getattr(self, name)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (ok and math.isfinite(value) and value > 0):
            raise _invalid(self._key(name), value, "must be a positive finite number")


@dataclasses.dataclass(frozen=True)
class RopeSettings(Settings):
    """RoPE (Su et al. 2021): the frequency base, a Hugging Face `rope_scaling`, the pair layout,
    and partial or proportional rotation (docs/rope.md).

    `scaling` is kept as a sorted tuple of (key, value) items, lists as tuples (hashable);
    `scaling_dict` is the dictionary, and `rope_parameters` the dict `rotary.rope_frequencies`
    takes: `scaling` with `partial_factor` / `proportion` folded in. Every rotary family's
    settings are (or extend) these: the attention layer's `Rotary` reads them.
    """

    prefix: ClassVar[str] = "rope_"
    base: float = setting(
        10000.0,
        help="RoPE frequency base: theta_k = base^(-2k/H)",
        continuous="the RoPE inverse frequencies, a Constant in the state",
    )
    scaling: Any = setting(
        None,
        help="None or a Hugging Face rope_scaling dict, e.g. "
        "{'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 512}",
        exclusive=True,
    )
    layout: str = setting(
        "interleaved",
        help="pairs rotated together: 'interleaved' (x0, x1) or 'half' (x_k, x_k+H/2)",
    )
    partial_factor: float = setting(
        1.0,
        help="partial rotary p (GPT-NeoX rotary_pct, HF partial_rotary_factor): RoPE turns the "
        "first int(p H) dims of each head with frequencies over them; the rest pass through",
        exclusive=True,
    )
    proportion: float = setting(
        1.0,
        help="proportional RoPE p (Gemma 4 p-RoPE, HF rope_type 'proportional'): frequencies "
        "over the whole head, only the int(p H // 2) fastest pairs turn",
        exclusive=True,
    )
    remap: Any = setting(
        None,
        help="None or an eval-time position remap for the pairs at distance >= window: "
        "{'type': 'rerope', 'window': w} (ReRoPE) or {'type': 'self_extend', 'window': w, "
        "'group': g} (SelfExtend)",
        exclusive=True,
    )

    def __post_init__(self):
        for name in ("scaling", "remap"):
            value = getattr(self, name)
            if value is not None and hasattr(value, "keys"):
                items = tuple(
                    sorted(
                        (k, tuple(v) if isinstance(v, list) else v)  # LongRoPE's factor lists
                        for k, v in ((k, value[k]) for k in value.keys())
                    )
                )
                object.__setattr__(self, name, items)

    @property
    def scaling_dict(self) -> dict[str, Any] | None:
        return None if self.scaling is None else dict(self.scaling)

    @property
    def remap_dict(self) -> dict[str, Any] | None:
        return None if self.remap is None else dict(self.remap)

    @property
    def rope_parameters(self) -> dict[str, Any] | None:
        """`scaling` with `partial_factor` / `proportion` folded in as Hugging Face's
        `partial_rotary_factor` (transformers 5 `rope_parameters`); None for plain RoPE."""
        params = self.scaling_dict
        if self.partial_factor != 1:
            params = {**(params or {}), rotary.PARTIAL_KEY: self.partial_factor}
        if self.proportion != 1:
            params = {k: v for k, v in (params or {}).items() if k != "type"}
            params.update(rope_type="proportional", **{rotary.PARTIAL_KEY: self.proportion})
        return params

    def to_keys(self) -> dict[str, Any]:
        return {
            **super().to_keys(),
            self._key("scaling"): self.scaling_dict,
            self._key("remap"): self.remap_dict,
        }

    def validate(self, ctx: Context) -> None:
        self._positive_number("base")
        if self.layout not in rotary.LAYOUTS:
            raise _invalid(
                self._key("layout"), self.layout, "allowed: " + ", ".join(map(repr, rotary.LAYOUTS))
            )
        if ctx.head_dim % 2:
            raise ValueError(
                f"config.model.d_model gives an odd head dim {ctx.head_dim} (d_model / num_heads); "
                "RoPE rotates pairs and needs an even head dim"
            )
        if self.scaling is not None and not isinstance(self.scaling, tuple):
            raise _invalid(
                self._key("scaling"),
                self.scaling,
                "must be None or a Hugging Face rope_scaling dict such as "
                "{'rope_type': 'linear', 'factor': 4.0, 'original_max_position_embeddings': 512}",
            )
        scaling = self.scaling_dict or {}
        kind = rotary.rope_kind(self.scaling_dict)
        for name in ("partial_factor", "proportion"):
            value = getattr(self, name)
            if value == 1 and not isinstance(value, bool):
                continue
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (ok and 0 < value < 1):
                raise _invalid(self._key(name), value, "must be a number in (0, 1]")
            if scaling.get(rotary.PARTIAL_KEY, value) != value:
                raise _invalid(
                    self._key(name),
                    value,
                    f"model.{self._key('scaling')} says {rotary.PARTIAL_KEY}="
                    f"{scaling[rotary.PARTIAL_KEY]!r}; set one of the two",
                )
        if self.partial_factor != 1 and self.proportion != 1:
            raise _invalid(
                self._key("partial_factor"),
                self.partial_factor,
                f"partial rotary (first int(p H) dims) and model.{self._key('proportion')}="
                f"{self.proportion!r} (proportional RoPE) are two different rotations; set one",
            )
        if self.partial_factor != 1 and kind == "proportional":
            raise _invalid(
                self._key("partial_factor"),
                self.partial_factor,
                "with rope_scaling type 'proportional' the fraction is proportional RoPE's: use "
                f"model.{self._key('proportion')}",
            )
        if self.proportion != 1 and kind not in ("default", "proportional"):
            raise _invalid(
                self._key("proportion"),
                self.proportion,
                f"proportional RoPE has no {kind!r} scaling (Hugging Face's takes only a linear "
                "'factor'); use model.rope_scaling=None or "
                "{'rope_type': 'proportional', 'factor': s}",
            )
        if self.remap is not None:
            try:
                if not isinstance(self.remap, tuple):
                    raise ValueError("must be None or a dict")
                rotary.validate_rope_remap(self.remap_dict)
            except ValueError as e:
                raise _invalid(
                    self._key("remap"),
                    self.remap_dict if isinstance(self.remap, tuple) else self.remap,
                    f"{e}",
                ) from None
        if self.rope_parameters is not None:
            where = f"config.model.{self._key('scaling')}"
            for name in ("partial_factor", "proportion"):
                if getattr(self, name) != 1:
                    where += f" with model.{self._key(name)}={getattr(self, name)!r}"
            try:
                rotary.validate_rope_scaling(self.rope_parameters, ctx.head_dim)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None

    def not_continuous(self) -> dict[str, str]:
        kind = rotary.rope_kind(self.rope_parameters)
        if kind in rotary.LENGTH_DEPENDENT:
            return {
                self._key("base"): f"with rope_scaling type {kind!r}, the frequencies are "
                "recomputed from the base and the current length inside the program"
            }
        return {}


@dataclasses.dataclass(frozen=True)
class LearnedSettings(Settings):
    """Learned absolute embeddings: a table of `max_len` rows, and nothing past it."""

    max_len: int = setting(
        1024,
        help="the longest sequence: the learned position table's size (and CoPE's default table, "
        "max_len + 1 positions)",
    )

    def validate(self, ctx: Context) -> None:
        self._positive_int("max_len")

    @property
    def max_positions(self) -> int:
        return self.max_len

    def check_length(self, length: int) -> None:
        if length > self.max_len:
            raise ValueError(
                f"{length} positions exceed config.model.max_len={self.max_len}, the learned "
                "position table's size (it has no row past it); raise model.max_len or use "
                "fewer positions"
            )


@dataclasses.dataclass(frozen=True)
class T5Settings(Settings):
    """T5's log-spaced relative buckets (Raffel et al. 2020)."""

    prefix: ClassVar[str] = "t5_"
    num_buckets: int = setting(32, help="relative-position buckets (split by direction if encoder)")
    max_distance: int = setting(128, help="distance where the last log-spaced bucket starts")

    def validate(self, ctx: Context) -> None:
        self._positive_int("num_buckets")
        self._positive_int("max_distance")
        buckets = self.num_buckets // (2 if ctx.bidirectional else 1)
        if buckets < 2 or (ctx.bidirectional and self.num_buckets % 2):
            raise _invalid(
                self._key("num_buckets"),
                self.num_buckets,
                "needs at least 2 buckets per direction (an even number for the encoder)",
            )
        if self.max_distance <= buckets // 2:
            raise _invalid(
                self._key("max_distance"),
                self.max_distance,
                f"must exceed the exact-bucket range num_buckets//2={buckets // 2} "
                "(the log-spaced buckets cover max_exact..max_distance)",
            )


@dataclasses.dataclass(frozen=True)
class AlibiSettings(Settings):
    """ALiBi (Press et al. 2022): `slope_scale` multiplies the paper's geometric slopes."""

    prefix: ClassVar[str] = "alibi_"
    slope_scale: float = setting(
        1.0,
        help="multiplies ALiBi's geometric slopes (1.0 is the paper)",
        continuous="the ALiBi slopes, a Constant in the state",
    )

    def validate(self, ctx: Context) -> None:
        self._positive_number("slope_scale")


COPE_GATES = ("keys", "values", "separate")


@dataclasses.dataclass(frozen=True)
class CopeSettings(Settings):
    """CoPE (Golovneva et al. 2024): the size of each layer's table of position embeddings and
    the scale of its logits."""

    prefix: ClassVar[str] = "cope_"
    positions: int = setting(
        0,
        help="P, the position embeddings of each layer's table: contextual positions are clamped "
        "to P - 1; 0: model.max_len + 1 (the reference's default, the block size + 1)",
    )
    scale_positions: bool = setting(
        True,
        help="the position logits q.e(p) scaled by 1/sqrt(H) with q.k (True, the reference's "
        "default) or added unscaled (False, its --cope-nodiv and the paper's listing)",
    )
    gates: str = setting(
        "keys",
        help="what each query's gates read: 'keys' (sigmoid(q.k / sqrt(H)), the reference's "
        "default), 'values' (sigmoid(q.v / sqrt(H)), its --cope-val-gates) or 'separate' (a key "
        "projection of their own, its --cope-sep-key)",
    )
    max_len: int = setting(1024, help="the training length (sets the default P)", key="max_len")

    @property
    def table_size(self) -> int:
        """P: `positions`, or max_len + 1."""
        return self.positions or self.max_len + 1

    def validate(self, ctx: Context) -> None:
        self._positive_int("max_len")
        value = self.positions
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            raise _invalid(
                self._key("positions"), value, "must be an integer >= 0 (0: max_len + 1)"
            )
        if self.gates not in COPE_GATES:
            raise _invalid(
                self._key("gates"), self.gates, f"must be one of {', '.join(map(repr, COPE_GATES))}"
            )
        if not isinstance(self.scale_positions, bool):
            raise _invalid(
                self._key("scale_positions"), self.scale_positions, "must be True or False"
            )


@dataclasses.dataclass(frozen=True)
class PathSettings(Settings):
    """PaTH (Yang et al. 2025): how each layer makes its reflections' directions w."""

    prefix: ClassVar[str] = "path_"
    w_rank: int = setting(
        32,
        help="the inner width of w's low-rank projection D -> r -> K*H where every query head "
        "has its own key head (the reference's 32); 0: one D x K*H projection, which a model "
        "with fewer key heads than query heads always uses, as the reference does",
    )
    conv: bool = setting(
        True,
        help="w through a causal depthwise convolution of width 3 and SiLU before its L2 norm "
        "(True, the reference's use_w_shortconv) or straight from the projection (False)",
    )

    def validate(self, ctx: Context) -> None:
        value = self.w_rank
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            raise _invalid(
                self._key("w_rank"), value, "must be an integer >= 0 (0: a full projection)"
            )
        if not isinstance(self.conv, bool):
            raise _invalid(self._key("conv"), self.conv, "must be True or False")


@dataclasses.dataclass(frozen=True)
class StickBreakingSettings(Settings):
    """Stick-breaking attention (Tan et al. 2025): where the stick the keys leave goes."""

    prefix: ClassVar[str] = "stick_breaking_"
    remainder: str = setting(
        "current",
        help="what the keys leave of each query's stick weights: 'current' (its own value, the "
        "reference tests' o + rem * v: rows sum to 1) or 'none' (dropped)",
    )
    logit_bias: float = setting(
        0.0,
        help="a constant b added to every logit before the sigmoid (0: the paper's); b < 0 gives "
        "each key a smaller share at initialisation, so the stick reaches ~1/sigmoid(b) keys back",
    )

    def validate(self, ctx: Context) -> None:
        from posattn.attention.stickbreaking import REMAINDERS

        if self.remainder not in REMAINDERS:
            raise _invalid(
                self._key("remainder"), self.remainder, f"must be one of {', '.join(REMAINDERS)}"
            )
        bias = self.logit_bias
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise _invalid(self._key("logit_bias"), bias, "must be a finite number")


@dataclasses.dataclass(frozen=True)
class KerpleSettings(Settings):
    """Kerple (Chi et al. 2022): whether each layer learns its own (r1, r2)."""

    prefix: ClassVar[str] = "kerple_"
    per_layer: bool = setting(
        False,
        help="one (r1, r2) per layer; False: one set for the whole stack, as the reference code",
    )

    def validate(self, ctx: Context) -> None:
        if not isinstance(self.per_layer, bool):
            raise _invalid(self._key("per_layer"), self.per_layer, "must be True or False")


@dataclasses.dataclass(frozen=True)
class SandwichSettings(Settings):
    """Sandwich (Chi et al. 2023): d-bar, the dimension of the two sinusoidal embeddings."""

    prefix: ClassVar[str] = "sandwich_"
    dim: int = setting(
        0,
        help="d-bar, the sinusoids' dimension (even; the bias sums d-bar/2 cosines); 0: the head "
        "dim, as the NeMo implementation",
    )

    def validate(self, ctx: Context) -> None:
        if not (isinstance(self.dim, int) and not isinstance(self.dim, bool) and self.dim >= 0):
            raise _invalid(self._key("dim"), self.dim, "must be 0 (the head dim) or an even int")
        if self.dim % 2:
            raise _invalid(self._key("dim"), self.dim, "must be even (d-bar/2 cosines)")
        if not self.dim and ctx.head_dim % 2:
            raise ValueError(
                f"config.model.d_model gives an odd head dim {ctx.head_dim}; Sandwich sums d'/2 "
                "cosines and needs an even head dim (or set config.model.sandwich_dim to an even "
                "d-bar)"
            )

    def bar_dim(self, ctx: Context) -> int:
        """d-bar: `dim`, or the head dim when it is 0."""
        return self.dim or ctx.head_dim


@dataclasses.dataclass(frozen=True)
class FireSettings(Settings):
    """FIRE (Li et al. 2024): the MLP's width, the initial values of c and of the threshold L."""

    prefix: ClassVar[str] = "fire_"
    mlp_width: int = setting(32, help="hidden width of FIRE's MLP 1 -> width -> N")
    init_c: float = setting(
        0.1,
        help="initial value of FIRE's learned c in psi(x) = log(c x + 1)",
        continuous="the initial value of FIRE's learned c",
    )
    init_L: float = setting(512.0, help="initial threshold L (learned as a multiplier of it)")
    norm_cap: int = setting(
        0,
        help="0 (the paper): the normaliser psi(max(L, i)) grows with the query position i; "
        "n > 0: it stops at i = n, psi(max(L, min(i, n))) (a diagnostic, not in the paper)",
    )

    def validate(self, ctx: Context) -> None:
        self._positive_int("mlp_width")
        self._positive_number("init_c")
        self._positive_number("init_L")
        cap = self.norm_cap
        if not (isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0):
            raise _invalid(
                self._key("norm_cap"),
                cap,
                "must be 0 (the normaliser grows with the query position, as in the paper) or "
                "a positive integer query position where it stops growing",
            )


# ----------------------------------------------------------------------------------------------
# Families and the registry.


@dataclasses.dataclass(frozen=True)
class BiasSpec:
    """How a relative-bias family makes, constrains and evaluates its parameters.

    Attributes:
      init: `(key, ctx, settings) -> {name: array}`, the initial values.
      fn: `(params, q_pos, k_pos, ctx, settings) -> float32[N, t, s]`, a pure bias function.
      trainable: whether the values are learned (`nnx.Param`) or fixed constants (ALiBi slopes).
      bounds: `{name: (low, high)}` a value is projected into after every optimiser step and at
        initialisation, as the reference code clamps its parameters' data in place.
      shared_across_layers: one bias for the whole stack (T5) or one per layer; a callable
        `(settings) -> bool` when a setting decides (Kerple). Ask `shared(settings)`.
      relative: the bias depends on `i - j` only (adding one shift to every query and key
        position leaves it unchanged), so a sliding window's ring-buffer cache may renumber
        positions (posattn.nn.window); False for FIRE, whose normaliser reads `i` itself.
      tabulate: a kernel that materialises the [T, S] bias evaluates it once per offset `i - j`
        (T + S - 1 of them) and gathers (`posattn.attention.masks.masked_logit_bias`): the same
        values, for a relative bias that costs far more per offset than a gather (Sandwich's
        d'/2 sines). Requires `relative`.
    """

    init: Callable[[Array, Context, Settings], dict[str, Array]]
    fn: Callable[..., Array]
    trainable: bool = True
    bounds: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    shared_across_layers: bool | Callable[[Settings], bool] = False
    relative: bool = True
    tabulate: bool = False

    def __post_init__(self):
        if self.tabulate and not self.relative:
            raise ValueError(
                "BiasSpec(tabulate=True) needs relative=True: a table per offset "
                "i - j holds only a bias that depends on i - j alone"
            )

    def shared(self, settings: Settings) -> bool:
        """Whether one bias module serves every layer, for these settings."""
        if callable(self.shared_across_layers):
            return bool(self.shared_across_layers(settings))
        return bool(self.shared_across_layers)

    def bind(self, ctx: Context, settings: Settings) -> BiasFn:
        """The `BiasFn` for these static settings, as the attention core takes it."""
        return BoundBias(self.fn, ctx, settings, tabulate=self.tabulate)


@dataclasses.dataclass(frozen=True)
class ForgetSpec:
    """How a data-dependent forget family gates attention (FoX, Lin et al. 2025).

    `log f_t = log_sigmoid(w_h . x_t + b_h)` per query head from the layer's normalised input,
    the logit of (i, j) gaining `c_i - c_j`, `c = cumsum(log f)` (docs/conventions.md#fox).

    Attributes:
      bias_init: the initial gate bias b_h (0: the reference's "full" gate, f = 1/2 at x = 0).
    """

    bias_init: float = 0.0


@dataclasses.dataclass(frozen=True)
class BoundBias:
    """A bias function with its static settings: `(params, q_pos, k_pos) -> float32[N, t, s]`.

    A frozen dataclass rather than a `functools.partial` so that two models built from the same
    config compare (and hash) equal: their graphdefs can then key a jit cache.
    """

    fn: Callable[..., Array]
    ctx: Context
    settings: Settings
    tabulate: bool = False  # BiasSpec.tabulate: materialised once per offset, then gathered

    def __call__(self, params: Params, q_pos: Array, k_pos: Array) -> Array:
        return self.fn(params, q_pos, k_pos, self.ctx, self.settings)


@dataclasses.dataclass(frozen=True)
class Family:
    """A position-encoding family.

    Attributes:
      name: its registry name (`model.position`).
      settings: its `Settings` class (the config keys it reads, their defaults, their checks).
      embedding: `"none"`, `"sinusoidal"` or `"learned"`: what is added to the token embeddings
        (`"learned"`: its settings extend LearnedSettings, the table's size).
      rotary: whether queries and keys are rotated (RoPE); its settings then extend RopeSettings.
      bias: the relative-bias spec, or None.
      scale_free: logits without the `1/sqrt(H)` factor (T5: its query initialiser carries it).
      forget: a data-dependent family: per-head forget gates computed from each layer's input
        (FoX), whose `log f` the attention core accumulates (`attention(..., log_forget=)`);
        the gate module is `posattn.nn.forget.ForgetGate`. Causal models only.
      normalizer: "softmax", or "stick_breaking": each query breaks a stick over its keys from the
        nearest back instead of a softmax (`posattn.attention.stick_breaking_attention`); the
        order of breaking is then the position signal. Causal models only; its settings extend
        StickBreakingSettings.
      contextual: CoPE: each key's position for a query is the count of the gates
        sigmoid(scale q.k) from it to the query, read from a learned table per layer
        (`posattn.attention.cope_attention`; the table is `posattn.nn.contextual.CopeTable`).
        Causal models only; its settings extend CopeSettings; no other signal.
      reflections: PaTH: each key reaches a query through the data-dependent reflections
        I - beta_s w_s w_s^T of every position s after it up to the query
        (`posattn.attention.path_attention`; the module that makes w and beta is
        `posattn.nn.path.Reflections`). Causal models only; its settings extend PathSettings;
        forget gates (PaTH-FoX, their term scaled with the logits) and nothing else beside it.
    """

    name: str
    settings: type[Settings] = Settings
    embedding: str = "none"
    rotary: bool = False
    bias: BiasSpec | None = None
    scale_free: bool = False
    description: str = ""
    forget: ForgetSpec | None = None
    normalizer: str = "softmax"
    contextual: bool = False
    reflections: bool = False


NORMALIZERS = ("softmax", "stick_breaking")
_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Adds a family; refuses a taken name and a config key another family declares differently."""
    if family.name in _REGISTRY:
        raise ValueError(f"position family {family.name!r} is already registered")
    if family.embedding not in ("none", "sinusoidal", "learned"):
        raise ValueError(
            f"family {family.name!r}: embedding must be 'none', 'sinusoidal' or 'learned'"
        )
    if not (isinstance(family.settings, type) and issubclass(family.settings, Settings)):
        raise ValueError(f"family {family.name!r}: settings must be a Settings subclass")
    if family.rotary and not issubclass(family.settings, RopeSettings):
        raise ValueError(f"family {family.name!r} is rotary: its settings must extend RopeSettings")
    if family.forget is not None and (family.bias is not None or family.embedding != "none"):
        raise ValueError(
            f"family {family.name!r}: a forget family carries no other position signal (FoX "
            "has none); register its bias or embedding as a family of its own"
        )
    if family.normalizer not in NORMALIZERS:
        raise ValueError(
            f"family {family.name!r}: normalizer must be one of {', '.join(NORMALIZERS)}"
        )
    if family.normalizer == "stick_breaking" and (
        family.bias is not None
        or family.forget is not None
        or not issubclass(family.settings, StickBreakingSettings)
    ):
        raise ValueError(
            f"family {family.name!r}: a stick-breaking family takes no bias and no forget gates "
            "(the stick-breaking kernel adds neither), and its settings extend "
            "StickBreakingSettings"
        )
    if family.contextual and (
        family.bias is not None
        or family.forget is not None
        or family.rotary
        or family.embedding != "none"
        or family.normalizer != "softmax"
        or not issubclass(family.settings, CopeSettings)
    ):
        raise ValueError(
            f"family {family.name!r}: a contextual (CoPE) family carries no other position "
            "signal and a softmax (the CoPE kernel adds no bias, gate or rotation), and its "
            "settings extend CopeSettings"
        )
    if family.reflections and (
        family.bias is not None
        or family.rotary
        or family.embedding != "none"
        or family.normalizer != "softmax"
        or family.contextual
        or not issubclass(family.settings, PathSettings)
    ):
        raise ValueError(
            f"family {family.name!r}: a PaTH family carries no position signal beside its "
            "reflections but forget gates (its kernel adds no bias and no rotation), uses a "
            "softmax, and its settings extend PathSettings"
        )
    if family.embedding == "learned" and not issubclass(family.settings, LearnedSettings):
        raise ValueError(
            f"family {family.name!r} learns an embedding table: its settings must extend "
            "LearnedSettings (the table's size)"
        )
    taken = keys()
    for key, f in family.settings.keys().items():
        if key in taken and taken[key].default != f.default:
            raise ValueError(
                f"family {family.name!r} declares config key model.{key} with default "
                f"{f.default!r}, but {', '.join(owners(key))} declare it with "
                f"{taken[key].default!r}"
            )
    _REGISTRY[family.name] = family
    return family


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get(name: str) -> Family:
    """The family called `name`; an unknown name is an error listing the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown position family {name!r}; known families: {', '.join(_REGISTRY)}"
        ) from None


def keys() -> dict[str, dataclasses.Field]:
    """Every config key (under `model.`) some family declares -> its field, in registry order."""
    out: dict[str, dataclasses.Field] = {}
    for family in _REGISTRY.values():
        for key, f in family.settings.keys().items():
            out.setdefault(key, f)
    return out


def owners(key: str) -> tuple[str, ...]:
    """The families that read config key `model.<key>`."""
    return tuple(n for n, f in _REGISTRY.items() if key in f.settings.keys())


def continuous_keys() -> dict[str, str]:
    """Family keys (under `model.`) a vmap sweep may stack -> why they leave the program alone."""
    return {k: f.metadata["continuous"] for k, f in keys().items() if f.metadata["continuous"]}


# ----------------------------------------------------------------------------------------------
# Bias functions. `offset = i - j` (positive when the key is in the past); a bidirectional model
# sees |offset| in the families that have no direction of their own (ALiBi, Kerple, Sandwich).


def _offsets(q_pos: Array, k_pos: Array) -> Array:
    return q_pos[:, None] - k_pos[None, :]  # (t, s)


def _distance(q_pos: Array, k_pos: Array) -> Array:
    # Causal models never attend to negative offsets (they are masked), so |offset| is the same
    # bias on every visible key and keeps the masked entries finite.
    return jnp.abs(_offsets(q_pos, k_pos))


# T5 (Raffel et al. 2020; mesh_tensorflow / t5x `_relative_position_bucket`): a learned scalar per
# (head, bucket), one table for the whole stack, no 1/sqrt(d) in the logits.
def _t5_init(key: Array, ctx: Context, s: T5Settings) -> dict[str, Array]:
    # t5x's T5.1.1 network builds RelativePositionBiases with
    # `embedding_init=variance_scaling(1.0, 'fan_avg', 'uniform')` over the (heads, buckets) table.
    init = jax.nn.initializers.variance_scaling(
        ctx.init_scale**2, "fan_avg", "uniform", in_axis=1, out_axis=0
    )
    return {"table": init(key, (ctx.num_heads, s.num_buckets), jnp.float32)}


def _t5_fn(params: Params, q_pos: Array, k_pos: Array, ctx: Context, s: T5Settings) -> Array:
    bucket = positions.t5_bucket(
        _offsets(q_pos, k_pos),
        bidirectional=ctx.bidirectional,
        num_buckets=s.num_buckets,
        max_distance=s.max_distance,
    )  # (t, s)
    return jnp.take(params["table"], bucket, axis=1).astype(jnp.float32)  # (N, t, s)


# ALiBi (Press et al. 2022): fixed geometric slopes; `slope_scale` multiplies them (a sweep knob;
# 1.0 is the paper).
def _alibi_init(key: Array, ctx: Context, s: AlibiSettings) -> dict[str, Array]:
    del key
    return {"slopes": positions.alibi_slopes(ctx.num_heads) * s.slope_scale}


def _alibi_fn(params: Params, q_pos: Array, k_pos: Array, ctx: Context, s: Settings) -> Array:
    return positions.alibi_bias(_distance(q_pos, k_pos), params["slopes"])


# Kerple (Chi et al. 2022, github.com/chijames/KERPLE, ParallelKerplePower / ParallelKerpleLog):
# per-head r1, r2 initialised uniformly (r1 ~ U(0, 1), r2 ~ U(0, 2) for power: bias_a, bias_p;
# r1 ~ U(0, 2), r2 ~ U(0, 1) for log: bias_p, bias_a) and clamped in place to >= 0.01 (and r2 <= 2
# for power) — our `bounds`, applied after every update.
_KERPLE_EPS = 1e-2


def _kerple_power_init(key: Array, ctx: Context, s: Settings) -> dict[str, Array]:
    k1, k2 = jax.random.split(key)
    r1 = jax.random.uniform(k1, (ctx.num_heads,), jnp.float32, 0.0, 1.0)
    r2 = jax.random.uniform(k2, (ctx.num_heads,), jnp.float32, 0.0, 2.0)
    return {"r1": jnp.clip(r1, _KERPLE_EPS), "r2": jnp.clip(r2, _KERPLE_EPS, 2.0)}


def _kerple_log_init(key: Array, ctx: Context, s: Settings) -> dict[str, Array]:
    k1, k2 = jax.random.split(key)
    r1 = jax.random.uniform(k1, (ctx.num_heads,), jnp.float32, 0.0, 2.0)
    r2 = jax.random.uniform(k2, (ctx.num_heads,), jnp.float32, 0.0, 1.0)
    return {"r1": jnp.clip(r1, _KERPLE_EPS), "r2": jnp.clip(r2, _KERPLE_EPS)}


def _kerple_shared(s: KerpleSettings) -> bool:
    # The reference builds one ParallelKerplePower / ParallelKerpleLog module in GPT2ModelPipe and
    # hands it to every ParallelTransformerLayerPipe: one (r1, r2) per head for the whole stack.
    return not s.per_layer


def _kerple_power_fn(params: Params, q_pos: Array, k_pos: Array, ctx, s) -> Array:
    return positions.kerple_power_bias(_distance(q_pos, k_pos), params["r1"], params["r2"])


def _kerple_log_fn(params: Params, q_pos: Array, k_pos: Array, ctx, s) -> Array:
    return positions.kerple_log_bias(_distance(q_pos, k_pos), params["r1"], params["r2"])


# Sandwich (Chi et al. 2023; the NeMo form): parameter-free.
def _sandwich_init(key: Array, ctx: Context, s: Settings) -> dict[str, Array]:
    return {}


def _sandwich_fn(params: Params, q_pos: Array, k_pos: Array, ctx: Context, s: Settings) -> Array:
    del params
    return positions.sandwich_bias(
        _distance(q_pos, k_pos), head_dim=s.bar_dim(ctx), num_heads=ctx.num_heads
    )


# FIRE (Li et al. 2024): bias = f(psi(i - j) / psi(max(L, i))), psi(x) = log(c|x| + 1), f an MLP
# 1 -> width -> N with ReLU. As in the paper's reference code, L is learned as a multiplier of its
# initial value (threshold = |L_multiplier * init_L|) and c starts at 0.1.
def _fire_init(key: Array, ctx: Context, s: FireSettings) -> dict[str, Array]:
    k1, k2 = jax.random.split(key)
    width, scale = s.mlp_width, ctx.init_scale
    # PyTorch nn.Linear's default init, as the reference MLP uses: U(-1/sqrt(fan_in), +1/sqrt(...)).
    lim1, lim2 = 1.0, 1.0 / math.sqrt(width)
    k1a, k1b = jax.random.split(k1)
    k2a, k2b = jax.random.split(k2)
    return {
        "c": jnp.asarray(s.init_c, jnp.float32),
        "L_multiplier": jnp.asarray(1.0, jnp.float32),
        "w1": scale * jax.random.uniform(k1a, (width,), jnp.float32, -lim1, lim1),
        "b1": scale * jax.random.uniform(k1b, (width,), jnp.float32, -lim1, lim1),
        "w2": scale * jax.random.uniform(k2a, (width, ctx.num_heads), jnp.float32, -lim2, lim2),
        "b2": scale * jax.random.uniform(k2b, (ctx.num_heads,), jnp.float32, -lim2, lim2),
    }


def _fire_fn(params: Params, q_pos: Array, k_pos: Array, ctx: Context, s: FireSettings) -> Array:
    threshold = jnp.abs(params["L_multiplier"] * s.init_L)
    cap = s.norm_cap or None
    d = positions.fire_normalized_distance(
        q_pos, k_pos, c=params["c"], L=threshold, norm_cap=cap
    )  # (t, s)
    h = jax.nn.relu(d[..., None] * params["w1"] + params["b1"])  # (t, s, width)
    out = h @ params["w2"] + params["b2"]  # (t, s, N)
    return jnp.moveaxis(out, -1, 0)  # (N, t, s)


# ----------------------------------------------------------------------------------------------
# The families.

register(Family("nope", description="no position signal (causal masking alone leaks order)"))
register(
    Family(
        "sinusoidal",
        embedding="sinusoidal",
        description="Vaswani et al. 2017 fixed sin/cos embeddings",
    )
)
register(
    Family(
        "learned",
        settings=LearnedSettings,
        embedding="learned",
        description="GPT-style learned absolute embeddings",
    )
)
register(
    Family(
        "rope",
        settings=RopeSettings,
        rotary=True,
        description="RoPE (Su et al. 2021), with optional HF rope_scaling",
    )
)
register(
    Family(
        "t5",
        settings=T5Settings,
        bias=BiasSpec(_t5_init, _t5_fn, shared_across_layers=True),
        scale_free=True,
        description="T5 log-bucketed learned relative bias",
    )
)
register(
    Family(
        "alibi",
        settings=AlibiSettings,
        bias=BiasSpec(_alibi_init, _alibi_fn, trainable=False),
        description="ALiBi linear biases with geometric slopes",
    )
)
register(
    Family(
        "kerple_power",
        settings=KerpleSettings,
        bias=BiasSpec(
            _kerple_power_init,
            _kerple_power_fn,
            shared_across_layers=_kerple_shared,
            bounds={"r1": (_KERPLE_EPS, math.inf), "r2": (_KERPLE_EPS, 2.0)},
        ),
        description="Kerple power kernel -r1 |i-j|^r2",
    )
)
register(
    Family(
        "kerple_log",
        settings=KerpleSettings,
        bias=BiasSpec(
            _kerple_log_init,
            _kerple_log_fn,
            shared_across_layers=_kerple_shared,
            bounds={"r1": (_KERPLE_EPS, math.inf), "r2": (_KERPLE_EPS, math.inf)},
        ),
        description="Kerple logarithmic kernel -r1 log(1 + r2 |i-j|)",
    )
)
register(
    Family(
        "sandwich",
        settings=SandwichSettings,
        bias=BiasSpec(_sandwich_init, _sandwich_fn, trainable=False, tabulate=True),
        description="Sandwich: sinusoidal inner product, ALiBi-compressed per head",
    )
)
register(
    Family(
        "fire",
        settings=FireSettings,
        bias=BiasSpec(_fire_init, _fire_fn, bounds={"c": (1e-6, math.inf)}, relative=False),
        description="FIRE: MLP of a progressively interpolated log distance",
    )
)
register(
    Family(
        "fox",
        forget=ForgetSpec(),
        description="FoX forgetting attention: data-dependent forget gates, no other signal",
    )
)
register(
    Family(
        "stick_breaking",
        settings=StickBreakingSettings,
        normalizer="stick_breaking",
        description="stick-breaking attention: no softmax, keys weighted nearest first, no other "
        "signal",
    )
)
register(
    Family(
        "cope",
        settings=CopeSettings,
        contextual=True,
        description="CoPE contextual positions: keys at the count of gates sigmoid(q.k) up to the "
        "query, a learned table per layer, no other signal",
    )
)
register(
    Family(
        "path",
        settings=PathSettings,
        reflections=True,
        description="PaTH: each key moved to the query through the data-dependent reflections "
        "I - beta w w^T of the positions between them, no other signal",
    )
)
register(
    Family(
        "path_fox",
        settings=PathSettings,
        reflections=True,
        forget=ForgetSpec(),
        description="PaTH-FoX: PaTH's reflections and FoX's forget gates (their term scaled with "
        "the logits, as the reference kernel)",
    )
)
