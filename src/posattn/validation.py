"""Checking a training config before any compute: every error names the key, the value and what
is allowed (`ConfigError`).

`validate(config)` checks the `model` section (through `ModelConfig.validate`, which asks the
position family to check its own settings) and the `data` and `train` sections, and returns the
frozen `ModelConfig` the modules take. Library code never sees the ConfigDict.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import ml_collections

from posattn.nn.config import ConfigError, ModelConfig

__all__ = ["model_config", "validate"]

_DATA_KEYS = {"corpus", "seq_len"}
_TRAIN_KEYS = {"steps", "batch_size", "learning_rate", "seed", "checkpoint_every"}


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
    """Validates `config.model` and returns it as a frozen `ModelConfig`.

    With `model.init_from='hf:PATH'` the architecture comes from the checkpoint's config.json
    (`posattn.hf.config.init_from_keys`)."""
    keys = config.model.to_dict()
    init_from = keys.get("init_from", "")
    if isinstance(init_from, str) and init_from.startswith("hf:") and len(init_from) > 3:
        from posattn.hf.config import init_from_keys

        keys = init_from_keys(keys)
    return ModelConfig.from_keys(keys).validate()


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"config.{key}={value!r} is invalid: {allowed}")


def _positive_int(section: Mapping[str, Any], prefix: str, name: str, allow_zero=False) -> None:
    value = section[name]
    ok = isinstance(value, int) and not isinstance(value, bool)
    ok = ok and (value >= 0 if allow_zero else value > 0)
    allowed = "must be an integer >= 0" if allow_zero else "must be a positive integer"
    _require(ok, f"{prefix}.{name}", value, allowed)


def validate(config: ml_collections.ConfigDict) -> ModelConfig:
    """Checks every setting of a training config; returns the ModelConfig. Raises ConfigError."""
    for section, keys in (("model", set()), ("data", _DATA_KEYS), ("train", _TRAIN_KEYS)):
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
    cfg.check_length(data.seq_len, "data.seq_len")
    _require(
        isinstance(data.corpus, str) and data.corpus != "",
        "data.corpus",
        data.corpus,
        "must be 'stdlib', a text file or directory, or a directory holding nanoGPT "
        "train.bin/val.bin",
    )
    if "batch_offset" in data:
        _positive_int(data, "data", "batch_offset", allow_zero=True)
    for name in ("passkey_fraction", "induction_fraction", "mask_rate"):
        if name in data:
            value = data[name]
            _require(
                isinstance(value, (int, float)) and 0.0 <= value <= 1.0,
                f"data.{name}",
                value,
                "must be a fraction in [0, 1]",
            )
    if "passkey_distractors" in data:
        _require(
            isinstance(data.passkey_distractors, bool),
            "data.passkey_distractors",
            data.passkey_distractors,
            "must be True or False",
        )
    if "probe_weight" in data:
        _require(
            isinstance(data.probe_weight, (int, float))
            and not isinstance(data.probe_weight, bool)
            and math.isfinite(data.probe_weight)
            and data.probe_weight >= 0,
            "data.probe_weight",
            data.probe_weight,
            "must be a finite weight >= 0 (1: the probe rows' answers weigh as any target)",
        )
    if "passkey_digits" in data:
        digits = data.passkey_digits
        _require(
            isinstance(digits, (tuple, list))
            and len(digits) == 2
            and all(isinstance(d, int) and not isinstance(d, bool) for d in digits)
            and 1 <= digits[0] <= digits[1],
            "data.passkey_digits",
            digits,
            "must be (shortest, longest) key lengths with 1 <= shortest <= longest, e.g. (1, 5)",
        )
    if "induction_span" in data:
        _positive_int(data, "data", "induction_span")
        _require(
            data.induction_span >= 4,
            "data.induction_span",
            data.induction_span,
            "must be at least 4 (an induction row's string has 4 to induction_span letters)",
        )
        if data.get("induction_fraction"):
            _require(
                2 * data.induction_span <= data.seq_len + 1,
                "data.induction_span",
                data.induction_span,
                f"must fit twice into a training row of data.seq_len + 1 = {data.seq_len + 1} "
                "bytes (the string and its repeat); lower it or raise data.seq_len",
            )
    for name in ("passkey_fraction", "induction_fraction"):
        if data.get(name) and not cfg.causal:
            raise ConfigError(
                f"config.data.{name}={data[name]} mixes probe rows into a causal LM's batches, "
                "but config.model.kind='encoder'; set the fraction to 0 or use the decoder"
            )
    for name in ("steps", "batch_size", "checkpoint_every"):
        _positive_int(train, "train", name)
    _positive_int(train, "train", "seed", allow_zero=True)
    _require(
        train.seed < 2**63,
        "train.seed",
        train.seed,
        "must be an integer in [0, 2**63) (a PRNG key holds 64 bits)",
    )
    for name in ("warmup_steps", "eval_every", "eval_batches", "log_every", "keep_checkpoints"):
        if name in train:
            _positive_int(train, "train", name, allow_zero=name in ("warmup_steps", "eval_every"))
    if "fsdp" in train:
        _positive_int(train, "train", "fsdp")
    lr = train.learning_rate
    _require(
        isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0,
        "train.learning_rate",
        lr,
        "must be a positive finite number",
    )
    # (key, low, high, high included, why): settings outside these ranges cannot train; AdamW's
    # bias correction divides by 1 - beta^t, which is 0 for beta = 1 (NaN at the first steps).
    for name, lo, hi, closed, why in (
        ("weight_decay", 0.0, math.inf, True, ""),
        ("grad_clip", 0.0, math.inf, False, "; 0 clips every gradient to zero"),
        ("b1", 0.0, 1.0, False, "; AdamW divides by 1 - b1**t, 0 for b1 = 1"),
        ("b2", 0.0, 1.0, False, "; AdamW divides by 1 - b2**t, 0 for b2 = 1"),
        ("min_lr_ratio", 0.0, 1.0, True, ""),
    ):
        if name in train:
            value = train[name]
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            inside = (
                number
                and math.isfinite(value)
                and lo <= value
                and (value <= hi if closed else value < hi)
            )
            if name == "grad_clip":
                inside = inside and value > 0
            left = "(" if name == "grad_clip" else "["
            _require(
                inside,
                f"train.{name}",
                value,
                f"must be a number in {left}{lo}, {hi}{']' if closed else ')'}{why}",
            )
    if "warmup_steps" in train and train.warmup_steps > train.steps:
        raise ConfigError(
            f"config.train.warmup_steps={train.warmup_steps} exceeds config.train.steps="
            f"{train.steps}; shorten the warmup"
        )
    _validate_observability(train)
    return cfg


def _validate_observability(train) -> None:
    """train.profile_steps, train.peak_flops, train.tensorboard (see docs/training.md)."""
    profile = train.profile_steps
    if profile:  # () / [] (as config.json holds it) / None: off
        ok = (
            isinstance(profile, (tuple, list))
            and len(profile) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in profile)
        )
        _require(ok, "train.profile_steps", profile, "must be () or (first, count), integers >= 1")
        _require(
            profile[0] + profile[1] - 1 <= train.steps,
            "train.profile_steps",
            profile,
            f"profiles steps {profile[0]}..{profile[0] + profile[1] - 1}, past the last step "
            f"(train.steps={train.steps}); allowed: first >= 1, first + count - 1 <= {train.steps}",
        )
    peak = train.peak_flops
    _require(
        peak is None
        or (isinstance(peak, (int, float)) and not isinstance(peak, bool) and 0 < peak < math.inf),
        "train.peak_flops",
        peak,
        "must be None (look the device up) or the device's peak FLOP/s, a positive number",
    )
    board = train.tensorboard
    _require(isinstance(board, bool), "train.tensorboard", board, "must be True or False")
