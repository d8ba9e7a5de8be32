"""The family registry: every family's bias function (values against `posattn.positions`), its
gradients, its settings, and the loud unknown-name error."""

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
        "fox",
        "stick_breaking",
        "cope",
        "path",
        "path_fox",
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
    np.testing.assert_allclose(jitted, out, rtol=1e-5, atol=1e-6)  # eager vs compiled
    assert bool(jnp.all(jnp.isfinite(out)))


@pytest.mark.parametrize("name", BIAS_FAMILIES)
def test_bias_depends_on_positions_not_tiling(name):
    """The bias of a tile equals the slice of the full bias (what blockwise attention relies on)."""
    params = _init(name, jax.random.key(1))
    full = _bias(name, params, jnp.arange(40), jnp.arange(40))
    tile = _bias(name, params, jnp.arange(16, 32), jnp.arange(8, 24))
    # Other shapes vectorise differently (exp/log/pow may differ by an ulp): rtol beside atol.
    np.testing.assert_allclose(tile, full[:, 16:32, 8:24], rtol=1e-5, atol=1e-6)


RELATIVE_FAMILIES = [n for n in BIAS_FAMILIES if families.get(n).bias.relative]


@pytest.mark.parametrize("name", RELATIVE_FAMILIES)
def test_a_tabulated_bias_is_the_direct_one(name):
    """A relative bias evaluated once per offset and gathered (`masks.masked_logit_bias` with
    `tabulate`, as the materialising kernels build it) is the bias evaluated per (query, key): a
    per-row and a traced query offset, T != S, a sliding window, key lengths and a forget term.
    Forced on for every relative family here; Sandwich has it by default."""
    from posattn.attention import masks

    params = _init(name, jax.random.key(3))
    bound = families.get(name).bias.bind(CTX, SETTINGS[name])
    assert bound.tabulate == (name == "sandwich")
    tabled, direct = (dataclasses.replace(bound, tabulate=t) for t in (True, False))
    gates = jax.nn.log_sigmoid(jax.random.normal(jax.random.key(4), (3, 40, CTX.num_heads)))
    cases = [
        (jnp.array([0, 7, 30], jnp.int32), 12, 40, dict(causal=True, kv_lengths=None, window=None)),
        (5, 20, 17, dict(causal=False, kv_lengths=jnp.array([9, 17]), window=None)),
        (0, 24, 24, dict(causal=True, kv_lengths=None, window=6)),
        (2, 16, 40, dict(causal=True, kv_lengths=None, window=None, log_forget=gates)),  # + FoX
    ]
    for q_offset, T, S, kw in cases:

        def logit_bias(fn, offset, T=T, S=S, kw=kw):
            kw = dict(kw)
            gates = kw.pop("log_forget", None)
            return masks.masked_logit_bias((fn, params), gates, offset, T, S, **kw)[0]

        want = jax.jit(logit_bias, static_argnums=0)(direct, q_offset)  # faster than op by op
        for got in (
            logit_bias(tabled, q_offset),
            jax.jit(logit_bias, static_argnums=0)(tabled, q_offset),
        ):
            assert got.shape == want.shape
            np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
            # Other shapes vectorise differently (a sum over Sandwich's d'/2 terms may round
            # differently by an ulp): rtol beside atol, as above.
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_tabulate_needs_a_relative_bias():
    spec = families.get("fire").bias
    with pytest.raises(ValueError, match="tabulate=True.*relative=True"):
        dataclasses.replace(spec, tabulate=True)


