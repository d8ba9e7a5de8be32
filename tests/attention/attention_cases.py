"""Shared inputs of the kernel tests (test_blockwise.py, test_chunked.py, test_window_forget.py):
small local bias functions standing in for the families (ALiBi-like, T5-like table, FIRE-like MLP),
so that these tests do not depend on `posattn.positions`, a grid of masking cases with ragged
lengths, the comparison against the reference (forward and every gradient: q, k, v, bias params,
log_forget), and an oracle for sliding windows and forgetting attention written from their
definitions (`oracle_attention`), independent of `posattn.attention.masks`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from posattn.attention import attention
from posattn.attention.blockwise import blockwise_attention

B, T, S, N, H = 2, 37, 45, 4, 8
TILES = dict(block_q=16, block_k=8)


def alibi_like(slopes, q_pos, k_pos):
    """-slope * (i - j): float32[N, t, s]."""
    return -slopes[:, None, None] * (q_pos[:, None] - k_pos[None, :]).astype(jnp.float32)


def t5_like(params, q_pos, k_pos):
    """A learned table gathered by a log-spaced bucket of the signed offset (bidirectional)."""
    table, max_distance = params["table"], params["max_distance"]  # (N, 16), int
    offset = q_pos[:, None] - k_pos[None, :]  # (t, s)
    n = jnp.abs(offset)
    far = 4 + (jnp.log(jnp.maximum(n, 1) / 4.0) / jnp.log(max_distance / 4.0) * 4).astype(jnp.int32)
    bucket = jnp.where(n < 4, n, jnp.minimum(far, 7)) + 8 * (offset < 0)  # (t, s) in [0, 16)
    return table[:, bucket]  # (N, t, s)


def fire_like(params, q_pos, k_pos):
    """An MLP (1 -> 8 -> N) of psi(i - j) / psi(max(L, i)), psi(x) = log(c x + 1)."""
    c, L = params["c"], params["L"]

    def psi(x):
        return jnp.log(c * x + 1.0)

    i = q_pos[:, None].astype(jnp.float32)
    dist = jnp.abs(q_pos[:, None] - k_pos[None, :]).astype(jnp.float32)
    x = psi(dist) / psi(jnp.maximum(L, i))  # (t, s)
    hidden = jax.nn.relu(x[..., None] * params["w1"] + params["b1"])  # (t, s, 8)
    return jnp.einsum("tsf,fn->nts", hidden, params["w2"])  # (N, t, s)


def _bias(kind, key):
    k1, k2, k3 = jax.random.split(key, 3)
    match kind:
        case "none":
            return None
        case "array":
            return jax.random.normal(k1, (N, T, S))
        case "alibi":
            return (alibi_like, jnp.array([0.5, 0.25, 0.125, 0.0625]))
        case "t5":
            return (
                t5_like,
                {"table": jax.random.normal(k1, (N, 16)), "max_distance": jnp.int32(64)},
            )
        case "fire":
            return (
                fire_like,
                {
                    "c": jnp.float32(1.5),
                    "L": jnp.float32(40.0),
                    "w1": jax.random.normal(k1, (8,)),
                    "b1": jax.random.normal(k2, (8,)) * 0.1,
                    "w2": jax.random.normal(k3, (8, N)) * 0.5,
                },
            )


def _inputs(K, key, dtype=jnp.float32, T=T, S=S):
    kq, kk, kv, kd = jax.random.split(key, 4)
    q = jax.random.normal(kq, (B, T, N, H), dtype)
    k = jax.random.normal(kk, (B, S, K, H), dtype)
    v = jax.random.normal(kv, (B, S, K, H), dtype)
    d_out = jax.random.normal(kd, (B, T, N, H), dtype)
    return q, k, v, d_out


def _value_and_grads(impl, q, k, v, d_out, bias, **kw):
    """Output and d<out, d_out>/d(q, k, v, bias[, log_forget]) for one implementation, jitted.

    impl: an implementation name, "blockwise" with the small TILES, or "oracle"
    (`oracle_attention`). A `log_forget` keyword is differentiated too (a fifth gradient).
    """
    fn, params = bias if isinstance(bias, tuple) else (None, bias)
    log_forget = kw.pop("log_forget", None)

    def run(q, k, v, params, log_forget):
        b = params if fn is None else (fn, params)
        if log_forget is not None:
            kw["log_forget"] = log_forget
        if impl == "blockwise":
            return blockwise_attention(q, k, v, bias=b, **TILES, **kw)
        if impl == "oracle":
            return oracle_attention(q, k, v, bias=b, **kw)
        return attention(q, k, v, bias=b, implementation=impl, **kw)

    def loss(q, k, v, params, log_forget):
        out = run(q, k, v, params, log_forget)
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)), out

    argnums = (0, 1, 2, 3) if log_forget is None else (0, 1, 2, 3, 4)
    grads, out = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True, allow_int=True))(
        q, k, v, params, log_forget
    )
    return out, grads


# The bias parameters' gradients (grads[3] of `_value_and_grads`) sum a term per (query, key)
# pair, ~10^4 here, and some of their components are zero up to rounding: where a parameter moves
# a whole row's logits alike (a FIRE unit active for every key of the row: d b1 = w2 * sum of the
# row's ds), the softmax's row sums cancel the terms exactly, and what is left is float32
# rounding of the sum of their magnitudes, in an order that differs between implementations and
# with XLA:CPU's code for the CPU. Measured on an AVX-512 "AMD EPYC" (family 25, model 17) with the
# suite's code generation: FIRE's d b1 in the "padding" case within 1.03e-5 of the vector's largest
# component for blockwise, 4-7e-6 for the others. These leaves get PARAMS_RTOL.
PARAMS_RTOL = 3e-5


def _assert_close(got, want, rtol, atol=1e-7, name=""):
    """Every array within rtol of the largest magnitude of its reference counterpart (plus a
    small atol for scalar parameter gradients that are sums of cancelling terms); the bias
    parameters' gradients of an (out, grads) pair within max(rtol, PARAMS_RTOL)."""
    params = (jax.tree_util.SequenceKey(1), jax.tree_util.SequenceKey(3))
    for path, g, w in zip(
        jax.tree_util.tree_leaves_with_path(want),
        jax.tree.leaves(got),
        jax.tree.leaves(want),
        strict=True,
    ):
        if w.dtype == jax.dtypes.float0:
            continue
        tol = max(rtol, PARAMS_RTOL) if tuple(path[0][:2]) == params else rtol
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.isfinite(g).all(), f"{name}{jax.tree_util.keystr(path[0])}: non-finite"
        err = np.max(np.abs(g - w)) if w.size else 0.0
        assert err <= tol * np.max(np.abs(w), initial=0.0) + atol, (
            f"{name}{jax.tree_util.keystr(path[0])}: max error {err:.3g}, "
            f"reference scale {np.max(np.abs(w)):.3g}"
        )


