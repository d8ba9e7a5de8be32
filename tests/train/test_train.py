"""Training: loss falls for every family; exact resumption; metrics, MFU and profiles; the same
losses on 1 and 8 devices and on 2 processes, which stop together on SIGTERM and resume exactly."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

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


def test_metrics_file_schema_step_time_mfu_and_profile(tmp_path):
    config = small_config(
        train__steps=10, train__eval_every=5, train__profile_steps=(3, 2), train__peak_flops=1e12
    )
    train_and_evaluate(config, tmp_path)
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
            "step_time",
            "mfu",
        } <= set(line)
        assert line["step_time"] > 0
        # tokens/s is the batch's tokens over the step time; MFU the compiled step's FLOPs over
        # the step time and the given peak (1e12 FLOP/s): positive, and below 1 on a CPU.
        assert line["tokens_per_sec"] == pytest.approx(8 * 32 / line["step_time"], rel=1e-6)
        assert 0 < line["mfu"] < 1
    assert [x["step"] for x in eval_lines] == [5, 10]
    assert all("loss" not in x and x["eval_loss"] > 0 for x in eval_lines)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model"]["position"] == "rope"
    traces = list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0


def test_mfu_is_null_where_the_peak_is_unknown_and_the_table_knows_accelerators():
    from posattn.train import loop

    on_this_cpu = loop._timing(0.5, 1000, flops=2e9, peak_flops=None)
    assert on_this_cpu == {"step_time": 0.5, "tokens_per_sec": 2000.0, "mfu": None}
    assert loop._timing(0.5, 1000, flops=2e9, peak_flops=1e10)["mfu"] == pytest.approx(0.4)
    assert loop._timing(0.5, 1000, flops=None, peak_flops=1e10)["mfu"] is None
    assert loop.device_peak_flops("cpu") is None
    assert loop.device_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert loop.device_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert loop.device_peak_flops("NVIDIA H200") == 989e12
    assert loop.device_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert loop.device_peak_flops("TPU v4") == 275e12
    assert loop.device_peak_flops("TPU v5 lite") == 197e12
    assert loop.device_peak_flops("TPU v5p") == 459e12
    assert loop.device_peak_flops("TPU v6 lite") == 918e12


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"train__profile_steps": (9, 3)}, r"train.profile_steps=\(9, 3\).*past the last step"),
        ({"train__profile_steps": (0, 2)}, r"train.profile_steps.*\(first, count\)"),
        ({"train__peak_flops": -1.0}, "train.peak_flops"),
        ({"train__fsdp": 3}, r"train.fsdp=3 must divide .*allowed: 1"),
    ],
)
def test_bad_observability_and_mesh_settings_fail_before_any_compute(tmp_path, overrides, match):
    from posattn.config import ConfigError

    with pytest.raises(ConfigError, match=match):
        train_and_evaluate(small_config(train__steps=10, **overrides), tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()


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


_PREEMPTIBLE = """
import json
from conftest import small_config, losses
from posattn.train import train_and_evaluate
config = small_config(**{overrides!r})
result = train_and_evaluate(config, {workdir!r})
print("RESULT", json.dumps({{k: result[k] for k in ("step", "preempted", "finished")}}))
print("LOSSES", json.dumps(losses({workdir!r})))
"""


def _two_processes(code: str) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for pid in range(2):
        env = dict(
            os.environ,
            XLA_FLAGS="--xla_force_host_platform_device_count=2",
            JAX_PLATFORMS="cpu",
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(pid),
            PYTHONPATH=str(ROOT / "tests") + os.pathsep + os.environ.get("PYTHONPATH", ""),
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
    return procs


def _finish(procs) -> list[str]:
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-2000:] + err[-4000:]
    return [out for out, _ in outputs]


def test_sigterm_to_one_of_two_processes_stops_both_at_one_step_and_resumes_exactly(tmp_path):
    """Two processes joined by jax.distributed (localhost, gloo); SIGTERM reaches only the second.

    Both agree to stop after the same step, save it and exit 0; the same command then resumes,
    and the whole run's losses are the uninterrupted one-process run's.
    """
    overrides = dict(train__steps=60, train__log_every=1, train__checkpoint_every=60)
    single = losses(_train_here(tmp_path / "one", **overrides))
    workdir = tmp_path / "two"
    code = _PREEMPTIBLE.format(overrides=overrides, workdir=str(workdir))
    procs = _two_processes(code)
    metrics, deadline = workdir / "metrics.jsonl", time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no steps"
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)  # not the lead process, which writes the files
    outputs = _finish(procs)
    results = [json.loads(out.split("RESULT", 1)[1].splitlines()[0]) for out in outputs]
    stopped = results[0]["step"]
    assert results[1] == results[0] == {"step": stopped, "preempted": True, "finished": False}
    assert 5 <= stopped < 60 and f"preempted (SIGTERM) at step {stopped}:" in outputs[0]
    saved = sorted(int(d.name) for d in (workdir / "checkpoints").iterdir() if d.name.isdigit())
    assert saved == [stopped]

    outputs = _finish(_two_processes(code))  # the same command resumes from `stopped`
    assert json.loads(outputs[0].split("RESULT", 1)[1].splitlines()[0])["finished"]
    resumed = json.loads(outputs[0].split("LOSSES", 1)[1])
    np.testing.assert_allclose(resumed, single, rtol=2e-5, atol=1e-6)


def test_the_schedule_evaluates_and_agrees_on_sigterm_at_the_steps_it_says():
    from posattn.train.loop import Schedule

    run = Schedule(total=20, log_every=5, checkpoint_every=8, eval_every=6)
    assert [s for s in range(1, 21) if run.evaluates(s)] == [6, 12, 18, 20]
    assert [s for s in range(1, 21) if run.agrees(s)] == [5, 8, 10, 15, 16, 20]
    sweep = Schedule(total=20, log_every=5, checkpoint_every=8, eval_at_end=True)
    assert [s for s in range(1, 21) if sweep.evaluates(s)] == [20]
    config = small_config(train__profile_steps=(3, 2), train__eval_every=4)
    assert Schedule.from_config(config.train, stop_after=7) == Schedule(
        total=20, log_every=5, checkpoint_every=10, eval_every=4, stop_after=7, profile_steps=(3, 2)
    )
