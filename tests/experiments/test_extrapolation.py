"""The length-extrapolation experiment end to end: one minute-sized run checking the files, their
schema, a new evaluator added from outside, reruns that reuse everything; provenance; seeds;
fine-tunes (the science is the record's job: experiments/README.md)."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import ml_collections
import numpy as np
import pytest
from conftest import ROOT

from posattn import data
from posattn.eval import heldout, registry, summary
from posattn.eval import lengths as lengths_lib

sys.path.insert(0, str(ROOT / "experiments"))
import length_extrapolation as experiment  # noqa: E402
from length_extrapolation import training  # noqa: E402

MINUTE = [
    "--config.workers=1",
    "--config.families=('learned','rope')",
    "--config.rope_scalings=('yarn',)",
    "--config.data.seq_len=32",
    "--config.data.induction_span=16",
    "--config.data.passkey_digits=(4, 7)",
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


def _first_logit_gap(model, text, length, settings):
    """A test's own evaluator: the mean NLL of the first position of `length` windows (one file,
    one registry line, nothing else edited)."""
    if not lengths_lib.can_read(lengths_lib.model_config_of(*model), length):
        return None
    windows, _ = text.plan.windows(text.val, length)
    nll = np.concatenate([n for n, _ in lengths_lib.forward(*model, windows[:2], 2)])
    return float(nll[:, 0].mean()) + settings["offset"]


@pytest.mark.figures
def test_end_to_end_files_schema_new_evaluator_and_rerun_reuses(tmp_path, capsys):
    registry.register(registry.Evaluator("first_nll", _first_logit_gap, defaults={"offset": 0.0}))
    try:
        assert experiment.main([*MINUTE, "--workdir", str(tmp_path)]) == 0
        results = json.loads((tmp_path / "results.json").read_text())
        mine = results["evaluators"]["first_nll"]
        assert set(mine) == {"learned", "rope", "rope+yarn", "rope+yarn+ft"}
        assert mine["learned"][1] is None and isinstance(mine["rope"][1], float)
        assert mine["rope+yarn"][0] == mine["rope"][0]  # at L the same model
        capsys.readouterr()
        assert experiment.main([*MINUTE, "--workdir", str(tmp_path)]) == 0  # all reused
        out = capsys.readouterr().out
        assert "reused (trained earlier" in out and "fine-tuning" not in out
    finally:
        registry.unregister("first_nll")
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
    # The heads' scores at L only ([layer][head] weights), described in the block.
    assert len(stats[0]["induction"]) == 2 and len(stats[0]["previous_token"][1]) == 4
    assert all(0 <= w <= 1 for layer in stats[0]["induction"] for w in layer)
    assert (
        "induction" not in stats[1]
        and "16 tokens written twice" in (results["attention_stats"]["heads"])
    )
    assert results["families"]["learned"]["loss"][1] is None  # past its table: no number
    assert results["families"]["learned"]["passkey_acc"][1] is None
    assert all(x is not None for x in results["families"]["rope"]["loss"])
    fams = results["families"]
    assert fams["rope+yarn"]["loss"][0] == fams["rope"]["loss"][0]  # at L: plain
    assert fams["rope+yarn"]["loss"][1] != fams["rope"]["loss"][1]
    assert results["training"]["finetune"]["yarn"]["row"] == "rope+yarn+ft"
    curve = results["per_position"]["curves"]["rope"]
    assert 3 <= len(curve["loss"]) <= 8 and curve["position"] == sorted(curve["position"])
    assert all(lo <= y <= hi for y, (lo, hi) in zip(curve["loss"], curve["ci"], strict=True))
    assert results["provenance"]["commit"] and results["config"]["data"]["seq_len"] == 32
    md = (tmp_path / "results.md").read_text()
    assert "| learned |" in md and "null" in md and "| rope+yarn+ft | 2 | 64 |" in md
    assert "### Heads at L" in md and "| rope+yarn+ft | " in md.split("### Heads at L")[1]
    for png in (
        "loss_vs_length.png",
        "per_position.png",
        "passkey_heatmap.png",
        "copy_vs_length.png",
        "induction.png",
        "attention_stats.png",
    ):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    again = json.loads((tmp_path / "results.json").read_text())
    assert again["families"] == results["families"]

    # The sweep's loss is this loss: the same protocol on the same text (chunks drawn first).
    config = (
        experiment.COMMAND
        and __import__("posattn.cli")
        .cli.parse(experiment.COMMAND, [*MINUTE, "--workdir", str(tmp_path)])
        .config
    )
    cfg, graphdef, params, constants = experiment.restore_model(
        experiment.family_config(config, "rope"), tmp_path / "rope", attention_impl="auto"
    )
    from posattn.eval import scoring
    from posattn.sweep.run import EVAL_SEED

    text = heldout.eval_text(
        data.load_corpus("stdlib"),
        lengths=[32, 64],
        max_tokens=256,
        sliding_tokens=0,
        stride=32,
        seed=EVAL_SEED,
    )

    def mean_losses(graphdef):
        scores = scoring.score_lengths(
            graphdef,
            params,
            constants,
            text.val,
            text.plan,
            lengths=[32, 64],
            train_len=32,
            batch_tokens=4 * 64,
            curve_bins=1,
        )
        return summary.mean_losses(scores)

    np.testing.assert_allclose(mean_losses(graphdef), rope["loss"], rtol=1e-6)

    # python -m posattn.eval on the trained RoPE: the same loss, written beside, and nothing
    # under checkpoints/ created or changed.
    from posattn import evaluate as eval_cli

    ckpt = tmp_path / "rope" / "checkpoints"
    before = sorted((str(p), p.stat().st_mtime_ns) for p in ckpt.rglob("*"))
    argv = ["--workdir", str(tmp_path / "rope"), "--lengths", "32,64", "--max_tokens", "256"]
    argv += ["--batch_size", "4"]
    assert eval_cli.main([*argv, "--evaluators", "loss"]) == 0
    assert sorted((str(p), p.stat().st_mtime_ns) for p in ckpt.rglob("*")) == before
    (written,) = (tmp_path / "rope" / "eval").glob("*.json")
    found = json.loads(written.read_text())
    np.testing.assert_allclose(found["loss"]["loss"], rope["loss"], rtol=1e-6)
    assert eval_cli.main([*argv, "--evaluators", "bogus"]) == 2
    # --window 16: the model under a sliding window of 16 keys, written beside (another settings
    # hash; the unwindowed file keeps its own): at 32 and 64 it is what the scoring code gives
    # for the windowed config, and not the plain model's loss.
    assert eval_cli.main([*argv, "--evaluators", "loss", "--window", "16"]) == 0
    (windowed,) = set((tmp_path / "rope" / "eval").glob("*.json")) - {written}
    found_w = json.loads(windowed.read_text())
    assert found_w["settings"]["window"] == 16 and "window" not in found["settings"]
    from flax import nnx

    from posattn.nn.model import TransformerLM

    small = lengths_lib.windowed(lengths_lib.model_config_of(graphdef, params, constants), 16)
    g_w = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(small, rngs=nnx.Rngs(0))))
    np.testing.assert_allclose(found_w["loss"]["loss"], mean_losses(g_w), rtol=1e-6)
    assert np.all(np.abs(np.subtract(found_w["loss"]["loss"], rope["loss"])) > 1e-4)
    assert eval_cli.main([*argv, "--window", "-1"]) == 2
    # --rope_remap: ReRoPE with a window of 8 at every length, again what the scoring code gives
    # for that config; a string that is no dict, or a bad remap, is refused.
    remap = "{'type': 'rerope', 'window': 8}"
    assert eval_cli.main([*argv, "--evaluators", "loss", "--rope_remap", remap]) == 0
    (remapped,) = set((tmp_path / "rope" / "eval").glob("*.json")) - {written, windowed}
    found_r = json.loads(remapped.read_text())
    assert found_r["settings"]["rope_remap"] == {"type": "rerope", "window": 8}
    base = lengths_lib.model_config_of(graphdef, params, constants)
    cfg_r = base.replace(rope_remap={"type": "rerope", "window": 8}, attention_impl="auto")
    g_r = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(cfg_r, rngs=nnx.Rngs(0))))
    np.testing.assert_allclose(found_r["loss"]["loss"], mean_losses(g_r), rtol=1e-6)
    assert np.all(np.abs(np.subtract(found_r["loss"]["loss"], rope["loss"])) > 1e-4)
    assert eval_cli.main([*argv, "--rope_remap", "rerope"]) == 2
    assert eval_cli.main([*argv, "--rope_remap", "{'type': 'rerope'}"]) == 2
    learned = ["--workdir", str(tmp_path / "learned"), "--rope_remap", remap]
    assert eval_cli.main(learned) == 2
    assert "--rope_remap needs a RoPE model" in capsys.readouterr().err


def _read(path):
    return json.loads(path.read_text())


LEARNED = [
    *MINUTE,
    "--config.families=('learned',)",
    "--config.rope_scalings=()",
    "--config.finetune.enabled=False",
    "--config.induction.enabled=False",
    "--config.copy.enabled=False",
    "--config.eval.attention_windows=0",
]


def test_provenance_other_code_is_refused_reused_or_reevaluated(tmp_path, capsys):
    """trained.json and the evaluations record the code that made them; results made by other
    code are refused without --reuse, reported under their own commit with it, and
    re-evaluated; other evaluation settings write their results beside, never over."""
    run = [*LEARNED, "--workdir", str(tmp_path)]
    assert experiment.main(run) == 0
    code = experiment.code_sha256()
    trained = _read(tmp_path / "learned" / "trained.json")
    cache = tmp_path / "learned" / "evaluations" / "learned.loss.json"
    evaluated = _read(cache)
    corpus_sha = _read(tmp_path / "results.json")["corpus_sha256"]
    assert trained["code"]["code_sha256"] == code
    for record in (trained, evaluated):
        assert record["code"]["corpus_sha256"] == corpus_sha
        assert isinstance(record["code"]["clean"], bool) and record["code"]["commit"]
    results = _read(tmp_path / "results.json")
    assert results["python_version"].count(".") == 2
    assert results["provenance"]["code_sha256"] == code
    assert results["row_provenance"]["learned"]["trained"]["code_sha256"] == code
    assert results["row_provenance"]["learned"]["evaluated"] == {
        **evaluated["code"],
        "evaluator": "loss",
    }
    md = (tmp_path / "results.md").read_text()
    assert "other code than this run's" not in md  # every row trained and evaluated by this run
    assert f"sha256 `{corpus_sha[:16]}`" in md and "the standard library of Python" in md
    written = cache.stat().st_mtime_ns
    assert experiment.main(run) == 0  # the same code again: trained.json and the cache reused
    assert cache.stat().st_mtime_ns == written

    # Other evaluation settings: results beside, the first ones kept.
    first = (tmp_path / "results.json").read_text()
    capsys.readouterr()
    assert experiment.main([*run, "--config.passkey.samples=3"]) == 0
    assert "other evaluation settings" in capsys.readouterr().out
    assert (tmp_path / "results.json").read_text() == first
    (beside,) = tmp_path.glob("results-*/results.json")
    assert _read(beside)["config"]["passkey"]["samples"] == 3
    assert cache.stat().st_mtime_ns == written  # the loss evaluation is not redone

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
    md = (tmp_path / "results.md").read_text()
    assert "`learned` trained by commit 0123456789ab (reused)" in md
    assert "`learned` evaluated by" not in md  # its evaluation is this run's code's

    # An evaluation made by other code is redone by this code (and recorded as such).
    (tmp_path / "learned" / "trained.json").write_text(json.dumps(trained))
    stale = json.loads(json.dumps(evaluated))
    stale["code"]["code_sha256"] = "1" * 64
    stale["values"] = [None, None]  # numbers that other code would have written
    cache.write_text(json.dumps(stale))
    capsys.readouterr()
    assert experiment.main(run) == 0
    assert "evaluating again" in capsys.readouterr().out
    again = _read(cache)
    assert again["code"]["code_sha256"] == evaluated["code"]["code_sha256"]
    assert again["values"] == evaluated["values"]


SEEDS = [
    "--config.workers=1",
    "--config.families=('alibi',)",
    "--config.rope_scalings=()",
    "--config.finetune.enabled=False",
    "--config.data.seq_len=32",
    "--config.data.induction_span=16",
    "--config.data.passkey_digits=(4, 7)",
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


PROBES = [  # cheap probes on: their per-seed values and spread over seeds
    "--config.passkey.enabled=True",
    "--config.passkey.samples=2",
    "--config.passkey.digits=2",
    "--config.induction.enabled=True",
    "--config.induction.samples=2",
    "--config.induction.span=4",
]


def test_adding_seeds_trains_only_the_new_ones_and_reports_mean_and_spread(tmp_path, capsys):
    assert experiment.main([*SEEDS, *PROBES, "--workdir", str(tmp_path)]) == 0
    one = _read(tmp_path / "results.json")["families"]["alibi"]
    metrics = (tmp_path / "alibi" / "metrics.jsonl").read_text()
    capsys.readouterr()
    one_probes = _read(tmp_path / "results.json")
    assert "loss_seeds" not in one_probes["passkey"]  # one seed: nothing over seeds
    assert "; ± standard error over the samples" in (tmp_path / "results.md").read_text()
    argv = [*SEEDS, *PROBES, "--config.seeds=2", "--workdir", str(tmp_path)]
    assert experiment.main(argv) == 0
    out = capsys.readouterr().out
    assert "alibi seed 0: reused" in out and "alibi seed 1: trained (in this run" in out
    assert (tmp_path / "alibi" / "metrics.jsonl").read_text() == metrics  # seed 0 untouched
    assert (tmp_path / "alibi" / "seed1" / "trained.json").exists()
    results = _read(tmp_path / "results.json")  # the same evaluation settings: replaced
    row = results["families"]["alibi"]
    seeds = row["loss_seeds"][0]
    assert len(seeds) == 2 and seeds[0] != seeds[1] and seeds[0] == one["loss"][0]
    assert row["loss"][0] == pytest.approx(np.mean(seeds))
    assert f"alibi: loss over 2 seeds [{row['loss'][0]:.3f}, {row['loss'][1]:.3f}]" in out
    assert row["loss_se"][0] == pytest.approx(np.std(seeds, ddof=1) / np.sqrt(2))
    assert row["loss_sliding"] == [None, None] and results["training"]["alibi"]["seeds"] == [0, 1]
    assert "±" in (tmp_path / "results.md").read_text()
    for probe in ("passkey", "induction"):  # each seed's probe losses, the mean their mean
        block, first = results[probe], one_probes[probe]
        per_seed = np.array(block["loss_seeds"]["alibi"], dtype=float)  # [seed][length][cell]
        assert per_seed.shape[0] == 2 and block["loss_seeds"]["alibi"][0] == first["loss"]["alibi"]
        assert np.isfinite(per_seed).any()  # None (nan here) only where a gap does not fit
        np.testing.assert_allclose(np.array(block["loss"]["alibi"], float), per_seed.mean(0))
        se = np.std(per_seed, axis=0, ddof=1) / np.sqrt(2)
        np.testing.assert_allclose(np.array(block["loss_seed_se"]["alibi"], float), se)
    assert results["passkey"]["acc_seeds"]["alibi"][0] == one_probes["passkey"]["acc"]["alibi"]
    assert (
        "2 training seeds: mean ± standard error over seeds"
        in (tmp_path / "results.md").read_text()
    )
    assert experiment.main(["--config.seeds=0", "--workdir", str(tmp_path / "x")]) == 2


# ----------------------------------------------------------------------------------------------
# Position interpolation with a fine-tune (rows <entry>+<kind>+ft).

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


def _counting_finetunes(monkeypatch) -> list:
    calls, real = [], training.finetune

    def counting(config, train_config, kind, source, run_dir):
        calls.append((kind, int(train_config.train.seed)))
        return real(config, train_config, kind, source, run_dir)

    monkeypatch.setattr(training, "finetune", counting)
    return calls


def _tuned_dir(workdir, kind="linear", seed=0):
    (found,) = (workdir / "rope" / "finetune").glob(f"{kind}-seed{seed}-*")
    return found


def _losses_apart(config, graphdef, params, constants) -> list[float]:
    """The non-overlapping loss at 32 and 64 of a split model on the run's text, computed here
    (`scoring.score_lengths`) rather than by the experiment."""
    from posattn.eval import scoring

    ev = config.eval
    text = heldout.eval_text(
        data.load_corpus("stdlib"),
        lengths=[32, 64],
        max_tokens=ev.max_tokens,
        sliding_tokens=ev.sliding_tokens,
        stride=ev.sliding_stride,
        seed=ev.seed,
    )
    kw = dict(lengths=[32, 64], train_len=32, batch_tokens=4 * 64, curve_bins=8)
    return summary.mean_losses(
        scoring.score_lengths(graphdef, params, constants, text.val, text.plan, **kw)
    )


def test_finetune_rows_keep_the_factor_at_every_length_and_are_cached(tmp_path, monkeypatch):
    from posattn import cli
    from posattn.train import restore_trained

    calls = _counting_finetunes(monkeypatch)
    run = [*TUNE, "--workdir", str(tmp_path)]
    assert experiment.main(run) == 0
    assert calls == [("linear", 0)]
    results = _read(tmp_path / "results.json")
    assert set(results["families"]) == {"rope", "rope+linear+ft"}
    row = results["families"]["rope+linear+ft"]
    assert set(row) == ROW_KEYS and all(np.isfinite(row["loss"]))
    info = results["training"]["finetune"]["linear"]
    assert info["steps"] == 3 and info["multiple"] == 2 and np.isfinite(info["final_train_loss"])

    # The fine-tune is a posattn.train workdir: config.json, metrics.jsonl, checkpoints.
    tuned_dir = _tuned_dir(tmp_path)
    saved = json.loads((tuned_dir / "config.json").read_text())
    assert saved["data"]["seq_len"] == 64 and saved["model"]["rope_scaling"]["factor"] == 2.0
    lines = [json.loads(x) for x in (tuned_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert [info["first_train_loss"], info["final_train_loss"]] == [
        lines[0]["loss"],
        lines[-1]["loss"],
    ]

    # The fine-tune moved the params; the row is those params under factor 2 at every length,
    # L included (where an eval-time row rope+linear is plain RoPE).
    config = cli.parse(experiment.COMMAND, run).config
    cfg, graphdef, params, constants = experiment.restore_model(
        experiment.family_config(config, "rope"), tmp_path / "rope", attention_impl="auto"
    )
    leaves, treedef = jax.tree.flatten(params)
    tune_config = ml_collections.ConfigDict(saved)
    tuned = jax.tree.leaves(restore_trained(tune_config, tuned_dir / "checkpoints")[1]["params"])
    assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(tuned, leaves, strict=True))
    tuned = jax.tree.unflatten(treedef, tuned)
    scaling = {"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 32}
    g2, c2 = lengths_lib.with_rope_scaling(cfg, scaling)
    np.testing.assert_allclose(_losses_apart(config, g2, tuned, c2), row["loss"], rtol=1e-6)
    unscaled = _losses_apart(config, graphdef, tuned, constants)
    assert unscaled[0] != pytest.approx(row["loss"][0], rel=1e-5)

    # Re-evaluating reuses the fine-tuned params (no second fine-tune) ...
    for path in (tmp_path / "rope" / "evaluations").iterdir():
        path.unlink()
    assert experiment.main(run) == 0
    assert calls == [("linear", 0)]
    assert _read(tmp_path / "results.json")["families"]["rope+linear+ft"]["loss"] == row["loss"]
    # ... and another finetune setting fine-tunes again and re-evaluates.
    assert experiment.main([*run, "--config.finetune.learning_rate=1e-4"]) == 0
    assert calls == [("linear", 0), ("linear", 0)]
    again = _read(tmp_path / "results.json")["families"]["rope+linear+ft"]["loss"]
    assert again != row["loss"]
    assert len(list((tmp_path / "rope" / "finetune").iterdir())) == 2  # beside, not over


WINDOW = [
    *MINUTE,
    "--config.families=('nope',)",
    "--config.rope_scalings=()",
    "--config.finetune.enabled=False",
    "--config.copy.enabled=False",
    "--config.passkey.enabled=False",
    "--config.induction.enabled=False",
    "--config.eval.head_strings=0",
]


def test_a_window_row_is_the_trained_model_under_a_window_of_L(tmp_path, capsys):
    from posattn import cli

    run = [*WINDOW, "--config.window_rows=('nope',)", "--workdir", str(tmp_path)]
    assert experiment.main(run) == 0
    results = _read(tmp_path / "results.json")
    fams = results["families"]
    assert list(fams) == ["nope", "nope+window"]
    assert fams["nope+window"]["loss"][0] == fams["nope"]["loss"][0]  # at L the same model
    assert fams["nope+window"]["loss"][1] != fams["nope"]["loss"][1]
    stats = results["attention_stats"]["rows"]
    assert stats["nope"][1]["mass_beyond_L"][0][0] > 0
    assert stats["nope+window"][1]["mass_beyond_L"] == [[0.0] * 4] * 2  # no key L away
    assert "Rows `<entry>+window`" in (tmp_path / "results.md").read_text()

    # The row's loss at 2L is the trained params read with `windowed` (computed here apart).
    config = cli.parse(experiment.COMMAND, run).config
    cfg, _, params, constants = experiment.restore_model(
        experiment.family_config(config, "nope"), tmp_path / "nope", attention_impl="auto"
    )
    from flax import nnx

    from posattn.nn.model import TransformerLM

    small = lengths_lib.windowed(cfg, 32)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(small, rngs=nnx.Rngs(0))))
    apart = _losses_apart(config, graphdef, params, constants)
    np.testing.assert_allclose(apart, fams["nope+window"]["loss"], rtol=1e-6)

    # The window on the first layer only: another row, written beside, the same check.
    assert experiment.main([*run, "--config.window_layers=(0,)"]) == 0
    (first,) = tmp_path.glob("results-*")
    one = _read(first / "results.json")["families"]["nope+window"]
    assert one["loss"][0] == fams["nope"]["loss"][0]
    assert one["loss"][1] not in (fams["nope"]["loss"][1], fams["nope+window"]["loss"][1])
    small = lengths_lib.windowed(cfg, 32, (0,))
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(small, rngs=nnx.Rngs(0))))
    apart = _losses_apart(config, graphdef, params, constants)
    np.testing.assert_allclose(apart, one["loss"], rtol=1e-6)
    assert "attention of layer 0 (counting from 0)" in (first / "results.md").read_text()
    first.rename(tmp_path / "first_layer")

    # Without the window row the trained row's evaluations are reused (its cache key is as it
    # was), written beside as other evaluation settings.
    capsys.readouterr()
    assert experiment.main([*WINDOW, "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "nope loss: reused" in out and "evaluating again" not in out
    (beside,) = tmp_path.glob("results-*")
    assert _read(beside / "results.json")["families"]["nope"] == fams["nope"]


def test_an_interrupted_finetune_resumes_to_the_uninterrupted_numbers(
    tmp_path, monkeypatch, capsys
):
    """A fine-tune stopped midway (as a preemption stops it: checkpoint saved) fails the run
    (exit 1, resumable); the same command resumes it from its checkpoint and reports the numbers
    of a run never interrupted. An .npz of an earlier version is not read: the log says so."""
    straight = tmp_path / "straight"
    assert experiment.main([*TUNE, "--config.finetune.steps=4", "--workdir", str(straight)]) == 0
    real = training.train_and_evaluate

    def preempted_once(config, workdir, **kwargs):
        if "init_from" in kwargs and not list(workdir.glob("checkpoints/*")):
            kwargs["stop_after"] = 2  # as SIGTERM would after step 2
        return real(config, workdir, **kwargs)

    monkeypatch.setattr(training, "train_and_evaluate", preempted_once)
    cut = tmp_path / "cut"
    run = [*TUNE, "--config.finetune.steps=4", "--workdir", str(cut)]
    (cut / "rope" / "finetune").mkdir(parents=True)
    (cut / "rope" / "finetune" / "linear-seed0.npz").write_bytes(b"an earlier version's cache")
    assert experiment.main(run) == 1
    out = capsys.readouterr()
    assert "stopped as asked at step 2" in out.out and "rerun to resume" in out.err
    assert "linear-seed0.npz was saved by an earlier version" in out.out
    assert experiment.main(run) == 0
    assert "from step 2" in capsys.readouterr().out
    lines = [json.loads(x) for x in (_tuned_dir(cut) / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    before, after = _read(straight / "results.json"), _read(cut / "results.json")
    assert after["families"] == before["families"]
    tuned = [after["training"]["finetune"]["linear"], before["training"]["finetune"]["linear"]]
    for key in ("first_train_loss", "final_train_loss"):
        assert tuned[0][key] == tuned[1][key]


def test_a_run_trained_before_a_config_key_existed_is_still_the_same_config(tmp_path):
    """A trained.json written before data.batch_offset existed holds no such key: it had its
    default then, so the run is the same (reused), and a saved non-default value is not."""
    from posattn import cli
    from posattn import config as config_lib

    config = cli.parse(experiment.COMMAND, [*TUNE, "--workdir", str(tmp_path)]).config
    train_config = experiment.family_config(config, "rope")
    saved = json.loads(config_lib.to_json(train_config))
    del saved["data"]["batch_offset"]
    code = {"commit": "abc", "code_sha256": "0" * 64, "corpus_sha256": "1" * 64}
    (tmp_path / "trained.json").write_text(json.dumps({"config": saved, "code": code}))
    assert training.finished_run(train_config, tmp_path, code, reuse=False) is not None
    saved["data"]["batch_offset"] = 5
    (tmp_path / "trained.json").write_text(json.dumps({"config": saved, "code": code}))
    assert training.finished_run(train_config, tmp_path, code, reuse=False) is None


def _sigterm_pending(pid: int) -> bool:
    """Whether a SIGTERM sent to process `pid` waits for it (Linux's /proc, its ShdPnd mask)."""
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    pending = next(line for line in status.splitlines() if line.startswith("ShdPnd:"))
    return bool(int(pending.split()[1], 16) >> (signal.SIGTERM - 1) & 1)


def test_a_workers_sigterm_outside_training_is_no_failure_of_the_code_it_passes():
    """In a busy worker, a SIGTERM outside a training loop ends the task with Interrupted, even
    through code that catches every Exception (a checkpoint's restore takes those for damage and
    would set a good checkpoint aside); an idle worker ignores it."""
    from length_extrapolation import workers

    caught = []

    def task(job, key):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs here
        except Exception as e:
            caught.append(e)
        return "went on"

    previous = signal.signal(signal.SIGTERM, workers._stop)
    try:
        with pytest.raises(experiment.Interrupted, match="stopped by SIGTERM"):
            workers._call(task, None, ("unit",))
        assert not caught and not workers._busy.is_set()
        os.kill(os.getpid(), signal.SIGTERM)  # idle: ignored
        time.sleep(0.1)
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_worker_processes_give_one_cores_numbers_and_a_sigterm_resumes(tmp_path):
    """`config.workers=2` trains and evaluates the units (here alibi, and rope with a fine-tune)
    in two worker processes, each on one core, every training (fine-tunes included) started
    before any evaluation. A SIGTERM to the command, once both workers have saved a checkpoint,
    reaches the workers: they save and stop, the run fails with "rerun to resume", and the same
    command resumes both trainings and finishes with every number equal to one process's on one
    core."""
    script = str(ROOT / "experiments" / "length_extrapolation.py")
    argv = [sys.executable, script, *LEARNED, "--config.families=('alibi','rope')"]
    argv += ["--config.finetune.enabled=True", "--config.finetune.kinds=('linear',)"]
    argv += ["--config.train.steps=60", "--config.train.checkpoint_every=10"]
    one, two = tmp_path / "one", tmp_path / "two"
    core = min(os.sched_getaffinity(0))  # one process on one core: pinned, then the command
    pin = f"import os, sys; os.sched_setaffinity(0, {{{core}}}); os.execv(sys.executable, "
    pin += "[sys.executable, *sys.argv[1:]])"
    alone = subprocess.run(
        [sys.executable, "-c", pin, *argv[1:], "--workdir", str(one)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert alone.returncode == 0, alone.stdout + alone.stderr
    argv += ["--config.workers=2", "--workdir", str(two)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Each worker is paused (SIGSTOP; its pid is in its workdir's lock) once it has saved a
    # checkpoint. With both paused, the command gets its SIGTERM; the workers go on only once
    # the command has passed it to both. So both are stopped inside training, whatever their
    # speeds and start-up times on a loaded machine.
    paused, deadline = {}, time.monotonic() + 300
    try:
        while len(paused) < 2:
            for unit in ("alibi", "rope"):
                if unit not in paused and any((two / unit / "checkpoints").glob("[0-9]*")):
                    paused[unit] = int((two / unit / ".lock").read_text())
                    os.kill(paused[unit], signal.SIGSTOP)
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGTERM)
        while not all(_sigterm_pending(pid) for pid in paused.values()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
    finally:
        for pid in paused.values():
            os.kill(pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, out + err
    assert "stopped by SIGTERM" in err and "rerun" in err, err
    assert out.count("preempted (SIGTERM)") == 2 and not (two / "results.json").exists()
    again = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "2 units in 2 worker processes" in again.stdout
    assert again.stdout.count("resuming") == 2, again.stdout
    lines = again.stdout.splitlines()
    trainings = [i for i, x in enumerate(lines) if ": training (" in x or "fine-tuning" in x]
    evaluations = [i for i, x in enumerate(lines) if "evaluating at" in x]
    assert len(trainings) == 3 and len(evaluations) == 2, again.stdout
    assert trainings[1] < evaluations[0], again.stdout  # both trainings before an evaluation
    tuning = [i for i, x in enumerate(lines) if "rope+linear+ft: fine-tuning" in x]
    rope = [i for i, x in enumerate(lines) if "rope seed 0:" in x and "evaluating at" in x]
    assert tuning[0] < rope[0], again.stdout  # the fine-tune with the training, before the rows
    a, b = _read(one / "results.json"), _read(two / "results.json")
    assert set(a["families"]) == {"alibi", "rope", "rope+linear+ft"}
    assert a["families"] == b["families"]
    assert (a["timing"]["workers"], b["timing"]["workers"]) == (0, 2)
    for name in ("alibi", "rope"):
        assert a["training"][name]["final_train_loss"] == b["training"][name]["final_train_loss"]
    tuned = [r["training"]["finetune"]["linear"]["final_train_loss"] for r in (a, b)]
    assert tuned[0] == tuned[1]
