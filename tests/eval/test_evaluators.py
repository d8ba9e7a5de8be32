"""The evaluators (`posattn.eval.registry`): each built-in one against the function it wraps, the
probes they read, the shared forward pass, RoPE's eval-time rows, and the registry itself."""

import jax
import numpy as np
import pytest
from conftest import small_config

from posattn import config as config_lib
from posattn import data
from posattn.data import probes
from posattn.eval import attention_stats, heldout, registry, retrieval, scoring, summary
from posattn.eval import lengths as lengths_lib
from posattn.train import steps

# ----------------------------------------------------------------------------------------------
# Probes.


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_passkey_sample_layout(depth):
    sample = probes.passkey_sample(np.random.default_rng(3), length=80, depth=depth, digits=5)
    text = sample.tokens.tobytes()
    assert len(text) == 80 and text.count(probes.NEEDLE_PREFIX) == 2
    key = text[sample.answer]
    assert key.isdigit() and len(key) == 5 and text.endswith(probes.NEEDLE_PREFIX + key)
    assert text[sample.needle_at :].startswith(probes.NEEDLE_PREFIX + key + b". ")
    assert sum(c.isdigit() for c in text.decode()) == 10  # the filler holds no digit
    filler = 80 - 2 * (len(probes.NEEDLE_PREFIX) + 5) - 2
    assert sample.needle_at == round(depth * filler)


def test_passkey_scoring_is_exact_match():
    sample = probes.passkey_sample(np.random.default_rng(0), length=64, depth=0.5)
    perfect = sample.tokens[1:].astype(np.int32)  # predictions[t] = tokens[t + 1]
    assert probes.score_passkey(sample, perfect)
    wrong = perfect.copy()
    wrong[sample.answer.stop - 2] = ord("x")  # the last digit is predicted at position n - 2
    assert not probes.score_passkey(sample, wrong)
    with pytest.raises(ValueError, match="length >= 28"):
        probes.passkey_sample(np.random.default_rng(0), length=27, depth=0.5)


def test_copy_sample_and_score():
    background = np.frombuffer(b"x = 1\n" * 20, np.uint8)
    sample = probes.copy_sample(np.random.default_rng(1), background, segment=10)
    tokens = sample.tokens
    assert tokens.size == background.size
    assert np.array_equal(tokens[sample.source], tokens[sample.repeat])
    assert tokens[sample.repeat].tobytes().isalpha()
    assert probes.score_copy(sample, tokens[1:]) == (9, 9)
    assert probes.score_copy(sample, np.zeros(tokens.size - 1, np.int32)) == (0, 9)


# ----------------------------------------------------------------------------------------------
# Passkey rows in training batches.


def test_passkey_mixing_is_pure_and_split_by_process():
    corpus = data.load_corpus("stdlib")
    kw = dict(seed=7, step=11, batch_size=8, seq_len=48)
    plain = data.train_batch(corpus, **kw)
    assert all(
        np.array_equal(plain[k], data.train_batch(corpus, **kw, passkey_fraction=0.0)[k])
        for k in plain
    )
    mixed = data.train_batch(corpus, **kw, passkey_fraction=0.5)
    again = data.train_batch(corpus, **kw, passkey_fraction=0.5)
    assert np.array_equal(mixed["inputs"], again["inputs"])
    halves = [
        data.train_batch(corpus, **kw, passkey_fraction=0.5, process_index=i, process_count=2)
        for i in (0, 1)
    ]
    assert np.array_equal(np.concatenate([h["inputs"] for h in halves]), mixed["inputs"])
    changed = [
        not np.array_equal(a, b) for a, b in zip(mixed["inputs"], plain["inputs"], strict=True)
    ]
    assert 0 < sum(changed) < 8
    for row, was_changed in zip(mixed["inputs"], changed, strict=True):
        assert (probes.NEEDLE_PREFIX in row.astype(np.uint8).tobytes()) == was_changed
    every = data.train_batch(corpus, **kw, passkey_fraction=1.0)
    for inputs, targets in zip(every["inputs"], every["targets"], strict=True):
        text = np.concatenate([inputs, targets[-1:]]).astype(np.uint8).tobytes()
        key = text.rsplit(b"=", 1)[1]
        assert (
            text.count(probes.NEEDLE_PREFIX) == 2
            and key.isdigit()
            and 1 <= len(key) <= probes.TRAIN_DIGITS
        )
        assert probes.NEEDLE_PREFIX + key + b". " in text
    with pytest.raises(data.DataError, match="passkey_fraction"):
        data.train_batch(corpus, **kw, passkey_fraction=1.5)


