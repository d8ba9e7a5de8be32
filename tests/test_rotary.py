"""Tests for posattn.rotary: reference goldens, the worked example of docs/conventions.md,
properties, precision.

Run: .venv/bin/python -m pytest tests/test_rotary.py -q
"""

import collections
import math
import re

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from posattn import rotary
from posattn.rotary import (
    ROPE_TYPES,
    apply_rope,
    rope_angles,
    rope_decay_bound,
    rope_frequencies,
    validate_rope_scaling,
)

# ----------------------------------------------------------------------------------------------
# Golden values, recorded with transformers 5.24.0 / torch 2.13.0+cpu / numpy 2.4.6 by a scratch
# script outside the repository (docs/rope.md, "Goldens"). For each case it built
#   LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
#               max_position_embeddings=...,
#               rope_parameters={**rope_parameters, "rope_theta": base})
# and called transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[rope_type](config, "cpu",
# seq_len=seq_len) ("default": LlamaRotaryEmbedding.compute_default_rope_parameters(config)).
# The comment above each case gives those arguments; `scaling` is the same setting as posattn
# takes it: for "dynamic" HF reads the original length from config.max_position_embeddings, which
# posattn takes as scaling["original_max_position_embeddings"]. HF computes in float32; the values
# are its float32 results, printed as shortest round-trip literals.
# ----------------------------------------------------------------------------------------------
Case = collections.namedtuple("Case", "head_dim base seq_len attention_factor scaling inv_freq")

