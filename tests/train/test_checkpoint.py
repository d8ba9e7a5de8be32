"""Checkpoints are never lost to a mismatch: incompatible ones stop the run untouched, damaged ones
are moved aside (never deleted) and the newest good one is used."""

import functools
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, SMALL_OVERRIDES, small_config
from flax import nnx

from posattn import config as config_lib
from posattn.nn import layers
from posattn.train import checkpoint as checkpoint_lib
from posattn.train import main, restore_trained, steps, train_and_evaluate
from posattn.train.checkpoint import Checkpointer, IncompatibleCheckpointError

# The small model of conftest.small_config, as command-line overrides (so that `main` is tested).
CLI_OVERRIDES = list(SMALL_OVERRIDES)


def _cli(workdir):
    return ["--config", str(ROOT / "configs" / "tiny.py"), "--workdir", str(workdir)] + [
        f"--config.{o}" for o in CLI_OVERRIDES
    ]


def _state(step, *, scale_name="scale", width=8, dtype=jnp.float32, poison=False):
    w = jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 7 + step
    if poison:
        w = w.at[1, 2].set(jnp.nan)
    return {
        "params": {"norm": {scale_name: jnp.ones((width,), dtype)}, "w": w},
        "step": jnp.asarray(step, jnp.int32),
    }


def _abstract(**kwargs):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.eval_shape(lambda: _state(0, **kwargs)),
    )


def _saved(directory, steps=(1, 2, 3), poison_last=False):
    ckpt = Checkpointer(directory, async_save=False)
    for s in steps:
        if poison_last and s == steps[-1]:  # as code without the save-time guard wrote it
            check = checkpoint_lib._fingerprint_and_check
            checkpoint_lib._fingerprint_and_check = lambda state, check=check: (check(state)[0], [])
            try:
                ckpt.save(s, _state(s, poison=True), {"step": s})
            finally:
                checkpoint_lib._fingerprint_and_check = check
        else:
            ckpt.save(s, _state(s), {"step": s})
    ckpt.close()


def _snapshot(path):
    """`path` and every file below it, with sizes and modification times."""
    return {
        str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in [path, *sorted(path.rglob("*"))]
    }


def _restore_latest(directory, abstract):
    ckpt = Checkpointer(directory)
    try:
        return ckpt.restore_latest(abstract), ckpt.set_aside, ckpt.steps()
    finally:
        ckpt.close()


# ---- Incompatible: the run stops, naming the paths; no file is touched. ----


@pytest.mark.parametrize(
    "changed, missing, unexpected, differing",
    [
        ({"scale_name": "gain"}, "params/norm/gain", "params/norm/scale", None),
        ({"width": 16}, None, None, "params/norm/scale: (8,) float32 -> (16,) float32"),
        ({"dtype": jnp.bfloat16}, None, None, "params/norm/scale: (8,) float32 -> (8,) bfloat16"),
    ],
    ids=["renamed", "shape", "dtype"],
)
def test_an_incompatible_checkpoint_stops_with_the_paths_and_touches_nothing(
    tmp_path, changed, missing, unexpected, differing
):
    directory = tmp_path / "checkpoints"
    _saved(directory)
    before = _snapshot(directory)
    ckpt = Checkpointer(directory)
    with pytest.raises(IncompatibleCheckpointError) as info:
        ckpt.restore_latest(_abstract(**changed))
    ckpt.close()
    error, text = info.value, str(info.value)
    assert error.step == 3 and "checkpoint 3" in text
    if missing:
        assert error.missing == [missing] and missing in text
    if unexpected:
        assert error.unexpected == [unexpected] and unexpected in text
    if differing:
        assert not error.missing and not error.unexpected and differing in text
        assert "params/w" not in text  # only what differs is named
    assert "No checkpoint was changed" in text and "the code that wrote it" in text
    assert _snapshot(directory) == before  # nothing moved, deleted or rewritten
    # The same checkpoints still restore with the code that wrote them.
    restored, set_aside, steps = _restore_latest(directory, _abstract())
    assert steps == [1, 2, 3] and not set_aside and int(restored[1]["step"]) == 3


# ---- Damaged: moved aside (never deleted), reported, the one before it used. ----


def _damage_truncate(directory, step):
    for path in (directory / str(step) / "state").rglob("d/*"):  # the array data (OCDBT)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _damage_metadata(directory, step):
    path = directory / str(step) / "state" / "_METADATA"  # the saved tree: unreadable
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _damage_fingerprint(directory, step):
    path = directory / str(step) / "record" / "metadata"
    record = json.loads(path.read_text())
    record["fingerprint"][0] ^= 1  # as if one bit of the first array had flipped
    path.write_text(json.dumps(record))


