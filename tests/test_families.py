"""The family registry: every family's bias function (values against `posattn.positions`), its
gradients, and the loud unknown-name error."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posattn import families, positions

SETTINGS = families.BiasSettings(
    num_heads=4, head_dim=16, t5_num_buckets=32, t5_max_distance=128, fire_init_L=16.0
)
BIAS_FAMILIES = [n for n in families.names() if families.get(n).bias is not None]


def test_registry_lists_every_family():
    assert set(families.names()) == {
        "nope",
        "sinusoidal",
        "learned",
        "rope",
        "t5",
        "alibi",
        "kerple_power",
        "kerple_log",
        "sandwich",
        "fire",
    }


def test_unknown_family_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown position family 'rotary'.*alibi.*fire"):
        families.get("rotary")


def _bias(name, params, q_pos, k_pos, settings=SETTINGS):
    return families.get(name).bias.bind(settings)(params, q_pos, k_pos)


@pytest.mark.parametrize("name", BIAS_FAMILIES)
def test_bias_shape_dtype_and_jit(name):
    spec = families.get(name).bias
    params = spec.init(jax.random.key(0), SETTINGS)
    q_pos, k_pos = jnp.arange(5, 12), jnp.arange(10)
    out = _bias(name, params, q_pos, k_pos)
    assert out.shape == (4, 7, 10) and out.dtype == jnp.float32
    jitted = jax.jit(lambda p, q, k: _bias(name, p, q, k))(params, q_pos, k_pos)
    np.testing.assert_allclose(jitted, out, rtol=1e-5, atol=1e-6)  # eager vs compiled
    assert bool(jnp.all(jnp.isfinite(out)))


@pytest.mark.parametrize("name", BIAS_FAMILIES)
def test_bias_depends_on_positions_not_tiling(name):
    """The bias of a tile equals the slice of the full bias (what blockwise attention relies on)."""
    spec = families.get(name).bias
    params = spec.init(jax.random.key(1), SETTINGS)
    full = _bias(name, params, jnp.arange(40), jnp.arange(40))
    tile = _bias(name, params, jnp.arange(16, 32), jnp.arange(8, 24))
    # Other shapes vectorise differently (exp/log/pow may differ by an ulp): rtol beside atol.
    np.testing.assert_allclose(tile, full[:, 16:32, 8:24], rtol=1e-5, atol=1e-6)


def _fire_numpy(params, q_pos, k_pos, settings=SETTINGS):
    """FIRE's MLP over `positions.fire_normalized_distance`, in float64 NumPy."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    threshold = abs(float(p["L_multiplier"]) * settings.fire_init_L)
    d = np.asarray(
        positions.fire_normalized_distance(q_pos, k_pos, c=params["c"], L=threshold), np.float64
    )  # (t, s)
    h = np.maximum(d[..., None] * p["w1"] + p["b1"], 0.0)  # (t, s, width)
    return np.moveaxis(h @ p["w2"] + p["b2"], -1, 0)  # (N, t, s)


# Queries 5..24 over keys 0..19: past keys (offset > 0), the diagonal, and future keys (offset < 0,
# which a causal model masks; the wrappers give them the bias of |offset|).
Q_POS, K_POS = jnp.arange(5, 25), jnp.arange(20)
DISTANCE = jnp.abs(Q_POS[:, None] - K_POS[None, :])


