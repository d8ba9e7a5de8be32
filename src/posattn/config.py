"""Configuration: Python config files, command-line overrides, validation before any compute.

A config file under `configs/` defines `get_config()` returning an `ml_collections.ConfigDict`
with the sections `model`, `data` and `train` (experiments add their own). Any key can be
overridden on the command line as `--config.a.b=value`; values are parsed as Python literals
(`--config.model.rope_scaling="{'rope_type': 'yarn', 'factor': 4.0, ...}"`), and an override of
a key the config does not define is an error (a typo must never be silently ignored).

`validate(config)` checks every setting and raises `ConfigError` naming the key, the value and
what is allowed. Library code never sees the ConfigDict: `model_config(config)` turns the `model`
section into the frozen `ModelConfig` dataclass the modules take.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import json
import math
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from posattn import families, rotary
from posattn.attention import IMPLEMENTATIONS

__all__ = [
    "ConfigError",
    "ModelConfig",
    "apply_overrides",
    "config_and_workdir",
    "load_config",
    "model_config",
    "parse_args",
    "parse_value",
    "to_json",
    "validate",
]


class ConfigError(ValueError):
    """An invalid configuration; the message names the key, the value and what is allowed."""


# ----------------------------------------------------------------------------------------------
# The model's static description.


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static hyperparameters of a language model (hashable: safe as a jit static argument).

    Shape letters: V vocab, D d_model, N query heads, K key/value heads, H head dim, F d_ff.
    """

    position: str = "rope"
    kind: str = "decoder"  # "decoder" (causal LM) or "encoder" (bidirectional, masked bytes)
    vocab_size: int = 256
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    d_ff: int = 0  # 0 means 4 * d_model
    max_len: int = 1024  # learned absolute table size
    kv_share: int = 1  # cross-layer KV sharing: groups of `kv_share` layers read one K/V
    dtype: str = "float32"  # compute dtype
    # Memory and compile-time settings for large models (they leave the function computed alone).
    param_dtype: str = "float32"  # storage dtype of the parameters (AdamW moments stay float32)
    remat: str = "none"  # rematerialise each block in the backward: "none" | "full" | "dots"
    scan_layers: bool = False  # stack the blocks' parameters and run them with one lax.scan
    attention_impl: str = "auto"
    # RoPE
    rope_base: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # a HF rope_scaling dict, as items
    rope_layout: str = "interleaved"
    # Relative biases
    t5_num_buckets: int = 32
    t5_max_distance: int = 128
    alibi_slope_scale: float = 1.0
    fire_mlp_width: int = 32
    fire_init_c: float = 0.1
    fire_init_L: float = 512.0
    init_scale: float = 1.0  # multiplies the std of every weight initialiser (a sweepable knob)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def ff_dim(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def causal(self) -> bool:
        return self.kind == "decoder"

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def family(self) -> families.Family:
        return families.get(self.position)


# ----------------------------------------------------------------------------------------------
# Loading and overriding.


def load_config(
    path: str | pathlib.Path, overrides: Sequence[str] = ()
) -> ml_collections.ConfigDict:
    """Loads `get_config()` from a Python file and applies `--config.key=value` overrides.

    Args:
      path: a Python file defining `get_config()`; `path:arg` passes `arg` to `get_config(arg)`.
      overrides: strings `key=value` or `--config.key=value`.

    Returns:
      The locked ConfigDict (validated: see `validate`).
    """
    path = str(path)
    arg = None
    if ":" in path and not pathlib.Path(path).exists():
        path, arg = path.split(":", 1)
    file = pathlib.Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {path!r} does not exist (expected e.g. configs/tiny.py)")
    spec = importlib.util.spec_from_file_location(f"posattn_config_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path!r} defines no get_config()")
    config = module.get_config(arg) if arg is not None else module.get_config()
    config = apply_overrides(config, overrides)
    validate(config)
    return config


def parse_value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare string such as alibi or /path/to/corpus