def _fire_numpy(params, q_pos, k_pos, settings=SETTINGS["fire"]):
    """FIRE's MLP over `positions.fire_normalized_distance`, in float64 NumPy."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    threshold = abs(float(p["L_multiplier"]) * settings.init_L)
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
    params = _init(name, jax.random.key(5))
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
        bidir = dataclasses.replace(CTX, bidirectional=True)
        buckets = positions.t5_bucket(offset, bidirectional=True, num_buckets=32, max_distance=128)
        np.testing.assert_array_equal(
            _bias("t5", params, Q_POS, K_POS, bidir), params["table"][:, buckets]
        )
        return
    assert not np.allclose(want, 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_alibi_slope_scale_multiplies_slopes():
    scaled = families.AlibiSettings(slope_scale=0.5)
    np.testing.assert_allclose(
        _init("alibi", None, settings=scaled)["slopes"], 0.5 * positions.alibi_slopes(4)
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
    bias = jax.jit(lambda p: _bias(name, p, q_pos, k_pos))  # one program, not one per op

    def f64(p):
        return float(np.sum(np.asarray(w, np.float64) * np.asarray(bias(p), np.float64)))

    grads = jax.jit(jax.grad(lambda p: jnp.sum(w * _bias(name, p, q_pos, k_pos))))(params)
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
    params = _init("t5", jax.random.key(2))
    _check_grads_fd("t5", params, eps=1e-2, rtol=1e-4, atol=1e-4)


def test_alibi_slope_gradient_matches_finite_differences():
    params = _init("alibi", None)  # fixed in training; linear here
    _check_grads_fd("alibi", params, eps=1e-2, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name, rtol", [("kerple_power", 3e-3), ("kerple_log", 1e-3)])
def test_kerple_gradients_match_finite_differences(name, rtol):
    params = {"r1": jnp.array([0.3, 0.8, 1.2, 0.5]), "r2": jnp.array([0.5, 1.0, 1.5, 0.2])}
    # eps 3e-3: at 1e-3 the float32 rounding of |offset|^r2 (up to ~130) shows in the difference,
    # at 1e-2 the truncation error of log(1 + r2 x) does (measured over 60 random directions).
    # Measured: 2.7e-4 (power) and 9e-5 (log) relative, on derivatives of magnitude > 5.
    _check_grads_fd(name, params, eps=3e-3, rtol=rtol, atol=1e-3)


def test_fire_gradients_match_finite_differences():
    params = _init("fire", jax.random.key(3))
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
    params = _init("fire", jax.random.key(4))
    full = _bias("fire", params, jnp.arange(31), jnp.arange(31))
    step = _bias("fire", params, jnp.array([30]), jnp.arange(31))
    # One row against 31 (other programs): values ~3e-3, so an atol beside the rtol.
    np.testing.assert_allclose(step[:, 0], full[:, 30], rtol=1e-5, atol=1e-6)


def test_fire_norm_cap_stops_the_normaliser_at_its_position():
    """`fire_norm_cap=n`: rows of queries up to n are the paper's; a query past n reads its keys
    through the normaliser of query n (so a row's offsets past n map above 1)."""
    params = _init("fire", jax.random.key(5))
    q_pos, k_pos = jnp.arange(40), jnp.arange(40)
    capped = dataclasses.replace(SETTINGS["fire"], norm_cap=24)
    capped.validate(CTX)
    plain = _bias("fire", params, q_pos, k_pos)
    got = _bias("fire", params, q_pos, k_pos, settings=capped)
    np.testing.assert_array_equal(got[:, :25], plain[:, :25])
    assert not np.allclose(got[:, 25:], plain[:, 25:])
    # The capped rows against the MLP over the formula, in float64 NumPy.
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    threshold = abs(float(p["L_multiplier"]) * capped.init_L)
    q, k = np.arange(40.0)[:, None], np.arange(40.0)[None, :]
    psi = lambda x: np.log1p(np.abs(float(p["c"]) * x))  # noqa: E731
    d = psi(q - k) / (psi(np.maximum(np.minimum(q, 24), threshold)) + positions.FIRE_EPS)
    assert d[30, 0] > 1  # an offset past the cap maps above 1
    h = np.maximum(d[..., None] * p["w1"] + p["b1"], 0.0)
    np.testing.assert_allclose(got, np.moveaxis(h @ p["w2"] + p["b2"], -1, 0), atol=2e-6)


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
        (families.FireSettings(norm_cap=-1), CTX, ["model.fire_norm_cap=-1", "positive integer"]),
        (families.FireSettings(norm_cap=8.5), CTX, ["model.fire_norm_cap=8.5", "0 (the norm"]),
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
        "rope_partial_factor",
        "rope_proportion",
        "rope_remap",
        "t5_num_buckets",
        "t5_max_distance",
        "alibi_slope_scale",
        "fire_mlp_width",
        "fire_init_c",
        "fire_init_L",
        "fire_norm_cap",
        "kerple_per_layer",
        "sandwich_dim",
        "stick_breaking_remainder",
        "stick_breaking_logit_bias",
        "cope_positions",
        "cope_scale_positions",
        "cope_gates",
        "path_w_rank",
        "path_conv",
    }
    assert set(families.continuous_keys()) == {"rope_base", "alibi_slope_scale", "fire_init_c"}
    assert families.owners("t5_max_distance") == ("t5",)
    assert set(families.owners("kerple_per_layer")) == {"kerple_power", "kerple_log"}
    assert families.owners("max_len") == ("learned", "cope")  # CoPE reads the learned key too


def test_cope_settings_size_the_table_from_max_len_and_refuse_bad_values():
    assert families.CopeSettings(max_len=64).table_size == 65  # the reference's block size + 1
    assert families.CopeSettings(positions=16, max_len=64).table_size == 16
    assert families.CopeSettings.from_keys({"max_len": 32, "cope_positions": 0}).table_size == 33
    for key, bad in (("cope_positions", -1), ("cope_positions", 2.5), ("max_len", 0)):
        with pytest.raises(ValueError, match=f"config.model.{key}="):
            families.CopeSettings.from_keys({key: bad}).validate(CTX)
    with pytest.raises(ValueError, match="cope_scale_positions"):
        families.CopeSettings(scale_positions="yes").validate(CTX)
    with pytest.raises(ValueError, match="config.model.cope_gates='queries'.*'keys', 'values'"):
        families.CopeSettings(gates="queries").validate(CTX)


def test_sandwich_dim_sets_d_bar_and_zero_means_the_head_dim():
    spec = families.get("sandwich").bias
    q, k = jnp.arange(40), jnp.arange(40)
    for dim, d_bar in ((0, CTX.head_dim), (128, 128)):
        settings = families.SandwichSettings(dim=dim)
        settings.validate(CTX)
        got = spec.bind(CTX, settings)({}, q, k)
        want = positions.sandwich_bias(
            jnp.abs(q[:, None] - k[None, :]), head_dim=d_bar, num_heads=CTX.num_heads
        )
        np.testing.assert_array_equal(got, want)
    for bad in (3, -2, 1.5):
        with pytest.raises(ValueError, match="sandwich_dim"):
            families.SandwichSettings(dim=bad).validate(CTX)


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
    with pytest.raises(ValueError, match="contextual .CoPE. family carries no other"):
        families.register(
            families.Family(
                "cope_abs", settings=families.CopeSettings, contextual=True, embedding="sinusoidal"
            )
        )
    with pytest.raises(ValueError, match="already registered"):
        families.register(families.Family("rope"))
    assert not {"t5_clash", "rot", "table", "cope_abs"} & set(families.names())
