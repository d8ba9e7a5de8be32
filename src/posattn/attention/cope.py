"""Contextual position encoding, CoPE (Golovneva et al. 2024, "Contextual Position Encoding:
Learning to Count What's Important"): positions counted by the content.

Query i gates each visible key l by g_il = sigmoid(z_il), z_il = scale * q_i . k_l (or
scale * q_i . g_l for other gate keys g: the values, or a key projection of their own), and key j
sits at the contextual position

    p_ij = sum over the visible l with j <= l <= i of g_il          (the key's own gate included)

a suffix sum over the row, clamped to P - 1 for a table e of P position embeddings [H, P]. As p
is fractional, the position logit interpolates the two integers around it,
`q_i . e[floor p] * (1 - w) + q_i . e[ceil p] * w`, w = p - floor p (the gradient reaches p
through w, none through the integers), and the logits are

    scale * (q_i . k_j + q_i . e(p_ij))       scale_positions=True (the reference's default)
    scale * q_i . k_j + q_i . e(p_ij)         scale_positions=False (`--cope-nodiv`, and the
                                                paper's listing)

then a softmax over the visible keys. This is facebookresearch/RAM `projects/cope`
(`ContextPosSelfAttn`, gates from the keys: `gate_logits = query @ key^T`,
`gates = sigmoid(gate_logits / sqrt(head_dim)) * attn_mask`, `positions = gates.flip(-1)
.cumsum(-1).flip(-1).clamp(max=npos - 1)`, one [head_dim, npos] table per layer shared by its
heads, zero at initialisation, npos = block size + 1 by default). A hidden key's gate is 0, so
padding and keys outside a sliding window count for nothing.

Visibility is the softmax core's (`posattn.attention.visibility_mask`, causal): key j <= i,
j < kv_lengths[b], i - j < window. Queries sit at q_offset + t (a KV-cache decode step). Everything
runs in float32 whatever the input dtype; the output keeps q's dtype; a query that sees no key
returns zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posattn.attention.masks import query_positions, visibility_mask
from posattn.attention.rowwise import check_qkv, check_static, map_query_blocks, masked_softmax

__all__ = ["cope_attention", "cope_positions", "cope_weights"]

f32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST
_NAME = "CoPE attention"


def _check_table(q, table):
    if table.ndim != 2 or table.shape[0] != q.shape[-1] or table.shape[1] < 1:
        raise ValueError(
            f"{_NAME}: the position table must be [H, P] with H = {q.shape[-1]} (the head dim) "
            f"and P >= 1 positions, got {table.shape}"
        )


def _content(q, k, scale):
    """scale * q.k float32[B, N, T, S] of q[B, T, N, H] and k[B, S, K, H]."""
    k_rep = jnp.repeat(k.astype(f32), q.shape[2] // k.shape[2], axis=2)  # (B, S, N, H)
    return jnp.einsum("btnh,bsnh->bnts", q.astype(f32), k_rep, precision=_HI) * scale


def _visible(q, S, *, q_offset, kv_lengths, window):
    """bool[B|1, 1, T, S]: the softmax core's causal visibility."""
    q_pos = query_positions(jnp.asarray(q_offset, jnp.int32), q.shape[1])  # (B|1, T)
    if kv_lengths is not None:
        kv_lengths = jnp.asarray(kv_lengths, jnp.int32)
    return visibility_mask(q_pos, S, causal=True, kv_lengths=kv_lengths, window=window)[:, None]


def cope_positions(
    q: jax.Array, k: jax.Array, *, q_offset=0, kv_lengths=None, scale=None, window=None
) -> jax.Array:
    """float32[B, N, T, S]: the contextual position p_ij of each key for each query (unclamped;
    0 at hidden keys). q[B, T, N, H], k[B, S, K, H] the keys that gate (the attention's keys,
    or its `gate_keys`); the other arguments as `cope_attention`'s."""
    check_qkv(_NAME, q, k, k)
    check_static(_NAME, window=window)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    visible = _visible(q, k.shape[1], q_offset=q_offset, kv_lengths=kv_lengths, window=window)
    return jnp.where(visible, _suffix_count(_content(q, k, scale), visible), 0.0)


def _suffix_count(z, visible):
    gates = jnp.where(visible, jax.nn.sigmoid(z), 0.0)
    return jax.lax.cumsum(gates, axis=3, reverse=True)


# The most elements `_read` indexes flat (int32 indices); past it, a batched gather.
_FLAT_LIMIT = 2**31 - 1