# ----------------------------------------------------------------------------------------------
# Evaluation functions.


def _model(position, **overrides):
    config = small_config(model__position=position, model__max_len=32, **overrides)
    cfg = config_lib.validate(config)
    return cfg, *steps.init_model(cfg, jax.random.key(0))


@pytest.fixture(scope="module")
def text():
    return heldout.eval_text(
        data.load_corpus("stdlib"),
        lengths=[16, 32, 64],
        max_tokens=128,
        sliding_tokens=64,
        stride=16,
        seed=0,
    )


def _settings(name, **own):
    evaluator = registry.get(name)
    shared = {"train_len": 32, "lengths": [16, 32, 64], "batch_tokens": 4 * 64, "seed": 0}
    return evaluator, {**evaluator.defaults, **own, **shared}


def test_loss_evaluator_matches_eval_step_and_learned_is_null_past_its_table(text):
    cfg, *model = _model("learned")
    evaluator, settings = _settings("loss", per_position_bins=4)
    assert evaluator.run(model, text, 64, settings) is None  # past the learned table
    got = evaluator.run(model, text, 32, settings)
    windows, _ = text.plan.windows(text.val, 32)
    nll, count = steps.eval_step(*model, {"inputs": windows[:, :-1], "targets": windows[:, 1:]})
    assert summary.mean_losses([got])[0] == pytest.approx(float(nll / count), rel=1e-5)
    assert "curve" not in got  # the curve is kept at the longest length only
    direct = scoring.score_lengths(
        *model,
        text.val,
        text.plan,
        lengths=[32],
        train_len=32,
        batch_tokens=256,
        curve_bins=4,
        curve_length=64,
    )[0]
    np.testing.assert_allclose(got["sum"], direct["sum"])


def test_probe_evaluators_wrap_their_scores_and_give_none_where_unreadable(text):
    cfg, *model = _model("learned")
    evaluator, settings = _settings("passkey", samples=2, digits=3)
    got = evaluator.run(model, text, 32, settings)
    grids = retrieval.passkey_scores(
        *model, lengths=[32], depths=[0.0, 1.0], samples=2, digits=3, seed=0, batch_tokens=256
    )
    assert got["acc"] == [float(x) for x in grids["acc"][0]]
    assert evaluator.run(model, text, 64, settings)["loss"] == [None, None]
    assert probes.passkey_min_length(3) - 1 == 23  # a 22-token window cannot hold 3 digits
    assert evaluator.run(model, text, 22, settings)["loss"] == [None, None]
    assert evaluator.run(model, text, 23, settings)["loss"][0] is not None
    evaluator, settings = _settings("induction", samples=2, span=4, gap_multiples=[0, 1])
    got = evaluator.run(model, text, 32, settings)
    assert len(got["loss"]) == 2 and got["loss"][1] is None  # 2 * 4 + 32 > 33: does not fit
    evaluator, settings = _settings("copy", samples=2, segment=4)
    assert isinstance(evaluator.run(model, text, 32, settings), float)
    assert evaluator.run(model, text, 64, settings) is None
    evaluator, settings = _settings("attention", attention_windows=2, head_strings=3)
    stats = evaluator.run(model, text, 32, settings)  # at L: the heads' scores too
    assert set(stats) == {"entropy", "distance", "mass_beyond_L", "previous_token", "induction"}
    tokens = attention_stats.repeated_strings(np.random.default_rng(0), 3, 16, 256)
    assert tokens.shape == (3, 32) and (tokens[:, 16:] == tokens[:, :16]).all()
    assert tokens.min() >= ord("a") and tokens.max() <= ord("z")  # a byte model: letters
    ids = attention_stats.repeated_strings(np.random.default_rng(0), 4, 50, 50_000)
    assert ids.max() >= 256 and ids.max() < 50_000  # a tokenizer's model: any id
    want = attention_stats.head_scores(*model, tokens, period=16)
    assert stats["induction"] == want["induction"] and len(stats["entropy"]) == 2
    assert evaluator.run(model, text, 64, settings) is None
    settings["train_len"] = 16  # past L: the statistics only
    assert set(evaluator.run(model, text, 32, settings)) == {"entropy", "distance", "mass_beyond_L"}
    settings.update(train_len=32, head_strings=0)  # off
    assert "induction" not in evaluator.run(model, text, 32, settings)


