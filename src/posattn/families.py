"""The registry: where a position family's name becomes its functions.

A family is some combination of three things, and the attention core never knows which:
  * an input embedding added to the token embeddings (`"sinusoidal"`, `"learned"`);
  * a q/k transform (`rotary=True`: RoPE and its scalings, applied by the attention layer);
  * an additive bias function of positions, `BiasFn(params, q_pos: int[t], k_pos: int[s]) ->
    float32[N, t, s]`, passed to `posattn.attention.attention` as `(fn, params)` so the core can
    evaluate it tile by tile and gradients reach `params`.

Adding a family means adding one `register(...)` call here; nothing else in the code branches on
a family's name.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from posattn import positions

__all__ = ["BiasSettings", "BiasSpec", "Family", "get", "names", "register"]

Array = jax.Array
Params = Mapping[str, Array]
BiasFn = Callable[[Params, Array, Array], Array]


@dataclasses.dataclass(frozen=True)
class BiasSettings:
    """Static settings a bias family needs (hashable). N = num_heads, H = head_dim."""

    num_heads: int
    head_dim: int
    bidirectional: bool = False
    t5_num_buckets: int = 32
    t5_max_distance: int = 128
    alibi_slope_scale: float = 1.0
    fire_mlp_width: int = 32
    fire_init_c: float = 0.1
    fire_init_L: float = 512.0
    init_scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class BiasSpec:
    """How a relative-bias family makes, constrains and evaluates its parameters.

    Attributes:
      init: `(key, settings) -> {name: array}`, the initial values.
      fn: `(params, q_pos, k_pos, settings) -> float32[N, t, s]`, a pure bias function.
      trainable: whether the values are learned (`nnx.Param`) or fixed constants (ALiBi slopes).
      bounds: `{name: (low, high)}` a value is projected into after every optimiser step and at
        initialisation, as the reference code clamps its parameters' data in place.
      shared_across_layers: one bias for the whole stack (T5) or one per layer.
    """

    init: Callable[[Array, BiasSettings], dict[str, Array]]
    fn: Callable[..., Array]
    trainable: bool = True
    bounds: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    shared_across_layers: bool = False

    def bind(self, settings: BiasSettings) -> BiasFn:
        """The `BiasFn` for these static settings, as the attention core takes it."""
        return BoundBias(self.fn, settings)


@dataclasses.dataclass(frozen=True)
class BoundBias:
    """A bias function with its static settings: `(params, q_pos, k_pos) -> float32[N, t, s]`.

    A frozen dataclass rather than a `functools.partial` so that two models built from the same
    config compare (and hash) equal: their graphdefs can then key a jit cache.
    """

    fn: Callable[..., Array]
    settings: BiasSettings

    def __call__(self, params: Params, q_pos: Array, k_pos: Array) -> Array:
        return self.fn(params, q_pos, k_pos, self.settings)


@dataclasses.dataclass(frozen=True)
class Family:
    """A position-encoding family.

    Attributes:
      name: its registry name (`model.position`).
      embedding: `"none"`, `"sinusoidal"` or `"learned"`: what is added to the token embeddings.
      rotary: whether queries and keys are rotated (RoPE).
      bias: the relative-bias spec, or None.
      scale_free: logits without the `1/sqrt(H)` factor (T5: its query initialiser carries it).
    """

    name: str
    embedding: str = "none"
    rotary: bool = False
    bias: BiasSpec | None = None
    scale_free: bool = False
    description: str = ""


_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    if family.name in _REGISTRY:
        raise ValueError(f"position family {family.name!r} is already registered")
    if family.embedding not in ("none", "sinusoidal", "learned"):
        raise ValueError(
            f"family {family.name!r}: embedding must be 'none', 'sinusoidal' or 'learned'"
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


# ----------------------------------------------------------------------------------------------
# Bias functions. `offset = i - j` (positive when the key is in the past); a bidirectional model
# sees |offset| in the families that have no direction of their own (ALiBi, Kerple, Sandwich).


def _offsets(q_pos: Array, k_pos: Array) -> Array:
    return q_pos[:, None] - k_pos[None, :]  # (t, s)


def _distance(q_pos: Array, k_pos: Array, settings: BiasSettings) -> Array:
    offset = _offsets(q_pos, k_pos)
    # Causal models never attend to negative offsets (they are masked), so |offset| is the same
    # bias on every visible key and keeps the masked entries finite.
    return jnp.abs(offset)


# T5 (Raffel et al. 2020; mesh_tensorflow / t5x `_relative_position_bucket`): a learned scalar per
# (head, bucket), one table for the whole stack, no 1/sqrt(d) in the logits.
def _t5_init(key: Array, s: BiasSettings) -> dict[str, Array]:
    # t5x's T5.1.1 network builds RelativePositionBiases with
    # `embedding_init=variance_scaling(1.0, 'fan_avg', 'uniform')` over the (heads, buckets) table.
    init = jax.nn.initializers.variance_scaling(
        s.init_scale**2, "fan_avg", "uniform", in_axis=1, out_axis=0
    )
    return {"table": init(key, (s.num_heads, s.t5_num_buckets), jnp.float32)}


def _t5_fn(params: Params, q_pos: Array, k_pos: Array, s: BiasSettings) -> Array:
    bucket = positions.t5_bucket(
        _offsets(q_pos, k_pos),
        bidirectional=s.bidirectional,
        num_buckets=s.t5_num_buckets,
        max_distance=s.t5_max_distance,
    )  # (t, s)
    return jnp.take(params["table"], bucket, axis=1).astype(jnp.float32)  # (N, t, s)


# ALiBi (Press et al. 2022): fixed geometric slopes; `alibi_slope_scale` multiplies them (a sweep
# knob; 1.0 is the paper).
def _alibi_init(key: Array, s: BiasSettings) -> dict[str, Array]:
    del key
    return {"slopes": positions.alibi_slopes(s.num_heads) * s.alibi_slope_scale}


def _alibi_fn(params: Params, q_pos: Array, k_pos: Array, s: BiasSettings) -> Array:
    return positions.alibi_bias(_distance(q_pos, k_pos, s), params["slopes"])


# Kerple (Chi et al. 2022, github.com/chijames/KERPLE, ParallelKerplePower / ParallelKerpleLog):
# per-head r1, r2 initialised uniformly (r1 ~ U(0, 1), r2 ~ U(0, 2) for power: bias_a, bias_p;
# r1 ~ U(0, 2), r2 ~ U(0, 1) for log: bias_p, bias_a) and clamped in place to >= 0.01 (and r2 <= 2
# for power) — our `bounds`, applied after every update.
_KERPLE_EPS = 1e-2


def _kerple_power_init(key: Array, s: BiasSettings) -> dict[str, Array]:
    k1, k2 = jax.random.split(key)
    r1 = jax.random.uniform(k1, (s.num_heads,), jnp.float32, 0.0, 1.0)
    r2 = jax.random.uniform(k2, (s.num_heads,), jnp.float32, 0.0, 2.0)
    return {"r1": jnp.clip(r1, _KERPLE_EPS), "r2": jnp.clip(r2, _KERPLE_EPS, 2.0)}


def _kerple_log_init(key: Array, s: BiasSettings) -> dict[str, Array]:
    k1, k2 = jax.random.split(key)
    r1 = jax.random.uniform(k1, (s.num_heads,), jnp.float32, 0.0, 2.0)
    r2 = jax.random.uniform(k2, (s.num_heads,), jnp.float32, 0.0, 1.0)
    return {"r1": jnp.clip(r1, _KERPLE_EPS), "r2": jnp.clip(r2, _KERPLE_EPS)}


def _kerple_power_fn(params: Params, q_pos: Array, k_pos: Array, s: BiasSettings) -> Array:
    return positions.kerple_power_bias(_distance(q_pos, k_pos, s), params["r1"], params["r2"])


def _kerple_log_fn(params: Params, q_pos: Array, k_pos: Array, s: BiasSettings) -> Array:
    return positions.kerple_log_bias(_distance(q_pos, k_pos, s), params["r1"], params["r2"])


# Sandwich (Chi et al. 2023; the NeMo form): parameter-free.
def _sandwich_fn(params: Params, q_pos: Array, k_pos: Array, s: BiasSettings) -> Array:
    del params
    return positions.sandwich_bias(
        _distance(q_pos, k_pos, s), head_dim=s.head_dim, num_heads=s.num_heads
    )


# FIRE (Li et al. 2024): bias = f(psi(i - j) / psi(max(L, i))), psi(x) = log(c|x| + 1), f an MLP
# 1 -> width -> N with ReLU. As in the paper's reference code, L is learned as a multiplier of its
# initial value (threshold = |L_multiplier * init_L|) and c starts at 0.1.
def _fire_init(key: Array, s: BiasSettings) -> dict[str, Array]:
    k1, k2 = jax.random.split(key)
    width = s.fire_mlp_width
    # PyTorch nn.Linear's default init, as the reference MLP uses: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    lim1, lim2 = 1.0, 1.0 / math.sqrt(width)
    k1a, k1b = jax.random.split(k1)
    k2a, k2b = jax.random.split(k2)
    return {
        "c": jnp.asarray(s.fire_init_c, jnp.float32),
        "L_multiplier": jnp.asarray(1.0, jnp.float32),
        "w1": s.init_scale * jax.random.uniform(k1a, (width,), jnp.float32, -lim1, lim1),
        "b1": s.init_scale * jax.random.uniform(k1b, (width,), jnp.float32, -lim1, lim1),
        "w2": s.init_scale
        * jax.random.uniform(k2a, (width, s.num_heads), jnp.float32, -lim2, lim2),
        "b2": s.init_scale * jax.random.uniform(k2b, (s.num_heads,), jnp.float32, -lim2, lim2),
    }


def _fire_fn(params: Params, q_pos: Array, k_pos: Array, s: BiasSettings) -> Array:
    threshold = jnp.abs(params["L_multiplier"] * s.fire_init_L)
    d = positions.fire_normalized_distance(q_pos, k_pos, c=params["c"], L=threshold)  # (t, s)
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
    Family("learned", embedding="learned", description="GPT-style learned absolute embeddings")
)
register(
    Family("rope", rotary=True, description="RoPE (Su et al. 2021), with optional HF rope_scaling")
)
register(
    Family(
        "t5",
        bias=BiasSpec(_t5_init, _t5_fn, shared_across_layers=True),
        scale_free=True,
        description="T5 log-bucketed learned relative bias",
    )
)
register(
    Family(
        "alibi",
        bias=BiasSpec(_alibi_init, _alibi_fn, trainable=False),
        description="ALiBi linear biases with geometric slopes",
    )
)
register(
    Family(
        "kerple_power",
        bias=BiasSpec(
            _kerple_power_init,
            _kerple_power_fn,
            bounds={"r1": (_KERPLE_EPS, math.inf), "r2": (_KERPLE_EPS, 2.0)},
        ),
        description="Kerple power kernel -r1 |i-j|^r2",
    )
)
register(
    Family(
        "kerple_log",
        bias=BiasSpec(
            _kerple_log_init,
            _kerple_log_fn,
            bounds={"r1": (_KERPLE_EPS, math.inf), "r2": (_KERPLE_EPS, math.inf)},
        ),
        description="Kerple logarithmic kernel -r1 log(1 + r2 |i-j|)",
    )
)
register(
    Family(
        "sandwich",
        bias=BiasSpec(lambda key, s: {}, _sandwich_fn, trainable=False),
        description="Sandwich: sinusoidal inner product, ALiBi-compressed per head",
    )
)
register(
    Family(
        "fire",
        bias=BiasSpec(_fire_init, _fire_fn, bounds={"c": (1e-6, math.inf)}),
        description="FIRE: MLP of a progressively interpolated log distance",
    )
)
