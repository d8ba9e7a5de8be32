"""What a run keeps in its workdir, shared by `posattn.train` and `posattn.sweep`.

An exclusive lock (two processes never interleave checkpoints), `config.json` (a resumed run must
use the same config, up to `RESUMABLE_CHANGES`), `metrics.jsonl` (trimmed on resume to the steps
the restored state has seen), the SIGTERM/SIGINT flag, and the progress bar. Every file a run
rewrites is written whole to a temporary file beside it and renamed over it (`atomic_write_text`),
so a kill at any moment leaves the old file or the new one, never a truncated one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import pathlib
import signal
import sys
from collections.abc import Sequence
from typing import Any

import ml_collections

from posattn import config as config_lib

__all__ = [
    "MetricsFile",
    "atomic_write_text",
    "check_config",
    "config_differences",
    "RESUMABLE_CHANGES",
    "WorkdirBusyError",
    "WorkdirError",
    "lock",
    "make_workdir",
    "preemption_flag",
    "progress_bar",
    "say",
    "write_config",
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
    "train.loggers",
    "train.wandb_mode",
    "train.wandb_project",
    "model.remat",  # recomputation in the backward pass: the same numbers, less memory
}


_log = logging.getLogger(__name__)


class WorkdirBusyError(RuntimeError):
    """Another process is already training in this workdir."""


def atomic_write_text(path: pathlib.Path, text: str) -> None:
    """Replaces `path` with `text` atomically: a temporary file in the same directory, flushed to
    disk, then renamed over `path` (a kill leaves the old content or the new, never a mix)."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


class MetricsFile:
    """metrics.jsonl, trimmed on resume to the lines of steps the restored state has seen.

    Every line also goes to `loggers` (`posattn.train.loggers`: TensorBoard, Weights & Biases),
    which repeat its numeric values; the JSON lines stay the source of truth (a resumed run's
    loggers may repeat the steps after the restored checkpoint, its metrics.jsonl does not).
    `enabled=False` (every process but the first) writes nothing. A context manager that closes
    the files and the loggers.
    """

    def __init__(
        self,
        path: pathlib.Path,
        *,
        keep_through: int,
        loggers: Sequence = (),
        enabled: bool = True,
        expect_through: bool = True,
    ):
        """`keep_through`: the restored step (0 for a fresh run); lines of later steps are cut
        (the atomic rewrite happens only when a line is cut). With `expect_through` (a resumed
        run), a file whose lines end before `keep_through` is reported with the missing steps,
        as is any unreadable line but a last one cut by a kill."""
        self._file = None
        self._loggers = list(loggers)
        self.missing: tuple[int, int] | None = None  # (first, last) step with no line, if any
        if not enabled:
            return
        lines, dropped, last_step = [], [], 0
        texts = path.read_text().splitlines() if path.exists() else []
        for i, text in enumerate(texts):
            try:
                step = json.loads(text).get("step", 0)
            except json.JSONDecodeError:
                if i < len(texts) - 1:  # a last line cut by a kill mid-write is expected
                    dropped.append(i + 1)
                continue
            if step <= keep_through:
                lines.append(text)
                last_step = max(last_step, step)
        if len(lines) != len(texts):
            atomic_write_text(path, "".join(line + "\n" for line in lines))
        if dropped:
            _log.warning(
                "%s: %d unreadable lines dropped (line %s%s)",
                path,
                len(dropped),
                ", ".join(map(str, dropped[:5])),
                ", ..." if len(dropped) > 5 else "",
            )
        if expect_through and keep_through > 0 and last_step < keep_through:
            self.missing = (last_step + 1, keep_through)
            _log.warning(
                "%s ends at step %d but the run resumes from step %d: steps %d..%d have no "
                "metrics lines (the file was lost or cut); the lines from step %d on are written "
                "as usual",
                path,
                last_step,
                keep_through,
                last_step + 1,
                keep_through,
                keep_through + 1,
            )
        self._file = path.open("a")

    def write(self, record: dict) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for logger in self._loggers:
            logger.write(record)

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()
        for logger in self._loggers:
            logger.close()
        self._loggers = []

    def __enter__(self) -> MetricsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
    """SIGTERM or SIGINT (Ctrl-C) sets a flag the loop checks after each step (it then saves and
    exits cleanly); a second SIGINT raises KeyboardInterrupt at once (nothing more is saved).

    The flag is this process's; the loop agrees on it with the other processes
    (`posattn.train.sharding.any_process`) so that every process stops after the same step.
    `flag()` is truthy once a signal came; `flag.name` names the first (`"SIGTERM"`).
    """
    received: list[int] = []

    def handler(signum, frame):
        if signum == signal.SIGINT and received:
            raise KeyboardInterrupt
        received.append(signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave signals alone
            pass

    class Flag:
        def __call__(self) -> bool:
            return bool(received)

        @property
        def name(self) -> str:
            return signal.Signals(received[0]).name if received else ""

    try:
        yield Flag()
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class WorkdirError(config_lib.ConfigError):
    """A --workdir that cannot hold a run (a file, an unwritable or read-only directory)."""


def make_workdir(workdir: pathlib.Path) -> None:
    """Creates `workdir` (and its parents), or says in one sentence why it cannot be used."""
    if workdir.exists() and not workdir.is_dir():
        raise WorkdirError(f"--workdir {workdir} is a file, not a directory; use another --workdir")
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WorkdirError(
            f"--workdir {workdir} cannot be created ({e.strerror or e}); use another --workdir"
        ) from None


@contextlib.contextmanager
def lock(workdir: pathlib.Path):
    """An exclusive lock on the workdir, so two runs never interleave their checkpoints."""
    path = workdir / ".lock"
    try:
        handle = path.open("a+")
    except OSError as e:
        raise WorkdirError(
            f"--workdir {workdir} is not writable ({e.strerror or e}); use another --workdir"
        ) from None
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


def _normalised(config: ml_collections.ConfigDict | dict) -> dict:
    if isinstance(config, ml_collections.ConfigDict):
        return json.loads(config_lib.to_json(config))
    return json.loads(json.dumps(config, default=str))


def config_differences(
    before: ml_collections.ConfigDict | dict, now: ml_collections.ConfigDict
) -> list[tuple[str, Any, Any]]:
    """`(key, before, now)` for every key that changes what a run computes (not in
    `RESUMABLE_CHANGES`). A key `before` lacks (added to the library since: a model, family,
    data or train key, or `plugins`) had its default then."""
    old, new = _flatten(_normalised(before)), _flatten(_normalised(now))
    defaults = _flatten(_normalised(config_lib.defaults()))  # as JSON holds them (tuples as lists)
    old.update({k: defaults[k] for k in new if k in defaults and k not in old})
    return [
        (k, old.get(k), new.get(k))
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k) and k not in RESUMABLE_CHANGES
    ]


