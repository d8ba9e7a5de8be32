"""A run started from another posattn workdir's parameters (`train_and_evaluate(init_from=...)`):
the fine-tune path (position interpolation, Chen et al. 2023) as a normal, resumable run."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import losses, read_metrics, small_config

from posattn import config as config_lib
from posattn import data as data_lib
from posattn.train import restore_trained, train_and_evaluate
from posattn.train import steps as steps_lib

SCALING = {"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 32}
TUNE = dict(  # the trained model at 2L under linear interpolation, a constant LR after warmup
    model__rope_scaling=SCALING,
    data__seq_len=64,
    data__batch_offset=9,
    train__steps=6,
    train__batch_size=4,
    train__learning_rate=5e-4,
    train__warmup_steps=2,
    train__min_lr_ratio=1.0,
    train__checkpoint_every=2,
    train__log_every=1,
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("trained")
    train_and_evaluate(small_config(train__steps=10), workdir)
    return workdir


def _by_hand(config, params):
    """The fine-tune written out: `steps.train_step` from `params` with fresh AdamW moments on
    batches (seed, batch_offset + s) of the fine-tune's shape; returns the per-step losses."""
    cfg = config_lib.validate(config)
    optim = steps_lib.OptimConfig.from_config(config.train)
    tx = steps_lib.make_optimizer(optim)
    graphdef, _, constants = steps_lib.init_model(cfg, jax.random.key(0))
    state = {
        "params": params,
        "constants": constants,
        "opt_state": tx.init(jax.tree.map(lambda p: p.astype(jnp.float32), params)),
        "step": jnp.zeros((), jnp.int32),
    }
    step = jax.jit(functools.partial(steps_lib.train_step, graphdef, optim))
    corpus = data_lib.load_corpus(config.data.corpus)
    options = data_lib.batch_options(config.data, causal=cfg.causal, vocab_size=cfg.vocab_size)
    out = []
    for s in range(1, config.train.steps + 1):
        batch = data_lib.train_batch(
            corpus,
            seed=config.train.seed,
            step=config.data.batch_offset + s,
            batch_size=config.train.batch_size,
            seq_len=config.data.seq_len,
            **options,
        )
        state, metrics = step(state, batch)
        out.append(float(metrics["loss"]))
    return out


def test_init_from_a_workdir_is_a_fine_tune_from_its_params_with_fresh_moments(tmp_path, trained):
    config = small_config(**TUNE)
    result = train_and_evaluate(config, tmp_path / "ft", init_from=trained)
    assert result["finished"] and result["step"] == 6
    source = restore_trained(small_config(train__steps=10), trained / "checkpoints")
    reference = _by_hand(config, source[1]["params"])
    np.testing.assert_allclose(losses(tmp_path / "ft"), reference, rtol=1e-5)
    lines, _ = read_metrics(tmp_path / "ft")
    assert [x["learning_rate"] for x in lines] == pytest.approx([2.5e-4] + [5e-4] * 5)
    saved = json.loads((tmp_path / "ft" / "config.json").read_text())
    assert saved["model"]["rope_scaling"] == SCALING and saved["data"]["batch_offset"] == 9
    # The source is read, never written.
    assert sorted(p.name for p in (trained / "checkpoints").iterdir()) == ["10"]


def test_a_fine_tune_stopped_midway_resumes_to_the_uninterrupted_losses(tmp_path, trained):
    config = small_config(**TUNE)
    straight = tmp_path / "straight"
    train_and_evaluate(config, straight, init_from=trained)
    stopped = tmp_path / "stopped"
    first = train_and_evaluate(config, stopped, init_from=trained, stop_after=3)
    assert not first["finished"] and first["step"] == 3
    again = train_and_evaluate(config, stopped, init_from=trained)  # resumes from its own step 3
    assert again["finished"]
    assert [x["step"] for x in read_metrics(stopped)[0]] == list(range(1, 7))
    assert losses(stopped) == losses(straight)  # bitwise: the state and batches are restored


def test_init_from_refuses_what_is_not_the_same_model_before_any_compute(tmp_path, trained):
    ConfigError = config_lib.ConfigError
    with pytest.raises(ConfigError, match=r"model.d_model: 32 -> 64.*may change only"):
        train_and_evaluate(small_config(model__d_model=64), tmp_path / "a", init_from=trained)
    with pytest.raises(ConfigError, match="model.position: 'rope' -> 'alibi'"):
        train_and_evaluate(small_config(model__position="alibi"), tmp_path / "b", init_from=trained)
    with pytest.raises(ConfigError, match="not a posattn workdir"):
        train_and_evaluate(small_config(), tmp_path / "c", init_from=tmp_path / "nothing")
    with pytest.raises(ConfigError, match="give one"):
        train_and_evaluate(
            small_config(),
            tmp_path / "d",
            init_from=trained,
            restart_from=trained / "checkpoints" / "10",
        )
    for name in "abcd":
        assert not (tmp_path / name / "checkpoints").exists()


def test_the_command_line_starts_from_a_workdir(tmp_path, trained, capsys):
    from conftest import ROOT, SMALL_OVERRIDES

    from posattn.train import main

    overrides = [f"--config.{x}" for x in SMALL_OVERRIDES] + [
        "--config.train.steps=2",
        "--config.train.warmup_steps=1",
        '--config.model.rope_scaling={"rope_type": "linear", "factor": 2.0}',
    ]
    argv = ["--config", str(ROOT / "configs" / "tiny.py"), *overrides]
    assert main([*argv, "--workdir", str(tmp_path / "ft"), "--init_from", str(trained)]) == 0
    assert f"starting from {trained} (its step 10)" in capsys.readouterr().out
