"""PaTH attention (Yang et al. 2025, "PaTH Attention: Position Encoding via Accumulating
Householder Transformations"): positions as a product of data-dependent reflections.

Each key position s carries a unit vector w_s and a strength beta_s in (0, 2) (per key/value
head), which make the Householder-like matrix H_s = I - beta_s w_s w_s^T. Between key j and
query i, the key travels through every position after it up to the query's own:

    logit(i, j) = scale * (q_i^T H_i H_{i-1} ... H_{j+1} k_j  +  c_i - c_j)

(H_{j+1} applied to k_j first; key i itself untransformed), then a softmax over the visible keys.
`c` is the optional forget gate's cumulative sum (PaTH-FoX), `c = cumsum(log_forget)` over the
key positions, query i reading it at its own position: as in the reference kernel, the forget
term is multiplied by `scale` with the content term, unlike the softmax core's FoX
(`attention(..., log_forget=)`), which adds it unscaled. With every beta 0 (or every w
orthogonal to the keys) PaTH is NoPE attention.

This is fla-org/flash-linear-attention `fla/ops/path_attn` (`parallel_path_attention(q, k, v, w,
beta, g, scale)`, and the naive chunked form its tests check the kernel against); the layer
(`fla/layers/path_attn.py`) makes w by a projection, a causal depthwise convolution of width 3
with SiLU and an L2 norm per head, beta = 2 sigmoid(x W_beta + b) (eigenvalues 1 - beta in
(-1, 1): negative ones allowed), and g = log_sigmoid(x W_g + b_g) per query head.

How it is computed here: by chunks of C positions (`chunk`, 64 by default, the reference kernel's
block), as the reference's chunked form does (`_chunk_scores`): within a chunk, a unit lower
triangular solve gives every key moved to the chunk's end, every query moved back to the chunk's
start and the chunk's whole product of reflections as one [H, H] matrix; one scan over the
distance between chunks then scores every query chunk against every earlier key chunk at once.
Float32 throughout, O(S^2 H (1 + H / C)) work per head in S / C sequential steps; the scores
are materialised ([B, N, T, S], as the reference implementation's), so memory is quadratic in S.
The keys are repeated over the query heads of their group before the chunks are formed.
`path_keys` (a prefill's cache) runs one scan over the positions instead, each step one
reflection of the keys before it.

Decoding needs no scan: a cache of the keys as seen from the last position moves one position on
by one reflection (`path_update_keys`), and the query then reads it with the ordinary softmax core
(`attention(q, keys, v, q_offset=p, log_forget=scale * log_forget)`), which is exactly this
function's row p (tests/attention/test_path.py checks it).

Visibility is the softmax core's, causal: key j <= i, j < kv_lengths[b], i - j < window. A
padded position's reflection (s >= kv_lengths[b]) is not applied, so `path_keys` leaves the keys
as seen from each row's last valid position. Queries sit at q_offset + t (int or int[B]),
keys at 0 .. S-1; the output keeps q's dtype; a query that sees no key returns zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from posattn.attention.masks import query_positions, visibility_mask
from posattn.attention.rowwise import check_qkv, check_static, masked_softmax

__all__ = ["path_attention", "path_extend_keys", "path_keys", "path_update_keys", "path_weights"]

f32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST
_NAME = "PaTH attention"
CHUNK = 64  # positions per chunk of the scores (the reference kernel's block)


def _check_reflections(k, w, beta, log_forget=None, num_heads=None) -> None:
    B, S, K, H = k.shape
    if w.shape != k.shape or beta.shape != (B, S, K):
        raise ValueError(
            f"{_NAME}: w must be [B, S, K, H] = {k.shape} like the keys and beta [B, S, K] = "
            f"{(B, S, K)}, got w {w.shape} and beta {beta.shape}"
        )
    if log_forget is not None and log_forget.shape != (B, S, num_heads):
        raise ValueError(
            f"{_NAME}: log_forget must be [B, S, N] = {(B, S, num_heads)} (one per key position "
            f"and query head), got {log_forget.shape}"
        )


def _reflect(keys, w, beta, active):
    """keys[B, S, K, H] with I - beta w w^T (w[B, K, H], beta[B, K]) applied to the rows where
    active[B, S] holds."""
    along = jnp.einsum("bskh,bkh->bsk", keys, w, precision=_HI)  # (B, S, K)
    moved = keys - (beta[:, None, :] * along)[..., None] * w[:, None]
    return jnp.where(active[:, :, None, None], moved, keys)


def _lengths(kv_lengths, B, S):
    if kv_lengths is None:
        return jnp.full((B,), S, jnp.int32)
    return jnp.broadcast_to(jnp.asarray(kv_lengths, jnp.int32), (B,))


def path_keys(k: jax.Array, w: jax.Array, beta: jax.Array, *, kv_lengths=None) -> jax.Array:
    """float32[B, S, K, H]: the keys as seen from each row's last position L - 1 (L =
    kv_lengths[b], or S): row j holds H_{L-1} ... H_{j+1} k_j, the cache a decode step continues
    from (`path_update_keys`). Rows at or past L are the keys as projected."""
    check_qkv(_NAME, k, k, k)
    _check_reflections(k, w, beta)
    return path_extend_keys(k.astype(f32), w, beta, 0, kv_lengths=kv_lengths)


def path_update_keys(keys: jax.Array, w: jax.Array, beta: jax.Array, position) -> jax.Array:
    """A decode step's cache: keys[B, S, K, H] as seen from position p - 1 moved on to p, H_p
    (w[B, K, H], beta[B, K] of the token at p) applied to the rows before p (position: int or
    int[B], each row's p). Row p is then the new key as projected: write it after this."""
    B, S, K, H = keys.shape
    if w.shape != (B, K, H) or beta.shape != (B, K):
        raise ValueError(
            f"{_NAME}: a decode step's w must be [B, K, H] = {(B, K, H)} and beta [B, K], got "
            f"w {w.shape} and beta {beta.shape}"
        )
    return path_extend_keys(keys, w[:, None], beta[:, None], position)


def path_extend_keys(
    keys: jax.Array, w: jax.Array, beta: jax.Array, q_offset, *, kv_lengths=None
) -> jax.Array:
    """A chunk's cache: keys[B, S, K, H] as seen from position p - 1 (p = q_offset, int or
    int[B]) moved on through the chunk's reflections w[B, T, K, H], beta[B, T, K] at positions
    p + t, each applied to the rows before its position (`path_update_keys` T times, in order);
    a reflection at or past kv_lengths[b] (padding) is not applied. Rows p .. p + T - 1 must hold
    the chunk's keys as projected: they leave as seen from the chunk's last valid position."""
    B, S, K, H = keys.shape
    T = w.shape[1]
    if w.shape != (B, T, K, H) or beta.shape != (B, T, K):
        raise ValueError(
            f"{_NAME}: a chunk's w must be [B, T, K, H] = {(B, T, K, H)} and beta [B, T, K], "
            f"got w {w.shape} and beta {beta.shape}"
        )
    p = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (B,))
    lengths = p + T if kv_lengths is None else _lengths(kv_lengths, B, S)
    rows = jnp.arange(S, dtype=jnp.int32)
    w, beta = jnp.moveaxis(w.astype(f32), 1, 0), jnp.moveaxis(beta.astype(f32), 1, 0)

    def step(moved, chunk_t):
        w_t, beta_t, t = chunk_t
        s = p + t  # (B,)
        active = (rows[None, :] < s[:, None]) & (s < lengths)[:, None]
        return _reflect(moved, w_t, beta_t, active), None

    steps = (w, beta, jnp.arange(T, dtype=jnp.int32))
    moved = jax.lax.scan(step, keys.astype(f32), steps)[0]
    return moved.astype(keys.dtype)


