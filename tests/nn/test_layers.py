"""Layers: the 2-D dense product, RMSNorm, shared modules handed to a layer of a scanned stack,
parameter dtypes, cache row writes and token positions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT
from flax import nnx

from posattn import config as config_lib
from posattn.attention import native
from posattn.nn import layers, model


def make_cfg(**model):
    config = config_lib.load_config(
        ROOT / "configs" / "tiny.py", [f"--config.model.{k}={v}" for k, v in model.items()]
    )
    return config_lib.validate(config)


def test_dense_is_the_einsum_over_the_last_and_first_axes():
    x = jax.random.normal(jax.random.key(0), (2, 3, 8))
    w = jax.random.normal(jax.random.key(1), (8, 4, 5))
    np.testing.assert_allclose(
        layers.dense(x, w), jnp.einsum("btd,dnh->btnh", x, w), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(64, 16), (16, 64), (32, 32)])
@pytest.mark.parametrize("transposed", [False, True])
def test_dense_gradients_are_jax_own_and_the_weight_gradient_is_computed_wide(
    shape, transposed, dtype
):
    """dense's backward (the weight gradient in the orientation whose result is wide) gives JAX's
    own matmul gradient, for a tall, a wide and a square weight, also where the weight is a
    transposed table (the tied output layer's `table.T`): the same dot products, equal within the
    rounding bound of a float32 dot product (the same bits on a Zen 4; on an AVX2 core a square
    product's last columns can round differently, as JAX's own gradient does between a jitted and
    an eager program there). In float32, where the native library built, the weight gradient is its
    product (`native.weight_gradient`, a chunked sum: within the same bound); otherwise the compiled
    backward's weight-gradient product has no more rows than columns."""
    x = jax.random.normal(jax.random.key(0), (2, 48, shape[0])).astype(dtype)
    table = jax.random.normal(jax.random.key(1), shape[::-1] if transposed else shape)
    table = table.astype(dtype)
    g = jax.random.normal(jax.random.key(2), (2, 48, shape[1])).astype(dtype)

    def loss(product, x, table):
        w = table.T if transposed else table
        return jnp.sum((product(x, w) * g).astype(jnp.float32))

    def plain(x, w):
        return (x.reshape(-1, x.shape[-1]) @ w).reshape(*x.shape[:-1], -1)

    grad = jax.jit(jax.grad(lambda *a: loss(layers.dense, *a), (0, 1)))
    got, want = grad(x, table), jax.grad(lambda *a: loss(plain, *a), (0, 1))(x, table)
    # |a - b| <= 2 K eps sum_k |u_k v_k| for two orderings of one K-term dot product, plus the
    # rounding to the output dtype; a wrong product (a transposed one, a missing term) is O(1) off.
    x2, g2 = np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(g, np.float64))
    x2, g2 = x2.reshape(-1, x2.shape[-1]), g2.reshape(-1, g2.shape[-1])
    w2 = np.abs(np.asarray(table.T if transposed else table, np.float64))
    sums = [(g2 @ w2.T).reshape(x.shape), x2.T @ g2]  # sum |u_k v_k| of dx and of dw
    sums[1] = sums[1].T if transposed else sums[1]
    eps = np.finfo(np.float32).eps
    for a, b, s, k in zip(got, want, sums, (shape[1], x2.shape[0]), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        bound = 2 * k * eps * s + 2 * float(jnp.finfo(dtype).eps) * np.abs(b)
        assert np.all(np.abs(a - b) <= bound), np.max(np.abs(a - b) / bound)
    text = grad.lower(x, table).compile().as_text()
    products = [
        line for line in text.splitlines() if " dot(" in line and "lhs_contracting_dims={0}" in line
    ]
    if dtype == jnp.float32 and native.available():
        assert "posattn_weight_gradient" in text and not products
        return
    assert products, "no weight-gradient product found"
    for line in products:  # "= f32[a,b]{minor,major} dot(": rows and columns as laid out
        shape, layout = line.split(" dot(")[0].split("[", 1)[1].split("]{")
        dims = [int(n) for n in shape.split(",")]
        rows, cols = (dims[0], dims[1]) if layout.startswith("1") else (dims[1], dims[0])
        assert rows <= cols, line


def test_dense_backward_elsewhere_than_cpu_is_jax_own(monkeypatch):
    """On another backend dense's backward is JAX's own product (its branch, run on this CPU)."""
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")
    x = jax.random.normal(jax.random.key(0), (40, 64))
    w = jax.random.normal(jax.random.key(1), (64, 16))
    g = jax.random.normal(jax.random.key(2), (40, 16))
    got = jax.grad(lambda x, w: jnp.sum(layers.dense(x, w) * g), (0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.sum((x @ w) * g), (0, 1))(x, w)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_rms_norm_normalises_in_float32_and_scales(param_dtype):
    norm = layers.RMSNorm(8, dtype=jnp.bfloat16, param_dtype=param_dtype)
    assert norm.scale[...].dtype == param_dtype
    norm.scale[...] = jnp.arange(1, 9, dtype=param_dtype)
    x = jax.random.normal(jax.random.key(0), (3, 8)) * 5
    y = norm(x)
    assert y.dtype == jnp.bfloat16
    want = x / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + 1e-6) * np.arange(1, 9)
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("position", ["rope", "t5"])
def test_a_layer_given_the_shared_modules_equals_one_that_holds_them(position):
    """A layer of a scanned stack holds no RoPE frequencies or shared T5 table; handed them as
    `shared=(rotary, bias)` it computes what the layer holding them computes."""
    cfg = make_cfg(position=position, d_model=32, num_layers=2)
    rotary = layers.Rotary(cfg.head_dim, cfg.settings) if cfg.family.rotary else None
    spec = cfg.family.bias
    bias = None
    if spec is not None:
        bias = layers.PositionBias(spec, cfg.context, cfg.settings, rngs=nnx.Rngs(params=7))

    def attention(**modules):
        return layers.Attention(
            cfg.d_model,
            cfg.num_heads,
            cfg.num_kv_heads,
            num_layers=cfg.num_layers,
            causal=True,
            scale_free=cfg.family.scale_free,
            init_scale=1.0,
            implementation="auto",
            dtype=jnp.float32,
            owns_kv=True,
            rngs=nnx.Rngs(params=0),
            **modules,
        )

    holds = attention(rotary_module=rotary, bias_module=bias)
    bare = attention(rotary_module=None, bias_module=None)
    x = jax.random.normal(jax.random.key(1), (2, 12, 32))
    out, (k, v) = holds(x)
    out_shared, (k_shared, v_shared) = bare(x, shared=(rotary, bias))
    np.testing.assert_allclose(out_shared, out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(k_shared, k, rtol=1e-6, atol=1e-6)
    # Without them it is another function (the test would notice a layer ignoring `shared`).
    assert not np.allclose(bare(x)[0], out, atol=1e-4)


def test_parameter_dtype_covers_projections_and_norms_not_bias_values():
    cfg = make_cfg(position="kerple_log", d_model=32, num_layers=2, param_dtype="bfloat16")
    spec = cfg.family.bias
    bias = layers.PositionBias(spec, cfg.context, cfg.settings, rngs=nnx.Rngs(params=0))
    block = model._block(
        cfg, owns_kv=True, rotary_module=None, bias_module=bias, rngs=nnx.Rngs(params=0)
    )
    dtypes = {"/".join(map(str, p)): v[...].dtype for p, v in nnx.to_flat_state(nnx.state(block))}
    assert dtypes["attn/wq"] == dtypes["mlp/w2"] == dtypes["attn_norm/scale"] == jnp.bfloat16
    assert dtypes["attn/bias/values/r1"] == jnp.float32
    out, _ = block(jax.random.normal(jax.random.key(1), (2, 12, 32)))
    assert out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))


def test_write_rows_drops_rows_past_the_cache_and_token_positions_offset():
    cache = jnp.zeros((2, 4, 1))
    chunk = jnp.ones((2, 3, 1)) * jnp.array([1.0, 2.0])[:, None, None]
    out = layers.write_rows(cache, chunk, jnp.array([0, 2]))
    np.testing.assert_array_equal(out[..., 0], [[1, 1, 1, 0], [0, 0, 2, 2]])  # row 4 dropped
    np.testing.assert_array_equal(layers.token_positions(3, 2), [3, 4])
    np.testing.assert_array_equal(layers.token_positions(jnp.array([0, 5]), 2), [[0, 1], [5, 6]])
