"""Per-layer position settings: `model.layer_pattern` and the layers it describes.

A pattern is a tuple of family entries repeated over the layers: layer `l` takes entry
`l % len(pattern)`. An entry is a family name with optional settings, the syntax of the
length-extrapolation experiment's `families`:

    "nope"                        # the family's defaults
    "rope:rope_base=1e6"          # a family key (a model key, here without "model.")
    "rope:rope_base=1e4,window=1024"
    "nope:attn_scale=0.1,floor_scale=8192"

Besides the family's own keys an entry takes the per-layer keys of `LAYER_KEYS`: a sliding window
(`window`) and the length temperatures (Llama 4's query scaling `attn_scale`, `floor_scale`;
scalable softmax `ssmax`). An entry of `model.position`'s family starts from `model.position`'s
settings (so `model.rope_base` reaches every "rope" entry that does not set its own); any other
entry starts from its family's defaults.

`parse_entry` is the one parser of that syntax (the experiment's `families` uses it too);
`LayerSpec` is one layer's static description, what `TransformerLM` builds a block from.
"""

from __future__ import annotations

import ast
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from posattn import families

__all__ = ["LAYER_KEYS", "LayerSpec", "entry_overrides", "parse_entry", "parse_value"]


def parse_value(text: str) -> Any:
    """A setting's value: a Python literal (`1e6`, `True`, `(1, 2)`), else the bare string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_entry(entry: str, *, where: str = "config.model.layer_pattern") -> tuple[str, dict]:
    """(family name, {key: value}) of an entry "family" or "family:key=value,key=value".

    Only the syntax and the family's name are checked here (`where` names the config key in the
    messages); what a key means is for the caller (`entry_overrides`, the experiment).
    """
    if not isinstance(entry, str) or not entry:
        raise ValueError(
            f"{where} has {entry!r}: an entry is a string 'family' or 'family:key=value,...'"
        )
    name, _, rest = entry.partition(":")
    if name not in families.names():
        raise ValueError(
            f"{where} has {entry!r}: unknown family {name!r}; known: "
            f"{', '.join(families.names())} (settings as 'rope:rope_base=1e6,window=128')"
        )
    values: dict[str, Any] = {}
    for item in filter(None, _split_items(rest)):
        key, eq, text = item.partition("=")
        if not eq or not key:
            raise ValueError(
                f"{where} entry {entry!r}: {item!r} is not key=value "
                "(e.g. 'rope:rope_base=1e6'; the family is the part before ':')"
            )
        if key in values:
            raise ValueError(f"{where} entry {entry!r} sets {key!r} twice")
        values[key] = parse_value(text)
    return name, values


def _split_items(text: str) -> list[str]:
    """`text` split at the commas outside brackets and quotes (a dict value keeps its commas)."""
    items, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items]


def _check_window(value) -> str | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return None
    return "must be an integer >= 1 (query i sees key j iff i - j < window)"


def _check_number(low_ok: bool):
    def check(value):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and math.isfinite(value) and (value >= 0 if low_ok else value > 0):
            return None
        return "must be a finite number >= 0" if low_ok else "must be a positive finite number"

    return check


def _check_bool(value) -> str | None:
    return None if isinstance(value, bool) else "must be True or False"


# Per-layer keys an entry may set: key -> (default, help, check returning an error or None).
LAYER_KEYS: dict[str, tuple[Any, str, Any]] = {
    "window": (
        None,
        "sliding window: query i sees key j iff i - j < window (Hugging Face sliding_window)",
        _check_window,
    ),
    "attn_scale": (
        0.0,
        "Llama 4 length temperature: q *= 1 + attn_scale log(floor((i+1)/floor_scale) + 1) "
        "(0: off; Llama 4 uses 0.1 on its NoPE layers)",
        _check_number(True),
    ),
    "floor_scale": (
        8192.0,
        "Llama 4 length temperature: positions per temperature step",
        _check_number(False),
    ),
    "ssmax": (
        False,
        "scalable softmax (Nakanishi 2025): q.k times s_h log n_i, s_h learned per head",
        _check_bool,
    ),
}


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One layer's position settings (hashable: it reaches the model's graph).

    Attributes:
      position: the family's registry name.
      settings: the family's settings.
      window: the sliding window, or None (every earlier key).
      attn_scale, floor_scale: Llama 4's query temperature (`attn_scale` 0 is off).
      ssmax: scalable softmax on this layer.
    """

    position: str
    settings: families.Settings
    window: int | None = None
    attn_scale: float = 0.0
    floor_scale: float = 8192.0
    ssmax: bool = False

    @property
    def family(self) -> families.Family:
        return families.get(self.position)

    @property
    def temperature(self) -> bool:
        """Whether the queries are rescaled by position (Llama 4's temperature or SSMax)."""
        return self.attn_scale != 0 or self.ssmax