def _refuse_differences(workdir: pathlib.Path, differences, source: str) -> None:
    changed = [k for k, _, _ in differences]
    if "model.scan_layers" in changed:  # the checkpoints' parameter layout differs
        was = next(old for k, old, _ in differences if k == "model.scan_layers") or False
        raise config_lib.ConfigError(
            f"{workdir}'s checkpoints hold parameters in the model.scan_layers={was} layout; "
            f"resume with --config.model.scan_layers={was} (posattn.nn.model.convert_layout "
            "converts a restored state to the other layout, for a new --workdir)"
        )
    if differences:
        detail = ", ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in differences[:5])
        more = f" and {len(differences) - 5} more" if len(differences) > 5 else ""
        raise config_lib.ConfigError(
            f"{workdir} holds a run with a different config ({source}: {detail}{more}); resume "
            "it with the same config or use a new --workdir"
        )


def check_config(
    workdir: pathlib.Path, config: ml_collections.ConfigDict, *, saved: dict | None = None
) -> None:
    """Refuses (ConfigError, naming the keys) to resume `workdir` with a config that computes
    something else than the run's: `saved` (the config a checkpoint was trained with) when
    given, else `config.json`. A damaged config.json is a ConfigError too."""
    if saved is not None:
        _refuse_differences(
            workdir, config_differences(saved, config), "as saved in its checkpoints"
        )
        return
    path = workdir / "config.json"
    if not path.exists():
        return
    before = _json_object(
        path,
        "the checkpoints keep the config they were trained with and a resume is checked against "
        f"it: move the file away (mv {path} {path}.bad) and rerun the same command",
    )
    _refuse_differences(workdir, config_differences(before, config), "config.json")


def read_config(workdir: pathlib.Path) -> ml_collections.ConfigDict:
    """The config a run in `workdir` was trained with (its `config.json`), for a reader such as
    generation or evaluation: completed with the keys added since (their defaults) and with its
    `plugins` imported, so a family a plugin registers is known again. A missing or damaged file
    is a ConfigError that says so."""
    path = pathlib.Path(workdir) / "config.json"
    if not path.is_file():
        raise config_lib.ConfigError(
            f"{workdir} has no config.json: is it a workdir written by python -m posattn.train?"
        )
    return config_lib.complete(ml_collections.ConfigDict(_json_object(path)))


def _json_object(path: pathlib.Path, advice: str = "") -> dict:
    """The JSON object in `path`, or a ConfigError saying the file is damaged (and `advice`)."""
    try:
        value = json.loads(path.read_text())
        if not isinstance(value, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise config_lib.ConfigError(
            f"{path} is damaged ({e})" + (f"; {advice}" if advice else "")
        ) from None
    return value


def write_config(workdir: pathlib.Path, config: ml_collections.ConfigDict) -> None:
    """Writes `config.json` (atomically)."""
    current = _normalised(config)
    atomic_write_text(workdir / "config.json", json.dumps(current, indent=2, sort_keys=True) + "\n")


def write_or_check_config(workdir: pathlib.Path, config: ml_collections.ConfigDict) -> None:
    """Writes config.json, or refuses to resume a workdir that was started with another config."""
    check_config(workdir, config)
    write_config(workdir, config)
