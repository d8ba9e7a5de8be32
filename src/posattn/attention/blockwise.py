"""Blockwise attention: tiled online softmax with a recomputing backward (FlashAttention-2).

Shape legend: B batch, T query length, S key length, N query heads, K key/value heads, G = N // K
query heads per key/value head, H head dim; tq/tk the query/key tile sizes, nq/nk the number of
tiles, Tp = nq * tq and Sp = nk * tk the padded lengths.

Forward (Dao 2023, "FlashAttention-2", Alg. 1): for each query tile, a loop over key tiles keeps a
running row max `m`, row sum `l` and unnormalised output `acc` in float32; only [tq, tk] logits
exist at a time. The log-sum-exp per query row is saved for the backward.

Backward (Alg. 2, one pass): an outer loop over key tiles accumulates dK, dV for its tile while an
inner loop over query tiles recomputes the probabilities from the saved log-sum-exp and adds into
a dQ buffer of size [T] (linear in T). So training memory is linear in T too.

Causal and window skipping: the key-tile loop of query tile i runs only over the key tiles that
some of its queries can see (and the query-tile loop of key tile j over the query tiles that can
see it), so tiles above the diagonal, and with a sliding window w the tiles outside the band
|i - j| < w, are never computed: the work grows as T x w, not T^2. Likewise key tiles wholly past
max(kv_lengths) are skipped. The bounds are traced values (fori_loop over a while loop), so the
compiled program does not grow with T.

Grouped-query heads: q is viewed as [B, K, G, tq, H] and contracted against the [B, K, tk, H] key
tile directly; K/V are never repeated. The tile equations (online softmax, gradients, the guard
for rows that see no key) live in `posattn.attention.tiles`, shared with `chunked`.

The bias is evaluated per tile: a `(BiasFn, params)` pair is called on the tile's positions (once
per batch row when q_offset is per-row) and differentiated with `jax.vjp` per tile, its parameter
cotangents summed over tiles; a materialised [N, T, S] bias is sliced per tile and its gradient
written tile by tile.

Forgetting attention (FoX): the tiles take the float32 cumulative sums c = cumsum(log_forget) at
their query positions, c_q [tq], and key positions, c_k [tk], and add c_q[:, None] - c_k[None, :]
to the logits; no [T, S] term is ever formed. The backward returns d c_q = rowsum(dS) and
d c_k = -colsum(dS) per tile (dS the logit gradient), and JAX's autodiff of the gather and the
cumulative sum outside the kernel turns them into d log_forget (a reverse cumulative sum). The
query-side rowsum is zero in exact arithmetic (c_i shifts a whole row, which softmax ignores).

Two-score attention (`far`, `masks.Far`): each tile computes both content products, q k^T and
q_far k_far^T, and selects per pair by its distance (`masks.within_window`); the backward splits
the tile's dS the same way into dq, dk and d q_far, d k_far.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from posattn.attention import masks, tiles

# Tile sizes: 256 to 512 were within noise of each other at T = 4096 on the 2-core Xeon of
# docs/attention.md (8 heads, head dim 64), 1024 slower; 512 x 512 makes the fewest loop trips.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static facts about one call: shapes, tiling and which bias/mask terms exist."""

    K: int
    G: int
    tq: int
    tk: int
    nq: int
    nk: int
    causal: bool
    scale: float
    bias_kind: str  # "none" | "fn" | "array"
    bias_fn: Callable | None  # BiasFn(params, q_pos, k_pos) -> float[N, tq, tk]
    kv_mask: bool  # keys past kv_len exist (explicit lengths or S padded to Sp)
    window: int | None = None  # sliding window: query i sees key j only if i - j < window
    forget: bool = False  # the forget term c_q - c_k is added to the logits
    softcap: float | None = None  # the content logits capped as c tanh(s / c) (Gemma 2)
    far_window: int | None = None  # two-score attention: far.q, far.k score from this distance


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    bias=None,
    causal: bool = False,
    q_offset: int | jax.Array = 0,
    kv_lengths: jax.Array | None = None,
    scale: float | None = None,
    window: int | None = None,
    log_forget: jax.Array | None = None,
    softcap: float | None = None,
    far: masks.Far | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
) -> jax.Array:
    """Same contract as `posattn.attention.attention` (which validates the inputs), tiled.

    Args:
      q, k, v, bias, causal, q_offset, kv_lengths, scale, window, log_forget, softcap, far: as
        in `posattn.attention.attention`.
      block_q: query tile size (clipped to T).
      block_k: key tile size (clipped to S).

    Returns:
      float[B, T, N, H] in q's dtype.
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    if scale is None:
        scale = 1.0 / math.sqrt(H)
    # A traced scale (e.g. swept under vmap) is folded into q (and into far.q).
    q_far = None if far is None else tiles.fold_scale(far.q, scale)[0]
    q, scale = tiles.fold_scale(q, scale)
    tq, tk = min(block_q, T), min(block_k, S)
    nq, nk = -(-T // tq), -(-S // tk)
    Tp, Sp = nq * tq, nk * tk

    offsets = jnp.atleast_1d(jnp.asarray(q_offset, jnp.int32))  # (B or 1,)
    kv_len = None
    if kv_lengths is not None:
        kv_len = jnp.minimum(jnp.asarray(kv_lengths, jnp.int32), S)  # (B,)
    elif Sp != S:
        kv_len = jnp.full((1,), S, jnp.int32)

    bias_fn, params = None, ()
    if isinstance(bias, tuple):
        bias_kind = "fn"
        bias_fn, params = bias
    elif bias is not None:
        bias_kind = "array"
        b = jnp.pad(jnp.asarray(bias, f32), ((0, 0), (0, Tp - T), (0, Sp - S)))
        params = b.reshape(N, nq, tq, nk, tk).transpose(1, 3, 0, 2, 4)  # (nq, nk, N, tq, tk)
    else:
        bias_kind = "none"

    plan = _Plan(
        K=K,
        G=G,
        tq=tq,
        tk=tk,
        nq=nq,
        nk=nk,
        causal=bool(causal),
        scale=float(scale),
        bias_kind=bias_kind,
        bias_fn=bias_fn,
        kv_mask=kv_len is not None,
        window=None if window is None else int(window),
        forget=log_forget is not None,
        softcap=None if softcap is None else float(softcap),
        far_window=None if far is None else int(far.window),
    )

    qt = _tile_queries(q, nq, tq, K)  # (nq, B, K, G, tq, H)
    kt = _tile_keys(k, nk, tk)  # (nk, B, K, tk, H)
    vt = _tile_keys(v, nk, tk)  # (nk, B, K, tk, H)
    qft = kft = None
    if far is not None:
        qft, kft = _tile_queries(q_far, nq, tq, K), _tile_keys(far.k, nk, tk)
    cq = ck = None
    if log_forget is not None:
        c = masks.forget_cumsum(log_forget)  # (B, S, N) float32
        c_q = masks.forget_at_queries(c, masks.query_positions(offsets, T))  # (B, T, N)
        cq = _tile_forget(c_q, nq, tq, K)  # (nq, B, K, G, tq)
        ck = _tile_forget(c, nk, tk, K)  # (nk, B, K, G, tk)
    out = _flash(plan, qt, kt, vt, params, offsets, kv_len, cq, ck, qft, kft)  # (nq,B,K,G,tq,H)
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(B, Tp, N, H)  # (B, Tp, N, H)
    return out[:, :T]


def _tile_queries(x, nq, tq, K):
    B, T, N, H = x.shape
    x = tiles.group_heads(jnp.pad(x, ((0, 0), (0, nq * tq - T), (0, 0), (0, 0))), K)
    return x.reshape(B, nq, tq, K, N // K, H).transpose(1, 0, 3, 4, 2, 5)  # (nq, B, K, G, tq, H)


def _tile_keys(x, nk, tk):
    B, S, K, H = x.shape
    x = jnp.pad(x, ((0, 0), (0, nk * tk - S), (0, 0), (0, 0)))
    return x.reshape(B, nk, tk, K, H).transpose(1, 0, 3, 2, 4)  # (nk, B, K, tk, H)


def _tile_forget(c, n, t, K):
    """float32[B, L, N] cumulative sums -> (n, B, K, G, t) tiles (zero-padded to n * t)."""
    B, L, N = c.shape
    c = jnp.pad(c, ((0, 0), (0, n * t - L), (0, 0)))
    return c.reshape(B, n, t, K, N // K).transpose(1, 0, 3, 4, 2)  # (n, B, K, G, t)


# ----------------------------------------------------------------------------------------------
# Per-tile pieces shared by the forward and the backward.


def _tile_positions(plan, offsets, i, j):
    q_pos = offsets[:, None] + i * plan.tq + jnp.arange(plan.tq, dtype=jnp.int32)  # (B|1, tq)
    k_pos = j * plan.tk + jnp.arange(plan.tk, dtype=jnp.int32)  # (tk,)
    return q_pos, k_pos


def _tile_bias(plan, params, offsets, i, j):
    """float32[B or 1, K, G, tq, tk] or None."""
    match plan.bias_kind:
        case "none":
            return None
        case "fn":
            q_pos, k_pos = _tile_positions(plan, offsets, i, j)
            b = masks.evaluate_bias(plan.bias_fn, params, q_pos, k_pos)  # (B|1, N, tq, tk)
        case "array":
            b = params[i, j][None]  # (1, N, tq, tk)
    return b.astype(f32).reshape(b.shape[0], plan.K, plan.G, plan.tq, plan.tk)


def _tile_logit_bias(plan, bias_t, cq, ck, i, j):
    """The position bias tile (B|1, K, G, tq, tk) plus the forget term c_q - c_k (B, ...)."""
    if not plan.forget:
        return bias_t
    f = cq[i][..., :, None] - ck[j][..., None, :]  # (B, K, G, tq, tk)
    return f if bias_t is None else bias_t + f


def _tile_mask(plan, offsets, kv_len, i, j):
    """bool[B or 1, 1, 1, tq, tk] (True = visible) or None when nothing is hidden."""
    q_pos, k_pos = _tile_positions(plan, offsets, i, j)
    return tiles.tile_mask(
        q_pos,
        k_pos,
        causal=plan.causal,
        kv_lengths=kv_len if plan.kv_mask else None,
        window=plan.window,
    )


def _tile_far(plan, offsets, qft, kft, i, j):
    """(far q tile, far k tile, near: bool[B or 1, 1, 1, tq, tk]) of tile (i, j) for
    `tiles.capped_logits`, or None without two-score attention."""
    if plan.far_window is None:
        return None
    q_pos, k_pos = _tile_positions(plan, offsets, i, j)
    near = masks.within_window(q_pos, k_pos, plan.far_window, causal=plan.causal)
    return qft[i], kft[j], near[:, None, None]


def _scores(plan, q_i, k_j, bias_t, mask, *, keys_transposed=False, far=None):
    """(float32[B, K, G, tq, tk] logits of one tile, hidden keys at -inf; the soft cap's slope
    or None: `tiles.capped_logits`).

    k_j is (B, K, tk, H), or (B, K, H, tk) with keys_transposed (the layout the CPU matmul wants,
    so the forward transposes K once instead of once per tile); `far` (`_tile_far`) likewise.
    """
    return tiles.capped_logits(
        "query_major",
        q_i,
        k_j,
        scale=plan.scale,
        bias=bias_t,
        mask=mask,
        keys_transposed=keys_transposed,
        softcap=plan.softcap,
        far=far,
    )


def _with_tile_mask(plan, offsets, kv_len, i, j, step, carry):
    """step(carry, mask) for tile (i, j); mask is None when every pair in the tile is visible.

    Only tiles crossing the causal diagonal, a window edge or a kv length need the select;
    `lax.cond` runs the mask-free branch for the others.
    """
    if not (plan.causal or plan.kv_mask or plan.window is not None):
        return step(carry, None)
    first_k, last_k = j * plan.tk, j * plan.tk + plan.tk - 1
    first_q = jnp.min(offsets) + i * plan.tq  # the tile's earliest and latest query positions
    last_q = jnp.max(offsets) + i * plan.tq + plan.tq - 1
    all_visible = jnp.bool_(True)
    if plan.causal:  # the earliest query of the tile sees the tile's last key
        all_visible &= first_q >= last_k
    if plan.window is not None:  # the latest query still sees the tile's first key
        all_visible &= last_q - first_k < plan.window
        if not plan.causal:  # and the earliest query the tile's last key
            all_visible &= last_k - first_q < plan.window
    if plan.kv_mask:
        all_visible &= last_k < jnp.min(kv_len)
    return jax.lax.cond(
        all_visible,
        lambda c: step(c, None),
        lambda c: step(c, _tile_mask(plan, offsets, kv_len, i, j)),
        carry,
    )


def _key_tile_start(plan, offsets, i):
    """The first key tile that query tile i can see (traced int): 0 without a window."""
    if plan.window is None:
        return jnp.int32(0)
    first_key = tiles.window_key_start(jnp.min(offsets) + i * plan.tq, plan.window)
    return jnp.clip(first_key // plan.tk, 0, plan.nk)


def _key_tile_end(plan, offsets, kv_len, i):
    """One past the last key tile that query tile i can see (traced int)."""
    end = jnp.int32(plan.nk)
    if plan.causal:
        key_end = tiles.causal_key_end(jnp.max(offsets), (i + 1) * plan.tq)
        end = jnp.clip(-(-key_end // plan.tk), 0, plan.nk)
    elif plan.window is not None:
        key_end = tiles.window_key_end(jnp.max(offsets) + (i + 1) * plan.tq - 1, plan.window)
        end = jnp.clip(-(-key_end // plan.tk), 0, plan.nk)
    if plan.kv_mask:
        end = jnp.minimum(end, -(-jnp.max(kv_len) // plan.tk))
    return end


def _query_tile_start(plan, offsets, j):
    """The first query tile that can see key tile j (traced int)."""
    if not plan.causal and plan.window is None:
        return jnp.int32(0)
    if plan.causal:
        first_q = tiles.causal_query_start(jnp.max(offsets), j * plan.tk)
    else:
        first_q = tiles.window_query_start(jnp.max(offsets), j * plan.tk, plan.window)
    return jnp.clip(first_q // plan.tq, 0, plan.nq)


def _query_tile_end(plan, offsets, j):
    """One past the last query tile that can see key tile j (traced int): nq without a window."""
    if plan.window is None:
        return jnp.int32(plan.nq)
    last_q = tiles.window_query_end(jnp.min(offsets), j * plan.tk + plan.tk - 1, plan.window) - 1
    return jnp.clip(last_q // plan.tq + 1, 0, plan.nq)


# ----------------------------------------------------------------------------------------------
# The kernel: forward and backward over tiles.


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(plan, qt, kt, vt, params, offsets, kv_len, cq, ck, qft, kft):
    return _forward(plan, qt, kt, vt, params, offsets, kv_len, cq, ck, qft, kft)[0]


def _forward(plan, qt, kt, vt, params, offsets, kv_len, cq, ck, qft, kft):
    """Returns out (nq, B, K, G, tq, H) in q's dtype and lse float32 (nq, B, K, G, tq)."""
    _, B, K, G, tq, H = qt.shape

    kt_t = jnp.swapaxes(kt, -1, -2)  # (nk, B, K, H, tk)
    kft_t = None if kft is None else jnp.swapaxes(kft, -1, -2)

    def query_tile(i):
        q_i = qt[i]  # (B, K, G, tq, H)

        def step(carry, mask, j):
            bias_t = _tile_logit_bias(plan, _tile_bias(plan, params, offsets, i, j), cq, ck, i, j)
            far = _tile_far(plan, offsets, qft, kft_t, i, j)
            s, _ = _scores(
                plan, q_i, kt_t[j], bias_t, mask, keys_transposed=True, far=far
            )  # (B, K, G, tq, tk)
            return tiles.online_softmax_step(carry, s, vt[j])

        def key_tile(j, carry):
            return _with_tile_mask(plan, offsets, kv_len, i, j, partial(step, j=j), carry)

        init = tiles.softmax_init((B, K, G, tq), H)
        state = jax.lax.fori_loop(
            _key_tile_start(plan, offsets, i),
            _key_tile_end(plan, offsets, kv_len, i),
            key_tile,
            init,
        )
        return tiles.softmax_finish(state, qt.dtype)[0], tiles.log_sum_exp(state)

    return jax.lax.map(query_tile, jnp.arange(plan.nq, dtype=jnp.int32))


