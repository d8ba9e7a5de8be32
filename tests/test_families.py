"""The family registry: every family's bias function, its gradients, its settings, and the loud
unknown-name error."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posattn import families, positions

CTX = families.Context(num_heads=4, head_dim=16)
# Each family's defaults, but FIRE's threshold at 16 (the test sequences are short).
SETTINGS = {
    name: families.FireSettings(init_L=16.0) if name == "fire" else families.get(name).settings()
    for name in families.names()
}
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


def _bias(name, params, q_pos, k_pos, ctx=CTX, settings=None):
    settings = SETTINGS[name] if settings is None else settings
    return families.get(name).bias.bind(ctx, settings)(params, q_pos, k_pos)


def _init(name, key, ctx=CTX, settings=None):
    settings = SETTINGS[name] if settings is None else settings
    return families.get(name).bias.init(key, ctx, settings)


@pytest.mark.parametrize("name", BIAS_FAMILIES)
def test_bias_shape_dtype_and_jit(name):
    params = _init(name, jax.random.key(0))
    q_pos, k_pos = jnp.arange(5, 12), jnp.arange(10)
    out = _bias(name, params, q_pos, k_pos)
    assert out.shape == (4, 7, 10) and out.dtype == jnp.float32
    jitted = jax.jit(lambda p, q, k: _bias(name, p, q, k))(params, q_pos, k_pos)
    np.testing.assert_allclose(jitted, out, rtol=1e-6, atol=1e-6)
    assert bool(jnp.all(jnp.isfinite(out)))


@pytest.mark.parametrize("name", BIAS_FAMILIES)
def test_bias_depends_on_positions_not_tiling(name):
    """The bias of a tile equals the full bias sliced (what blockwise attention relies on)."""
    params = _init(name, jax.random.key(1))
    full = _bias(name, params, jnp.arange(40), jnp.arange(40))
    tile = _bias(name, params, jnp.arange(16, 32), jnp.arange(8, 24))
    np.testing.assert_allclose(tile, full[:, 16:32, 8:24], rtol=1e-6, atol=1e-6)


def test_family_biases_match_the_pure_functions():
    q, k = jnp.arange(20), jnp.arange(20)
    offset = q[:, None] - k[None, :]
    np.testing.assert_allclose(
        _bias("alibi", _init("alibi", None), q, k)[:, offset >= 0],
        positions.alibi_bias(offset, positions.alibi_slopes(4))[:, offset >= 0],
    )
    table = jnp.arange(4 * 32, dtype=jnp.float32).reshape(4, 32)
    buckets = positions.t5_bucket(offset, bidirectional=False, num_buckets=32, max_distance=128)
    np.testing.assert_array_equal(_bias("t5", {"table": table}, q, k), table[:, buckets])
    bidir = dataclasses.replace(CTX, bidirectional=True)
    buckets = positions.t5_bucket(offset, bidirectional=True, num_buckets=32, max_distance=128)
    np.testing.assert_array_equal(_bias("t5", {"table": table}, q, k, bidir), table[:, buckets])


def test_alibi_slope_scale_multiplies_slopes():
    scaled = families.AlibiSettings(slope_scale=0.5)
    np.testing.assert_allclose(
        _init("alibi", None, settings=scaled)["slopes"], 0.5 * positions.alibi_slopes(4)
    )


def _check_grads_fd(name, params, *, eps=1e-2, rtol=2e-2, seed=0):
    """Directional derivatives of sum(W * bias) against central finite differences.

    The directions are fixed (one key per leaf, in sorted order), and the differences sum the
    float32 biases in float64: a float32 sum of 2304 terms carries more rounding than the
    difference being measured at small eps.
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
            analytic,
            numeric,
            rtol=rtol,
            atol=1e-2 * max(1.0, abs(float(numeric))),
            err_msg=f"{name}.{leaf_name}",
        )


def test_t5_table_gradient_matches_finite_differences():
    params = _init("t5", jax.random.key(2))
    _check_grads_fd("t5", params)


@pytest.mark.parametrize("name", ["kerple_power", "kerple_log"])
def test_kerple_gradients_match_finite_differences(name):
    params = {"r1": jnp.array([0.3, 0.8, 1.2, 0.5]), "r2": jnp.array([0.5, 1.0, 1.5, 0.2])}
    # eps 3e-3: at 1e-3 the float32 rounding of |offset|^r2 (up to ~130) shows in the difference,
    # at 1e-2 the truncation error of log(1 + r2 x) does (measured over 60 random directions).
    _check_grads_fd(name, params, eps=3e-3)


def test_fire_gradients_match_finite_differences():
    params = _init("fire", jax.random.key(3))
    # Keep every hidden pre-activation d * w1 + b1 (d in [0, 1]) at least 0.5 away from ReLU's kink,
    # so central differences measure the derivative rather than a kink crossing.
    sign = jnp.where(jnp.arange(params["b1"].size) % 2 == 0, 1.0, -1.0)
    params = dict(params, c=jnp.asarray(0.5), b1=sign * (jnp.abs(params["w1"]) + 0.5))
    _check_grads_fd("fire", params, eps=1e-3)
    grads = jax.grad(lambda p: jnp.sum(_bias("fire", p, jnp.arange(40), jnp.arange(40))))(params)
    assert all(
        bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g).sum()) > 0 for g in grads.values()
    )