@pytest.mark.parametrize("name", ["alibi", "kerple_power", "kerple_log", "sandwich", "fire", "t5"])
def test_family_wrappers_match_their_pure_functions(name):
    """Each registry BiasFn gives, at its initial and at perturbed values, what the pure function
    of `posattn.positions` gives for the same parameters (the wrapper adds only |i - j|)."""
    spec = families.get(name).bias
    params = spec.init(jax.random.key(5), SETTINGS)
    # Away from the initial values too: a wrapper that ignored a parameter would still pass there.
    params = {
        k: v * (1.0 + 0.25 * jax.random.uniform(jax.random.fold_in(jax.random.key(6), i), v.shape))
        for i, (k, v) in enumerate(sorted(params.items()))
    }
    got = _bias(name, params, Q_POS, K_POS)
    assert got.shape == (4, 20, 20)
    if name == "alibi":
        want = positions.alibi_bias(DISTANCE, params["slopes"])
        np.testing.assert_allclose(
            want, -np.asarray(params["slopes"])[:, None, None] * np.asarray(DISTANCE), rtol=1e-6
        )
    elif name == "kerple_power":
        want = positions.kerple_power_bias(DISTANCE, params["r1"], params["r2"])
    elif name == "kerple_log":
        want = positions.kerple_log_bias(DISTANCE, params["r1"], params["r2"])
    elif name == "sandwich":
        want = positions.sandwich_bias(DISTANCE, head_dim=16, num_heads=4)
    elif name == "fire":
        want = _fire_numpy(params, Q_POS, K_POS)
    else:
        offset = Q_POS[:, None] - K_POS[None, :]
        buckets = positions.t5_bucket(offset, bidirectional=False, num_buckets=32, max_distance=128)
        np.testing.assert_array_equal(got, params["table"][:, buckets])  # a gather: exact
        bidir = dataclasses.replace(SETTINGS, bidirectional=True)
        buckets = positions.t5_bucket(offset, bidirectional=True, num_buckets=32, max_distance=128)
        np.testing.assert_array_equal(
            _bias("t5", params, Q_POS, K_POS, bidir), params["table"][:, buckets]
        )
        return
    assert not np.allclose(want, 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_alibi_slope_scale_multiplies_slopes():
    scaled = dataclasses.replace(SETTINGS, alibi_slope_scale=0.5)
    np.testing.assert_allclose(
        families.get("alibi").bias.init(None, scaled)["slopes"], 0.5 * positions.alibi_slopes(4)
    )


def _check_grads_fd(name, params, *, eps, rtol, atol, seed=0):
    """Directional derivatives of sum(W * bias) against central finite differences.

    The directions are fixed (one key per leaf, in sorted order), and the differences sum the
    float32 biases in float64: a float32 sum of 2304 terms carries more rounding than the
    difference being measured at small eps. `rtol` and `atol` are per family: a bias linear in
    its parameters has no truncation error, only float32 rounding.
    """
    q_pos, k_pos = jnp.arange(24), jnp.arange(24)
    w = jax.random.normal(jax.random.key(seed), (4, 24, 24))

    def f(p):
        return jnp.sum(w * _bias(name, p, q_pos, k_pos))

    def f64(p):
        return float(
            np.sum(np.asarray(w, np.float64) * np.asarray(_bias(name, p, q_pos, k_pos), np.float64))
        )

    grads = jax.grad(f)(params)
    for i, leaf_name in enumerate(sorted(params)):
        key = jax.random.fold_in(jax.random.key(seed + 1), i)
        direction = jax.random.normal(key, jnp.shape(params[leaf_name]))
        plus = dict(params, **{leaf_name: params[leaf_name] + eps * direction})
        minus = dict(params, **{leaf_name: params[leaf_name] - eps * direction})
        numeric = (f64(plus) - f64(minus)) / (2 * eps)
        analytic = jnp.sum(grads[leaf_name] * direction)
        np.testing.assert_allclose(
            analytic, numeric, rtol=rtol, atol=atol, err_msg=f"{name}.{leaf_name}"
        )


# Tolerances: about 10x the worst error measured over 5 seeds of (weights, directions) on an x86
# CPU. T5 (a table lookup) and ALiBi (slope * distance) are linear in their parameters, so central
# differences are exact up to float32 rounding: measured 5e-6 and 3e-6 relative.


def test_t5_table_gradient_matches_finite_differences():
    params = families.get("t5").bias.init(jax.random.key(2), SETTINGS)
    _check_grads_fd("t5", params, eps=1e-2, rtol=1e-4, atol=1e-4)


def test_alibi_slope_gradient_matches_finite_differences():
    params = families.get("alibi").bias.init(None, SETTINGS)  # fixed in training; linear here
    _check_grads_fd("alibi", params, eps=1e-2, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name, rtol", [("kerple_power", 3e-3), ("kerple_log", 1e-3)])
def test_kerple_gradients_match_finite_differences(name, rtol):
    params = {"r1": jnp.array([0.3, 0.8, 1.2, 0.5]), "r2": jnp.array([0.5, 1.0, 1.5, 0.2])}
    # eps 3e-3: at 1e-3 the float32 rounding of |offset|^r2 (up to ~130) shows in the difference,
    # at 1e-2 the truncation error of log(1 + r2 x) does (measured over 60 random directions).
    # Measured: 2.7e-4 (power) and 9e-5 (log) relative, on derivatives of magnitude > 5.
    _check_grads_fd(name, params, eps=3e-3, rtol=rtol, atol=1e-3)


def test_fire_gradients_match_finite_differences():
    params = families.get("fire").bias.init(jax.random.key(3), SETTINGS)
    # Keep every hidden pre-activation d * w1 + b1 (d in [0, 1]) at least 0.5 away from ReLU's kink,
    # so central differences measure the derivative rather than a kink crossing.
    sign = jnp.where(jnp.arange(params["b1"].size) % 2 == 0, 1.0, -1.0)
    params = dict(params, c=jnp.asarray(0.5), b1=sign * (jnp.abs(params["w1"]) + 0.5))
    # At eps 1e-3 the float32 rounding of the biases (~1) summed over 2304 weights, divided by
    # 2 eps, is ~1e-3 absolute: measured 2.7e-3 worst (on a derivative of 0.04), 1e-3 relative on
    # the larger ones.
    _check_grads_fd("fire", params, eps=1e-3, rtol=1e-2, atol=1e-2)
    grads = jax.grad(lambda p: jnp.sum(_bias("fire", p, jnp.arange(40), jnp.arange(40))))(params)
    assert all(
        bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g).sum()) > 0 for g in grads.values()
    )


def test_fire_uses_the_true_query_position():
    """A decode step at query 30 sees the bias row of the full sequence (progressive
    interpolation normalises by the true query position)."""
    params = families.get("fire").bias.init(jax.random.key(4), SETTINGS)
    full = _bias("fire", params, jnp.arange(31), jnp.arange(31))
    step = _bias("fire", params, jnp.array([30]), jnp.arange(31))
    # One row against 31 (other programs): values ~3e-3, so an atol beside the rtol.
    np.testing.assert_allclose(step[:, 0], full[:, 30], rtol=1e-5, atol=1e-6)
