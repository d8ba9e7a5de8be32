"""Scoring every length under both protocols (`posattn.eval.scoring`) on a small model."""

import jax
import numpy as np
import pytest
from conftest import small_config

from posattn import config as config_lib
from posattn import data
from posattn.eval import heldout, intervals, scoring, summary
from posattn.eval import lengths as lengths_lib
from posattn.train import steps


def _model(position):
    cfg = config_lib.validate(small_config(model__position=position, model__max_len=32))
    return steps.init_model(cfg, jax.random.key(0))


@pytest.fixture(scope="module")
def plan_and_tokens():
    held = heldout.held_out_units(data.load_corpus("stdlib"), block=1000)
    plan = heldout.make_plan(
        held, max_len=64, tokens=6 * 64, sliding_tokens=5 * 16, stride=16, seed=0
    )
    return plan, held.tokens


def test_sums_match_a_direct_forward_pass(plan_and_tokens):
    plan, tokens = plan_and_tokens
    model = _model("alibi")
    rows = scoring.score_lengths(
        *model, tokens, plan, lengths=[16, 64], train_len=16, batch_tokens=80, curve_bins=6
    )
    for length, row in zip([16, 64], rows, strict=True):
        windows, units = plan.windows(tokens, length)
        nll, _ = lengths_lib.token_stats(
            *model, windows[:, :-1], windows[:, 1:], chunk=length
        )  # one pass, no batching
        nll = np.asarray(nll, np.float64)
        assert row["count"].sum() == 6 * 64 == nll.size
        np.testing.assert_allclose(row["sum"].sum(), nll.sum(), rtol=1e-5)
        for u in np.unique(units):
            np.testing.assert_allclose(row["sum"][u], nll[units == u].sum(), rtol=1e-5)
        if length == 16:
            assert row["beyond_sum"] is None and "curve" not in row
        else:
            np.testing.assert_allclose(row["beyond_sum"].sum(), nll[:, 16:].sum(), rtol=1e-5)
            assert row["beyond_count"].sum() == nll[:, 16:].size
            curve = row["curve"]
            np.testing.assert_allclose(curve["sum"].sum(), nll.sum(), rtol=1e-5)
            assert curve["count"].sum() == nll.size and curve["edges"][-1] == 64
        slide, s_units, scored = plan.sliding(tokens, length)
        s_nll, _ = lengths_lib.token_stats(*model, slide[:, :-1], slide[:, 1:], chunk=length)
        np.testing.assert_allclose(
            row["sliding_sum"].sum(), np.asarray(s_nll, np.float64)[:, -16:].sum(), rtol=1e-5
        )
        assert row["sliding_count"].sum() == 5 * 16 and scored == 16


def test_learned_reads_only_its_table(plan_and_tokens):
    plan, tokens = plan_and_tokens
    rows = scoring.score_lengths(
        *_model("learned"),
        tokens,
        plan,
        lengths=[32, 64],
        train_len=32,
        batch_tokens=64,
        curve_bins=4,
    )
    assert rows[1] is None and rows[0]["beyond_sum"] is None
    # The curve is kept at the longest length only; the model cannot read it, so there is none.
    assert "curve" not in rows[0]


def test_windows_per_pass_and_curve_edges():
    assert scoring.windows_per_pass(64, 8192) == 128 and scoring.windows_per_pass(9000, 10) == 1
    edges = scoring.curve_edges(1024, 32)
    assert edges[0] == 0 and edges[-1] == 1024 and np.all(np.diff(edges) > 0)


def test_sliding_windows_capped_per_length_score_a_prefix_of_the_blocks(plan_and_tokens):
    plan, tokens = plan_and_tokens
    model = _model("rope")
    capped, full = (
        scoring.score_lengths(
            *model,
            tokens,
            plan,
            lengths=[16, 64],
            train_len=16,
            batch_tokens=64,
            curve_bins=4,
            sliding_max_tokens=cap,
        )
        for cap in (128, 0)
    )
    # 128 tokens a length: 8 windows of 16 (all 5 blocks), 2 windows of 64 (the first 2 blocks).
    assert [len(r["sliding_block_sums"]) for r in capped] == [5, 2]
    assert [len(r["sliding_block_sums"]) for r in full] == [5, 5]
    np.testing.assert_allclose(
        capped[1]["sliding_block_sums"], full[1]["sliding_block_sums"][:2], rtol=1e-6
    )
    assert capped[1]["sliding_count"].sum() == 2 * 16
    units = plan.block_units
    weights = intervals.bootstrap_weights(plan.num_units, replicates=50, seed=0)
    row = summary.summarize_row([[r] for r in capped], weights, block_units=units)
    # The change from the first length is taken on the first 2 blocks at both lengths.
    a, b = (np.sum(r["sliding_block_sums"][:2]) for r in (capped[1], full[0]))
    assert row["delta_L_sliding"][1] == pytest.approx((a - b) / 32, rel=1e-9)
    assert row["eval_bytes_sliding"] == [80, 32]