def test_fire_uses_the_true_query_position():
    """A decode step at query 30 sees the bias row of the full sequence (progressive interp.)."""
    params = _init("fire", jax.random.key(4))
    full = _bias("fire", params, jnp.arange(31), jnp.arange(31))
    step = _bias("fire", params, jnp.array([30]), jnp.arange(31))
    # Values near 0.003 differ by ~1e-8 between CPUs' vector units (AVX2 vs AVX-512): an atol too.
    np.testing.assert_allclose(step[:, 0], full[:, 30], rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------------------------
# Settings: each family's own, with defaults, config keys and a validate naming the key.


@pytest.mark.parametrize("name", families.names())
def test_settings_defaults_validate_round_trip_and_hash(name):
    cls = families.get(name).settings
    settings = cls()
    settings.validate(CTX)
    assert cls.from_keys(settings.to_keys()) == settings
    assert hash(cls.from_keys(settings.to_keys())) == hash(settings)
    for key in cls.keys():
        assert name in families.owners(key)


def test_settings_read_their_own_prefixed_keys_only():
    t5 = families.T5Settings.from_keys(
        {"t5_num_buckets": 16, "t5_max_distance": 64, "rope_base": 5.0, "alibi_slope_scale": 2.0}
    )
    assert t5 == families.T5Settings(num_buckets=16, max_distance=64)
    assert t5.to_keys() == {"t5_num_buckets": 16, "t5_max_distance": 64}
    rope = families.RopeSettings.from_keys({"rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert rope.scaling == (("factor", 2.0), ("rope_type", "linear"))  # hashable items
    assert rope.scaling_dict == {"rope_type": "linear", "factor": 2.0}
    assert rope.to_keys()["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize(
    "settings, ctx, words",
    [
        (families.T5Settings(max_distance=8), CTX, ["model.t5_max_distance=8", "exceed"]),
        (families.T5Settings(num_buckets=0), CTX, ["model.t5_num_buckets=0", "positive"]),
        (
            families.T5Settings(num_buckets=31),
            dataclasses.replace(CTX, bidirectional=True),
            ["model.t5_num_buckets=31", "even number for the encoder"],
        ),
        (
            families.AlibiSettings(slope_scale=-1.0),
            CTX,
            ["model.alibi_slope_scale=-1.0", "positive"],
        ),
        (families.FireSettings(mlp_width=0), CTX, ["model.fire_mlp_width=0", "positive integer"]),
        (families.FireSettings(init_L=float("inf")), CTX, ["model.fire_init_L=inf", "finite"]),
        (families.LearnedSettings(max_len=0), CTX, ["model.max_len=0", "positive integer"]),
        (families.RopeSettings(layout="halves"), CTX, ["model.rope_layout='halves'", "'half'"]),
        (
            families.RopeSettings(),
            dataclasses.replace(CTX, head_dim=15),
            ["odd head dim 15", "RoPE"],
        ),
        (families.RopeSettings(scaling="yarn"), CTX, ["model.rope_scaling='yarn'", "None or"]),
        (
            families.RopeSettings(scaling={"rope_type": "magic", "factor": 2.0}),
            CTX,
            ["model.rope_scaling", "magic"],
        ),
        (families.SandwichSettings(), dataclasses.replace(CTX, head_dim=15), ["odd", "Sandwich"]),
    ],
)
def test_settings_validate_names_the_key_the_value_and_what_is_allowed(settings, ctx, words):
    with pytest.raises(ValueError) as e:
        settings.validate(ctx)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_learned_table_bounds_the_length_and_dynamic_ntk_makes_the_base_static():
    families.LearnedSettings(max_len=32).check_length(32)
    with pytest.raises(ValueError, match=r"33 positions exceed config.model.max_len=32"):
        families.LearnedSettings(max_len=32).check_length(33)
    families.RopeSettings().check_length(10**9)  # relative families read any length
    assert families.RopeSettings().not_continuous() == {}
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16}
    assert "dynamic" in families.RopeSettings(scaling=dynamic).not_continuous()["rope_base"]


def test_registry_derives_keys_and_continuous_keys_from_the_settings():
    assert set(families.keys()) == {
        "max_len",
        "rope_base",
        "rope_scaling",
        "rope_layout",
        "t5_num_buckets",
        "t5_max_distance",
        "alibi_slope_scale",
        "fire_mlp_width",
        "fire_init_c",
        "fire_init_L",
    }
    assert set(families.continuous_keys()) == {"rope_base", "alibi_slope_scale", "fire_init_c"}
    assert families.owners("t5_max_distance") == ("t5",)


def test_register_refuses_inconsistent_families():
    @dataclasses.dataclass(frozen=True)
    class OtherT5(families.Settings):
        prefix = "t5_"
        num_buckets: int = families.setting(64, help="a different default")

    with pytest.raises(ValueError, match="model.t5_num_buckets with default 64.*t5 declare it"):
        families.register(families.Family("t5_clash", settings=OtherT5))
    with pytest.raises(ValueError, match="rotary: its settings must extend RopeSettings"):
        families.register(families.Family("rot", settings=families.AlibiSettings, rotary=True))
    with pytest.raises(ValueError, match="settings must extend LearnedSettings"):
        families.register(families.Family("table", embedding="learned"))
    with pytest.raises(ValueError, match="already registered"):
        families.register(families.Family("rope"))
    assert not {"t5_clash", "rot", "table"} & set(families.names())