def apply_overrides(
    config: ml_collections.ConfigDict, overrides: Sequence[str]
) -> ml_collections.ConfigDict:
    """Returns a copy of `config` with `key=value` overrides applied, refusing unknown keys."""
    config = ml_collections.ConfigDict(config.to_dict())
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
                    f"unknown config key {key!r}: {where} has no {part!r} (known: {', '.join(sorted(known))}){hint}"
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


def parse_args(argv: Sequence[str]) -> tuple[str | None, list[str], dict[str, str]]:
    """Splits a command line into (config path, config overrides, other --flag=value pairs)."""
    path, overrides, flags = None, [], {}
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--config."):
            if "=" not in arg and i + 1 < len(args):
                arg, i = f"{arg}={args[i + 1]}", i + 1
            overrides.append(arg)
        elif arg.startswith("--"):
            name, has_value, value = arg[2:].partition("=")
            if not has_value:
                if i + 1 < len(args) and not args[i + 1].startswith("--"):
                    value, i = args[i + 1], i + 1
                else:
                    value = "true"
            if name == "config":
                path = value
            else:
                flags[name.replace("-", "_")] = value
        else:
            raise ConfigError(
                f"unexpected argument {arg!r}; flags look like --workdir DIR or --config.key=value"
            )
        i += 1
    return path, overrides, flags


def config_and_workdir(argv: Sequence[str], command: str) -> tuple[str, list[str], str]:
    """(config path, overrides, workdir) of `python -m <command> --config F --workdir DIR [--config.k=v ...]`;
    a missing or unknown flag is a ConfigError that shows the usage."""
    path, overrides, flags = parse_args(argv)
    unknown = set(flags) - {"workdir"}
    if path is None or "workdir" not in flags or unknown:
        raise ConfigError(
            f"usage: python -m {command} --config configs/<name>.py --workdir DIR [--config.key=value ...]"
            + (f" (unknown flag --{sorted(unknown)[0]})" if unknown else "")
        )
    return path, overrides, flags["workdir"]


def to_json(config: ml_collections.ConfigDict) -> str:
    return json.dumps(config.to_dict(), indent=2, sort_keys=True, default=str)


# ----------------------------------------------------------------------------------------------
# Validation.


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"config.{key}={value!r} is invalid: {allowed}")


def _positive_int(
    section: Mapping[str, Any], prefix: str, name: str, allow_zero: bool = False
) -> None:
    value = section[name]
    ok = (
        isinstance(value, int)
        and not isinstance(value, bool)
        and (value >= 0 if allow_zero else value > 0)
    )
    _require(
        ok,
        f"{prefix}.{name}",
        value,
        "must be a positive integer" if not allow_zero else "must be an integer >= 0",
    )


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
    """Validates `config.model` and returns it as a frozen `ModelConfig`."""
    section = config.model
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = set(section.keys()) - known
    if unknown:
        raise ConfigError(
            f"unknown config key(s) config.model.{sorted(unknown)[0]}: known keys are {sorted(known)}"
        )
    values = dict(section.to_dict())
    scaling = values.get("rope_scaling")
    if isinstance(scaling, str):
        scaling = parse_value(scaling)
    if scaling is not None and not isinstance(scaling, Mapping):
        raise ConfigError(
            f"config.model.rope_scaling={scaling!r} is invalid: must be None or a Hugging Face rope_scaling "
            "dict such as {'rope_type': 'linear', 'factor': 4.0, 'original_max_position_embeddings': 512}"
        )
    values["rope_scaling"] = None if scaling is None else tuple(sorted(dict(scaling).items()))
    cfg = ModelConfig(**values)
    _validate_model(cfg)
    return cfg


