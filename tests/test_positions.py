"""Tests for posattn.positions: golden values from the reference code, properties, jit/vmap, grads.

Golden values were produced by running (or reading) the cited reference code outside this repo;
the source of each is named next to it. Nothing here imports torch or transformers.
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posattn import positions as P

F32_EPS = float(np.finfo(np.float32).eps)


# ------------------------------------------------------------------------------------------
# Sinusoidal
# ------------------------------------------------------------------------------------------

# harvardnlp/annotated-transformer, the_annotated_transformer.py, `PositionalEncoding`
# (pe[:, 0::2] = sin(position * div_term), pe[:, 1::2] = cos(...)), run in torch float32,
# d_model = 8, positions [0, 1, 7, 100], rounded to 7 decimals.
SINUSOIDAL_GOLDEN = [
    [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0],
    [0.841471, 0.5403023, 0.0998334, 0.9950042, 0.0099998, 0.99995, 0.001, 0.9999995],
    [0.6569866, 0.7539023, 0.6442176, 0.7648422, 0.0699428, 0.997551, 0.0069999, 0.9999755],
    [-0.5063657, 0.8623189, -0.5440203, -0.839072, 0.841471, 0.5403023, 0.0998334, 0.9950042],
]


def _sinusoidal_closed_form(pos, dim):
    # Vaswani et al. 2017, §3.5, in float64: PE(i, 2k) = sin(i / 10000^(2k/d)), PE(i, 2k+1) = cos.
    col = np.arange(dim)
    angle = pos[:, None].astype(np.float64) / 10000.0 ** (2 * (col // 2) / dim)
    return np.where(col % 2 == 0, np.sin(angle), np.cos(angle))


def test_sinusoidal_golden_annotated_transformer():
    out = P.sinusoidal(jnp.array([0, 1, 7, 100]), 8)
    chex.assert_shape(out, (4, 8))
    chex.assert_type(out, jnp.float32)
    np.testing.assert_allclose(out, SINUSOIDAL_GOLDEN, atol=2e-6)


@pytest.mark.parametrize("dim", [64, 7, 1])
def test_sinusoidal_matches_closed_form(dim):
    pos = np.arange(0, 1024, 3)
    out = np.asarray(P.sinusoidal(pos, dim))
    # The angle is one float32 product: error <= ~1 ulp of the largest angle.
    np.testing.assert_allclose(
        out, _sinusoidal_closed_form(pos, dim), atol=2 * F32_EPS * 1024 + 1e-6
    )
    assert out.shape == (len(pos), dim)


# ------------------------------------------------------------------------------------------
# Learned absolute embeddings
# ------------------------------------------------------------------------------------------


def test_learned_embedding_exact_in_range_and_keeps_dtype():
    table = jnp.arange(5 * 3, dtype=jnp.bfloat16).reshape(5, 3)
    pos = jnp.array([[0, 4], [2, 2]])
    out = P.learned_embedding(table, pos)
    chex.assert_type(out, jnp.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(out, np.float32), np.asarray(table, np.float32)[np.asarray(pos)]
    )


def test_learned_embedding_raises_on_concrete_out_of_range():
    table = jnp.zeros((16, 4))
    with pytest.raises(
        ValueError, match=r"position 20 .* only 16 positions.*model\.max_len.*relative"
    ):
        P.learned_embedding(table, np.array([0, 5, 20]))
    with pytest.raises(ValueError, match="negative position -1"):
        P.learned_embedding(table, np.array([-1, 3]))
    with pytest.raises(TypeError):
        P.learned_embedding(table, np.array([0.0, 1.0]))


def test_learned_embedding_traced_out_of_range_is_nan_not_clamped():
    table = jnp.arange(4 * 2, dtype=jnp.float32).reshape(4, 2)
    pos = jnp.array([0, 3, 4, 9, -1])  # -1 would wrap and 4, 9 would clamp in plain indexing
    for fn in (jax.jit(P.learned_embedding), jax.vmap(P.learned_embedding, in_axes=(None, 0))):
        out = np.asarray(fn(table, pos))
        np.testing.assert_array_equal(out[:2], np.asarray(table)[[0, 3]])
        assert np.isnan(out[2:]).all()


# ------------------------------------------------------------------------------------------
# T5 buckets
# ------------------------------------------------------------------------------------------

# google-research/t5x, t5x/examples/t5/layers.py,
# `RelativePositionBiases._relative_position_bucket`, run on relative_position = -offset over
# offsets -3000..3000 (identical output from Hugging Face transformers models/t5/modeling_t5.py
# `T5Attention._relative_position_bucket` for these four configs). Offsets: both sides of every
# bucket boundary, max_distance +-1 and far values.
T5_GOLDEN = {
    (32, 128, False): (
        [
            -3000,
            -1,
            0,
            1,
            2,
            3,
            4,
            5,
            6,
            7,
            8,
            9,
            10,
            11,
            12,
            13,
            14,
            15,
            16,
            18,
            19,
            20,
            21,
            23,
            24,
            26,
            27,
            30,
            31,
            34,
            35,
            39,
            40,
            45,
            46,
            51,
            52,
            58,
            59,
            66,
            67,
            76,
            77,
            86,
            87,
            98,
            99,
            112,
            113,
            127,
            128,
            129,
            3000,
        ],
        [
            0,
            0,
            0,
            1,
            2,
            3,
            4,
            5,
            6,
            7,
            8,
            9,
            10,
            11,
            12,
            13,
            14,
            15,
            16,
            16,
            17,
            17,
            18,
            18,
            19,
            19,
            20,
            20,
            21,
            21,
            22,
            22,
            23,
            23,
            24,
            24,
            25,
            25,
            26,
            26,
            27,
            27,
            28,
            28,
            29,
            29,
            30,
            30,
            31,
            31,
            31,
            31,
            31,
        ],
    ),
    (32, 128, True): (
        [
            -3000,
            -91,
            -90,
            -64,
            -63,
            -46,
            -45,
            -32,
            -31,
            -23,
            -22,
            -16,
            -15,
            -12,
            -11,
            -8,
            -7,
            -6,
            -5,
            -4,
            -3,
            -2,
            -1,
            0,
            1,
            2,
            3,
            4,
            5,
            6,
            7,
            8,
            11,
            12,
            15,
            16,
            22,
            23,
            31,
            32,
            45,
            46,
            63,
            64,
            90,
            91,
            127,
            128,
            129,
            3000,
        ],
        [
            31,
            31,
            30,
            30,
            29,
            29,
            28,
            28,
            27,
            27,
            26,
            26,
            25,
            25,
            24,
            24,
            23,
            22,
            21,
            20,
            19,
            18,
            17,
            0,
            1,
            2,
            3,
            4,
            5,
            6,
            7,
            8,
            8,
            9,
            9,
            10,
            10,
            11,
            11,
            12,
            12,
            13,
            13,
            14,
            14,
            15,
            15,
            15,
            15,
            15,
        ],
    ),
    (32, 1024, False): (
        [
            -3000,
            -1,
            0,
            1,
            2,
            3,
            4,
            5,
            6,
            7,
            8,
            9,
            10,
            11,
            12,
            13,
            14,
            15,
            16,
            20,
            21,
            26,
            27,
            34,
            35,
            45,
            46,
            58,
            59,
            76,
            77,
            98,
            99,
            127,
            128,
            165,
            166,
            215,
            216,
            279,
            280,
            362,
            363,
            469,
            470,
            608,
            609,
            789,
            790,
            1023,
            1024,
            1025,
            3000,
        ],
        [
            0,
            0,
            0,
            1,
            2,
            3,
            4,
            5,
            6,
            7,
            8,
            9,
            10,
            11,
            12,
            13,
            14,
            15,
            16,
            16,
            17,
            17,
            18,
            18,
            19,
            19,
            20,
            20,
            21,
            21,
            22,
            22,
            23,
            23,
            24,
            24,
            25,
            25,
            26,
            26,
            27,
            27,
            28,
            28,
            29,
            29,
            30,
            30,
            31,
            31,
            31,
            31,
            31,
        ],
    ),
    (32, 1024, True): (
        [
            -3000,
            -559,
            -558,
            -305,
            -304,
            -166,
            -165,
            -91,
            -90,
            -50,
            -49,
            -27,
            -26,
            -15,
            -14,
            -8,
            -7,
            -6,
            -5,
            -4,
            -3,
            -2,
            -1,
            0,
            1,
            2,
            3,
            4,
            5,
            6,
            7,
            8,
            14,
            15,
            26,
            27,
            49,
            50,
            90,
            91,
            165,
            166,
            304,
            305,
            558,
            559,
            1023,
            1024,
            1025,
            3000,
        ],
        [
            31,
            31,
            30,
            30,
            29,
            29,
            28,
            28,
            27,
            27,
            26,
            26,
            25,
            25,
            24,
            24,
            23,
            22,
            21,
            20,
            19,
            18,
            17,
            0,
            1,
            2,
            3,
            4,
            5,
            6,
            7,
            8,
            8,
            9,
            9,
            10,
            10,
            11,
            11,
            12,
            12,
            13,
            13,
            14,
            14,
            15,
            15,
            15,
            15,
            15,
        ],
    ),
}


def _t5_reference_float32(offset, bidirectional, num_buckets, max_distance):
    """Independent NumPy float32 re-derivation of the t5x formula (with its eps), n = offset."""
    n = np.asarray(offset, np.int64)
    ret = np.zeros_like(n)
    if bidirectional:
        num_buckets //= 2
        ret = ret + (n < 0) * num_buckets
        n = np.abs(n)
    else:
        n = np.maximum(n, 0)
    max_exact = num_buckets // 2
    with np.errstate(divide="ignore"):
        x = np.log(n.astype(np.float32) / np.float32(max_exact) + np.float32(F32_EPS))
    x = x / np.float32(math.log(max_distance / max_exact)) * np.float32(num_buckets - max_exact)
    large = np.minimum(max_exact + np.where(n < max_exact, 0, x).astype(np.int32), num_buckets - 1)
    return ret + np.where(n < max_exact, n, large)


@pytest.mark.parametrize("config", sorted(T5_GOLDEN))
def test_t5_bucket_golden_boundaries(config):
    num_buckets, max_distance, bidirectional = config
    offsets, expected = T5_GOLDEN[config]
    out = P.t5_bucket(
        jnp.array(offsets),
        bidirectional=bidirectional,
        num_buckets=num_buckets,
        max_distance=max_distance,
    )
    chex.assert_type(out, jnp.int32)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize(
    "num_buckets,max_distance", [(32, 128), (32, 1024), (64, 256), (48, 81), (8, 289)]
)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_t5_bucket_brute_force_against_float32_reference(num_buckets, max_distance, bidirectional):
    nb = 2 * num_buckets if bidirectional and num_buckets < 16 else num_buckets
    offsets = np.arange(-3000, 3001)
    out = P.t5_bucket(
        offsets, bidirectional=bidirectional, num_buckets=nb, max_distance=max_distance
    )
    np.testing.assert_array_equal(
        out, _t5_reference_float32(offsets, bidirectional, nb, max_distance)
    )


def test_t5_bucket_exact_integer_boundaries():
    # (48, 81) causal: log(36/24)/log(81/24)*24 = 8 exactly. t5x (with its eps) gives bucket 32;
    # Hugging Face's torch port (no eps), run in torch 2.13 float32, gives 31 at offset 36.
    out = P.t5_bucket(jnp.array([35, 36, 37]), bidirectional=False, num_buckets=48, max_distance=81)
    np.testing.assert_array_equal(out, [31, 32, 32])
    # (8, 289) causal: log(34/4)/log(289/4)*4 = 2 exactly -> bucket 6 in all-float32 arithmetic
    # (mesh-tensorflow; t5x under NumPy 1.x). The t5x code run under NumPy 2 promotes the division
    # to float64 (NEP 50) and gives 5 at offset 34; we follow the float32 reference.
    out = P.t5_bucket(jnp.array([33, 34, 35]), bidirectional=False, num_buckets=8, max_distance=289)
    np.testing.assert_array_equal(out, [5, 6, 6])


def test_t5_bucket_rejects_bad_settings():
    with pytest.raises(ValueError, match="max_distance"):
        P.t5_bucket(jnp.arange(3), bidirectional=False, num_buckets=32, max_distance=16)
    with pytest.raises(TypeError, match="offset"):
        P.t5_bucket(jnp.arange(3.0), bidirectional=False)


# ------------------------------------------------------------------------------------------
# ALiBi
# ------------------------------------------------------------------------------------------

# ofirpress/attention_with_linear_biases, fairseq/models/transformer.py, `get_slopes`, run and
# cast with torch.Tensor (float32) as the reference does.
ALIBI_GOLDEN = {
    1: [2**-8],
    3: [2**-4, 2**-8, 2**-2],
    6: [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3],
    8: [2.0**-h for h in range(1, 9)],
    12: [2.0**-h for h in range(1, 9)]
    + [0.7071067690849304, 0.3535533845424652, 0.1767766922712326, 0.0883883461356163],
    20: [
        0.7071067690849304,
        0.5,
        0.3535533845424652,
        0.25,
        0.1767766922712326,
        0.125,
        0.0883883461356163,
        0.0625,
        0.04419417306780815,
        0.03125,
        0.022097086533904076,
        0.015625,
        0.011048543266952038,
        0.0078125,
        0.005524271633476019,
        0.00390625,
        0.8408964276313782,
        0.5946035385131836,
        0.4204482138156891,
        0.2973017692565918,
    ],
    24: [
        0.7071067690849304,
        0.5,
        0.3535533845424652,
        0.25,
        0.1767766922712326,
        0.125,
        0.0883883461356163,
        0.0625,
        0.04419417306780815,
        0.03125,
        0.022097086533904076,
        0.015625,
        0.011048543266952038,
        0.0078125,
        0.005524271633476019,
        0.00390625,
        0.8408964276313782,
        0.5946035385131836,
        0.4204482138156891,
        0.2973017692565918,
        0.21022410690784454,
        0.1486508846282959,
        0.10511205345392227,
        0.07432544231414795,
    ],
}


@pytest.mark.parametrize("num_heads", sorted(ALIBI_GOLDEN))
def test_alibi_slopes_golden(num_heads):
    out = P.alibi_slopes(num_heads)
    chex.assert_shape(out, (num_heads,))
    chex.assert_type(out, jnp.float32)
    np.testing.assert_array_equal(out, np.asarray(ALIBI_GOLDEN[num_heads], np.float32))


@pytest.mark.parametrize("num_heads", [2, 4, 16, 32, 64])
def test_alibi_slopes_power_of_two_closed_form(num_heads):
    # Press et al. 2022: m_h = 2^(-8h/n), h = 1..n.
    expected = 2.0 ** (-8.0 * np.arange(1, num_heads + 1) / num_heads)
    np.testing.assert_allclose(P.alibi_slopes(num_heads), expected, rtol=2 * F32_EPS)


def test_alibi_bias_linear_and_row_shift_equivalent_to_fairseq():
    slopes = P.alibi_slopes(8)
    i, j = np.arange(6)[:, None], np.arange(6)[None, :]
    bias = P.alibi_bias(i - j, slopes)
    chex.assert_shape(bias, (8, 6, 6))
    want = -np.asarray(slopes)[:, None, None] * (i - j)
    np.testing.assert_allclose(bias, want, rtol=1e-7, atol=1e-7)
    # Linear in the offset: bias(a + b) = bias(a) + bias(b).
    a, b = jnp.array([3, -2, 7]), jnp.array([5, 4, -1])
    np.testing.assert_allclose(
        P.alibi_bias(a + b, slopes),
        P.alibi_bias(a, slopes) + P.alibi_bias(b, slopes),
        rtol=1e-6,
        atol=1e-6,
    )
    # fairseq adds slope * j (keys' absolute position); softmax over visible keys is identical.
    causal = j <= i
    fairseq = np.asarray(slopes)[:, None, None] * np.broadcast_to(j, (6, 6))
    ours = jax.nn.softmax(jnp.where(causal, bias, -jnp.inf), axis=-1)
    ref = jax.nn.softmax(jnp.where(causal, fairseq, -jnp.inf), axis=-1)
    np.testing.assert_allclose(ours, ref, atol=1e-6)
    # Bidirectional: the caller passes |i - j| (NeMo ALiBiRelativePositionEmbedding, bidirectional).
    sym = P.alibi_bias(jnp.abs(i - j), slopes)
    np.testing.assert_allclose(sym, np.swapaxes(sym, 1, 2))
    assert (np.asarray(sym) <= 0).all()


# ------------------------------------------------------------------------------------------
# Kerple
# ------------------------------------------------------------------------------------------

# chijames/KERPLE, megatron/mpu/layers.py, run in torch float32 on diff = [0, 1, 2, 7, 100, 4096]:
# `ParallelKerplePower.forward`: -bias_a * diff.pow(bias_p), bias_a = r1 = [0.5, 1.3],
# bias_p = r2 = [0.3, 1.7].
# `ParallelKerpleLog.forward`: -bias_p * log(1 + bias_a * diff), bias_p = r1 = [0.5, 1.3],
# bias_a = r2 = [0.3, 1.7].
KERPLE_OFFSETS = [0, 1, 2, 7, 100, 4096]
KERPLE_R1, KERPLE_R2 = [0.5, 1.3], [0.3, 1.7]
KERPLE_POWER_GOLDEN = [
    [0.0, -0.5, -0.6155722141265869, -0.8963950276374817, -1.9905359745025635, -6.062866687774658],
    [
        0.0,
        -1.2999999523162842,
        -4.22371244430542,
        -35.531211853027344,
        -3265.452880859375,
        -1798686.25,
    ],
]
KERPLE_LOG_GOLDEN = [
    [
        0.0,
        -0.13118211925029755,
        -0.2350018173456192,
        -0.5657010674476624,
        -1.7169936895370483,
        -3.5573034286499023,
    ],
    [
        0.0,
        -1.2912273406982422,
        -1.9260858297348022,
        -3.3243954181671143,
        -6.684162139892578,
        -11.50309944152832,
    ],
]


@pytest.mark.parametrize(
    "fn,golden",
    [(P.kerple_power_bias, KERPLE_POWER_GOLDEN), (P.kerple_log_bias, KERPLE_LOG_GOLDEN)],
)
def test_kerple_golden_and_symmetric(fn, golden):
    out = fn(jnp.array(KERPLE_OFFSETS), jnp.array(KERPLE_R1), jnp.array(KERPLE_R2))
    chex.assert_shape(out, (2, len(KERPLE_OFFSETS)))
    chex.assert_type(out, jnp.float32)
    np.testing.assert_allclose(out, golden, rtol=2e-6, atol=1e-7)
    neg = fn(-jnp.array(KERPLE_OFFSETS), jnp.array(KERPLE_R1), jnp.array(KERPLE_R2))
    np.testing.assert_array_equal(neg, out)


def _assert_grad_matches_central_difference(f, x, grad, h, rtol=2e-3):
    """Checks `grad` against (f(x + h) - f(x - h)) / 2h, coordinate by coordinate.

    float32-appropriate: besides `rtol` (truncation, O(h^2)), allow the rounding noise of the
    difference quotient, ~ a few ulps of |f| divided by h.
    """
    x = np.asarray(x, np.float32)
    noise = 8 * F32_EPS * abs(float(f(x))) / h
    for idx in np.ndindex(x.shape):
        step = np.zeros_like(x)
        step[idx] = h
        fd = (float(f(x + step)) - float(f(x - step))) / (2 * h)
        g = float(np.asarray(grad)[idx])
        assert abs(g - fd) <= rtol * abs(fd) + noise, (idx, g, fd, noise)


@pytest.mark.parametrize("fn", [P.kerple_power_bias, P.kerple_log_bias])
def test_kerple_gradients_finite_at_zero_and_match_finite_differences(fn):
    offsets = jnp.array([[0, 1, 3], [-2, 0, 9]])  # includes offset 0 twice
    weights = jnp.linspace(0.5, 1.5, 6).reshape(2, 3)
    r1 = jnp.array([0.7, 1.1, 0.02])
    r2 = jnp.array([0.05, 0.5, 1.9])  # r2 < 1: |0|^r2 has an infinite slope in naive code
    loss = jax.jit(lambda a, b: jnp.sum(weights * fn(offsets, a, b)))
    g1, g2 = jax.jit(jax.grad(loss, argnums=(0, 1)))(r1, r2)
    assert np.isfinite(g1).all() and np.isfinite(g2).all()
    _assert_grad_matches_central_difference(lambda a: loss(a, r2), r1, g1, h=1e-2)
    _assert_grad_matches_central_difference(lambda b: loss(r1, b), r2, g2, h=1e-2)
    # At offset 0 alone the bias is identically 0, so both gradients are exactly 0.
    z1, z2 = jax.grad(lambda a, b: jnp.sum(fn(jnp.zeros(4, jnp.int32), a, b)), argnums=(0, 1))(
        r1, r2
    )
    np.testing.assert_array_equal(z1, 0.0)
    np.testing.assert_array_equal(z2, 0.0)


# ------------------------------------------------------------------------------------------
# Sandwich
# ------------------------------------------------------------------------------------------

# NVIDIA/NeMo, nemo/collections/nlp/modules/common/megatron/position_embedding/
# sandwich_relative_position_embedding.py, `SandwichRelativePositionEmbedding.forward`, run in torch
# float32 with hidden_size (per-head) = 16, num_attention_heads = 4, one row of |i - j| =
# [0, 1, 2, 5, 20, 100, 1000]. NeMo's own float32 rounding error on these is <= 6e-6.
SANDWICH_OFFSETS = [0, 1, 2, 5, 20, 100, 1000]
SANDWICH_GOLDEN = [
    [
        0.0,
        -0.02756810188293457,
        -0.1077880859375,
        -0.5733113288879395,
        -0.8162894248962402,
        -2.1875014305114746,
        -2.9947662353515625,
    ],
    [
        0.0,
        -0.013784050941467285,
        -0.05389404296875,
        -0.2866556644439697,
        -0.4081447124481201,
        -1.0937507152557373,
        -1.4973831176757812,
    ],
    [
        0.0,
        -0.009189367294311523,
        -0.0359293632209301,
        -0.1911037713289261,
        -0.2720964848995209,
        -0.7291671633720398,
        -0.9982554316520691,
    ],
    [
        0.0,
        -0.006892025470733643,
        -0.026947021484375,
        -0.14332783222198486,
        -0.20407235622406006,
        -0.5468753576278687,
        -0.7486915588378906,
    ],
]


def _sandwich_float64(offsets, head_dim, num_heads):
    # The NeMo formula (docs/conventions.md, Sandwich) in float64.
    k = np.arange(1, head_dim // 2 + 1)
    base = np.cos(
        np.abs(np.asarray(offsets, np.float64))[:, None] / 10000.0 ** (2 * k / head_dim)
    ).sum(-1)
    return (base - head_dim / 2) / (8.0 * np.arange(1, num_heads + 1) / num_heads)[:, None]


def test_sandwich_golden_nemo():
    out = P.sandwich_bias(jnp.array(SANDWICH_OFFSETS), head_dim=16, num_heads=4)
    chex.assert_shape(out, (4, len(SANDWICH_OFFSETS)))
    chex.assert_type(out, jnp.float32)
    np.testing.assert_allclose(out, SANDWICH_GOLDEN, atol=1e-5, rtol=1e-5)


def test_sandwich_zero_at_zero_even_and_matches_float64_formula():
    offsets = np.arange(-64, 4096, 7)
    out = np.asarray(P.sandwich_bias(offsets, head_dim=64, num_heads=12))
    ref = _sandwich_float64(offsets, 64, 12)
    small = np.abs(offsets) < 64  # no cancellation: tight near 0
    np.testing.assert_allclose(out[:, small], ref[:, small], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(out, ref, atol=1e-3)  # float32 angle of large offsets, as in NeMo
    zero = P.sandwich_bias(jnp.array([0]), head_dim=64, num_heads=12)
    np.testing.assert_array_equal(zero, 0.0)
    np.testing.assert_array_equal(P.sandwich_bias(-offsets, head_dim=64, num_heads=12), out)
    with pytest.raises(ValueError, match="even"):
        P.sandwich_bias(jnp.arange(3), head_dim=7, num_heads=2)


# ------------------------------------------------------------------------------------------
# FIRE
# ------------------------------------------------------------------------------------------

# The FIRE paper's reference listing (Li et al. 2024, arXiv 2310.04418), as reproduced in
# mcleish7/arithmetic cramming/architectures/embeddings.py `FIRE.forward`: normalised distance
# log(|c (i-j)| + 1) / (log(|c max(i, |L_multiplier * init_L|)| + 1) + 1e-6), run in torch float32
# with L_multiplier = 1, for q_pos = [0, 1, 2, 5, 10, 100, 1000], k_pos = [0, 1, 3, 10, 999].
# The gradients are torch autograd of sum(out * w), w = arange(35).reshape(7, 5) / 35, w.r.t. c
# and L (= L_multiplier.grad / init_L).
FIRE_Q, FIRE_K = [0, 1, 2, 5, 10, 100, 1000], [0, 1, 3, 10, 999]
FIRE_GOLDEN = {
    (0.1, 512.0): (
        [
            [
                0.0,
                0.024098152294754982,
                0.06633595377206802,
                0.17525476217269897,
                1.1666327714920044,
            ],
            [
                0.024098152294754982,
                0.0,
                0.04609804227948189,
                0.16228581964969635,
                1.166382074356079,
            ],
            [
                0.04609804227948189,
                0.024098152294754982,
                0.024098152294754982,
                0.14861547946929932,
                1.1661311388015747,
            ],
            [
                0.10251745581626892,
                0.08507335186004639,
                0.04609804227948189,
                0.10251745581626892,
                1.1653767824172974,
            ],
            [
                0.17525476217269897,
                0.16228581964969635,
                0.13416360318660736,
                0.0,
                1.1641144752502441,
            ],
            [
                0.6062818765640259,
                0.603972852230072,
                0.5992904901504517,
                0.5821837186813354,
                1.1402440071105957,
            ],
            [
                0.9999998211860657,
                0.9997851848602295,
                0.9993552565574646,
                0.9978438019752502,
                0.020651722326874733,
            ],
        ],
        4.739484786987305,
        -0.002750424901023507,
    ),
    (0.5, 4.5): (
        [
            [0.0, 0.3440062999725342, 0.7774030566215515, 1.5201717615127563, 5.273470401763916],
            [0.3440062999725342, 0.0, 0.5880826711654663, 1.4463491439819336, 5.272622585296631],
            [
                0.5880826711654663,
                0.3440062999725342,
                0.3440062999725342,
                1.3654857873916626,
                5.271773815155029,
            ],
            [
                0.9999992251396179,
                0.8769508004188538,
                0.5532943606376648,
                0.9999992251396179,
                4.957518577575684,
            ],
            [0.999999463558197, 0.9514374732971191, 0.8394411206245422, 0.0, 3.4633913040161133],
            [
                0.9999997615814209,
                0.9974939227104187,
                0.9924071431159973,
                0.9737564325332642,
                1.5540761947631836,
            ],
            [
                0.9999998211860657,
                0.9998392462730408,
                0.999517560005188,
                0.9983863830566406,
                0.06522288918495178,
            ],
        ],
        -7.040370941162109,
        -0.7375259929233127,
    ),
}


@pytest.mark.parametrize("c,L", sorted(FIRE_GOLDEN))
def test_fire_golden_values_and_gradients(c, L):
    expected, grad_c, grad_L = FIRE_GOLDEN[(c, L)]
    q, k = jnp.array(FIRE_Q), jnp.array(FIRE_K)
    out = P.fire_normalized_distance(q, k, c=c, L=L)
    chex.assert_shape(out, (7, 5))
    chex.assert_type(out, jnp.float32)
    np.testing.assert_allclose(out, expected, rtol=3e-6, atol=1e-7)
    w = jnp.arange(35.0).reshape(7, 5) / 35

    def loss(c_, L_):
        return jnp.sum(w * P.fire_normalized_distance(q, k, c=c_, L=L_))

    gc, gL = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.float32(c), jnp.float32(L))
    np.testing.assert_allclose([gc, gL], [grad_c, grad_L], rtol=1e-4, atol=1e-6)


def test_fire_gradients_match_finite_differences():
    q, k = jnp.arange(0, 300, 13), jnp.arange(0, 300, 11)
    w = jnp.cos(jnp.arange(q.size * k.size, dtype=jnp.float32)).reshape(q.size, k.size)
    loss = jax.jit(lambda c, L: jnp.sum(w * P.fire_normalized_distance(q, k, c=c, L=L)))
    c0, L0 = 0.3, 150.5  # L between query positions, so max(i, L) selects both sides
    gc, gL = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.float32(c0), jnp.float32(L0))
    _assert_grad_matches_central_difference(lambda c: loss(c, np.float32(L0)), c0, gc, h=1e-2)
    _assert_grad_matches_central_difference(lambda L: loss(np.float32(c0), L), L0, gL, h=0.25)


def test_fire_causal_values_in_unit_interval_and_kv_cache_row():
    pos = jnp.arange(0, 2000, 7)
    for c, L in [(0.1, 512.0), (3.0, 1.0), (0.01, 4096.0)]:
        out = np.asarray(P.fire_normalized_distance(pos, pos, c=c, L=L))
        causal = np.tril(np.ones(out.shape, bool))
        assert (out[causal] >= 0).all() and (out[causal] <= 1).all()
        # Decoding one token with a KV cache: the true query position gives the same row (1 row
        # against 286: another program, so float32 rounding apart, not bit-equal).
        row = P.fire_normalized_distance(pos[-1:], pos, c=c, L=L)
        np.testing.assert_allclose(row[0], out[-1], rtol=1e-6, atol=1e-7)


def test_fire_norm_cap_freezes_the_normaliser_past_its_position():
    q, k = jnp.arange(0, 200, 7), jnp.arange(0, 200, 5)
    c, L, cap = 0.3, 20.0, 100
    out = np.asarray(P.fire_normalized_distance(q, k, c=c, L=L, norm_cap=cap), np.float64)
    qn, kn = np.arange(0, 200, 7.0)[:, None], np.arange(0, 200, 5.0)[None, :]
    psi = lambda x: np.log1p(np.abs(c * x))  # noqa: E731
    want = psi(qn - kn) / (psi(np.maximum(np.minimum(qn, cap), L)) + P.FIRE_EPS)
    np.testing.assert_allclose(out, want, rtol=2e-6)
    # A cap at or past the last query position is the paper's normaliser, exactly.
    np.testing.assert_array_equal(
        P.fire_normalized_distance(q, k, c=c, L=L, norm_cap=int(q[-1])),
        P.fire_normalized_distance(q, k, c=c, L=L),
    )


# ------------------------------------------------------------------------------------------
# Every function under jit and vmap
# ------------------------------------------------------------------------------------------

_OFFS = jnp.arange(-40, 41, 9)
_SLOPES = P.alibi_slopes(4)
_R1, _R2 = jnp.array([0.5, 1.0, 1.5, 2.0]), jnp.array([0.2, 0.9, 1.2, 2.0])
CASES = {
    # name: (function of one batched array argument, the batch to map over)
    "sinusoidal": (lambda x: P.sinusoidal(x, 6), jnp.stack([jnp.arange(5), jnp.arange(5) * 3])),
    "learned": (lambda x: P.learned_embedding(jnp.ones((8, 3)), x), jnp.array([[0, 7], [3, 1]])),
    "t5_causal": (lambda x: P.t5_bucket(x, bidirectional=False), jnp.stack([_OFFS, 5 * _OFFS])),
    "t5_bidir": (
        lambda x: P.t5_bucket(x, bidirectional=True, max_distance=1024),
        jnp.stack([_OFFS, 9 * _OFFS]),
    ),
    "alibi_bias": (lambda s: P.alibi_bias(_OFFS, s), jnp.stack([_SLOPES, 2 * _SLOPES])),
    "kerple_power": (lambda r: P.kerple_power_bias(_OFFS, _R1, r), jnp.stack([_R2, _R2 / 2])),
    "kerple_log": (lambda r: P.kerple_log_bias(_OFFS, r, _R2), jnp.stack([_R1, _R1 * 3])),
    "sandwich": (
        lambda x: P.sandwich_bias(x, head_dim=8, num_heads=4),
        jnp.stack([_OFFS, 2 * _OFFS]),
    ),
    "fire_c": (
        lambda c: P.fire_normalized_distance(jnp.arange(6), jnp.arange(6), c=c, L=3.5),
        jnp.array([0.1, 0.7]),
    ),
    "fire_pos": (
        lambda q: P.fire_normalized_distance(q, jnp.arange(4), c=0.2, L=2.0),
        jnp.array([[0, 1, 2], [5, 6, 7]]),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_jit_and_vmap_agree_with_eager(name):
    fn, batch = CASES[name]
    eager = [fn(x) for x in batch]
    # Compiled and vmapped programs against eager ops: values reach 0 (sandwich, FIRE, Kerple at
    # offset 0), so an atol beside the rtol.
    chex.assert_trees_all_close(jax.jit(fn)(batch[0]), eager[0], rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(jax.vmap(fn)(batch), jnp.stack(eager), rtol=1e-6, atol=1e-6)


def test_alibi_slopes_jits_with_static_head_count():
    np.testing.assert_array_equal(jax.jit(P.alibi_slopes, static_argnums=0)(6), P.alibi_slopes(6))