@jax.custom_vjp
def _inverse(unit_lower):
    """(I + L)^-1 of L strictly lower [..., C, C], by forward substitution, one row a step (row i
    is e_i - L[i] X: the rows before i are final, those after still e_s, where L[i] is 0). Its
    gradient is the inverse's, -X^T g X^T below the diagonal, two products instead of the loop's
    reverse (XLA:CPU's batched `triangular_solve` deadlocked here in some gradients on two cores,
    jax 0.10.2)."""
    C = unit_lower.shape[-1]
    eye = jnp.eye(C, dtype=unit_lower.dtype)

    def row(i, X):
        new = eye[i] - jnp.einsum("...s,...sc->...c", unit_lower[..., i, :], X, precision=_HI)
        return X.at[..., i, :].set(new)

    return jax.lax.fori_loop(1, C, row, jnp.broadcast_to(eye, unit_lower.shape))


def _inverse_fwd(unit_lower):
    X = _inverse(unit_lower)
    return X, X


def _inverse_bwd(X, g):
    Xt = jnp.swapaxes(X, -1, -2)
    grad = -jnp.einsum("...ij,...jk,...kl->...il", Xt, g, Xt, precision=_HI)
    return (jnp.tril(grad, -1),)


_inverse.defvjp(_inverse_fwd, _inverse_bwd)