def entry_overrides(entry: str, *, base: families.Settings | None, where: str) -> LayerSpec:
    """The `LayerSpec` of one entry; `base` is the settings its family starts from (None: the
    family's defaults). Raises ValueError naming the entry, the key and what is allowed."""
    name, values = parse_entry(entry, where=where)
    family = families.get(name)
    own = family.settings.keys()
    layer: dict[str, Any] = {}
    settings_values: dict[str, Any] = {}
    for key, value in values.items():
        if key in LAYER_KEYS:
            problem = LAYER_KEYS[key][2](value)
            if problem:
                raise ValueError(f"{where} entry {entry!r}: {key}={value!r} is invalid: {problem}")
            layer[key] = value
        elif key in own:
            settings_values[key] = value
        else:
            owners = families.owners(key)
            if owners:
                why = f"model.{key} is a setting of {', '.join(owners)}, not of {name}"
            else:
                why = f"{key!r} is not a setting of {name}"
            allowed = ", ".join([*own, *LAYER_KEYS]) or ", ".join(LAYER_KEYS)
            raise ValueError(f"{where} entry {entry!r}: {why}; allowed keys: {allowed}")
    start = base.to_keys() if base is not None else {}
    try:
        settings = family.settings.from_keys({**start, **settings_values})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where} entry {entry!r}: {e}") from None
    return LayerSpec(name, settings, **layer)


def layer_specs(
    pattern: tuple[str, ...],
    *,
    num_layers: int,
    position: str,
    settings: families.Settings,
) -> tuple[LayerSpec, ...]:
    """The spec of each of `num_layers` layers (the pattern cycled; empty: `position`'s)."""
    if not pattern:
        return (LayerSpec(position, settings),) * num_layers
    where = "config.model.layer_pattern"
    entries = []
    for entry in pattern:
        name = parse_entry(entry, where=where)[0]
        entries.append(
            entry_overrides(entry, base=settings if name == position else None, where=where)
        )
    return tuple(entries[i % len(entries)] for i in range(num_layers))


