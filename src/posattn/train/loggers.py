"""Where a run's metrics go besides metrics.jsonl: one list of loggers, chosen by config.

`metrics.jsonl` is always written and stays the source of truth (`workdir.MetricsFile`); each
name in `train.loggers` adds a logger that repeats every numeric value of every line:

  * `"tensorboard"`: tensorboardX event files beside metrics.jsonl (`train.tensorboard=True` is
    the same as naming it);
  * `"wandb"`: a Weights & Biases run in `WORKDIR/wandb`, in `train.wandb_mode` ("offline" by
    default: nothing leaves the machine; `wandb sync WORKDIR/wandb/offline-run-*` uploads it
    later; "online" logs live), project `train.wandb_project`, one run per workdir (a resumed run
    appends to it).

A sweep's lines carry `member`: their values are logged under `member_<k>/`. The libraries are
imported only when named, and a missing one is a ConfigError before any compute.
"""

from __future__ import annotations

import hashlib
import math
import pathlib
from typing import Any, Protocol

from posattn.nn.config import ConfigError

__all__ = ["LOGGERS", "Logger", "check", "names", "open_loggers"]

LOGGERS = ("tensorboard", "wandb")
WANDB_MODES = ("offline", "online", "disabled")
_PACKAGES = {"tensorboard": "tensorboardX", "wandb": "wandb"}


class Logger(Protocol):
    def write(self, record: dict) -> None: ...

    def close(self) -> None: ...


def names(train_config) -> tuple[str, ...]:
    """The loggers a (completed) `train` section asks for, in order, without repeats."""
    chosen = list(train_config.loggers)
    if train_config.tensorboard and "tensorboard" not in chosen:
        chosen.append("tensorboard")
    return tuple(dict.fromkeys(chosen))


def check(train_config) -> None:
    """Refuses unknown logger names, a bad W&B mode, and a named logger whose library is missing,
    naming the key and the fix."""
    for name in train_config.loggers:
        if name not in LOGGERS:
            raise ConfigError(
                f"config.train.loggers names {name!r}; allowed: {', '.join(LOGGERS)} "
                "(metrics.jsonl is always written)"
            )
    mode = train_config.wandb_mode
    if mode not in WANDB_MODES:
        raise ConfigError(f"config.train.wandb_mode={mode!r}; allowed: {', '.join(WANDB_MODES)}")
    for name in names(train_config):
        _module(name)


def _module(name: str):
    package = _PACKAGES[name]
    try:
        return __import__(package)
    except ImportError:
        key = "train.tensorboard=True" if name == "tensorboard" else f"train.loggers={name!r}"
        raise ConfigError(
            f"config.{key} writes its metrics with {package}, which is not installed; "
            f"pip install {package} or leave {name!r} out"
        ) from None


def open_loggers(train_config, workdir: pathlib.Path, config: dict[str, Any]) -> list[Logger]:
    """The loggers `train_config` names, open on `workdir` (`config`: the run's config, which W&B
    records)."""
    made = []
    for name in names(train_config):
        if name == "tensorboard":
            made.append(_TensorBoard(workdir))
        else:
            made.append(_Wandb(workdir, train_config, config))
    return made


def _numbers(record: dict) -> tuple[int, dict[str, float]]:
    """(step, {key: value}) of a metrics line: finite numbers only, under `member_<k>/` for a
    sweep member's line."""
    prefix = f"member_{record['member']}/" if "member" in record else ""
    values = {
        prefix + key: float(value)
        for key, value in record.items()
        if key not in ("step", "member")
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    }
    return int(record["step"]), values


class _TensorBoard:
    def __init__(self, workdir: pathlib.Path):
        self._writer = _module("tensorboard").SummaryWriter(logdir=str(workdir))

    def write(self, record: dict) -> None:
        step, values = _numbers(record)
        for key, value in values.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class _Wandb:
    def __init__(self, workdir: pathlib.Path, train_config, config: dict[str, Any]):
        wandb = _module("wandb")
        directory = workdir / "wandb"
        directory.mkdir(parents=True, exist_ok=True)
        # One W&B run per workdir: a resumed run appends to the run it started.
        run_id = hashlib.sha1(str(workdir.resolve()).encode()).hexdigest()[:16]
        self._run = wandb.init(
            project=train_config.wandb_project,
            dir=str(workdir),
            mode=train_config.wandb_mode,
            config=config,
            id=run_id,
            resume="allow",
            name=workdir.name,
            reinit="create_new",
        )

    def write(self, record: dict) -> None:
        step, values = _numbers(record)
        if values:
            self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()
