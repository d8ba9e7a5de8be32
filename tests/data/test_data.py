"""Data: batches are a pure function of (seed, step), and any split of their rows (per process, per
device) concatenates to the global batch; held-out windows; corpora and their refusals."""

import hashlib

import ml_collections
import numpy as np
import pytest

from posattn import data


def _corpus(size: int = 5000) -> data.Corpus:
    rng = np.random.default_rng(0)
    train = rng.integers(32, 127, size=size).astype(np.uint8)
    val = rng.integers(32, 127, size=size // 10).astype(np.uint8)
    return data.Corpus("synthetic", train, val, 256, "0" * 64, 1)


_KW = dict(seed=3, step=7, batch_size=8, seq_len=32)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"passkey_fraction": 0.5},
        {"passkey_fraction": 0.5, "passkey_distractors": True},
        {"mask_rate": 0.3, "mask_id": 256},
        {"passkey_fraction": 0.4, "induction_fraction": 0.5, "probe_weight": 8.0},
    ],
    ids=["lm", "passkeys", "distractors", "encoder", "weighted-probes"],
)
def test_any_split_of_the_rows_concatenates_to_the_global_batch(options):
    corpus = _corpus()
    whole = data.train_batch(corpus, **_KW, **options)
    assert whole["inputs"].shape == (8, 32) and whole["inputs"].dtype == np.int32
    for cuts in ([0, 4, 8], [0, 1, 3, 8], [0, 2, 4, 6, 8]):
        parts = [
            data.train_batch(corpus, **_KW, rows=slice(a, b), **options)
            for a, b in zip(cuts[:-1], cuts[1:], strict=True)
        ]
        for key in whole:
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])
    by_process = [
        data.train_batch(corpus, **_KW, process_index=i, process_count=2, **options)
        for i in range(2)
    ]
    for key in whole:
        np.testing.assert_array_equal(np.concatenate([p[key] for p in by_process]), whole[key])


def test_a_batch_is_a_pure_function_of_seed_and_step():
    corpus = _corpus()
    a, b = data.train_batch(corpus, **_KW), data.train_batch(corpus, **_KW)
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    other = data.train_batch(corpus, **dict(_KW, step=8))
    assert not np.array_equal(a["inputs"], other["inputs"])
    np.testing.assert_array_equal(a["inputs"][:, 1:], a["targets"][:, :-1])  # shifted by one


def test_eval_windows_predict_every_token_once_and_encoder_masks_are_fixed():
    tokens = np.arange(100, dtype=np.uint16)
    windows = data.eval_windows(tokens, seq_len=10)
    assert windows.shape == (9, 11)
    np.testing.assert_array_equal(windows[1:, 0], windows[:-1, -1])  # one shared token
    np.testing.assert_array_equal(np.concatenate([w[1:] for w in windows]), tokens[1:91])
    corpus = _corpus()
    kw = dict(seed=1, batch_size=4, seq_len=16, max_batches=2, mask_rate=0.3, mask_id=256)
    first, again = data.eval_batches(corpus, **kw), data.eval_batches(corpus, **kw)
    assert len(first) == 2
    for x, y in zip(first, again, strict=True):
        np.testing.assert_array_equal(x["weights"], y["weights"])
        assert 0 < x["weights"].sum() < x["weights"].size


def test_text_files_split_by_position_and_hash_their_content(tmp_path):
    path = tmp_path / "book.txt"
    content = bytes(range(32, 127)) * 40
    path.write_bytes(content)
    corpus = data.load_corpus(str(path))
    assert corpus.train.size + corpus.val.size == len(content)
    assert corpus.val.size == len(content) - int(len(content) * 0.95)
    assert corpus.sha256 == hashlib.sha256(content).hexdigest() and corpus.vocab_size == 256


def test_bad_corpora_are_refused_naming_what_to_change(tmp_path):
    with pytest.raises(data.DataError, match="data.corpus=.*no such file"):
        data.load_corpus(str(tmp_path / "missing"))
    (tmp_path / "nano").mkdir()
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "nano" / "train.bin")
    with pytest.raises(data.DataError, match="no val.bin"):
        data.load_corpus(str(tmp_path / "nano"))
    with pytest.raises(data.DataError, match="seq_len"):
        data.check_length(_corpus(size=20), 64)
    with pytest.raises(data.DataError, match="model.vocab_size=100"):
        _corpus().check_vocab(100)


def test_training_passkeys_in_the_evaluated_format_carry_distractor_numbers():
    corpus = _corpus()
    kw = dict(seed=5, step=2, batch_size=16, seq_len=96, passkey_fraction=1.0)
    plain = data.train_batch(corpus, **kw)
    with_distractors = data.train_batch(corpus, **kw, passkey_distractors=True)
    rooms = {}
    for name, batch in (("plain", plain), ("distractors", with_distractors)):
        rooms[name] = 0
        for inputs, targets in zip(batch["inputs"], batch["targets"], strict=True):
            text = np.concatenate([inputs, targets[-1:]]).astype(np.uint8).tobytes()
            key = text.rsplit(b"=", 1)[1]
            assert key.isdigit() and b"passkey=" + key + b". " in text  # the answer is the needle
            rooms[name] += text.count(b"Room ")
    # About one filler sentence in three is a number sentence: ~1.3 a row here.
    assert rooms["plain"] == 0 and rooms["distractors"] >= 8


