"""What a run keeps in its workdir, shared by `posattn.train` and `posattn.sweep`.

An exclusive lock (two processes never interleave checkpoints), `config.json` (a resumed run must
use the same config, up to `RESUMABLE_CHANGES`), `metrics.jsonl` (trimmed on resume to the steps
the restored state has seen), the SIGTERM flag, and the progress bar.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import pathlib
import signal
import sys
from typing import Any

import ml_collections

from posattn import config as config_lib

__all__ = [
    "MetricsFile",
    "RESUMABLE_CHANGES",
    "WorkdirBusyError",
    "lock",
    "preemption_flag",
    "progress_bar",
    "require_tensorboard",
    "say",
    "write_or_check_config",
]

# Keys that may differ when a workdir is resumed (they do not change what was computed so far).
RESUMABLE_CHANGES = {
    "train.steps",
    "train.checkpoint_every",
    "train.log_every",
    "train.eval_every",
    "train.keep_checkpoints",
    "train.fsdp",
    "train.distributed",
    "train.profile_steps",
    "train.peak_flops",
    "train.tensorboard",
    "model.remat",  # recomputation in the backward pass: the same numbers, less memory
}


class WorkdirBusyError(RuntimeError):
    """Another process is already training in this workdir."""


class MetricsFile:
    """metrics.jsonl, trimmed on resume to the lines of steps the restored state has seen.

    With `tensorboard=True` every numeric value of a line is also written as a TensorBoard scalar
    (tensorboardX event files beside metrics.jsonl; a sweep's lines under `member_<k>/`); the
    JSON lines stay the source of truth (a resumed run's event files repeat the steps after the
    restored checkpoint, its metrics.jsonl does not). `enabled=False` (every process but the
    first) writes nothing. A context manager that closes the files.
    """

    def __init__(
        self,
        path: pathlib.Path,
        *,
        keep_through: int,
        tensorboard: bool = False,
        enabled: bool = True,
    ):
        self._file = self._events = None
        if not enabled:
            return
        lines = []
        if path.exists():
            for text in path.read_text().splitlines():
                try:
                    if json.loads(text).get("step", 0) <= keep_through:
                        lines.append(text)
                except json.JSONDecodeError:
                    pass  # a line cut by a kill mid-write
        path.write_text("".join(line + "\n" for line in lines))
        self._file = path.open("a")
        if tensorboard:
            self._events = require_tensorboard().SummaryWriter(logdir=str(path.parent))

    def write(self, record: dict) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._events is not None:
            step = int(record["step"])
            prefix = f"member_{record['member']}/" if "member" in record else ""
            for key, value in record.items():
                if key in ("step", "member") or isinstance(value, bool):
                    continue
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._events.add_scalar(prefix + key, value, step)

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()
        if self._events is not None:
            self._events.close()
            self._events = None

    def __enter__(self) -> MetricsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def require_tensorboard():
    """The tensorboardX module (`train.tensorboard=True`), or a ConfigError saying how to get it."""
    try:
        import tensorboardX
    except ImportError:
        raise config_lib.ConfigError(
            "config.train.tensorboard=True writes TensorBoard event files with tensorboardX, which "
            "is not installed; pip install tensorboardX (see requirements.txt) or set it to False"
        ) from None
    return tensorboardX


def progress_bar(lead: bool, total: int, start: int, name: str):
    """A tqdm bar on the lead process when stderr is a terminal (or POSATTN_PROGRESS is set)."""
    if not lead:
        return None
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        initial=start,
        desc=f"train {name}",
        unit="step",
        dynamic_ncols=True,
        disable=not sys.stderr.isatty() and not os.environ.get("POSATTN_PROGRESS"),
    )


def say(lead: bool, message: str) -> None:
    if lead:
        print(f"posattn: {message}", flush=True)


@contextlib.contextmanager
def preemption_flag():
    """SIGTERM sets a flag the loop checks after each step (it then saves and exits cleanly).

    The flag is this process's; the loop agrees on it with the other processes
    (`posattn.train.sharding.any_process`) so that every process stops after the same step.
    """
    received = []
    previous = None

    def handler(signum, frame):
        received.append(signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        previous = None
    try:
        yield lambda: bool(received)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def lock(workdir: pathlib.Path):
    """An exclusive lock on the workdir, so two runs never interleave their checkpoints."""
    path = workdir / ".lock"
    handle = path.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "unknown"
        handle.close()
        raise WorkdirBusyError(
            f"another process (pid {owner}) is already training in {workdir}; wait for it to "
            "finish or use another --workdir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    try:
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and not (prefix.endswith("model.") and k == "rope_scaling"):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def write_or_check_config(workdir: pathlib.Path, config: ml_collections.ConfigDict) -> None:
    """Writes config.json, or refuses to resume a workdir that was started with another config."""
    path = workdir / "config.json"
    current = json.loads(config_lib.to_json(config))
    if path.exists():
        before = json.loads(path.read_text())
        old, new = _flatten(before), _flatten(current)
        # A model key added since the run started had its default then.
        defaults = {  # as config.json writes them (a tuple default reads back as a list)
            f"model.{f.name}": json.loads(json.dumps(f.default, default=str))
            for f in dataclasses.fields(config_lib.ModelConfig)
        }
        old.update({k: defaults[k] for k in new if k in defaults and k not in old})
        changed = sorted(
            k
            for k in set(old) | set(new)
            if old.get(k) != new.get(k) and k not in RESUMABLE_CHANGES
        )
        if "model.scan_layers" in changed:  # the checkpoints' parameter layout differs
            was = old.get("model.scan_layers", False)
            raise config_lib.ConfigError(
                f"{workdir}'s checkpoints hold parameters in the model.scan_layers={was} layout; "
                f"resume with --config.model.scan_layers={was} (posattn.nn.model.convert_layout "
                "converts a restored state to the other layout, for a new --workdir)"
            )
        if changed:
            detail = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed[:5])
            raise config_lib.ConfigError(
                f"{workdir} holds a run with a different config ({detail}); resume it with the "
                "same config or use a new --workdir"
            )
    path.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n")
