"""experiments/heads_by_length.py: the copying head read at every evaluation length."""

import json

import numpy as np
import pytest
from conftest import experiment_script, small_config

from posattn.eval import lengths as lengths_lib
from posattn.eval.attention_stats import head_scores, repeated_strings
from posattn.generate import load_model
from posattn.train import train_and_evaluate


@pytest.fixture(scope="module")
def script():
    return experiment_script("heads_by_length")


def test_the_head_chosen_at_L_is_read_at_every_length(script, tmp_path):
    for position in ("rope", "learned"):
        config = small_config(  # the learned table holds L = 32 positions, no more
            model__position=position, model__max_len=32, train__steps=2, train__checkpoint_every=2
        )
        train_and_evaluate(config, tmp_path / position)
    L = config.data.seq_len
    # Without a results.json the lengths are the default multiples of L; with one, the run's
    # (two here, to keep the test short).
    assert script._read_results(tmp_path / "results.json") == {}
    assert script._lengths({}, L) == [m * L for m in (1, 2, 4, 8, 16)]
    results = {"families": {"rope": {"eval_len": [L, 2 * L]}}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    header, rule, learned, rope = script.head_rows(tmp_path)
    assert header.split(" | ")[3:5] == [str(L), str(2 * L)]
    assert learned.startswith("| learned | 0 | ") and learned.endswith("| - | - |")
    # At L the head is the one with the largest induction weight on the evaluator's strings
    # (eval.seed 1234, 32 strings without a results.json), and its weight is that one.
    _, graphdef, params, constants, _ = load_model(tmp_path / "rope")
    tokens = repeated_strings(np.random.default_rng(1234), 32, L // 2, 256)
    at_L = head_scores(graphdef, params, constants, tokens, period=L // 2)
    ind, prev = np.asarray(at_L["induction"]), np.asarray(at_L["previous_token"])
    layer, head = np.unravel_index(np.argmax(ind), ind.shape)
    below = prev[:layer] if layer > 0 else prev  # the feeding head: in a layer below the copier
    p_layer, p_head = np.unravel_index(np.argmax(below), below.shape)
    cells = [c.strip() for c in rope.strip("|").split("|")]
    assert cells[:3] == ["rope", "0", f"{layer}.{head}, {p_layer}.{p_head}"]
    assert cells[3] == f"{ind.max():.2f} / {below.max():.2f} / 0.00"  # nothing before at L
    pairs = [[float(x) for x in c.split(" / ")] for c in cells[3:5]]
    assert all(0 <= w <= 1 for pair in pairs for w in pair)
    assert float(cells[5]) >= pairs[-1][0]  # any head's induction weight >= the chosen one's

    # A run's eval-time scalings (results.json's rope_scalings) and the fine-tunes under a RoPE
    # seed are rows too: the scaling row is the trained model at L and differs past it.
    # Here they come from a results.json of other evaluation settings, written beside the first.
    results["config"] = {"rope_scalings": ["yarn"], "window_rows": ["rope"]}
    beside = tmp_path / "results-0123" / "results.json"
    beside.parent.mkdir()
    beside.write_text(json.dumps(results))
    scaling = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}
    tune = small_config(
        model__rope_scaling=scaling, data__seq_len=64, train__steps=2, train__checkpoint_every=2
    )
    train_and_evaluate(tune, tmp_path / "rope" / "finetune" / "yarn-seed0-0123abcd")
    rows = {line.split(" | ")[0][2:]: line for line in script.head_rows(tmp_path, beside)[2:]}
    assert list(rows) == ["learned", "rope", "rope+window", "rope+yarn", "rope+yarn+ft"]
    plain = [c.strip() for c in rows["rope"].strip("|").split("|")]
    assert plain[2:4] == cells[2:4]  # at L as before
    for other in ("rope+yarn", "rope+window"):  # the trained model at L
        assert [c.strip() for c in rows[other].strip("|").split("|")][2:4] == plain[2:4]
    models = {
        r[0]: r[-1]
        for r in script._row_models(tmp_path, script._read_results(beside))
        if r[0].startswith("rope")
    }
    tokens = np.tile(np.arange(97, 129), (2, 2))  # 2L: a string of L letters written twice
    at_2L = {
        r: head_scores(*models[r](64), tokens, period=32)
        for r in ("rope", "rope+yarn", "rope+window")
    }
    assert not np.allclose(at_2L["rope"]["induction"], at_2L["rope+yarn"]["induction"])
    # The window row reads every layer under a window of L past L: other weights than RoPE's.
    graphdef, params, constants = models["rope+window"](64)
    assert lengths_lib.model_config_of(graphdef, params, constants).layers[0].window == L
    assert not np.allclose(at_2L["rope"]["induction"], at_2L["rope+window"]["induction"])
    tuned = [c.strip() for c in rows["rope+yarn+ft"].strip("|").split("|")]
    assert "-" not in tuned[3:5]  # read with its own scaling at every length

    # An entry with settings trains in "<family>@<settings>" and is named as results.json names
    # it, its window row too.
    (tmp_path / "rope@rope_base=10000.0").symlink_to(tmp_path / "rope")
    entry = "rope:rope_base=10000.0"
    config = {"families": ["learned", entry], "window_rows": [entry]}
    names = [r[0] for r in script._row_models(tmp_path, {"config": config})]
    assert entry in names and f"{entry}+window" in names
    assert "rope@rope_base=10000.0" not in names and "rope+window" not in names


def test_a_directory_without_checkpoints_is_refused(script, tmp_path, capsys):
    assert script.main([str(tmp_path)]) == 2
    assert "no trained checkpoints" in capsys.readouterr().err
    assert script.main([str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert script.main([str(tmp_path), "--results", str(tmp_path / "results.json")]) == 2
    assert "is not a file" in capsys.readouterr().err
