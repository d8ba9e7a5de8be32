"""Probe sequences (passkey among distractors, induction) and their loss/accuracy scoring."""

import jax
import numpy as np
import pytest
from conftest import small_config

from posattn import config as config_lib
from posattn import data
from posattn.data import probes
from posattn.eval import lengths as lengths_lib
from posattn.eval import retrieval
from posattn.train import steps


def test_passkey_with_distractors_holds_other_numbers_of_the_key_length():
    for seed in range(5):
        sample = probes.passkey_sample(
            np.random.default_rng(seed), length=200, depth=0.5, digits=4, distractors=True
        )
        text = sample.tokens.tobytes()
        key = text[sample.answer]
        assert len(text) == 200 and key.isdigit() and len(key) == 4
        assert text.count(probes.NEEDLE_PREFIX) == 2 and text.endswith(probes.NEEDLE_PREFIX + key)
        assert text[sample.needle_at :].startswith(probes.NEEDLE_PREFIX + key + b". ")
        assert sum(c.isdigit() for c in text.decode()) > 8  # distractor digits in the filler
        assert b"Room " in text
    plain = probes.passkey_sample(np.random.default_rng(0), length=200, depth=0.5, digits=4)
    assert sum(c.isdigit() for c in plain.tokens.tobytes().decode()) == 8  # the training form


def test_induction_sample_layout():
    background = np.frombuffer(b"x = 1\n" * 30, np.uint8)
    sample = probes.induction_sample(np.random.default_rng(2), background, span=6, gap=20)
    t = sample.tokens
    assert t.size == background.size and sample.repeat.stop == t.size
    assert sample.repeat.start - sample.source.stop == 20
    assert (
        np.array_equal(t[sample.source], t[sample.repeat]) and t[sample.repeat].tobytes().isalpha()
    )
    np.testing.assert_array_equal(probes.target_positions(slice(5, 8)), [4, 5, 6])
    with pytest.raises(ValueError, match="2 \\* span \\+ gap"):
        probes.induction_sample(np.random.default_rng(2), background, span=6, gap=170)


def _model(position):
    cfg = config_lib.validate(small_config(model__position=position, model__max_len=32))
    return steps.init_model(cfg, jax.random.key(1))


def test_probe_scores_are_the_models_nll_at_the_scored_positions():
    model = _model("learned")
    tokens = data.load_corpus("stdlib").val[:20000]
    ind = retrieval.induction_scores(
        *model,
        tokens,
        lengths=[32, 64],
        gaps=[0, 10, 30],
        span=4,
        samples=3,
        seed=5,
        batch_tokens=64,
    )
    assert np.all(np.isnan(ind["loss"][1]))  # learned: no row past its table
    assert np.isnan(ind["loss"][0, 2])  # 2 * 4 + 30 > 33: does not fit
    # Rebuild the cell (32, gap 10) and score it directly.
    made = []
    for s in range(3):
        rng = np.random.default_rng([5, 32, 1, s, 0x1D])
        start = int(rng.integers(0, tokens.size - 33))
        made.append(
            probes.induction_sample(rng, np.asarray(tokens[start : start + 33]), span=4, gap=10)
        )
    seqs = np.stack([m.tokens for m in made]).astype(np.int32)
    nll, pred = lengths_lib.token_stats(*model, seqs[:, :-1], seqs[:, 1:], chunk=32)
    where = probes.target_positions(slice(made[0].repeat.start + 1, made[0].repeat.stop))
    expect = np.asarray(nll)[:, where].mean()
    assert ind["loss"][0, 1] == pytest.approx(expect, rel=1e-5)
    hits = (np.asarray(pred)[:, where] == seqs[:, where + 1]).mean()
    assert ind["acc"][0, 1] == pytest.approx(hits)

    pk = retrieval.passkey_scores(
        *model, lengths=[32, 64], depths=[0.0, 1.0], samples=2, digits=3, seed=0, batch_tokens=64
    )
    assert set(pk) == {"acc", "digit_acc", "loss", "se"}
    assert np.all(np.isnan(pk["loss"][1])) and np.all(pk["loss"][0] > 0)
    assert np.all(np.isnan(pk["se"][1]))
    assert np.all((0 <= pk["digit_acc"][0]) & (pk["digit_acc"][0] <= 1))
    assert np.all(pk["acc"][0] <= pk["digit_acc"][0])
    # Rebuild the cell (32, depth 1.0): its loss is the mean of each sample's NLL per digit, its
    # se their standard error.
    per_sample = []
    for s in range(2):
        made = probes.passkey_sample(
            np.random.default_rng([0, 32, 1, s, 0xD15]),
            length=33,
            depth=1.0,
            digits=3,
            distractors=True,
        )
        seq = made.tokens[None].astype(np.int32)
        nll, _ = lengths_lib.token_stats(*model, seq[:, :-1], seq[:, 1:], chunk=32)
        per_sample.append(float(np.asarray(nll)[0, probes.target_positions(made.answer)].mean()))
    assert pk["loss"][0, 1] == pytest.approx(np.mean(per_sample), rel=1e-5)
    assert pk["se"][0, 1] == pytest.approx(np.std(per_sample, ddof=1) / np.sqrt(2), rel=1e-4)
