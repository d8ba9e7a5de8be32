"""Chunked attention: each batch row's logits materialised, a few rows at a time, own backward.

Shape legend: B batch, T query length, S key length, N query heads, K key/value heads, G = N // K
query heads per key/value head, H head dim, R batch rows per chunk.

The fast path at training lengths (T, S up to ~1k) on XLA:CPU. `posattn.attention` builds the
additive logit bias (the position bias with -inf at hidden keys, `attention_from_bias`) and
`chunked_attention` only sees arrays. A sliding window is part of those -inf (with a static causal
offset the query tiles also skip the keys below their window), and the forgetting-attention term
c_i - c_j is part of the bias, one slice per batch row. Two-score attention (`masks.Far`) comes
with its near pairs' mask materialised beside the bias; each tile computes both content products
and selects, and the backward splits dS between the two pairs.

Forward: a `lax.scan` over chunks of R batch rows. Per chunk, in head-major layout,
`s = scale q k^T + bias` ([R, K, G, T, S]), its row max and sum, `out = softmax(s) v`; the row max
and 1 / row sum are the only extra residuals (no logits are kept).

Backward (FlashAttention-2's equations, Dao 2023, Alg. 2, with the whole row as one tile; the
equations live in `posattn.attention.tiles`): the probabilities are recomputed from the saved row
max and 1 / row sum, `dV = P^T dO`, `dP = dO V^T`, `dS = P * (dP - D)` with `D = rowsum(P * dP)`,
`dQ = scale dS K`, `dK = scale dS^T Q`, and the bias gradient is the sum of `dS` over the rows that
share the bias.

Why it is fast on XLA:CPU (measured at B 16, T = S 256, 4 heads of 32, ALiBi, causal, with
development scripts that are not in the repository; docs/attention.md gives the numbers, and
`benchmarks/train_throughput.py --crossover` reproduces the end result):
  * head-major operands make every matmul a batched GEMM on contiguous [T, H] / [S, H] blocks
    (`jax.nn.dot_product_attention`'s [B, T, N, H] contractions ran 3-4x slower);
  * a chunk of R rows keeps the [R, N, T, S] logits (4 MiB) in cache for the elementwise passes,
    instead of streaming the whole batch's logits through memory once per pass;
  * the backward works on transposed logits [S, G*T]: XLA:CPU runs `A B` and `A B^T` on its fast
    library path but copies the operand of `A^T B` through a slow strided transpose, and in this
    layout dV, dK and dP are `A B` / `A B^T` while dQ is computed as (K^T dS^T)^T;
  * sums over the rows of a chunk are unrolled adds: XLA:CPU's reductions over a short axis (the R
    rows) ran about 10x slower than these.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from posattn.attention import masks, tiles

# Logits per chunk: R batch rows with R * N * T * S <= CHUNK_LOGITS (4 MiB of float32, half the
# 2 MiB-per-core L2 of both cores). 256Ki to 1Mi were within noise at B 16, T 256, 4 heads; 4Mi
# (the whole batch at once) ran the forward+backward ~2x slower.
CHUNK_LOGITS = 1 << 20
# At most this many rows per chunk: the backward sums the bias gradient over the rows of a chunk
# with unrolled adds.
MAX_CHUNK_ROWS = 16
# Causal query tiles: tile [a, a + TILE_Q) only multiplies the keys it can see. 128 at T = 256
# skips a quarter of the work (the upper-right [128, 128] block of each head).
TILE_Q = 128

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class _Plan:
    scale: float
    rows: int  # batch rows per chunk (R), a divisor of B
    per_row_bias: bool  # the bias has one slice per batch row (per-row offsets or lengths)
    bias_grad: bool  # compute the bias gradient (False: the bias is a constant mask)
    # (first query, end query, first key, end key) of each query tile
    tiles: tuple[tuple[int, int, int, int], ...]
    softcap: float | None = None  # the content logits capped as c tanh(s / c) (Gemma 2)
    far: bool = False  # two-score attention: far pairs score with a second query/key pair
    per_row_near: bool = False  # its near mask has one slice per batch row (per-row offsets)


def attention_from_bias(
    q,
    k,
    v,
    *,
    bias,
    causal,
    q_offset,
    kv_lengths,
    scale,
    static_offset=None,
    window=None,
    log_forget=None,
    softcap=None,
    far=None,
) -> jax.Array:
    """`chunked_attention` on the bias materialised [B or 1, N, T, S] with -inf at hidden keys:
    the contract of `posattn.attention.attention`.

    `static_offset`: q_offset as a Python int when it is one (the causal tiles are then static).
    The window joins the mask; the forget term c_i - c_j (c = cumsum(log_forget) in float32) joins
    the materialised bias, one slice per batch row, and JAX differentiates the cumulative sum and
    the gather outside the kernel from the bias gradient. Two-score attention (`far`,
    `masks.Far`) passes its pair and the near pairs' mask [B or 1, T, S] (`masks.within_window`).
    """
    logit_bias, bias_grad = masks.masked_logit_bias(
        bias,
        log_forget,
        q_offset,
        q.shape[1],
        k.shape[1],
        causal=causal,
        kv_lengths=kv_lengths,
        window=window,
    )
    pair = None
    if far is not None:
        q_pos = masks.query_positions(q_offset, q.shape[1])  # (B|1, T)
        k_pos = jnp.arange(k.shape[1], dtype=jnp.int32)
        pair = (far.q, far.k, masks.within_window(q_pos, k_pos, far.window, causal=causal))
    return chunked_attention(
        q,
        k,
        v,
        logit_bias,
        scale=scale,
        bias_grad=bias_grad,
        causal_offset=static_offset if causal else None,
        window=window if causal else None,
        softcap=softcap,
        far=pair,
    )


def chunked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    logit_bias: jax.Array | None,
    *,
    scale,
    bias_grad: bool,
    causal_offset: int | None = None,
    chunk_logits: int | None = None,
    tile_q: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    far: tuple | None = None,
) -> jax.Array:
    """softmax(scale q k^T + logit_bias) v, chunked over the batch (with `softcap` c:
    softmax(c tanh(scale q k^T / c) + logit_bias) v).

    Args:
      q: float[B, T, N, H] queries.
      k: float[B, S, K, H] keys, N % K == 0.
      v: float[B, S, K, H] values.
      logit_bias: None or float[B or 1, N or 1, T, S] added to the logits; -inf hides a key. A row
        with no visible key returns zeros.
      scale: the logit scale, a Python float or a traced scalar (folded into q, so its gradient
        flows through autodiff outside the kernel).
      bias_grad: whether `logit_bias` needs its gradient (False for a mask-only bias; its
        cotangent is then zero).
      causal_offset: a static int when the attention is causal with that (scalar) position of the
        first query: `logit_bias` must then hide every key j > q_offset + t, and query tiles skip
        the keys none of their queries can see. None: every query sees every key (up to the bias).
      chunk_logits: logits per chunk, default CHUNK_LOGITS; R, the rows per chunk, is the largest
        divisor of B with R * N * T * S <= chunk_logits (at least 1, at most MAX_CHUNK_ROWS).
      tile_q: query tile of the causal skipping, default TILE_Q.
      window: with `causal_offset`, a causal sliding window w that `logit_bias` already applies
        (keys j <= i - w hidden): query tiles then also skip the keys below their window.
      softcap: None, or a static c > 0 capping the content logits (Gemma 2's soft-capping).
      far: None, or (q_far [B, T, N, H], k_far [B, S, K, H], near bool[B or 1, T, S]): two-score
        attention, the pairs where `near` is False scoring scale q_far k_far^T.

    Returns:
      float[B, T, N, H] in q's dtype.
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    pair = None
    if far is not None:
        q_far, k_far, near = far
        near = jnp.asarray(near, bool)[:, None, None]  # (B|1, 1, 1, T, S)
        pair = (tiles.group_heads(tiles.fold_scale(q_far, scale)[0], K), k_far, near)
    q, scale = tiles.fold_scale(q, scale)
    chunk_logits = CHUNK_LOGITS if chunk_logits is None else chunk_logits
    rows = max(1, min(B, MAX_CHUNK_ROWS, chunk_logits // max(N * T * S, 1)))
    while B % rows:
        rows -= 1
    bias = None
    if logit_bias is not None:
        Bb, Nb = logit_bias.shape[:2]
        heads = (K, G) if Nb == N else (1, 1)
        bias = logit_bias.astype(f32).reshape(Bb, *heads, T, S)  # (B|1, K|1, G|1, T, S)
    plan = _Plan(
        scale=float(scale),
        rows=rows,
        per_row_bias=bias is not None and bias.shape[0] != 1,
        bias_grad=bool(bias_grad) and bias is not None,
        tiles=_query_tiles(T, S, causal_offset, TILE_Q if tile_q is None else tile_q, window),
        softcap=None if softcap is None else float(softcap),
        far=pair is not None,
        per_row_near=pair is not None and pair[2].shape[0] != 1,
    )
    out = _attend(plan, tiles.group_heads(q, K), k, v, bias, pair)  # (B, T, K, G, H)
    return tiles.ungroup_heads(out)


def _query_tiles(T, S, causal_offset, tile_q, window=None):
    """(first query, end query, first key, end key) per query tile: with a static causal offset,
    tile [a, b) needs keys [0, offset + b) only, and with a causal window w keys from
    offset + a - w + 1 on; otherwise one tile sees every key."""
    if causal_offset is None or (T <= tile_q and window is None):
        return ((0, T, 0, S),)
    result = []
    for a in range(0, T, tile_q):
        b = min(a + tile_q, T)
        end = min(S, max(tiles.causal_key_end(causal_offset, b), 0))
        # no query of the tile sees a key: one key keeps the shapes non-empty (masked)
        end = end if end > 0 else 1
        start = 0 if window is None else causal_offset + a - window + 1
        result.append((a, b, min(max(start, 0), end - 1), end))
    return tuple(result)


def _head_major(q, k, v):
    """A chunk's q (R, T, K, G, H) and k, v (R, S, K, H) as (R, K, G, T, H) and (R, K, S, H)."""
    return q.transpose(0, 2, 3, 1, 4), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def _split(plan, x):
    """[B, ...] -> [B / R, R, ...] (the scanned axis first); None stays None."""
    return None if x is None else x.reshape(x.shape[0] // plan.rows, plan.rows, *x.shape[1:])


def _merge(x):
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _pair_xs(plan, pair):
    """The scanned inputs of two-score attention: far q and k split per chunk, and the near mask
    split when it is per row (None otherwise: `pair`'s own, shared)."""
    if pair is None:
        return None
    q_far, k_far, near = pair
    return (
        _split(plan, q_far),
        _split(plan, k_far),
        _split(plan, near) if plan.per_row_near else None,
    )


def _pair_of_chunk(plan, pair, pair_c):
    """(far q (R, K, G, T, H), far k (R, K, S, H), near (R|1, 1, 1, T, S)) of one chunk."""
    if pair is None:
        return None
    q_far, k_far, near_c = pair_c
    q_far, k_far, _ = _head_major(q_far, k_far, k_far)
    return q_far, k_far, near_c if plan.per_row_near else pair[2]


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(plan, q, k, v, bias, pair):
    return _forward(plan, q, k, v, bias, pair)[0]


def _forward(plan, q, k, v, bias, pair=None):
    """out (B, T, K, G, H) in q's dtype, and the row max m and 1 / row sum, float32 (B, K, G, T).

    The backward recomputes P = exp(s - m) / l from these rather than exp(s - lse): it then
    matches the forward's probabilities to rounding, which keeps the gradient of a per-row
    constant bias shift (zero in exact arithmetic) at the reference's float32 noise level.
    """

    def tile(q_c, k_c, v_c, b, far):
        s, _ = tiles.capped_logits(
            "query_major", q_c, k_c, scale=plan.scale, bias=b, softcap=plan.softcap, far=far
        )  # (R, K, G, t, s)
        state = tiles.softmax_init(s.shape[:-1], v_c.shape[-1])
        state = tiles.online_softmax_step(state, s, v_c)  # the whole row is one key tile
        return tiles.softmax_finish(state, q_c.dtype)  # out, guarded m, 1 / l

    def chunk(_, xs):
        q_c, k_c, v_c, bias_c, pair_c = xs  # (R, T, K, G, H), (R, S, K, H) x2, (R, K|1, G|1, T, S)
        q_c, k_c, v_c = _head_major(q_c, k_c, v_c)
        b = bias_c if plan.per_row_bias else bias
        two = _pair_of_chunk(plan, pair, pair_c)
        outs = [
            tile(
                q_c[:, :, :, a:e],
                k_c[:, :, st:end],
                v_c[:, :, st:end],
                None if b is None else b[..., a:e, st:end],
                None
                if two is None
                else (two[0][:, :, :, a:e], two[1][:, :, st:end], two[2][..., a:e, st:end]),
            )
            for a, e, st, end in plan.tiles
        ]
        o, m, inv_l = (jnp.concatenate(x, axis=3) for x in zip(*outs, strict=True))  # along T
        return None, (o.transpose(0, 3, 1, 2, 4), m, inv_l)

    xs = (
        _split(plan, q),
        _split(plan, k),
        _split(plan, v),
        _split(plan, bias) if plan.per_row_bias else None,
        _pair_xs(plan, pair),
    )
    _, (out, m, inv_l) = jax.lax.scan(chunk, None, xs)
    return _merge(out), _merge(m), _merge(inv_l)


def _attend_fwd(plan, q, k, v, bias, pair):
    out, m, inv_l = _forward(plan, q, k, v, bias, pair)
    return out, (q, k, v, bias, pair, m, inv_l)


def _attend_bwd(plan, res, d_out):
    q, k, v, bias, pair, m, inv_l = res
    # The barrier keeps a constant cotangent (the gradient of `out.sum()`) an array: XLA:CPU
    # (jaxlib 0.10.2) folds its broadcast scalar into dP = dO V^T, and its fused library graph
    # of that product with D and dS then computes wrong dq and dk, which can change from run to
    # run (docs/attention.md, "A constant cotangent"; tests/attention/test_attention.py::
    # test_a_constant_cotangent_gives_the_same_gradients).
    d_out = jax.lax.optimization_barrier(d_out.astype(q.dtype))
    # Transposed logits [S, G*T] per (row, key head); see the module docstring.
    bias_t = None if bias is None else jnp.moveaxis(bias, -1, 2)  # (B|1, K|1, S, G|1, T)
    # Two-score attention: the near mask in the same transposed layout, (B|1, 1, S, 1, T).
    pair_t = None if pair is None else (*pair[:2], jnp.moveaxis(pair[2], -1, 2))

    def tile(q_c, k_c, v_c, do_c, m_c, inv_l_c, b, far):
        """One query tile's dq (R, K, H, G, t), dk, dv (R, K, s, H) and dS^T (R, K, s, G, t);
        with `far`, dq and dk are (near, far) pairs (`tiles.tile_grads`)."""
        s_t, slope = tiles.capped_logits(
            "key_major", q_c, k_c, scale=plan.scale, bias=b, softcap=plan.softcap, far=far
        )  # (R, K, s, G, t)
        p_t = tiles.probabilities("key_major", s_t, m_c, inv_l_c)  # hidden keys: 0
        return tiles.tile_grads(
            "key_major",
            p=p_t,
            q=q_c,
            k=k_c,
            v=v_c,
            d_out=do_c,
            delta=None,
            scale=plan.scale,
            cap_slope=slope,
            far=far,
        )

    def chunk(d_bias, xs):
        q_c, k_c, v_c, do_c, m_c, inv_l_c, bias_c, pair_c = xs
        q_c, k_c, v_c = _head_major(q_c, k_c, v_c)
        do_c = do_c.transpose(0, 2, 3, 1, 4)  # (R, K, G, T, H)
        b = bias_c if plan.per_row_bias else bias_t
        two = _pair_of_chunk(plan, pair_t, pair_c)
        R, K, S, H = k_c.shape
        zeros = jnp.zeros((R, K, S, H), f32)
        dk, dv = ((zeros, zeros) if plan.far else zeros), zeros
        dq, ds_rows = [], None
        if plan.bias_grad and plan.per_row_bias:
            ds_rows = jnp.zeros(bias_c.shape, f32)
        for a, e, st, end in plan.tiles:
            dq_t, dk_i, dv_i, ds_t = tile(
                q_c[:, :, :, a:e],
                k_c[:, :, st:end],
                v_c[:, :, st:end],
                do_c[:, :, :, a:e],
                m_c[..., a:e],
                inv_l_c[..., a:e],
                None if b is None else b[:, :, st:end, :, a:e],
                None
                if two is None
                else (two[0][:, :, :, a:e], two[1][:, :, st:end], two[2][:, :, st:end, :, a:e]),
            )
            dq.append(dq_t)
            dk = jax.tree.map(
                lambda acc, x, keys=slice(st, end): acc.at[:, :, keys].add(x), dk, dk_i
            )
            dv = dv.at[:, :, st:end].add(dv_i)
            if ds_rows is not None:
                ds_rows = ds_rows.at[:, :, st:end, :, a:e].set(tiles.sum_to(ds_t, bias_c.shape))
            elif plan.bias_grad:
                for r in range(plan.rows):  # unrolled: see the module docstring
                    d_bias = d_bias.at[:, st:end, :, a:e].add(tiles.sum_to(ds_t[r], d_bias.shape))
        dq = jax.tree.map(  # (R, T, K, G, H)
            lambda *parts: jnp.concatenate(parts, axis=-1).transpose(0, 4, 1, 3, 2), *dq
        )
        dk = jax.tree.map(lambda x: x.transpose(0, 2, 1, 3), dk)  # (R, S, K, H)
        return d_bias, (dq, dk, dv.transpose(0, 2, 1, 3), ds_rows)

    per_row = plan.per_row_bias
    xs = tuple(_split(plan, x) for x in (q, k, v, d_out, m, inv_l)) + (
        _split(plan, bias_t) if per_row else None,
        _pair_xs(plan, pair_t),
    )
    init = jnp.zeros(bias_t.shape[1:], f32) if plan.bias_grad and not per_row else None
    d_bias, (dq, dk, dv, ds_rows) = jax.lax.scan(chunk, init, xs)
    d_pair = None
    if plan.far:
        (dq, dq_far), (dk, dk_far) = dq, dk
        q_far, k_far, _ = pair
        d_pair = (_merge(dq_far).astype(q_far.dtype), _merge(dk_far).astype(k_far.dtype), None)
    if bias is None:
        d_bias = None
    elif not plan.bias_grad:
        d_bias = jnp.zeros(bias.shape, bias.dtype)
    else:
        d_bias_t = _merge(ds_rows) if per_row else d_bias[None]  # (B|1, K|1, S, G|1, T)
        d_bias = jnp.moveaxis(d_bias_t, 2, -1).astype(bias.dtype)
    return (
        _merge(dq).astype(q.dtype),
        _merge(dk).astype(k.dtype),
        _merge(dv).astype(v.dtype),
        d_bias,
        d_pair,
    )


_attend.defvjp(_attend_fwd, _attend_bwd)
