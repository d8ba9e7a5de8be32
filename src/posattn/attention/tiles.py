"""The FlashAttention-2 tile math shared by `chunked` and `blockwise` (Dao 2023, Algs. 1 and 2).

Shape legend: B batch rows (R in a chunk), K key/value heads, G = N // K query heads per key/value
head, H head dim, t/s a tile's query/key length. A tile's logits live in one of two layouts:

  "query_major"  [B, K, G, t, s]: the forward of both kernels and the backward of `blockwise`.
  "key_major"    [B, K, s, G, t]: the backward of `chunked`, where XLA:CPU runs every product of
                 the gradient as `A B` or `A B^T` (see `posattn.attention.chunked`).

Each equation is written once here, for both layouts:

  forward    s = scale q k^T + bias (hidden keys at -inf); the online softmax keeps the running
             row max m, row sum l and unnormalised output acc; out = acc / l. With a soft cap c
             (Gemma 2) the content term scale q k^T becomes c tanh(scale q k^T / c) before the
             bias is added. Two-score attention (`masks.Far`) takes the content term of the
             pairs past its window from a second pair q_far k_far^T, and splits dS between
             the two pairs in the backward.
  backward   P = exp(s - m) / l (or exp(s - lse)); dV = P^T dO; dP = dO V^T;
             D = rowsum(dO * O); dS = P * (dP - D); dQ = scale dS K; dK = scale dS^T Q
             (with a soft cap, dS times the cap's slope 1 - tanh^2 in dQ and dK, not the bias's).
             D has a second form, rowsum(P * dP), equal in exact arithmetic: a kernel that holds
             a whole row of P in one tile (`chunked`) uses it, so that each row of dS sums to zero
             to rounding and the gradients of bias parameters that shift a whole row (FIRE's MLP
             bias) keep the reference's float32 noise level; a kernel that sees a row in several
             key tiles (`blockwise`) must use rowsum(dO * O), known before the first tile.
  forget     the forget term c_q[:, None] - c_k[None, :] (FoX) of a tile has the cotangents
             d c_q = rowsum(dS) and d c_k = -colsum(dS) (`forget_grads`).
  empty rows a query row that sees no key keeps m = -inf and l = 0: its max is taken as 0 so that
             exp(-inf - 0) = 0, its output is 0 and its probabilities are 0, never NaN.

Keys and values are never repeated for the G query heads that share them: queries are viewed as
[..., K, G, ...] and contracted against [..., K, ...] keys directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from posattn.attention import masks

f32 = jnp.float32

# einsum specs per layout: operand names and the spec, so each equation below has one definition
# and each layout keeps the operand order its fast matmul path wants.
_LAYOUTS = {
    "query_major": dict(
        logits=("q", "k", "bkgqh,bkch->bkgqc"),
        logits_kt=("q", "k", "bkgqh,bkhc->bkgqc"),  # keys passed as [B, K, H, s]
        pv=("p", "v", "bkgqc,bkch->bkgqh"),
        dv=("p", "do", "bkgqc,bkgqh->bkch"),
        dp=("do", "v", "bkgqh,bkch->bkgqc"),
        dq=("ds", "k", "bkgqc,bkch->bkgqh"),
        dk=("ds", "q", "bkgqc,bkgqh->bkch"),
        delta=("p", "dp", "bkgqc,bkgqc->bkgq"),
        row_axis=-1,  # the key axis of the logits; per-query-row statistics broadcast along it
    ),
    "key_major": dict(
        logits=("k", "q", "bksh,bkgth->bksgt"),
        dv=("p", "do", "bksgt,bkgth->bksh"),
        dp=("v", "do", "bksh,bkgth->bksgt"),
        dq=("k", "ds", "bksh,bksgt->bkhgt"),  # dQ^T = K^T dS^T: [B, K, H, G, t]
        dk=("ds", "q", "bksgt,bkgth->bksh"),
        delta=("p", "dp", "bksgt,bksgt->bkgt"),
        row_axis=2,
    ),
}


def _einsum(layout, name, **operands):
    *names, spec = _LAYOUTS[layout][name]
    args = [operands[n] for n in names]
    if jax.default_backend() == "cpu" and any(a.dtype != f32 for a in args):
        # XLA:CPU has no bfloat16 x bfloat16 -> float32 product outside the fusions it hands to
        # its GEMM library (jax 0.10: "Unsupported element type for DotThunk"), and which
        # products it fuses depends on the shapes. The float32 product of the widened operands
        # is the same: a product of two bfloat16 values is exact in float32.
        args = [a.astype(f32) for a in args]
    return jnp.einsum(spec, *args, preferred_element_type=f32)


def _per_row(layout, x):
    """A per-query-row statistic [B, K, G, t] broadcast against the layout's logits."""
    return jnp.expand_dims(x, _LAYOUTS[layout]["row_axis"])


