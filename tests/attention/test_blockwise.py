"""Blockwise and chunked attention equal the reference: forward and every gradient (q, k, v, bias
params).

Small local bias functions stand in for the families (ALiBi-like, T5-like table, FIRE-like MLP),
so these tests do not depend on `posattn.positions`. Tiles are small (8 x 16) and lengths ragged
so every path (padding, diagonal tiles, skipped tiles) is exercised; the chunked kernel runs one
batch row per chunk on the grid (the scan's carried bias gradient) and 2 or 4 rows per chunk in
`test_chunked_rows_per_chunk` (the within-chunk sum).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posattn.attention import attention, chunked
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
    psi = lambda x: jnp.log(c * x + 1.0)
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
    """Output and d<out, d_out>/d(q, k, v, bias) for one implementation, jitted."""
    fn, params = bias if isinstance(bias, tuple) else (None, bias)

    def run(q, k, v, params):
        b = params if fn is None else (fn, params)
        if impl == "blockwise":
            return blockwise_attention(q, k, v, bias=b, **TILES, **kw)
        return attention(q, k, v, bias=b, implementation=impl, **kw)

    def loss(q, k, v, params):
        out = run(q, k, v, params)
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)), out

    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True, allow_int=True))(
        q, k, v, params
    )
    return out, grads


def _assert_close(got, want, rtol, atol=1e-7, name=""):
    """Every array within rtol of the largest magnitude of its reference counterpart (plus a
    small atol for scalar parameter gradients that are sums of cancelling terms)."""
    for path, g, w in zip(
        jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got), jax.tree.leaves(want)
    ):
        if w.dtype == jax.dtypes.float0:
            continue
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.isfinite(g).all(), f"{name}{jax.tree_util.keystr(path[0])}: non-finite"
        err = np.max(np.abs(g - w)) if w.size else 0.0
        assert err <= rtol * np.max(np.abs(w), initial=0.0) + atol, (
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


@pytest.mark.parametrize("impl", ["blockwise", "chunked"])
@pytest.mark.parametrize("bias_kind, case", GRID)
def test_matches_reference(impl, bias_kind, case, monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK_LOGITS", 1)  # chunked: one batch row per chunk
    monkeypatch.setattr(chunked, "TILE_Q", 16)  # chunked: causal query tiles of 16 (static offsets)
    inputs, bias, kw, want = _reference_case(bias_kind, case)
    got = _value_and_grads(impl, *inputs, bias, **kw)
    _assert_close(got, want, rtol=1e-5)
    if case == "fully_masked_rows":
        np.testing.assert_array_equal(got[0][0, :20], 0.0)  # positions -20..-1 see no key
        np.testing.assert_array_equal(got[0][1], 0.0)  # kv_lengths 0


@pytest.mark.parametrize(
    "bias_kind, case",
    [("alibi", "causal_gqa"), ("array", "padding"), ("t5", "causal_per_batch_offset")],
)
def test_chunked_rows_per_chunk(bias_kind, case, monkeypatch):
    """4 batch rows in chunks of 1, 2 and 4 rows: same output and gradients as the reference."""
    K, kw = CASES[case]
    kw = {name: np.tile(x, 2) if isinstance(x, np.ndarray) else x for name, x in kw.items()}
    key = jax.random.key(11)
    q, k, v, d_out = (jnp.concatenate([x, 2 * x]) for x in _inputs(K, key))  # (4, ...)
    bias = _bias(bias_kind, key)
    want = _value_and_grads("reference", q, k, v, d_out, bias, **kw)
    for rows in (1, 2, 4):
        monkeypatch.setattr(chunked, "CHUNK_LOGITS", rows * N * T * S)
        _assert_close(
            _value_and_grads("chunked", q, k, v, d_out, bias, **kw),
            want,
            rtol=1e-5,
            name=f"rows={rows} ",
        )


@pytest.mark.parametrize("q_offset", [-20, 5])
def test_chunked_causal_tiles(q_offset, monkeypatch):
    """A static causal offset splits the queries into tiles that skip the keys above the diagonal
    (at -20 the first tile sees no key at all); output and gradients stay the reference's."""
    assert chunked._query_tiles(256, 256, 0, 128) == ((0, 128, 128), (128, 256, 256))
    assert chunked._query_tiles(256, 256, None, 128) == ((0, 256, 256),)
    assert chunked._query_tiles(37, 45, -20, 16) == ((0, 16, 1), (16, 32, 12), (32, 37, 17))
    monkeypatch.setattr(chunked, "TILE_Q", 16)
    key = jax.random.key(12)
    q, k, v, d_out = _inputs(2, key)
    bias = _bias("alibi", key)
    want = _value_and_grads("reference", q, k, v, d_out, bias, causal=True, q_offset=q_offset)
    got = _value_and_grads("chunked", q, k, v, d_out, bias, causal=True, q_offset=q_offset)
    _assert_close(got, want, rtol=1e-5)


