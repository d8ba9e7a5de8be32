"""The KV cache of a sliding-window layer: a ring buffer of its last `window` keys.

Shape legend: B batch, T chunk length, W window (ring rows), K key/value heads, H head dim.

A windowed layer never reads a key more than `window - 1` positions back, so its cache needs
only W = window rows: position p lives in row `p % W`. To attend, the ring's live rows (positions
`start - min(start, W) .. start - 1`) and the chunk's (`start .. start + T - 1`) are laid out
contiguously, `shift + r` the position of row r, and handed to the attention core with query
offset `start - shift` and lengths `kv_lengths - shift`: every position the core sees is the true
one minus `shift`, the same for queries and keys. The causal mask, the window and every bias
that depends on `i - j` only (`families.BiasSpec.relative`) are unchanged by that; RoPE keys
are cached rotated at their true position, and the length temperatures use the true positions
(`nn/temperature.py`). A layer whose position signal depends on the absolute position otherwise
(FIRE, dynamic NTK) keeps a full cache (`posattn.nn.decode.init_cache`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["assemble", "write_ring"]


def _rows(start, B: int) -> jax.Array:
    return jnp.broadcast_to(jnp.asarray(start, jnp.int32), (B,))


def assemble(ring: jax.Array, chunk: jax.Array, start) -> tuple[jax.Array, jax.Array]:
    """The live keys of a ring and a chunk, contiguous: ([B, W + T, ...], shift int32[B]).

    Args:
      ring: [B, W, ...] holding position p at row p % W for p in [start - min(start, W), start).
      chunk: [B, T, ...], positions start .. start + T - 1.
      start: int or int[B], the chunk's first position.

    Returns:
      Row r of the result holds position shift + r (rows past min(start, W) + T are filler,
      to be hidden by the lengths).
    """
    B, W, T = ring.shape[0], ring.shape[1], chunk.shape[1]
    start = _rows(start, B)
    n_old = jnp.minimum(start, W)  # (B,)
    shift = start - n_old  # (B,)
    r = jnp.arange(W + T, dtype=jnp.int32)[None]  # (1, W + T)
    old_row = (shift[:, None] + r) % W
    new_row = W + jnp.clip(r - n_old[:, None], 0, T - 1)
    index = jnp.where(r < n_old[:, None], old_row, new_row)  # (B, W + T)
    both = jnp.concatenate([ring, chunk.astype(ring.dtype)], axis=1)  # (B, W + T, ...)
    return jax.vmap(lambda x, i: x[i])(both, index), shift


def write_ring(ring: jax.Array, chunk: jax.Array, start, lengths) -> jax.Array:
    """The ring with the chunk's positions in [lengths - W, lengths) written at rows p % W.

    Positions at or past `lengths` (a padded prompt's tail) are not written, nor those that the
    chunk's own later positions push out of the window (no two writes hit one row).
    """
    B, W, T = ring.shape[0], ring.shape[1], chunk.shape[1]
    p = _rows(start, B)[:, None] + jnp.arange(T, dtype=jnp.int32)[None]  # (B, T)
    lengths = _rows(lengths, B)[:, None]
    keep = (p < lengths) & (p >= lengths - W)
    rows = jnp.where(keep, p % W, W)  # row W is past the end: dropped
    batch = jnp.arange(B, dtype=jnp.int32)[:, None]
    return ring.at[batch, rows].set(chunk.astype(ring.dtype), mode="drop")
