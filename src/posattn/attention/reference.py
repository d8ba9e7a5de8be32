"""Materialised implementations: the float32 oracle and `jax.nn.dot_product_attention`.

Both hold the logits of the whole batch, [B, N, T, S]; see `posattn.attention` for the contract.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posattn.attention.masks import (
    forget_cumsum,
    materialize_logit_bias,
    query_positions,
    visibility_mask,
    within_window,
)


def reference_attention(
    q,
    k,
    v,
    *,
    bias,
    causal,
    q_offset,
    kv_lengths,
    scale,
    window=None,
    log_forget=None,
    softcap=None,
    far=None,
):
    """The oracle: every step written out in float32 on the full [B, N, T, S] logits."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    f32 = jnp.float32
    v_rep = jnp.repeat(v.astype(f32), G, axis=2)  # (B, S, N, H)

    def content(q, k):  # scale q.k, (B, N, T, S)
        # Repeat each key/value head for its G query heads: obviously right, costs memory.
        k_rep = jnp.repeat(k.astype(f32), G, axis=2)  # (B, S, N, H)
        hi = jax.lax.Precision.HIGHEST
        return jnp.einsum("btnh,bsnh->bnts", q.astype(f32), k_rep, precision=hi) * scale

    q_pos = query_positions(q_offset, T)  # (B or 1, T)
    logits = content(q, k)
    if far is not None:  # two-score attention: the far pairs score with far.q and far.k
        near = within_window(q_pos, jnp.arange(S, dtype=jnp.int32), far.window, causal=causal)
        logits = jnp.where(near[:, None], logits, content(far.q, far.k))
    if softcap is not None:  # Gemma 2: the content logits capped, before any bias
        logits = softcap * jnp.tanh(logits / softcap)
    c = None if log_forget is None else forget_cumsum(log_forget)  # (B, S, N)
    extra = materialize_logit_bias(bias, c, q_pos, S)  # (B or 1, N, T, S) or None
    if extra is not None:
        logits = logits + extra
    visible = visibility_mask(
        q_pos, S, causal=causal, kv_lengths=kv_lengths, window=window
    )  # (B|1, T, S)
    logits = jnp.where(visible[:, None], logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    p = jnp.exp(logits - row_max)  # masked keys give exactly 0
    denom = jnp.sum(p, axis=-1, keepdims=True)
    probs = p / jnp.where(denom == 0.0, 1.0, denom)  # a row with no visible key stays all-zero
    out = jnp.einsum("bnts,bsnh->btnh", probs, v_rep, precision=jax.lax.Precision.HIGHEST)
    return out.astype(q.dtype)


def xla_attention(
    q, k, v, *, bias, causal, q_offset, kv_lengths, scale, window=None, log_forget=None
):
    """`jax.nn.dot_product_attention` with a materialised bias and an explicit boolean mask.

    jax masks with a large finite negative number, so a query row with no visible key would
    average all values; those rows are zeroed here. The window goes into the boolean mask rather
    than `local_window_size`: jax builds that window on the indices 0..T-1 and 0..S-1, blind to
    q_offset (a decode step or a per-row offset), and XLA runs it as the same materialised mask.
    The forget term joins the materialised bias (per batch row: [B, N, T, S]).
    """
    T, S = q.shape[1], k.shape[1]
    q_pos = query_positions(q_offset, T)  # (B or 1, T)
    c = None if log_forget is None else forget_cumsum(log_forget)  # (B, S, N)
    bias4 = materialize_logit_bias(bias, c, q_pos, S)  # (B|1, N, T, S) or None
    mask = None
    row_visible = None
    if causal or kv_lengths is not None or window is not None:
        visible = visibility_mask(
            q_pos, S, causal=causal, kv_lengths=kv_lengths, window=window
        )  # (B|1, T, S)
        mask = visible[:, None]  # (B|1, 1, T, S)
        row_visible = jnp.any(visible, axis=-1)  # (B|1, T)
    dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
    out = jax.nn.dot_product_attention(
        q.astype(dtype), k.astype(dtype), v.astype(dtype), bias=bias4, mask=mask, scale=scale
    )
    if row_visible is not None:
        out = jnp.where(row_visible[:, :, None, None], out, jnp.zeros((), out.dtype))
    return out.astype(q.dtype)
