"""Two-score attention (`far=Far(q_far, k_far, w)`): pairs with i - j >= w (|i - j| >= w when not
causal) score scale q_far.k_far, the others scale q.k; the soft cap, bias, forget term and masks
then apply to either.

The oracle (`attention_cases.oracle_attention(far=)`) selects between the two dense logit
matrices from that definition, sharing no code with `posattn.attention`; "reference", "chunked"
(one batch row per chunk, causal query tiles of 16) and "blockwise" (small tiles, so that tiles
hold near and far pairs, wholly near or wholly far ones) match its output and every gradient (q,
k, v, far.q, far.k, the bias parameters, log_forget) over masking and window cases. The other
implementations refuse `far` by name.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
    TILES,
    _assert_close,
    grid_case,
    oracle_attention,
)

from posattn import attention as attn_lib
from posattn.attention import FAR_IMPLEMENTATIONS, Far, attention, chunked
from posattn.attention.blockwise import blockwise_attention

POINTS = [
    ("alibi", "causal_gqa", 12),
    ("fire", "causal_per_batch_offset", 5),
    ("array", "padding", 7),
    ("none", "fully_masked_rows", 9),
    ("t5", "plain_mha", 6),
    ("alibi", "window_causal_gqa_ragged_per_row_offset", 4),
    ("none", "forget_gqa", 10),
    ("alibi", "forget_window_decode_block_mqa", 3),
    ("none", "causal_mqa_offset", 1),
]


def _case(bias_kind, case):
    return grid_case(bias_kind, case, seed=500)


def _far_inputs(q, k, seed=7):
    kq, kk = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kq, q.shape, q.dtype), jax.random.normal(kk, k.shape, k.dtype)


def _value_and_grads(impl, q, k, v, d_out, q_far, k_far, w, bias, **kw):
    """Output and d<out, d_out>/d(q, k, v, far.q, far.k, bias[, log_forget]), jitted."""
    fn, params = bias if isinstance(bias, tuple) else (None, bias)
    log_forget = kw.pop("log_forget", None)

    def loss(q, k, v, q_far, k_far, params, log_forget):
        b = params if fn is None else (fn, params)
        extra = {} if log_forget is None else {"log_forget": log_forget}
        if impl == "oracle":
            out = oracle_attention(q, k, v, bias=b, far=(q_far, k_far, w), **kw, **extra)
        elif impl == "blockwise":  # small tiles: near, far and mixed tiles
            far = Far(q_far, k_far, w)
            out = blockwise_attention(q, k, v, bias=b, far=far, **TILES, **kw, **extra)
        else:
            far = Far(q_far, k_far, w)
            out = attention(q, k, v, bias=b, far=far, implementation=impl, **kw, **extra)
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)), out

    argnums = (0, 1, 2, 3, 4, 5) + ((6,) if log_forget is not None else ())
    grads, out = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True, allow_int=True))(
        q, k, v, q_far, k_far, params, log_forget
    )
    # _assert_close reads the bias parameters' gradients at index 3 of grads
    grads = (grads[0], grads[1], grads[2], grads[5], grads[3], grads[4], *grads[6:])
    return out, grads


@pytest.mark.parametrize("bias_kind, case, w", POINTS)
def test_every_implementation_that_takes_it_matches_the_oracle_and_its_gradients(
    bias_kind, case, w, monkeypatch
):
    monkeypatch.setattr(chunked, "CHUNK_LOGITS", 1)  # chunked: one batch row per chunk
    monkeypatch.setattr(chunked, "TILE_Q", 16)  # chunked: causal query tiles of 16
    (q, k, v, d_out), bias, kw = _case(bias_kind, case)
    q_far, k_far = _far_inputs(q, k)
    want = _value_and_grads("oracle", q, k, v, d_out, q_far, k_far, w, bias, **dict(kw))
    # the far pairs change the output and reach far.q and far.k: the comparison can fail
    plain = oracle_attention(q, k, v, bias=bias, **kw)
    assert np.max(np.abs(np.asarray(want[0]) - np.asarray(plain))) > 0.05
    assert np.max(np.abs(np.asarray(want[1][4]))) > 0.05  # d far.q
    for impl in ("reference", "chunked", "blockwise", "auto"):
        got = _value_and_grads(impl, q, k, v, d_out, q_far, k_far, w, bias, **dict(kw))
        _assert_close(got, want, rtol=1e-5, atol=1e-5, name=f"{impl} ")


def test_with_a_soft_cap():
    (q, k, v, d_out), bias, kw = _case("alibi", "causal_gqa")
    q_far, k_far = _far_inputs(q, k)
    far = Far(q_far, k_far, 6)
    want = oracle_attention(q, k, v, bias=bias, far=(q_far, k_far, 6), softcap=1.5, **kw)
    for impl in ("reference", "chunked", "blockwise"):
        got = attention(q, k, v, bias=bias, far=far, softcap=1.5, implementation=impl, **kw)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=impl)


def test_equal_pairs_or_a_window_past_every_distance_are_plain_attention():
    (q, k, v, _), bias, kw = _case("alibi", "causal_gqa")
    plain = attention(q, k, v, bias=bias, implementation="reference", **kw)
    T = q.shape[1]
    for impl in ("reference", "chunked", "blockwise"):
        same = attention(q, k, v, bias=bias, far=Far(q, k, 3), implementation=impl, **kw)
        np.testing.assert_allclose(same, plain, atol=2e-6, err_msg=impl)
        q_far, k_far = _far_inputs(q, k)
        wide = attention(q, k, v, bias=bias, far=Far(q_far, k_far, T), implementation=impl, **kw)
        np.testing.assert_allclose(wide, plain, atol=2e-6, err_msg=impl)


def test_the_selection_by_hand():
    """One query at position 3, four keys, window 2: keys 2 and 3 score q.k, keys 0 and 1
    q_far.k_far."""
    H = 2
    q = jnp.array([1.0, 0.5]).reshape(1, 1, 1, H)
    q_far = jnp.array([-1.0, 2.0]).reshape(1, 1, 1, H)
    keys = np.array([[1.0, 0.0], [0.0, 1.0], [2.0, 1.0], [-1.0, 1.0]])
    far_keys = np.array([[0.5, 0.5], [1.0, -1.0], [3.0, 3.0], [4.0, 4.0]])
    k, k_far = (jnp.asarray(x, jnp.float32).reshape(1, 4, 1, H) for x in (keys, far_keys))
    v = jnp.asarray(np.arange(8, dtype=np.float32).reshape(1, 4, 1, H))
    s = np.array(
        [
            far_keys[0] @ [-1.0, 2.0],
            far_keys[1] @ [-1.0, 2.0],
            keys[2] @ [1, 0.5],
            keys[3] @ [1, 0.5],
        ]
    )
    p = np.exp(s - s.max())
    p /= p.sum()
    want = p @ np.arange(8.0).reshape(4, 2)
    for impl in ("reference", "chunked", "blockwise"):
        got = attention(
            q,
            k,
            v,
            far=Far(q_far, k_far, 2),
            causal=True,
            q_offset=3,
            scale=1.0,
            implementation=impl,
        )
        np.testing.assert_allclose(got[0, 0, 0], want, rtol=1e-6, err_msg=impl)


@pytest.mark.parametrize("impl", ["xla", "native", "cudnn", "pallas"])
def test_implementations_without_it_refuse_it_by_name(impl):
    (q, k, v, _), _, _ = _case("none", "causal_gqa")
    assert impl not in FAR_IMPLEMENTATIONS
    with pytest.raises(ValueError, match=f"implementation='{impl}' does not compute two-score"):
        attention(q, k, v, causal=True, far=Far(q, k, 4), implementation=impl)


@pytest.mark.parametrize(
    "far, match",
    [
        ((None, None, 4), "far must be None or posattn.attention.Far"),
        ("q_far", "far must be None or posattn.attention.Far"),
        (Far(None, None, 0), "far.window must be a static Python int >= 1"),
        (Far(None, None, 2.0), "far.window must be a static Python int >= 1"),
        (Far("q", None, 2), r"far.q must have the shape of q"),
        (Far(None, "k", 2), r"far.k must have the shape of k"),
    ],
)
def test_a_bad_far_is_refused(far, match):
    (q, k, v, _), _, _ = _case("none", "causal_gqa")
    if isinstance(far, Far):
        far = Far(q if far.q is None else far.q, k if far.k is None else far.k, far.window)
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, causal=True, far=far)


def test_auto_takes_chunked_or_blockwise_by_size_on_every_backend():
    small = jax.ShapeDtypeStruct((2, 64, 4, 16), jnp.float32)
    long = jax.ShapeDtypeStruct((1, 2048, 4, 16), jnp.float32)
    pick = attn_lib.choose_implementation
    for backend in ("cpu", "gpu", "tpu"):
        assert pick(small, small, None, causal=True, backend=backend, far=True) == "chunked"
        assert pick(long, long, None, causal=True, backend=backend, far=True) == "blockwise"


@pytest.mark.parametrize("impl", ["chunked", "blockwise"])
def test_vmap_over_every_array_matches_a_loop(impl):
    """The public contract: attention keeps working under jax.vmap over its array arguments, the
    far pair included (the kernels' custom_vjp batched), forward and gradients."""
    keys = jax.random.split(jax.random.key(9), 5)
    V, B, T, N, K, H = 3, 2, 24, 4, 2, 8
    q, q_far = (jax.random.normal(x, (V, B, T, N, H)) for x in keys[:2])
    k, v, k_far = (jax.random.normal(x, (V, B, T, K, H)) for x in keys[2:])

    def f(q, k, v, q_far, k_far):
        return attention(q, k, v, causal=True, far=Far(q_far, k_far, 5), implementation=impl)

    grad = jax.grad(lambda *a: f(*a).sum(), argnums=(0, 3, 4))
    # all compiled: faster than op by op
    got = jax.jit(jax.vmap(f))(q, k, v, q_far, k_far)
    got_grads = jax.jit(jax.vmap(grad))(q, k, v, q_far, k_far)
    f, grad = jax.jit(f), jax.jit(grad)
    for i in range(V):
        np.testing.assert_allclose(got[i], f(q[i], k[i], v[i], q_far[i], k_far[i]), atol=1e-6)
        want = grad(q[i], k[i], v[i], q_far[i], k_far[i])
        for g, w in zip(got_grads, want, strict=True):
            np.testing.assert_allclose(g[i], w, atol=2e-6)