def as_pattern(value: Any) -> tuple[str, ...]:
    """`model.layer_pattern` as a tuple (a config file's list, a single entry string)."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Mapping):
        raise ValueError(
            f"config.model.layer_pattern={value!r} must be a tuple of family entries, "
            "e.g. ('rope:window=128', 'nope')"
        )
    return tuple(value)


def validate(cfg) -> None:
    """Checks `cfg.layer_pattern` against the rest of a `ModelConfig`; raises ValueError naming
    the key, the value and what is allowed."""
    pattern = cfg.layer_pattern
    where = "config.model.layer_pattern"
    if not all(isinstance(e, str) for e in pattern):
        raise ValueError(
            f"{where}={pattern!r} is invalid: must be a tuple of strings such as "
            "('rope:window=128', 'nope')"
        )
    if len(pattern) > cfg.num_layers:
        raise ValueError(
            f"{where} has {len(pattern)} entries but config.model.num_layers={cfg.num_layers}: "
            f"the entries after the first {cfg.num_layers} would never be used; shorten the "
            "pattern or add layers"
        )
    specs = cfg.layers
    if pattern:
        names = {spec.position for spec in specs}
        own = cfg.family
        if cfg.position != "rope" and own.embedding == "none" and cfg.position not in names:
            raise ValueError(
                f"config.model.position={cfg.position!r} is not used: with a {where} the layers "
                "come from its entries and model.position only adds an input embedding "
                "('sinusoidal', 'learned') or gives the settings of its family's entries; add "
                f"{cfg.position!r} to the pattern or leave model.position at its default"
            )
    for entry, spec in zip(pattern or (cfg.position,), specs, strict=False):
        family = spec.family
        if pattern and family.embedding != "none":
            raise ValueError(
                f"{where} entry {entry!r}: {spec.position} is an input embedding (added once, "
                "before the first layer), not a per-layer family; set "
                f"config.model.position={spec.position!r} and give the layers 'nope' entries"
            )
        try:
            spec.settings.validate(cfg.context)
        except ValueError as e:
            raise ValueError(f"{where} entry {entry!r}: {e}") from None
        label = f"{where} entry {entry!r}" if pattern else f"config.model.position={entry!r}"
        if family.forget is not None and not cfg.causal:
            raise ValueError(
                f"{label}: FoX's forget gates accumulate over earlier positions and need a causal "
                f"model, but config.model.kind={cfg.kind!r}; set model.kind='decoder'"
            )
        if family.normalizer == "stick_breaking" and not cfg.causal:
            raise ValueError(
                f"{label}: stick-breaking attention breaks each query's stick over the earlier "
                f"keys and needs a causal model, but config.model.kind={cfg.kind!r}; set "
                "model.kind='decoder'"
            )
        if family.normalizer == "stick_breaking" and cfg.attn_logit_softcap:
            raise ValueError(
                f"{label}: stick-breaking attention has no softmax logits to cap, but "
                f"config.model.attn_logit_softcap={cfg.attn_logit_softcap}; set it to 0"
            )
        if family.contextual and not cfg.causal:
            raise ValueError(
                f"{label}: CoPE counts each query's gates over the keys up to it and needs a "
                f"causal model, but config.model.kind={cfg.kind!r}; set model.kind='decoder'"
            )
        if family.contextual and spec.settings.gates == "separate" and cfg.kv_share != 1:
            raise ValueError(
                f"{label}: config.model.kv_share={cfg.kv_share} is not supported with CoPE's "
                "separate gate keys (each layer's gate keys belong to its own keys); set "
                "model.kv_share=1 or model.cope_gates='keys'"
            )
        if family.contextual and cfg.attn_logit_softcap:
            raise ValueError(
                f"{label}: the CoPE kernel has no logit soft cap, but "
                f"config.model.attn_logit_softcap={cfg.attn_logit_softcap}; set it to 0"
            )
        if family.reflections and not cfg.causal:
            raise ValueError(
                f"{label}: PaTH moves each key through the reflections of the positions after it "
                f"up to the query and needs a causal model, but config.model.kind={cfg.kind!r}; "
                "set model.kind='decoder'"
            )
        if family.reflections and cfg.kv_share != 1:
            raise ValueError(
                f"{label}: config.model.kv_share={cfg.kv_share} is not supported with PaTH (each "
                "layer's keys travel through its own reflections); set model.kv_share=1"
            )
        if family.reflections and cfg.attn_logit_softcap:
            raise ValueError(
                f"{label}: the PaTH kernel has no logit soft cap, but "
                f"config.model.attn_logit_softcap={cfg.attn_logit_softcap}; set it to 0"
            )
        if family.forget is not None and cfg.kv_share != 1:
            raise ValueError(
                f"{label}: config.model.kv_share={cfg.kv_share} is not supported with FoX (each "
                "layer's forget gates belong to its own keys); set model.kv_share=1"
            )
    distinct = list(dict.fromkeys(specs))
    if cfg.scan_layers and len(distinct) > 1:
        raise ValueError(
            f"config.model.scan_layers=True needs identical layers, but {where}={pattern!r} "
            f"gives {len(distinct)} different ones; set model.scan_layers=False (a pattern of "
            "one entry scans)"
        )
    if cfg.kv_share > 1:
        for start in range(0, cfg.num_layers, cfg.kv_share):
            group = specs[start : start + cfg.kv_share]
            if len(set(group)) > 1:
                last = start + len(group) - 1
                raise ValueError(
                    f"config.model.kv_share={cfg.kv_share}: layers {start}..{last} share one "
                    f"key/value cache but {where} gives them different entries; "
                    "align the pattern with the sharing groups or set model.kv_share=1"
                )