# ----------------------------------------------------------------------------------------------
# Inputs: the scale, grouped query heads.


def fold_scale(q: jax.Array, scale) -> tuple[jax.Array, float]:
    """(q, scale) with a traced scale folded into q, so that autodiff outside a custom_vjp carries
    its gradient; a Python scale stays a static float inside the kernel."""
    if isinstance(scale, (int, float, np.number)):
        return q, float(scale)
    return (q.astype(f32) * scale).astype(q.dtype), 1.0


def group_heads(q: jax.Array, K: int) -> jax.Array:
    """[..., N, H] -> [..., K, G, H]: query head n = k G + g shares key/value head k."""
    *lead, N, H = q.shape
    return q.reshape(*lead, K, N // K, H)


def ungroup_heads(x: jax.Array) -> jax.Array:
    """[..., K, G, H] -> [..., N, H]."""
    *lead, K, G, H = x.shape
    return x.reshape(*lead, K * G, H)


# ----------------------------------------------------------------------------------------------
# Masks and causal tile ranges.


def tile_mask(q_pos, k_pos, *, causal, kv_lengths, window=None):
    """bool[B or 1, 1, 1, t, s] (True = visible) for query-major logits, or None if none hidden."""
    mask = masks.visible(q_pos, k_pos, causal=causal, kv_lengths=kv_lengths, window=window)
    return None if mask is None else mask[:, None, None]


def causal_key_end(offset, query_end):
    """One past the last key that queries [.., query_end) see under a causal mask whose first
    query sits at position `offset` (Python ints or traced)."""
    return offset + query_end


def causal_query_start(offset, key_start):
    """The first query (index) that sees key `key_start` under a causal mask with `offset`."""
    return key_start - offset


def window_key_start(query_pos, window):
    """The first key that the query at `query_pos` sees under a sliding window (i - j < w)."""
    return query_pos - window + 1


def window_key_end(query_pos, window):
    """One past the last key the query at `query_pos` sees under a two-sided window (|i-j| < w)."""
    return query_pos + window


def window_query_start(offset, key, window):
    """The first query (index) that sees `key` under a two-sided window, first query at `offset`."""
    return key - window + 1 - offset


def window_query_end(offset, key, window):
    """One past the last query (index) that sees `key` under a window, first query at `offset`."""
    return key + window - offset


def sum_to(x: jax.Array, shape) -> jax.Array:
    """Sums x over the axes where `shape` (same rank) has 1: a bias shared by rows or heads."""
    axes = tuple(
        i for i, (a, b) in enumerate(zip(x.shape, shape, strict=True)) if b == 1 and a != 1
    )
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


# ----------------------------------------------------------------------------------------------
# Forward.


def logits(layout, q, k, *, scale, bias=None, mask=None, keys_transposed=False, softcap=None):
    """float32 logits of one tile in `layout`, hidden keys at -inf.

    With `softcap` c the content logits are capped before the bias is added (`cap`); use
    `capped_logits` where the backward needs the cap's slope."""
    return capped_logits(
        layout,
        q,
        k,
        scale=scale,
        bias=bias,
        mask=mask,
        keys_transposed=keys_transposed,
        softcap=softcap,
    )[0]


def capped_logits(
    layout, q, k, *, scale, bias=None, mask=None, keys_transposed=False, softcap=None, far=None
):
    """(logits, slope): `logits`, and the derivative of the cap at the content logits,
    1 - tanh^2(scale q.k / c), or None without a cap.

    `far`: None, or (q_far, k_far, near) for two-score attention (`masks.Far`): the pairs where
    the bool `near` (broadcast against the logits) is False score scale q_far.k_far instead
    (k_far in k's layout, transposed or not)."""
    name = "logits_kt" if keys_transposed else "logits"
    s = _einsum(layout, name, q=q, k=k) * scale
    if far is not None:
        q_far, k_far, near = far
        s = jnp.where(near, s, _einsum(layout, name, q=q_far, k=k_far) * scale)
    slope = None
    if softcap is not None:
        s, slope = cap(s, softcap)
    if bias is not None:
        s = s + bias
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    return s, slope


def cap(s: jax.Array, softcap: float) -> tuple[jax.Array, jax.Array]:
    """Logit soft-capping (Gemma 2): (c tanh(s / c), its derivative 1 - tanh^2(s / c))."""
    t = jnp.tanh(s / softcap)
    return softcap * t, 1.0 - t * t


def guard_row_max(m: jax.Array) -> jax.Array:
    """The empty-row guard: a row max of -inf (no visible key so far) is taken as 0."""
    return jnp.where(m == -jnp.inf, 0.0, m)


def softmax_init(shape, H):
    """(m, l, acc) before the first key tile: shape is [B, K, G, t]."""
    return jnp.full(shape, -jnp.inf, f32), jnp.zeros(shape, f32), jnp.zeros((*shape, H), f32)


def online_softmax_step(state, s, v):
    """One key tile of the online softmax: s float32[B, K, G, t, s] logits, v [B, K, s, H]."""
    m, row_sum, acc = state
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = guard_row_max(m_new)
    p = jnp.exp(s - m_safe[..., None])  # hidden keys give exactly 0
    alpha = jnp.exp(m - m_safe)
    row_sum = alpha * row_sum + jnp.sum(p, axis=-1)
    pv = _einsum("query_major", "pv", p=p.astype(v.dtype), v=v)
    return m_new, row_sum, alpha[..., None] * acc + pv


def softmax_finish(state, dtype):
    """(out in `dtype`, guarded row max m, 1 / l) from the final state; empty rows give out 0."""
    m, row_sum, acc = state
    inv_l = 1.0 / jnp.where(row_sum > 0.0, row_sum, 1.0)
    return (acc * inv_l[..., None]).astype(dtype), guard_row_max(m), inv_l


def log_sum_exp(state):
    """float32[B, K, G, t] log-sum-exp of each row's logits; +inf for an empty row (so that
    exp(s - lse) = 0 there)."""
    m, row_sum, _ = state
    seen = row_sum > 0.0
    return jnp.where(seen, m + jnp.log(jnp.where(seen, row_sum, 1.0)), jnp.inf)


# ----------------------------------------------------------------------------------------------
# Backward.


def softmax_delta(d_out: jax.Array, out: jax.Array) -> jax.Array:
    """D = rowsum(dO * O), float32 over the last (head) axis: the softmax-Jacobian term."""
    return jnp.sum(d_out.astype(f32) * out.astype(f32), axis=-1)


def softmax_delta_from_probs(layout, p, dp):
    """D = rowsum(P * dP) over one tile holding whole rows (see the module docstring); an
    einsum, where XLA:CPU's reduction over the short head-grouped axes ran about 10x slower."""
    return _einsum(layout, "delta", p=p, dp=dp)


def probabilities(layout, s, m, inv_l):
    """P = exp(s - m) / l from the forward's guarded row max and 1 / row sum."""
    return jnp.exp(s - _per_row(layout, m)) * _per_row(layout, inv_l)


def probabilities_from_lse(layout, s, lse):
    """P = exp(s - lse); an empty row (lse = +inf) gives 0."""
    return jnp.exp(s - _per_row(layout, lse))


def logit_grad(layout, p, dp, delta):
    """dS = P * (dP - D): d loss / d logits."""
    return p * (dp - _per_row(layout, delta))


def forget_grads(ds: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(d c_q, d c_k) of the forget term c_q[:, None] - c_k[None, :] from one query-major tile's
    logit gradient dS [B, K, G, t, s]: rowsum(dS) [B, K, G, t] and -colsum(dS) [B, K, G, s]."""
    return jnp.sum(ds, axis=-1), -jnp.sum(ds, axis=-2)


def tile_grads(layout, *, p, q, k, v, d_out, delta, scale, cap_slope=None, far=None):
    """One tile's (dq, dk, dv, dS) from its probabilities P, all float32. `delta`: D per query
    row, or None when the tile holds whole rows (D is then rowsum(P * dP)). `cap_slope`: the
    soft-cap's derivative at the content logits (`capped_logits`), which dq and dk pass through
    and the bias does not.

    dq is [B, K, G, t, H] in "query_major" and [B, K, H, G, t] in "key_major"; dk, dv
    [B, K, s, H]; dS in the layout of the logits (the bias gradient before any sum).

    `far`: None, or (q_far, k_far, near) as in `capped_logits`; dq and dk are then pairs
    (near, far): the near pairs' dS reaches q and k, the far pairs' q_far and k_far.
    """
    dv = _einsum(layout, "dv", p=p.astype(d_out.dtype), do=d_out)
    dp = _einsum(layout, "dp", do=d_out, v=v)
    if delta is None:
        delta = softmax_delta_from_probs(layout, p, dp)
    ds = logit_grad(layout, p, dp, delta)
    ds_c = (ds if cap_slope is None else ds * cap_slope).astype(q.dtype)
    if far is None:
        dq = scale * _einsum(layout, "dq", ds=ds_c, k=k)
        dk = scale * _einsum(layout, "dk", ds=ds_c, q=q)
        return dq, dk, dv, ds
    q_far, k_far, near = far
    zero = jnp.zeros((), ds_c.dtype)
    ds_near, ds_far = jnp.where(near, ds_c, zero), jnp.where(near, zero, ds_c)
    dq = (
        scale * _einsum(layout, "dq", ds=ds_near, k=k),
        scale * _einsum(layout, "dq", ds=ds_far, k=k_far),
    )
    dk = (
        scale * _einsum(layout, "dk", ds=ds_near, q=q),
        scale * _einsum(layout, "dk", ds=ds_far, q=q_far),
    )
    return dq, dk, dv, ds
