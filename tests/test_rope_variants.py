"""Partial rotary, proportional rotary (Gemma 4's p-RoPE) and LongRoPE in posattn.rotary, against
Hugging Face transformers' values (tests/goldens/rope_goldens.json, written by
tests/goldens/make_rope_goldens.py; the JSON is committed, so nothing here needs transformers) and
against their defining properties. Formulas and references: docs/rope.md.
"""

import json
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posattn.rotary import apply_rope, rope_frequencies, validate_rope_scaling

GOLDENS = json.loads((pathlib.Path(__file__).parent / "goldens" / "rope_goldens.json").read_text())
FREQ = GOLDENS["frequencies"]
ROT = GOLDENS["rotations"]
rope = jax.jit(apply_rope, static_argnames="layout")


def pseudo_random(shape, seed):
    """The inputs of the goldens script (and of tests/test_rotary.py): exact in float32."""
    n = np.arange(int(np.prod(shape)), dtype=np.uint64)
    h = (n * np.uint64(2654435761) + np.uint64(seed) * np.uint64(40503)) % np.uint64(2**32)
    return ((h >> np.uint64(12)).astype(np.float64) / 2**18 - 2.0).reshape(shape).astype(np.float32)


def ulps(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


def rotate_reference(x, positions, inv_freq, layout, factor=1.0):
    """float64 re-derivation from the HF formulas: rotate the first 2F dims, pass the rest."""
    x = np.asarray(x, np.float64)
    f = len(inv_freq)
    angle = np.asarray(positions, np.float64)[..., None] * np.asarray(inv_freq, np.float64)
    cos, sin = (np.cos(angle) * factor)[..., None, :], (np.sin(angle) * factor)[..., None, :]
    out = x.copy()
    if layout == "half":
        a, b = x[..., :f], x[..., f : 2 * f]
        out[..., :f], out[..., f : 2 * f] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = x[..., 0 : 2 * f : 2], x[..., 1 : 2 * f : 2]
        out[..., 0 : 2 * f : 2], out[..., 1 : 2 * f : 2] = a * cos - b * sin, a * sin + b * cos
    return out


# ------------------------------------------------------------------------------- frequencies
def test_goldens_were_made_by_the_committed_script():
    assert GOLDENS["made_by"] == "tests/goldens/make_rope_goldens.py"
    assert GOLDENS["versions"]["transformers"] == "5.24.0"
    assert len(FREQ) == 29 and len(ROT) == 5


@pytest.mark.parametrize("name", sorted(FREQ))
def test_frequencies_and_attention_factor_match_hugging_face(name):
    case = FREQ[name]
    inv_freq, factor = rope_frequencies(
        case["head_dim"], base=case["base"], scaling=case["scaling"], seq_len=case["seq_len"]
    )
    assert inv_freq.dtype == jnp.float32
    assert inv_freq.shape == (len(case["inv_freq"]),)
    # HF evaluates in float32 (a few ulp off float64); posattn rounds float64 once. Measured max: 4.
    assert ulps(inv_freq, case["inv_freq"]).max() <= 4
    assert factor == pytest.approx(case["attention_factor"], rel=1e-12)


def test_partial_rotary_takes_frequencies_over_the_rotary_dim_with_hf_rounding():
    # R = int(H p): 16 * 0.25 = 4 -> 2 frequencies base^(-0/4), base^(-2/4).
    inv_freq, _ = rope_frequencies(16, scaling={"partial_rotary_factor": 0.25})
    np.testing.assert_allclose(inv_freq, [1.0, 0.01], rtol=1e-7)
    # Odd R = int(20 * 0.25) = 5: HF's arange(0, 5, 2) gives 3 frequencies over 5 (6 dims turn).
    inv_freq, _ = rope_frequencies(20, scaling={"partial_rotary_factor": 0.25})
    np.testing.assert_allclose(inv_freq, 10000.0 ** (-np.arange(0, 5, 2) / 5), rtol=1e-7)
    # Truncation, not rounding: int(64 * 0.3) = int(19.2) = 19 -> 10 frequencies over 19.
    inv_freq, _ = rope_frequencies(64, scaling={"partial_rotary_factor": 0.3})
    np.testing.assert_allclose(inv_freq, 10000.0 ** (-np.arange(0, 19, 2) / 19), rtol=1e-6)
    # p = 1 is the plain rope, bit for bit.
    np.testing.assert_array_equal(
        rope_frequencies(64, scaling={"partial_rotary_factor": 1.0})[0], rope_frequencies(64)[0]
    )


def test_proportional_keeps_the_whole_head_formula_and_zeroes_the_slow_pairs():
    for head_dim, p in [(16, 0.25), (64, 0.5), (256, 0.25), (48, 0.3)]:
        inv_freq, factor = rope_frequencies(
            head_dim, scaling={"rope_type": "proportional", "partial_rotary_factor": p}
        )
        turning = int(p * head_dim // 2)
        assert inv_freq.shape == (head_dim // 2,) and factor == 1.0
        full = rope_frequencies(head_dim)[0]
        np.testing.assert_array_equal(inv_freq[:turning], full[:turning])
        assert not np.any(inv_freq[turning:])
    # Not the same as partial rotary at the same p: frequencies over H, not over R = p H.
    partial = rope_frequencies(16, scaling={"partial_rotary_factor": 0.25})[0]
    proportional = rope_frequencies(
        16, scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25}
    )[0]
    assert partial[1] == pytest.approx(0.01) and proportional[1] == pytest.approx(10**-0.5)


def test_longrope_switches_to_the_long_factors_past_the_original_length():
    case = FREQ["longrope_inferred_1000"]
    scaling = case["scaling"]
    theta = 10000.0 ** (-np.arange(0, 32, 2) / 32)
    for seq_len, factors in [
        (None, "short_factor"),
        (1, "short_factor"),
        (256, "short_factor"),
        (257, "long_factor"),
        (10**6, "long_factor"),
    ]:
        inv_freq, factor = rope_frequencies(32, scaling=scaling, seq_len=seq_len)
        np.testing.assert_allclose(inv_freq, theta / np.array(scaling[factors]), rtol=1e-6)
        # s = max_position_embeddings / m_l = 4: sqrt(1 + ln 4 / ln 256) = sqrt(1.25).
        assert factor == pytest.approx(1.25**0.5, rel=1e-15)


def test_longrope_traced_length_picks_the_factors_in_one_trace():
    scaling = FREQ["longrope_inferred_1000"]["scaling"]
    traces = []

    @jax.jit
    def frequencies(seq_len):
        traces.append(1)
        return rope_frequencies(32, scaling=scaling, seq_len=seq_len)[0]

    for seq_len in (100, 256, 257, 1000):
        np.testing.assert_array_equal(
            frequencies(jnp.int32(seq_len)),
            rope_frequencies(32, scaling=scaling, seq_len=seq_len)[0],
        )
    assert len(traces) == 1


def test_variants_accept_a_traced_base():
    bases = jnp.array([1e4, 5e5])
    for scaling in (
        {"partial_rotary_factor": 0.25},
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 2048,
            "partial_rotary_factor": 0.5,
        },
        {"rope_type": "proportional", "partial_rotary_factor": 0.25},
        FREQ["partial_0.5_longrope_h32"]["scaling"],
    ):
        swept = jax.jit(
            jax.vmap(lambda b, scaling=scaling: rope_frequencies(32, base=b, scaling=scaling)[0])
        )(bases)
        for row, base in zip(swept, [1e4, 5e5], strict=True):
            host = rope_frequencies(32, base=base, scaling=scaling)[0]
            assert row.shape == host.shape and ulps(row, host).max() <= 8


def test_a_rope_theta_equal_to_the_base_is_taken_and_a_different_one_refused():
    """transformers 5 keeps the base in `rope_parameters` and writes it into a `rope_scaling`
    dict a config is built with: that dict gives the frequencies of the dict without it."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    for scaling in (None, yarn, {"partial_rotary_factor": 0.5}):
        plain = rope_frequencies(32, base=5e5, scaling=scaling)
        given = {**(scaling or {"rope_type": "default"}), "rope_theta": 5e5}
        with_theta = rope_frequencies(32, base=5e5, scaling=given)
        np.testing.assert_array_equal(with_theta[0], plain[0])
        assert with_theta[1] == plain[1]
    with pytest.raises(ValueError, match=r"'rope_theta'\] = 10000.0 .*differs from base = 5000"):
        rope_frequencies(32, base=5e5, scaling={**yarn, "rope_theta": 1e4})
    with pytest.raises(ValueError, match="traced"):
        jax.jit(lambda b: rope_frequencies(32, base=b, scaling={**yarn, "rope_theta": 5e5})[0])(
            jnp.float32(5e5)
        )
    with pytest.raises(ValueError, match="model.rope_base"):  # no base to compare it with
        validate_rope_scaling({**yarn, "rope_theta": 5e5}, 32)


def test_a_dict_transformers_wrote_the_base_into_gives_its_frequencies():
    """Live: the dict given to a transformers config, as transformers left it, against
    transformers' own frequencies (skipped without transformers)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for scaling in (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    ):
        config = transformers.LlamaConfig(
            hidden_size=128,
            num_attention_heads=4,
            head_dim=32,
            rope_theta=5e5,
            max_position_embeddings=32768,
            rope_scaling=scaling,
        )
        inv_freq, factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
        ours, our_factor = rope_frequencies(32, base=5e5, scaling=scaling)
        np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=2e-6)
        assert our_factor == pytest.approx(factor, rel=1e-6)


