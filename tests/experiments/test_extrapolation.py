"""The length-extrapolation experiment: probes, evaluation functions, passkey mixing, and one
minute-sized end-to-end run checking the files and their schema (the science is the record's job:
experiments/README.md)."""

import importlib.util
import json

import jax
import numpy as np
import pytest
from conftest import ROOT, small_config

from posattn import config as config_lib
from posattn import data, rotary
from posattn.data import probes
from posattn.eval import lengths as evaluate
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


def test_loss_matches_eval_step_and_learned_is_null_past_its_table():
    tokens = data.load_corpus("stdlib").val[:5000]
    cfg, graphdef, params, constants = _model("learned")
    losses = evaluate.loss_at_lengths(
        graphdef, params, constants, tokens, lengths=[16, 32, 64], max_tokens=256, batch_size=3
    )
    assert losses[2] is None and all(isinstance(x, float) for x in losses[:2])
    windows = data.eval_windows(tokens, seq_len=32, max_windows=8)
    nll, count = steps.eval_step(
        graphdef, params, constants, {"inputs": windows[:, :-1], "targets": windows[:, 1:]}
    )
    assert losses[1] == pytest.approx(float(nll / count), rel=1e-5)
    grid = evaluate.passkey_accuracy(
        graphdef,
        params,
        constants,
        lengths=[32, 64],
        depths=[0.0, 1.0],
        samples=2,
        digits=3,
        seed=0,
        batch_size=4,
    )
    assert grid.shape == (2, 2) and np.all(np.isfinite(grid[0])) and np.all(np.isnan(grid[1]))
    assert (
        evaluate.copy_accuracy(
            graphdef,
            params,
            constants,
            tokens,
            lengths=[32, 64],
            samples=2,
            segment=4,
            seed=0,
            batch_size=4,
        )[1]
        is None
    )


