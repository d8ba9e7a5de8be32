"""Rotary position embeddings (RoPE, Su et al. 2021) and the Hugging Face scalings of their
frequencies.

Shapes: B batch, T query length, N heads, H head dim (even), F rotation frequencies (H // 2 unless
the rotation is partial).

- `rope_frequencies(H, base=, scaling=, seq_len=)` -> (theta float32[F], attention factor):
  theta_k = base^(-2k/H), optionally rescaled by a Hugging Face `rope_scaling` dict ("linear",
  "ntk", "dynamic", "yarn", "llama3", "longrope", "proportional"); formulas follow
  `transformers.modeling_rope_utils`. The dict's `partial_rotary_factor` p (transformers 5 keeps it
  in `rope_parameters`) makes the rotation partial: frequencies over the first R = int(p H) dims
  only, F = ceil(R / 2) of them. With "proportional" (Gemma 4, p-RoPE) the same key means
  something else: F = H // 2 frequencies over the whole head, the int(p H // 2) fastest kept and
  the others 0 (pairs left unrotated).
- `apply_rope(x, positions, inv_freq)` rotates each feature pair by `position * theta_k` with
  float32 complex multiplication; "interleaved" pairs (x0, x1), (x2, x3) ... (Meta Llama, GPT-J) or
  "half" pairs (x_k, x_{k+F}) (GPT-NeoX, Hugging Face `rotate_half`), within the first 2F dims;
  dims past 2F pass through untouched (partial rotary).
- `rope_angles(positions, inv_freq)` the angles, to ~1e-6 rad for |p| < 2^24 (a plain float32
  `p * theta` is off by up to 0.03 rad at p = 1e6); `rope_decay_bound` RoFormer §3.4.3's bound;
  `validate_rope_scaling(scaling, head_dim)` checks a scaling dict once, before any compute.
- `remap_positions(remap, q_pos, k_pos)`: an eval-time remap's second rotation for the pairs
  beyond its window (ReRoPE, SelfExtend), scored by two-score attention (`posattn.attention.Far`);
  `validate_rope_remap(remap)` checks one.
Formulas, reference functions, pitfalls and the precision measurement: docs/rope.md.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope", "proportional")
LAYOUTS = ("interleaved", "half")

_M_L = "original_max_position_embeddings"
# rope_type -> (required keys, optional keys with their defaults). HF reads beta_fast/beta_slow with
# `or 32` / `or 1` and `truncate` with `.get("truncate", True)`; None means "use the default" here
# too.
_KEYS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "default": ((), {}),
    "linear": (("factor",), {_M_L: None}),
    "ntk": (("factor",), {_M_L: None}),
    "dynamic": (("factor", _M_L), {}),
    "yarn": (
        ("factor", _M_L),
        {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": None,
            "mscale_all_dim": None,
            "attention_factor": None,
            "truncate": True,
        },
    ),
    "llama3": (("factor", _M_L, "low_freq_factor", "high_freq_factor"), {}),
    # HF reads `factor` from the dict and, when it is None, config.max_position_embeddings / m_l;
    # posattn has no model config, so that length is the dict's own `max_position_embeddings`.
    "longrope": (
        ("short_factor", "long_factor", _M_L),
        {"factor": None, "max_position_embeddings": None, "attention_factor": None},
    ),
    # HF `_compute_proportional_rope_parameters` reads `factor` with `.get("factor", 1.0)` (its
    # config validator calls the key unrecognised, but the computation divides by it).
    "proportional": ((), {"factor": 1.0}),
}
PARTIAL_KEY = _PARTIAL = "partial_rotary_factor"  # HF's key, in every kind's dict
# Kinds whose frequencies follow the current length (dynamic NTK; LongRoPE's long factors past m_l).
LENGTH_DEPENDENT = ("dynamic", "longrope")


def rope_kind(scaling: Mapping | None) -> str:
    """The kind of a Hugging Face `rope_scaling` dict: its "rope_type", else its older alias
    "type", else "default" (also for None: plain RoPE). Every reader of the kind asks here;
    `validate_rope_scaling` refuses a dict whose two keys disagree."""
    if scaling is None:
        return "default"
    kind = scaling.get("rope_type")
    if kind is None:
        kind = scaling.get("type")
    return "default" if kind is None else kind


# ----------------------------------------------------------------------------------------------
# Validation of the static settings.
# ----------------------------------------------------------------------------------------------
def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _refuse(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"rope_scaling[{key!r}] = {value!r} is not allowed: {allowed}.")


def _check_head_dim(head_dim: Any, kind: str) -> None:
    minimum = 4 if kind in ("ntk", "dynamic") else 2  # their base exponent d / (d - 2) needs d > 2
    if (
        not isinstance(head_dim, numbers.Integral)
        or isinstance(head_dim, bool)
        or head_dim < minimum
        or head_dim % 2
    ):
        raise ValueError(
            f"head_dim = {head_dim!r} is not allowed with rope_type {kind!r}: RoPE rotates "
            f"pairs of features, so it must be an even integer >= {minimum}."
        )


def validate_rope_scaling(scaling: Mapping | None, head_dim: int) -> dict[str, Any]:
    """Checks a Hugging Face `rope_scaling` dict and returns it normalised, defaults filled in.

    Call it when a config is built: every error names the key, the value and what is allowed.

    Args:
      scaling: None (plain RoPE) or a mapping such as `{"rope_type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": 2048}`; `"type"` is accepted as an alias of
        `"rope_type"`, as Hugging Face does. Any object with `keys()` works (ml_collections).
        Every kind takes `"partial_rotary_factor"` p in (0, 1] (default 1): partial rotary of
        the first int(H p) dims, or for "proportional" the fraction of pairs that turn.
        "longrope" takes `short_factor` / `long_factor` (one number per rotated pair),
        `original_max_position_embeddings`, and `factor` or `max_position_embeddings` (HF's
        `config.max_position_embeddings`, from which it infers the factor).
      head_dim: H, the size of one attention head.

    Returns:
      A new plain dict with `"rope_type"` set and every key of that kind present (the factor
      lists as tuples, so the dict's items are hashable).

    Raises:
      ValueError: unknown rope_type, missing or unknown key, or a value out of range.
    """
    if scaling is None:
        cfg: dict[str, Any] = {}
    elif hasattr(scaling, "keys"):
        cfg = {key: scaling[key] for key in scaling.keys()}
    else:
        raise ValueError(
            f"rope_scaling = {scaling!r} is not allowed: it must be None or a dict such as "
            "{'rope_type': 'linear', 'factor': 2.0}."
        )
    kind, alias = cfg.get("rope_type"), cfg.get("type")
    if kind is not None and alias is not None and kind != alias:
        raise _refuse("type", alias, f"it is an alias of 'rope_type', which says {kind!r}")
    kind = rope_kind(cfg)
    for name in ("rope_type", "type"):
        cfg.pop(name, None)
    if kind not in _KEYS:
        raise _refuse("rope_type", kind, f"known types are {', '.join(ROPE_TYPES)}")
    _check_head_dim(head_dim, kind)
    if "rope_theta" in cfg:
        raise _refuse(
            "rope_theta",
            cfg["rope_theta"],
            "pass the base as rope_frequencies(base=...) "
            "(config key model.rope_base), not inside the scaling dict",
        )
    partial = cfg.pop(_PARTIAL, None)
    partial = 1.0 if partial is None else partial  # HF: .get("partial_rotary_factor", 1.0)
    if not (_is_number(partial) and 0 < partial <= 1):
        raise _refuse(
            _PARTIAL,
            partial,
            "a number in (0, 1]: the fraction of the head "
            + (
                "whose pairs turn (proportional RoPE)"
                if kind == "proportional"
                else "that RoPE rotates (1.0: the whole head)"
            ),
        )
    _check_rotary_dim(head_dim, kind, partial)
    required, optional = _KEYS[kind]
    for key in required:
        if cfg.get(key) is None:
            hint = (
                ""
                if key != _M_L
                else (
                    " (the length the model was trained at"
                    + (
                        "; Hugging Face reads it from config.max_position_embeddings for this kind)"
                        if kind == "dynamic"
                        else ")"
                    )
                )
            )
            raise ValueError(
                f"rope_scaling for rope_type {kind!r} is missing {key!r}{hint}; it needs "
                f"{', '.join(required)}."
            )
    unknown = sorted(set(cfg) - set(required) - set(optional))
    if unknown:
        raise _refuse(
            unknown[0],
            cfg[unknown[0]],
            f"rope_type {kind!r} takes the keys {', '.join((*required, *optional)) or '(none)'}",
        )
    cfg = {"rope_type": kind, **optional, **{k: v for k, v in cfg.items() if v is not None}}
    cfg[_PARTIAL] = float(partial)

    if cfg.get("factor") is not None and not (_is_number(cfg["factor"]) and cfg["factor"] >= 1):
        raise _refuse("factor", cfg["factor"], "a number >= 1 (the context-extension ratio)")
    m_l = cfg.get(_M_L)
    if m_l is not None and not (_is_number(m_l) and m_l >= 1 and float(m_l).is_integer()):
        raise _refuse(_M_L, m_l, "a positive integer (the context length the model was trained at)")
    if kind == "yarn":
        for key in ("beta_fast", "beta_slow"):
            if not (_is_number(cfg[key]) and cfg[key] > 0):
                raise _refuse(
                    key,
                    cfg[key],
                    "a number > 0 (a count of rotations within the original "
                    "length; None means the default 32 / 1)",
                )
        if cfg["beta_fast"] <= cfg["beta_slow"]:
            raise _refuse(
                "beta_fast", cfg["beta_fast"], f"it must exceed beta_slow = {cfg['beta_slow']!r}"
            )
        for key in ("mscale", "mscale_all_dim"):
            if cfg[key] is not None and not (_is_number(cfg[key]) and cfg[key] >= 0):
                raise _refuse(key, cfg[key], "None or a number >= 0")
        if cfg["attention_factor"] is not None and not (
            _is_number(cfg["attention_factor"]) and cfg["attention_factor"] > 0
        ):
            raise _refuse("attention_factor", cfg["attention_factor"], "None or a number > 0")
        if not isinstance(cfg["truncate"], bool):
            raise _refuse("truncate", cfg["truncate"], "True or False")
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if not (_is_number(cfg[key]) and cfg[key] > 0):
                raise _refuse(key, cfg[key], "a number > 0")
        if cfg["high_freq_factor"] <= cfg["low_freq_factor"]:
            raise _refuse(
                "high_freq_factor",
                cfg["high_freq_factor"],
                f"it must exceed low_freq_factor = {cfg['low_freq_factor']!r}",
            )
    if kind == "longrope":
        _check_longrope(cfg, head_dim)
    return cfg


def _rotary_dim(head_dim: int, cfg: Mapping[str, Any]) -> int:
    """The d of the frequency formula: R = int(H p) (HF's truncation) for a partial rotation, the
    whole head H for "proportional" (its p chooses which pairs turn, not the span)."""
    if cfg["rope_type"] == "proportional":
        return head_dim
    return int(head_dim * cfg.get(_PARTIAL, 1.0))


def _check_rotary_dim(head_dim: int, kind: str, partial: float) -> None:
    if kind == "proportional":
        turning = int(partial * head_dim // 2)  # HF's expression, evaluated in float
        if turning < 1:
            raise _refuse(
                _PARTIAL,
                partial,
                f"with head_dim {head_dim}, proportional RoPE turns int(p * H // 2) = {turning} "
                "pairs; p must keep at least one (p >= 2 / H)",
            )
        return
    dim = int(head_dim * partial)
    minimum = 4 if kind in ("ntk", "dynamic") else 2
    if dim < minimum:
        raise _refuse(
            _PARTIAL,
            partial,
            f"with head_dim {head_dim} it rotates R = int(H * p) = {dim} dims; rope_type "
            f"{kind!r} needs R >= {minimum}",
        )
    if dim % 2 and kind == "yarn":
        # HF's yarn ramp has R // 2 entries against ceil(R / 2) frequencies: a shape error there.
        raise _refuse(
            _PARTIAL,
            partial,
            f"with head_dim {head_dim} it rotates an odd R = int(H * p) = {dim} dims, which "
            "rope_type 'yarn' cannot ramp (Hugging Face fails on it too); choose p with H p even",
        )


def _check_longrope(cfg: dict[str, Any], head_dim: int) -> None:
    pairs = len(range(0, _rotary_dim(head_dim, cfg), 2))  # HF's arange(0, R, 2)
    for key in ("short_factor", "long_factor"):
        values = cfg[key]
        if (
            isinstance(values, (str, bytes, Mapping))
            or not hasattr(values, "__len__")
            or not all(_is_number(v) and v > 0 for v in values)
        ):
            raise _refuse(key, values, "a list of numbers > 0, one per rotated pair")
        if len(values) != pairs:
            raise _refuse(
                key,
                values,
                f"it has {len(values)} entries; head_dim {head_dim} with partial_rotary_factor "
                f"{cfg[_PARTIAL]!r} rotates {pairs} pairs, one factor each",
            )
        cfg[key] = tuple(float(v) for v in values)
    if cfg[_M_L] < 2:
        raise _refuse(
            _M_L, cfg[_M_L], "an integer >= 2 (LongRoPE's attention factor divides by its log)"
        )
    length = cfg["max_position_embeddings"]
    if length is not None and not (
        _is_number(length) and length >= 1 and float(length).is_integer()
    ):
        raise _refuse(
            "max_position_embeddings",
            length,
            "None or a positive integer (the extended context length; HF's "
            "config.max_position_embeddings)",
        )
    if cfg["factor"] is None and length is None:
        raise ValueError(
            "rope_scaling for rope_type 'longrope' is missing 'factor' and "
            "'max_position_embeddings'; it needs one of them: Hugging Face uses factor, else "
            "config.max_position_embeddings / original_max_position_embeddings (put that "
            "length in the dict as 'max_position_embeddings')."
        )
    attention = cfg["attention_factor"]
    if attention is not None and not (_is_number(attention) and attention > 0):
        raise _refuse("attention_factor", attention, "None or a number > 0")


# ----------------------------------------------------------------------------------------------
# Inverse frequencies. Each formula is written once against an array namespace: numpy float64 on
# the host when its inputs are Python numbers, jax.numpy float32 when one is traced (a `base` swept
# under vmap, dynamic's `seq_len` under jit).
# ----------------------------------------------------------------------------------------------
def _static(value: Any) -> bool:
    try:
        float(value)
        return True
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return False


def _xp(value: Any):
    return np if value is None or _static(value) else jnp


def _default(d: int, base, cfg, seq_len):
    # theta_k = base^(-2k/d), k = 0 .. d/2 - 1 (RoFormer §3.2.2 with 0-based k, as HF and Meta
    # write it).
    xp = _xp(base)
    return 1.0 / base ** (xp.arange(0, d, 2) / d)


def _linear(d, base, cfg, seq_len):
    # Position interpolation (Chen et al. 2023): positions * 1/s is frequencies * 1/s.
    return _default(d, base, cfg, seq_len) / cfg["factor"]


def _ntk(d, base, cfg, seq_len):
    # NTK-aware base change (bloc97, r/LocalLLaMA 2023; YaRN paper, "NTK-aware"):
    # b' = b s^(d/(d-2)), so that the lowest frequency is divided by exactly s (as in linear
    # interpolation) and the highest is untouched.
    return _default(d, base * cfg["factor"] ** (d / (d - 2)), cfg, seq_len)


def _dynamic(d, base, cfg, seq_len):
    # HF `_compute_dynamic_ntk_parameters`: b' = b r^(d/(d-2)), r = s L / m_l - (s - 1) with
    # L = max(seq_len, m_l). Written as theta_k(b) r^(-2k/(d-2)) so that only the factor that
    # depends on a traced length is computed on the device; the frequencies of b stay host float64.
    s, m_l = cfg["factor"], cfg[_M_L]
    length = m_l if seq_len is None else _xp(seq_len).maximum(seq_len, m_l)
    ratio = s * length / m_l - (s - 1)
    return _default(d, base, cfg, seq_len) * ratio ** (-np.arange(0, d, 2) / (d - 2))


def _yarn(d, base, cfg, seq_len):
    # HF `_compute_yarn_parameters` (Peng et al. 2024, "NTK-by-parts"): pair k keeps theta_k when it
    # turns more than beta_fast times within m_l, is divided by s when less than beta_slow times,
    # with a linear ramp in k between.
    xp, s, m_l = _xp(base), cfg["factor"], cfg[_M_L]

    def pair_index(
        rotations,
    ):  # the (fractional) k whose wavelength fits `rotations` times into m_l
        return d * xp.log(m_l / (rotations * 2 * math.pi)) / (2 * xp.log(base))

    low, high = pair_index(cfg["beta_fast"]), pair_index(cfg["beta_slow"])
    if cfg["truncate"]:
        low, high = xp.floor(low), xp.ceil(high)
    low, high = xp.maximum(low, 0), xp.minimum(high, d - 1)  # HF clamps with d - 1, not d/2 - 1
    high = xp.where(high == low, high + 0.001, high)
    ramp = xp.clip(
        (xp.arange(d // 2) - low) / (high - low), 0, 1
    )  # 0: keep theta_k, 1: theta_k / s
    theta = _default(d, base, cfg, seq_len)
    return theta / s * ramp + theta * (1 - ramp)


def _llama3(d, base, cfg, seq_len):
    # HF `_compute_llama3_parameters` (Llama 3.1): wavelengths below m_l / high_freq_factor keep
    # theta_k, above m_l / low_freq_factor are divided by s, smooth interpolation between.
    xp, s, m_l = _xp(base), cfg["factor"], cfg[_M_L]
    low, high = cfg["low_freq_factor"], cfg["high_freq_factor"]
    theta = _default(d, base, cfg, seq_len)
    wavelength = 2 * math.pi / theta
    smooth = (m_l / wavelength - low) / (high - low)
    interpolated = (1 - smooth) * theta / s + smooth * theta
    is_mid = (wavelength >= m_l / high) & (wavelength <= m_l / low)
    return xp.where(is_mid, interpolated, xp.where(wavelength > m_l / low, theta / s, theta))


def _longrope(d, base, cfg, seq_len):
    # HF `_compute_longrope_parameters` (LongRoPE, Ding et al. 2024; Phi-3): theta_k / lambda_k with
    # per-pair factors, `long_factor` when the current length exceeds m_l, else `short_factor`
    # (also when seq_len is None, as HF at init). A traced length picks with `where`, as HF's
    # `longrope_frequency_update` does with torch.where.
    theta = _default(d, base, cfg, seq_len)
    short = theta / np.asarray(cfg["short_factor"])
    long = theta / np.asarray(cfg["long_factor"])
    if seq_len is None:
        return short
    if _static(seq_len):
        return long if float(seq_len) > cfg[_M_L] else short
    if isinstance(theta, np.ndarray):  # host float64 rounded once, as the static path
        short, long = short.astype(np.float32), long.astype(np.float32)
    return jnp.where(jnp.asarray(seq_len) > cfg[_M_L], long, short)


def _proportional(d, base, cfg, seq_len):
    # HF `_compute_proportional_rope_parameters` (Gemma 4; p-RoPE, Barbero et al. 2025): theta_k of
    # the whole head for k < int(p d // 2), 0 after (those pairs do not turn), all divided by
    # `factor`.
    xp = _xp(base)
    turning = int(cfg[_PARTIAL] * d // 2)
    theta = _default(d, base, cfg, seq_len)
    return xp.where(np.arange(d // 2) < turning, theta, 0.0) / cfg["factor"]


_INV_FREQ = {
    "default": _default,
    "linear": _linear,
    "ntk": _ntk,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "llama3": _llama3,
    "longrope": _longrope,
    "proportional": _proportional,
}


def _yarn_attention_factor(cfg: dict[str, Any]) -> float:
    # HF: an explicit attention_factor wins; else the YaRN paper's sqrt(1/t) = 0.1 ln(s) + 1, or
    # with both mscale and mscale_all_dim set (DeepSeek-V2/V3 configs) the ratio of two such terms.
    if cfg["attention_factor"] is not None:
        return float(cfg["attention_factor"])

    def mscale(s, scale=1.0):
        return 1.0 if s <= 1 else 0.1 * scale * math.log(s) + 1.0

    if cfg["mscale"] and cfg["mscale_all_dim"]:  # HF tests truthiness: 0 counts as unset
        return mscale(cfg["factor"], cfg["mscale"]) / mscale(cfg["factor"], cfg["mscale_all_dim"])
    return mscale(cfg["factor"])


def _longrope_attention_factor(cfg: dict[str, Any]) -> float:
    # HF: an explicit attention_factor wins; else sqrt(1 + ln s / ln m_l) (LongRoPE's scaling) with
    # s = factor, or max_position_embeddings / m_l when the dict has no factor; 1.0 for s <= 1.
    if cfg["attention_factor"] is not None:
        return float(cfg["attention_factor"])
    s = cfg["factor"]
    if s is None:
        s = cfg["max_position_embeddings"] / cfg[_M_L]
    return 1.0 if s <= 1 else math.sqrt(1 + math.log(s) / math.log(cfg[_M_L]))


_ATTENTION_FACTOR = {"yarn": _yarn_attention_factor, "longrope": _longrope_attention_factor}


def rope_frequencies(
    head_dim: int,
    *,
    base: float = 10000.0,
    scaling: Mapping | None = None,
    seq_len: int | None = None,
) -> tuple[jax.Array, float]:
    """Inverse frequencies theta_k of RoPE and the attention factor of its scaling.

    Args:
      head_dim: H, even.
      base: b in theta_k = b^(-2k/H), > 1. May be traced (a swept base under vmap).
      scaling: None or a Hugging Face `rope_scaling` dict, see `validate_rope_scaling`; a
        transformers 5 `rope_parameters` dict too, whose `rope_theta` (the base, which
        transformers 5 also writes into a `rope_scaling` dict given to a config) must then equal
        `base`. Its `partial_rotary_factor` p (default 1) makes the rotation partial: every
        formula then runs with d = R = int(H p) in place of H and returns ceil(R / 2)
        frequencies; `apply_rope` rotates the first 2 ceil(R / 2) dims and passes the rest
        through. For `rope_type="proportional"` p is instead the fraction of the H // 2 pairs
        that turn.
      seq_len: the current length (max position + 1), read by "dynamic" and "longrope" (long
        factors when seq_len > original_max_position_embeddings); None means the original
        length. May be traced.

    Returns:
      (theta float32[F], attention factor), F = H // 2, or ceil(R / 2) when partial: the factor
      multiplies both cos and sin (YaRN's and LongRoPE's temperature; attention logits then scale
      by its square); 1.0 for every kind but "yarn" and "longrope".
    """
    cfg = validate_rope_scaling(_without_theta(scaling, base), head_dim)
    if _static(base) and not float(base) > 1:
        raise ValueError(f"base = {base!r} is not allowed: it must be a number > 1.")
    if (
        seq_len is not None
        and _static(seq_len)
        and not (float(seq_len) >= 1 and float(seq_len).is_integer())
    ):
        raise ValueError(
            f"seq_len = {seq_len!r} is not allowed: it must be None or a positive integer."
        )
    kind = cfg["rope_type"]
    inv_freq = _INV_FREQ[kind](_rotary_dim(head_dim, cfg), base, cfg, seq_len)
    if isinstance(inv_freq, np.ndarray):  # host float64 -> float32, rounded to nearest by numpy
        inv_freq = inv_freq.astype(np.float32)
    factor = _ATTENTION_FACTOR[kind](cfg) if kind in _ATTENTION_FACTOR else 1.0
    return jnp.asarray(inv_freq, jnp.float32), factor


def _without_theta(scaling: Mapping | None, base) -> Mapping | None:
    """`scaling` without a `rope_theta` key that agrees with `base` (transformers 5 keeps the base
    in `rope_parameters`, and adds it to a `rope_scaling` dict a config is built with); a
    `rope_theta` that differs from `base`, or that cannot be compared with a traced one, is
    refused."""
    if scaling is None or not hasattr(scaling, "keys") or "rope_theta" not in scaling.keys():
        return scaling
    theta = scaling["rope_theta"]
    if not _static(base):
        raise _refuse(
            "rope_theta",
            theta,
            "the base is traced here (a swept base), so the scaling dict cannot also name one: "
            "leave rope_theta out of it",
        )
    if not (_is_number(theta) and float(theta) == float(base)):
        raise _refuse(
            "rope_theta",
            theta,
            f"it differs from base = {float(base)!r}: pass the base once, as "
            "rope_frequencies(base=...), or the same value in both",
        )
    return {key: scaling[key] for key in scaling.keys() if key != "rope_theta"}


# ----------------------------------------------------------------------------------------------
# Angles p * theta mod 2 pi in float32, accurate for integer |p| < 2^24 and 0 <= theta <= 1.
#
# p = 4096 a + b with b in [0, 4096), so p theta = a (4096 theta) + b theta. Per frequency (cheap,
# F values): Omega = 4096 theta mod 2 pi is formed as s + e (two float32) to ~1e-13. Per element,
# every product of a 12-bit integer with a 12-bit float32 piece is exact, the two large exact
# products are reduced mod 2 pi with a Cody-Waite split of 2 pi, and the small pieces are added.
# Exact products also make the result independent of FMA contraction. Derivation and measured
# errors: docs/rope.md.
# ----------------------------------------------------------------------------------------------
def _truncate_bits(value: float, bits: int) -> float:
    mantissa, exponent = math.frexp(value)
    return math.floor(mantissa * 2.0**bits) * 2.0 ** (exponent - bits)


# 2 pi = _C1 + _C2 + _C3 + _C4: 12-bit pieces (k * _Ci exact for |k| < 2^12) and a float32 rest.
_C1 = _truncate_bits(2 * math.pi, 12)
_C2 = _truncate_bits(2 * math.pi - _C1, 12)
_C3 = _truncate_bits(2 * math.pi - _C1 - _C2, 12)
_C4 = float(np.float32(2 * math.pi - _C1 - _C2 - _C3))
_C34 = float(np.float32(_C3 + _C4))
_SPLIT = 12  # p = a * 2^12 + b


def _high_bits(x: jax.Array) -> jax.Array:
    """x with its 12 leading significant bits (sign, exponent and 11 stored bits); x - result is
    exact."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFFF000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _reduce(x: jax.Array) -> jax.Array:
    """x - k 2 pi in about [-pi, pi] for an exact float32 x with |x| < 2^12 pi (one rounding)."""
    k = jnp.round(x * (1 / (2 * math.pi)))
    return ((x - k * _C1) - k * _C2) - k * _C34


def rope_angles(positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """`positions[..., None] * inv_freq` modulo 2 pi, in float32 to ~1e-6 rad.

    Args:
      positions: int[...]; exact for |p| < 2^24.
      inv_freq: float[F], treated as exact float32 values in [0, 1].

    Returns:
      float32[..., F], congruent to p * theta mod 2 pi, |angle| < 2 pi + 6 (not fully reduced).
    """
    positions = jnp.asarray(positions)
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(f"positions must be integers, got dtype {positions.dtype}.")
    theta = jnp.asarray(inv_freq, jnp.float32)
    # Per frequency: Omega = 4096 theta - K 2 pi = s + e. The first two subtractions are exact
    # (|K| < 2^10, |result| < 8 on a grid of 2^-22); TwoSum keeps the rounding of the third.
    big = theta * 2.0**_SPLIT
    k = jnp.round(big * (1 / (2 * math.pi)))
    r = (big - k * _C1) - k * _C2
    s = r - k * _C3
    t = s - r
    e = ((r - (s - t)) + (-k * _C3 - t)) - k * _C4
    s_hi, theta_hi = _high_bits(s), _high_bits(theta)
    s_lo, theta_lo = s - s_hi, theta - theta_hi

    p = positions.astype(jnp.int32)[..., None]
    a = jnp.right_shift(p, _SPLIT).astype(jnp.float32)  # floor(p / 4096), |a| <= 2^12
    b = jnp.bitwise_and(p, 2**_SPLIT - 1).astype(jnp.float32)  # p mod 4096
    reduced = _reduce(a * s_hi) + _reduce(b * theta_hi)  # exact products up to 2^12 pi
    return reduced + (a * s_lo + (b * theta_lo + a * e))  # |.| <= 4, 2 theta, 5e-4


# ----------------------------------------------------------------------------------------------
# Rotation.
# ----------------------------------------------------------------------------------------------
def _rotation_table(angles: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) of `angles` [..., T, 1, F], computed once per (position, frequency).

    Both tables are read back through a gather (an identity index over F) so that XLA keeps them
    as arrays: without it, XLA:CPU fuses `rope_angles` and the two transcendentals into every
    elementwise loop that reads the rotation (the forward of q and k, their transposes in the
    backward), evaluating them once per element of [B, T, N, F] instead of once per [T, F]. At the
    experiment's shape (d_model 64, 2 layers, 4 heads of 16, T 64, batch 32) those loops were a
    quarter of a training step (`benchmarks/step_profile.py`, docs/benchmarks.md). The values are
    the same either way.
    """
    index = jnp.arange(angles.shape[-1])
    return tuple(jnp.take(f(angles), index, axis=-1) for f in (jnp.cos, jnp.sin))


def apply_rope(
    x: jax.Array,
    positions: jax.Array,
    inv_freq: jax.Array,
    *,
    layout: str = "interleaved",
    attention_factor: float = 1.0,
) -> jax.Array:
    """Rotates each feature pair of x by `position * theta_k` (and scales by attention_factor).

    Args:
      x: float[..., T, N, H] queries or keys.
      positions: int[T] or int[..., T] (e.g. per-sequence positions [B, T] with a KV cache); the
        leading axes broadcast against x's.
      inv_freq: float[F], from `rope_frequencies`, 1 <= F <= H // 2. The first 2F dims of each
        head are rotated; with F < H // 2 (partial rotary) dims 2F .. H-1 pass through untouched,
        neither rotated nor scaled by attention_factor (as Hugging Face concatenates them back).
      layout: "interleaved" pairs (x_2k, x_2k+1) as Meta Llama / GPT-J; "half" pairs (x_k, x_k+F)
        as GPT-NeoX / Hugging Face `rotate_half`, both within the first 2F dims. A checkpoint
        works only with its own layout.
      attention_factor: multiplies cos and sin (YaRN); the logits q.k then scale by its square.

    Returns:
      Same shape and dtype as x; the rotation itself is computed in complex64.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout = {layout!r} is not allowed: use one of {', '.join(LAYOUTS)}.")
    if x.ndim < 3 or x.shape[-1] % 2:
        raise ValueError(f"x must be [..., T, N, H] with H even, got shape {x.shape}.")
    half = x.shape[-1] // 2
    freqs = jnp.shape(inv_freq)[0] if jnp.ndim(inv_freq) == 1 else 0
    if not 1 <= freqs <= half:
        raise ValueError(
            f"inv_freq must have shape (F,) with 1 <= F <= {half} for head dim {x.shape[-1]} "
            f"(F = {half}: the whole head; fewer: partial rotary of the first 2F dims), "
            f"got {jnp.shape(inv_freq)}."
        )
    positions = jnp.asarray(positions)
    if positions.ndim < 1 or positions.shape[-1] != x.shape[-3]:
        raise ValueError(
            f"positions must be [T] or [..., T] with T = {x.shape[-3]} (x is [..., T, N, H] "
            f"= {x.shape}), got shape {positions.shape}."
        )
    try:
        broadcast = np.broadcast_shapes(positions.shape + (1,), x.shape[:-1])
    except ValueError:
        broadcast = None
    if broadcast != x.shape[:-1]:
        raise ValueError(
            f"positions of shape {positions.shape} do not broadcast to x's [..., T] = "
            f"{x.shape[:-2]}."
        )
    angles = rope_angles(positions, inv_freq)[..., None, :]  # (..., T, 1, F)
    rotation = jax.lax.complex(*_rotation_table(angles)) * attention_factor
    x32 = x.astype(jnp.float32)
    rotated = x32[..., : 2 * freqs]  # the whole head unless partial
    if layout == "interleaved":
        pairs = rotated.reshape(*x.shape[:-1], freqs, 2)  # (..., T, N, F, 2)
        z = jax.lax.complex(pairs[..., 0], pairs[..., 1]) * rotation  # (..., T, N, F)
        out = jnp.stack([z.real, z.imag], axis=-1).reshape(rotated.shape)
    else:
        z = jax.lax.complex(rotated[..., :freqs], rotated[..., freqs:]) * rotation  # (..., T, N, F)
        out = jnp.concatenate([z.real, z.imag], axis=-1)
    if freqs < half:  # partial rotary: the other dims pass through (float32 round trip is exact)
        out = jnp.concatenate([out, x32[..., 2 * freqs :]], axis=-1)
    return out.astype(x.dtype)


def rope_decay_bound(offsets: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """RoFormer §3.4.3's relative upper bound (1/F) sum_{j=1..F} |S_j|,
    S_j = sum_{k<j} e^{i o theta_k}.

    |sum_k h_k e^{i o theta_k}| <= max_k |h_{k+1} - h_k| * sum_j |S_j| by Abel summation; the bound
    falls, with ripples, as the offset o = m - n grows, and a larger base stretches the fall.

    Args:
      offsets: int[...] relative distances m - n.
      inv_freq: float[F].

    Returns:
      float32[...]; (F + 1) / 2 at offset 0.
    """
    angles = rope_angles(offsets, inv_freq)  # (..., F)
    partial_sums = jnp.cumsum(
        jax.lax.complex(jnp.cos(angles), jnp.sin(angles)), axis=-1
    )  # S_1 .. S_F
    return jnp.mean(jnp.abs(partial_sums), axis=-1)


# ----------------------------------------------------------------------------------------------
# Eval-time position remaps: a second rotation for the far pairs (two-score attention).
# ----------------------------------------------------------------------------------------------
REMAP_TYPES = ("rerope", "self_extend")
_REMAP_KEYS = {"rerope": ("window",), "self_extend": ("window", "group")}
_REMAP_OPTIONAL = {"rerope": ("leak", "log_scale_base"), "self_extend": ("log_scale_base",)}
_REMAP_LEAST = {"log_scale_base": 2, "leak": 2}  # the smallest value of each key (else 1)


def validate_rope_remap(remap: Mapping | None) -> dict[str, Any] | None:
    """`remap` as a plain dict, checked; ValueError naming the key and what is allowed.

    A remap keeps RoPE's rotation for the pairs at distance i - j < window and gives the others
    a second rotation (`remap_positions`), scored by `posattn.attention.Far`:

      {"type": "rerope", "window": w}: ReRoPE (Su 2023, "Rectified Rotary Position Embeddings",
        github.com/bojone/rerope): every far pair sits at distance w. With "leak": k (an
        integer >= 2), Leaky ReRoPE (the same repository's `leaky_rerope_patch.py`): far pairs
        at distance w + (i - j - w) / k, the far queries rotated to i + w (k - 1) and the far
        keys to j, both with the frequencies divided by k (`remap_frequency_scale`).
      {"type": "self_extend", "window": w, "group": g}: SelfExtend (Jin et al. 2024, "LLM Maybe
        LongLM", github.com/datamllab/LongLM): far queries at i // g + w - w / g, far keys at
        j // g. g must divide w: the reference's prefill shifts by w - w / g and its decode step
        by w - w // g, which agree only then (and positions stay integers).

    Either may add "log_scale_base": b (an integer >= 2), the log-n query scale both references
    offer (ReRoPE's patch always, with b its training length; SelfExtend's `scale_base`):
    queries at position i are multiplied by max(1, log(i + 1) / log b) (`remap_query_scale`).
    """
    if remap is None:
        return None
    if not isinstance(remap, Mapping):
        raise ValueError(
            f"rope remap {remap!r} must be None or a dict such as {{'type': 'rerope', "
            "'window': 512}} or {'type': 'self_extend', 'window': 1024, 'group': 8}"
        )
    kind = remap.get("type")
    if kind not in REMAP_TYPES:
        raise ValueError(
            f"rope remap type {kind!r} is not allowed: use one of {', '.join(REMAP_TYPES)}"
        )
    want, optional = {"type", *_REMAP_KEYS[kind]}, _REMAP_OPTIONAL[kind]
    if not want <= set(remap) <= want | set(optional):
        raise ValueError(
            f"rope remap {dict(remap)!r}: a {kind!r} remap has the keys "
            f"{', '.join(sorted(want))}, and optionally {', '.join(optional)}"
        )
    keys = [key for key in (*_REMAP_KEYS[kind], *optional) if key in remap]
    for key in keys:
        value, least = remap[key], _REMAP_LEAST.get(key, 1)
        integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        if not (integral and value >= least):
            raise ValueError(f"rope remap {kind!r}: {key}={value!r} must be an integer >= {least}")
    out = {"type": kind, **{key: int(remap[key]) for key in keys}}
    if kind == "self_extend" and out["window"] % out["group"]:
        raise ValueError(
            f"rope remap 'self_extend': group={out['group']} must divide window={out['window']} "
            "(the reference shifts far queries by w - w / g in its prefill and by w - w // g "
            "when decoding; they agree only when g divides w)"
        )
    return out


def remap_positions(
    remap: Mapping, q_pos: jax.Array, k_pos: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(far query positions, far key positions), int32 of q_pos's and k_pos's shapes: where a
    remap (`validate_rope_remap`) rotates the queries and keys of the pairs at distance
    i - j >= window.

    ReRoPE rotates far queries to `window` and leaves far keys at 0, so every far pair scores at
    distance `window`; Leaky ReRoPE rotates them to i + w (k - 1) and j at frequencies / k
    (`remap_frequency_scale`), a distance of w + (i - j - w) / k; SelfExtend rotates queries to
    i // g + w - w / g and keys to j // g, so a far pair's distance is i // g - j // g + w - w / g:
    the neighbours' window continues into distances shrunk g-fold, and the largest distance at
    length T is about w + (T - w) / g.
    """
    return far_positions(remap_numbers(remap)[0], q_pos, k_pos)


def far_positions(ints, q_pos: jax.Array, k_pos: jax.Array) -> tuple[jax.Array, jax.Array]:
    """((i // g) * a_q + c_q, (j // g) * a_k), int32, for ints = (g, a_q, c_q, a_k) of
    `remap_numbers`, as Python ints or int32 arrays (`posattn.eval.lengths.TableRotary`)."""
    g, a_q, c_q, a_k = ints
    q_pos = jnp.asarray(q_pos, jnp.int32)
    k_pos = jnp.asarray(k_pos, jnp.int32)
    return (q_pos // g) * a_q + c_q, (k_pos // g) * a_k


def remap_numbers(remap: Mapping) -> tuple[tuple[int, int, int, int], tuple[float, float]]:
    """((g, a_q, c_q, a_k), (frequency scale, log base)) of a remap: its far query positions are
    (i // g) * a_q + c_q and its far keys (j // g) * a_k (`remap_positions`), its far rotations
    multiply the frequencies by the scale (`remap_frequency_scale`), and its queries are
    multiplied by max(1, log(i + 1) / log base) (`remap_query_scale`; an infinite base: by 1).
    The numbers let one program serve every remap of one window (`posattn.eval.lengths`)."""
    w = int(remap["window"])
    if remap["type"] == "rerope" and remap.get("leak"):
        ints = (1, 1, w * (int(remap["leak"]) - 1), 1)
    elif remap["type"] == "rerope":
        ints = (1, 0, w, 0)
    else:
        g = int(remap["group"])
        ints = (g, 1, w - w // g, 1)
    base = remap.get("log_scale_base")
    return ints, (remap_frequency_scale(remap), math.inf if base is None else math.log(base))


def remap_frequency_scale(remap: Mapping) -> float:
    """What the far rotations multiply the frequencies by: 1 / k for Leaky ReRoPE (its
    reference's `LlamaLinearScalingRotaryEmbedding` of factor k), 1 otherwise."""
    leak = remap.get("leak")
    return 1.0 / int(leak) if leak else 1.0


def remap_query_scale(remap: Mapping, q_pos: jax.Array) -> jax.Array | None:
    """float32 max(1, log(i + 1) / log b) at the query positions (q_pos's shape), the remap's
    log-n query scale, or None when it has no "log_scale_base" b."""
    base = remap.get("log_scale_base")
    return None if base is None else log_n_scale(q_pos, math.log(base))


def log_n_scale(q_pos: jax.Array, log_base) -> jax.Array:
    """float32 max(1, log(i + 1) / log_base) at the query positions; log_base a Python float or
    a float32 array (an infinite one gives exactly 1)."""
    return jnp.maximum(1.0, jnp.log(jnp.asarray(q_pos, jnp.float32) + 1.0) / log_base)