def test_a_directory_corpus_records_each_held_out_file_span(tmp_path):
    contents = {f"f{i:02d}.txt": bytes([97 + i % 26]) * (50 + 7 * i) for i in range(40)}
    for name, content in contents.items():
        (tmp_path / name).write_bytes(content)
    corpus = data.load_corpus(str(tmp_path))
    pieces = [bytes(corpus.val[a:b]) for a, b in corpus.val_spans]
    assert len(pieces) >= 1 and all(p in contents.values() for p in pieces)
    assert sum(len(p) for p in pieces) + len(pieces) - 1 == corpus.val.size
    # A token file has no file boundaries.
    (tmp_path / "t.bin").write_bytes(np.arange(600, dtype=np.uint16).tobytes())
    assert data.load_corpus(str(tmp_path / "t.bin")).val_spans is None


def test_induction_rows_repeat_a_random_string_inside_the_window_and_leave_the_rest():
    corpus = _corpus(20000)
    base = dict(seed=3, step=7, batch_size=64, seq_len=64)
    plain = data.train_batch(corpus, **base)
    mixed = data.train_batch(corpus, **base, induction_fraction=0.5)
    both = data.train_batch(corpus, **base, induction_fraction=0.5, passkey_fraction=0.3)
    changed = np.flatnonzero((plain["inputs"] != mixed["inputs"]).any(axis=1))
    assert 16 < changed.size < 48  # about half of 64 rows
    letters = set(range(ord("a"), ord("z") + 1))
    for row in changed:
        full = np.concatenate([mixed["inputs"][row], mixed["targets"][row, -1:]])
        # The row ends with a string of 4..12 letters that also stands earlier in the row.
        span = next(
            s
            for s in range(12, 3, -1)
            if set(full[-s:]) <= letters
            and any((full[i : i + s] == full[-s:]).all() for i in range(len(full) - 2 * s + 1))
        )
        assert 4 <= span <= 12
        untouched = plain["inputs"][row] == mixed["inputs"][row]
        assert untouched.sum() >= 64 - 2 * 12  # only the two copies were written
    # Rows taken by passkeys are left to them; the passkey rows are those of passkeys alone.
    alone = data.train_batch(corpus, **base, passkey_fraction=0.3)
    keys = np.flatnonzero((alone["inputs"] != plain["inputs"]).any(axis=1))
    np.testing.assert_array_equal(both["inputs"][keys], alone["inputs"][keys])
    rest = np.setdiff1d(np.arange(64), keys)
    np.testing.assert_array_equal(both["inputs"][rest], mixed["inputs"][rest])
    # A pure function of (seed, step), split over rows like every batch.
    halves = [
        data.train_batch(corpus, **base, induction_fraction=0.5, rows=slice(a, a + 32))
        for a in (0, 32)
    ]
    np.testing.assert_array_equal(np.concatenate([h["inputs"] for h in halves]), mixed["inputs"])
    with pytest.raises(data.DataError, match="induction_fraction"):
        data.train_batch(corpus, **{**base, "seq_len": 16}, induction_fraction=0.5)


def test_induction_span_sets_the_longest_string():
    """`induction_span` draws each row's string uniformly from 4 to that many letters (its repeat
    but the first letter is what `probe_weight` weighs), inside the window; a span under 4 or too
    long for the window is refused."""
    corpus = _corpus(20000)
    base = dict(seed=5, batch_size=64, seq_len=64, induction_fraction=1.0, probe_weight=2.0)
    spans = []
    for step in range(8):
        batch = data.train_batch(corpus, step=step, **base, induction_span=24)
        spans += ((batch["weights"] == 2.0).sum(axis=1) + 1).tolist()
        letters = batch["targets"][batch["weights"] == 2.0]
        assert ((letters >= ord("a")) & (letters <= ord("z"))).all()
    assert min(spans) == 4 and max(spans) == 24 and len(set(spans)) == 21
    default = data.train_batch(corpus, step=0, **base)  # 4..12 letters
    assert ((default["weights"] == 2.0).sum(axis=1) + 1).max() <= 12
    with pytest.raises(data.DataError, match="induction_span=3 must be at least 4"):
        data.train_batch(corpus, step=0, **base, induction_span=3)
    with pytest.raises(data.DataError, match="induction_span=33 letters and its repeat"):
        data.train_batch(corpus, step=0, **base, induction_span=33)