def test_chunked_output_projection_is_exact():
    _, graphdef, params, constants = _model("alibi")
    tokens = np.asarray(data.load_corpus("stdlib").val[:200], np.int32)
    inputs, targets = tokens[None, :-1], tokens[None, 1:]  # T = 199: not a multiple of the chunk
    whole = evaluate.token_stats(graphdef, params, constants, inputs, targets, chunk=199)
    chunked = evaluate.token_stats(graphdef, params, constants, inputs, targets, chunk=16)
    np.testing.assert_allclose(chunked[0], whole[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(chunked[1], whole[1])


def test_rope_rows_change_only_the_frequencies():
    cfg, graphdef, params, constants = _model("rope")
    assert evaluate.rope_scaling_row("linear", train_len=32, eval_len=32) is None
    scaling = evaluate.rope_scaling_row("linear", train_len=32, eval_len=128)
    assert scaling == {"rope_type": "linear", "factor": 4.0, "original_max_position_embeddings": 32}
    graphdef4, constants4 = evaluate.with_rope_scaling(cfg, scaling)
    leaves, leaves4 = jax.tree.leaves(constants), jax.tree.leaves(constants4)
    assert len(leaves) == len(leaves4) == 1
    np.testing.assert_allclose(leaves4[0], leaves[0] / 4.0, rtol=1e-6)  # linear PI: theta / s
    tokens = data.load_corpus("stdlib").val[:3000]
    plain = evaluate.loss_at_lengths(
        graphdef, params, constants, tokens, lengths=[128], max_tokens=256, batch_size=2
    )
    scaled = evaluate.loss_at_lengths(
        graphdef4, params, constants4, tokens, lengths=[128], max_tokens=256, batch_size=2
    )
    assert plain[0] != scaled[0]
    with pytest.raises(ValueError, match="RoPE"):
        evaluate.with_rope_scaling(_model("alibi")[0], scaling)


# ----------------------------------------------------------------------------------------------
# End to end.


def _experiment():
    spec = importlib.util.spec_from_file_location(
        "length_extrapolation", ROOT / "experiments" / "length_extrapolation.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MINUTE = [
    "--config.families=('learned','rope')",
    "--config.rope_scalings=('yarn',)",
    "--config.data.seq_len=32",
    "--config.model.max_len=32",
    "--config.model.d_model=32",
    "--config.model.t5_max_distance=32",
    "--config.train.steps=12",
    "--config.train.warmup_steps=2",
    "--config.train.checkpoint_every=12",
    "--config.data.passkey_fraction=0.25",
    "--config.eval.multiples=(1,2)",
    "--config.eval.max_tokens=256",
    "--config.eval.sliding_tokens=128",
    "--config.eval.sliding_stride=16",
    "--config.eval.bootstrap=50",
    "--config.eval.attention_windows=2",
    "--config.eval.batch_size=4",
    "--config.eval.per_position_bins=8",
    "--config.passkey.samples=2",
    "--config.passkey.depths=(0.0,1.0)",
    "--config.passkey.digits=3",
    "--config.induction.samples=2",
    "--config.induction.span=4",
    "--config.induction.gap_multiples=(0,1)",
    "--config.copy.enabled=True",
    "--config.copy.samples=2",
    "--config.copy.segment=6",
    "--config.finetune.kinds=('yarn',)",
    "--config.finetune.multiple=2",
    "--config.finetune.steps=2",
    "--config.finetune.warmup_steps=1",
]

ROW_KEYS = {
    "eval_len",
    "loss",
    "passkey_acc",
    "loss_ci",
    "loss_seeds",
    "loss_se",
    "delta_L",
    "delta_L_ci",
    "eval_bytes",
    "loss_beyond_L",
    "loss_beyond_L_ci",
    "loss_sliding",
    "loss_sliding_ci",
    "loss_sliding_seeds",
    "delta_L_sliding",
    "delta_L_sliding_ci",
    "eval_bytes_sliding",
}


def test_end_to_end_files_schema_and_rerun_skips(tmp_path, capsys):
    experiment = _experiment()
    assert experiment.main([*MINUTE, "--workdir", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["train_len"] == 32 and results["corpus"] == "stdlib"
    assert set(results["families"]) == {"learned", "rope", "rope+yarn", "rope+yarn+ft"}
    for row in results["families"].values():
        assert set(row) == ROW_KEYS
        assert row["eval_len"] == [32, 64]
        assert all(isinstance(x, float) and 0 < x < 10 for x in row["loss"] if x is not None)
        assert len(row["passkey_acc"]) == 2
        for loss, ci, seeds in zip(row["loss"], row["loss_ci"], row["loss_seeds"], strict=True):
            if loss is not None:
                assert ci[0] <= loss <= ci[1] and seeds == [loss]
        assert row["loss_beyond_L"][0] is None  # at L there is no position >= L
        assert row["eval_bytes"][0] == 256 and row["eval_bytes_sliding"][0] == 128
    rope = results["families"]["rope"]
    assert rope["loss_beyond_L"][1] is not None and rope["loss_sliding"][1] is not None
    assert results["evaluation"]["units_scored"] == 256 // 64  # 4 chunks of 64 from 4 files
    assert results["evaluation"]["paired"]["reference"] is None  # no alibi row here
    assert set(results["passkey"]["loss"]) == set(results["families"])
    assert results["induction"]["gaps"] == [0, 32] and results["induction"]["loss"]["rope"][1][1]
    stats = results["attention_stats"]["rows"]["rope"]
    assert stats[0]["mass_beyond_L"] == [[0.0] * 4] * 2  # at L no key is L away
    assert stats[1]["mass_beyond_L"][0][0] > 0 and stats[1]["entropy"][0][0] > 0
    assert results["families"]["learned"]["loss"][1] is None  # past its table: no number
    assert results["families"]["learned"]["passkey_acc"][1] is None
    assert all(x is not None for x in results["families"]["rope"]["loss"])
    assert (
        results["families"]["rope+yarn"]["loss"][0] == results["families"]["rope"]["loss"][0]
    )  # at L: plain
    assert results["families"]["rope+yarn"]["loss"][1] != results["families"]["rope"]["loss"][1]
    curve = results["per_position"]["curves"]["rope"]
    assert 3 <= len(curve["loss"]) <= 8 and curve["position"] == sorted(curve["position"])
    assert all(lo <= y <= hi for y, (lo, hi) in zip(curve["loss"], curve["ci"], strict=True))
    assert results["provenance"]["commit"] and results["config"]["data"]["seq_len"] == 32
    md = (tmp_path / "results.md").read_text()
    assert "| learned |" in md and "null" in md
    for png in (
        "loss_vs_length.png",
        "per_position.png",
        "passkey_heatmap.png",
        "copy_vs_length.png",
        "induction.png",
        "attention_stats.png",
    ):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    metrics = (tmp_path / "rope" / "metrics.jsonl").read_text()

    capsys.readouterr()
    assert experiment.main([*MINUTE, "--workdir", str(tmp_path)]) == 0  # rerun: nothing retrained
    assert (tmp_path / "rope" / "metrics.jsonl").read_text() == metrics
    assert "resuming" not in capsys.readouterr().out
    assert json.loads((tmp_path / "results.json").read_text())["families"] == results["families"]


def _read(path):
    return json.loads(path.read_text())


def test_provenance_other_code_is_refused_reused_or_reevaluated(tmp_path, capsys):
    """trained.json / eval.json record the code that made them; results made by other code are
    refused without --reuse, reported under their own commit with it, and re-evaluated."""
    experiment = _experiment()
    minute = [
        *MINUTE,
        "--config.families=('learned',)",
        "--config.rope_scalings=()",
        "--config.finetune.enabled=False",
    ]
    run = [*minute, "--workdir", str(tmp_path)]
    assert experiment.main(run) == 0
    code = experiment.code_sha256()
    assert len(code) == 64 and code == experiment.code_sha256()  # a content hash: stable
    trained, evaluated = _read(tmp_path / "learned" / "trained.json"), None
    evaluated = _read(tmp_path / "learned" / "eval.json")
    corpus_sha = _read(tmp_path / "results.json")["corpus_sha256"]
    for record in (trained, evaluated):
        assert record["code"]["code_sha256"] == code
        assert record["code"]["corpus_sha256"] == corpus_sha
        assert isinstance(record["code"]["clean"], bool) and record["code"]["commit"]
    results = _read(tmp_path / "results.json")
    assert results["python_version"].count(".") == 2
    assert results["provenance"]["code_sha256"] == code
    assert results["row_provenance"]["learned"]["trained"]["code_sha256"] == code
    md = (tmp_path / "results.md").read_text()
    assert f"sha256 `{corpus_sha[:16]}`" in md and "the standard library of Python" in md
    assert "other code" not in md
    written = (tmp_path / "learned" / "eval.json").stat().st_mtime_ns
    assert experiment.main(run) == 0  # the same code again: trained.json and eval.json reused
    assert (tmp_path / "learned" / "eval.json").stat().st_mtime_ns == written

    # The run was trained by other code: refused before any compute, nothing touched.
    other = dict(commit="0123456789ab", clean=True, code_sha256="0" * 64)
    older = dict(trained, code=dict(trained["code"], **other))
    (tmp_path / "learned" / "trained.json").write_text(json.dumps(older))
    metrics = (tmp_path / "learned" / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert experiment.main(run) == 1
    err = capsys.readouterr().err
    assert "commit 0123456789ab" in err and "--reuse" in err and "move" in err
    assert (tmp_path / "learned" / "metrics.jsonl").read_text() == metrics
    # With --reuse its numbers are reported under its own commit.
    assert experiment.main([*run, "--reuse"]) == 0
    results = _read(tmp_path / "results.json")
    assert results["row_provenance"]["learned"]["trained"]["commit"] == "0123456789ab"
    assert results["provenance"]["code_sha256"] == code  # this run's code, beside the row's
    assert (
        "`learned` trained by commit 0123456789ab (reused)" in (tmp_path / "results.md").read_text()
    )

    # An evaluation made by other code is redone by this code (and recorded as such).
    (tmp_path / "learned" / "trained.json").write_text(json.dumps(trained))
    stale = json.loads(json.dumps(evaluated))
    stale["code"]["code_sha256"] = "1" * 64
    stale["rows"]["learned"]["scores"] = []  # numbers that other code would have written
    (tmp_path / "learned" / "eval.json").write_text(json.dumps(stale))
    capsys.readouterr()
    assert experiment.main(run) == 0
    assert "evaluating again" in capsys.readouterr().out
    again = _read(tmp_path / "learned" / "eval.json")
    assert again["code"]["code_sha256"] == code
    np.testing.assert_allclose(
        experiment.plain_losses(again["rows"]["learned"])[0],
        experiment.plain_losses(evaluated["rows"]["learned"])[0],
        rtol=1e-6,
    )


def test_bad_settings_fail_before_compute(tmp_path):
    experiment = _experiment()
    assert experiment.main(["--config.families=('rope','bogus')", "--workdir", str(tmp_path)]) == 2
    assert experiment.main(["--config.passkey.digits=40", "--workdir", str(tmp_path)]) == 2
    assert experiment.main(["--config.eval.attention_impl=flash", "--workdir", str(tmp_path)]) == 2
    assert experiment.main(["--config.model.attention_impl=flash", "--workdir", str(tmp_path)]) == 2
    assert experiment.main(["--config.eval.sliding_stride=65", "--workdir", str(tmp_path)]) == 2
    assert experiment.main(["--config.eval.max_tokens=0", "--workdir", str(tmp_path)]) == 2
    assert experiment.main(["--config.induction.gaps=(2000,)", "--workdir", str(tmp_path)]) == 2
    assert experiment.main(["--config.rope_scalings=('yarn:beta=2',)", "--workdir", str(tmp_path)])
    assert experiment.main(
        ["--config.rope_scalings=('dynamic:factor=0.5',)", "--workdir", str(tmp_path)]
    )
    assert not any(tmp_path.iterdir())


def test_family_entries_carry_their_own_settings_and_directories(tmp_path):
    experiment = _experiment()
    config = config_lib.load_config(ROOT / "configs" / "extrapolation.py", [])
    name, overrides = experiment.family_entry("fire:fire_init_c=3.2,fire_init_L=64", config)
    assert (name, overrides) == ("fire", {"fire_init_c": 3.2, "fire_init_L": 64})
    train = experiment.family_config(config, "fire:fire_init_c=3.2,fire_init_L=64")
    assert train.model.position == "fire" and train.model.fire_init_c == 3.2
    assert experiment.family_config(config, "fire").model.fire_init_c == config.model.fire_init_c
    assert experiment.entry_dir(tmp_path, "fire") == tmp_path / "fire"
    assert experiment.entry_dir(tmp_path, "t5:t5_max_distance=16").name == "t5@t5_max_distance=16"
    for entry, words in (
        ("fire:bogus=1", ["bogus"]),
        ("alibi:fire_init_c=3.2", ["fire_init_c", "fire", "alibi"]),
        ("sandwich:sandwich_dim=3", ["sandwich_dim", "even"]),
        ("rope:position=alibi", ["position"]),
        ("firefly", ["firefly", "unknown"]),
    ):
        config.families = ("alibi", entry)
        with pytest.raises(config_lib.ConfigError) as err:
            experiment.check_experiment(config)
        assert all(w in str(err.value) for w in words), str(err.value)
    for arg in ("fire", "t5", "sandwich", "kerple", "rope"):  # every settings sweep is valid
        experiment.check_experiment(
            config_lib.load_config(f"{ROOT / 'configs' / 'extrapolation_settings.py'}:{arg}", [])
        )


def test_rope_scaling_entries_keep_hugging_face_meanings():
    experiment = _experiment()
    entry = experiment.rope_scaling_entry
    assert entry("ntk") == ("ntk", {})
    assert entry("dynamic") == ("dynamic", {"factor": 2.0})  # a configured factor, not T / L
    assert entry("yarn:beta_fast=16") == ("yarn", {"beta_fast": 16.0, "beta_slow": 1.0})
    for bad in ("ntk:factor=2", "yarn:beta=3", "yarn:beta_fast", "dynamic:factor=x", "pi"):
        with pytest.raises(ValueError, match="rope_scalings"):
            entry(bad)
    # HF dynamic at T = 16L with its factor 2: the base grows by (2 * 16 - 1)^(d/(d-2)), from the
    # length of the window read, not by the extension ratio's (16^2 - 16 + 1)^(d/(d-2)).
    options = entry("dynamic")[1]
    scaling = evaluate.rope_scaling_row("dynamic", train_len=64, eval_len=1024, **options)
    assert scaling["factor"] == 2.0 and scaling["original_max_position_embeddings"] == 64
    d = 16
    got, _ = rotary.rope_frequencies(d, base=10000.0, scaling=scaling, seq_len=1024)
    base = 10000.0 * 31.0 ** (d / (d - 2))
    np.testing.assert_allclose(got, 1.0 / base ** (np.arange(0, d, 2) / d), rtol=1e-5)


def test_paper_config_builds_a_247m_class_model_for_every_family():
    from flax import nnx

    from posattn.nn.model import TransformerLM

    experiment = _experiment()
    config = config_lib.load_config(ROOT / "configs" / "extrapolation_paper.py")
    experiment.check_experiment(config)
    assert experiment.eval_lengths(config) == [512, 1012, 2012, 4012, 8512]
    for family in config.families:
        cfg = config_lib.validate(experiment.family_config(config, family))
        model = nnx.eval_shape(
            lambda cfg=cfg: TransformerLM(cfg, rngs=nnx.Rngs(params=0))
        )  # no compute
        count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        assert 245e6 < count < 260e6, (family, count)
    long = config_lib.load_config(f"{ROOT / 'configs' / 'extrapolation_paper.py'}:1024")
    assert long.data.seq_len == 1024 and experiment.eval_lengths(long)[-1] == 16 * 1024


def test_seeds_train_as_one_sweep_program_and_report_mean_and_spread(tmp_path):
    experiment = _experiment()
    args = [
        "--config.families=('alibi',)",
        "--config.rope_scalings=()",
        "--config.finetune.enabled=False",
        "--config.seeds=2",
        "--config.data.seq_len=32",
        "--config.model.max_len=32",
        "--config.model.d_model=32",
        "--config.train.steps=4",
        "--config.train.warmup_steps=1",
        "--config.train.checkpoint_every=4",
        "--config.data.passkey_fraction=0.0",
        "--config.eval.multiples=(1,2)",
        "--config.eval.max_tokens=128",
        "--config.eval.sliding_tokens=0",
        "--config.eval.sliding_stride=32",
        "--config.eval.bootstrap=20",
        "--config.eval.attention_windows=0",
        "--config.passkey.enabled=False",
        "--config.induction.enabled=False",
    ]
    assert experiment.main([*args, "--workdir", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    row = results["families"]["alibi"]
    assert (tmp_path / "alibi" / "seeds" / "sweep.json").exists()  # trained by posattn.sweep
    seeds = row["loss_seeds"][0]
    assert len(seeds) == 2 and seeds[0] != seeds[1]
    assert row["loss"][0] == pytest.approx(np.mean(seeds))
    assert row["loss_se"][0] == pytest.approx(np.std(seeds, ddof=1) / np.sqrt(2))
    assert row["loss_sliding"] == [None, None] and results["training"]["alibi"]["seeds"] == [0, 1]
    assert "±" in (tmp_path / "results.md").read_text()
    # eval.json records the code that evaluated the seeds, and a rerun by that code reuses it.
    code = experiment.code_sha256()
    assert _read(tmp_path / "alibi" / "eval.json")["code"]["code_sha256"] == code
    assert results["row_provenance"]["alibi"]["evaluated"]["code_sha256"] == code
    written = (tmp_path / "alibi" / "eval.json").stat().st_mtime_ns
    assert experiment.main([*args, "--workdir", str(tmp_path)]) == 0
    assert (tmp_path / "alibi" / "eval.json").stat().st_mtime_ns == written
    assert _read(tmp_path / "results.json")["families"]["alibi"]["loss"] == row["loss"]
    # The seeds' training records its code too: seeds trained by other code are refused before
    # any compute (nothing touched) unless --reuse, and then reported under their own commit.
    marker = tmp_path / "alibi" / "seeds" / "trained.json"
    trained = _read(marker)
    assert trained["code"]["code_sha256"] == code
    older = dict(trained, code=dict(trained["code"], commit="0123456789ab", code_sha256="0" * 64))
    marker.write_text(json.dumps(older))
    assert experiment.main([*args, "--workdir", str(tmp_path)]) == 1
    assert experiment.main([*args, "--reuse", "--workdir", str(tmp_path)]) == 0
    provenance = _read(tmp_path / "results.json")["row_provenance"]["alibi"]
    assert provenance["trained"]["commit"] == "0123456789ab"
    assert experiment.main(["--config.seeds=0", "--workdir", str(tmp_path / "x")]) == 2


# ----------------------------------------------------------------------------------------------
# Position interpolation with a fine-tune (rows rope+<kind>+ft).

TUNE = [  # the probes are off: the end-to-end test checks that a +ft row carries them
    *MINUTE,
    "--config.families=('rope',)",
    "--config.rope_scalings=()",
    "--config.finetune.kinds=('linear',)",
    "--config.finetune.steps=3",
    "--config.copy.enabled=False",
    "--config.eval.attention_windows=0",
    "--config.passkey.enabled=False",
    "--config.induction.enabled=False",
]


def _counting_finetunes(experiment, monkeypatch) -> list:
    calls, real = [], experiment.finetune_params

    def counting(*args, **kwargs):
        calls.append((args[4], kwargs["seed"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(experiment, "finetune_params", counting)
    return calls


def test_finetune_rows_keep_the_factor_at_every_length_and_are_cached(tmp_path, monkeypatch):
    from posattn import cli

    experiment = _experiment()
    calls = _counting_finetunes(experiment, monkeypatch)
    run = [*TUNE, "--workdir", str(tmp_path)]
    assert experiment.main(run) == 0
    assert calls == [("linear", 0)]
    results = _read(tmp_path / "results.json")
    assert set(results["families"]) == {"rope", "rope+linear+ft"}
    row = results["families"]["rope+linear+ft"]
    assert set(row) == ROW_KEYS and all(np.isfinite(row["loss"]))
    info = results["training"]["finetune"]["linear"]
    assert info["steps"] == 3 and info["multiple"] == 2 and np.isfinite(info["final_train_loss"])
    assert "| rope+linear+ft | 3 | 64 |" in (tmp_path / "results.md").read_text()

    # The fine-tune moved the params; the row is those params under factor 2 at every length,
    # L included (where the eval-time row rope+linear is plain RoPE).
    config = cli.parse(experiment.COMMAND, run).config
    train_config = experiment.family_config(config, "rope")
    cfg, graphdef, params, constants = experiment.restore_model(
        train_config, tmp_path / "rope", attention_impl=config.eval.attention_impl
    )
    leaves, treedef = jax.tree.flatten(params)
    with np.load(tmp_path / "rope" / "finetune" / "linear-seed0.npz") as saved:
        tuned = [saved[f"p{i}"] for i in range(len(leaves))]
    assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(tuned, leaves, strict=True))
    tuned = jax.tree.unflatten(treedef, tuned)
    lengths = experiment.eval_lengths(config)
    text = experiment.eval_text(config, data.load_corpus("stdlib"), lengths)
    scaling = {"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 32}
    g2, c2 = evaluate.with_rope_scaling(cfg, scaling)
    rows = _read(tmp_path / "rope" / "eval.json")["rows"]
    ft = experiment.plain_losses(rows["rope+linear+ft"])
    for i, length in enumerate(lengths):
        one = experiment._evaluate_model((g2, tuned, c2), text, config, lengths, only=[length])
        assert experiment.plain_losses(one)[0] == pytest.approx(ft[i], rel=1e-5)
    unscaled = experiment._evaluate_model((graphdef, tuned, constants), text, config, lengths)
    assert experiment.plain_losses(unscaled)[0] != pytest.approx(ft[0], rel=1e-5)

    # Re-evaluating reuses the fine-tuned params (no second fine-tune) ...
    (tmp_path / "rope" / "eval.json").unlink()
    assert experiment.main(run) == 0
    assert calls == [("linear", 0)]
    assert _read(tmp_path / "results.json")["families"]["rope+linear+ft"]["loss"] == row["loss"]
    # ... and another finetune setting fine-tunes again and re-evaluates.
    assert experiment.main([*run, "--config.finetune.learning_rate=1e-4"]) == 0
    assert calls == [("linear", 0), ("linear", 0)]
    again = _read(tmp_path / "results.json")["families"]["rope+linear+ft"]["loss"]
    assert again != row["loss"] and _read(tmp_path / "rope" / "eval.json")["settings"]["finetune"][
        "learning_rate"
    ] == pytest.approx(1e-4)


def test_finetune_runs_once_per_seed(tmp_path, monkeypatch):
    experiment = _experiment()
    calls = _counting_finetunes(experiment, monkeypatch)
    args = [
        *TUNE,
        "--config.seeds=2",
        "--config.train.steps=4",
        "--config.train.checkpoint_every=4",
        "--config.finetune.steps=2",
        "--workdir",
        str(tmp_path),
    ]
    assert experiment.main(args) == 0
    assert calls == [("linear", 0), ("linear", 1)]
    results = _read(tmp_path / "results.json")
    seeds = results["families"]["rope+linear+ft"]["loss_seeds"][1]
    assert len(seeds) == 2 and seeds[0] != seeds[1]
    info = results["training"]["finetune"]["linear"]
    assert info["seeds"] == [0, 1] and len(info["final_train_loss_seeds"]) == 2
    assert {p.name for p in (tmp_path / "rope" / "finetune").iterdir()} == {
        "linear-seed0.npz",
        "linear-seed1.npz",
    }


@pytest.mark.parametrize(
    "override, key",
    [
        ("--config.finetune.kinds=('dynamic',)", "config.finetune.kinds"),
        ("--config.finetune.multiple=1", "config.finetune.multiple"),
        ("--config.finetune.steps=0", "config.finetune.steps"),
        ("--config.finetune.learning_rate=0.0", "config.finetune.learning_rate"),
        ("--config.families=('alibi',) --config.rope_scalings=()", "config.finetune"),
    ],
)
def test_bad_finetune_settings_fail_before_compute(tmp_path, capsys, override, key):
    experiment = _experiment()
    assert experiment.main([*override.split(), "--workdir", str(tmp_path)]) == 2
    assert key in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