CASES = {
    # name: (K, attention keywords)
    "plain_mha": (4, dict()),
    "causal_gqa": (2, dict(causal=True)),
    "causal_mqa_offset": (1, dict(causal=True, q_offset=5)),
    "causal_per_batch_offset": (2, dict(causal=True, q_offset=np.array([0, 8], np.int32))),
    "padding": (2, dict(kv_lengths=np.array([45, 19], np.int32))),
    "fully_masked_rows": (
        2,
        dict(
            causal=True,
            q_offset=np.array([-20, 3], np.int32),
            kv_lengths=np.array([30, 0], np.int32),
        ),
    ),
}


# Every case with a BiasFn (per-row positions, parameter gradients); the materialised bias, no
# bias and the other families (the same code path with other parameters) on a covering subset.
GRID = [("alibi", c) for c in CASES] + [
    ("array", "plain_mha"),
    ("array", "causal_per_batch_offset"),
    ("array", "fully_masked_rows"),
    ("none", "plain_mha"),
    ("none", "causal_mqa_offset"),
    ("none", "padding"),
    ("t5", "causal_gqa"),
    ("t5", "fully_masked_rows"),
    ("fire", "causal_per_batch_offset"),
    ("fire", "padding"),
]


@functools.cache
def _reference_case(bias_kind, case):
    """Inputs, bias, keywords and the reference's output and gradients of one grid point."""
    K, kw = CASES[case]
    key = jax.random.key(GRID.index((bias_kind, case)))
    q, k, v, d_out = _inputs(K, key)
    bias = _bias(bias_kind, jax.random.fold_in(key, 1))
    return (q, k, v, d_out), bias, kw, _value_and_grads("reference", q, k, v, d_out, bias, **kw)


