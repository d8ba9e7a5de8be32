"""Faults lose nothing: NaN stops cleanly, SIGTERM saves, SIGKILL and damaged checkpoints resume
exactly."""

import fcntl
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, losses, read_metrics, small_config

from posattn.config import ConfigError
from posattn.data import DataError, load_corpus
from posattn.train import NonFiniteLossError, WorkdirBusyError, main, steps, train_and_evaluate

# A run long enough to be interrupted: the schedule is that of 10^5 steps, we stop it much earlier.
LONG = dict(
    train__steps=100_000, train__warmup_steps=10, train__checkpoint_every=4, train__log_every=1
)
CLI_OVERRIDES = [
    "model.d_model=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "data.seq_len=32",
    "train.batch_size=8",
    "train.eval_every=0",
    "train.steps=100000",
    "train.warmup_steps=10",
    "train.checkpoint_every=4",
    "train.log_every=1",
]


def _start_cli(workdir, extra=()):
    args = [
        sys.executable,
        "-m",
        "posattn.train",
        "--config",
        str(ROOT / "configs" / "tiny.py"),
        "--workdir",
        str(workdir),
    ] + [f"--config.{o}" for o in [*CLI_OVERRIDES, *extra]]
    return subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )


def _wait_for_steps(workdir, n, proc, timeout=240):
    path = workdir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    raise AssertionError(f"no {n} steps after {timeout}s")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The losses of 60 uninterrupted steps of the LONG run (computed once for the module)."""
    workdir = tmp_path_factory.mktemp("reference")
    train_and_evaluate(small_config(**LONG), workdir, stop_after=60)
    return losses(workdir)


def test_nan_loss_stops_with_the_step_and_keeps_the_last_checkpoint(
    tmp_path, monkeypatch, reference
):
    original = steps.train_step

    def poisoned(graphdef, optim, state, batch):  # the update of step 7 produces NaN everywhere
        new_state, metrics = original(graphdef, optim, state, batch)
        bad = state["step"] >= 6
        metrics = dict(metrics, loss=np.float32(np.nan) * bad + metrics["loss"])
        return new_state, metrics

    monkeypatch.setattr(steps, "train_step", poisoned)
    with pytest.raises(
        NonFiniteLossError,
        match=r"loss is nan at step 7.*last good checkpoint is \S*checkpoints/4 \(step 4",
    ):
        train_and_evaluate(small_config(**LONG), tmp_path)
    assert sorted(
        int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()
    ) == [4]
    monkeypatch.setattr(steps, "train_step", original)
    result = train_and_evaluate(small_config(**LONG), tmp_path, stop_after=8)  # resumes from 4
    assert result["step"] == 8 and losses(tmp_path) == reference[:8]


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path, reference):
    workdir = tmp_path / "run"
    proc = _start_cli(workdir)
    _wait_for_steps(workdir, 6, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "preempted (SIGTERM) at step" in out
    stopped = int(out.split("preempted (SIGTERM) at step ")[1].split(":")[0])
    saved = max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == stopped
    assert stopped + 3 <= len(reference)
    train_and_evaluate(small_config(**LONG), workdir, stop_after=stopped + 3)
    assert losses(workdir) == reference[: stopped + 3]


def test_sigkill_resumes_with_exactly_the_uninterrupted_losses(tmp_path, reference):
    workdir = tmp_path / "run"
    proc = _start_cli(workdir)
    _wait_for_steps(workdir, 11, proc)
    proc.kill()
    proc.communicate()
    train_and_evaluate(small_config(**LONG), workdir, stop_after=16)
    assert losses(workdir) == reference[:16]


# orbax's aborted reads of the damaged checkpoint raise when finalised, here or during a later
# test (those are filtered in pyproject.toml).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_latest_checkpoint_falls_back_to_the_previous(tmp_path, damage, caplog, reference):
    workdir = tmp_path / "run"
    train_and_evaluate(small_config(**LONG), workdir, stop_after=10)  # checkpoints 4, 8, 10
    # Every data file of checkpoint 10 damaged: orbax writes its arrays into these files in
    # parallel, so which file holds what (and which bytes of it a restore reads) differs from run
    # to run; one byte of one file could miss every array read.
    for target in (workdir / "checkpoints" / "10" / "state").rglob("d/*"):
        data = bytearray(target.read_bytes())
        if damage == "flip":
            for at in (len(data) // 4, len(data) // 2, 3 * len(data) // 4):
                data[at] ^= 0x01
        else:
            data = data[: len(data) // 2]
        target.write_bytes(bytes(data))
    train_and_evaluate(small_config(**LONG), workdir, stop_after=12)
    assert "checkpoint 10" in caplog.text and "damaged" in caplog.text
    assert (workdir / "checkpoints" / "damaged" / "10" / "state").is_dir()  # kept, not deleted
    assert losses(workdir) == reference[:12]


def test_a_second_process_on_the_same_workdir_is_refused(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    with open(tmp_path / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242")
        held.flush()
        with pytest.raises(WorkdirBusyError, match="already training"):
            train_and_evaluate(small_config(train__steps=2), tmp_path)
        code = main(["--config", str(ROOT / "configs" / "tiny.py"), "--workdir", str(tmp_path)])
        assert code == 1
    assert not (tmp_path / "metrics.jsonl").exists()


def test_token_ids_outside_the_vocabulary_are_rejected(tmp_path):
    tokens = np.arange(2000, dtype=np.uint16) % 300
    tokens.tofile(tmp_path / "train.bin")
    tokens.tofile(tmp_path / "val.bin")
    corpus = load_corpus(str(tmp_path))
    assert corpus.vocab_size == 300
    with pytest.raises(DataError, match=r"model.vocab_size=256.*--config.model.vocab_size=300"):
        train_and_evaluate(small_config(data__corpus=str(tmp_path)), tmp_path / "w")


def test_empty_and_too_short_corpora_are_clear_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="empty directory"):
        load_corpus(str(empty))
    with pytest.raises(DataError, match="no such file"):
        load_corpus(str(tmp_path / "missing"))
    short = tmp_path / "short.txt"
    short.write_text("too short to cut a window from")
    with pytest.raises(DataError, match=r"fewer than one window.*data.seq_len"):
        train_and_evaluate(small_config(data__corpus=str(short)), tmp_path / "w")
    assert not (tmp_path / "w").exists()  # refused before the workdir was made


# ---- Readers beside a running trainer; a NaN state is never saved; resume checks. ----


def test_readers_during_training_lose_no_checkpoint_and_sigint_saves(tmp_path):
    """Readers (restore_trained, as generation and evaluation use it) in a loop against a run
    that checkpoints every step, then Ctrl-C: the trainer exits 0 with its checkpoint saved, and
    every checkpoint it wrote restores."""
    from posattn import generate
    from posattn.train import checkpoint as checkpoint_lib
    from posattn.train import restore_trained
    from posattn.train import workdir as workdir_lib

    workdir = tmp_path / "run"
    config = small_config(**dict(LONG, train__checkpoint_every=1, train__keep_checkpoints=1000))
    # A workdir with its config and no checkpoint yet: a reader creates nothing in it.
    workdir.mkdir()
    workdir_lib.write_config(workdir, config)
    assert generate.main(["--workdir", str(workdir), "--prompt", "x"]) == 2
    assert sorted(p.name for p in workdir.iterdir()) == ["config.json"]
    proc = _start_cli(workdir, ["train.checkpoint_every=1", "train.keep_checkpoints=1000"])
    _wait_for_steps(workdir, 1, proc)
    reads = collisions = 0
    while proc.poll() is None and (reads < 12 or collisions < 3):
        writing = any("tmp" in p.name for p in (workdir / "checkpoints").iterdir())
        restored = restore_trained(config, workdir / "checkpoints")
        collisions += writing or any("tmp" in p.name for p in (workdir / "checkpoints").iterdir())
        reads += restored is not None
        if reads > 400:
            break
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "interrupted (SIGINT) at step" in out
    stopped = int(out.split("interrupted (SIGINT) at step ")[1].split(":")[0])
    assert collisions >= 3 and reads >= 10, (reads, collisions)
    # Every step 1..stopped was checkpointed, and every one restores (read-only: nothing moves).
    reader = checkpoint_lib.Checkpointer(workdir / "checkpoints", read_only=True)
    try:
        assert reader.steps() == list(range(1, stopped + 1))
        _, state, _ = restore_trained(config, workdir / "checkpoints")  # the targets
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        for step in reader.steps():
            _, record = reader.restore_checked(step, abstract)
            assert record["step"] == step
    finally:
        reader.close()
    assert not (workdir / "checkpoints" / "damaged").exists()


def _poison_params_at(monkeypatch, step):
    """The update of `step` makes the parameters NaN while that step's loss stays finite."""
    original = steps.train_step

    def poisoned(graphdef, optim, state, batch):
        new_state, metrics = original(graphdef, optim, state, batch)
        bad = state["step"] >= step - 1
        params = jax.tree.map(lambda p: jnp.where(bad, jnp.nan, p), new_state["params"])
        return dict(new_state, params=params), metrics

    monkeypatch.setattr(steps, "train_step", poisoned)
    return original


