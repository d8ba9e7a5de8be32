"""`posattn.eval.lengths.rope_row_model`: every RoPE scaling of one model read at one length is one
graph (its frequencies and attention factor as arrays), with the numbers of `with_rope_scaling`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config

from posattn import config as config_lib
from posattn.eval import lengths as lengths_lib
from posattn.train import steps

L, T = 32, 128

SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 4.0, "original_max_position_embeddings": L},
    {"rope_type": "ntk", "factor": 4.0, "original_max_position_embeddings": L},
    {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": L},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L},
    {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": L,
    },
]


def _model(**model):
    config = small_config(model__position="rope", data__seq_len=L, model__max_len=L, **model)
    cfg = config_lib.validate(config)
    _, params, _ = steps.init_model(cfg, jax.random.key(0))
    return cfg, params


def _nll(graphdef, params, constants, tokens):
    return lengths_lib.token_stats(
        graphdef, params, constants, tokens[:, :-1], tokens[:, 1:], chunk=T
    )[0]


@pytest.fixture(scope="module")
def tokens():
    return jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, T + 1)), jnp.int32)


@pytest.mark.parametrize(
    ("model", "scalings"),
    [({}, SCALINGS), ({"model__scan_layers": True}, [SCALINGS[0], SCALINGS[3], SCALINGS[4]])],
    ids=["unrolled", "scanned"],
)
def test_every_scaling_is_one_graph_with_the_same_numbers(tokens, model, scalings):
    cfg, params = _model(**model)
    traced, original = [], lengths_lib._token_stats

    def counted(*args, **kwargs):
        traced.append(args[0])
        return original(*args, **kwargs)

    lengths_lib._compiled.cache_clear()  # so that the table graph is traced here
    graphdefs = set()
    for scaling in scalings:
        expected = lengths_lib.with_rope_scaling(cfg, scaling)
        expected = _nll(expected[0], params, expected[1], tokens)
        graphdef, constants = lengths_lib.rope_row_model(cfg, scaling, T)
        graphdefs.add(graphdef)
        assert lengths_lib.model_config_of(graphdef, params, constants) == cfg
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(lengths_lib, "_token_stats", counted)
            np.testing.assert_array_equal(_nll(graphdef, params, constants, tokens), expected)
    assert len(graphdefs) == 1  # one compiled program serves every row at this length
    assert len([g for g in traced if g in graphdefs]) == 1  # and traced once


def test_dynamic_table_is_the_length_s_own(tokens):
    """Dynamic NTK's base follows the window length: the table at T differs from the one at 2T
    and from the plain frequencies, and reading the model at another length is refused."""
    cfg, params = _model()
    dynamic = SCALINGS[3]
    at_t = _inv_freq(lengths_lib.rope_row_model(cfg, dynamic, T)[1])
    at_2t = _inv_freq(lengths_lib.rope_row_model(cfg, dynamic, 2 * T)[1])
    plain = _inv_freq(lengths_lib.rope_row_model(cfg, None, T)[1])
    assert not np.array_equal(at_t, at_2t) and not np.array_equal(at_t, plain)
    graphdef, constants = lengths_lib.rope_row_model(cfg, dynamic, 2 * T)
    with pytest.raises(ValueError, match=f"windows of {2 * T} tokens"):
        _nll(graphdef, params, constants, tokens)


def _inv_freq(constants):
    (table,) = [
        leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(constants)[0]
        if "inv_freq" in jax.tree_util.keystr(path)
    ]
    return np.asarray(table)


def test_needs_a_rope_model():
    cfg = config_lib.validate(small_config(model__position="alibi"))
    with pytest.raises(ValueError, match="RoPE"):
        lengths_lib.rope_row_model(cfg, SCALINGS[1], T)


def test_none_keeps_the_model_s_own_scaling(tokens):
    cfg, params = _model()
    own = cfg.replace(rope_scaling=dict(SCALINGS[4]))  # a model trained under YaRN
    graphdef, _, constants = steps.init_model(own, jax.random.key(0))
    expected = _nll(graphdef, params, constants, tokens)
    table = lengths_lib.rope_row_model(own, None, T)
    np.testing.assert_array_equal(_nll(table[0], params, table[1], tokens), expected)
    plain = lengths_lib.rope_row_model(cfg, None, T)
    assert not np.array_equal(_nll(plain[0], params, plain[1], tokens), expected)


REMAPS = [
    {"type": "rerope", "window": 8},
    {"type": "rerope", "window": 8, "log_scale_base": L},
    {"type": "rerope", "window": 8, "leak": 3},
    {"type": "self_extend", "window": 8, "group": 4},
    {"type": "self_extend", "window": 8, "group": 2, "log_scale_base": L},
]


def test_every_remap_of_one_window_is_one_graph_with_the_same_numbers(tokens):
    """ReRoPE, Leaky ReRoPE and SelfExtend of one window, with and without the log scale, read
    at one length: one graph (their numbers as arrays), each with the numbers of the model that
    holds the remap itself; another window is another graph."""
    cfg, params = _model()
    graphdefs = set()
    for remap in REMAPS:
        direct = lengths_lib.with_rope_scaling(cfg.replace(rope_remap=remap), None)
        expected = _nll(direct[0], params, direct[1], tokens)
        graphdef, constants = lengths_lib.rope_row_model(cfg, None, T, remap)
        graphdefs.add(graphdef)
        # the same operations on the same values (bitwise where it was written, an AVX2 EPYC)
        got = _nll(graphdef, params, constants, tokens)
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert len(graphdefs) == 1
    other = lengths_lib.rope_row_model(cfg, None, T, {"type": "rerope", "window": 4})[0]
    assert other not in graphdefs