def check_decode_step(impl):
    """One query per row at a per-row position (KV-cache decoding), under jit and vmap, with a
    traced scale whose gradient flows."""
    key = jax.random.key(9)
    q, k, v, _ = _inputs(2, key, T=1)
    bias = _bias("fire", key)
    step = jnp.array([44, 20], jnp.int32)
    kw = dict(causal=True, q_offset=step, kv_lengths=step + 1)

    def attend(q, k, v, **kw):
        if impl == "blockwise":
            return blockwise_attention(q, k, v, bias=bias, **kw, **TILES)
        return attention(q, k, v, bias=bias, implementation=impl, **kw)

    got = jax.jit(
        lambda q, k, v, step: attend(q, k, v, causal=True, q_offset=step, kv_lengths=step + 1)
    )(q, k, v, step)
    _assert_close(got, attention(q, k, v, bias=bias, implementation="reference", **kw), rtol=1e-5)
    # kv_lengths = step + 1 hides exactly what causal hides, so each row alone must agree.
    per_row = jax.vmap(
        lambda q, k, v, s: attend(q[None], k[None], v[None], causal=True, q_offset=s)[0]
    )(q, k, v, step)
    _assert_close(per_row, got, rtol=1e-6)
    d_scale = [
        jax.grad(lambda s, name=name: attention(q, k, v, scale=s, implementation=name, **kw).sum())(
            0.3
        )
        for name in (impl, "reference")
    ]
    _assert_close(d_scale[0], d_scale[1], rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# Sliding windows and forgetting attention: the oracle and its grid.


def oracle_attention(
    q,
    k,
    v,
    *,
    bias=None,
    causal=False,
    q_offset=0,
    kv_lengths=None,
    scale=None,
    window=None,
    log_forget=None,
    softcap=None,
    far=None,
):
    """The definitions written out densely in float32 (differentiable), with no code shared with
    `posattn.attention`: logits scale q.k (or softcap * tanh(scale q.k / softcap), Gemma 2's
    `attn_logit_softcapping`) + bias, plus the forget term
    sum_{l=j+1..i} log_forget[b, l, h] as an explicit masked sum (not a cumulative sum); key j is
    visible to query i iff (j <= i if causal), (i - j < window, and j - i < window if not causal),
    j < kv_lengths[b]; softmax over the visible keys, a row with none gives zeros. `far`
    (q_far, k_far, w): the pairs with i - j >= w (|i - j| >= w if not causal) score
    scale q_far.k_far instead of scale q.k."""
    Bq, Tq, Nq, Hq = q.shape
    Sk, Kk = k.shape[1], k.shape[2]
    G = Nq // Kk
    scale = 1.0 / np.sqrt(Hq) if scale is None else scale
    f32 = jnp.float32
    kr = jnp.repeat(k.astype(f32), G, axis=2)  # (B, S, N, H)
    vr = jnp.repeat(v.astype(f32), G, axis=2)
    hi = jax.lax.Precision.HIGHEST
    logits = scale * jnp.einsum("btnh,bsnh->bnts", q.astype(f32), kr, precision=hi)
    i = jnp.broadcast_to(jnp.asarray(q_offset), (Bq,))[:, None] + jnp.arange(Tq)  # (B, T)
    j = jnp.arange(Sk)
    if far is not None:
        q_far, k_far, w = far
        k_far = jnp.repeat(k_far.astype(f32), G, axis=2)
        far_logits = scale * jnp.einsum("btnh,bsnh->bnts", q_far.astype(f32), k_far, precision=hi)
        gap = i[:, :, None] - j[None, None, :]  # (B, T, S)
        is_far = (gap >= w) if causal else (jnp.abs(gap) >= w)
        logits = jnp.where(is_far[:, None], far_logits, logits)
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    if bias is not None:
        if isinstance(bias, tuple):
            logits = logits + jnp.stack([bias[0](bias[1], i[b], j) for b in range(Bq)])
        else:
            logits = logits + bias[None]
    if log_forget is not None:
        l_pos = jnp.arange(Sk)
        between = (j[None, None, :, None] < l_pos) & (l_pos <= i[:, :, None, None])  # (B,T,S,L)
        logits = logits + jnp.einsum(
            "btsl,blh->bhts", between.astype(f32), log_forget.astype(f32), precision=hi
        )
    d = i[:, :, None] - j[None, None, :]  # (B, T, S): i - j
    seen = jnp.ones(d.shape, bool)
    if causal:
        seen &= d >= 0
    if window is not None:
        seen &= d < window
        if not causal:
            seen &= -d < window
    if kv_lengths is not None:
        seen &= j[None, None, :] < jnp.asarray(kv_lengths)[:, None, None]
    seen = seen[:, None]  # (B, 1, T, S)
    m = jax.lax.stop_gradient(jnp.max(jnp.where(seen, logits, -1e30), axis=-1, keepdims=True))
    e = jnp.where(seen, jnp.exp(jnp.where(seen, logits - m, 0.0)), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(denom > 0, denom, 1.0)
    return jnp.einsum("bnts,bsnh->btnh", p, vr, precision=hi).astype(q.dtype)


def log_forget_gates(key, B=B, S=S, N=N, dtype=jnp.float32):
    """log(sigmoid(x)) forget gates, float[B, S, N], mostly near 0 (as a trained FoX's are) with
    some strongly forgetting ones."""
    return jax.nn.log_sigmoid(2.0 + 2.0 * jax.random.normal(key, (B, S, N))).astype(dtype)


WINDOW_CASES = {
    # name: (K, T, attention keywords); "forget" adds log_forget gates
    "window_causal_gqa_ragged_per_row_offset": (
        2,
        T,
        dict(
            causal=True,
            window=9,
            q_offset=np.array([0, 8], np.int32),
            kv_lengths=np.array([45, 19], np.int32),
        ),
    ),
    "window_bidirectional_mqa": (1, T, dict(window=5)),
    "forget_gqa": (2, T, dict(causal=True, forget=True)),
    # a window past S hides nothing more than the causal mask
    "forget_window_past_S_scalar_offset_mha": (
        4,
        T,
        dict(causal=True, window=64, q_offset=8, forget=True),
    ),
    "forget_window_decode_block_mqa": (
        1,
        5,
        dict(
            causal=True,
            window=6,
            q_offset=np.array([40, 12], np.int32),
            kv_lengths=np.array([45, 17], np.int32),
            forget=True,
        ),
    ),
    # a window of 1 (each query its own key), and rows that see no key at all
    "forget_window_one_empty_rows": (
        2,
        T,
        dict(
            causal=True,
            window=1,
            q_offset=np.array([-20, 3], np.int32),
            kv_lengths=np.array([30, 0], np.int32),
            forget=True,
        ),
    ),
}

# Every case with the ALiBi-like BiasFn (parameter gradients) but one with a materialised bias;
# no bias once.
WINDOW_GRID = [
    ("alibi", "window_causal_gqa_ragged_per_row_offset"),
    ("alibi", "window_bidirectional_mqa"),
    ("none", "forget_gqa"),
    ("array", "forget_window_past_S_scalar_offset_mha"),
    ("alibi", "forget_window_decode_block_mqa"),
    ("alibi", "forget_window_one_empty_rows"),
]


def grid_case(bias_kind, case, seed):
    """(q, k, v, d_out), bias, keywords of a point (bias kind, case of CASES or WINDOW_CASES);
    a case of CASES draws its inputs from key `seed` + its index."""
    if case in WINDOW_CASES:
        return window_case(bias_kind, case)
    K, kw = CASES[case]
    key = jax.random.key(seed + list(CASES).index(case))
    return _inputs(K, key), _bias(bias_kind, jax.random.fold_in(key, 1)), dict(kw)


def window_case(bias_kind, case, dtype=jnp.float32):
    """(q, k, v, d_out), bias, keywords (log_forget included) of one WINDOW_GRID point."""
    K, t, kw = WINDOW_CASES[case]
    kw = dict(kw)
    key = jax.random.key(100 + list(WINDOW_CASES).index(case))
    inputs = _inputs(K, key, dtype, T=t)
    bias = _bias(bias_kind, jax.random.fold_in(key, 1))
    if bias_kind == "array":
        bias = bias[:, :t]
    if kw.pop("forget", False):
        kw["log_forget"] = log_forget_gates(jax.random.fold_in(key, 2), dtype=dtype)
    return inputs, bias, kw


@functools.cache
def _oracle_case(bias_kind, case):
    """The oracle's output and gradients at one WINDOW_GRID point (float32)."""
    inputs, bias, kw = window_case(bias_kind, case)
    return _value_and_grads("oracle", *inputs, bias, **kw)
