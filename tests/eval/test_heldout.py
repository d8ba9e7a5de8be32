"""Held-out units, evaluation plans, the bootstrap and the summaries built on them (NumPy only)."""

import numpy as np
import pytest

from posattn import data
from posattn.eval import heldout, intervals, summary


@pytest.fixture(scope="module")
def held():
    return heldout.held_out_units(data.load_corpus("stdlib"), block=1000)


def test_stdlib_units_are_the_held_out_files(held):
    spans = held.spans
    assert held.unit == "file" and len(spans) > 10
    assert spans[0, 0] == 0 and spans[-1, 1] == held.tokens.size
    np.testing.assert_array_equal(spans[1:, 0], spans[:-1, 1] + 1)  # joined by one newline
    assert np.all(held.tokens[spans[:-1, 1]] == ord("\n"))


def test_corpus_without_files_is_cut_into_blocks(tmp_path):
    path = tmp_path / "one.txt"
    path.write_bytes(bytes(range(256)) * 100)
    corpus = data.load_corpus(str(path))
    held = heldout.held_out_units(corpus, block=300)
    assert held.unit == "block of 300 tokens"
    assert held.spans[0, 0] == 0 and held.spans[-1, 1] == corpus.val.size
    assert np.all(np.diff(held.spans, axis=1) <= 300)


def test_plan_scores_the_same_tokens_at_every_length_and_spreads_over_units(held):
    plan = heldout.make_plan(
        held, max_len=256, tokens=40 * 256, sliding_tokens=64 * 32, stride=32, seed=3
    )
    assert plan.chunk_starts.size == 40 and plan.block_ends.size == 64
    # Round-robin: 40 chunks come from 40 different files (there are more than 40 long enough).
    assert np.unique(plan.chunk_units).size == 40
    every = np.sort((plan.chunk_starts[:, None] + 1 + np.arange(256)).ravel())  # chunk targets
    for length in (32, 64, 256):
        windows, units = plan.windows(held.tokens, length)
        assert windows.shape == (40 * 256 // length, length + 1)
        starts = plan.chunk_starts[:, None] + length * np.arange(256 // length)
        predicted = np.sort((starts.reshape(-1, 1) + 1 + np.arange(length)).ravel())
        np.testing.assert_array_equal(predicted, every)  # the same target tokens at every length
        np.testing.assert_array_equal(
            windows[:, 1:].ravel(),
            held.tokens[(starts.reshape(-1, 1) + 1 + np.arange(length)).ravel()],
        )
        # Each window lies inside the file of its unit.
        first = np.repeat(plan.chunk_starts, 256 // length) + length * np.tile(
            np.arange(256 // length), 40
        )
        lo, hi = held.spans[units, 0], held.spans[units, 1]
        assert np.all(first >= lo) and np.all(first + length + 1 <= hi)
    for length in (32, 128, 256):
        slide, units, scored = plan.sliding(held.tokens, length)
        assert slide.shape == (64, length + 1) and scored == 32
        np.testing.assert_array_equal(slide[:, -1], held.tokens[plan.block_ends - 1])
        assert np.all(plan.block_ends - 256 - 1 >= held.spans[units, 0])  # context in the file
        assert np.all(plan.block_ends <= held.spans[units, 1])
    again = heldout.make_plan(
        held, max_len=256, tokens=40 * 256, sliding_tokens=64 * 32, stride=32, seed=3
    )
    np.testing.assert_array_equal(again.chunk_starts, plan.chunk_starts)
    assert again.fingerprint == plan.fingerprint
    other = heldout.make_plan(
        held, max_len=256, tokens=40 * 256, sliding_tokens=64 * 32, stride=32, seed=4
    )
    assert other.fingerprint != plan.fingerprint


def test_plan_rejects_bad_settings(held):
    with pytest.raises(ValueError, match="stride"):
        heldout.make_plan(held, max_len=64, tokens=64, sliding_tokens=64, stride=65, seed=0)
    with pytest.raises(ValueError, match="no held-out unit"):
        heldout.make_plan(held, max_len=10**8, tokens=64, sliding_tokens=0, stride=1, seed=0)


def test_bootstrap_intervals():
    weights = intervals.bootstrap_weights(20, replicates=500, seed=0)
    assert weights.shape == (500, 20) and np.all(weights.sum(axis=1) == 20)
    counts = np.arange(1.0, 21.0)
    same = 2.5 * counts  # every unit has the mean loss 2.5: no spread to resample
    point, (lo, hi) = intervals.ratio_interval(same[None], counts, weights)
    assert point == pytest.approx(2.5) and lo == pytest.approx(2.5) and hi == pytest.approx(2.5)
    rng = np.random.default_rng(1)
    noisy = counts * rng.normal(2.0, 0.3, size=20)
    point, (lo, hi) = intervals.ratio_interval(noisy[None], counts, weights)
    assert lo < point < hi and 0.05 < hi - lo < 1.0
    delta, ci = intervals.paired_interval(noisy, noisy, counts, weights)
    assert delta == 0.0 and ci == [0.0, 0.0]
    delta, ci = intervals.paired_interval(noisy + 0.1 * counts, noisy, counts, weights)
    assert delta == pytest.approx(0.1, abs=1e-12) and ci == pytest.approx([0.1, 0.1], abs=1e-12)


def test_summaries_of_seeds_and_lengths():
    weights = intervals.bootstrap_weights(4, replicates=200, seed=0)
    count = np.array([10.0, 20.0, 30.0, 40.0])

    def scores(loss, beyond=None):
        return {
            "sum": loss * count,
            "count": count,
            "beyond_sum": None if beyond is None else beyond * count,
            "beyond_count": None if beyond is None else count,
            "sliding_sum": None,
            "sliding_count": None,
        }

    per_length = [[scores(2.0), scores(2.2)], [scores(1.5, 1.0), scores(1.7, 1.2)], None]
    row = summary.summarize_row(per_length, weights)
    assert row["loss"][:2] == pytest.approx([2.1, 1.6]) and row["loss"][2] is None
    assert row["loss_seeds"][0] == pytest.approx([2.0, 2.2])
    assert row["loss_se"][0] == pytest.approx(0.1)  # std [2.0, 2.2] (ddof 1) / sqrt 2
    assert row["delta_L"][1] == pytest.approx(-0.5)
    assert row["delta_L_ci"][1] == pytest.approx([-0.5, -0.5])
    assert row["loss_beyond_L"][:2] == [None, pytest.approx(1.1)]
    assert row["eval_bytes"][:2] == [100, 100] and row["loss_sliding"] == [None] * 3
    other = [[scores(2.5), scores(2.5)], [scores(1.0), scores(1.0)], None]
    diff = summary.paired_difference(per_length, other, weights)
    assert diff["delta"][:2] == pytest.approx([-0.4, 0.6]) and diff["delta"][2] is None
    curve = summary.summarize_curve(
        [{"edges": [0, 1, 3], "sum": np.ones((4, 2)), "count": np.full((4, 2), 2.0)}], weights
    )
    assert curve["position"] == [0.0, 1.5] and curve["loss"] == pytest.approx([0.5, 0.5])