def _read(at_int: jax.Array, index: jax.Array) -> jax.Array:
    """at_int[b, n, t, index[b, n, t, s]]: float32[B, N, T, S] from at_int[B, N, T, P].

    One gather over the flattened array, each element's own index, while its B N T P elements
    fit int32; `take_along_axis` (a batched gather, the same values) beyond.
    """
    B, N, T, P = at_int.shape
    if B * N * T * P > _FLAT_LIMIT:
        return jnp.take_along_axis(at_int, index, axis=3)
    rows = P * jnp.arange(B * N * T, dtype=jnp.int32).reshape(B, N, T, 1)
    return jnp.take(at_int.reshape(-1), rows + index, mode="clip")


def cope_weights(
    q: jax.Array,
    k: jax.Array,
    table: jax.Array,
    *,
    q_offset=0,
    kv_lengths=None,
    scale: float | None = None,
    window: int | None = None,
    scale_positions: bool = True,
    gate_keys: jax.Array | None = None,
) -> jax.Array:
    """float32[B, N, T, S]: the softmax weights each query puts on each key (rows that see no
    key are zeros). q[B, T, N, H], k[B, S, K, H], table[H, P]; the other arguments as
    `cope_attention`'s."""
    check_qkv(_NAME, q, k, k if gate_keys is None else gate_keys)
    check_static(_NAME, window=window)
    _check_table(q, table)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    visible = _visible(q, k.shape[1], q_offset=q_offset, kv_lengths=kv_lengths, window=window)
    z = _content(q, k, scale)
    gate_z = z if gate_keys is None else _content(q, gate_keys, scale)
    P = table.shape[1]
    p = jnp.minimum(_suffix_count(gate_z, visible), P - 1)
    below = jnp.floor(p)
    w = p - below  # the gradient reaches p here only
    # q_i . e[n] for every integer n < P, then read at floor p and ceil p
    at_int = jnp.einsum("btnh,hp->bntp", q.astype(f32), table.astype(f32), precision=_HI)
    lo = _read(at_int, below.astype(jnp.int32))
    hi = _read(at_int, jnp.ceil(p).astype(jnp.int32))
    position_logits = hi * w + lo * (1.0 - w)
    logits = z + (scale * position_logits if scale_positions else position_logits)
    return masked_softmax(logits, visible)


def cope_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    table: jax.Array,
    *,
    q_offset=0,
    kv_lengths=None,
    scale: float | None = None,
    window: int | None = None,
    scale_positions: bool = True,
    gate_keys: jax.Array | None = None,
    query_chunk: int | None = None,
) -> jax.Array:
    """Causal attention of q[B, T, N, H] over k, v[B, S, K, H] (N % K == 0) with contextual
    positions read from table[H, P] (one layer's position embeddings, shared by its heads).

    Args:
      q_offset: int or int[B], the position of the first query (a KV-cache decode step).
      kv_lengths: int[B] or None; keys j >= kv_lengths[b] are padding (their gates are 0).
      scale: the logit scale, default 1/sqrt(H); the gates are sigmoid(scale * q.k).
      window: None, or a static int w: only keys with i - j < w are seen or counted (Hugging
        Face's `sliding_window` convention).
      scale_positions: the position logits q.e(p) multiplied by `scale` as q.k is (True, the
        reference's default) or added as they are (False).
      gate_keys: None (the gates are sigmoid(scale q.k), the reference's default), or
        [B, S, K, H] the gates are computed from instead, sigmoid(scale q.g): the values
        (the reference's `--cope-val-gates`) or a separate key projection (`--cope-sep-key`).
      query_chunk: None, or a static int c: the queries in blocks of c, one program mapped over
        them (`rowwise.map_query_blocks`): memory linear in T.

    Returns:
      float[B, T, N, H] in q's dtype.
    """
    check_qkv(_NAME, q, k, v)
    if gate_keys is not None:
        check_qkv(_NAME, q, k, gate_keys)
    check_static(_NAME, window=window, query_chunk=query_chunk)
    _check_table(q, table)
    B, T, N, H = q.shape
    v_rep = jnp.repeat(v.astype(f32), N // k.shape[2], axis=2)  # (B, S, N, H)

    def block(q, offset):
        w = cope_weights(
            q,
            k,
            table,
            q_offset=offset,
            kv_lengths=kv_lengths,
            scale=scale,
            window=window,
            scale_positions=scale_positions,
            gate_keys=gate_keys,
        )
        return jnp.einsum("bnts,bsnh->btnh", w, v_rep, precision=_HI)

    return map_query_blocks(block, q, q_offset, query_chunk)