def _validate_model(cfg: ModelConfig) -> None:
    p = "model"
    if cfg.position not in families.names():
        raise ConfigError(
            f"config.model.position={cfg.position!r} is not a known position family; known: {', '.join(families.names())}"
        )
    _require(
        cfg.kind in ("decoder", "encoder"), f"{p}.kind", cfg.kind, "allowed: 'decoder', 'encoder'"
    )
    fields = cfg.__dict__
    for name in (
        "vocab_size",
        "d_model",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "max_len",
        "kv_share",
        "t5_num_buckets",
        "t5_max_distance",
        "fire_mlp_width",
    ):
        _positive_int(fields, p, name)
    _positive_int(fields, p, "d_ff", allow_zero=True)
    _require(
        cfg.d_model % cfg.num_heads == 0,
        f"{p}.d_model",
        cfg.d_model,
        f"must be divisible by model.num_heads={cfg.num_heads} (head dim = d_model / num_heads)",
    )
    _require(
        cfg.num_heads % cfg.num_kv_heads == 0,
        f"{p}.num_kv_heads",
        cfg.num_kv_heads,
        f"must divide model.num_heads={cfg.num_heads} (grouped-query attention; 1 is multi-query)",
    )
    _require(
        cfg.num_layers % cfg.kv_share == 0,
        f"{p}.kv_share",
        cfg.kv_share,
        f"must divide model.num_layers={cfg.num_layers} (layers share K/V in groups of kv_share)",
    )
    _require(
        cfg.dtype in ("float32", "bfloat16"),
        f"{p}.dtype",
        cfg.dtype,
        "allowed: 'float32', 'bfloat16'",
    )
    _validate_scaling(cfg)
    _require(
        cfg.attention_impl in IMPLEMENTATIONS,
        f"{p}.attention_impl",
        cfg.attention_impl,
        "allowed: " + ", ".join(repr(name) for name in IMPLEMENTATIONS),
    )
    _require(
        cfg.rope_layout in ("interleaved", "half"),
        f"{p}.rope_layout",
        cfg.rope_layout,
        "allowed: 'interleaved', 'half'",
    )
    for name in ("rope_base", "alibi_slope_scale", "fire_init_c", "fire_init_L", "init_scale"):
        value = fields[name]
        _require(
            isinstance(value, (int, float)) and math.isfinite(value) and value > 0,
            f"{p}.{name}",
            value,
            "must be a positive finite number",
        )
    family = cfg.family
    if family.rotary:
        _require(
            cfg.head_dim % 2 == 0,
            f"{p}.d_model",
            cfg.d_model,
            f"gives an odd head dim {cfg.head_dim} (d_model / num_heads); RoPE rotates pairs and needs an even head dim",
        )
        if cfg.rope_scaling is not None:
            try:
                rotary.validate_rope_scaling(cfg.rope_scaling_dict, cfg.head_dim)
            except ValueError as e:
                raise ConfigError(f"config.model.rope_scaling: {e}") from None
    elif cfg.rope_scaling is not None:
        raise ConfigError(
            f"config.model.rope_scaling is set but config.model.position={cfg.position!r} does not use RoPE; "
            "set the position to 'rope' or the scaling to None"
        )
    if cfg.position == "t5":
        buckets = cfg.t5_num_buckets // (1 if cfg.causal else 2)
        _require(
            buckets >= 2 and (cfg.causal or cfg.t5_num_buckets % 2 == 0),
            f"{p}.t5_num_buckets",
            cfg.t5_num_buckets,
            "needs at least 2 buckets per direction (an even number for the encoder)",
        )
        _require(
            cfg.t5_max_distance > buckets // 2,
            f"{p}.t5_max_distance",
            cfg.t5_max_distance,
            f"must exceed the exact-bucket range num_buckets//2={buckets // 2} "
            "(the log-spaced buckets cover max_exact..max_distance)",
        )
    if cfg.position == "sandwich":
        _require(
            cfg.head_dim % 2 == 0,
            f"{p}.d_model",
            cfg.d_model,
            f"gives an odd head dim {cfg.head_dim}; Sandwich sums d'/2 cosines and needs an even head dim",
        )