def test_normalised_dict_is_hashable_and_reusable():
    scaling = FREQ["longrope_inferred_1000"]["scaling"]
    normalised = validate_rope_scaling(scaling, 32)
    assert isinstance(normalised["short_factor"], tuple)
    hash(tuple(sorted(normalised.items())))
    assert normalised["partial_rotary_factor"] == 1.0 and normalised["factor"] is None
    assert validate_rope_scaling(normalised, 32) == normalised


# ---------------------------------------------------------------------------------- rotations
@pytest.mark.parametrize("name", sorted(ROT))
def test_rotation_matches_hugging_face(name):
    case = ROT[name]
    x = pseudo_random(tuple(case["shape"]), case["seed"])
    inv_freq = jnp.array(case["inv_freq"], jnp.float32)
    out = rope(
        x,
        jnp.array(case["positions"]),
        inv_freq,
        layout=case["layout"],
        attention_factor=case["attention_factor"],
    )
    want = np.reshape(case["out"], x.shape)
    # The goldens are float64 rotations of the float32 frequencies; |values| <= 2.3.
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    rotated = 2 * len(case["inv_freq"])
    # The dims past 2F are HF's pass-through: bit for bit the input (no attention factor).
    np.testing.assert_array_equal(np.asarray(out)[..., rotated:], x[..., rotated:])


