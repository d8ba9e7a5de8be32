"""The evaluators: name -> a function that scores one model at one length.

An evaluator is

    run(model, text, length, settings) -> a JSON value (None, or None cells: the model cannot
        read `length`, or a probe does not fit in it)

* `model`: the split model `(graphdef, params, constants)` (a causal LM; RoPE rows carry their
  eval-time scaling in the graphdef and constants already, so an evaluator never asks which
  family it reads);
* `text`: the held-out evaluation text, `posattn.eval.heldout.EvalText` (tokens, the plan of
  chunks and sliding blocks drawn over held-out files, the unit);
* `length`: the window length T to score;
* `settings`: a dict of its own keys (`Evaluator.defaults`, overridden by the experiment config's
  `Evaluator.section`) plus the shared ones every evaluator gets: `train_len` (L), `lengths`
  (every length of the evaluation, increasing), `batch_tokens` (tokens per forward pass) and
  `seed` (draws every probe sample).

It returns plain JSON (lists, floats, None), so its output can be cached and reported as is.
The one forward pass is `posattn.eval.lengths.forward` (batched) or `token_stats`. Seeds of one
row are combined by `Evaluator.combine`: "mean" (elementwise over seeds, None if any seed has
None), "first" (the first seed's), or "all" (the list over seeds, for evaluators whose
summary needs every seed: the loss, whose intervals `posattn.eval.summary` draws).

A new evaluator is one module with its `run` and one `register(Evaluator(...))` line (here, or in
the code that uses it); the experiment (`experiments/length_extrapolation/`) and
`python -m posattn.eval` run every registered evaluator whose settings enable it, and write its
output under `evaluators.<name>` of their results.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from posattn.eval import attention_stats, retrieval, scoring

__all__ = ["SHARED", "Evaluator", "get", "names", "register", "settings_of", "unregister"]

# Settings every evaluator receives beside its own (see the module docstring).
SHARED = ("train_len", "lengths", "batch_tokens", "seed")


def _enabled_flag(settings: Mapping[str, Any]) -> bool:
    return bool(settings.get("enabled", True))


@dataclasses.dataclass(frozen=True)
class Evaluator:
    """One registered evaluator.

    Attributes:
      name: its key in results (`evaluators.<name>`) and on the command line.
      run: `run(model, text, length, settings)` (module docstring).
      section: the section of the experiment config that holds its settings (None: none).
      defaults: its own settings and their values when the config does not set them.
      enabled: whether `settings` (its own) turn it on; default: `settings.get("enabled", True)`.
      combine: how the values of several seeds make one row's: "mean", "first" or "all".
      byte_level: whether its probes are byte sequences (digits, letters as byte ids), so that it
        reads only a byte-level model (vocabulary 256); a model with a tokenizer skips it.
    """

    name: str
    run: Callable[..., Any]
    section: str | None = None
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    enabled: Callable[[Mapping[str, Any]], bool] = _enabled_flag
    combine: str = "mean"
    byte_level: bool = False

    def __post_init__(self):
        if self.combine not in ("mean", "first", "all"):
            raise ValueError(
                f"Evaluator {self.name!r}: combine={self.combine!r}; allowed: mean, first, all"
            )


_REGISTRY: dict[str, Evaluator] = {}


def register(evaluator: Evaluator) -> Evaluator:
    """Adds `evaluator` (its name must be new); returns it."""
    if evaluator.name in _REGISTRY:
        raise ValueError(f"evaluator {evaluator.name!r} is already registered")
    _REGISTRY[evaluator.name] = evaluator
    return evaluator


def unregister(name: str) -> None:
    """Removes an evaluator (tests that register their own)."""
    _REGISTRY.pop(name, None)


def names() -> list[str]:
    """Every registered evaluator, in registration order."""
    return list(_REGISTRY)


def get(name: str) -> Evaluator:
    """The evaluator `name`; an unknown one is an error listing the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown evaluator {name!r}; known: {', '.join(_REGISTRY)}") from None


def settings_of(evaluator: Evaluator, config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """An evaluator's own settings from an experiment config (a mapping of sections; None: the
    defaults), or None when they turn it off. Only the keys of `defaults` are read."""
    section = {}
    if config is not None and evaluator.section is not None:
        section = config.get(evaluator.section) or {}
    own = {k: _plain(section.get(k, v)) for k, v in evaluator.defaults.items()}
    return own if evaluator.enabled(own) else None


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


register(
    Evaluator(
        "loss",
        scoring.loss_evaluator,
        section="eval",
        defaults={"per_position_bins": 32, "sliding_max_tokens": 0},
        combine="all",
    )
)
register(
    Evaluator(
        "attention",
        attention_stats.attention_evaluator,
        section="eval",
        defaults={"attention_windows": 4, "head_strings": 32},
        enabled=lambda s: s["attention_windows"] > 0,
        combine="first",
    )
)
register(
    Evaluator(
        "passkey",
        retrieval.passkey_evaluator,
        section="passkey",
        defaults={
            "depths": [0.0, 1.0],
            "samples": 32,
            "digits": 4,
            "distractors": True,
            "enabled": True,
        },
        byte_level=True,
    )
)
register(
    Evaluator(
        "induction",
        retrieval.induction_evaluator,
        section="induction",
        defaults={"gap_multiples": [0.5, 4], "gaps": [], "span": 8, "samples": 32, "enabled": True},
        byte_level=True,
    )
)
register(
    Evaluator(
        "copy",
        retrieval.copy_evaluator,
        section="copy",
        defaults={"samples": 8, "segment": 12, "enabled": False},
        byte_level=True,
    )
)