def _solve(unit_lower, rhs, *, left: bool):
    """(I + L)^-1 rhs (left) or rhs (I + L)^-1 (right), L strictly lower [..., C, C]."""
    X = _inverse(unit_lower)
    if left:
        return jnp.einsum("...ij,...jk->...ik", X, rhs, precision=_HI)
    return jnp.einsum("...ij,...jk->...ik", rhs, X, precision=_HI)


def _chunk_scores(q, k, w, beta, chunk):
    """float32[B, N, S, S]: q_i . H_i ... H_{j+1} k_j for the queries q[B, N, S, H] at the key
    positions (k, w [B, N, S, H], beta [B, N, S], S a multiple of `chunk`), by chunks of C
    positions; above the diagonal is left to the mask.

    In a chunk (local positions), a key moved through the reflections after it to the chunk's end
    is k_j - sum_m beta_m w_m U[m, j], with U = (I + L)^-1 strict(W K^T), L[m, m'] = beta_m'
    (w_m . w_m') below the diagonal (each reflection's coefficient w_m . x, x the key as moved so
    far: a unit lower triangular system). A query moved back through the reflections up to its own
    (H_i first) is q_i - sum_m beta_m w_m V[i, m], V (I + L') = tril(Q W^T), L'[m', m] = beta_m'
    (w_m' . w_m). The chunk's whole product is G = I - W^T diag(beta) (I + L)^-1 W. The scores of
    a chunk with itself follow from U; of chunk c with chunk c - d, the moved queries times
    G_{c-1} ... G_{c-d+1} times the moved keys: one scan over the distance d, all chunks at once.
    """
    B, N, S, H = q.shape
    C, n = chunk, S // chunk
    Q, K, W = (x.reshape(B, N, n, C, H) for x in (q, k, w))
    b = beta.reshape(B, N, n, C)
    below = jnp.tril(jnp.ones((C, C), bool), -1)
    on_or_below = jnp.tril(jnp.ones((C, C), bool))

    def mm(x, y):  # [..., a, h] x [..., c, h] -> [..., a, c]
        return jnp.einsum("...ah,...ch->...ac", x, y, precision=_HI)

    ww = mm(W, W)
    # one solve for U and (I + L)^-1 W
    UZ = _solve(
        jnp.where(below, ww * b[..., None, :], 0.0),
        jnp.concatenate([jnp.where(below, mm(W, K), 0.0), W], axis=-1),
        left=True,
    )
    U, Z = UZ[..., :C], UZ[..., C:]
    qw = jnp.where(on_or_below, mm(Q, W), 0.0)
    local = jnp.where(on_or_below, mm(Q, K), 0.0) - jnp.einsum(
        "...im,...mj->...ij", qw * b[..., None, :], U, precision=_HI
    )
    bw = b[..., None] * W  # rows beta_m w_m
    moved_k = K - jnp.einsum("...mj,...mh->...jh", U, bw, precision=_HI)
    V = _solve(jnp.where(below, b[..., :, None] * ww, 0.0), qw, left=False)
    moved_q = Q - jnp.einsum("...im,...mh->...ih", V, bw, precision=_HI)
    G = jnp.eye(H, dtype=f32) - jnp.einsum("...mh,...mg->...hg", bw, Z, precision=_HI)
    # blocks[d][:, :, j]: the query chunk j + d against the key chunk j. The carry Y[j] holds the
    # queries of chunk j + d moved back through G_{j+d-1} ... G_{j+1}; the next distance's is
    # Y[j + 1] G_{j+1}: static shifts along the chunks, no gather
    blocks = local[:, :, None]  # (B, N, n_d, n, C, C)
    if n > 1:

        def ahead(x):  # x[j + 1] at j, zeros past the last chunk
            return jnp.concatenate([x[:, :, 1:], jnp.zeros_like(x[:, :, :1])], axis=2)

        def step(Y, _):
            scores = mm(Y, moved_k)
            return ahead(jnp.einsum("...ih,...hg->...ig", Y, G, precision=_HI)), scores

        far = jax.lax.scan(step, ahead(moved_q), None, length=n - 1)[1]  # (n - 1, B, N, n, ..)
        blocks = jnp.concatenate([blocks, jnp.moveaxis(far, 0, 2)], axis=2)
    ci, cj = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    full = blocks[:, :, np.clip(ci - cj, 0, n - 1), cj]  # (B, N, n, n, C, C)
    return jnp.swapaxes(full, 3, 4).reshape(B, N, S, S)


