"""The model's RoPE settings for partial rotary (`model.rope_partial_factor`), proportional RoPE
(`model.rope_proportion`) and LongRoPE (`model.rope_scaling` with rope_type 'longrope'): config
keys, their checks before compute, and the `Rotary` layer they build (docs/rope.md,
docs/families.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT
from flax import nnx

from posattn import config as config_lib
from posattn import families, rotary
from posattn.nn import decode, layers
from posattn.train import steps

CTX = families.Context(num_heads=4, head_dim=16)
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.02 * k for k in range(8)],
    "long_factor": [1.0 + 0.25 * k**1.5 for k in range(8)],
    "original_max_position_embeddings": 16,
    "max_position_embeddings": 64,
}


def make_cfg(**model):
    config = config_lib.load_config(
        ROOT / "configs" / "tiny.py",
        [
            f"--config.model.{k}={v}"
            for k, v in {"d_model": 64, "num_heads": 4, "num_layers": 1, **model}.items()
        ],
    )
    return config_lib.validate(config)


def test_default_settings_build_the_same_rotary_as_before():
    settings = families.RopeSettings()
    assert settings.rope_parameters is None
    assert settings.to_keys()["rope_partial_factor"] == 1.0
    assert settings.to_keys()["rope_proportion"] == 1.0
    module = layers.Rotary(16, settings)
    np.testing.assert_array_equal(module.inv_freq[...], rotary.rope_frequencies(16)[0])
    assert module.scaling is None and not module.dynamic


def test_the_factors_fold_into_the_hugging_face_dict():
    partial = families.RopeSettings(
        partial_factor=0.25,
        scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    )
    assert partial.rope_parameters == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "partial_rotary_factor": 0.25,
    }
    proportional = families.RopeSettings(proportion=0.25, base=1e6)
    assert proportional.rope_parameters == {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
    }
    linear = families.RopeSettings(proportion=0.5, scaling={"type": "proportional", "factor": 2.0})
    assert linear.rope_parameters == {
        "rope_type": "proportional",
        "factor": 2.0,
        "partial_rotary_factor": 0.5,
    }
    for settings in (partial, proportional, linear):
        settings.validate(CTX)


def test_longrope_lists_are_kept_hashable():
    settings = families.RopeSettings(scaling=LONGROPE)
    hash(settings)
    assert settings.scaling_dict["short_factor"] == tuple(LONGROPE["short_factor"])
    settings.validate(CTX)
    assert "longrope" in settings.not_continuous()["rope_base"]
    module = layers.Rotary(16, settings)
    assert module.dynamic
    x = jax.random.normal(jax.random.key(0), (2, 20, 4, 16))
    positions = jnp.arange(20)
    # Up to the original length (16) the short factors, past it the long ones, as HF's
    # longrope_frequency_update.
    for seq_len in (16, 17):
        want = rotary.apply_rope(
            x,
            positions,
            rotary.rope_frequencies(16, scaling=LONGROPE, seq_len=seq_len)[0],
            attention_factor=rotary.rope_frequencies(16, scaling=LONGROPE)[1],
        )
        np.testing.assert_allclose(module(x, positions, seq_len=seq_len), want, rtol=1e-6)
    per_row = module(x, positions, seq_len=jnp.array([16, 17]))
    np.testing.assert_allclose(per_row[0], module(x, positions, seq_len=16)[0], rtol=1e-6)
    np.testing.assert_allclose(per_row[1], module(x, positions, seq_len=17)[1], rtol=1e-6)


@pytest.mark.parametrize(
    "settings, words",
    [
        (families.RopeSettings(partial_factor=1.5), ["model.rope_partial_factor=1.5", "(0, 1]"]),
        (families.RopeSettings(partial_factor=0.0), ["model.rope_partial_factor=0.0", "(0, 1]"]),
        (families.RopeSettings(partial_factor=True), ["model.rope_partial_factor=True", "(0, 1]"]),
        (families.RopeSettings(proportion=-0.5), ["model.rope_proportion=-0.5", "(0, 1]"]),
        (
            families.RopeSettings(partial_factor=0.1),
            ["model.rope_partial_factor=0.1", "R = int(H * p) = 1", "R >= 2"],
        ),
        (
            families.RopeSettings(proportion=0.1),
            ["model.rope_proportion=0.1", "int(p * H // 2) = 0"],
        ),
        (
            families.RopeSettings(partial_factor=0.5, proportion=0.5),
            ["model.rope_partial_factor=0.5", "model.rope_proportion=0.5", "set one"],
        ),
        (
            families.RopeSettings(partial_factor=0.5, scaling={"partial_rotary_factor": 0.25}),
            ["model.rope_partial_factor=0.5", "partial_rotary_factor=0.25", "set one"],
        ),
        (
            families.RopeSettings(
                partial_factor=0.5,
                scaling={"rope_type": "proportional", "partial_rotary_factor": 0.5},
            ),
            ["model.rope_partial_factor=0.5", "'proportional'", "model.rope_proportion"],
        ),
        (
            families.RopeSettings(proportion=0.25, scaling={"rope_type": "linear", "factor": 2.0}),
            ["model.rope_proportion=0.25", "no 'linear' scaling", "'proportional'"],
        ),
        (
            families.RopeSettings(scaling={**LONGROPE, "long_factor": [1.0] * 7}),
            ["model.rope_scaling", "'long_factor'", "7 entries", "8 pairs"],
        ),
        (
            families.RopeSettings(partial_factor=0.5, scaling=LONGROPE),
            ["model.rope_scaling with model.rope_partial_factor=0.5", "'short_factor'", "4 pairs"],
        ),
    ],
)
def test_bad_settings_fail_naming_the_key(settings, words):
    with pytest.raises(ValueError) as error:
        settings.validate(CTX)
    for word in words:
        assert word in str(error.value), (word, str(error.value))


def test_a_partial_rotary_model_has_the_default_parameter_tree():
    default = make_cfg(position="rope")
    partial = make_cfg(position="rope", rope_partial_factor=0.25, rope_layout="half")
    assert partial.settings.partial_factor == 0.25
    _, params, _ = steps.init_model(default, jax.random.key(0))
    graphdef, partial_params, constants = steps.init_model(partial, jax.random.key(0))
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, partial_params)
    # head 16 with p = 0.25: R = 4, two frequencies base^(0/4), base^(-2/4).
    inv_freq = [
        leaf for path, leaf in jax.tree.leaves_with_path(constants) if "inv_freq" in str(path)
    ]
    assert inv_freq and all(np.allclose(f, [1.0, 0.01]) for f in inv_freq)
    model = nnx.merge(graphdef, partial_params, constants)
    tokens = jnp.arange(24).reshape(2, 12) % 50
    logits = jax.jit(lambda t: model(t))(tokens)
    assert logits.shape[:2] == (2, 12) and bool(jnp.all(jnp.isfinite(logits)))


def test_the_keys_are_refused_with_another_family_and_checked_before_compute():
    with pytest.raises(ValueError, match="rope_partial_factor"):
        make_cfg(position="alibi", rope_partial_factor=0.5)
    with pytest.raises(ValueError, match=r"model.rope_proportion=2.0"):
        make_cfg(position="rope", rope_proportion=2.0)
    cfg = make_cfg(position="rope", rope_proportion=0.25, rope_base=1e6)
    assert cfg.settings.rope_parameters == {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
    }


def test_longrope_from_a_command_line_dict_literal():
    literal = (
        "{'rope_type': 'longrope', 'short_factor': [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7], "
        "'long_factor': [2, 2, 2, 2, 3, 3, 3, 3], 'original_max_position_embeddings': 16, "
        "'max_position_embeddings': 64}"
    )
    cfg = make_cfg(position="rope", rope_scaling=literal)
    hash(cfg)  # the lists became tuples: the config keys jit caches
    params = cfg.settings.rope_parameters
    assert params["long_factor"] == (2, 2, 2, 2, 3, 3, 3, 3)
    inv_freq, factor = rotary.rope_frequencies(16, scaling=params, seq_len=17)
    np.testing.assert_allclose(
        inv_freq,
        10000.0 ** (-np.arange(0, 16, 2) / 16) / np.array(params["long_factor"]),
        rtol=1e-6,
    )
    assert factor == pytest.approx((1 + np.log(4) / np.log(16)) ** 0.5)


@pytest.mark.parametrize(
    "model",
    [
        {"rope_partial_factor": 0.25, "rope_layout": "half"},
        {"rope_proportion": 0.25, "rope_base": 1e6},
    ],
    ids=["partial-half", "proportional-interleaved"],
)
def test_cached_decoding_equals_the_full_forward(model):
    # Partial and proportional frequencies do not depend on the length: keys rotated when
    # written stay right, so prefill + cached steps give the full forward's logits.
    cfg = make_cfg(position="rope", **model)
    graphdef, params, constants = steps.init_model(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, 256)

    def run(params, constants, tokens):
        full = nnx.merge(graphdef, params, constants)(tokens)
        cache = decode.init_cache(cfg, batch_size=2, capacity=10)
        lengths = jnp.array([6, 6], jnp.int32)
        first, cache = decode.prefill(graphdef, params, constants, cache, tokens[:, :6], lengths)

        def body(cache, tok):
            out, cache = decode.decode_step(graphdef, params, constants, cache, tok)
            return cache, out

        _, outs = jax.lax.scan(body, cache, tokens[:, 6:].T)
        return full[:, 5:], jnp.concatenate([first[:, None], outs.transpose(1, 0, 2)], axis=1)

    full, cached = jax.jit(run)(params, constants, tokens)
    np.testing.assert_allclose(cached, full, rtol=1e-5, atol=2e-5)
