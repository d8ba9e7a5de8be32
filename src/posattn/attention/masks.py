"""Positions, visibility masks and materialised biases: the conventions every implementation shares.

Query positions are `q_offset + arange(T)` (q_offset a scalar or one per batch row), key positions
`arange(S)` (docs/attention.md). `causal` hides keys j > i, `kv_lengths` hides keys j >= length,
and a sliding `window` w hides keys with i - j >= w (and, without `causal`, j - i >= w): the
`sliding_window` of Hugging Face's Mistral and Gemma 2/3 masks, where query i sees key j iff
i - j < w. `visible` is the one definition of which keys a query sees.

The forgetting-attention term (FoX, Lin et al. 2025, "Forgetting Transformer: Softmax Attention
with a Forget Gate"): with `c = cumsum(log_forget, axis=1)` in float32, the logit of (i, j) gains
`c[i] - c[j] = sum_{l=j+1..i} log_forget[l]` per query head; query i reads c at its own position.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

f32 = jnp.float32


class Far(NamedTuple):
    """A second query/key pair for the pairs at distance `window` and beyond: two-score attention.

    The logit of query i and key j is scale * q_i . k_j while i - j < window (|i - j| < window
    when not causal), and scale * far.q_i . far.k_j from there on; the soft cap, the bias, the
    forget term and the masks then apply to either alike. Eval-time RoPE position remaps are
    this: ReRoPE (Su 2023), whose far queries are rotated at position `window` and far keys not
    at all, and SelfExtend (Jin et al. 2024), whose far queries and keys are rotated at their
    positions floor-divided by a group size (`posattn.rotary.remap_positions`).

    Attributes:
      q: float[B, T, N, H], the far queries (the near ones are attention's q).
      k: float[B, S, K, H], the far keys.
      window: a static int >= 1, the distance from which a pair scores with q and k here.
    """

    q: jax.Array
    k: jax.Array
    window: int


def query_positions(q_offset: jax.Array, T: int) -> jax.Array:
    """int32[B or 1, T]: q_offset + arange(T), one row per batch element if q_offset is per-row."""
    return jnp.atleast_1d(q_offset)[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]


def visible(q_pos, k_pos, *, causal: bool, kv_lengths, window: int | None = None):
    """bool[B or 1, t, s] (True = query row may attend to key column), or None if nothing is hidden.

    q_pos: int[B or 1, t] query positions; k_pos: int[s] key positions; kv_lengths: int[B or 1] or
    None; window: None or a static int w >= 1 (query i sees key j only if i - j < w, and also
    j - i < w when not causal).
    """
    mask = None
    if causal:
        mask = k_pos[None, None, :] <= q_pos[:, :, None]  # (B|1, t, s)
    if window is not None:
        near = within_window(q_pos, k_pos, window, causal=causal)
        mask = near if mask is None else mask & near
    if kv_lengths is not None:
        valid = k_pos[None, None, :] < kv_lengths[:, None, None]  # (B|1, 1, s)
        mask = valid if mask is None else mask & valid
    return mask


def within_window(q_pos, k_pos, window: int, *, causal: bool):
    """bool[B or 1, t, s]: i - j < window (and j - i < window when not causal), i the query
    positions int[B or 1, t], j the key positions int[s]: a sliding window's visible pairs, and
    the pairs a two-score attention (`posattn.attention.Far`) scores with its near q and k."""
    distance = q_pos[:, :, None] - k_pos[None, None, :]  # (B|1, t, s): i - j
    near = distance < window
    return near if causal else near & (-distance < window)


def visibility_mask(q_pos, S, *, causal, kv_lengths, window=None):
    """bool[B or 1, T, S]: True where query (row) may attend to key (column)."""
    k_pos = jnp.arange(S, dtype=jnp.int32)
    mask = visible(q_pos, k_pos, causal=causal, kv_lengths=kv_lengths, window=window)
    full = jnp.ones(q_pos.shape + (S,), bool)  # (B|1, T, S)
    return full if mask is None else full & mask


def evaluate_bias(fn, params, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """float32[B or 1, N, t, s]: a BiasFn evaluated on each row of q_pos (int[B or 1, t])."""
    return jax.vmap(fn, in_axes=(None, 0, None))(params, q_pos, k_pos).astype(f32)


def materialize_bias(bias, q_pos: jax.Array, S: int) -> jax.Array:
    """float32[B or 1, N, T, S] from either bias form; q_pos is int[B or 1, T]."""
    if isinstance(bias, tuple):
        fn, params = bias
        return evaluate_bias(fn, params, q_pos, jnp.arange(S, dtype=jnp.int32))  # (B|1, N, T, S)
    return jnp.asarray(bias, f32)[None]  # (1, N, T, S)


# ----------------------------------------------------------------------------------------------
# Forgetting attention.


def forget_cumsum(log_forget: jax.Array) -> jax.Array:
    """float32[B, S, N]: c = cumsum(log_forget) over the key axis, in float32 whatever the input
    dtype."""
    return jnp.cumsum(log_forget.astype(f32), axis=1)


def forget_at_queries(c: jax.Array, q_pos: jax.Array) -> jax.Array:
    """float32[B, t, N]: c[b, i, h] at each query position i of q_pos (int[B or 1, t]).

    Positions outside [0, S) are clipped: a query at i < 0 sees no key under the causal mask that
    forgetting attention requires, and i >= S is outside the contract (i < S, as in
    self-attention and a KV cache).
    """
    B, S, _ = c.shape
    idx = jnp.broadcast_to(jnp.clip(q_pos, 0, S - 1), (B, q_pos.shape[1]))  # (B, t)
    return jnp.take_along_axis(c, idx[:, :, None], axis=1)  # (B, t, N)


def materialize_forget(c: jax.Array, q_pos: jax.Array) -> jax.Array:
    """float32[B, N, T, S]: the forget term c_i - c_j for every query and key."""
    c_q = forget_at_queries(c, q_pos)  # (B, T, N)
    return jnp.transpose(c_q, (0, 2, 1))[:, :, :, None] - jnp.transpose(c, (0, 2, 1))[:, :, None]


def relative_bias_table(fn, params, q_offset, T: int, S: int) -> jax.Array:
    """float32[B or 1, N, T, S]: a relative BiasFn (one that depends on i - j only) at queries
    q_offset + arange(T) and keys arange(S), evaluated once per offset and gathered.

    A row's offsets i - j are the T + S - 1 integers from q_offset - (S - 1) up; `fn` reads each
    at query position i - j and key position 0, which gives the same integer offset, hence the
    same value, as the (i, j) it stands for. The gather's indices are static."""
    lo = jnp.atleast_1d(q_offset).astype(jnp.int32) - (S - 1)  # (B|1,) smallest offset a row
    offsets = lo[:, None] + jnp.arange(T + S - 1, dtype=jnp.int32)[None, :]  # (B|1, T+S-1)
    table = evaluate_bias(fn, params, offsets, jnp.zeros((1,), jnp.int32))[..., 0]  # (B|1, N, O)
    index = np.arange(T)[:, None] - np.arange(S)[None, :] + (S - 1)  # (T, S): offset - lo
    return jnp.take(table, jnp.asarray(index, jnp.int32), axis=-1)  # (B|1, N, T, S)


def materialize_logit_bias(bias, c, q_pos: jax.Array, S: int) -> jax.Array | None:
    """float32[B or 1, N, T, S]: the position bias plus the forget term (c the forget cumsum or
    None), or None when there is neither."""
    terms = []
    if bias is not None:
        terms.append(materialize_bias(bias, q_pos, S))
    if c is not None:
        terms.append(materialize_forget(c, q_pos))
    if not terms:
        return None
    return terms[0] if len(terms) == 1 else terms[0] + terms[1]


def masked_logit_bias(
    bias, log_forget, q_offset, T: int, S: int, *, causal, kv_lengths, window, ranged=False
) -> tuple[jax.Array | None, bool]:
    """The one logit bias a kernel that takes it materialised ("chunked", "native") adds:
    float32[B or 1, N or 1, T, S] (or None), the position bias plus the forget term with -inf at
    the keys the visibility mask hides, and whether it needs a gradient (a position bias or a
    forget term; a mask alone does not). `ranged`: the kernel hides the causal keys, and the
    window's, itself, so only per-row key lengths join the mask. A bias marked `tabulate`
    (`posattn.families.BiasSpec`) is evaluated once per offset (`relative_bias_table`)."""
    q_pos = query_positions(q_offset, T)  # (B or 1, T)
    c = None if log_forget is None else forget_cumsum(log_forget)  # (B, S, N)
    if isinstance(bias, tuple) and getattr(bias[0], "tabulate", False):
        tabled = relative_bias_table(*bias, q_offset, T, S)  # (B|1, N, T, S)
        logit_bias = tabled if c is None else tabled + materialize_forget(c, q_pos)
    else:
        logit_bias = materialize_logit_bias(bias, c, q_pos, S)  # (B|1, N, T, S) or None
    if kv_lengths is not None or (not ranged and (causal or window is not None)):
        visible = visibility_mask(q_pos, S, causal=causal, kv_lengths=kv_lengths, window=window)
        logit_bias = jnp.where(
            visible[:, None], 0.0 if logit_bias is None else logit_bias, -jnp.inf
        )  # (B|1, N|1, T, S)
    return logit_bias, bias is not None or c is not None
