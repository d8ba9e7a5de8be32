"""Training: loss falls for every family; exact resumption; the same losses on 1, 8 devices and 2 processes."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, losses, read_metrics, run_python, small_config

from posattn import families
from posattn.train import train_and_evaluate


@pytest.mark.parametrize("position", families.names())
def test_loss_falls_for_every_family(tmp_path, position):
    config = small_config(
        model__position=position,
        train__steps=40,
        train__learning_rate=3e-3,
        train__checkpoint_every=40,
    )
    result = train_and_evaluate(config, tmp_path)
    values = losses(tmp_path)
    assert len(values) == 40 and result["finished"]
    assert np.mean(values[-5:]) < np.mean(values[:5]) - 0.5, values
    assert values[0] == pytest.approx(np.log(256), abs=0.5)  # starts near uniform over bytes


def test_encoder_with_bidirectional_t5_trains(tmp_path):
    config = small_config(
        model__position="t5",
        model__kind="encoder",
        train__steps=30,
        train__learning_rate=3e-3,
        train__eval_every=30,
    )
    result = train_and_evaluate(config, tmp_path)
    values = losses(tmp_path)
    assert np.mean(values[-5:]) < np.mean(values[:5]) - 0.3
    assert np.isfinite(result["eval_loss"])


def test_metrics_file_schema(tmp_path):
    train_and_evaluate(small_config(train__steps=10, train__eval_every=5), tmp_path)
    train_lines, eval_lines = read_metrics(tmp_path)
    assert [x["step"] for x in train_lines] == list(range(1, 11))
    for line in train_lines:
        assert {
            "step",
            "loss",
            "grad_norm",
            "param_norm",
            "learning_rate",
            "tokens_per_sec",
        } <= set(line)
    assert [x["step"] for x in eval_lines] == [5, 10]
    assert all("loss" not in x and x["eval_loss"] > 0 for x in eval_lines)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model"]["position"] == "rope"


@pytest.mark.parametrize("position", ["kerple_power", "t5"])
def test_resume_gives_exactly_the_uninterrupted_losses(tmp_path, position):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    config = small_config(model__position=position, train__steps=20, train__checkpoint_every=5)
    train_and_evaluate(config, straight)
    first = train_and_evaluate(
        config, interrupted, stop_after=12
    )  # a checkpoint at 12, lines to 12
    assert not first["finished"] and first["step"] == 12
    train_and_evaluate(config, interrupted)  # resumes from 12
    assert losses(interrupted) == losses(
        straight
    )  # bitwise: batches and state are restored exactly


def test_resuming_with_another_config_is_refused(tmp_path):
    from posattn.config import ConfigError

    train_and_evaluate(small_config(train__steps=5), tmp_path)
    with pytest.raises(ConfigError, match="model.position"):
        train_and_evaluate(small_config(train__steps=5, model__position="alibi"), tmp_path)


_RUN = """
import json, sys
from conftest import small_config, losses
from posattn.train import train_and_evaluate
overrides = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {{}}
config = small_config(**{overrides})
result = train_and_evaluate(config, {workdir!r}, stop_after={stop_after})
print("LOSSES", json.dumps(losses({workdir!r})))
"""


def _subprocess_losses(workdir, *, devices=1, stop_after=None, **overrides):
    out = run_python(
        _RUN.format(overrides=overrides, workdir=str(workdir), stop_after=stop_after),
        devices=devices,
    )
    return json.loads(out.split("LOSSES", 1)[1])


def test_eight_devices_and_fsdp_give_the_single_device_losses(tmp_path):
    single = losses(_train_here(tmp_path / "one"))
    data_parallel = _subprocess_losses(tmp_path / "dp", devices=8)
    fsdp = _subprocess_losses(tmp_path / "fsdp", devices=8, train__fsdp=4)
    np.testing.assert_allclose(data_parallel, single, rtol=2e-5)
    np.testing.assert_allclose(fsdp, single, rtol=2e-5)


def _train_here(workdir, **overrides):
    train_and_evaluate(small_config(**overrides), workdir)
    return workdir


def test_restore_onto_a_different_mesh(tmp_path):
    """Half a run on 8 devices (fsdp 2), the rest on 1: the losses of a 1-device run throughout."""
    single = losses(_train_here(tmp_path / "one"))
    moved = tmp_path / "moved"
    _subprocess_losses(moved, devices=8, stop_after=10, train__fsdp=2)
    train_and_evaluate(small_config(), moved)  # this process has 1 device
    np.testing.assert_allclose(losses(moved), single, rtol=2e-5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_joined_by_jax_distributed(tmp_path):
    """Two processes on localhost (CPU collectives over gloo) train to the one-process losses."""
    single = losses(_train_here(tmp_path / "one"))
    workdir = tmp_path / "two"
    port = _free_port()
    code = _RUN.format(overrides={}, workdir=str(workdir), stop_after=None)
    procs = []
    for pid in range(2):
        env = dict(
            os.environ,
            XLA_FLAGS="--xla_force_host_platform_device_count=2",
            JAX_PLATFORMS="cpu",
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(pid),
            PYTHONPATH=str(ROOT / "tests"),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-4000:]
    np.testing.assert_allclose(json.loads(outputs[0][0].split("LOSSES", 1)[1]), single, rtol=2e-5)