def test_rotation_goldens_use_the_frequencies_posattn_computes():
    for rotation, frequency in [
        ("neox_partial_0.25_h16", "partial_0.25_h16"),
        ("neox_partial_0.5_yarn_h64", "partial_0.5_yarn_h64"),
        ("neox_partial_odd_h20", "partial_odd_h20"),
        ("gemma4_proportional_0.25_h16", "proportional_0.25_h16"),
    ]:
        assert ROT[rotation]["inv_freq"] == FREQ[frequency]["inv_freq"]
    # GPT-J's rotary_dim = 8 of head 16 is partial_rotary_factor 0.5 with the default rope.
    ours = rope_frequencies(16, scaling={"partial_rotary_factor": 0.5})[0]
    assert ulps(ours, ROT["gptj_rotary_dim_8_h16"]["inv_freq"]).max() <= 1


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("head_dim, p", [(16, 0.25), (16, 0.5), (20, 0.25), (64, 0.25), (80, 0.5)])
def test_partial_rotation_rotates_the_first_dims_and_passes_the_rest(layout, head_dim, p):
    x = pseudo_random((2, 5, 3, head_dim), seed=21)
    positions = jnp.array([[0, 3, 100, 4096, 77_777], [1, 2, 3, 4, 5]])
    inv_freq, _ = rope_frequencies(head_dim, scaling={"partial_rotary_factor": p})
    out = np.asarray(rope(x, positions, inv_freq, layout=layout))
    want = rotate_reference(x, positions, inv_freq, layout)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    rotated = 2 * len(inv_freq)
    np.testing.assert_array_equal(out[..., rotated:], x[..., rotated:])
    # The rotated part is the full rotation of a head of 2F dims with the same frequencies.
    np.testing.assert_array_equal(
        out[..., :rotated], np.asarray(rope(x[..., :rotated], positions, inv_freq, layout=layout))
    )
    # Norm preserved, per head.
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=2e-6)