def test_a_nan_state_with_a_finite_loss_is_never_saved_and_restart_from_goes_on(
    tmp_path, monkeypatch, reference
):
    workdir = tmp_path / "run"
    config = small_config(**dict(LONG, train__checkpoint_every=3))
    original = _poison_params_at(monkeypatch, 9)
    with pytest.raises(NonFiniteLossError) as e:
        train_and_evaluate(config, workdir)
    message = str(e.value)
    good = workdir / "checkpoints" / "6"
    assert "step 9" in message and f"last good checkpoint is {good}" in message
    assert f"--restart_from={good}" in message
    assert sorted(int(p.name) for p in good.parent.iterdir() if p.name.isdigit()) == [3, 6]
    monkeypatch.setattr(steps, "train_step", original)
    # A lower learning rate: a new workdir started from the good checkpoint.
    lower = small_config(**dict(LONG, train__checkpoint_every=3, train__learning_rate=5e-4))
    with pytest.raises(ConfigError, match="train.learning_rate"):
        train_and_evaluate(lower, workdir, stop_after=8)  # the same workdir: another config
    new = tmp_path / "lower"
    train_and_evaluate(lower, new, stop_after=8, restart_from=good)
    lines, _ = read_metrics(new)
    assert [x["step"] for x in lines] == [7, 8]
    assert losses(new)[0] == pytest.approx(reference[6], rel=1e-6)  # from checkpoint 6's state
    schedule = reference_lr(lower, 6)
    assert lines[0]["learning_rate"] == pytest.approx(schedule, rel=1e-6)
    # The new workdir resumes as any other.
    train_and_evaluate(lower, new, stop_after=9)
    assert [x["step"] for x in read_metrics(new)[0]] == [7, 8, 9]