def _flash_fwd(plan, qt, kt, vt, params, offsets, kv_len, cq, ck, qft, kft):
    out, lse = _forward(plan, qt, kt, vt, params, offsets, kv_len, cq, ck, qft, kft)
    return out, (qt, kt, vt, params, offsets, kv_len, cq, ck, qft, kft, out, lse)


def _flash_bwd(plan, res, d_out):
    qt, kt, vt, params, offsets, kv_len, cq, ck, qft, kft, out, lse = res
    two = plan.far_window is not None  # dq and dk are then (near, far) pairs
    d_out = d_out.astype(qt.dtype)
    delta = tiles.softmax_delta(d_out, out)  # (nq, B, K, G, tq)
    if plan.bias_kind == "fn":  # differentiate the floating-point leaves only
        floats, rebuild, cotangent = _split_float_leaves(params)
    match plan.bias_kind:
        case "fn":
            d_params = [jnp.zeros(x.shape, f32) for x in floats]
        case "array":
            d_params = jnp.zeros(params.shape, f32)  # (nq, nk, N, tq, tk)
        case _:
            d_params = ()

    def key_tile(j, carry):
        dq, dk, dv, d_params, dcq, dck = carry
        k_j, v_j = kt[j], vt[j]  # (B, K, tk, H)

        def tile_grads(i, mask):
            """Tile (i, j)'s contributions: dq_i, dk_j, dv_j, the bias cotangent and the forget
            cotangents d c_q (B, K, G, tq) and d c_k (B, K, G, tk)."""
            q_i, do_i = qt[i], d_out[i]  # (B, K, G, tq, H)
            pull = None
            match plan.bias_kind:
                case "fn":
                    bias_t, pull = jax.vjp(
                        lambda fl: _tile_bias(plan, rebuild(fl), offsets, i, j), floats
                    )
                case _:
                    bias_t = _tile_bias(plan, params, offsets, i, j)
            far = _tile_far(plan, offsets, qft, kft, i, j)
            logit_bias = _tile_logit_bias(plan, bias_t, cq, ck, i, j)
            s, slope = _scores(plan, q_i, k_j, logit_bias, mask, far=far)
            p = tiles.probabilities_from_lse("query_major", s, lse[i])  # hidden, empty rows: 0
            dq, dk, dv, ds = tiles.tile_grads(
                "query_major",
                p=p,
                q=q_i,
                k=k_j,
                v=v_j,
                d_out=do_i,
                delta=delta[i],
                scale=plan.scale,
                cap_slope=slope,
                far=far,
            )  # ds: (B, K, G, tq, tk); dq, dk (near, far) pairs with `far`
            d_forget = tiles.forget_grads(ds) if plan.forget else ((), ())
            d_bias = ()
            if bias_t is not None:
                ds = tiles.sum_to(ds, bias_t.shape)  # a bias shared by the batch
                match plan.bias_kind:  # ds: (B|1, K, G, tq, tk), the bias tile's layout
                    case "fn":
                        d_bias = pull(ds)[0]
                    case "array":
                        d_bias = ds[0].reshape(params.shape[2:])  # (N, tq, tk)
            return dq, dk, dv, d_bias, d_forget

        def query_tile(i, carry):
            dq, dk_j, dv_j, d_params, dcq, dck_j = carry
            # Only tile-sized values cross the cond, so the [T]-sized buffers update in place.
            dq_i, dk, dv, d_bias, (dcq_i, dck) = _with_tile_mask(
                plan, offsets, kv_len, i, j, lambda _, mask: tile_grads(i, mask), None
            )
            if plan.forget:
                dcq, dck_j = dcq.at[i].add(dcq_i), dck_j + dck
            match plan.bias_kind:
                case "fn":
                    d_params = [a + b for a, b in zip(d_params, d_bias, strict=True)]
                case "array":
                    d_params = d_params.at[i, j].set(d_bias)
            dq = jax.tree.map(lambda buf, x: buf.at[i].add(x), dq, dq_i)
            dk_j = jax.tree.map(jnp.add, dk_j, dk)
            return dq, dk_j, dv_j + dv, d_params, dcq, dck_j

        zeros = jnp.zeros(k_j.shape, f32)
        dck_j = jnp.zeros(ck.shape[1:], f32) if plan.forget else ()
        dq, dk_j, dv_j, d_params, dcq, dck_j = jax.lax.fori_loop(
            _query_tile_start(plan, offsets, j),
            _query_tile_end(plan, offsets, j),
            query_tile,
            (dq, (zeros, zeros) if two else zeros, zeros, d_params, dcq, dck_j),
        )
        if plan.forget:
            dck = dck.at[j].set(dck_j)
        dk = jax.tree.map(lambda buf, x: buf.at[j].set(x), dk, dk_j)
        return dq, dk, dv.at[j].set(dv_j), d_params, dcq, dck

    # The first query tile sees the earliest keys, the last query tile the latest: no key tile
    # outside that range is needed.
    first_key_tile = _key_tile_start(plan, offsets, 0)
    n_key_tiles = _key_tile_end(plan, offsets, kv_len, plan.nq - 1)
    d_forget = (jnp.zeros(cq.shape, f32), jnp.zeros(ck.shape, f32)) if plan.forget else ((), ())
    dq0, dk0 = jnp.zeros(qt.shape, f32), jnp.zeros(kt.shape, f32)
    init = (
        (dq0, dq0) if two else dq0,
        (dk0, dk0) if two else dk0,
        jnp.zeros(vt.shape, f32),
        d_params,
        *d_forget,
    )
    dq, dk, dv, d_params, dcq, dck = jax.lax.fori_loop(first_key_tile, n_key_tiles, key_tile, init)
    if plan.bias_kind == "fn":
        d_params = cotangent(d_params)
    if not plan.forget:
        dcq = dck = None
    (dq, dqf), (dk, dkf) = (dq, dk) if two else ((dq, None), (dk, None))
    return (
        dq.astype(qt.dtype),
        dk.astype(kt.dtype),
        dv.astype(vt.dtype),
        d_params,
        None,
        None,
        dcq,
        dck,
        None if dqf is None else dqf.astype(qft.dtype),
        None if dkf is None else dkf.astype(kft.dtype),
    )


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------------------------
# Bias parameters: only floating-point leaves are differentiated; integer leaves ride along.


def _split_float_leaves(params):
    """(float leaves, rebuild, cotangent): rebuild(float leaves) gives back the params pytree,
    cotangent(float leaf gradients) the params-shaped cotangent (float0 for integer leaves)."""
    leaves, treedef = jax.tree.flatten(params)
    is_float = [jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in leaves]

    def rebuild(floats):
        it = iter(floats)
        return jax.tree.unflatten(
            treedef, [next(it) if f else x for x, f in zip(leaves, is_float, strict=True)]
        )

    def cotangent(d_floats):
        it = iter(d_floats)
        return jax.tree.unflatten(
            treedef,
            [
                next(it).astype(jnp.result_type(x))
                if f
                else np.zeros(jnp.shape(x), jax.dtypes.float0)
                for x, f in zip(leaves, is_float, strict=True)
            ],
        )

    return [x for x, f in zip(leaves, is_float, strict=True) if f], rebuild, cotangent
