"""The workdir: metrics.jsonl trimmed on resume (and TensorBoard events beside it), config.json
checked on resume, the lock, and the SIGTERM flag."""

import errno
import json
import os
import pathlib
import signal
import struct
import sys
import time

import ml_collections
import pytest
from conftest import small_config

from posattn.config import ConfigError
from posattn.train import loggers as loggers_lib
from posattn.train import workdir as workdir_lib


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_metrics_are_trimmed_to_the_restored_step_and_appended(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3, 4))
        + '{"step": 5, "lo'  # cut by a kill mid-write
    )
    with workdir_lib.MetricsFile(path, keep_through=2) as metrics:
        metrics.write({"step": 3, "loss": 0.5, "mfu": None})
    assert _lines(path) == [
        {"step": 1, "loss": 1.0},
        {"step": 2, "loss": 0.5},
        {"step": 3, "loss": 0.5, "mfu": None},
    ]
    with workdir_lib.MetricsFile(path, keep_through=0, enabled=False) as metrics:
        metrics.write({"step": 9, "loss": 0.0})  # not the lead process: nothing is touched
    assert len(_lines(path)) == 3


def _events(directory):
    """(tag, step, value) of every scalar in the TFRecord event files of `directory`."""
    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4  # length, its CRC, the record, its CRC
            out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return out


def test_tensorboard_events_repeat_the_numeric_values_beside_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboardX")
    path = tmp_path / "metrics.jsonl"
    train = ml_collections.ConfigDict(dict(loggers=(), tensorboard=True, wandb_mode="offline"))
    board = loggers_lib.open_loggers(train, tmp_path, {})
    with workdir_lib.MetricsFile(path, keep_through=0, loggers=board) as metrics:
        metrics.write({"step": 1, "loss": 2.5, "mfu": None, "tokens_per_sec": 100.0})
        metrics.write({"step": 2, "member": 3, "loss": 2.0, "diverged": True})
        metrics.write({"step": 2, "eval_loss": 1.5, "eval_tokens": 64})
    assert sorted(_events(tmp_path)) == [
        ("eval_loss", 2, 1.5),
        ("eval_tokens", 2, 64.0),
        ("loss", 1, 2.5),
        ("member_3/loss", 2, 2.0),
        ("tokens_per_sec", 1, 100.0),
    ]
    assert len(_lines(path)) == 3  # the source of truth