def test_the_host_fingerprint_equals_the_compiled_one_bit_for_bit():
    # A small state on the CPU is checked in NumPy (no program to compile); checkpoints written
    # either way must restore either way, so both give the same checksums and finiteness.
    rng = np.random.default_rng(0)
    values = [
        rng.normal(size=(7, 5)).astype(np.float32),
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45], np.float32),
        jnp.asarray(rng.normal(size=300), jnp.bfloat16),
        rng.normal(size=(3, 3)).astype(np.float16),
        np.array([-1, 2**31 - 1, -(2**31)], np.int32),
        np.array([-128, -1, 0, 127], np.int8),
        np.arange(300, dtype=np.uint8),
        np.array([True, False, True]),
        rng.normal(size=4),  # float64: read as float32, as jnp.asarray does
        np.zeros((0, 3), np.float32),
        np.float32(2.5),
        7,
        0.1,
        True,
        jnp.arange(100_000, dtype=jnp.uint32),  # products past 2^32 wrap the same way
    ]
    host = [checkpoint_lib._host_array(x) for x in values]
    assert all(a is not None for a in host)
    sums, finite = checkpoint_lib._host_fingerprints(host)
    want_sums, want_finite = jax.device_get(
        checkpoint_lib._fingerprints([jnp.asarray(x) for x in values])
    )
    assert sums == [int(v) for v in want_sums]
    assert finite == [bool(v) for v in want_finite] and finite.count(False) == 1
    # What only a compiled program reads goes to it.
    assert checkpoint_lib._host_array(jax.random.key(0)) is None
    assert checkpoint_lib._host_array(np.array(["a"])) is None


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(
    "damage, reason",
    [
        (_damage_truncate, ""),
        (_damage_metadata, ""),
        (_damage_fingerprint, "fingerprint"),
        (None, "non-finite"),  # saved with a NaN
    ],
    ids=["truncated", "metadata", "fingerprint", "nan"],
)
def test_a_damaged_checkpoint_is_moved_aside_and_the_previous_one_used(
    tmp_path, caplog, damage, reason
):
    directory = tmp_path / "checkpoints"
    _saved(directory, poison_last=damage is None)
    if damage is not None:
        damage(directory, 3)
    damaged_files = sorted(
        str(p.relative_to(directory / "3")) for p in (directory / "3").rglob("*")
    )
    with caplog.at_level(logging.WARNING):
        restored, set_aside, steps = _restore_latest(directory, _abstract())
    state, record = restored
    assert record["step"] == 2 and int(state["step"]) == 2
    np.testing.assert_array_equal(state["params"]["w"], _state(2)["params"]["w"])
    assert steps == [1, 2]
    assert [(x.step, x.moved_to) for x in set_aside] == [(3, directory / "damaged" / "3")]
    assert reason in set_aside[0].reason
    # Kept whole for inspection, not deleted.
    assert (
        sorted(
            str(p.relative_to(directory / "damaged" / "3"))
            for p in set_aside[0].moved_to.rglob("*")
        )
        == damaged_files
    )
    assert "checkpoint 3" in caplog.text and "damaged" in caplog.text
    assert "resuming from checkpoint 2" in caplog.text
    # The run writes step 3 again; a second damaged step 3 is kept beside the first.
    ckpt = Checkpointer(directory, async_save=False)
    ckpt.save(3, _state(3), {"step": 3})
    ckpt.close()
    _damage_fingerprint(directory, 3)
    restored, set_aside, steps = _restore_latest(directory, _abstract())
    assert restored[1]["step"] == 2 and steps == [1, 2]
    assert set_aside[0].moved_to == directory / "damaged" / "3.1"
    assert (directory / "damaged" / "3").is_dir()


# ---- The rename of a real parameter, through train_and_evaluate and the command line. ----


def _rename_rmsnorm_scale_to_gain(monkeypatch):
    def init(self, dim, *, dtype=jnp.float32, param_dtype=jnp.float32, eps=1e-6):
        self.gain = nnx.Param(jnp.ones((dim,), param_dtype))
        self.dtype, self.eps = dtype, eps

    def call(self, x):
        x = x.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * self.gain[...]).astype(self.dtype)

    monkeypatch.setattr(layers.RMSNorm, "__init__", init)
    monkeypatch.setattr(layers.RMSNorm, "__call__", call)


def test_renaming_a_parameter_stops_the_resume_and_keeps_every_checkpoint(
    tmp_path, monkeypatch, capsys
):
    # A workdir as `python -m posattn.train` leaves it after 20 steps (config.json, checkpoints 10
    # and 20 of the train state this code builds), without spending a compile on training.
    workdir = tmp_path / "run"
    workdir.mkdir()
    config = small_config()
    (workdir / "config.json").write_text(config_lib.to_json(config))
    (workdir / "metrics.jsonl").write_text(
        "".join(f'{{"step": {s}, "loss": 5.0}}\n' for s in range(1, 21))
    )
    tx = steps.make_optimizer(steps.OptimConfig.from_config(config.train))
    init = functools.partial(steps.init_train_state, config_lib.validate(config), tx)
    state = jax.jit(init)(jax.random.key(0))
    ckpt = Checkpointer(workdir / "checkpoints")
    for step in (10, 20):
        ckpt.save(step, dict(state, step=jnp.int32(step)), {"step": step})
    ckpt.close()
    kept = ("checkpoints", "metrics.jsonl")
    before = {name: _snapshot(workdir / name) for name in kept}
    assert before["checkpoints"]
    _rename_rmsnorm_scale_to_gain(monkeypatch)

    assert main(_cli(workdir)) == 1
    err = capsys.readouterr().err
    assert "posattn.train: error: checkpoint 20" in err
    assert "params/final_norm/gain/value" in err and "params/final_norm/scale/value" in err
    assert "mv " in err and "No checkpoint was changed" in err
    with pytest.raises(IncompatibleCheckpointError) as info:
        train_and_evaluate(small_config(train__steps=40), workdir)
    # Both norms of both blocks and the final one, in the parameters and both Adam moments.
    assert len(info.value.missing) == len(info.value.unexpected) == 15
    assert "params/blocks/0/attn_norm/gain/value" in info.value.missing
    assert "params/blocks/0/attn_norm/scale/value" in info.value.unexpected
    assert {name: _snapshot(workdir / name) for name in kept} == before  # untouched

    monkeypatch.undo()  # the code that wrote them restores them
    _, state, step = restore_trained(small_config(), workdir / "checkpoints")
    assert step == 20 and int(state["step"]) == 20