@pytest.mark.parametrize("position", ["rope", "t5"])
def test_a_window_of_w_is_the_last_w_tokens_read_from_scratch(position):
    """One layer of a relative family: with every key at most w - 1 back, position i's
    prediction is the model's at the last position of tokens i - w + 1 .. i read alone."""
    cfg = config_lib.validate(
        small_config(model__position=position, model__num_layers=1, model__max_len=32)
    )
    graphdef, params, constants = steps.init_model(cfg, jax.random.key(0))
    model_cfg = lengths_lib.model_config_of(graphdef, params, constants)
    w, T = 8, 24
    small = lengths_lib.windowed(model_cfg, w)
    assert [s.window for s in small.layers] == [w]
    from flax import nnx

    from posattn.nn.model import TransformerLM

    win_graph = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(small, rngs=nnx.Rngs(0))))
    tokens = np.random.default_rng(0).integers(0, model_cfg.vocab_size, (2, T + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    nll, _ = lengths_lib.token_stats(win_graph, params, constants, x, y, chunk=T)
    full, _ = lengths_lib.token_stats(graphdef, params, constants, x, y, chunk=T)
    nll, full = np.asarray(nll), np.asarray(full)
    np.testing.assert_array_equal(nll[:, :w], full[:, :w])  # the window hides nothing yet
    for i in range(w, T):
        alone, _ = lengths_lib.token_stats(
            graphdef, params, constants, x[:, i - w + 1 : i + 1], y[:, i - w + 1 : i + 1], chunk=w
        )
        np.testing.assert_allclose(nll[:, i], np.asarray(alone)[:, -1], rtol=2e-5, atol=2e-6)
    assert not np.allclose(nll[:, w:], full[:, w:], rtol=1e-3)
    # The same tree: the window on some layers reads the same params.
    two = model_cfg.replace(num_layers=2)
    for layers in (None, (0,), (1,)):
        some = lengths_lib.windowed(two, w, layers)
        abstract = nnx.eval_shape(lambda: TransformerLM(some, rngs=nnx.Rngs(0)))  # noqa: B023
        plain = nnx.eval_shape(lambda: TransformerLM(two, rngs=nnx.Rngs(0)))
        assert jax.tree.structure(nnx.state(abstract)) == jax.tree.structure(nnx.state(plain))


def test_windowed_keeps_smaller_windows_and_the_pattern():
    from posattn.nn.config import ModelConfig

    cfg = ModelConfig.from_keys(
        position="rope",
        d_model=32,
        num_heads=2,
        num_layers=3,
        layer_pattern=("rope:window=4,rope_base=1e6", "nope:ssmax=True"),
    )
    new = lengths_lib.windowed(cfg, 16)
    assert [(s.position, s.window) for s in new.layers] == [("rope", 4), ("nope", 16), ("rope", 4)]
    assert new.layers[0].settings == cfg.layers[0].settings and new.layers[1].ssmax
    plain = lengths_lib.windowed(ModelConfig.from_keys(position="alibi", num_layers=2), 16)
    assert [s.window for s in plain.layers] == [16, 16]
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="window"):
            lengths_lib.windowed(cfg, bad)
    # Some layers only: the pattern is spelled out a layer at a time.
    some = lengths_lib.windowed(cfg, 16, layers=[1, 2])
    assert [(s.position, s.window) for s in some.layers] == [("rope", 4), ("nope", 16), ("rope", 4)]
    one = lengths_lib.windowed(ModelConfig.from_keys(position="t5", num_layers=3), 8, layers=(1,))
    assert [s.window for s in one.layers] == [None, 8, None] and len(one.layer_pattern) == 3
    assert lengths_lib.windowed(cfg, 16, layers=(0, 1, 2)).layers == new.layers
    for bad in ((), (3,), (-1,), (True,)):
        with pytest.raises(ValueError, match="indices of the 3 layers"):
            lengths_lib.windowed(cfg, 16, layers=bad)