def test_wandb_offline_logs_every_numeric_value_with_no_network(tmp_path, monkeypatch):
    """A training run with `train.loggers=('wandb',)` in offline mode writes a W&B run under
    WORKDIR/wandb holding the values of metrics.jsonl; nothing is sent anywhere."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    train = ml_collections.ConfigDict(
        dict(loggers=("wandb",), tensorboard=False, wandb_mode="offline", wandb_project="t")
    )
    loggers_lib.check(train)
    path = tmp_path / "metrics.jsonl"
    made = loggers_lib.open_loggers(train, tmp_path, {"train": {"steps": 2}})
    run = made[0]._run
    with workdir_lib.MetricsFile(path, keep_through=0, loggers=made) as metrics:
        metrics.write({"step": 1, "loss": 2.5, "mfu": None})
        metrics.write({"step": 2, "loss": 2.0, "member": 1})
        metrics.write({"step": 3, "eval_loss": 1.5})  # W&B commits a step when the next begins
        assert run.offline and run.config["train"] == {"steps": 2}
        assert run.summary["loss"] == 2.5 and run.summary["member_1/loss"] == 2.0
    files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    assert wandb.run is None  # finished when the metrics file closed
    with pytest.raises(ConfigError, match="train.loggers names 'mlflow'"):
        loggers_lib.check(ml_collections.ConfigDict(dict(train, loggers=("mlflow",))))


def test_tensorboard_without_tensorboardx_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails
    train = ml_collections.ConfigDict(dict(loggers=(), tensorboard=True, wandb_mode="offline"))
    with pytest.raises(ConfigError, match="train.tensorboard=True .* pip install tensorboardX"):
        loggers_lib.check(train)


def test_resuming_checks_the_config_but_allows_what_does_not_change_the_run(tmp_path):
    workdir_lib.write_or_check_config(tmp_path, small_config())
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved["train"]["profile_steps"], saved["train"]["tensorboard"]  # a run from before them
    (tmp_path / "config.json").write_text(json.dumps(saved))
    workdir_lib.write_or_check_config(
        tmp_path, small_config(train__steps=50, train__profile_steps=(2, 3), train__log_every=1)
    )
    with pytest.raises(ConfigError, match="model.position: 'rope' -> 'alibi'"):
        workdir_lib.write_or_check_config(tmp_path, small_config(model__position="alibi"))


def test_the_lock_refuses_a_second_owner_and_names_the_first(tmp_path):
    with workdir_lib.lock(tmp_path):
        with pytest.raises(workdir_lib.WorkdirBusyError, match=f"pid {os.getpid()}"):
            with workdir_lib.lock(tmp_path):
                pass
    with workdir_lib.lock(tmp_path):  # released
        pass


def test_sigterm_sets_the_flag_and_the_handler_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    with workdir_lib.preemption_flag() as received:
        assert not received()
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not received() and time.monotonic() < deadline:
            time.sleep(0.01)  # Python runs the handler between bytecodes
        assert received()
    assert signal.getsignal(signal.SIGTERM) is before


def test_metrics_are_rewritten_atomically(tmp_path, monkeypatch):
    """A kill during the startup rewrite leaves the old file whole (here: the rename fails)."""
    path = tmp_path / "metrics.jsonl"
    original = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6))
    path.write_text(original)

    def killed(*args):
        raise KeyboardInterrupt  # as if the process died just before the rename

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        workdir_lib.MetricsFile(path, keep_through=2)
    assert path.read_text() == original
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temp file left
    monkeypatch.undo()
    with pytest.raises(KeyboardInterrupt):
        monkeypatch.setattr(os, "replace", killed)
        workdir_lib.write_config(tmp_path, small_config())
    assert not (tmp_path / "config.json").exists()


def test_metrics_that_end_before_the_restored_step_are_reported(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3))
        + "garbage\n"
        + json.dumps({"step": 4, "loss": 1.0})
        + "\n"
    )
    with workdir_lib.MetricsFile(path, keep_through=8) as metrics:
        assert metrics.missing == (5, 8)
    assert "steps 5..8 have no metrics lines" in caplog.text
    assert "1 unreadable lines dropped (line 4)" in caplog.text
    path.unlink()  # lost altogether (e.g. zero bytes after a crash)
    with workdir_lib.MetricsFile(path, keep_through=8) as metrics:
        assert metrics.missing == (1, 8)
    caplog.clear()
    with workdir_lib.MetricsFile(path, keep_through=0) as metrics:  # a fresh run: nothing to say
        assert metrics.missing is None
    assert not caplog.text


def test_a_damaged_config_json_is_a_config_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model": {"d_model": 3')
    with pytest.raises(ConfigError, match=r"config.json is damaged.*mv "):
        workdir_lib.check_config(tmp_path, small_config())


def test_a_workdir_that_cannot_hold_a_run_is_one_sentence(tmp_path, monkeypatch):
    afile = tmp_path / "file"
    afile.write_text("")
    with pytest.raises(workdir_lib.WorkdirError, match="is a file"):
        workdir_lib.make_workdir(afile)
    with pytest.raises(workdir_lib.WorkdirError, match="cannot be created"):
        workdir_lib.make_workdir(afile / "below")

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(pathlib.Path, "open", read_only)
    with pytest.raises(workdir_lib.WorkdirError, match="not writable .Read-only file system"):
        with workdir_lib.lock(tmp_path):
            pass


def test_a_config_json_written_before_keys_were_added_still_resumes(config_factory):
    """Keys added to the library since a run started (a family's, data's, train's, `plugins`)
    had their defaults then: no difference, so old workdirs resume."""
    import json

    from posattn import config as config_lib
    from posattn.train import workdir as workdir_lib

    config = config_factory()
    before = json.loads(config_lib.to_json(config))
    for section, key in (
        (None, "plugins"),
        ("data", "induction_fraction"),
        ("data", "probe_weight"),
        ("model", "layer_pattern"),
        ("model", "rope_partial_factor"),
    ):
        (before if section is None else before[section]).pop(key)
    assert workdir_lib.config_differences(before, config) == []
    before["data"]["seq_len"] = 99
    assert [k for k, _, _ in workdir_lib.config_differences(before, config)] == ["data.seq_len"]
