"""Stick-breaking attention (Tan et al. 2025, "Scaling Stick-Breaking Attention"): no softmax.

Query i breaks a stick of length 1 over its visible keys from the nearest back: key j takes the
fraction beta_ij = sigmoid(z_ij) of what the nearer keys left, z_ij = scale * q_i . k_j, so

    A_ij = beta_ij * prod_{j < l < i, l visible} (1 - beta_il)        (j < i, j visible)

in log space, log A_ij = log_sigmoid(z_ij) + sum_{j < l < i} log_sigmoid(-z_il): a suffix sum
over the keys of the row (the references' `naive_stickbreaking_attn` and `sb_ref.stickbreaking`,
github.com/shawntan/stickbreaking-attention). Query i does not attend to its own key (the
references' default, `attend_current=False`), and what the keys leave, the remainder
r_i = prod_{l visible} (1 - beta_il) = 1 - sum_j A_ij, goes to its own value (`remainder=
"current"`, the reference tests' `o + rem * v`) or is dropped (`"none"`, flash-linear-attention's
layer). The recency order is the method's only position signal: there is no position encoding.

Visibility is the softmax core's (`posattn.attention.visibility_mask`) with the diagonal removed:
key j < i, j < kv_lengths[b], and i - j < window for a sliding window. Queries sit at
q_offset + t and must lie in [0, S) (the current value is read at that row: self-attention, a
KV cache). Everything runs in float32 whatever the input dtype; the output keeps q's dtype.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp

from posattn.attention.masks import query_positions, visibility_mask
from posattn.attention.rowwise import check_qkv, check_static, map_query_blocks

__all__ = ["REMAINDERS", "StickBreaking", "stick_breaking_attention", "stick_breaking_weights"]

REMAINDERS = ("current", "none")


class StickBreaking(NamedTuple):
    """A stick-breaking layer's settings (the keyword arguments of `stick_breaking_attention`)."""

    remainder: str = "current"
    logit_bias: float = 0.0


f32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST


def _check(q, k, v, remainder, window, query_chunk, logit_bias=0.0):
    check_qkv("stick-breaking attention", q, k, v)
    if remainder not in REMAINDERS:
        raise ValueError(
            f"stick-breaking attention: remainder={remainder!r}; use one of "
            f"{', '.join(map(repr, REMAINDERS))}"
        )
    if not (isinstance(logit_bias, numbers.Real) and math.isfinite(logit_bias)):
        raise ValueError(
            f"stick-breaking attention: logit_bias must be a finite number, got {logit_bias!r}"
        )
    check_static("stick-breaking attention", window=window, query_chunk=query_chunk)


def stick_breaking_weights(
    q: jax.Array,
    k: jax.Array,
    *,
    q_offset=0,
    kv_lengths=None,
    scale: float | None = None,
    window: int | None = None,
    remainder: str = "current",
    logit_bias: float = 0.0,
) -> jax.Array:
    """float32[B, N, T, S]: the weights each query puts on each key row, the remainder included
    (at the query's own row with remainder="current"), so a row sums to 1 ("current") or to
    1 - r_i ("none"). q[B, T, N, H], k[B, S, K, H]; the other arguments as
    `stick_breaking_attention`'s."""
    _check(q, k, k, remainder, window, None, logit_bias)
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    if scale is None:
        scale = H**-0.5
    q_pos = query_positions(jnp.asarray(q_offset, jnp.int32), T)  # (B or 1, T)
    if kv_lengths is not None:
        kv_lengths = jnp.asarray(kv_lengths, jnp.int32)
    k_rep = jnp.repeat(k.astype(f32), N // K, axis=2)  # (B, S, N, H)
    z = jnp.einsum("btnh,bsnh->bnts", q.astype(f32), k_rep, precision=_HI) * scale
    if logit_bias:
        z = z + logit_bias
    k_pos = jnp.arange(S, dtype=jnp.int32)
    # The softmax core's visibility without the diagonal: the stick breaks over j < i.
    earlier = k_pos[None, None, :] < q_pos[:, :, None]  # (B|1, T, S)
    visible = visibility_mask(q_pos, S, causal=True, kv_lengths=kv_lengths, window=window)
    visible = (visible & earlier)[:, None]  # (B|1, 1, T, S)
    log_keep = jnp.where(visible, jax.nn.log_sigmoid(-z), 0.0)  # log(1 - beta), 0 if hidden
    # sum over the visible l >= j of log(1 - beta_il), the key's own term included: with
    # log beta_ij = z_ij + log(1 - beta_ij), log A_ij = z_ij + that suffix sum
    suffix = jax.lax.cumsum(log_keep, axis=3, reverse=True)
    weights = jnp.where(visible, jnp.exp(jnp.where(visible, z + suffix, 0.0)), 0.0)
    if remainder == "current":
        # r_i = prod over the visible keys of (1 - beta_il): the whole row's sum, at column 0
        rest = jnp.exp(suffix[..., :1])  # (B, N, T, 1)
        own = k_pos[None, None, None, :] == q_pos[:, None, :, None]  # (B|1, 1, T, S)
        weights = weights + jnp.where(own, rest, 0.0)
    return weights


def stick_breaking_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_offset=0,
    kv_lengths=None,
    scale: float | None = None,
    window: int | None = None,
    remainder: str = "current",
    logit_bias: float = 0.0,
    query_chunk: int | None = None,
) -> jax.Array:
    """Causal stick-breaking attention of q[B, T, N, H] over k, v[B, S, K, H] (N % K == 0).

    Args:
      q_offset: int or int[B], the position of the first query (a KV-cache decode step).
      kv_lengths: int[B] or None; keys j >= kv_lengths[b] are padding.
      scale: logit scale, default 1/sqrt(H).
      window: None, or a static int w: only keys with i - j < w break the stick (Hugging Face's
        `sliding_window` convention, the current token being the w-th).
      remainder: "current" (the stick left by the keys weights the query's own value, so every
        row's weights sum to 1) or "none" (it is dropped).
      logit_bias: a static number b added to every logit, z = scale * q.k + b (0: the paper's).
        b < 0 starts every key with a smaller share, sigmoid(b) of what is left, so that at
        initialisation (z near b) the stick reaches about 1 / sigmoid(b) keys back, not 2.
      query_chunk: None, or a static int c: the queries in blocks of c, one program mapped over
        them (`rowwise.map_query_blocks`), so that the [B, N, c, S] weights of one block are
        alive at a time instead of [B, N, T, S]: memory linear in T.

    Returns:
      float[B, T, N, H] in q's dtype. A query with no visible key returns its own value
      ("current") or zeros ("none").
    """
    _check(q, k, v, remainder, window, query_chunk, logit_bias)
    B, T, N, H = q.shape
    K = k.shape[2]
    kw = dict(
        kv_lengths=kv_lengths,
        scale=scale,
        window=window,
        remainder=remainder,
        logit_bias=logit_bias,
    )
    v_rep = jnp.repeat(v.astype(f32), N // K, axis=2)  # (B, S, N, H)

    def block(q, offset):
        w = stick_breaking_weights(q, k, q_offset=offset, **kw)
        return jnp.einsum("bnts,bsnh->btnh", w, v_rep, precision=_HI)

    return map_query_blocks(block, q, q_offset, query_chunk)
