"""Config files and overrides: the defaults, loading `configs/*.py`, `--config.key=value`.

A config file under `configs/` is a plain Python module defining `get_config()` (or
`get_config(arg)`, called for `file.py:arg`) that returns an `ml_collections.ConfigDict` with the
sections `model`, `data` and `train` (experiments add their own). It starts from `defaults()`,
where every default is written once: the `model` keys come from `posattn.nn.config.ModelConfig`
and the family registry (each family's settings), the `data` and `train` keys from the tables
below. A config file may import its sibling files relatively (`from .tiny import get_config`):
`load_config` loads it as a member of a package whose path is the file's directory.

Any key can be overridden as `--config.a.b=value`; values are parsed as Python literals
(`--config.model.rope_scaling="{'rope_type': 'yarn', 'factor': 4.0, ...}"`), converted to the
type of the value they replace, and an override of a key the config does not define is an error
(a typo must never be silently ignored). Checking the result is `posattn.validation`'s job;
reading a command line is `posattn.cli`'s.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import importlib.util
import inspect
import json
import pathlib
import sys
import traceback
import types
from collections.abc import Sequence
from typing import Any

import ml_collections

from posattn.nn import config as nn_config
from posattn.nn.config import ConfigError, ModelConfig
from posattn.validation import model_config, validate

__all__ = [
    "ConfigError",
    "ModelConfig",
    "apply_overrides",
    "complete",
    "defaults",
    "describe",
    "load_config",
    "model_config",
    "parse_value",
    "read_config",
    "to_json",
    "validate",
]

# key -> (default, help). The `model` section's defaults live with ModelConfig and the families.
DATA: dict[str, tuple[Any, str]] = {
    "corpus": (
        "stdlib",
        "'stdlib', a text file or directory, or a directory of nanoGPT train.bin/val.bin",
    ),
    "seq_len": (128, "L, the training sequence length"),
    "mask_rate": (0.15, "encoder only: the share of input bytes masked"),
    "passkey_fraction": (
        0.0,
        "share of training rows replaced by passkey sequences (posattn.data.probes)",
    ),
    "passkey_distractors": (
        False,
        "training passkeys carry distractor numbers in their filler (the evaluation's format)",
    ),
    "passkey_digits": (
        (1, 5),
        "the shortest and longest key of a training passkey row, in digits (each row's drawn "
        "uniformly in between)",
    ),
    "induction_fraction": (
        0.0,
        "share of training rows given a random string repeated later in the row (in-context "
        "copying, as the induction probe asks; posattn.data.probes)",
    ),
    "induction_span": (
        12,
        "the longest random string of an induction row (4 to this many letters, drawn uniformly)",
    ),
    "batch_offset": (
        0,
        "training step s reads batch s + batch_offset of the stream of train.seed (a fine-tune "
        "going on past the batches of the run it starts from)",
    ),
    "probe_weight": (
        1.0,
        "loss weight of the targets the probe rows are scored on (passkey digits, the induction "
        "repeat); every other target weighs 1",
    ),
}
TRAIN: dict[str, tuple[Any, str]] = {
    "steps": (1000, "optimiser steps"),
    "batch_size": (16, "sequences per step, over all devices and hosts"),
    "learning_rate": (1e-3, "peak learning rate (AdamW)"),
    "warmup_steps": (100, "linear warmup, then cosine decay"),
    "min_lr_ratio": (0.1, "the cosine ends at min_lr_ratio * learning_rate"),
    "weight_decay": (0.1, "AdamW decay of the matrices"),
    "grad_clip": (1.0, "global gradient-norm clip"),
    "b1": (0.9, "AdamW beta1"),
    "b2": (0.95, "AdamW beta2"),
    "seed": (0, "PRNG seed of the initial parameters and the batches"),
    "checkpoint_every": (500, "steps between checkpoints"),
    "keep_checkpoints": (3, "checkpoints kept"),
    "log_every": (10, "steps between metrics lines"),
    "eval_every": (0, "steps between evaluations (0: at the end only)"),
    "eval_batches": (4, "batches per evaluation"),
    "fsdp": (1, "size of the fsdp mesh axis (1: pure data parallel)"),
    "distributed": (False, "call jax.distributed.initialize() (pods, SLURM); env vars also work"),
    "profile_steps": (
        (),
        "(first, count): a jax.profiler trace of those steps under WORKDIR/profile",
    ),
    "peak_flops": (None, "device peak FLOP/s for the MFU; None: the table of known devices"),
    "tensorboard": (
        False,
        "also write TensorBoard event files (tensorboardX) beside metrics.jsonl",
    ),
    "loggers": (
        (),
        "loggers besides metrics.jsonl (always written): 'tensorboard', 'wandb' "
        "(posattn.train.loggers)",
    ),
    "wandb_mode": ("offline", "'wandb' logger: 'offline' (nothing leaves the machine), 'online'"),
    "wandb_project": ("posattn", "'wandb' logger: the Weights & Biases project"),
}


PLUGINS_HELP = (
    "modules imported before the config is read (families registered outside posattn: "
    "docs/adding-a-family.md)"
)


def import_plugins(modules: Any) -> None:
    """Imports the modules a config's `plugins` key names, so that the families they register
    (`posattn.families.register`) exist before any `model` key is read. A workdir's config.json
    keeps the key, so every entry point (train, sweep, generate, eval, the experiment) finds the
    same families."""
    if isinstance(modules, str):
        modules = (modules,)
    if not isinstance(modules, (tuple, list)) or not all(isinstance(m, str) for m in modules):
        raise ConfigError(
            f"config.plugins={modules!r} must be a tuple of module names, e.g. "
            "--config.plugins=\"('my_families',)\""
        )
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as error:
            raise ConfigError(
                f"config.plugins names module {name!r}, which cannot be imported ({error}); "
                "put its directory on PYTHONPATH or install it"
            ) from None


def defaults() -> ml_collections.ConfigDict:
    """Every `model`, `data` and `train` key with its default: what config files start from."""
    config = ml_collections.ConfigDict()
    config.plugins = ()
    config.model = ml_collections.ConfigDict(nn_config.defaults())
    config.data = ml_collections.ConfigDict({k: v for k, (v, _) in DATA.items()})
    config.train = ml_collections.ConfigDict({k: v for k, (v, _) in TRAIN.items()})
    return config


def describe(config: ml_collections.ConfigDict) -> list[tuple[str, Any, str]]:
    """(dotted key, value, help) for every leaf of `config`, in section order."""
    helps = {f"model.{k}": h for k, h in nn_config.describe().items()}
    helps |= {f"data.{k}": h for k, (_, h) in DATA.items()}
    helps |= {f"train.{k}": h for k, (_, h) in TRAIN.items()}
    helps["plugins"] = PLUGINS_HELP
    out = []
    order = {key: i for i, key in enumerate(["model", "data", "train", *helps])}

    def walk(node, prefix):
        keys = sorted(node.keys(), key=lambda k: order.get(prefix + k, len(order)))
        for key in keys:
            value = node[key]
            if isinstance(value, ml_collections.ConfigDict) and not (
                prefix == "model." and key in nn_config.config_keys()
            ):
                walk(value, f"{prefix}{key}.")
            else:
                plain = value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value
                out.append((prefix + key, plain, helps.get(prefix + key, "")))

    walk(config, "")
    return out


# ----------------------------------------------------------------------------------------------
# Loading.


def load_config(
    path: str | pathlib.Path, overrides: Sequence[str] = ()
) -> ml_collections.ConfigDict:
    """Loads `get_config()` from a Python file and applies `--config.key=value` overrides.

    Args:
      path: a Python file defining `get_config()`; `path:arg` passes `arg` to `get_config(arg)`.
      overrides: strings `key=value` or `--config.key=value`.

    Returns:
      The config (validated: see `posattn.validation.validate`); keys the file leaves out of its
      `model`, `data` and `train` sections take their defaults.
    """
    config = read_config(path)
    config = apply_overrides(config, overrides)
    validate(config)
    return config


def read_config(path: str | pathlib.Path) -> ml_collections.ConfigDict:
    """The file's `get_config()` with the defaults filled in; no overrides, no validation."""
    path = str(path)
    arg = None
    if ":" in path and not pathlib.Path(path).exists():
        path, arg = path.split(":", 1)
    file = pathlib.Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {path!r} does not exist (expected e.g. configs/tiny.py)")
    try:
        module = _import_file(file)
        if not hasattr(module, "get_config"):
            raise ConfigError(f"config file {path!r} defines no get_config()")
        try:
            inspect.signature(module.get_config).bind(*(() if arg is None else (arg,)))
        except TypeError:
            given = "no argument" if arg is None else f"the argument {arg!r} ({path}:{arg})"
            raise ConfigError(
                f"config file {path!r}: get_config{inspect.signature(module.get_config)} cannot "
                f"be called with {given}"
            ) from None
        config = module.get_config(arg) if arg is not None else module.get_config()
    except ConfigError:
        raise
    except SyntaxError as e:
        raise ConfigError(
            f"config file {e.filename or path}, line {e.lineno}: syntax error: {e.msg}"
        ) from None
    except Exception as e:  # the file's own code failed: say where, in one line
        names = {str(file), str(file.resolve()), str(file.absolute())}
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename in names]
        where = f", line {frames[-1].lineno}" if frames else ""
        raise ConfigError(f"config file {path}{where}: {type(e).__name__}: {e}") from None
    if not isinstance(config, (ml_collections.ConfigDict, dict)):
        raise ConfigError(
            f"config file {path!r}: get_config() returned {type(config).__name__}, not an "
            "ml_collections.ConfigDict"
        )
    return complete(ml_collections.ConfigDict(config) if isinstance(config, dict) else config)


