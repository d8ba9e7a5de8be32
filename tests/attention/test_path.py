"""PaTH attention (`posattn.attention.path_attention`) against two float64 forms of the
reference: a transcription of the chunked algorithm that fla-org/flash-linear-attention's tests
check their kernel against (`tests/ops/test_path_attn.py::naive_path_attn`: a UT transform per
chunk, queries carried back chunk by chunk), and the definition itself (each key moved through
the reflections H_{j+1} .. H_i one by one). Then the masks, the decode identity (a cache of keys
moved on by one reflection per step, read by the softmax core), gradients against autodiff of
the definition, and the refusals."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from path_reference import naive_chunked

from posattn.attention import (
    attention,
    path_attention,
    path_extend_keys,
    path_keys,
    path_update_keys,
    path_weights,
)

jax.config.update("jax_default_matmul_precision", "highest")

# The functions under test, compiled: called eagerly, each of their few hundred operations is
# compiled on its own, several times the time of compiling one program.
# test_jit_vmap_and_bfloat16 keeps the eager calls.
compiled = types.SimpleNamespace(
    path_attention=jax.jit(path_attention, static_argnames=("scale", "window", "chunk")),
    path_weights=jax.jit(path_weights, static_argnames=("scale", "window", "chunk")),
    path_keys=jax.jit(path_keys),
    path_update_keys=jax.jit(path_update_keys),
    path_extend_keys=jax.jit(path_extend_keys),
    attention=jax.jit(attention, static_argnames=("causal", "window", "implementation")),
)


def _inputs(B=2, T=9, N=4, K=2, H=8, seed=0, forget=False):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, N, H))
    k = rng.standard_normal((B, T, K, H))
    v = rng.standard_normal((B, T, K, H))
    w = rng.standard_normal((B, T, K, H))
    w /= np.linalg.norm(w, axis=-1, keepdims=True)
    beta = rng.uniform(0.2, 1.9, (B, T, K))
    g = np.log(rng.uniform(0.8, 1.0, (B, T, N))) if forget else np.zeros((B, T, N))
    return q, k, v, w, beta, g


def definition_logits(q, k, w, beta, g, scale, q_offset=0, length=None):
    """float64[B, N, T, S]: scale (q_i . H_i ... H_{j+1} k_j + c_i - c_j), every pair, by moving
    each key through the reflections one at a time (NaN above the diagonal); a padded position's
    reflection (s >= length) is not applied, as documented."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    c = np.cumsum(g, axis=1)
    out = np.full((B, N, T, S), np.nan)
    for b in range(B):
        for n in range(N):
            kh = n // G
            for t in range(T):
                i = q_offset + t
                for j in range(min(i, S - 1) + 1):
                    x = k[b, j, kh].copy()
                    for s in range(j + 1, min(i + 1, length or S)):
                        x = x - beta[b, s, kh] * (w[b, s, kh] @ x) * w[b, s, kh]
                    out[b, n, t, j] = scale * (q[b, t, n] @ x + c[b, i, n] - c[b, j, n])
    return out


