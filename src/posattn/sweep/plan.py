"""The `sweep` section of a config: which runs a sweep holds, all checked before any compute.

A sweep config is an ordinary training config (so every member can be rerun alone with
`python -m posattn.train` and the same file) plus a `sweep` section whose leaves mirror the
config's own keys:

    config.sweep.discrete.model.position = ("rope", "alibi")  # one compiled program per combination
    config.sweep.continuous.train.seed = (0, 1, 2, 3)         # stacked on the vmap axis
    config.sweep.continuous.train.learning_rate = (1e-3, 3e-3)
    config.sweep.combine = "grid"   # continuous axes: "grid" (every combination) or "zip"

or, when each program sweeps its own keys (RoPE bases for RoPE, slope scales for ALiBi), an
explicit list of programs instead of `discrete`:

    config.sweep.programs = (
        {"set": {"model.position": "rope"},
         "continuous": {"model.rope_base": (1e3, 1e4, 1e5)}},
        {"set": {"model.position": "alibi"},
         "continuous": {"model.alibi_slope_scale": (0.5, 1.0, 2.0)}},
    )

Only keys that change array values, never shapes or the traced program, may be continuous
(`CONTINUOUS`: the optimiser's injected hyperparameters and the seed, plus the `model.*` keys whose
settings field says why it may be, in `posattn.nn.config.ModelConfig` or a family's settings);
everything else (family, depth, heads, seq_len, rope_scaling, ...) is discrete. A family may make
one of its continuous keys static for some of its settings (a RoPE base under dynamic NTK).
Each member's config is built from the same `key=value` strings a single run's command line
would carry, and validated in full, before the first step of the first program.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from posattn import config as config_lib
from posattn.nn import config as nn_config

__all__ = ["CONTINUOUS", "Member", "Program", "continuous_keys", "format_override", "plan"]

# Training keys a vmap sweep may stack, and where each one lives (why it leaves the compiled
# program alone); the model's come from their settings fields (`continuous_keys`).
_TRAIN_CONTINUOUS = {
    "train.seed": "the initial parameters' PRNG key and the batches (each member gets its own)",
    "train.learning_rate": "optax.inject_hyperparams: an array in opt_state",
    "train.weight_decay": "optax.inject_hyperparams: an array in opt_state",
    "train.b1": "optax.inject_hyperparams: an array in opt_state",
    "train.b2": "optax.inject_hyperparams: an array in opt_state",
}


def continuous_keys() -> dict[str, str]:
    """Every key a vmap sweep may stack -> why it leaves the compiled program alone."""
    model = {f"model.{key}": why for key, why in nn_config.continuous_keys().items()}
    return {**_TRAIN_CONTINUOUS, **model}


CONTINUOUS = continuous_keys()  # as registered at import; the function sees later families too

_SWEEP_KEYS = {
    "discrete",
    "continuous",
    "combine",
    "programs",
    "eval_lengths",
    "eval_max_tokens",
    "eval_batch_size",
}


@dataclasses.dataclass(frozen=True)
class Member:
    """One run of a sweep.

    Attributes:
      index: its place in the whole sweep (0..M-1), the `member` of metrics lines.
      program: the index of the compiled program that trains it.
      overrides: dotted key -> value; `--config.key=value` for each reproduces it as a single run.
      config: its full, validated training config.
    """

    index: int
    program: int
    overrides: dict[str, Any]
    config: ml_collections.ConfigDict

    @property
    def cfg(self) -> config_lib.ModelConfig:
        return config_lib.model_config(self.config)

    def command(self, config_path: str | None, workdir: str = "DIR") -> str:
        """The `python -m posattn.train` command that reruns this member alone."""
        parts = ["python", "-m", "posattn.train", "--config", config_path or "CONFIG.py"]
        parts += [format_override(k, v) for k, v in self.overrides.items()]
        return shlex.join(parts + ["--workdir", workdir])


@dataclasses.dataclass(frozen=True)
class Program:
    """Members that share one compiled program (same shapes and structure).

    Attributes:
      index: 0..P-1.
      settings: the discrete choices (dotted key -> value) that define the program.
      swept: the continuous keys stacked on the vmap axis.
      members: its members, in vmap order.
    """

    index: int
    settings: dict[str, Any]
    swept: tuple[str, ...]
    members: tuple[Member, ...]


def format_override(key: str, value: Any) -> str:
    """`--config.key=value`, written so that `posattn.config` parses back exactly `value`."""
    if isinstance(value, str):
        try:
            ast.literal_eval(value)
            text = repr(value)  # "1e3" or "None" as a string must stay a string
        except (ValueError, SyntaxError):
            text = value
    else:
        text = repr(_plain(value))
    return f"--config.{key}={text}"


def _plain(value: Any) -> Any:
    if isinstance(value, (ml_collections.ConfigDict, Mapping)):
        return {k: _plain(v) for k, v in dict(value).items()}
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    return value


def _axes(node: Any, where: str, prefix: str = "") -> dict[str, tuple]:
    """Flattens a section (`model.position = (...)`) or a dotted-key mapping to key -> values."""
    if node is None:
        return {}
    if not isinstance(node, (ml_collections.ConfigDict, Mapping)):
        raise config_lib.ConfigError(
            f"config.{where} must map config keys to tuples of values, got {node!r}"
        )
    out = {}
    for key, value in dict(node).items():
        full = f"{prefix}{key}"
        if isinstance(value, (ml_collections.ConfigDict, Mapping)):
            out.update(_axes(value, where, f"{full}."))
        elif isinstance(value, (list, tuple)) and len(value) > 0:
            out[full] = tuple(value)
        else:
            raise config_lib.ConfigError(
                f"config.{where}.{full}={value!r} is invalid: must be a non-empty tuple of values, "
                f"e.g. config.{where}.{full} = ({value!r},)"
            )
    return out


def _combine(axes: dict[str, tuple], how: str, where: str) -> list[dict[str, Any]]:
    if not axes:
        return [{}]
    keys = list(axes)
    if how == "zip":
        sizes = {k: len(v) for k, v in axes.items()}
        if len(set(sizes.values())) != 1:
            raise config_lib.ConfigError(
                f"config.sweep.combine='zip' needs every {where} axis to have the same length, "
                f"got {sizes}; use combine='grid' for every combination"
            )
        return [dict(zip(keys, values, strict=True)) for values in zip(*axes.values(), strict=True)]
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*axes.values())]


def _check_continuous(
    keys: Sequence[str], settings: Mapping[str, Any], config: ml_collections.ConfigDict, where: str
) -> None:
    allowed = continuous_keys()
    for key in keys:
        if key not in allowed:
            raise config_lib.ConfigError(
                f"config.{where}.{key} cannot be swept inside one compiled program: it is not one "
                f"of the keys that only change array values ({', '.join(allowed)}); {key} may "
                "change shapes or the traced program (e.g. rope_scaling's type), so move it to "
                "config.sweep.discrete (one program per value)"
            )
    model_keys = [k.removeprefix("model.") for k in keys if k.startswith("model.")]
    if not model_keys:
        return
    # The program's family may make a key static for its settings (its members share them).
    strings = [format_override(k, v) for k, v in settings.items()]
    try:
        cfg = config_lib.model_config(config_lib.apply_overrides(config, strings))
    except config_lib.ConfigError:
        return  # the members' own validation names the problem
    static = [(k, why) for k, why in cfg.not_continuous().items() if k in model_keys]
    if static:
        key, why = static[0]
        raise config_lib.ConfigError(
            f"config.{where}.model.{key} cannot be continuous for model.position="
            f"{cfg.position!r} with these settings: {why}; sweep it in config.sweep.discrete "
            "instead (one program per value)"
        )


def _programs(config: ml_collections.ConfigDict) -> list[tuple[dict[str, Any], dict[str, tuple]]]:
    sweep = config.sweep
    explicit = tuple(sweep.get("programs", ()) or ())
    discrete = _axes(sweep.get("discrete"), "sweep.discrete")
    continuous = _axes(sweep.get("continuous"), "sweep.continuous")
    if explicit and discrete:
        raise config_lib.ConfigError(
            "config.sweep.programs and config.sweep.discrete are both set; list the programs "
            "explicitly or give the discrete grid, not both"
        )
    if not explicit:
        return [(settings, continuous) for settings in _combine(discrete, "grid", "sweep.discrete")]
    out = []
    for i, entry in enumerate(explicit):
        if not isinstance(entry, Mapping) or set(entry) - {"set", "continuous"}:
            raise config_lib.ConfigError(
                f"config.sweep.programs[{i}]={entry!r} is invalid: each program is a dict with "
                "keys 'set' ({dotted key: value}) and optionally 'continuous' "
                "({dotted key: (values...)})"
            )
        settings = dict(entry.get("set") or {})
        own = (
            _axes(entry["continuous"], f"sweep.programs[{i}].continuous")
            if "continuous" in entry
            else continuous
        )
        out.append((settings, own))
    return out


def plan(config: ml_collections.ConfigDict, *, cli_overrides: Sequence[str] = ()) -> list[Program]:
    """Expands `config.sweep` into programs and members, validating every member's config.

    Args:
      config: a training config with a `sweep` section (see the module docstring).
      cli_overrides: `--config.key=value` strings already applied to `config`; they are part of
        each member's reproducing overrides (those under `sweep.` are not).

    Returns:
      The programs, in order; member indices run across them.

    Raises:
      ConfigError: naming the key (and the member) when anything is wrong.
    """
    if "sweep" not in config:
        raise config_lib.ConfigError(
            "config has no 'sweep' section; see configs/sweep_tiny.py for the layout"
        )
    unknown = set(config.sweep.keys()) - _SWEEP_KEYS
    if unknown:
        raise config_lib.ConfigError(
            f"unknown config key config.sweep.{sorted(unknown)[0]}; known: "
            f"{', '.join(sorted(_SWEEP_KEYS))}"
        )
    combine = config.sweep.get("combine", "grid")
    if combine not in ("grid", "zip"):
        raise config_lib.ConfigError(
            f"config.sweep.combine={combine!r} is invalid: allowed 'grid', 'zip'"
        )
    base = {}
    for item in cli_overrides:
        key = item.removeprefix("--").removeprefix("config.").split("=", 1)[0]
        if not key.startswith("sweep."):
            base[key] = _get(config, key)
    programs, index = [], 0
    for p, (settings, axes) in enumerate(_programs(config)):
        where = (
            f"sweep.programs[{p}].continuous"
            if config.sweep.get("programs")
            else "sweep.continuous"
        )
        for key in list(settings) + list(axes):
            if key.startswith("sweep."):
                raise config_lib.ConfigError(f"config.sweep cannot sweep its own key {key!r}")
        _check_continuous(list(axes), settings, config, where)
        members = []
        for values in _combine(axes, combine, where):
            overrides = {**base, **settings, **values}
            members.append(Member(index, p, overrides, _member_config(config, overrides, index)))
            index += 1
        programs.append(Program(p, settings, tuple(axes), tuple(members)))
    return programs


def _get(config: ml_collections.ConfigDict, key: str) -> Any:
    node = config
    for part in key.split("."):
        node = node[part]
    return _plain(node)


def _member_config(config: ml_collections.ConfigDict, overrides: dict[str, Any], index: int):
    """The member's config, from the very strings its single-run command line would carry."""
    strings = [format_override(k, v) for k, v in overrides.items()]
    try:
        member = config_lib.apply_overrides(config, strings)
        config_lib.validate(member)
    except config_lib.ConfigError as e:
        shown = ", ".join(f"{k}={v!r}" for k, v in overrides.items()) or "no overrides"
        raise config_lib.ConfigError(f"sweep member {index} ({shown}): {e}") from None
    return member