def reference_lr(config, step):
    optim = steps.OptimConfig.from_config(config.train)
    return float(optim.learning_rate * steps.lr_shape(optim)(step))


def test_a_nan_state_is_never_saved_by_the_loop_and_a_fresh_run_names_no_checkpoint(tmp_path):
    """`run_loop` with a stand-in step whose update turns the state NaN at `bad` (loss finite)."""
    from posattn.train import sharding
    from posattn.train.checkpoint import Checkpointer
    from posattn.train.loop import Job, Schedule, run_loop

    def run(bad, directory):
        def step_fn(state, batch):
            w = state["w"] + 1.0
            w = jnp.where(state["step"] + 1 >= bad, jnp.nan, w)
            return {"w": w, "step": state["step"] + 1}, {"loss": jnp.float32(1.0)}

        state = {"w": jnp.zeros((3,)), "step": jnp.int32(0)}
        ckpt = Checkpointer(directory, async_save=False)
        with pytest.raises(NonFiniteLossError) as e:
            job = Job(
                step=step_fn, batch_at=lambda s: None, emit=lambda *a: None,
                record=lambda s: {"step": s}, name="t", tokens_per_step=1,
            )  # fmt: skip
            schedule = Schedule(total=10, log_every=1, checkpoint_every=1)
            run_loop(state, 0, job, schedule, ckpt, sharding.make_mesh(1))
        return str(e.value), sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())

    message, saved = run(1, tmp_path / "fresh")
    assert "No checkpoint was saved" in message and "step 0" not in message and saved == []
    message, saved = run(4, tmp_path / "later")
    assert saved == [1, 2, 3] and "state of step 4 holds NaN" in message
    assert f"last good checkpoint is {tmp_path / 'later' / '3'} (step 3" in message


@pytest.mark.parametrize("key, value", [("b2", 1.0), ("b1", 1.0), ("b2", -0.1), ("grad_clip", 0)])
def test_optimiser_settings_that_cannot_train_are_refused(key, value):
    with pytest.raises(ConfigError, match=rf"train\.{key}={value}.* must be a number in [\[(]"):
        small_config(**{f"train__{key}": value})


def test_resume_checks_the_checkpoints_config_whatever_config_json_says(tmp_path):
    train_and_evaluate(small_config(**LONG), tmp_path, stop_after=4)
    (tmp_path / "config.json").unlink()
    changed = small_config(**dict(LONG, train__learning_rate=0.05, train__seed=7))
    with pytest.raises(ConfigError) as e:
        train_and_evaluate(changed, tmp_path, stop_after=6)
    assert "train.learning_rate" in str(e.value) and "train.seed" in str(e.value)
    assert "checkpoints" in str(e.value)
    assert not (tmp_path / "config.json").exists()  # not rewritten with the refused config
    assert [x["step"] for x in read_metrics(tmp_path)[0]] == [1, 2, 3, 4]


def test_a_validation_split_smaller_than_one_eval_batch_is_refused(tmp_path):
    corpus = tmp_path / "small"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"f{i:02d}.txt").write_text(f"{i:02d}" + "x" * 48 + "\n")  # 51 bytes
    with pytest.raises(DataError, match="fewer than one evaluation batch"):
        train_and_evaluate(
            small_config(data__corpus=str(corpus), train__eval_every=5), tmp_path / "w"
        )
    assert not (tmp_path / "w" / "metrics.jsonl").exists()
    # A sweep evaluates every program at its end: refused the same way, before compute.
    from posattn import config as config_lib
    from posattn import sweep

    sweep_config = config_lib.load_config(
        ROOT / "configs" / "sweep_tiny.py",
        ["data.seq_len=32", "train.batch_size=8", f"data.corpus={corpus}"],
    )
    with pytest.raises(DataError, match="fewer than one evaluation batch"):
        sweep.run_sweep(sweep_config, tmp_path / "s")
    assert not (tmp_path / "s" / "programs").exists()
