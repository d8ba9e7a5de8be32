"""Training on several devices: the same losses on 1 and 8 devices (data parallel and fsdp), a run
moved between meshes, and 2 processes, which stop together on SIGTERM and resume exactly."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT, losses, run_python, small_config, xla_flags

from posattn.train import train_and_evaluate

_RUN = """
import json
from conftest import small_config, losses
from posattn.train import train_and_evaluate
for workdir, overrides, stop_after in {runs!r}:
    train_and_evaluate(small_config(**overrides), workdir, stop_after=stop_after)
    print("LOSSES", json.dumps(losses(workdir)))
"""


def _subprocess_losses(*runs, devices=8) -> list[list[float]]:
    """Each (workdir, overrides, stop_after) of `runs` trained in turn in one process with
    `devices` devices: the losses of each."""
    out = run_python(_RUN.format(runs=[(str(w), o, s) for w, o, s in runs]), devices=devices)
    return [json.loads(line.split("LOSSES", 1)[1]) for line in out.splitlines() if "LOSSES" in line]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The losses of the 1-device run of small_config(), trained here."""
    workdir = tmp_path_factory.mktemp("one")
    train_and_evaluate(small_config(), workdir)
    return losses(workdir)


def test_eight_devices_and_fsdp_give_the_single_device_losses(tmp_path, single):
    data_parallel, fsdp = _subprocess_losses(
        (tmp_path / "dp", {}, None), (tmp_path / "fsdp", {"train__fsdp": 4}, None)
    )
    np.testing.assert_allclose(data_parallel, single, rtol=2e-5)
    np.testing.assert_allclose(fsdp, single, rtol=2e-5)


def _train_here(workdir, **overrides):
    train_and_evaluate(small_config(**overrides), workdir)
    return workdir


def test_restore_onto_a_different_mesh(tmp_path, single):
    """Half a run on 8 devices (fsdp 2), the rest on 1: the losses of a 1-device run throughout."""
    moved = tmp_path / "moved"
    _subprocess_losses((moved, {"train__fsdp": 2}, 10))
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
            XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=2"),
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
