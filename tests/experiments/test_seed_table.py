"""experiments/seed_table.py: a line per row and seed, from a workdir or a committed record."""

import json

import numpy as np
import pytest
from conftest import ROOT, experiment_script

RECORD = ROOT / "experiments" / "record_2026-12-03_3000_steps_avx512_cpu"


@pytest.fixture(scope="module")
def seed_table():
    return experiment_script("seed_table")


def _write(path, values):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": {}, "code": {}, "values": values}))


def test_a_committed_record_gives_the_readme_table(seed_table):
    # experiments/README.md, the record at 3000 steps: T5 seed 0 half way, the text at L from
    # results.json's loss_seeds (the record keeps no loss files).
    lines = seed_table.seed_lines(RECORD)
    assert len(lines) == 2 + 17 * 3
    assert "| t5 | 0 | 1.592 | 0.64 / 0.62 | 0.25 / 0.22 | 0.33 ± 0.13 |" in lines
    assert "| fire | 2 | 1.602 | 0.01 / 0.01 | 1.00 / 1.00 | 0.33 ± 0.15 |" in lines


def test_a_length_reads_that_length_and_the_change_from_L(seed_table, capsys):
    # experiments/README.md, the remap record: ReRoPE's seed 0 at 16L = 1024, its text from
    # results.json's loss_seeds, the passkey and induction from the committed evaluations.
    record = ROOT / "experiments" / "remap_2026-12-05_avx512_cpu"
    lines = seed_table.seed_lines(record, 1024)
    assert lines[0].startswith("| row | seed | text at 1024 | change from L | passkey")
    assert "| rope+rerope | 0 | 1.615 | -0.074 | 1.84 / 2.20 | 0.09 / 0.00 | 2.38 ± 0.29 |" in lines
    assert "| rope | 1 | 3.064 | +1.373 | 3.53 / 3.42 | 0.00 / 0.00 | 4.26 ± 0.19 |" in lines
    assert seed_table.main([str(record), "--length", "100"]) == 2
    assert "no evaluation at length 100" in capsys.readouterr().err


def test_a_workdir_gives_every_seed_and_row(seed_table, tmp_path):
    loss = {"sum": [3.0, 1.0], "count": [2, 2]}  # 4 / 4 = 1.000 at L
    _write(tmp_path / "rope" / "evaluations" / "rope.loss.json", [loss, None])
    _write(tmp_path / "rope" / "evaluations" / "rope+yarn.loss.json", [loss])
    pk = {"loss": [0.5, 1.25], "acc": [1.0, 0.5], "se": [0.1, 0.1]}
    _write(tmp_path / "rope" / "seed1" / "evaluations" / "rope.passkey.json", [pk])
    ind = {"loss": [2.0, None], "acc": [0.5, None], "se": [0.5, None]}
    _write(tmp_path / "rope" / "seed1" / "evaluations" / "rope.induction.json", [ind])
    _write(tmp_path / "rope" / "seed10" / "evaluations" / "rope.loss.json", [loss])
    (tmp_path / "rope" / "checkpoints").mkdir()
    assert seed_table.seed_lines(tmp_path)[2:] == [
        "| rope | 0 | 1.000 | - | - | - |",
        "| rope | 1 | - | 0.50 / 1.25 | 1.00 / 0.50 | 2.00 ± 0.98 |",
        "| rope | 10 | 1.000 | - | - | - |",
        "| rope+yarn | 0 | 1.000 | - | - | - |",
    ]