def _import_file(file: pathlib.Path) -> types.ModuleType:
    """Executes `file` as a member of a package whose path is its directory (so that relative
    imports of sibling config files work); the package is named after the directory."""
    directory = file.resolve().parent
    package = "posattn_configs_" + hashlib.sha1(str(directory).encode()).hexdigest()[:12]
    if package not in sys.modules:
        module = types.ModuleType(package, f"config files in {directory}")
        module.__path__ = [str(directory)]
        sys.modules[package] = module
    name = f"{package}.{file.stem}"
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a fresh execution each load; siblings import this one
    spec.loader.exec_module(module)
    return module


def complete(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy of `config` whose `model`, `data` and `train` sections hold every key: those the
    config leaves out take their defaults."""
    out = ml_collections.ConfigDict(config.to_dict())
    import_plugins(out.get("plugins", ()))
    base = defaults()
    if "plugins" not in out:
        out.plugins = ()
    for section in ("model", "data", "train"):
        if section in out and isinstance(out[section], ml_collections.ConfigDict):
            for key, value in base[section].items():
                if key not in out[section]:
                    out[section][key] = value.to_dict() if hasattr(value, "to_dict") else value
    return out


def parse_value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare string such as alibi or /path/to/corpus


def apply_overrides(
    config: ml_collections.ConfigDict, overrides: Sequence[str]
) -> ml_collections.ConfigDict:
    """Returns a copy of `config` with `key=value` overrides applied, refusing unknown keys.

    A `plugins=...` override is applied first and its modules imported, so that the other
    overrides may set the keys of the families they register.
    """
    config = ml_collections.ConfigDict(config.to_dict())
    plugins = [x for x in overrides if _override_key(x) == "plugins"]
    if plugins:
        config = complete(_apply(config, plugins))
        overrides = [x for x in overrides if _override_key(x) != "plugins"]
    return _apply(config, overrides)


def _override_key(item: str) -> str:
    return item.removeprefix("--").removeprefix("config.").split("=", 1)[0]


def _apply(
    config: ml_collections.ConfigDict, overrides: Sequence[str]
) -> ml_collections.ConfigDict:
    for item in overrides:
        item = item.removeprefix("--").removeprefix("config.")
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form --config.key=value")
        key, text = item.split("=", 1)
        value = parse_value(text)
        parts = key.split(".")
        node = config
        for depth, part in enumerate(parts):
            known = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
            if part not in known:
                where = ".".join(parts[:depth]) or "the config"
                close = difflib.get_close_matches(part, known, n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise ConfigError(
                    f"unknown config key {key!r}: {where} has no {part!r} "
                    f"(known: {', '.join(sorted(known))}){hint}"
                )
            if depth < len(parts) - 1:
                node = node[part]
        old = node[parts[-1]]
        node[parts[-1]] = _coerce(key, old, value)
    return config


def _coerce(key: str, old: Any, value: Any) -> Any:
    """Converts an override to the type of the value it replaces, or explains why it cannot."""
    if old is None or value is None:
        return value
    if isinstance(old, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif isinstance(old, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif isinstance(old, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(old, str):
        return str(value)
    elif isinstance(old, (tuple, list)):
        if isinstance(value, (tuple, list)):
            return tuple(value)
        if isinstance(value, str):
            return (value,)
    elif isinstance(old, (dict, ml_collections.ConfigDict)):
        if isinstance(value, dict):
            return value
    else:
        return value
    raise ConfigError(
        f"config key {key!r} expects a {type(old).__name__} (like {old!r}), got {value!r}"
    )


def to_json(config: ml_collections.ConfigDict) -> str:
    return json.dumps(config.to_dict(), indent=2, sort_keys=True, default=str)
