"""Absolute position embeddings and relative-bias families, as pure functions.

Conventions (docs/conventions.md): `i` is the query position, `j` the key position, `offset = i - j`
(positive when the key lies in the past). Shape letters: T query length, S key length, N heads, D
model dim, P rows of a learned table; `...` is any shape of offsets (usually `[T, S]`).

Every bias function returns float32 `[N, ...]`, heads first, so that it adds onto logits
`[N, T, S]`. Integer hyperparameters (`dim`, `num_heads`, bucket settings) are Python values used
at trace time: mark them static under `jax.jit`. Array arguments (positions, offsets, slopes,
Kerple `r1`/`r2`, FIRE `c`/`L`) may be traced, batched with `jax.vmap` and differentiated.

Each function names the reference code it reproduces; docs/families.md lists them with the tests
that pin them (tests/test_positions.py) and every place we deviate from a paper.
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "sinusoidal",
    "learned_embedding",
    "t5_bucket",
    "alibi_slopes",
    "alibi_bias",
    "kerple_power_bias",
    "kerple_log_bias",
    "sandwich_bias",
    "fire_normalized_distance",
    "FIRE_EPS",
    "llama4_attention_scale",
    "visible_keys",
    "ssmax_scale",
]

# Added to FIRE's log-normaliser, as `eps=1e-6` in the FIRE paper's reference listing (Li et al.
# 2024, arXiv 2310.04418), so that a zero normaliser (query 0 with L = 0) cannot divide by zero.
FIRE_EPS = 1e-6


def _static_int(name: str, value, minimum: int) -> int:
    """Validates a trace-time integer hyperparameter; the message names the setting."""
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a Python int (a static setting), got {value!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _int_array(name: str, x) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must hold integer positions/offsets, got dtype {x.dtype}")
    return x


def _heads_first(param, ndim: int) -> jax.Array:
    """float32 `[N] -> [N, 1, ..., 1]` so a per-head parameter broadcasts over `ndim` offset
    axes."""
    param = jnp.asarray(param, jnp.float32)
    return param.reshape(param.shape + (1,) * ndim)


# --------------------------------------------------------------------------------------------
# Absolute embeddings (e_i = x_i + PE(i); docs/conventions.md).
# --------------------------------------------------------------------------------------------


def sinusoidal(positions, dim: int) -> jax.Array:
    """Sinusoidal position embedding of Vaswani et al. (2017), §3.5.

    `PE(i, 2k) = sin(i / 10000^(2k/dim))`, `PE(i, 2k+1) = cos(i / 10000^(2k/dim))`: sine and
    cosine interleaved column by column, exactly as the formula indexes them (the Annotated
    Transformer's `pe[:, 0::2] = sin`, `pe[:, 1::2] = cos`). For odd `dim` the last column is the
    sine of pair `k = (dim - 1) / 2`, i.e. the formula evaluated at every column that exists.

    Args:
      positions: int[T] (or any shape `[...]`) absolute positions.
      dim: embedding width D (static).

    Returns:
      float32[T, dim] (`[..., dim]`).
    """
    dim = _static_int("dim", dim, 1)
    # Frequencies in float64 on the host, rounded once to float32: the most accurate float32
    # value of each 10000^(-2k/dim); the angle is then a single float32 product, as in the
    # reference implementations.
    k = np.arange((dim + 1) // 2, dtype=np.float64)
    inv_freq = (10000.0 ** (-2.0 * k / dim)).astype(np.float32)
    angle = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq  # [..., ceil(D/2)]
    pe = jnp.stack([jnp.sin(angle), jnp.cos(angle)], axis=-1)  # [..., ceil(D/2), 2]
    pe = pe.reshape(*angle.shape[:-1], 2 * angle.shape[-1])  # [..., 2 ceil(D/2)] interleaved
    return pe[..., :dim]


def learned_embedding(table, positions) -> jax.Array:
    """Checked lookup of learned absolute position embeddings (GPT-style), never clamped.

    JAX indexing silently clamps out-of-range indices (and `jnp.take(mode="fill")` still wraps
    negative ones), which would hand position P+5 the row of P-1. A learned table has nothing for
    positions it was not trained on (docs/conventions.md), so:

    * positions concrete (eager call, NumPy or committed array): any position outside `[0, P)`
      raises `ValueError` naming the table size, the offending position and the fix;
    * positions traced (under `jax.jit`, `jax.vmap`, `grad`): no value is known at trace time, so
      every out-of-range row comes back as NaN -- loudly wrong, and caught by a NaN guard on the
      loss. Validate the length before jitting (the config check of `model.max_len`).

    Args:
      table: float[P, D] embedding table (floating dtype, kept in the output).
      positions: int[...] positions to look up.

    Returns:
      `[..., D]` rows of `table`, same dtype as `table`.

    Raises:
      ValueError: a concrete position is outside `[0, P)`.
      TypeError: `table` is not floating or `positions` are not integers.
    """
    table = jnp.asarray(table)
    positions = _int_array("positions", positions)
    if table.ndim != 2 or not jnp.issubdtype(table.dtype, jnp.floating):
        raise TypeError(f"table must be float[P, D], got {table.dtype}{list(table.shape)}")
    num_positions = table.shape[0]
    if not isinstance(positions, jax.core.Tracer) and positions.size:
        hi, lo = int(jnp.max(positions)), int(jnp.min(positions))
        if hi >= num_positions:
            raise ValueError(
                f"learned position embedding: position {hi} requested but the table has only "
                f"{num_positions} positions (0..{num_positions - 1}); learned embeddings cannot "
                f"extrapolate. Raise model.max_len to at least {hi + 1} or use a relative "
                "family (rope, alibi, t5, kerple_*, sandwich, fire)."
            )
        if lo < 0:
            raise ValueError(f"learned position embedding: negative position {lo} requested")
    valid = (positions >= 0) & (positions < num_positions)  # [...]
    rows = table[jnp.clip(positions, 0, num_positions - 1)]  # [..., D]
    return jnp.where(valid[..., None], rows, jnp.asarray(jnp.nan, table.dtype))


# --------------------------------------------------------------------------------------------
# T5 relative-position buckets (Raffel et al. 2020; docs/conventions.md).
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _t5_thresholds(num_buckets: int, max_distance: int) -> tuple[int, ...]:
    """Smallest distance `n` reaching each logarithmic bucket, from the reference formula.

    Evaluates t5x `RelativePositionBiases._relative_position_bucket` (google-research/t5x,
    t5x/examples/t5/layers.py) on the host, in NumPy float32 -- the arithmetic of mesh-tensorflow
    and of t5x under NumPy 1.x -- including t5x's `+ finfo(float32).eps` inside the log, for every
    `n` in `[max_exact, max_distance]`. The bucket is non-decreasing in `n` (float32 log is
    monotone) and reaches `num_buckets - 1` by `n = max_distance`, so the thresholds determine the
    bucket of every distance exactly. The device then only compares integers: no transcendental
    whose last-ulp rounding differs between NumPy, XLA:CPU, GPU and TPU can move a boundary
    (boundaries such as n = 16, 32, 64 for 32 bidirectional buckets sit exactly on integers).
    """
    max_exact = num_buckets // 2
    n = np.arange(max_exact, max_distance + 1, dtype=np.int64)
    scaled = np.log(n.astype(np.float32) / np.float32(max_exact) + np.finfo(np.float32).eps)
    scaled = scaled / np.float32(math.log(max_distance / max_exact))  # float32 / float32
    scaled = scaled * np.float32(num_buckets - max_exact)
    bucket = np.minimum(max_exact + scaled.astype(np.int32), num_buckets - 1)
    assert bucket[0] == max_exact and bucket[-1] == num_buckets - 1
    assert np.all(np.diff(bucket) >= 0), "reference bucket formula is not monotone"
    targets = np.arange(max_exact + 1, num_buckets)
    return tuple(int(t) for t in n[np.searchsorted(bucket, targets, side="left")])


def t5_bucket(
    offset, *, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128
) -> jax.Array:
    """T5 relative-position bucket of each offset `i - j` (Raffel et al. 2020).

    Follows mesh-tensorflow / t5x `_relative_position_bucket`, not the `n_b + 1` wording
    of some textbook accounts. With `n = i - j` (the reference's `-relative_position`):
    bidirectional halves `num_buckets`, keys in the future (`n < 0`) take the upper half and
    `n = |n|`; causal uses `n = max(n, 0)` (future keys share bucket 0). Then `n < max_exact =
    buckets // 2` gets bucket `n`; larger `n` gets `max_exact + int(log(n / max_exact + eps) /
    log(max_distance / max_exact) * (buckets - max_exact))`, capped at `buckets - 1`, evaluated
    bit-exactly as the float32 reference (see `_t5_thresholds`).

    Args:
      offset: int[...] query-minus-key offsets `i - j`.
      bidirectional: encoder-style buckets for both signs (static).
      num_buckets: total number of buckets, the rows of the learned bias table (static).
      max_distance: distance from which all offsets share the last bucket (static).

    Returns:
      int32[...] bucket indices in `[0, num_buckets)`.
    """
    num_buckets = _static_int("num_buckets", num_buckets, 4 if bidirectional else 2)
    n = _int_array("offset", offset).astype(jnp.int32)
    if bidirectional:
        num_buckets //= 2
        ret = jnp.where(n < 0, num_buckets, 0).astype(jnp.int32)
        n = jnp.abs(n)
    else:
        ret = jnp.zeros_like(n)
        n = jnp.maximum(n, 0)
    max_exact = num_buckets // 2
    max_distance = _static_int("max_distance", max_distance, max_exact + 1)
    if max_distance > 2**24:  # float32 (the reference's arithmetic) stops being exact on integers
        raise ValueError(f"max_distance must be <= 2**24, got {max_distance}")
    large = jnp.full_like(n, max_exact)
    for threshold in _t5_thresholds(num_buckets, max_distance):  # <= num_buckets/2 fused compares
        large = large + (n >= threshold).astype(jnp.int32)
    return ret + jnp.where(n < max_exact, n, large)


# --------------------------------------------------------------------------------------------
# ALiBi (Press et al. 2022).
# --------------------------------------------------------------------------------------------


def _alibi_slopes_list(n: int) -> list[float]:
    # ofirpress/attention_with_linear_biases, fairseq/models/transformer.py, `get_slopes`, in the
    # same Python float64 arithmetic (`start * ratio**h`) so the float32 cast is bit-identical.
    if math.log2(n).is_integer():
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))  # = 2^(-8/n)
        return [start * start**h for h in range(n)]
    closest = 2 ** math.floor(math.log2(n))
    # Non-power-of-two n: slopes of the largest power of two below n, then every other slope of
    # the 2*closest sequence (the odd-numbered ones, which interleave) until there are n.
    return _alibi_slopes_list(closest) + _alibi_slopes_list(2 * closest)[0::2][: n - closest]


def alibi_slopes(num_heads: int) -> jax.Array:
    """ALiBi head slopes `m_h = 2^(-8h/N)`, with the reference rule for any head count.

    `1/2^(8/k)`, as some write-ups print it, is a misprint of `2^(-8k/n)`; we follow the
    reference code. For N = 6 the result is `[2^-2, 2^-4, 2^-6, 2^-8, 2^-1, 2^-3]`: not sorted.

    Args:
      num_heads: N (static).

    Returns:
      float32[N].
    """
    num_heads = _static_int("num_heads", num_heads, 1)
    return jnp.asarray(np.asarray(_alibi_slopes_list(num_heads), np.float32))


def alibi_bias(offset, slopes) -> jax.Array:
    """ALiBi bias `-m_h * offset` (Press et al. 2022).

    Causal use passes `offset = i - j`. The fairseq code adds `m_h * j` instead, which differs
    from this by `m_h * i`, a per-row constant that softmax ignores. Bidirectional use (no
    official variant; NeMo's `ALiBiRelativePositionEmbedding(bidirectional=True)`) passes
    `abs(i - j)`: the caller chooses, this function never takes the absolute value itself.

    Args:
      offset: int[...] (or float) offsets; `jnp.abs(i - j)` for the bidirectional variant.
      slopes: float[N] per-head slopes, normally `alibi_slopes(N)`.

    Returns:
      float32[N, ...].
    """
    offset = jnp.asarray(offset, jnp.float32)
    return -_heads_first(slopes, offset.ndim) * offset


# --------------------------------------------------------------------------------------------
# Kerple (Chi et al. 2022).  Reference: chijames/KERPLE, megatron/mpu/layers.py,
# `ParallelKerplePower.forward` (`-bias_a * diff**bias_p`) and `ParallelKerpleLog.forward`
# (`-bias_p * log(1 + bias_a * diff)`); our r1 is their outer factor, r2 the inner one.
# Keeping r1, r2 in range (clamp >= 0.01, r2 <= 2 for power) is the module's job
# (docs/conventions.md).
# --------------------------------------------------------------------------------------------


def kerple_power_bias(offset, r1, r2) -> jax.Array:
    """Kerple power bias `-r1 * |offset|^r2`, one `(r1, r2)` per head.

    `|0|^r2` is computed so that its gradients are finite: at offset 0 the value is 0 (the limit
    for r2 > 0, and the reference value on its clamped domain `0.01 <= r2 <= 2`) and both
    gradients are exactly 0, instead of the `0 * log(0)` / `r2 * 0^(r2-1)` NaN of a naive power.

    Args:
      offset: int[...] offsets `i - j` (any sign; the absolute value is taken).
      r1: float[N] positive scales.
      r2: float[N] exponents in `(0, 2]`.

    Returns:
      float32[N, ...].
    """
    dist = jnp.abs(jnp.asarray(offset, jnp.float32))  # [...]
    r1, r2 = _heads_first(r1, dist.ndim), _heads_first(r2, dist.ndim)
    nonzero = dist > 0
    # Double `where`: the power only ever sees a positive base, so no NaN/inf flows backwards.
    powered = jnp.power(jnp.where(nonzero, dist, 1.0), r2)  # [N, ...]
    return -r1 * jnp.where(nonzero, powered, 0.0)


def kerple_log_bias(offset, r1, r2) -> jax.Array:
    """Kerple logarithmic bias `-r1 * log(1 + r2 * |offset|)`, one `(r1, r2)` per head.

    Uses `log1p`, which is exact where the reference's `log(1 + x)` rounds `1 + x` first (a
    difference of at most a few float32 ulps, toward the true value).

    Args:
      offset: int[...] offsets `i - j` (any sign; the absolute value is taken).
      r1: float[N] positive scales.
      r2: float[N] positive rates.

    Returns:
      float32[N, ...].
    """
    dist = jnp.abs(jnp.asarray(offset, jnp.float32))  # [...]
    r1, r2 = _heads_first(r1, dist.ndim), _heads_first(r2, dist.ndim)
    return -r1 * jnp.log1p(r2 * dist)


# --------------------------------------------------------------------------------------------
# Sandwich (Chi et al. 2023), in the form of NVIDIA/NeMo
# nemo/collections/nlp/modules/common/megatron/position_embedding/
# sandwich_relative_position_embedding.py, `SandwichRelativePositionEmbedding.forward`.
# --------------------------------------------------------------------------------------------


def sandwich_bias(offset, *, head_dim: int, num_heads: int) -> jax.Array:
    """Sandwich bias: inner product of two sinusoidal embeddings, shifted and ALiBi-compressed.

    `bias_h(o) = (sum_{k=1..d'/2} cos(o / 10000^(2k/d')) - d'/2) / (8h/N)`, `h = 1..N`, `d'` the
    head dim; `k` starts at 1 as in NeMo. Computed as `-2 sum_k sin^2(theta_k / 2)`, the same
    quantity without the cancellation of `sum cos - d'/2`: offset 0 gives exactly 0 and small
    offsets keep full relative precision (NeMo's float32 form loses ~1e-6 absolute there).
    Even in `offset` (cos), so causal and bidirectional use are the same call.

    Args:
      offset: int[...] offsets `i - j`.
      head_dim: d', even (static).
      num_heads: N (static).

    Returns:
      float32[N, ...].
    """
    head_dim = _static_int("head_dim", head_dim, 2)
    num_heads = _static_int("num_heads", num_heads, 1)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for sandwich_bias, got {head_dim}")
    k = np.arange(1, head_dim // 2 + 1, dtype=np.float64)
    inv_freq = (10000.0 ** (-2.0 * k / head_dim)).astype(np.float32)  # [d'/2]
    dist = jnp.abs(jnp.asarray(offset, jnp.float32))  # [...]
    half_angle = dist[..., None] * inv_freq * 0.5  # [..., d'/2]; x0.5 is exact
    base = -2.0 * jnp.sum(jnp.square(jnp.sin(half_angle)), axis=-1)  # [...]
    # NeMo divides by (h * 8 / N) computed in float32; same rounding here.
    scale = np.float32(8.0) * np.arange(1, num_heads + 1, dtype=np.float32) / np.float32(num_heads)
    return base / _heads_first(scale, base.ndim)


# --------------------------------------------------------------------------------------------
# FIRE (Li et al. 2024).
# --------------------------------------------------------------------------------------------


def fire_normalized_distance(q_pos, k_pos, *, c, L, norm_cap=None) -> jax.Array:
    """FIRE's progressively interpolated distance `psi(i - j) / psi(max(L, i))`, before the MLP.

    As in the paper's reference listing (arXiv 2310.04418; reproduced e.g. in mcleish7/arithmetic
    cramming/architectures/embeddings.py, `FIRE.forward`): `psi(x) = log(|c x| + 1)`, with the
    absolute value inside so future keys (bidirectional use) are symmetric; the threshold is
    `|L|` (the reference learns `L = L_multiplier * init_L`, init_L = 512, and takes `abs`: pass
    that product here); the normaliser gets `+ FIRE_EPS`. Causal offsets land in `[0, 1)`.
    Differentiable in `c` and `L` (through `max`, only where `|L| > i`). Pass the true query
    positions when decoding with a KV cache.

    Args:
      q_pos: int[T] query positions `i`.
      k_pos: int[S] key positions `j`.
      c: float scalar, log-transform rate (> 0; the reference initialises 0.1).
      L: float scalar, normaliser threshold.
      norm_cap: None (the paper), or the query position past which the normaliser stops growing:
        `psi(max(L, min(i, norm_cap)))`. Not in the paper: a diagnostic of what the growing
        normaliser does past the trained lengths (with a cap of at least the last trained
        position, training is unchanged; past the cap, offsets beyond it map above 1).

    Returns:
      float32[T, S].
    """
    q = jnp.asarray(q_pos, jnp.float32)  # [T]
    k = jnp.asarray(k_pos, jnp.float32)  # [S]
    c = jnp.asarray(c, jnp.float32)
    threshold = jnp.abs(jnp.asarray(L, jnp.float32))
    psi = lambda x: jnp.log1p(jnp.abs(c * x))  # noqa: E731  log(|c x| + 1), exact near 0
    rel = psi(q[..., :, None] - k[..., None, :])  # [T, S]
    q_norm = q if norm_cap is None else jnp.minimum(q, jnp.asarray(norm_cap, jnp.float32))
    norm = psi(jnp.maximum(q_norm, threshold)) + FIRE_EPS  # [T]
    return rel / norm[..., :, None]


# ----------------------------------------------------------------------------------------------
# Length temperatures: factors the queries are multiplied by, functions of the query's position.


def llama4_attention_scale(positions, *, floor_scale: float, attn_scale: float) -> jax.Array:
    """Llama 4's query temperature `1 + attn_scale * log(floor((i + 1) / floor_scale) + 1)`.

    Hugging Face `modeling_llama4.py` (`Llama4TextAttention.forward`, `attn_temperature_tuning`,
    applied to the queries of its NoPE layers after RoPE and the QK norm): computed in float32
    from the absolute position `i` (`cache_position`, so a decode step passes its own), the
    queries multiplied by it and cast back to their dtype. 1 for `i + 1 < floor_scale`.

    Args:
      positions: int[...] absolute query positions.
      floor_scale: positions per step of the temperature (Llama 4: 8192).
      attn_scale: its slope (Llama 4: 0.1).

    Returns:
      float32[...].
    """
    i = jnp.asarray(positions, jnp.float32)
    return 1.0 + attn_scale * jnp.log(jnp.floor((i + 1.0) / floor_scale) + 1.0)


def visible_keys(positions, *, kv_len, window: int | None = None, causal: bool = True):
    """n_i, the number of keys query `i` sees: the keys `j < kv_len` inside its window and, when
    causal, not after it (causal: `min(i + 1, window, kv_len)` for `i < kv_len`).

    Args:
      positions: int[T] or int[B, T] query positions.
      kv_len: int or int[B] valid keys (positions 0..kv_len-1).
      window: None or the sliding window (query i sees j iff |i - j| < window).
      causal: hide keys j > i.

    Returns:
      int32 of the broadcast shape of positions and kv_len ([T], [B, T]).
    """
    i = jnp.asarray(positions, jnp.int32)
    kv = jnp.asarray(kv_len, jnp.int32)
    if kv.ndim == 1:
        kv = kv[:, None]  # (B, 1)
    hi = kv - 1 if not causal else jnp.minimum(i, kv - 1)
    lo = jnp.zeros_like(i)
    if window is not None:
        lo = jnp.maximum(lo, i - window + 1)
        if not causal:
            hi = jnp.minimum(hi, i + window - 1)
    return jnp.maximum(hi - lo + 1, 0)


def ssmax_scale(num_keys, s) -> jax.Array:
    """Scalable softmax (Nakanishi 2025, arXiv 2501.19399): the factor `s_h * log n_i` its
    logits are multiplied by (`softmax(s log(n) z)` is `n^(s z_j) / sum_k n^(s z_k)`).

    Args:
      num_keys: int[...] n_i (`visible_keys`); a row that sees no key counts as 1 (factor 0).
      s: float[N] per-head scale.

    Returns:
      float32[..., N].
    """
    n = jnp.maximum(jnp.asarray(num_keys, jnp.float32), 1.0)
    return jnp.log(n)[..., None] * jnp.asarray(s, jnp.float32)