def test_passkey_digits_set_the_keys_lengths():
    """`passkey_digits` draws each passkey row's key length uniformly from (shortest, longest)
    (the weighted targets are the key's digits); the default (1, 5) is the batches of before it
    existed; a key too long for the row is refused before any batch, from the config."""
    corpus = _corpus(20000)
    base = dict(seed=5, batch_size=64, seq_len=64, passkey_fraction=1.0, probe_weight=2.0)
    lengths = []
    for step in range(6):
        batch = data.train_batch(corpus, step=step, **base, passkey_digits=(4, 8))
        lengths += (batch["weights"] == 2.0).sum(axis=1).tolist()
        keys = batch["targets"][batch["weights"] == 2.0]
        assert ((keys >= ord("0")) & (keys <= ord("9"))).all()
    assert min(lengths) == 4 and max(lengths) == 8 and len(set(lengths)) == 5
    default = data.train_batch(corpus, step=0, **base)
    same = data.train_batch(corpus, step=0, **base, passkey_digits=(1, 5))
    for k in default:
        np.testing.assert_array_equal(default[k], same[k])
    assert (default["weights"] == 2.0).sum(axis=1).max() <= 5
    with pytest.raises(data.DataError, match="passkey_digits=.*1 <= shortest <= longest"):
        data.train_batch(corpus, step=0, **base, passkey_digits=(5, 4))
    with pytest.raises(data.DataError, match="up to 30 digits needs rows of at least 78 bytes"):
        data.train_batch(corpus, step=0, **base, passkey_digits=(1, 30))
    config = ml_collections.ConfigDict(
        {"seq_len": 64, "passkey_fraction": 0.2, "passkey_distractors": True}
    )
    config.update(passkey_digits=(2, 30), induction_fraction=0.0, induction_span=12)
    config.probe_weight = 1.0
    with pytest.raises(data.DataError, match="data.seq_len=64 is too short"):
        data.batch_options(config, causal=True, vocab_size=256)
    config.passkey_digits = (2, 6)
    assert data.batch_options(config, causal=True, vocab_size=256)["passkey_digits"] == (2, 6)


def test_probe_weight_weighs_exactly_the_answers_and_both_copies_lie_inside_the_window():
    """The probe rows teach what the evaluation scores at L: a passkey row holds its needle and
    its question inside the L + 1 bytes and weighs the key's digits after the final `passkey=`; an
    induction row holds both copies inside the window and weighs its repeat but the first letter
    (the probe's scored letters). Nothing else changes weight, and the weight changes no byte."""
    corpus = _corpus(20000)
    L, W = 64, 8.0
    base = dict(seed=11, batch_size=64, seq_len=L, passkey_distractors=True)
    mix = dict(passkey_fraction=0.3, induction_fraction=0.4)
    letters = set(range(ord("a"), ord("z") + 1))
    kinds, spans, gaps = {"passkey": 0, "induction": 0, "text": 0}, set(), []
    for step in range(4):
        plain = data.train_batch(corpus, step=step, **base, **mix)
        batch = data.train_batch(corpus, step=step, **base, **mix, probe_weight=W)
        for key in ("inputs", "targets"):
            np.testing.assert_array_equal(batch[key], plain[key])
        assert (plain["weights"] == 1).all()  # weight 1: every target counts once, as before
        assert set(np.unique(batch["weights"])) <= {1.0, W}
        for inputs, targets, weights in zip(
            batch["inputs"], batch["targets"], batch["weights"], strict=True
        ):
            full = np.concatenate([inputs, targets[-1:]]).astype(np.uint8)  # the L + 1 bytes
            k = int((weights == W).sum())
            if k == 0:
                kinds["text"] += 1
                continue
            assert (weights[L - k :] == W).all()  # the row's last k targets, nothing before
            text = full.tobytes()
            if text.rsplit(b"=", 1)[-1].isdigit() and b"passkey=" in text:
                key = text.rsplit(b"=", 1)[1]
                assert len(key) == k and 1 <= k <= 5
                assert bytes(targets[L - k :].astype(np.uint8)) == key  # the weighted targets
                needle = text.index(b"passkey=" + key + b". ")
                assert needle + len(b"passkey=") + k + 2 <= L + 1 - len(b"passkey=") - k
                kinds["passkey"] += 1
                continue
            span = k + 1  # the repeat's first letter is not scored (nothing announces it)
            repeat = full[-span:]
            assert 4 <= span <= 12 and set(repeat) <= letters
            firsts = [
                i for i in range(L + 1 - 2 * span + 1) if (full[i : i + span] == repeat).all()
            ]
            assert firsts  # the first copy ends before the repeat starts, inside the window
            spans.add(span)
            gaps.append(L + 1 - span - (firsts[-1] + span))
            kinds["induction"] += 1
    assert all(v > 20 for v in kinds.values()), kinds
    # The evaluation's induction cell at L (span 8, gap L/2) lies inside what training draws.
    assert 8 in spans and min(gaps) < L // 4 and max(gaps) > L // 2
    with pytest.raises(data.DataError, match="probe_weight"):
        data.train_batch(corpus, step=0, **base, **mix, probe_weight=-1.0)