def _validate_scaling(cfg: ModelConfig) -> None:
    """model.param_dtype, model.remat, model.scan_layers (see posattn.nn.model)."""
    _require(
        cfg.param_dtype in ("float32", "bfloat16"),
        "model.param_dtype",
        cfg.param_dtype,
        "allowed: 'float32', 'bfloat16'",
    )
    _require(
        cfg.remat in ("none", "full", "dots"),
        "model.remat",
        cfg.remat,
        "allowed: 'none', 'full' (recompute each block), 'dots' (keep its matmul outputs)",
    )
    _require(
        isinstance(cfg.scan_layers, bool), "model.scan_layers", cfg.scan_layers, "must be a bool"
    )
    if cfg.scan_layers and cfg.kv_share != 1:
        raise ConfigError(
            f"config.model.kv_share={cfg.kv_share} is not supported with "
            "config.model.scan_layers=True "
            "(a scanned stack needs identical layers, and a layer that reads another's keys/values "
            "has no key/value projections); set model.kv_share=1 or model.scan_layers=False"
        )


_DATA_KEYS = {"corpus", "seq_len"}
_TRAIN_KEYS = {"steps", "batch_size", "learning_rate", "seed", "checkpoint_every"}


def validate(config: ml_collections.ConfigDict) -> ModelConfig:
    """Checks every setting of a training config; returns the ModelConfig. Raises ConfigError."""
    for section, keys in (("model", {"position"}), ("data", _DATA_KEYS), ("train", _TRAIN_KEYS)):
        if section not in config:
            raise ConfigError(
                f"config has no {section!r} section (see configs/tiny.py for the layout)"
            )
        missing = keys - set(config[section].keys())
        if missing:
            raise ConfigError(f"config.{section} lacks required key(s) {sorted(missing)}")
    cfg = model_config(config)
    data, train = config.data, config.train
    _positive_int(data, "data", "seq_len")
    if cfg.position == "learned" and data.seq_len > cfg.max_len:
        raise ConfigError(
            f"config.data.seq_len={data.seq_len} exceeds config.model.max_len={cfg.max_len}, the learned "
            "position table's size; raise model.max_len or shorten data.seq_len"
        )
    _require(
        isinstance(data.corpus, str) and data.corpus != "",
        "data.corpus",
        data.corpus,
        "must be 'stdlib', a text file or directory, or a directory holding nanoGPT train.bin/val.bin",
    )
    for name in ("passkey_fraction", "mask_rate"):
        value = data.get(name, 0.0)
        _require(
            isinstance(value, (int, float)) and 0.0 <= value <= 1.0,
            f"data.{name}",
            value,
            "must be a fraction in [0, 1]",
        )
    if data.get("passkey_fraction", 0.0) > 0 and not cfg.causal:
        raise ConfigError(
            f"config.data.passkey_fraction={data.passkey_fraction} mixes passkey sequences into a causal LM's "
            "batches, but config.model.kind='encoder'; set the fraction to 0 or use the decoder"
        )
    for name in ("steps", "batch_size", "checkpoint_every"):
        _positive_int(train, "train", name)
    _positive_int(train, "train", "seed", allow_zero=True)
    for name in (
        "warmup_steps",
        "eval_every",
        "eval_batches",
        "log_every",
        "keep_checkpoints",
        "fsdp",
    ):
        if name in train:
            _positive_int(train, "train", name, allow_zero=name in ("warmup_steps", "eval_every"))
    lr = train.learning_rate
    _require(
        isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0,
        "train.learning_rate",
        lr,
        "must be a positive finite number",
    )
    for name, lo, hi in (
        ("weight_decay", 0.0, math.inf),
        ("grad_clip", 0.0, math.inf),
        ("b1", 0.0, 1.0),
        ("b2", 0.0, 1.0),
        ("min_lr_ratio", 0.0, 1.0),
    ):
        if name in train:
            value = train[name]
            _require(
                isinstance(value, (int, float)) and lo <= value <= hi,
                f"train.{name}",
                value,
                f"must be a number in [{lo}, {hi}]",
            )
    if "warmup_steps" in train and train.warmup_steps > train.steps:
        raise ConfigError(
            f"config.train.warmup_steps={train.warmup_steps} exceeds config.train.steps={train.steps}; "
            "shorten the warmup"
        )
    return cfg