@pytest.mark.parametrize("impl", ["blockwise", "chunked"])
def test_bfloat16(impl):
    key = jax.random.key(7)
    q, k, v, d_out = _inputs(2, key, jnp.bfloat16)
    bias = _bias("alibi", key)
    out, grads = _value_and_grads(impl, q, k, v, d_out, bias, causal=True)
    assert out.dtype == jnp.bfloat16 and grads[0].dtype == jnp.bfloat16
    # The oracle sees the same bfloat16 values, computed in float32.
    f32 = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
    want = _value_and_grads("reference", *f32, bias, causal=True)
    _assert_close((out, grads), want, rtol=3e-2)


def test_through_attention_and_default_tiles():
    """implementation="blockwise" reaches the same kernel (default tiles, one tile here)."""
    key = jax.random.key(8)
    q, k, v, _ = _inputs(2, key)
    bias = _bias("alibi", key)
    got = attention(q, k, v, bias=bias, causal=True, implementation="blockwise")
    want = attention(q, k, v, bias=bias, causal=True, implementation="reference")
    _assert_close(got, want, rtol=1e-5)


@pytest.mark.parametrize("impl", ["blockwise", "chunked"])
def test_decode_step_jit_vmap_and_traced_scale(impl):
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
        jax.grad(lambda s: attention(q, k, v, scale=s, implementation=name, **kw).sum())(0.3)
        for name in (impl, "reference")
    ]
    _assert_close(d_scale[0], d_scale[1], rtol=1e-5)


def test_causal_tiles_above_the_diagonal_are_never_computed():
    """Count the bias tiles evaluated: with 4 x 4 tiles only the 10 on or below the diagonal
    run, forward and backward, for a causal 64-token self-attention."""
    seen = []

    def counting_bias(slopes, q_pos, k_pos):
        jax.debug.callback(lambda qp, kp: seen.append((int(qp), int(kp))), q_pos[0], k_pos[0])
        return alibi_like(slopes, q_pos, k_pos)

    q, k, v, d_out = _inputs(2, jax.random.key(10), T=64, S=64)
    bias = (counting_bias, jnp.array([0.5, 0.25, 0.125, 0.0625]))
    blockwise_attention(
        q[:1], k[:1], v[:1], bias=bias, causal=True, block_q=16, block_k=16
    ).block_until_ready()
    assert sorted(set(seen)) == [(i, j) for i in range(0, 64, 16) for j in range(0, i + 1, 16)]
    assert len(seen) == 10
    seen.clear()
    jax.grad(
        lambda q: blockwise_attention(
            q, k[:1], v[:1], bias=bias, causal=True, block_q=16, block_k=16
        ).sum()
    )(q[:1]).block_until_ready()
    assert len(seen) == 10 + 10  # forward once, backward once


def test_program_size_and_memory_do_not_grow_quadratically():
    """Same jaxpr size at any T (loops, not unrolled); compiled temporary memory of the forward
    and backward grows linearly with T."""

    def grad_fn(T):
        spec = jax.ShapeDtypeStruct((1, T, 8, 64), jnp.float32)
        f = jax.grad(
            lambda q, k, v: blockwise_attention(
                q,
                k,
                v,
                bias=(alibi_like, jnp.full((8,), 0.1)),
                causal=True,
                block_q=128,
                block_k=128,
            ).sum(),
            argnums=(0, 1, 2),
        )
        return f, spec

    sizes, temps = [], []
    for t in (1024, 2048):
        f, spec = grad_fn(t)
        sizes.append(len(jax.make_jaxpr(f)(spec, spec, spec).eqns))
        temps.append(
            jax.jit(f).lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes
        )
    assert sizes[0] == sizes[1]
    assert temps[1] / temps[0] < 2.5, temps  # quadratic would be 4
