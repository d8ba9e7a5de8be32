"""Positions, visibility masks and materialised biases: the conventions every implementation shares.

Query positions are `q_offset + arange(T)` (q_offset a scalar or one per batch row), key positions
`arange(S)` (docs/attention.md). `causal` hides keys j > i, `kv_lengths` hides keys j >= length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def query_positions(q_offset: jax.Array, T: int) -> jax.Array:
    """int32[B or 1, T]: q_offset + arange(T), one row per batch element if q_offset is per-row."""
    return jnp.atleast_1d(q_offset)[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]


def visible(q_pos, k_pos, *, causal: bool, kv_lengths) -> jax.Array | None:
    """bool[B or 1, t, s] (True = query row may attend to key column), or None if nothing is hidden.

    q_pos: int[B or 1, t] query positions; k_pos: int[s] key positions; kv_lengths: int[B or 1] or
    None.
    """
    mask = None
    if causal:
        mask = k_pos[None, None, :] <= q_pos[:, :, None]  # (B|1, t, s)
    if kv_lengths is not None:
        valid = k_pos[None, None, :] < kv_lengths[:, None, None]  # (B|1, 1, s)
        mask = valid if mask is None else mask & valid
    return mask


def visibility_mask(q_pos, S, *, causal, kv_lengths):
    """bool[B or 1, T, S]: True where query (row) may attend to key (column)."""
    k_pos = jnp.arange(S, dtype=jnp.int32)
    mask = visible(q_pos, k_pos, causal=causal, kv_lengths=kv_lengths)
    full = jnp.ones(q_pos.shape + (S,), bool)  # (B|1, T, S)
    return full if mask is None else full & mask


def evaluate_bias(fn, params, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """float32[B or 1, N, t, s]: a BiasFn evaluated on each row of q_pos (int[B or 1, t])."""
    return jax.vmap(fn, in_axes=(None, 0, None))(params, q_pos, k_pos).astype(jnp.float32)


def materialize_bias(bias, q_pos: jax.Array, S: int) -> jax.Array:
    """float32[B or 1, N, T, S] from either bias form; q_pos is int[B or 1, T]."""
    if isinstance(bias, tuple):
        fn, params = bias
        return evaluate_bias(fn, params, q_pos, jnp.arange(S, dtype=jnp.int32))  # (B|1, N, T, S)
    return jnp.asarray(bias, jnp.float32)[None]  # (1, N, T, S)
