"""Stick-breaking attention against two oracles written here: a float64 NumPy transcription of the
references' matrix form (shawntan/stickbreaking-attention `sb_ref.stickbreaking`, flash-linear-
attention's `naive_stickbreaking_attn`: log_sigmoid(z) plus log_sigmoid(-z) summed over the
nearer keys by a strictly lower-triangular matrix, `o + rem * v` in the reference tests), and a
float64 loop over each query's keys written from the definition (the stick broken from the
nearest visible key back), for offsets, padding, windows and grouped heads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posattn.attention import stick_breaking_attention, stick_breaking_weights

B, T, S, N, K, H = 2, 13, 13, 4, 2, 8


def _inputs(seed=0, T=T, S=S, K=K, spread=1.5):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = spread * jax.random.normal(keys[0], (B, T, N, H))
    k = spread * jax.random.normal(keys[1], (B, S, K, H))
    v = jax.random.normal(keys[2], (B, S, K, H))
    return q, k, v


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def reference_matrix_form(q, k, v, remainder):
    """The references' naive causal forward (T == S, no offset), float64: mask = triu(0),
    log_z = log_sigmoid(z) masked to -1e5, log_beta = log_sigmoid(-z) masked to 0, then
    re_cum = log_beta @ tril(ones, -1), att = exp(log_z + re_cum), o = att @ v,
    rem = 1 - att.sum(-1), and the tests' `o + rem * v`."""
    q, k, v = (np.asarray(a, np.float64).transpose(0, 2, 1, 3) for a in (q, k, v))  # (B, h, T, H)
    k, v = (np.repeat(a, q.shape[1] // a.shape[1], axis=1) for a in (k, v))
    z = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    mask = np.triu(np.ones((q.shape[2],) * 2, bool), 0)
    log_z = np.where(mask, -1e5, _log_sigmoid(z))
    log_beta = np.where(mask, 0.0, _log_sigmoid(-z))
    cum_weight = np.tril(np.ones((q.shape[2],) * 2), -1)
    att = np.exp(log_z + log_beta @ cum_weight)
    o = att @ v
    if remainder == "current":
        o = o + (1 - att.sum(-1))[..., None] * v
    return o.transpose(0, 2, 1, 3)


def loop_oracle(q, k, v, *, q_offset, kv_lengths, window, remainder, logit_bias=0.0):
    """float64 (out [B, T, N, H], weights [B, N, T, S]) from the definition: query i at
    q_offset + t walks its visible keys (j < i, j < length, i - j < window) from the nearest back,
    each taking sigmoid(z) of the stick left; the rest weights its own value ("current")."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b_, t_, n_, h_ = q.shape
    s_, k_ = k.shape[1], k.shape[2]
    offsets = np.broadcast_to(np.asarray(q_offset), (b_,))
    lengths = np.full(b_, s_) if kv_lengths is None else np.asarray(kv_lengths)
    weights = np.zeros((b_, n_, t_, s_))
    for b in range(b_):
        for n in range(n_):
            for t in range(t_):
                i = int(offsets[b]) + t
                stick = 1.0
                for j in range(i - 1, -1, -1):
                    if j >= lengths[b] or (window is not None and i - j >= window):
                        continue
                    z = q[b, t, n] @ k[b, j, n * k_ // n_] / np.sqrt(h_) + logit_bias
                    beta = 1 / (1 + np.exp(-z))
                    weights[b, n, t, j] = stick * beta
                    stick *= 1 - beta
                if remainder == "current":
                    weights[b, n, t, i] += stick
    v_rep = np.repeat(v, n_ // k_, axis=2)
    return np.einsum("bnts,bsnh->btnh", weights, v_rep), weights


@pytest.mark.parametrize("remainder", ["current", "none"])
@pytest.mark.parametrize("kv_heads", [K, N])
def test_equals_the_references_matrix_form(remainder, kv_heads):
    q, k, v = _inputs(K=kv_heads)
    got = stick_breaking_attention(q, k, v, remainder=remainder)
    want = reference_matrix_form(q, k, v, remainder)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


CASES = {
    "causal": dict(q_offset=0, kv_lengths=None, window=None, T=T),
    "window": dict(q_offset=0, kv_lengths=None, window=4, T=T),
    "padded": dict(q_offset=0, kv_lengths=np.array([13, 7]), window=None, T=T),
    "decode_step": dict(q_offset=np.array([12, 6]), kv_lengths=np.array([13, 7]), window=None, T=1),
    "decode_block_window": dict(q_offset=np.array([9, 3]), kv_lengths=None, window=3, T=4),
    "scalar_offset": dict(q_offset=5, kv_lengths=None, window=None, T=8),
    "logit_bias": dict(q_offset=0, kv_lengths=np.array([13, 9]), window=None, T=T, logit_bias=-3.0),
}


@pytest.mark.parametrize("remainder", ["current", "none"])
@pytest.mark.parametrize("case", CASES)
def test_equals_the_loop_over_each_querys_keys(case, remainder):
    c = CASES[case]
    q, k, v = _inputs(seed=1, T=c["T"])
    kw = dict(q_offset=c["q_offset"], kv_lengths=c["kv_lengths"], window=c["window"])
    if "logit_bias" in c:
        kw["logit_bias"] = c["logit_bias"]
    want_out, want_w = loop_oracle(q, k, v, remainder=remainder, **kw)
    got_w = stick_breaking_weights(q, k, remainder=remainder, **kw)
    np.testing.assert_allclose(got_w, want_w, rtol=2e-5, atol=1e-7)
    got = stick_breaking_attention(q, k, v, remainder=remainder, **kw)
    np.testing.assert_allclose(got, want_out, rtol=2e-5, atol=2e-6)
    # query blocks of 3: each reads only the keys it can see (a static offset) or all of them
    chunked = stick_breaking_attention(q, k, v, remainder=remainder, query_chunk=3, **kw)
    np.testing.assert_allclose(chunked, want_out, rtol=2e-5, atol=2e-6)


def test_rows_sum_to_one_and_the_first_query_reads_its_own_value():
    q, k, v = _inputs(seed=2)
    w = stick_breaking_weights(q, k)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
    out = stick_breaking_attention(q, k, v)
    np.testing.assert_allclose(out[:, 0], jnp.repeat(v[:, 0], N // K, axis=1), rtol=1e-6)
    none = stick_breaking_attention(q, k, v, remainder="none")
    np.testing.assert_array_equal(none[:, 0], 0.0)


def test_equal_logits_give_geometric_weights_nearest_first():
    """With every z = 0 each key takes half of what is left: 1/2, 1/4, ... from the nearest."""
    q = jnp.zeros((1, 6, 1, 4))
    k = jnp.ones((1, 6, 1, 4))
    w = np.asarray(stick_breaking_weights(q, k, remainder="none"))[0, 0, 5]
    np.testing.assert_allclose(w, [1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 0.0], rtol=1e-6)


def test_gradients_equal_the_product_forms():
    """Gradients of q, k, v against autodiff of the definition written as a cumulative product
    (the nearer keys' 1 - beta multiplied, not summed in log space)."""
    q, k, v = _inputs(seed=3, spread=1.0)
    c = CASES["padded"]
    d_out = jax.random.normal(jax.random.key(9), q.shape)

    def product_form(q, k, v):
        k_rep, v_rep = (jnp.repeat(a, N // K, axis=2) for a in (k, v))
        z = jnp.einsum("btnh,bsnh->bnts", q, k_rep, precision="highest") / np.sqrt(H)
        i, j = np.arange(T)[:, None], np.arange(S)[None, :]
        visible = (j < i)[None, None] & (j < c["kv_lengths"][:, None, None, None])
        keep = jnp.where(visible, jax.nn.sigmoid(-z), 1.0)
        # prod over l > j of keep: an exclusive reverse cumulative product
        after = jnp.flip(jnp.cumprod(jnp.flip(keep, -1), -1), -1) / keep
        w = jnp.where(visible, jax.nn.sigmoid(z) * after, 0.0)
        w = w + jnp.eye(T, S)[None, None] * jnp.prod(keep, -1, keepdims=True)
        return jnp.einsum("bnts,bsnh->btnh", w, v_rep, precision="highest")

    def loss(fn, *a):
        return jnp.sum(fn(*a) * d_out)

    ours = jax.grad(
        lambda *a: loss(
            lambda q, k, v: stick_breaking_attention(q, k, v, kv_lengths=c["kv_lengths"]), *a
        ),
        (0, 1, 2),
    )(q, k, v)
    want = jax.grad(lambda *a: loss(product_form, *a), (0, 1, 2))(q, k, v)
    for got, ref in zip(ours, want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5)
    chunked = jax.grad(
        lambda *a: loss(
            lambda q, k, v: stick_breaking_attention(
                q, k, v, kv_lengths=c["kv_lengths"], query_chunk=4
            ),
            *a,
        ),
        (0, 1, 2),
    )(q, k, v)
    for got, ref in zip(chunked, want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5)


def test_jit_vmap_and_bfloat16():
    q, k, v = _inputs(seed=4)
    fn = jax.jit(lambda q, k, v: stick_breaking_attention(q, k, v, window=5))
    looped = jnp.stack([fn(q[b : b + 1], k[b : b + 1], v[b : b + 1])[0] for b in range(B)])
    mapped = jax.vmap(lambda q, k, v: fn(q[None], k[None], v[None])[0])(q, k, v)
    np.testing.assert_allclose(mapped, looped, rtol=1e-6, atol=1e-7)
    low = fn(*(a.astype(jnp.bfloat16) for a in (q, k, v)))
    assert low.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(low, np.float32), fn(q, k, v), atol=0.06)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(remainder="value"), "remainder"),
        (dict(window=0), "window"),
        (dict(query_chunk=2.5), "query_chunk"),
        (dict(logit_bias=float("nan")), "logit_bias"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=match):
        stick_breaking_attention(q, k, v, **kwargs)
    with pytest.raises(ValueError, match="multiple"):
        stick_breaking_attention(q[:, :, :3], k, v)