def _reads(monkeypatch, predict):
    """Make `retrieval.passkey_places` read predictions `predict(seqs) -> int[n, T]`."""

    def forward(graphdef, params, constants, seqs, batch):
        pred = predict(np.asarray(seqs))
        yield np.zeros(pred.shape, np.float32), pred

    monkeypatch.setattr(retrieval.lengths_lib, "forward", forward)


def test_passkey_places_say_where_each_wrong_digit_came_from(monkeypatch):
    kw = dict(length=48, depths=[0.0, 1.0], samples=16, digits=4, seed=0, batch_tokens=512)
    made = retrieval.passkey_samples(
        **{k: v for k, v in kw.items() if k != "batch_tokens"}, distractors=True
    )
    keys = np.stack([m.tokens[m.answer] for m in made])  # (2 * 16, 4)
    assert len(made) == 32 and all(m.tokens.size == 49 for m in made)

    def places(predict):
        _reads(monkeypatch, predict)
        got = retrieval.passkey_places(None, None, None, **kw)
        assert set(got) == set(retrieval.PLACES) and got["right"].shape == (2, 4)
        np.testing.assert_allclose(sum(got.values()), 1.0)  # every digit falls in one class
        return got

    assert (places(lambda s: s[:, 1:])["right"] == 1).all()  # the next byte: every digit right
    # One byte ahead (the key found, its place lost): a digit the key holds next, or the same
    # digit where the key repeats it; the last digit is read off the sequence's end, right.
    ahead = places(lambda s: np.concatenate([s[:, 2:], s[:, -1:]], axis=1))
    same = (keys[:, 1:] == keys[:, :-1]).reshape(2, 16, 3).mean(axis=1)
    np.testing.assert_allclose(ahead["right"][:, :3], same)
    np.testing.assert_allclose(ahead["later"][:, :3], 1 - same)
    assert (ahead["right"][:, 3] == 1).all()
    # One byte behind: the first digit reads "=", no digit; the others the key's digit before
    # (counted as a later one where the key holds it again further on).
    behind = places(lambda s: s[:, :-1])
    assert (behind["other"][:, 0] == 1).all() and (behind["other"][:, 1:] == 0).all()
    assert (behind["window"] == 0).all() and behind["earlier"][:, 1:].mean() > 0.7

    # Another number of the window: each row's first distractor digit that its key lacks ("x",
    # no digit, in a row without one).
    found = [
        next((d for d in m.tokens[: m.answer.start] if 48 <= d <= 57 and d not in k), None)
        for m, k in zip(made, keys, strict=True)
    ]

    def distractor(s):
        pred = np.full((len(s), s.shape[1] - 1), ord("x"), np.int32)
        for i, (m, d) in enumerate(zip(made, found, strict=True)):
            pred[i, probes.target_positions(m.answer)] = ord("x") if d is None else d
        return pred

    window = places(distractor)
    has = np.array([d is not None for d in found]).reshape(2, 16).mean(axis=1)
    assert 0 < has.min() and has.max() < 1
    np.testing.assert_allclose(window["window"], np.repeat(has[:, None], 4, axis=1))
    np.testing.assert_allclose(window["other"], 1 - window["window"])