FREQ_GOLDEN = {
    # head_dim=32, rope_theta=10000.0, max_position_embeddings=2048, seq_len=None,
    #   rope_parameters={'rope_type': 'default'}
    "default": Case(
        32,
        10000.0,
        None,
        1.0,
        scaling=None,
        inv_freq=[
            1.0,
            0.56234133,
            0.31622776,
            0.17782794,
            0.1,
            0.05623413,
            0.03162278,
            0.017782794,
            0.01,
            0.0056234132,
            0.0031622779,
            0.0017782794,
            0.001,
            0.0005623413,
            0.0003162278,
            0.00017782794,
        ],
    ),
    # head_dim=32, rope_theta=10000.0, max_position_embeddings=2048, seq_len=None,
    #   rope_parameters={'rope_type': 'linear', 'factor': 2.5}
    "linear": Case(
        32,
        10000.0,
        None,
        1.0,
        scaling={"factor": 2.5, "rope_type": "linear"},
        inv_freq=[
            0.4,
            0.22493653,
            0.1264911,
            0.07113118,
            0.04,
            0.022493651,
            0.012649111,
            0.0071131177,
            0.0039999997,
            0.0022493652,
            0.0012649111,
            0.00071131176,
            0.00040000002,
            0.00022493652,
            0.00012649111,
            7.113117e-05,
        ],
    ),
    # head_dim=32, rope_theta=10000.0, max_position_embeddings=256, seq_len=None,
    #   rope_parameters={'rope_type': 'dynamic', 'factor': 2.0}
    "dynamic_none": Case(
        32,
        10000.0,
        None,
        1.0,
        scaling={"factor": 2.0, "original_max_position_embeddings": 256, "rope_type": "dynamic"},
        inv_freq=[
            1.0,
            0.56234133,
            0.31622776,
            0.17782794,
            0.1,
            0.05623413,
            0.03162278,
            0.017782794,
            0.01,
            0.0056234132,
            0.0031622779,
            0.0017782794,
            0.001,
            0.0005623413,
            0.0003162278,
            0.00017782794,
        ],
    ),
    # head_dim=32, rope_theta=10000.0, max_position_embeddings=256, seq_len=100,
    #   rope_parameters={'rope_type': 'dynamic', 'factor': 2.0}
    "dynamic_100": Case(
        32,
        10000.0,
        100,
        1.0,
        scaling={"factor": 2.0, "original_max_position_embeddings": 256, "rope_type": "dynamic"},
        inv_freq=[
            1.0,
            0.56234133,
            0.31622776,
            0.17782794,
            0.1,
            0.05623413,
            0.03162278,
            0.017782794,
            0.01,
            0.0056234132,
            0.0031622779,
            0.0017782794,
            0.001,
            0.0005623413,
            0.0003162278,
            0.00017782794,
        ],
    ),
    # head_dim=32, rope_theta=10000.0, max_position_embeddings=256, seq_len=512,
    #   rope_parameters={'rope_type': 'dynamic', 'factor': 2.0}
    "dynamic_512": Case(
        32,
        10000.0,
        512,
        1.0,
        scaling={"factor": 2.0, "original_max_position_embeddings": 256, "rope_type": "dynamic"},
        inv_freq=[
            1.0,
            0.5226271,
            0.2731391,
            0.14274988,
            0.07460496,
            0.03899057,
            0.020377528,
            0.010649848,
            0.005565899,
            0.0029088897,
            0.0015202645,
            0.00079453137,
            0.00041524367,
            0.00021701757,
            0.00011341926,
            5.927598e-05,
        ],
    ),
    # head_dim=32, rope_theta=10000.0, max_position_embeddings=256, seq_len=1000,
    #   rope_parameters={'rope_type': 'dynamic', 'factor': 2.0}
    "dynamic_1000": Case(
        32,
        10000.0,
        1000,
        1.0,
        scaling={"factor": 2.0, "original_max_position_embeddings": 256, "rope_type": "dynamic"},
        inv_freq=[
            1.0,
            0.49481887,
            0.24484569,
            0.12115426,
            0.059949413,
            0.029664101,
            0.014678355,
            0.007263127,
            0.0035939321,
            0.0017783453,
            0.0008799588,
            0.0004354202,
            0.00021545411,
            0.000106610765,
            5.275301e-05,
            2.6103186e-05,
        ],
    ),
    # head_dim=32, rope_theta=10000.0, max_position_embeddings=8192, seq_len=None,
    #   rope_parameters={'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings':
    #   2048}
    "yarn": Case(
        32,
        10000.0,
        None,
        1.138629436111989,
        scaling={"factor": 4.0, "original_max_position_embeddings": 2048, "rope_type": "yarn"},
        inv_freq=[
            1.0,
            0.56234133,
            0.31622776,
            0.17782794,
            0.1,
            0.05020904,
            0.02484647,
            0.012066896,
            0.0057142857,
            0.0026108704,
            0.001129385,
            0.00044456986,
            0.00025,
            0.00014058533,
            7.905695e-05,
            4.4456985e-05,
        ],
    ),
    # head_dim=32, rope_theta=10000.0, max_position_embeddings=8192, seq_len=None,
    #   rope_parameters={'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings':
    #   2048, 'truncate': False}
    "yarn_no_truncate": Case(
        32,
        10000.0,
        None,
        1.138629436111989,
        scaling={
            "factor": 4.0,
            "original_max_position_embeddings": 2048,
            "rope_type": "yarn",
            "truncate": False,
        },
        inv_freq=[
            1.0,
            0.56234133,
            0.31622776,
            0.17782794,
            0.1,
            0.049453083,
            0.023870196,
            0.011207953,
            0.0050569717,
            0.0021432224,
            0.00081129046,
            0.00044456986,
            0.00025,
            0.00014058533,
            7.905695e-05,
            4.4456985e-05,
        ],
    ),
    # head_dim=32, rope_theta=10000.0, max_position_embeddings=131072, seq_len=None,
    #   rope_parameters={'rope_type': 'yarn', 'factor': 2.0, 'original_max_position_embeddings':
    #   65536}
    "yarn_long_original": Case(
        32,
        10000.0,
        None,
        1.0693147180559945,
        scaling={"factor": 2.0, "original_max_position_embeddings": 65536, "rope_type": "yarn"},
        inv_freq=[
            1.0,
            0.56234133,
            0.31622776,
            0.17782794,
            0.1,
            0.05623413,
            0.03162278,
            0.017782794,
            0.01,
            0.0056234132,
            0.0031622779,
            0.0016512595,
            0.0008571429,
            0.00044183957,
            0.00022587698,
            0.000114317954,
        ],
    ),
    # head_dim=64, rope_theta=10000.0, max_position_embeddings=16384, seq_len=None,
    #   rope_parameters={'rope_type': 'yarn', 'factor': 8.0, 'original_max_position_embeddings':
    #   2048, 'mscale': 1.0, 'mscale_all_dim': 0.8}
    "yarn_mscale": Case(
        64,
        10000.0,
        None,
        1.0356570849393496,
        scaling={
            "factor": 8.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "original_max_position_embeddings": 2048,
            "rope_type": "yarn",
        },
        inv_freq=[
            1.0,
            0.7498942,
            0.56234133,
            0.4216965,
            0.31622776,
            0.23713736,
            0.17782794,
            0.13335215,
            0.1,
            0.06994205,
            0.04866415,
            0.033654623,
            0.023108954,
            0.01573315,
            0.010601281,
            0.0070522767,
            0.004615384,
            0.0029563138,
            0.0018384235,
            0.0010947889,
            0.00060813036,
            0.00029642173,
            0.00022228493,
            0.00016669018,
            0.000125,
            9.373677e-05,
            7.029266e-05,
            5.271206e-05,
            3.9528473e-05,
            2.9642173e-05,
            2.2228493e-05,
            1.6669019e-05,
        ],
    ),
    # head_dim=32, rope_theta=500000.0, max_position_embeddings=32768, seq_len=None,
    #   rope_parameters={'rope_type': 'yarn', 'factor': 16.0, 'original_max_position_embeddings':
    #   2048, 'attention_factor': 0.9, 'beta_fast': 16.0, 'beta_slow': 2.0}
    "yarn_explicit": Case(
        32,
        500000.0,
        None,
        0.9,
        scaling={
            "attention_factor": 0.9,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "factor": 16.0,
            "original_max_position_embeddings": 2048,
            "rope_type": "yarn",
        },
        inv_freq=[
            1.0,
            0.44036663,
            0.19392276,
            0.0853971,
            0.028792117,
            0.008797734,
            0.00216501,
            0.00020071538,
            8.838834e-05,
            3.8923277e-05,
            1.7140512e-05,
            7.548109e-06,
            3.3239348e-06,
            1.4637499e-06,
            6.445866e-07,
            2.838544e-07,
        ],
    ),
    # head_dim=128, rope_theta=500000.0, max_position_embeddings=131072, seq_len=None,
    #   rope_parameters={'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,
    #   'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192}
    "llama3": Case(
        128,
        500000.0,
        None,
        1.0,
        scaling={
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        inv_freq=[
            1.0,
            0.8146172,
            0.6636013,
            0.540581,
            0.44036663,
            0.35873023,
            0.29222783,
            0.23805381,
            0.19392276,
            0.15797281,
            0.12868738,
            0.10483095,
            0.0853971,
            0.06956595,
            0.05666962,
            0.04616405,
            0.03760603,
            0.03063452,
            0.024955409,
            0.020329105,
            0.01656044,
            0.01349042,
            0.010989529,
            0.008952259,
            0.007292665,
            0.0059407307,
            0.0048394212,
            0.003942276,
            0.003211446,
            0.0021665706,
            0.0013718937,
            0.00085675146,
            0.000524846,
            0.00031269365,
            0.00017850779,
            9.556212e-05,
            7.7846555e-05,
            6.3415144e-05,
            5.165907e-05,
            4.2082367e-05,
            3.4281024e-05,
            2.792591e-05,
            2.2748929e-05,
            1.853167e-05,
            1.5096218e-05,
            1.2297639e-05,
            1.0017869e-05,
            8.160728e-06,
            6.6478697e-06,
            5.4154693e-06,
            4.4115345e-06,
            3.5937119e-06,
            2.9274997e-06,
            2.3847917e-06,
            1.9426925e-06,
            1.5825508e-06,
            1.2891732e-06,
            1.0501826e-06,
            8.554969e-07,
            6.9690253e-07,
            5.677088e-07,
            4.6246538e-07,
            3.7673226e-07,
            3.068926e-07,
        ],
    ),
    # head_dim=32, rope_theta=10000.0, max_position_embeddings=1024, seq_len=None,
    #   rope_parameters={'rope_type': 'llama3', 'factor': 4.0, 'low_freq_factor': 1.0,
    #   'high_freq_factor': 4.0, 'original_max_position_embeddings': 256}
    "llama3_small": Case(
        32,
        10000.0,
        None,
        1.0,
        scaling={
            "factor": 4.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 256,
            "rope_type": "llama3",
        },
        inv_freq=[
            1.0,
            0.56234133,
            0.31622776,
            0.17782794,
            0.1,
            0.03221069,
            0.010185918,
            0.0044456986,
            0.0025,
            0.0014058533,
            0.00079056947,
            0.00044456986,
            0.00025,
            0.00014058533,
            7.905695e-05,
            4.4456985e-05,
        ],
    ),
}

# Rotations of x = pseudo_random(shape, seed) (below; the same function ran in the scratch script),
# evaluated by the reference formulations in float64 from the float32 inv_freq values above:
# - interleaved: Meta Llama model.py `precompute_freqs_cis` + `apply_rotary_emb`
#   (torch.polar, torch.view_as_complex / view_as_real), complex128, head_dim 8, base 10000;
# - half: transformers.models.llama.modeling_llama.apply_rotary_pos_emb (rotate_half,
#   unsqueeze_dim=2) with cos/sin of cat(freqs, freqs) times attention_scaling, as
#   LlamaRotaryEmbedding.forward does; yarn head_dim 8, factor 4, original_max_position_embeddings
#   64 (inv_freq and attention factor from ROPE_INIT_FUNCTIONS["yarn"]), per-sequence positions.

# Interleaved: x = pseudo_random((1, 5, 2, 8), seed=1), HF default inv_freq for head_dim 8.
INTERLEAVED_INV_FREQ = [1.0, 0.1, 0.01, 0.001]
INTERLEAVED_POSITIONS = [3, 17, 250, 1023, 4096]
INTERLEAVED_OUT = [
    1.9133182,
    -0.7496817,
    -1.4271274,
    1.0412016,
    -0.062198337,
    -1.6418905,
    0.8349327,
    -0.6925095,
    -1.7945135,
    0.0040220623,
    -1.574212,
    0.7623697,
    -0.27832353,
    -1.8713884,
    0.6126906,
    -0.9160928,
    -0.4023308,
    -1.5014642,
    -0.7690665,
    -1.6140617,
    -0.87317616,
    1.793011,
    0.40636513,
    -1.1340946,
    -0.5553005,
    -1.2258202,
    -0.5192917,
    -1.8063946,
    -1.0551656,
    1.5355991,
    0.18727483,
    -1.3607635,
    -0.14000818,
    -1.1768103,
    -1.8607534,
    0.7779122,
    -0.07559176,
    -1.7772433,
    0.33557475,
    -1.551884,
    -0.4100695,
    -1.0141872,
    1.853604,
    0.05705476,
    0.23639916,
    -1.7320654,
    0.17474198,
    -1.8230155,
    -0.5279686,
    -0.95340633,
    -0.39387846,
    1.5598117,
    1.7417527,
    0.33557537,
    -1.9424278,
    0.5939115,
    -0.821444,
    -0.8382908,
    -0.13143118,
    1.3851669,
    1.7355039,
    0.6507584,
    -1.8682277,
    0.2875233,
    -0.6053974,
    -1.1830138,
    0.7692858,
    0.9437794,
    1.9499713,
    -0.34781778,
    1.7910988,
    -0.10413764,
    -0.91716915,
    -1.2296801,
    0.8942404,
    0.6543563,
    -1.8267977,
    -0.57600796,
    1.7380728,
    0.20661566,
]

# Half: x = pseudo_random((2, 4, 2, 8), seed=2), yarn inv_freq and attention factor.
HALF_INV_FREQ = [1.0, 0.0625, 0.0025, 0.00025]
HALF_ATTENTION_FACTOR = 1.138629436111989
HALF_POSITIONS = [[0, 1, 2, 3], [100, 101, 102, 5000]]
HALF_OUT = [
    -2.2771764,
    0.5376721,
    -1.2020015,
    1.612847,
    -0.1268223,
    -1.8664958,
    0.9483526,
    -0.7913167,
    2.0235274,
    0.28385815,
    -1.4558154,
    1.359033,
    -0.38063627,
    -2.1203098,
    0.6945386,
    -1.045135,
    1.4900553,
    -0.106200404,
    -1.7107259,
    1.1055437,
    1.1463653,
    2.1780133,
    0.43644917,
    -1.2986727,
    1.5664963,
    -0.3436701,
    -1.9639045,
    0.8517932,
    0.79565185,
    1.9088415,
    0.1819971,
    -1.5525501,
    0.51327986,
    -0.68241346,
    -2.216895,
    0.59848994,
    1.6228851,
    1.6001713,
    -0.07799309,
    -1.806278,
    0.8496961,
    -0.9026029,
    2.0850239,
    0.34480292,
    1.4977167,
    1.3166934,
    -0.31030047,
    -2.0602188,
    -0.51409584,
    -1.1851332,
    1.83389,
    0.08827852,
    1.7396694,
    0.9610652,
    -0.5607974,
    2.2403796,
    -0.22700368,
    -1.387187,
    1.5819824,
    -0.16534503,
    1.9551251,
    0.66438794,
    -0.8165078,
    1.986371,
    -0.8795622,
    -1.4702066,
    1.5486338,
    -0.46085116,
    -1.9853013,
    0.70667505,
    -0.72145367,
    1.7216984,
    1.0792978,
    -1.7323065,
    1.365505,
    -0.70824116,
    1.8517995,
    0.46142232,
    -1.0301718,
    1.4616191,
    -1.0867612,
    -2.0040097,
    1.1857206,
    -0.9559315,
    1.5675956,
    0.09117839,
    -1.3359339,
    1.2013009,
    -1.1984341,
    -2.2502754,
    1.0033641,
    -1.2032608,
    1.2264618,
    -0.16996595,
    -1.6451089,
    0.9411595,
    -1.4528321,
    2.070595,
    0.8258906,
    -1.450756,
    -0.6240765,
    -0.16862075,
    -1.9522252,
    0.68065566,
    -1.226115,
    1.8411212,
    -0.5045528,
    -1.6980158,
    -0.90236133,
    -0.4446368,
    2.1453834,
    0.42045262,
    0.66640365,
    -0.9979555,
    -0.07115298,
    -0.81099075,
    1.3959326,
    -1.4563079,
    1.958497,
    -1.775407,
    0.37638265,
    -1.2283515,
    -0.34124163,
    -0.65015835,
    1.6074346,
    -1.1810611,
    1.7220755,
    -2.0963056,
]


def pseudo_random(shape, seed):
    """Inputs exact in float32: a multiplicative hash of the flat index, mapped to [-2, 2) in
    2^-18 steps."""
    n = np.arange(int(np.prod(shape)), dtype=np.uint64)
    h = (n * np.uint64(2654435761) + np.uint64(seed) * np.uint64(40503)) % np.uint64(2**32)
    return ((h >> np.uint64(12)).astype(np.float64) / 2**18 - 2.0).reshape(shape).astype(np.float32)


def ulps(a, b):
    """Distance in float32 units in the last place (same-sign values)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


def wrapped(angle):
    """angle mod 2 pi in [-pi, pi)."""
    return (angle + np.pi) % (2 * np.pi) - np.pi


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# Compiled once per shape: eager op-by-op dispatch of the ~40 small ops costs more than the tests.
rope = jax.jit(apply_rope, static_argnames="layout")


# ---------------------------------------------------------------------------------- frequencies
@pytest.mark.parametrize("name", sorted(FREQ_GOLDEN))
def test_frequencies_match_hugging_face(name):
    case = FREQ_GOLDEN[name]
    inv_freq, factor = rope_frequencies(
        case.head_dim, base=case.base, scaling=case.scaling, seq_len=case.seq_len
    )
    chex.assert_shape(inv_freq, (case.head_dim // 2,))
    assert inv_freq.dtype == jnp.float32
    # HF evaluates in float32, up to 3.5 ulp away from the float64 value; posattn rounds the
    # float64 value once (<= 0.5 ulp). Measured distance between the two: <= 3 ulp.
    assert ulps(inv_freq, case.inv_freq).max() <= 4
    assert factor == case.attention_factor  # a Python float both sides: exact


def test_frequencies_are_float64_rounded_once_to_float32():
    d, base = 128, 500000.0
    inv_freq, _ = rope_frequencies(d, base=base)
    np.testing.assert_array_equal(
        inv_freq, (1.0 / base ** (np.arange(0, d, 2) / d)).astype(np.float32)
    )


def test_dynamic_accepts_a_traced_length_without_retracing():
    scaling = FREQ_GOLDEN["dynamic_512"].scaling

    @jax.jit
    @chex.assert_max_traces(n=1)
    def frequencies(seq_len):
        return rope_frequencies(32, scaling=scaling, seq_len=seq_len)[0]

    for name in ("dynamic_100", "dynamic_512", "dynamic_1000"):
        case = FREQ_GOLDEN[name]
        assert ulps(frequencies(case.seq_len), case.inv_freq).max() <= 4
    # Up to the original length (256) the frequencies are the plain ones: HF's max(seq_len, m_l).
    np.testing.assert_allclose(frequencies(256), rope_frequencies(32)[0], rtol=1e-6)


def test_ntk_divides_the_lowest_frequency_by_the_factor_and_keeps_the_highest():
    # Static NTK-aware scaling (bloc97 2023; YaRN paper §3.1): b' = b s^(d/(d-2)), i.e.
    # lambda = (m/m_l)^(d/(d-2)) with s = m/m_l, so theta'_k = theta_k s^(-2k/(d-2)).
    d, s = 64, 4.0
    plain, _ = rope_frequencies(d)
    ntk, factor = rope_frequencies(d, scaling={"rope_type": "ntk", "factor": s})
    assert factor == 1.0 and ntk[0] == 1.0
    np.testing.assert_allclose(ntk[-1], plain[-1] / s, rtol=1e-6)
    np.testing.assert_allclose(ntk, plain * s ** (-2.0 * np.arange(d // 2) / (d - 2)), rtol=1e-6)


def test_type_alias_defaults_and_config_dicts_give_the_same_frequencies():
    reference = rope_frequencies(32, scaling=YARN)
    alias = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    explicit_defaults = {**YARN, "beta_fast": 32, "beta_slow": 1, "truncate": True, "mscale": None}
    for scaling in (alias, explicit_defaults):
        inv_freq, factor = rope_frequencies(32, scaling=scaling)
        np.testing.assert_array_equal(inv_freq, reference[0])
        assert factor == reference[1]
    np.testing.assert_array_equal(
        rope_frequencies(32, scaling={"rope_type": "default"})[0], rope_frequencies(32)[0]
    )
    normalised = validate_rope_scaling(YARN, 32)
    assert (
        normalised["beta_fast"] == 32.0
        and normalised["beta_slow"] == 1.0
        and normalised["truncate"]
    )
    assert validate_rope_scaling(ml_collections.ConfigDict(YARN), 32) == normalised


@pytest.mark.parametrize(
    "scaling, head_dim, fragments",
    [
        (
            {"rope_type": "xpos", "factor": 2.0},
            64,
            ["'rope_type'", "'xpos'", ", ".join(ROPE_TYPES)],
        ),
        ({"rope_type": "linear"}, 64, ["'linear'", "missing 'factor'"]),
        ({"rope_type": "yarn", "factor": 4.0}, 64, ["missing 'original_max_position_embeddings'"]),
        (
            {"type": "dynamic", "factor": 2.0},
            64,
            [
                "'dynamic'",
                "missing 'original_max_position_embeddings'",
                "config.max_position_embeddings",
            ],
        ),
        ({**LLAMA3, "low_freq_factor": None}, 128, ["missing 'low_freq_factor'"]),
        ({"rope_type": "linear", "factor": 0.5}, 64, ["'factor'", "0.5", ">= 1"]),
        ({"rope_type": "linear", "factor": True}, 64, ["'factor'", "True", ">= 1"]),
        (
            {**YARN, "beta_fast": 1.0, "beta_slow": 2.0},
            64,
            ["'beta_fast'", "1.0", "beta_slow = 2.0"],
        ),
        ({**YARN, "beta_fast": 0}, 64, ["'beta_fast'", "= 0", "> 0"]),  # HF's `or 32` would hide it
        ({**YARN, "beta_slow": -1.0}, 64, ["'beta_slow'", "-1.0", "> 0"]),
        ({**YARN, "mscale": -0.5}, 64, ["'mscale'", "-0.5", ">= 0"]),
        ({**YARN, "attention_factor": 0.0}, 64, ["'attention_factor'", "0.0", "> 0"]),
        ({**YARN, "truncate": "yes"}, 64, ["'truncate'", "'yes'", "True or False"]),
        (
            {**YARN, "original_max_position_embeddings": 2048.5},
            64,
            ["'original_max_position_embeddings'", "2048.5", "positive integer"],
        ),
        (
            {**LLAMA3, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
            128,
            ["'high_freq_factor'", "1.0", "low_freq_factor = 4.0"],
        ),
        ({**LLAMA3, "low_freq_factor": 0}, 128, ["'low_freq_factor'", "= 0", "> 0"]),
        ({**YARN, "beta_fats": 16}, 64, ["'beta_fats'", "beta_fast, beta_slow"]),
        ({**YARN, "rope_theta": 1e6}, 64, ["'rope_theta'", "base"]),
        (
            {**YARN, "partial_rotary_factor": 1.5},
            64,
            ["'partial_rotary_factor'", "1.5", "(0, 1]"],
        ),
        ({"rope_type": "linear", "type": "yarn", "factor": 2.0}, 64, ["'type'", "'yarn'", "alias"]),
        ("yarn", 64, ["rope_scaling = 'yarn'", "None or a dict"]),
        (None, 63, ["head_dim = 63", "even integer"]),
        ({"rope_type": "ntk", "factor": 2.0}, 2, ["head_dim = 2", "'ntk'", ">= 4"]),
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


def test_invalid_base_and_length_are_refused():
    with pytest.raises(ValueError, match="base = 1.0"):
        rope_frequencies(64, base=1.0)
    with pytest.raises(ValueError, match="seq_len = 0"):
        rope_frequencies(64, scaling=FREQ_GOLDEN["dynamic_512"].scaling, seq_len=0)


def test_vmap_over_a_swept_base():
    bases = jnp.array([1e4, 5e4, 5e5])
    for scaling in (None, YARN, LLAMA3):
        swept = jax.jit(
            jax.vmap(lambda b, scaling=scaling: rope_frequencies(128, base=b, scaling=scaling)[0])
        )(bases)
        chex.assert_shape(swept, (3, 64))
        for row, base in zip(swept, [1e4, 5e4, 5e5], strict=True):
            # traced base: computed in float32 on the device, a few ulp from the host float64 path
            assert ulps(row, rope_frequencies(128, base=base, scaling=scaling)[0]).max() <= 8


# ---------------------------------------------------------------------------------- rotations
@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_two_dimensional_worked_example(layout):
    # q = [1, 0.5], k = [0.8, 0.3], 0.5 rad per position (inv_freq = [0.5]); x is [T=1, N=1, H=2].
    q, k, inv_freq = jnp.array([[[1.0, 0.5]]]), jnp.array([[[0.8, 0.3]]]), jnp.array([0.5])

    def score(m, n):
        qm = rope(q, jnp.array([m]), inv_freq, layout=layout)
        kn = rope(k, jnp.array([n]), inv_freq, layout=layout)
        return float(jnp.sum(qm * kn))

    assert score(0, 0) == pytest.approx(0.95, abs=1e-6)
    assert score(5, 5) == pytest.approx(0.95, abs=1e-6)
    assert score(0, 2) == pytest.approx(0.597434, abs=1e-6)
    assert score(7, 9) == pytest.approx(0.597434, abs=1e-6)
    # Counter-clockwise: [1, 0] at position 1 points to angle +0.5.
    e1 = rope(jnp.array([[[1.0, 0.0]]]), jnp.array([1]), inv_freq, layout=layout)
    np.testing.assert_allclose(e1.ravel(), [math.cos(0.5), math.sin(0.5)], atol=1e-7)
    # Offsets +2 and -2 differ: 0.95 cos(1) -/+ 0.1 sin(1).
    assert score(2, 0) == pytest.approx(0.95 * math.cos(1) - 0.1 * math.sin(1), abs=1e-6)
    assert abs(score(2, 0) - score(0, 2)) > 0.1


def test_interleaved_matches_meta_view_as_complex():
    x = pseudo_random((1, 5, 2, 8), seed=1)
    out = rope(x, jnp.array(INTERLEAVED_POSITIONS), jnp.array(INTERLEAVED_INV_FREQ, jnp.float32))
    # Measured: 1.9e-7 (one float32 rounding of |x| <= 2); Meta's own float32 pipeline is 2.4e-6
    # off.
    np.testing.assert_allclose(np.ravel(out), INTERLEAVED_OUT, rtol=0, atol=1e-6)


def test_half_matches_hugging_face_rotate_half_with_factor_and_per_sequence_positions():
    x = pseudo_random((2, 4, 2, 8), seed=2)
    out = rope(
        x,
        jnp.array(HALF_POSITIONS),
        jnp.array(HALF_INV_FREQ, jnp.float32),
        layout="half",
        attention_factor=HALF_ATTENTION_FACTOR,
    )
    np.testing.assert_allclose(np.ravel(out), HALF_OUT, rtol=0, atol=1e-6)


def test_layouts_differ_only_by_where_the_pair_members_sit():
    x = pseudo_random((2, 6, 3, 16), seed=3)
    positions, inv_freq = jnp.arange(6) * 777, rope_frequencies(16)[0]
    to_half = np.concatenate([np.arange(0, 16, 2), np.arange(1, 16, 2)])  # (x0, x1) -> (x_0, x_8)
    interleaved = rope(x, positions, inv_freq, layout="interleaved")
    half = rope(x[..., to_half], positions, inv_freq, layout="half")
    # Two programs on |values| up to ~2.8 (a float32 ulp there is 2.4e-7): rtol beside atol.
    np.testing.assert_allclose(interleaved[..., to_half], half, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_rotation_preserves_norms_and_the_factor_scales_them(layout):
    x = pseudo_random((2, 7, 3, 64), seed=4)
    positions, inv_freq = jnp.arange(7) * 150_001, rope_frequencies(64)[0]
    norm = np.linalg.norm(x, axis=-1)
    out = rope(x, positions, inv_freq, layout=layout)
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), norm, rtol=2e-6)
    scaled = rope(x, positions, inv_freq, layout=layout, attention_factor=1.25)
    np.testing.assert_allclose(np.linalg.norm(scaled, axis=-1), 1.25 * norm, rtol=2e-6)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_scores_depend_only_on_the_offset_even_near_a_million(layout):
    # <R(m + c) q, R(n + c) k> for shifts c up to 2^20: a plain float32 p * theta would move these
    # scores by ~1e-2 (0.03 rad phase error at 1e6).
    shifts = jnp.array([0, 1, 4095, 4096, 123_457, 999_999, 2**20 - 9])
    inv_freq = rope_frequencies(128)[0]
    q = jnp.broadcast_to(pseudo_random((1, 1, 128), seed=5), (7, 1, 128))
    k = jnp.broadcast_to(pseudo_random((1, 1, 128), seed=6), (7, 1, 128))
    for m, n in [(3, 0), (0, 3), (1000, 17)]:
        scores = jnp.sum(
            rope(q, m + shifts, inv_freq, layout=layout)
            * rope(k, n + shifts, inv_freq, layout=layout),
            axis=(-1, -2),
        )
        assert float(jnp.max(scores) - jnp.min(scores)) < 1e-4  # |q| |k| ~ 150


def test_angles_are_accurate_where_a_float32_product_is_not():
    # Phase error against float64 (the float32 theta taken as exact). The exhaustive sweep over all
    # p < 2^20 (benchmarks/rope_phase_error.py) measured 7.3e-7 rad; this is a sample of it.
    theta = np.concatenate(
        [
            rope_frequencies(128)[0],
            rope_frequencies(128, base=500000.0)[0],
            rope_frequencies(128, scaling=LLAMA3, base=500000.0)[0],
        ]
    )
    rng = np.random.default_rng(0)
    positions = np.concatenate(
        [np.arange(4096), rng.integers(-(2**20), 2**20, 20_000), [2**20 - 1, 10**6, -(2**20)]]
    ).astype(np.int32)
    exact = positions[:, None].astype(np.float64) * theta.astype(np.float64)
    angles = jax.jit(rope_angles)
    error = np.abs(wrapped(np.asarray(angles(positions, theta), np.float64) - exact))
    assert error.max() < 1e-6
    naive = np.abs(
        wrapped((positions[:, None].astype(np.float32) * theta).astype(np.float64) - exact)
    )
    assert naive.max() > 0.01  # the test can see the error it guards against
    # Up to the documented limit |p| < 2^24 (measured 1.03e-6 rad).
    far = rng.integers(-(2**24) + 1, 2**24, 5_000).astype(np.int32)
    exact = far[:, None].astype(np.float64) * theta.astype(np.float64)
    assert np.abs(wrapped(np.asarray(angles(far, theta), np.float64) - exact)).max() < 2e-6


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_no_nan_at_long_positions(layout):
    x = pseudo_random((1, 5, 2, 128), seed=7)
    positions = jnp.array([0, 10**6, 2**20, 2**24 - 1, 2**31 - 1])
    out = rope(x, positions, rope_frequencies(128)[0], layout=layout)
    assert bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=2e-6)


def test_output_keeps_the_input_dtype_and_rotates_in_float32():
    x = jnp.asarray(pseudo_random((2, 5, 2, 16), seed=8), jnp.bfloat16)
    positions, inv_freq = jnp.arange(5) + 40_000, rope_frequencies(16)[0]
    out = rope(x, positions, inv_freq)
    assert out.dtype == jnp.bfloat16
    # The rotation of the bfloat16 input in float32, rounded once to bfloat16: within half a
    # bfloat16 ulp (2^(e - 8) for |value| in [2^e, 2^(e+1))) of the float32 rotation, up to
    # float32 noise. Rotating in bfloat16 (cos, sin and products each rounded) misses this.
    want = np.asarray(rope(x.astype(jnp.float32), positions, inv_freq))
    half_ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 1e-30))) - 8)
    error = np.abs(np.asarray(out, np.float32) - want)
    assert (error <= half_ulp * (1 + 1e-5) + 1e-7).all(), (error / half_ulp).max()


def test_jit_vmap_and_eval_shape():
    x = pseudo_random((3, 6, 2, 32), seed=9)
    positions = jnp.arange(18).reshape(3, 6) * 1000
    inv_freq = rope_frequencies(32, scaling=YARN)[0]
    direct = apply_rope(x, positions, inv_freq, layout="half")
    jitted = jax.jit(apply_rope, static_argnames="layout")(x, positions, inv_freq, layout="half")
    mapped = jax.jit(jax.vmap(lambda xb, pb: apply_rope(xb, pb, inv_freq, layout="half")))(
        x, positions
    )
    chex.assert_trees_all_close(jitted, direct, mapped, rtol=1e-6, atol=1e-6)
    # One frequency vector per swept base, one rotation each: [3 bases, B, T, N, H].
    swept = jax.jit(jax.vmap(lambda b: apply_rope(x, positions, rope_frequencies(32, base=b)[0])))(
        jnp.array([1e4, 1e5, 1e6])
    )
    chex.assert_shape(swept, (3, *x.shape))
    # A Llama-sized call, shapes only.
    big = jax.eval_shape(
        apply_rope,
        jax.ShapeDtypeStruct((8, 8192, 32, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((8, 8192), jnp.int32),
        jax.ShapeDtypeStruct((64,), jnp.float32),
    )
    assert big.shape == (8, 8192, 32, 128) and big.dtype == jnp.bfloat16


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_compiled_rotation_evaluates_cos_and_sin_once_per_position_and_frequency(layout):
    # The gradient of a rotation of q [B, T, N, H], compiled: every cosine and sine XLA runs has
    # at most T x F elements (the table), never one per element of q. XLA:CPU fuses an elementwise
    # table into its consumers otherwise, which made RoPE a quarter of a training step.
    B, T, N, H = 4, 32, 3, 16
    x = pseudo_random((B, T, N, H), seed=12)
    inv_freq = rope_frequencies(H)[0]

    def loss(x):
        return jnp.sum(apply_rope(x, jnp.arange(T), inv_freq, layout=layout) ** 2)

    text = jax.jit(jax.grad(loss)).lower(x).compile().as_text()
    # A fused computation is a loop over its outputs' elements: one holding a cosine or a sine
    # evaluates it once per output element, so its outputs must be table-sized.
    outputs = [
        header
        for header, body in re.findall(
            r"\n(%?[\w.-]+ \([^\n]*\) -> [^\n]*) \{\n(.*?)\n\}", text, re.S
        )
        if re.search(r" (?:cosine|sine)\(", body)
    ]
    assert outputs, "no cosine or sine found in the compiled program"
    for header in outputs:
        result = header.split(" -> ", 1)[1]
        sizes = [
            math.prod(int(d) for d in dims.split(",") if d)
            for dims in re.findall(r"f32\[([\d,]*)\]", result)
        ]
        assert max(sizes) <= T * (H // 2), header


def test_bad_arguments_are_refused():
    x, inv_freq = jnp.zeros((4, 2, 8)), rope_frequencies(8)[0]
    with pytest.raises(ValueError, match="layout = 'neox'.*interleaved, half"):
        apply_rope(x, jnp.arange(4), inv_freq, layout="neox")
    with pytest.raises(ValueError, match=r"inv_freq must have shape \(F,\) with 1 <= F <= 4"):
        apply_rope(x, jnp.arange(4), jnp.concatenate([inv_freq, inv_freq]))
    with pytest.raises(ValueError, match="T = 4"):
        apply_rope(x, jnp.arange(5), inv_freq)
    with pytest.raises(ValueError, match="do not broadcast"):
        apply_rope(jnp.zeros((2, 4, 2, 8)), jnp.zeros((3, 4), jnp.int32), inv_freq)
    with pytest.raises(TypeError, match="integers"):
        apply_rope(x, jnp.arange(4.0), inv_freq)


# ---------------------------------------------------------------------------------- decay bound
def test_decay_bound_starts_at_half_the_pairs_and_falls_slower_for_a_larger_base():
    offsets = jnp.arange(4096)
    bounds = {
        base: np.asarray(rope_decay_bound(offsets, rope_frequencies(128, base=base)[0]))
        for base in (1e4, 1e6)
    }
    small = bounds[1e4]
    assert small[0] == pytest.approx((64 + 1) / 2, rel=1e-6)  # S_j = j at offset 0
    windows = [
        small[a:b].mean() for a, b in [(0, 16), (16, 64), (64, 256), (256, 1024), (1024, 4096)]
    ]
    assert all(np.diff(windows) < 0), windows  # measured 21.5, 12.8, 8.9, 6.3, 5.0
    assert np.any(np.diff(small) > 0)  # with ripples, not monotone
    assert bounds[1e6][64:4096].mean() > small[64:4096].mean()  # a larger base stretches the decay


def test_rope_kind_reads_rope_type_then_its_alias():
    """The one reader of a rope_scaling dict's kind (the layers, the decoder and the settings ask
    it): "rope_type", else Hugging Face's older "type", else plain RoPE."""
    assert rotary.rope_kind(None) == rotary.rope_kind({}) == "default"
    assert rotary.rope_kind({"type": "dynamic", "factor": 2.0}) == "dynamic"
    assert rotary.rope_kind({"rope_type": "yarn", "type": None}) == "yarn"
    assert rotary.rope_kind({"rope_type": None, "type": "linear"}) == "linear"
    for kind in rotary.LENGTH_DEPENDENT:
        assert rotary.rope_kind({"rope_type": kind}) == kind