def test_what_p_quarter_leaves_unrotated_with_heads_of_16():
    # docs/rope.md: partial p = 0.25 turns dims 0-3 (half layout pairs (0, 2), (1, 3);
    # interleaved (0, 1), (2, 3)) and leaves 4-15; proportional p = 0.25 turns pairs k = 0, 1,
    # i.e. half-layout dims 0, 1, 8, 9, and leaves 2-7 and 10-15.
    x = pseudo_random((1, 1, 1, 16), seed=22)
    positions = jnp.array([1])

    def turned(scaling, layout):
        inv_freq, _ = rope_frequencies(16, scaling=scaling)
        out = np.asarray(rope(x, positions, inv_freq, layout=layout))
        return sorted(np.flatnonzero(out.ravel() != x.ravel()).tolist())

    partial = {"partial_rotary_factor": 0.25}
    proportional = {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    assert turned(partial, "half") == [0, 1, 2, 3]
    assert turned(partial, "interleaved") == [0, 1, 2, 3]
    assert turned(proportional, "half") == [0, 1, 8, 9]
    assert turned(proportional, "interleaved") == [0, 1, 2, 3]


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize(
    "scaling",
    [
        {"partial_rotary_factor": 0.25},
        {"rope_type": "proportional", "partial_rotary_factor": 0.25},
    ],
)
def test_scores_depend_only_on_the_offset(layout, scaling):
    inv_freq, _ = rope_frequencies(64, scaling=scaling)
    shifts = jnp.array([0, 1, 4095, 123_457, 999_999])
    q = jnp.broadcast_to(pseudo_random((1, 1, 64), seed=23), (5, 1, 64))
    k = jnp.broadcast_to(pseudo_random((1, 1, 64), seed=24), (5, 1, 64))
    for m, n in [(3, 0), (0, 3), (1000, 17)]:
        scores = jnp.sum(
            rope(q, m + shifts, inv_freq, layout=layout)
            * rope(k, n + shifts, inv_freq, layout=layout),
            axis=(-1, -2),
        )
        assert float(jnp.max(scores) - jnp.min(scores)) < 1e-4
    # ... and do depend on it (the rotated part is not empty).
    a = jnp.sum(rope(q[:1], jnp.array([5]), inv_freq, layout=layout) * k[:1])
    b = jnp.sum(rope(q[:1], jnp.array([6]), inv_freq, layout=layout) * k[:1])
    assert abs(float(a - b)) > 1e-3


def test_attention_factor_scales_only_the_rotated_dims():
    case = FREQ["partial_0.5_yarn_h64"]
    inv_freq, factor = rope_frequencies(64, scaling=case["scaling"])
    x = pseudo_random((2, 4, 2, 64), seed=25)
    out = np.asarray(rope(x, jnp.arange(4) * 999, inv_freq, layout="half", attention_factor=factor))
    np.testing.assert_allclose(
        np.linalg.norm(out[..., :32], axis=-1),
        factor * np.linalg.norm(x[..., :32], axis=-1),
        rtol=2e-6,
    )
    np.testing.assert_array_equal(out[..., 32:], x[..., 32:])


def test_partial_rotation_keeps_dtype_and_works_under_jit_vmap_and_eval_shape():
    inv_freq, _ = rope_frequencies(32, scaling={"partial_rotary_factor": 0.25})
    x = pseudo_random((3, 6, 2, 32), seed=26)
    xb = jnp.asarray(x, jnp.bfloat16)
    out = rope(xb, jnp.arange(6), inv_freq, layout="half")
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out[..., 8:]), np.asarray(xb[..., 8:]))
    positions = jnp.arange(18).reshape(3, 6) * 1000
    direct = apply_rope(x, positions, inv_freq, layout="interleaved")
    mapped = jax.jit(jax.vmap(lambda a, b: apply_rope(a, b, inv_freq)))(x, positions)
    chex.assert_trees_all_close(direct, mapped, rtol=1e-6, atol=1e-6)
    swept = jax.jit(
        jax.vmap(
            lambda b: apply_rope(
                x,
                positions,
                rope_frequencies(32, base=b, scaling={"partial_rotary_factor": 0.5})[0],
            )
        )
    )(jnp.array([1e4, 1e6]))
    chex.assert_shape(swept, (2, *x.shape))
    big = jax.eval_shape(
        lambda a, b: apply_rope(a, b, inv_freq, layout="half"),
        jax.ShapeDtypeStruct((8, 4096, 32, 32), jnp.bfloat16),
        jax.ShapeDtypeStruct((8, 4096), jnp.int32),
    )
    assert big.shape == (8, 4096, 32, 32) and big.dtype == jnp.bfloat16


def test_apply_rope_refuses_frequencies_that_do_not_fit_the_head():
    x = jnp.zeros((4, 2, 8))
    for inv_freq in (jnp.ones(5), jnp.ones(0), jnp.ones((2, 2))):
        with pytest.raises(ValueError, match=r"1 <= F <= 4 for head dim 8"):
            apply_rope(x, jnp.arange(4), inv_freq)


