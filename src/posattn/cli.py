"""The one command-line parser of every entry point (`python -m posattn.train`, `posattn.sweep`,
`posattn.generate`, `experiments/length_extrapolation.py`).

A command line is `--name value` or `--name=value` flags (a boolean flag stands alone:
`--no_cache`), plus, for commands that take a config, `--config FILE[:arg]` and any number of
`--config.<key>=<value>` overrides (see `posattn.config`). `--help` prints the usage, the flags and
every config key with its default, and exits. A bad command line is a `UsageError` (a
`ConfigError`: the entry points report it and exit with status 2), never a traceback.

    COMMAND = cli.Command("python -m posattn.train", "Trains a model.", flags=(cli.WORKDIR,))
    args = cli.parse(COMMAND, argv)   # args.config (validated), args.workdir, args.overrides
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import pathlib
import re
import sys
import textwrap
import types
from collections.abc import Callable, Sequence
from typing import Any

from posattn import config as config_lib
from posattn.nn.config import ConfigError

__all__ = [
    "REQUIRED",
    "SWEEP",
    "TRAIN",
    "WORKDIR",
    "Command",
    "Flag",
    "UsageError",
    "parse",
    "report_errors",
]

REQUIRED = object()  # the default of a flag that must be given


class UsageError(ConfigError):
    """A command line the command does not accept; the message shows the usage."""


@dataclasses.dataclass(frozen=True)
class Flag:
    """A `--name value` flag.

    Attributes:
      name: the flag without dashes (`max_new_tokens`; `--max-new-tokens` is accepted too).
      help: one line for `--help`.
      default: its value when not given; `REQUIRED` when it must be given.
      type: converts the text (`int`, `float`, `str`); `bool` makes a switch that takes no value.
      choices: the allowed values, if limited.
      metavar: how `--help` names its value.
    """

    name: str
    help: str
    default: Any = REQUIRED
    type: Callable[[str], Any] = str
    choices: tuple = ()
    metavar: str = "VALUE"


WORKDIR = Flag(
    "workdir",
    "where config.json, metrics.jsonl and checkpoints/ live; an existing run resumes",
    metavar="DIR",
)
_HELP = Flag("help", "print this message and exit", False, bool)
_DEBUG = Flag("debug", "show the traceback of an error instead of a one-line message", False, bool)


@dataclasses.dataclass(frozen=True)
class Command:
    """An entry point's command line.

    Attributes:
      prog: how it is invoked (`python -m posattn.train`).
      description: what it does (one paragraph).
      flags: its flags besides `--config`, `--config.<key>` and `--help`.
      takes_config: whether it reads a config file and `--config.<key>=<value>` overrides.
      default_config: the config file used without `--config` (None: `--config` is required).
    """

    prog: str
    description: str
    flags: tuple[Flag, ...] = (WORKDIR,)
    takes_config: bool = True
    default_config: str | pathlib.Path | None = None

    def usage(self) -> str:
        parts = [self.prog]
        if self.takes_config:
            config = "--config configs/<name>.py"
            parts.append(f"[{config}]" if self.default_config else config)
        for flag in self.flags:
            shown = f"--{flag.name}" + ("" if flag.type is bool else f" {flag.metavar}")
            parts.append(shown if flag.default is REQUIRED else f"[{shown}]")
        if self.takes_config:
            parts.append("[--config.<key>=<value> ...]")
        return "usage: " + " ".join(parts)


TRAIN = Command(
    "python -m posattn.train",
    "Trains (or resumes) the language model a config file describes, in a workdir: "
    "config.json, metrics.jsonl (one JSON line per log step) and orbax checkpoints.",
)
SWEEP = Command(
    "python -m posattn.sweep",
    "Trains every member of the config's `sweep` section: one compiled program per discrete "
    "choice, the continuous values stacked on one vmap axis; writes sweep.json and sweep.md.",
)


# The eval-time RoPE remap flag of `python -m posattn.eval` and `python -m posattn.generate`.
ROPE_REMAP = Flag(
    "rope_remap",
    "read a RoPE model under an eval-time remap (ReRoPE, SelfExtend: docs/rope.md), a dict such "
    "as \"{'type': 'self_extend', 'window': 1024, 'group': 8}\" (default: none)",
    "",
    metavar="DICT",
)


def rope_remap(text: str) -> dict | None:
    """The value of --rope_remap, checked (`rotary.validate_rope_remap`), or None when empty;
    UsageError naming the flag otherwise."""
    import ast

    from posattn import rotary

    if not text:
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = None
    if not isinstance(value, dict):
        raise UsageError(
            f"--rope_remap={text!r} is not a Python dict literal, e.g. "
            "\"{'type': 'rerope', 'window': 512}\""
        )
    try:
        return rotary.validate_rope_remap(value)
    except ValueError as e:
        raise UsageError(f"--rope_remap: {e}") from None


def with_rope_remap(cfg, remap: dict | None, source: str):
    """`cfg` (a ModelConfig) read under `remap` (None: itself), its attention "auto" (the
    implementations that score two pairs); UsageError when it is not a RoPE model."""
    if remap is None:
        return cfg
    if not cfg.family.rotary:
        raise UsageError(
            f"--rope_remap needs a RoPE model; {source} has model.position={cfg.position!r}"
        )
    return cfg.replace(rope_remap=remap, attention_impl="auto").validate()


def parse(command: Command, argv: Sequence[str] | None = None) -> types.SimpleNamespace:
    """Reads a command line; prints the help and exits (status 0) on `--help`.

    Returns:
      A namespace with one attribute per flag and, for commands that take a config,
      `config` (loaded, overridden and validated), `config_path` and `overrides` (the
      `--config.key=value` strings, as given).

    Raises:
      UsageError: an unknown flag, a missing one, or a value of the wrong type.
      ConfigError: the config file or an override is invalid.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = {flag.name: flag for flag in (*command.flags, _HELP, _DEBUG)}
    path, overrides, values = None, [], {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            values["help"] = True
        elif command.takes_config and arg.startswith("--config."):
            if "=" not in arg:
                if i + 1 >= len(argv):
                    raise _usage(command, f"{arg} needs a value: {arg}=<value>")
                arg, i = f"{arg}={argv[i + 1]}", i + 1
            overrides.append(arg)
        elif arg.startswith("--"):
            name, has_value, value = arg[2:].partition("=")
            name = name.replace("-", "_")
            if command.takes_config and name == "config":
                flag = Flag("config", "", metavar="FILE")
            elif name in flags:
                flag = flags[name]
            else:
                raise _usage(command, f"unknown flag --{name}")
            if flag.type is bool and not has_value:
                value = "true"
            elif not has_value:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise _usage(command, f"--{name} needs a value ({flag.metavar})")
                value, i = argv[i + 1], i + 1
            if name == "config":
                path = value
            else:
                values[name] = _convert(command, flag, value)
        else:
            raise _usage(command, f"unexpected argument {arg!r}; flags look like --name value")
        i += 1
    if values.pop("help", False):
        print(help_text(command, path, overrides))
        raise SystemExit(0)
    values.setdefault("debug", False)
    for flag in command.flags:
        if flag.name not in values:
            if flag.default is REQUIRED:
                raise _usage(command, f"--{flag.name} is required")
            values[flag.name] = flag.default
    if command.takes_config:
        path = path or command.default_config
        if path is None:
            raise _usage(command, "--config is required")
        values["config"] = config_lib.load_config(path, overrides)
        values["config_path"], values["overrides"] = str(path), overrides
    return types.SimpleNamespace(**values)


def report_errors(
    prog: str,
    argv: Sequence[str],
    body: Callable[[], int],
    *,
    user_errors: tuple[type[BaseException], ...] = (),
    run_errors: tuple[type[BaseException], ...] = (),
) -> int:
    """Runs an entry point's `body`, turning the errors a user can act on into one line on stderr.

    Exit status 2: a bad command line, config, workdir or corpus (`ConfigError` and
    `user_errors`), or an input file posattn found missing (its `FileNotFoundError` with our own
    message); 1: the run cannot go on (`run_errors`, a file system error such as a full
    disk or a read-only directory, Ctrl-C before training started). Anything else is a bug and
    keeps its traceback; `--debug` on the command line shows the traceback of every error.
    """
    debug = "--debug" in argv
    quiet = _QuietDiskFull()
    # orbax's and asyncio's threads log a traceback per array for a full disk; we say it once.
    # (A filter on the handlers sees the records propagated from every logger.)
    filtered = [logging.getLogger("absl"), *logging.getLogger().handlers]
    for target in filtered if not debug else []:
        target.addFilter(quiet)
    try:
        return body()
    except BaseException as e:
        if debug or isinstance(e, SystemExit):
            raise
        status, message = _classify(e, user_errors, run_errors)
        if status is None:
            raise
        print(f"{prog}: error: {message}", file=sys.stderr)
        return status
    finally:
        for target in filtered:
            target.removeFilter(quiet)


class _QuietDiskFull(logging.Filter):
    """Drops log records about a full disk (the entry point reports it in one line), and once
    one was seen, those of the aborted writes' event loops."""

    def __init__(self):
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += str(record.exc_info[1])
        self.seen = self.seen or _NO_SPACE in text
        return not (_NO_SPACE in text or (self.seen and "Event loop is closed" in text))


_NO_SPACE = "No space left on device"


def _classify(e: BaseException, user_errors, run_errors) -> tuple[int | None, str]:
    if isinstance(e, (ConfigError, *user_errors)):
        return 2, str(e)
    if isinstance(e, run_errors):
        return 1, str(e)
    if isinstance(e, KeyboardInterrupt):
        return 1, "interrupted (Ctrl-C) before a checkpoint could be saved; nothing new was kept"
    full = _no_space(e)
    if full is not None:
        return 1, full
    if isinstance(e, FileNotFoundError) and not e.strerror and e.args:
        return 2, str(e)  # a missing input, in our own words (not the OS's): the user's to fix
    if isinstance(e, OSError) and e.strerror:
        where = f": {e.filename}" if e.filename else ""
        return 1, f"{e.strerror}{where} (rerun with --debug for the traceback)"
    return None, ""


def _no_space(e: BaseException) -> str | None:
    """The one line for a full disk, whoever raised it (orbax and tensorstore wrap the OSError)."""
    seen, cause = set(), e
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if (isinstance(cause, OSError) and cause.errno == errno.ENOSPC) or _NO_SPACE in str(cause):
            where = getattr(cause, "filename", None)
            if where is None:  # tensorstore: ... Failed writing: "<path>": ...
                found = re.search(r'Failed writing: "([^"]+)"', str(cause))
                where = found and found.group(1)
            return (
                "no space left on device"
                + (f" writing {where}" if where else "")
                + "; free some space (or move the workdir) and rerun the same command: it "
                "resumes from the last complete checkpoint"
            )
        cause = cause.__cause__ or cause.__context__
    return None


def _usage(command: Command, problem: str) -> UsageError:
    what = "the flags and config keys" if command.takes_config else "the flags"
    return UsageError(f"{problem}\n{command.usage()}\n(--help lists {what})")


def _convert(command: Command, flag: Flag, text: str) -> Any:
    if flag.type is bool:
        if text.lower() not in ("true", "false"):
            raise _usage(command, f"--{flag.name}={text!r}: expected true or false")
        return text.lower() == "true"
    try:
        value = flag.type(text)
    except ValueError:
        kind = getattr(flag.type, "__name__", "value")
        raise _usage(command, f"--{flag.name}={text!r} is not a valid {kind}") from None
    if flag.choices and value not in flag.choices:
        allowed = ", ".join(map(repr, flag.choices))
        raise _usage(command, f"--{flag.name}={value!r} is not allowed; allowed: {allowed}")
    return value


def help_text(command: Command, path: str | None = None, overrides: Sequence[str] = ()) -> str:
    """The `--help` message: usage, description, flags, then every config key with its value."""
    lines = [command.usage(), "", *textwrap.wrap(command.description, _WIDTH), "", "flags:"]
    rows = []
    if command.takes_config:
        where = f"default {command.default_config}" if command.default_config else "required"
        rows.append(("--config FILE[:arg]", f"a config file defining get_config() ({where})"))
    for flag in (*command.flags, _HELP, _DEBUG):
        name = f"--{flag.name}" + ("" if flag.type is bool else f" {flag.metavar}")
        extra = []
        if flag.choices:
            extra.append("one of " + ", ".join(map(str, flag.choices)))
        if flag.default is REQUIRED:
            extra.append("required")
        elif flag.type is not bool:
            extra.append(f"default {flag.default!r}")
        rows.append((name, flag.help + (f" ({'; '.join(extra)})" if extra else "")))
    width = max(len(name) for name, _ in rows)
    for name, text in rows:
        lines += _columns(name, text, width)
    if command.takes_config:
        source = path or command.default_config
        try:
            if source is None:
                config, shown = config_lib.defaults(), "the library defaults"
            else:
                config = config_lib.apply_overrides(config_lib.read_config(source), overrides)
                shown = str(source) + (" with the overrides given" if overrides else "")
        except ConfigError as e:
            config, shown = config_lib.defaults(), f"the library defaults ({e})"
        lines += ["", f"config keys, override with --config.<key>=<value> (values of {shown}):"]
        entries = [(f"{key} = {value!r}", text) for key, value, text in config_lib.describe(config)]
        width = min(max(len(left) for left, _ in entries), 40)
        for left, text in entries:
            lines += _columns(left, text, width)
    return "\n".join(lines)


_WIDTH = 100


def _columns(left: str, text: str, width: int) -> list[str]:
    """`left` in a column of `width`, `text` wrapped beside it (below it if `left` is wider)."""
    wrapped = textwrap.wrap(text, _WIDTH - width - 4) or [""]
    if len(left) > width:
        return [f"  {left}"] + [f"  {'':<{width}}  {line}" for line in wrapped if line]
    first = f"  {left:<{width}}  {wrapped[0]}".rstrip()
    return [first] + [f"  {'':<{width}}  {line}" for line in wrapped[1:]]