def _softmax_rows(logits, visible):
    z = np.where(visible, logits, -np.inf)
    top = np.max(z, axis=-1, keepdims=True)
    e = np.where(visible, np.exp(z - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = e.sum(-1, keepdims=True)
    return e / np.where(total > 0, total, 1.0)


def _f32(*xs):
    return [jnp.asarray(x, jnp.float32) for x in xs]


@pytest.mark.parametrize(
    "shape, forget, chunk, ours",
    [
        (dict(B=2, T=9, N=4, K=2, H=8), False, 4, 64),  # GQA, a ragged last chunk; ours: one
        (dict(B=2, T=9, N=4, K=2, H=8), False, 4, 2),  # ours in five chunks, the last padded
        (dict(B=1, T=12, N=2, K=2, H=16), True, 4, 4),  # PaTH-FoX, both in three chunks
        (dict(B=2, T=7, N=3, K=1, H=8), True, 8, 3),  # MQA
    ],
)
def test_equals_the_references_chunked_naive_form(shape, forget, chunk, ours):
    q, k, v, w, beta, g = _inputs(**shape, forget=forget)
    scale = shape["H"] ** -0.5
    want = naive_chunked(q, k, v, w, beta, g, scale, chunk)
    got = compiled.path_attention(
        *_f32(q, k, v, w, beta), log_forget=jnp.asarray(g, jnp.float32), chunk=ours
    )
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_the_chunked_form_and_the_definition_agree_in_float64():
    """The two float64 references are one function (a check of the transcription itself)."""
    q, k, v, w, beta, g = _inputs(B=1, T=10, N=2, K=1, H=4, seed=3, forget=True)
    scale = 0.5
    logits = definition_logits(q, k, w, beta, g, scale)
    T = q.shape[1]
    weights = _softmax_rows(logits, np.tril(np.ones((T, T), bool)))
    want = np.einsum("bnts,bsnh->btnh", weights, np.repeat(v, 2, axis=2))
    np.testing.assert_allclose(naive_chunked(q, k, v, w, beta, g, scale, 4), want, atol=1e-12)


CASES = {
    "offset_window": dict(T=5, S=11, q_offset=6, kv_lengths=None, window=4),
    "padding": dict(T=9, S=9, q_offset=0, kv_lengths=[9, 5], window=None),
    "per_row_offset": dict(T=3, S=10, q_offset=[7, 2], kv_lengths=[10, 6], window=3),
    "decode_row": dict(T=1, S=8, q_offset=[7, 4], kv_lengths=[8, 5], window=None),
}


@pytest.mark.parametrize("chunk", [64, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_weights_equal_the_definition_with_offsets_padding_and_windows(case, chunk):
    c = CASES[case]
    B, N, K, H = 2, 4, 2, 8
    rng = np.random.default_rng(7)
    q = rng.standard_normal((B, c["T"], N, H))
    _, k, _, w, beta, g = _inputs(B=B, T=c["S"], N=N, K=K, H=H, seed=8, forget=True)
    scale = 0.3
    lengths = None if c["kv_lengths"] is None else np.asarray(c["kv_lengths"])
    offset = np.broadcast_to(np.asarray(c["q_offset"]), (B,))
    got = compiled.path_weights(
        *_f32(q, k, w, beta),
        q_offset=jnp.asarray(c["q_offset"]),
        kv_lengths=None if lengths is None else jnp.asarray(lengths),
        scale=scale,
        window=c["window"],
        log_forget=jnp.asarray(g, jnp.float32),
        chunk=chunk,
    )
    for b in range(B):
        logits = definition_logits(q[b : b + 1], k[b : b + 1], w[b : b + 1], beta[b : b + 1],
                                   g[b : b + 1], scale, q_offset=int(offset[b]),
                                   length=None if lengths is None else int(lengths[b]))  # fmt: skip
        i = offset[b] + np.arange(c["T"])[:, None]
        j = np.arange(c["S"])[None, :]
        visible = j <= i
        if lengths is not None:
            visible &= j < lengths[b]
        if c["window"] is not None:
            visible &= i - j < c["window"]
        want = _softmax_rows(np.nan_to_num(logits[0]), visible[None])
        np.testing.assert_allclose(np.asarray(got[b]), want, rtol=1e-5, atol=1e-6)


def test_a_padded_rows_reflections_are_not_applied():
    """Valid queries of a padded row equal the same row unpadded (cut to its length), and the
    keys `path_keys` leaves are those of the unpadded row's last position."""
    q, k, v, w, beta, _ = _f32(*_inputs(B=2, T=10, N=2, K=2, H=8, seed=4))
    lengths = jnp.asarray([10, 6])
    full = compiled.path_attention(q, k, v, w, beta, kv_lengths=lengths)
    alone = compiled.path_attention(q[1:, :6], k[1:, :6], v[1:, :6], w[1:, :6], beta[1:, :6])
    np.testing.assert_allclose(np.asarray(full[1, :6]), np.asarray(alone[0]), atol=2e-6)
    keys = compiled.path_keys(k, w, beta, kv_lengths=lengths)
    keys_alone = compiled.path_keys(k[1:, :6], w[1:, :6], beta[1:, :6])
    np.testing.assert_allclose(np.asarray(keys[1, :6]), np.asarray(keys_alone[0]), atol=2e-6)
    np.testing.assert_array_equal(np.asarray(keys[1, 6:]), np.asarray(k[1, 6:]))


@pytest.mark.parametrize("prefill", [0, 5])
def test_decoding_by_a_moved_key_cache_and_the_softmax_core_is_the_full_forward(prefill):
    """The cache route: keys as seen from position p - 1 (`path_keys` after a prefill), moved on
    by H_p (`path_update_keys`), key p written, read by `attention` with the forget term scaled:
    every step equals the full forward's row p."""
    B, S, N, K, H = 2, 11, 4, 2, 8
    q, k, v, w, beta, g = _f32(*_inputs(B=B, T=S, N=N, K=K, H=H, seed=5, forget=True))
    scale = H**-0.5
    full = compiled.path_attention(q, k, v, w, beta, log_forget=g, window=6)
    cache = jnp.zeros_like(k)
    if prefill:
        cache = cache.at[:, :prefill].set(
            compiled.path_keys(k[:, :prefill], w[:, :prefill], beta[:, :prefill])
        )
    for p in range(prefill, S):
        cache = compiled.path_update_keys(cache, w[:, p], beta[:, p], p).at[:, p].set(k[:, p])
        out = compiled.attention(
            q[:, p : p + 1],
            cache,
            v,
            causal=True,
            q_offset=p,
            kv_lengths=jnp.full((B,), p + 1),
            log_forget=scale * g,
            window=6,
            implementation="reference",
        )
        np.testing.assert_allclose(np.asarray(out[:, 0]), np.asarray(full[:, p]), atol=3e-6)


def test_per_row_decode_positions_move_only_each_rows_earlier_keys():
    _, k, _, w, beta, _ = _f32(*_inputs(B=2, T=6, N=2, K=2, H=4, seed=6))
    moved = compiled.path_update_keys(k, w[:, 0], beta[:, 0], jnp.asarray([4, 1]))
    np.testing.assert_array_equal(np.asarray(moved[0, 4:]), np.asarray(k[0, 4:]))
    np.testing.assert_array_equal(np.asarray(moved[1, 1:]), np.asarray(k[1, 1:]))
    assert not np.allclose(np.asarray(moved[0, :4]), np.asarray(k[0, :4]))


def test_a_chunk_moves_a_prefix_cache_to_the_whole_sequences_keys():
    """path_extend_keys from the prefix's cache (per-row prefix lengths, the chunk's rows as
    projected) equals path_keys of the whole sequence; a padded position's reflection (at or
    past kv_lengths) is skipped, and T steps of it are path_update_keys T times."""
    _, k, _, w, beta, _ = _f32(*_inputs(B=2, T=10, N=2, K=2, H=4, seed=12))
    p, T, lengths = jnp.asarray([3, 5]), 4, jnp.asarray([7, 8])  # row 1: its last chunk row pads
    prefix = jnp.stack(
        [
            compiled.path_keys(k[b : b + 1], w[b : b + 1], beta[b : b + 1], kv_lengths=p[b])[0]
            for b in range(2)
        ]
    )
    rows = p[:, None] + jnp.arange(T)  # (B, T)
    cache = prefix.at[jnp.arange(2)[:, None], rows].set(k[jnp.arange(2)[:, None], rows])
    take = jnp.arange(2)[:, None]
    got = compiled.path_extend_keys(cache, w[take, rows], beta[take, rows], p, kv_lengths=lengths)
    want = compiled.path_keys(k, w, beta, kv_lengths=lengths)
    for b in range(2):  # the rows the sequence holds
        np.testing.assert_allclose(
            np.asarray(got[b, : int(lengths[b])]),
            np.asarray(want[b, : int(lengths[b])]),
            atol=2e-6,
        )
    stepped = cache
    for t in range(T):
        stepped = compiled.path_update_keys(
            stepped, w[take, rows][:, t], beta[take, rows][:, t], p + t
        )
    np.testing.assert_allclose(
        np.asarray(compiled.path_extend_keys(cache, w[take, rows], beta[take, rows], p)),
        np.asarray(stepped),
        atol=1e-6,
    )


def test_no_reflection_is_nope_attention_and_a_reflection_changes_the_scores():
    q, k, v, w, beta, _ = _f32(*_inputs(B=1, T=8, N=2, K=2, H=8, seed=9))
    nope = compiled.attention(q, k, v, causal=True, implementation="reference")
    none = compiled.path_attention(q, k, v, w, jnp.zeros_like(beta))
    np.testing.assert_allclose(np.asarray(none), np.asarray(nope), atol=2e-6)
    assert not np.allclose(np.asarray(compiled.path_attention(q, k, v, w, beta)), np.asarray(nope))


def _definition_jnp(q, k, v, w, beta, g, scale):
    """The definition in jnp, unrolled (a second formulation for the gradients)."""
    B, T, N, H = q.shape
    G = N // k.shape[2]
    c = jnp.cumsum(g, axis=1)
    rows = []
    for i in range(T):
        cols = []
        for j in range(T):
            if j > i:
                cols.append(jnp.full((B, N), -jnp.inf))
                continue
            x = jnp.repeat(k[:, j], G, axis=1)  # (B, N, H)
            for s in range(j + 1, i + 1):
                ws, bs = jnp.repeat(w[:, s], G, axis=1), jnp.repeat(beta[:, s], G, axis=1)
                x = x - (bs * jnp.sum(ws * x, -1))[..., None] * ws
            cols.append(scale * (jnp.sum(q[:, i] * x, -1) + c[:, i] - c[:, j]))
        rows.append(jnp.stack(cols, -1))  # (B, N, S)
    weights = jax.nn.softmax(jnp.stack(rows, 2), axis=-1)  # (B, N, T, S)
    return jnp.einsum("bnts,bsnh->btnh", weights, jnp.repeat(v, G, axis=2))


def test_gradients_of_every_input_equal_autodiff_of_the_definition():
    """In one chunk and in chunks of 2 (the scan between chunks and the inverse's own
    gradient)."""
    q, k, v, w, beta, g = _f32(*_inputs(B=1, T=7, N=4, K=2, H=4, seed=11, forget=True))
    ct = jax.random.normal(jax.random.key(0), q.shape)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a) * ct)

    args = (q, k, v, w, beta, g)
    want = jax.jit(jax.grad(loss(lambda *a: _definition_jnp(*a, 0.5)), range(6)))(*args)
    for chunk in (64, 2):
        ours = functools.partial(_ours, chunk=chunk)
        got = jax.jit(jax.grad(loss(ours), range(6)))(*args)
        for name, x, y in zip("q k v w beta log_forget".split(), got, want, strict=True):
            np.testing.assert_allclose(
                np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5, err_msg=f"{name}, {chunk}"
            )


def _ours(q, k, v, w, beta, g, *, chunk):
    return path_attention(q, k, v, w, beta, log_forget=g, chunk=chunk)


def test_jit_vmap_and_bfloat16():
    q, k, v, w, beta, _ = _f32(*_inputs(B=2, T=7, N=2, K=1, H=8, seed=12))
    want = path_attention(q, k, v, w, beta)
    jitted = jax.jit(path_attention, static_argnames="window")(q, k, v, w, beta)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(want), atol=1e-6)
    mapped = jax.vmap(lambda *a: path_attention(*(x[None] for x in a))[0])(q, k, v, w, beta)
    np.testing.assert_allclose(np.asarray(mapped), np.asarray(want), atol=1e-6)
    low = path_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), w, beta)
    assert low.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(low, np.float32), np.asarray(want), atol=0.1)


def test_bad_shapes_are_refused_with_what_they_must_be():
    q, k, v, w, beta, _ = _f32(*_inputs(B=1, T=4, N=2, K=1, H=4))
    with pytest.raises(ValueError, match="beta"):
        path_attention(q, k, v, w, beta[..., None])
    with pytest.raises(ValueError, match="log_forget"):
        path_attention(q, k, v, w, beta, log_forget=jnp.zeros((1, 4, 1)))
    with pytest.raises(ValueError, match="window"):
        path_attention(q, k, v, w, beta, window=0)
    with pytest.raises(ValueError, match="decode step"):
        path_update_keys(k, w, beta[:, 0], 2)
