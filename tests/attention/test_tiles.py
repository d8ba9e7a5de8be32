"""The shared tile math: the online softmax over several key tiles equals one tile, rows that see
no key give zeros, and the backward equations agree between the two logits layouts and with
autodiff of the softmax."""

import jax
import jax.numpy as jnp
import numpy as np

from posattn.attention import tiles

B, K, G, T, S, H = 2, 2, 3, 5, 8, 4


def _inputs(seed=0):
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (B, K, G, T, H))
    k = jax.random.normal(kk, (B, K, S, H))
    v = jax.random.normal(kv, (B, K, S, H))
    d_out = jax.random.normal(kd, (B, K, G, T, H))
    return q, k, v, d_out


def _attend(q, k, v, mask, tile):
    state = tiles.softmax_init((B, K, G, T), H)
    for a in range(0, S, tile):
        s = tiles.logits(
            "query_major", q, k[:, :, a : a + tile], scale=0.5, mask=mask[..., a : a + tile]
        )
        state = tiles.online_softmax_step(state, s, v[:, :, a : a + tile])
    return state


def test_online_softmax_over_tiles_and_empty_rows():
    q, k, v, _ = _inputs()
    mask = jnp.ones((1, 1, 1, T, S), bool).at[..., 2, :].set(False)  # query row 2 sees nothing
    out_one, m, inv_l = tiles.softmax_finish(_attend(q, k, v, mask, S), jnp.float32)
    state = _attend(q, k, v, mask, 3)  # tiles of 3, 3, 2 keys
    out_tiles = tiles.softmax_finish(state, jnp.float32)[0]
    np.testing.assert_allclose(out_tiles, out_one, rtol=1e-5, atol=1e-6)
    s = 0.5 * jnp.einsum("bkgth,bksh->bkgts", q, k)
    want = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1) @ v[:, :, None]
    np.testing.assert_allclose(
        out_one[..., [0, 1, 3, 4], :], want[..., [0, 1, 3, 4], :], 1e-5, 1e-6
    )
    assert np.all(np.asarray(out_one[..., 2, :]) == 0.0) and np.isfinite(out_one).all()
    assert np.all(np.isinf(tiles.log_sum_exp(state)[..., 2]))
    p = tiles.probabilities_from_lse(
        "query_major", jnp.where(mask, s, -jnp.inf), tiles.log_sum_exp(state)
    )
    np.testing.assert_array_equal(p[..., 2, :], 0.0)


def test_backward_equations_agree_across_layouts_and_with_autodiff():
    q, k, v, d_out = _inputs(1)
    scale = 0.5

    def loss(q, k, v):
        p = jax.nn.softmax(scale * jnp.einsum("bkgth,bksh->bkgts", q, k), axis=-1)
        return jnp.sum(jnp.einsum("bkgts,bksh->bkgth", p, v) * d_out)

    want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    state = _attend(q, k, v, jnp.ones((1, 1, 1, T, S), bool), S)
    out, m, inv_l = tiles.softmax_finish(state, jnp.float32)
    s = tiles.logits("query_major", q, k, scale=scale)
    p = tiles.probabilities("query_major", s, m, inv_l)
    delta = tiles.softmax_delta(d_out, out)
    dq, dk, dv, ds = tiles.tile_grads(
        "query_major", p=p, q=q, k=k, v=v, d_out=d_out, delta=delta, scale=scale
    )
    for got, w in zip((dq, dk, dv), want, strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)
    # The key-major layout (logits [B, K, S, G, T], dQ transposed, D from P * dP) agrees.
    s_t = tiles.logits("key_major", q, k, scale=scale)
    np.testing.assert_allclose(s_t, jnp.moveaxis(s, -1, 2), rtol=1e-6, atol=1e-6)
    p_t = tiles.probabilities("key_major", s_t, m, inv_l)
    dq_t, dk_t, dv_t, ds_t = tiles.tile_grads(
        "key_major", p=p_t, q=q, k=k, v=v, d_out=d_out, delta=None, scale=scale
    )
    np.testing.assert_allclose(jnp.moveaxis(dq_t, 2, -1), dq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dk_t, dk, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dv_t, dv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jnp.moveaxis(ds_t, 2, -1), ds, rtol=1e-5, atol=1e-5)


def test_helpers():
    x = jnp.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(tiles.sum_to(x, (1, 3, 1)), x.sum((0, 2), keepdims=True))
    q = jnp.arange(2 * 6 * 4.0).reshape(2, 6, 4)  # [T, N, H] with N = 6
    np.testing.assert_array_equal(tiles.ungroup_heads(tiles.group_heads(q, 2)), q)
    assert tiles.group_heads(q, 2).shape == (2, 2, 3, 4)
    assert tiles.fold_scale(q, 0.5)[1] == 0.5
    folded, one = tiles.fold_scale(q, jnp.float32(0.5))
    assert one == 1.0
    np.testing.assert_array_equal(folded, q * 0.5)