def test_passkey_places_at_random_draw_from_the_digits_before(monkeypatch):
    text = b"x 77 passkey=12. passkey=12"
    sample = probes.PasskeySample(np.frombuffer(text, np.uint8), slice(25, 27), 2)
    monkeypatch.setattr(retrieval, "passkey_samples", lambda **kw: [sample])
    got = retrieval.passkey_places_at_random(length=26, depths=[0.0], samples=1, digits=2, seed=0)
    # Digit 1 of "12": 7 7 1 2 before it; digit 2: 7 7 1 2 1.
    want = {"right": [1 / 4, 1 / 5], "later": [1 / 4, 0], "earlier": [0, 2 / 5]}
    want.update(window=[2 / 4, 2 / 5], other=[0, 0])
    for place in retrieval.PLACES:
        np.testing.assert_allclose(got[place][0], want[place], err_msg=place)


def test_passkey_places_of_a_model_agree_with_its_scores():
    cfg, *model = _model("rope")
    kw = dict(length=32, depths=[0.0, 1.0], samples=3, digits=3, seed=5, batch_tokens=256)
    got = retrieval.passkey_places(*model, **kw)
    grids = retrieval.passkey_scores(
        *model, lengths=[32], **{k: v for k, v in kw.items() if k != "length"}
    )
    np.testing.assert_allclose(got["right"].mean(axis=1), grids["digit_acc"][0])


def test_registry_settings_names_and_a_new_evaluator():
    assert registry.names()[:5] == ["loss", "attention", "passkey", "induction", "copy"]
    assert registry.settings_of(registry.get("copy"), None) is None  # off by default
    config = {"copy": {"enabled": True, "samples": 3, "segment": 5, "other": 1}}
    assert registry.settings_of(registry.get("copy"), config) == {
        "samples": 3,
        "segment": 5,
        "enabled": True,
    }
    assert (
        registry.settings_of(registry.get("attention"), {"eval": {"attention_windows": 0}}) is None
    )
    with pytest.raises(KeyError, match="known: loss"):
        registry.get("bogus")
    mine = registry.Evaluator("ones", lambda model, text, length, settings: 1.0)
    registry.register(mine)
    try:
        assert "ones" in registry.names()
        with pytest.raises(ValueError, match="already"):
            registry.register(mine)
    finally:
        registry.unregister("ones")
    with pytest.raises(ValueError, match="combine"):
        registry.Evaluator("x", print, combine="sum")


def test_chunked_output_projection_is_exact():
    _, graphdef, params, constants = _model("alibi")
    tokens = np.asarray(data.load_corpus("stdlib").val[:200], np.int32)
    inputs, targets = tokens[None, :-1], tokens[None, 1:]  # T = 199: not a multiple of the chunk
    whole = lengths_lib.token_stats(graphdef, params, constants, inputs, targets, chunk=199)
    chunked = lengths_lib.token_stats(graphdef, params, constants, inputs, targets, chunk=16)
    np.testing.assert_allclose(chunked[0], whole[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(chunked[1], whole[1])


def test_rope_rows_change_only_the_frequencies(text):
    cfg, graphdef, params, constants = _model("rope")
    assert lengths_lib.rope_scaling_row("linear", train_len=32, eval_len=32) is None
    scaling = lengths_lib.rope_scaling_row("linear", train_len=32, eval_len=64)
    assert scaling == {"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 32}
    graphdef2, constants2 = lengths_lib.with_rope_scaling(cfg, scaling)
    leaves, leaves2 = jax.tree.leaves(constants), jax.tree.leaves(constants2)
    assert len(leaves) == len(leaves2) == 1
    np.testing.assert_allclose(leaves2[0], leaves[0] / 2.0, rtol=1e-6)  # linear PI: theta / s
    evaluator, settings = _settings("loss")
    plain = evaluator.run((graphdef, params, constants), text, 64, settings)
    scaled = evaluator.run((graphdef2, params, constants2), text, 64, settings)
    assert summary.mean_losses([plain]) != summary.mean_losses([scaled])
    with pytest.raises(ValueError, match="RoPE"):
        lengths_lib.with_rope_scaling(_model("alibi")[0], scaling)