def path_weights(
    q: jax.Array,
    k: jax.Array,
    w: jax.Array,
    beta: jax.Array,
    *,
    q_offset=0,
    kv_lengths=None,
    scale: float | None = None,
    window: int | None = None,
    log_forget: jax.Array | None = None,
    chunk: int = CHUNK,
) -> jax.Array:
    """float32[B, N, T, S]: the softmax weights of each query over the keys (rows that see no
    key are zeros); the arguments as `path_attention`'s."""
    check_qkv(_NAME, q, k, k)
    check_static(_NAME, window=window, chunk=chunk)
    B, T, N, H = q.shape
    S = k.shape[1]
    _check_reflections(k, w, beta, log_forget, N)
    scale = H**-0.5 if scale is None else scale
    q_pos = jnp.broadcast_to(query_positions(jnp.asarray(q_offset, jnp.int32), T), (B, T))
    lengths = _lengths(kv_lengths, B, S)
    # every query at its position among the keys' (one past the keys: dropped, a zero row)
    rows = jnp.arange(B, dtype=jnp.int32)[:, None]
    placed = jnp.zeros((B, S, N, H), f32).at[rows, q_pos].set(q.astype(f32), mode="drop")
    beta = jnp.where(jnp.arange(S)[None, :, None] < lengths[:, None, None], beta, 0.0)
    C = min(chunk, S)
    pad = -S % C

    def heads(x):  # [B, S, h, ...] -> [B, N, S + pad, ...], key/value heads repeated
        x = jnp.moveaxis(jnp.repeat(x.astype(f32), N // x.shape[2], axis=2), 2, 1)
        return jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))

    scores = _chunk_scores(heads(placed), heads(k), heads(w), heads(beta), C)[:, :, :S, :S]
    at = jnp.clip(q_pos, 0, S - 1)  # (B, T)
    logits = jnp.take_along_axis(scores, at[:, None, :, None], axis=2)  # (B, N, T, S)
    if log_forget is not None:
        c = jnp.cumsum(log_forget.astype(f32), axis=1)  # (B, S, N)
        c_q = jnp.take_along_axis(c, at[:, :, None], axis=1)  # (B, T, N)
        logits = logits + (jnp.swapaxes(c_q, 1, 2)[..., None] - jnp.swapaxes(c, 1, 2)[:, :, None])
    logits = scale * logits
    visible = visibility_mask(
        q_pos, S, causal=True, kv_lengths=None if kv_lengths is None else lengths, window=window
    )
    visible = visible[:, None] & (q_pos < S)[:, None, :, None]  # (B, 1, T, S)
    return masked_softmax(logits, visible)


def path_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    w: jax.Array,
    beta: jax.Array,
    *,
    q_offset=0,
    kv_lengths=None,
    scale: float | None = None,
    window: int | None = None,
    log_forget: jax.Array | None = None,
    chunk: int = CHUNK,
) -> jax.Array:
    """Causal PaTH attention of q[B, T, N, H] over k, v[B, S, K, H] (N % K == 0).

    Args:
      w: float[B, S, K, H], each key position's reflection direction (unit vectors: the layer
        L2-normalises them; not re-normalised here).
      beta: float[B, S, K], each reflection's strength, in (0, 2) in the reference layer.
      q_offset: int or int[B], the position of the first query; keys sit at 0 .. S-1, and a
        query at position p reads the keys as seen from p.
      kv_lengths: int[B] or None; keys j >= kv_lengths[b] are padding, and their reflections are
        not applied.
      scale: the logit scale, default 1/sqrt(H); it multiplies the forget term too.
      window: None, or a static int w: only keys with i - j < w are seen (Hugging Face's
        `sliding_window`); the keys still travel through every reflection in between.
      log_forget: None, or float[B, S, N] the forget gate's log f per key position and query
        head (PaTH-FoX): the logit of (i, j) gains scale * (c_i - c_j), c its cumulative sum.
      chunk: a static int, the positions per chunk of the scores (`_chunk_scores`).

    Returns:
      float[B, T, N, H] in q's dtype.
    """
    check_qkv(_NAME, q, k, v)
    weights = path_weights(
        q,
        k,
        w,
        beta,
        q_offset=q_offset,
        kv_lengths=kv_lengths,
        scale=scale,
        window=window,
        log_forget=log_forget,
        chunk=chunk,
    )
    N = q.shape[2]
    v_rep = jnp.repeat(v.astype(f32), N // k.shape[2], axis=2)  # (B, S, N, H)
    return jnp.einsum("bnts,bsnh->btnh", weights, v_rep, precision=_HI).astype(q.dtype)
