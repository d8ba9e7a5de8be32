"""CoPE against oracles written here: a float64 NumPy transcription of the reference layer
(facebookresearch/RAM `projects/cope`, `ContextPosSelfAttn` with gates from the keys: gates
sigmoid(q k^T / sqrt(d)) times the mask, positions by flip-cumsum-flip clamped to npos - 1, the
table's logits gathered at ceil and floor and mixed by p - floor p, then divided by sqrt(d) with
q k^T or added after it, `--cope-nodiv`), a float64 loop over each query's keys written from
the definition (offsets, padding, windows, grouped heads, decode steps), and autodiff of a
second formulation of the interpolation (hat functions over the integer positions); gates from
the keys (the reference's default), from the values (its `--cope-val-gates`) and from keys of
their own (its `--cope-sep-key`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posattn.attention import (
    attention,
    cope_attention,
    cope_positions,
    cope_weights,
)

B, T, S, N, K, H, P = 2, 13, 13, 4, 2, 8, 6


def _inputs(seed=0, T=T, S=S, K=K, spread=1.5, positions=P):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = spread * jax.random.normal(keys[0], (B, T, N, H))
    k = spread * jax.random.normal(keys[1], (B, S, K, H))
    v = jax.random.normal(keys[2], (B, S, K, H))
    table = 2.0 * jax.random.normal(keys[3], (H, positions))
    return q, k, v, table


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def reference_form(q, k, v, table, *, nodiv, gates="keys", key_cope=None):
    """The reference layer's causal forward in float64, heads folded into the batch as it does
    (T == S, no offset, no padding). `gates`: "keys" (its default), "values" (its
    `--cope-val-gates`: gates from q v^T) or "separate" (its `--cope-sep-key`: gates from q
    key_cope^T), the logits from q k^T in the last two."""
    key_cope = k if key_cope is None else key_cope
    q, k, v, key_cope = (
        np.asarray(a, np.float64).transpose(0, 2, 1, 3) for a in (q, k, v, key_cope)
    )  # (B, h, T, H)
    k, v, key_cope = (np.repeat(a, q.shape[1] // a.shape[1], axis=1) for a in (k, v, key_cope))
    q, k, v, key_cope = (a.reshape(-1, *a.shape[2:]) for a in (q, k, v, key_cope))  # (B h, T, H)
    d = q.shape[-1]
    npos = table.shape[1]
    pos_emb = np.asarray(table, np.float64)[None]  # (1, H, npos)
    mask = np.tril(np.ones((q.shape[1],) * 2))[None]
    gate_logits = q @ {"keys": k, "values": v, "separate": key_cope}[gates].transpose(0, 2, 1)
    gate_values = _sigmoid(gate_logits / np.sqrt(d)) * mask
    positions = np.flip(np.cumsum(np.flip(gate_values, -1), -1), -1)
    positions = np.minimum(positions, npos - 1)
    pos_logits_fixed = q @ pos_emb  # (B h, T, npos)
    ceil, floor = np.ceil(positions).astype(int), np.floor(positions).astype(int)
    pos_ceil = np.take_along_axis(pos_logits_fixed, ceil, -1)
    pos_floor = np.take_along_axis(pos_logits_fixed, floor, -1)
    w = positions - floor
    pos_logits = pos_ceil * w + pos_floor * (1 - w)
    attn_logits = gate_logits.copy() if gates == "keys" else q @ k.transpose(0, 2, 1)
    if nodiv:
        attn_logits = attn_logits / np.sqrt(d) + pos_logits
    else:
        attn_logits = (attn_logits + pos_logits) / np.sqrt(d)
    with np.errstate(divide="ignore"):
        attn_logits = attn_logits + np.log(mask)
    attn = np.exp(attn_logits - attn_logits.max(-1, keepdims=True))
    attn = attn / attn.sum(-1, keepdims=True)
    out = attn @ v  # (B h, T, H)
    return out.reshape(B, -1, *out.shape[1:]).transpose(0, 2, 1, 3)


def loop_oracle(q, k, v, table, *, q_offset, kv_lengths, window, scale_positions=True):
    """float64 (out [B, T, N, H], weights [B, N, T, S], positions [B, N, T, S]) from the
    definition: query i at q_offset + t counts the gates of its visible keys from j up to
    itself, reads the table at that count (interpolated, clamped) and takes a softmax."""
    q, k, v, table = (np.asarray(a, np.float64) for a in (q, k, v, table))
    b_, t_, n_, h_ = q.shape
    s_, k_ = k.shape[1], k.shape[2]
    npos = table.shape[1]
    offsets = np.broadcast_to(np.asarray(q_offset), (b_,))
    lengths = np.full(b_, s_) if kv_lengths is None else np.asarray(kv_lengths)
    weights = np.zeros((b_, n_, t_, s_))
    counts = np.zeros((b_, n_, t_, s_))
    for b in range(b_):
        for n in range(n_):
            for t in range(t_):
                i = int(offsets[b]) + t
                seen = [
                    j
                    for j in range(min(i + 1, s_))
                    if j < lengths[b] and (window is None or i - j < window)
                ]
                if not seen:
                    continue
                z = {j: q[b, t, n] @ k[b, j, n * k_ // n_] / np.sqrt(h_) for j in seen}
                logits = {}
                for j in seen:
                    p = sum(_sigmoid(z[m]) for m in seen if m >= j)
                    counts[b, n, t, j] = p
                    p = min(p, npos - 1)
                    lo, frac = int(np.floor(p)), p - np.floor(p)
                    e = (1 - frac) * (q[b, t, n] @ table[:, lo])
                    if frac:
                        e += frac * (q[b, t, n] @ table[:, lo + 1])
                    logits[j] = z[j] + (e / np.sqrt(h_) if scale_positions else e)
                top = max(logits.values())
                total = sum(np.exp(x - top) for x in logits.values())
                for j, x in logits.items():
                    weights[b, n, t, j] = np.exp(x - top) / total
    v_rep = np.repeat(v, n_ // k_, axis=2)
    return np.einsum("bnts,bsnh->btnh", weights, v_rep), weights, counts


@pytest.mark.parametrize("nodiv", [False, True])
@pytest.mark.parametrize("kv_heads", [K, N])
@pytest.mark.parametrize("positions", [P, T + 1])
@pytest.mark.parametrize("gates", ["keys", "values", "separate"])
def test_equals_the_reference_layer(nodiv, kv_heads, positions, gates):
    """P = 6 clamps the far keys' positions; P = T + 1 (the reference's default, block size + 1)
    never clamps."""
    q, k, v, table = _inputs(K=kv_heads, positions=positions)
    key_cope = 1.5 * jax.random.normal(jax.random.key(7), k.shape)
    gate_keys = {"keys": None, "values": v, "separate": key_cope}[gates]
    got = cope_attention(q, k, v, table, scale_positions=not nodiv, gate_keys=gate_keys)
    want = reference_form(q, k, v, table, nodiv=nodiv, gates=gates, key_cope=key_cope)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5)


CASES = {
    "causal": dict(q_offset=0, kv_lengths=None, window=None, T=T),
    "window": dict(q_offset=0, kv_lengths=None, window=4, T=T),
    "padded": dict(q_offset=0, kv_lengths=np.array([13, 7]), window=None, T=T),
    "decode_step": dict(q_offset=np.array([12, 6]), kv_lengths=np.array([13, 7]), window=None, T=1),
    "decode_block_window": dict(q_offset=np.array([9, 3]), kv_lengths=None, window=3, T=4),
    "scalar_offset": dict(q_offset=5, kv_lengths=None, window=None, T=8),
}


@pytest.mark.parametrize("scale_positions", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_equals_the_loop_over_each_querys_keys(case, scale_positions):
    c = CASES[case]
    q, k, v, table = _inputs(seed=1, T=c["T"])
    kw = dict(q_offset=c["q_offset"], kv_lengths=c["kv_lengths"], window=c["window"])
    want_out, want_w, want_p = loop_oracle(q, k, v, table, scale_positions=scale_positions, **kw)
    np.testing.assert_allclose(cope_positions(q, k, **kw), want_p, rtol=2e-6, atol=1e-6)
    got_w = cope_weights(q, k, table, scale_positions=scale_positions, **kw)
    np.testing.assert_allclose(got_w, want_w, rtol=2e-5, atol=1e-7)
    got = cope_attention(q, k, v, table, scale_positions=scale_positions, **kw)
    np.testing.assert_allclose(got, want_out, rtol=2e-5, atol=1e-5)
    chunked = cope_attention(q, k, v, table, scale_positions=scale_positions, query_chunk=3, **kw)
    np.testing.assert_allclose(chunked, want_out, rtol=2e-5, atol=1e-5)


def test_a_zero_table_is_softmax_attention_and_equal_gates_count_half_a_key_each():
    """The reference's initial table (zeros) gives the plain causal softmax; with every gate
    1/2 (k = 0) key j sits at (i - j + 1) / 2 for query i."""
    q, k, v, table = _inputs(seed=2)
    got = cope_attention(q, k, v, jnp.zeros_like(table))
    want = attention(q, k, v, causal=True, implementation="reference")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    p = np.asarray(cope_positions(q, jnp.zeros_like(k)))
    i, j = np.arange(T)[:, None], np.arange(S)[None, :]
    np.testing.assert_allclose(p, np.broadcast_to(np.where(j <= i, (i - j + 1) / 2, 0), p.shape))


def test_gradients_equal_the_hat_function_form():
    """Gradients of q, k, v and the table against autodiff of the interpolation written as hat
    functions: e(p) = sum_n q.e[n] max(0, 1 - |p - n|), the same values as floor/ceil mixing."""
    q, k, v, table = _inputs(seed=3, spread=1.0)
    lengths = CASES["padded"]["kv_lengths"]
    d_out = jax.random.normal(jax.random.key(9), q.shape)

    def hat_form(q, k, v, table, val_gates=False):
        k_rep, v_rep = (jnp.repeat(a, N // K, axis=2) for a in (k, v))
        z = jnp.einsum("btnh,bsnh->bnts", q, k_rep, precision="highest") / np.sqrt(H)
        gate_z = jnp.einsum("btnh,bsnh->bnts", q, v_rep, precision="highest") / np.sqrt(H)
        i, j = np.arange(T)[:, None], np.arange(S)[None, :]
        visible = (j <= i)[None, None] & (j < lengths[:, None, None, None])
        gates = jnp.where(visible, jax.nn.sigmoid(gate_z if val_gates else z), 0.0)
        upper = np.triu(np.ones((S, S)))  # p_j = sum over l >= j
        p = jnp.minimum(jnp.einsum("bntl,jl->bntj", gates, upper, precision="highest"), P - 1)
        hats = jnp.maximum(0.0, 1.0 - jnp.abs(p[..., None] - jnp.arange(P)))  # (B, N, T, S, P)
        at_int = jnp.einsum("btnh,hp->bntp", q, table, precision="highest")
        logits = z + jnp.einsum("bntsp,bntp->bnts", hats, at_int) / np.sqrt(H)
        w = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1)
        return jnp.einsum("bnts,bsnh->btnh", w, v_rep, precision="highest")

    def loss(fn, *a):
        return jnp.sum(fn(*a) * d_out)

    for val_gates, chunk in ((False, None), (False, 4), (True, 4)):

        def want_fn(q, k, v, e, val_gates=val_gates):
            return hat_form(q, k, v, e, val_gates)

        def ours_fn(q, k, v, e, val_gates=val_gates, chunk=chunk):
            gate_keys = v if val_gates else None
            return cope_attention(
                q, k, v, e, kv_lengths=lengths, query_chunk=chunk, gate_keys=gate_keys
            )

        want = jax.grad(lambda *a: loss(want_fn, *a), (0, 1, 2, 3))(q, k, v, table)
        ours = jax.grad(lambda *a: loss(ours_fn, *a), (0, 1, 2, 3))(q, k, v, table)
        for got, ref in zip(ours, want, strict=True):
            np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5)


def test_the_batched_gather_past_int32_reads_the_same(monkeypatch):
    """Past int32's range the table is read by `take_along_axis`: the same weights, gradients
    and all (the limit lowered here to take that path at test sizes)."""
    from posattn.attention import cope as cope_lib

    q, k, v, table = _inputs(seed=5)

    def run(q, k, v, table):
        return cope_attention(q, k, v, table, kv_lengths=jnp.array([13, 9]))

    flat = (run(q, k, v, table), jax.grad(lambda t: run(q, k, v, t).sum())(table))
    monkeypatch.setattr(cope_lib, "_FLAT_LIMIT", 0)
    batched = (run(q, k, v, table), jax.grad(lambda t: run(q, k, v, t).sum())(table))
    np.testing.assert_array_equal(batched[0], flat[0])
    np.testing.assert_allclose(batched[1], flat[1], rtol=1e-5, atol=1e-6)


def test_jit_vmap_bfloat16_and_a_row_that_sees_nothing():
    q, k, v, table = _inputs(seed=4)
    fn = jax.jit(lambda q, k, v: cope_attention(q, k, v, table, window=5))
    looped = jnp.stack([fn(q[b : b + 1], k[b : b + 1], v[b : b + 1])[0] for b in range(B)])
    mapped = jax.vmap(lambda q, k, v: fn(q[None], k[None], v[None])[0])(q, k, v)
    np.testing.assert_allclose(mapped, looped, rtol=1e-6, atol=1e-7)
    low = fn(*(a.astype(jnp.bfloat16) for a in (q, k, v)))
    assert low.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(low, np.float32), fn(q, k, v), atol=0.06)
    empty = cope_attention(q, k, v, table, kv_lengths=jnp.array([0, 3]))
    assert np.isfinite(np.asarray(empty)).all()
    np.testing.assert_array_equal(empty[0], 0.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(window=0), "window"),
        (dict(query_chunk=2.5), "query_chunk"),
        (dict(table=jnp.zeros((H + 1, P))), "table"),
        (dict(table=jnp.zeros((H,))), "table"),
        (dict(gate_keys=jnp.zeros((B, S, K, H + 1))), "alike"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    q, k, v, table = _inputs()
    table = kwargs.pop("table", table)
    with pytest.raises(ValueError, match=match):
        cope_attention(q, k, v, table, **kwargs)
    with pytest.raises(ValueError, match="multiple"):
        cope_attention(q[:, :, :3], k, v, table)
