"""Attention computed from materialised weights, query rows at a time: what stick-breaking
attention (`stickbreaking.py`) and CoPE (`cope.py`) share. Neither fits the online-softmax tiles
(each row's weights need the whole row before any is known), so each computes a block of
queries' [B, N, c, S] weights at once and maps one program over the blocks. PaTH (`path.py`)
uses the argument checks and the masked softmax.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = ["check_qkv", "check_static", "map_query_blocks", "masked_softmax"]


def check_qkv(name: str, q, k, v) -> None:
    """q[B, T, N, H], k and v [B, S, K, H] alike, N a multiple of K; `name` opens the error."""
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(
            f"{name}: q must be [B, T, N, H] and k, v [B, S, K, H] alike, got "
            f"q {q.shape}, k {k.shape}, v {v.shape}"
        )
    if q.shape[2] % k.shape[2] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"{name}: q {q.shape} and k {k.shape} must share B and H, and the query heads must "
            "be a multiple of the key/value heads"
        )


def check_static(name: str, **values) -> None:
    """Each value None or a static int >= 1 (a window, a query block)."""
    for key, value in values.items():
        static_int = isinstance(value, int) and not isinstance(value, bool)
        if value is not None and not (static_int and value >= 1):
            raise ValueError(f"{name}: {key} must be None or a static int >= 1, got {value!r}")


def masked_softmax(logits: jax.Array, visible: jax.Array) -> jax.Array:
    """Softmax over the last axis of float32 logits where `visible` (broadcast), zero elsewhere; a
    row with nothing visible is all zeros, never NaN."""
    logits = jnp.where(visible, logits, -jnp.inf)
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    e = jnp.where(visible, jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(total > 0, total, 1.0)


def map_query_blocks(
    block: Callable[[jax.Array, jax.Array], jax.Array], q: jax.Array, q_offset, query_chunk
) -> jax.Array:
    """block(q_block [B, c, N, H], its first position) -> [B, c, N, H], over q[B, T, N, H] at
    positions q_offset + t (q_offset int or int[B]): called once on all of q when `query_chunk`
    is None or >= T, else mapped over blocks of `query_chunk` queries (`jax.lax.map`, one
    program), so that one block's weights are alive at a time: memory linear in T. The last
    block is padded with queries whose rows are dropped. The result keeps q's dtype.

    (Blocks unrolled in Python, each reading only the keys before its last query, were faster,
    but XLA kept every block's buffers alive: memory quadratic in T.)
    """
    B, T, N, H = q.shape
    if query_chunk is None or T <= query_chunk:
        return block(q, q_offset).astype(q.dtype)
    c = query_chunk
    pad = -T % c
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    blocks = qp.reshape(B, (T + pad) // c, c, N, H).swapaxes(0, 1)  # (T/c, B, c, N, H)
    offset = jnp.asarray(q_offset, jnp.int32)
    steps = c * jnp.arange(blocks.shape[0], dtype=jnp.int32)
    starts = offset[None] + steps[:, None] if offset.ndim == 1 else offset + steps  # (T/c[, B])
    out = jax.lax.map(lambda a: block(*a), (blocks, starts))  # (T/c, B, c, N, H)
    return out.swapaxes(0, 1).reshape(B, T + pad, N, H)[:, :T].astype(q.dtype)