# --------------------------------------------------------------------------------- validation
LONG = FREQ["longrope_inferred_1000"]["scaling"]
PROP = {"rope_type": "proportional", "partial_rotary_factor": 0.25}


@pytest.mark.parametrize(
    "scaling, head_dim, fragments",
    [
        ({"partial_rotary_factor": 0.0}, 64, ["'partial_rotary_factor'", "0.0", "(0, 1]"]),
        ({"partial_rotary_factor": 1.5}, 64, ["'partial_rotary_factor'", "1.5", "(0, 1]"]),
        ({"partial_rotary_factor": -0.25}, 64, ["'partial_rotary_factor'", "-0.25", "(0, 1]"]),
        ({"partial_rotary_factor": True}, 64, ["'partial_rotary_factor'", "True", "(0, 1]"]),
        ({"partial_rotary_factor": "0.5"}, 64, ["'partial_rotary_factor'", "'0.5'", "(0, 1]"]),
        (
            {"partial_rotary_factor": 0.1},
            16,
            ["'partial_rotary_factor'", "0.1", "R = int(H * p) = 1"],
        ),
        (
            {
                "rope_type": "dynamic",
                "factor": 2.0,
                "original_max_position_embeddings": 64,
                "partial_rotary_factor": 0.125,
            },
            16,
            ["'partial_rotary_factor'", "0.125", "R = int(H * p) = 2", "R >= 4"],
        ),
        (
            {
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 64,
                "partial_rotary_factor": 0.25,
            },
            20,
            ["'partial_rotary_factor'", "0.25", "odd R = int(H * p) = 5", "'yarn'"],
        ),
        ({**PROP, "partial_rotary_factor": 0.0}, 16, ["'partial_rotary_factor'", "0.0", "(0, 1]"]),
        (
            {**PROP, "partial_rotary_factor": 0.1},
            16,
            ["'partial_rotary_factor'", "0.1", "int(p * H // 2) = 0", "p >= 2 / H"],
        ),
        ({**PROP, "factor": 0.5}, 16, ["'factor'", "0.5", ">= 1"]),
        ({**PROP, "beta_fast": 32}, 16, ["'beta_fast'", "'proportional' takes the keys"]),
        (
            {k: v for k, v in LONG.items() if k != "short_factor"},
            32,
            ["'longrope'", "missing 'short_factor'"],
        ),
        (
            {**LONG, "long_factor": LONG["long_factor"][:-1]},
            32,
            ["'long_factor'", "15 entries", "rotates 16 pairs"],
        ),
        (
            {**LONG, "partial_rotary_factor": 0.5},
            32,
            ["'short_factor'", "16 entries", "partial_rotary_factor 0.5 rotates 8 pairs"],
        ),
        ({**LONG, "short_factor": [1.0] * 15 + [0.0]}, 32, ["'short_factor'", "numbers > 0"]),
        ({**LONG, "short_factor": "1.0"}, 32, ["'short_factor'", "'1.0'", "a list of numbers"]),
        ({**LONG, "long_factor": 2.0}, 32, ["'long_factor'", "2.0", "a list of numbers"]),
        (
            {k: v for k, v in LONG.items() if k != "max_position_embeddings"},
            32,
            ["missing 'factor' and 'max_position_embeddings'", "config.max_position_embeddings"],
        ),
        ({**LONG, "max_position_embeddings": 0.5}, 32, ["'max_position_embeddings'", "0.5"]),
        ({**LONG, "attention_factor": 0.0}, 32, ["'attention_factor'", "0.0", "> 0"]),
        ({**LONG, "factor": 0.5}, 32, ["'factor'", "0.5", ">= 1"]),
        (
            {**LONG, "original_max_position_embeddings": 1},
            32,
            ["'original_max_position_embeddings'", "= 1", ">= 2"],
        ),
        ({**LONG, "beta_fast": 32}, 32, ["'beta_fast'", "'longrope' takes the keys"]),
    ],
)
def test_invalid_settings_are_refused_naming_key_value_and_allowed(scaling, head_dim, fragments):
    for check in (
        lambda: validate_rope_scaling(scaling, head_dim),
        lambda: rope_frequencies(head_dim, scaling=scaling),
    ):
        with pytest.raises(ValueError) as error:
            check()
        for fragment in fragments:
            assert fragment in str(error.value)