def test_seeds_are_named_from_train_seed(seed_table, tmp_path):
    # --config.train.seed=5 --config.seeds=2: the family directory is seed 5, seed6/ seed 6;
    # results.json's loss_seeds run over the same seeds.
    pk = {"loss": [0.5], "acc": [1.0], "se": [0.1]}
    _write(tmp_path / "t5" / "evaluations" / "t5.passkey.json", [pk])
    _write(tmp_path / "t5" / "seed6" / "evaluations" / "t5.passkey.json", [pk])
    (tmp_path / "t5" / "config.json").write_text(json.dumps({"train": {"seed": 5}}))
    results = {"config": {"train": {"seed": 5}}, "families": {"t5": {"loss_seeds": [[1.5, 2.5]]}}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    assert seed_table.seed_lines(tmp_path)[2:] == [
        "| t5 | 5 | 1.500 | 0.50 | 1.00 | - |",
        "| t5 | 6 | 2.500 | 0.50 | 1.00 | - |",
    ]


def test_a_directory_without_evaluations_is_refused(seed_table, tmp_path, capsys):
    assert seed_table.main([str(tmp_path)]) == 2
    assert "no per-seed evaluations" in capsys.readouterr().err
    assert seed_table.main([str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_a_damaged_evaluation_is_named(seed_table, tmp_path, capsys):
    bad = tmp_path / "alibi" / "evaluations" / "alibi.passkey.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    assert seed_table.main([str(tmp_path)]) == 2
    assert f"{bad} is not an evaluation" in capsys.readouterr().err
    bad.unlink()
    _write(bad, [{"loss": [0.5], "acc": [1.0], "se": [0.1]}])
    (tmp_path / "results.json").write_text('{"families": []}')
    assert seed_table.main([str(tmp_path)]) == 2
    assert "results.json is not a results.json" in capsys.readouterr().err


def test_heads_prints_each_layers_scores_of_the_restored_model(seed_table, tmp_path):
    from conftest import small_config

    from posattn.eval.attention_stats import head_scores, repeated_strings
    from posattn.generate import load_model
    from posattn.train import train_and_evaluate

    config = small_config(train__steps=2, train__checkpoint_every=2)
    train_and_evaluate(config, tmp_path / "rope")
    (tmp_path / "alibi" / "checkpoints").mkdir(parents=True)  # nothing to restore
    L = config.data.seq_len
    _, graphdef, params, constants, _ = load_model(tmp_path / "rope")

    def want(seed, count):
        tokens = repeated_strings(np.random.default_rng(seed), count, L // 2, 256)
        found = head_scores(graphdef, params, constants, tokens, period=L // 2)
        return [
            f"| rope | 0 | {layer} | {' '.join(f'{x:.2f}' for x in prev)} | "
            f"{' '.join(f'{x:.2f}' for x in ind)} |"
            for layer, (prev, ind) in enumerate(
                zip(found["previous_token"], found["induction"], strict=True)
            )
        ]

    lines = seed_table.head_lines(tmp_path)  # no results.json: the default config's draw
    assert lines[2].startswith("| alibi | 0 | not restored (")
    assert lines[3:] == want(1234, 32) and len(lines) == 3 + config.model.num_layers
    # The experiment's own draw (results.json's eval.seed and eval.head_strings), so that the
    # first seed's lines are what its attention evaluator wrote.
    (tmp_path / "results.json").write_text(
        json.dumps({"config": {"eval": {"seed": 7, "head_strings": 2}}})
    )
    assert seed_table.head_lines(tmp_path)[3:] == want(7, 2)


def test_a_layer_pattern_row_is_named_as_results_json_names_it(seed_table):
    # The committed hybrids record: the evaluation files spell "rope:window=32|nope" as their
    # stem "rope@window=32|nope"; the table names the row as results.json does, its '|' escaped,
    # with the text at L from results.json's loss_seeds.
    lines = seed_table.seed_lines(ROOT / "experiments" / "hybrids_2026-12-03_avx512_cpu")
    assert len(lines) == 2 + 3 * 3
    row = "| rope:window=32\\|nope | 1 | 1.551 | 0.01 / 0.01 | 1.00 / 1.00 | 0.19 ± 0.07 |"
    assert row in lines
    assert all(line.count(" | ") == 5 for line in lines[2:])  # six cells, none split


def test_digits_prints_where_each_passkey_digit_came_from(seed_table, tmp_path):
    from conftest import small_config

    from posattn.eval.retrieval import PLACES, passkey_places, passkey_places_at_random
    from posattn.generate import load_model
    from posattn.train import train_and_evaluate

    config = small_config(train__steps=2, train__checkpoint_every=2)
    train_and_evaluate(config, tmp_path / "rope")
    L = config.data.seq_len
    _, graphdef, params, constants, _ = load_model(tmp_path / "rope")

    def cells(found):
        return " | ".join(" ".join(f"{x:.2f}" for x in found[k].mean(axis=0)) for k in PLACES)

    def want(seed, samples, depths, batch_tokens):
        probe = dict(length=L, depths=depths, samples=samples, digits=4, seed=seed)
        found = passkey_places(graphdef, params, constants, batch_tokens=batch_tokens, **probe)
        chance = passkey_places_at_random(**probe)
        return [
            f"| a digit before it, at random (L = {L}) | | {cells(chance)} |",
            f"| rope | 0 | {cells(found)} |",
        ]

    lines = seed_table.digit_lines(tmp_path)  # no results.json: the evaluators' defaults
    assert len(lines) == 4 and lines[0].count("|") == 8
    assert lines[2:] == want(1234, 32, [0.0, 1.0], 8 * 16 * L)
    # The experiment's own draw: results.json's passkey settings, eval seed and batch.
    run = {"passkey": {"samples": 3, "depths": [0.5]}, "eval": {"seed": 7, "batch_size": 2}}
    (tmp_path / "results.json").write_text(json.dumps({"config": run}))
    assert seed_table.digit_lines(tmp_path)[2:] == want(7, 3, [0.5], 2 * 16 * L)
