"""The experiment's config: its rows' entries parsed and every setting checked before compute.

`families` entries ("fire", "fire:fire_init_c=3.2"), `rope_scalings` entries ("yarn",
"yarn:beta_fast=16", and the remaps "rerope", "self_extend:window_multiple=0.25"),
`window_rows` (entries of `families` also read under a window of L), the
`finetune` block and the evaluation sections (`eval`, `passkey`,
`induction`, `copy`); `check_experiment` validates all of them (the training sections are
validated by `posattn.config.load_config`). The keys and their defaults: experiments/README.md.
"""

from __future__ import annotations

import pathlib
from typing import Any

import ml_collections

from posattn import config as config_lib
from posattn import data as data_lib
from posattn import families, rotary
from posattn.attention import FAR_IMPLEMENTATIONS, IMPLEMENTATIONS
from posattn.data import probes
from posattn.eval import lengths as lengths_lib
from posattn.eval import retrieval
from posattn.nn import pattern
from posattn.nn.config import ModelConfig

__all__ = [
    "FINETUNE_KINDS",
    "ROPE_KINDS",
    "ROPE_OPTIONS",
    "check_experiment",
    "check_window_layers",
    "check_window_rows",
    "entry_dir",
    "eval_lengths",
    "family_config",
    "family_entry",
    "finetune_batch_size",
    "finetune_config",
    "finetune_enabled",
    "finetune_multiple",
    "finetune_scaling",
    "induction_gaps",
    "is_rotary",
    "rope_row_at",
    "rope_scaling_entry",
    "row_stem",
    "window_row_problem",
]

# Eval-time RoPE rows: Hugging Face rope_scaling kinds, then position remaps (ReRoPE,
# SelfExtend: `posattn.eval.lengths.rope_remap_row`).
REMAP_KINDS = ("rerope", "self_extend")
ROPE_KINDS = ("linear", "ntk", "dynamic", "yarn", *REMAP_KINDS)


def eval_lengths(config: ml_collections.ConfigDict) -> list[int]:
    """`eval.lengths` if given, else `eval.multiples` x the training length."""
    if config.eval.lengths:
        return [int(x) for x in config.eval.lengths]
    return [int(m * config.data.seq_len) for m in config.eval.multiples]


def induction_gaps(config: ml_collections.ConfigDict) -> list[int]:
    """`induction.gaps` if given, else `induction.gap_multiples` x the training length."""
    return retrieval.induction_gaps(
        {**config.induction.to_dict(), "train_len": int(config.data.seq_len)}
    )


def check_evaluation(config: ml_collections.ConfigDict, lengths: list[int]) -> None:
    """Validates the evaluation keys (`eval`, `passkey`, `induction`) before any compute."""
    fail = config_lib.ConfigError
    ev = config.eval
    for key in ("max_tokens", "batch_size", "per_position_bins", "bootstrap", "sliding_stride"):
        if not (isinstance(ev[key], int) and ev[key] > 0):
            raise fail(f"config.eval.{key}={ev[key]!r} must be a positive integer")
    for key in ("sliding_tokens", "sliding_max_tokens", "attention_windows", "head_strings"):
        value = ev.get(key, 0)  # absent: the evaluator's default
        if not (isinstance(value, int) and value >= 0):
            raise fail(f"config.eval.{key}={value!r} must be an integer >= 0")
    if ev.sliding_stride > min(config.data.seq_len, lengths[0]):
        raise fail(
            f"config.eval.sliding_stride={ev.sliding_stride} must be at most the training length "
            f"and the shortest eval length ({min(config.data.seq_len, lengths[0])}): the sliding "
            "protocol scores the last `stride` positions of each window"
        )
    if config.induction.enabled:
        ind = config.induction
        gaps = induction_gaps(config)
        if not (isinstance(ind.span, int) and ind.span >= 2):
            raise fail(f"config.induction.span={ind.span!r} must be an integer >= 2")
        if not (isinstance(ind.samples, int) and ind.samples >= 1):
            raise fail(f"config.induction.samples={ind.samples!r} must be a positive integer")
        if not gaps or any(g < 0 for g in gaps) or 2 * ind.span + gaps[0] > lengths[-1] + 1:
            raise fail(
                f"induction gaps {gaps} (config.induction.gaps / gap_multiples) must be >= 0 and "
                f"the smallest must fit the longest length: 2 * span + gap <= {lengths[-1] + 1}"
            )
    if config.passkey.enabled and not (
        isinstance(config.passkey.samples, int) and config.passkey.samples >= 1
    ):
        raise fail(f"config.passkey.samples={config.passkey.samples!r} must be a positive integer")


def check_experiment(config: ml_collections.ConfigDict) -> None:
    """Validates the experiment's own sections (the training sections are validated by
    load_config)."""
    fail = config_lib.ConfigError
    if not config.families:
        raise fail("config.families is empty; name at least one family")
    for e in config.families:
        family_entry(e, config, fail)
    if len(set(config.families)) != len(config.families):
        raise fail(f"config.families={tuple(config.families)!r} repeats an entry")
    for entry in config.families:
        try:
            family_config(config, entry)  # validated there
        except config_lib.ConfigError as err:
            raise fail(f"config.families entry {entry!r}: {err}") from None
    try:  # the probe rows fit the training rows (keys, strings): before any training
        data_lib.batch_options(config.data, causal=True, vocab_size=256)
    except data_lib.DataError as err:
        raise fail(str(err)) from None
    for e in config.rope_scalings:
        rope_scaling_entry(e, fail)
    if len(set(config.rope_scalings)) != len(config.rope_scalings):
        raise fail(f"config.rope_scalings={tuple(config.rope_scalings)!r} repeats an entry")
    L = config.data.seq_len
    for entry in config.rope_scalings:
        check_rope_row(
            entry,
            L,
            eval_lengths(config),
            config.model.d_model // config.model.num_heads,
            config.eval.attention_impl,
            fail,
        )
    if config.rope_scalings and not any(is_rotary(e) for e in config.families):
        raise fail(
            "config.rope_scalings needs a RoPE entry in config.families (e.g. 'rope'; the rows "
            "rescale each trained RoPE model)"
        )
    check_window_rows(config, fail)
    lengths = eval_lengths(config)
    if not lengths or any(x < 2 for x in lengths) or lengths != sorted(set(lengths)):
        raise fail(
            f"eval lengths {lengths} (config.eval.lengths / eval.multiples) must be distinct, "
            "increasing, >= 2"
        )
    if config.eval.attention_impl not in IMPLEMENTATIONS:
        raise fail(
            f"config.eval.attention_impl={config.eval.attention_impl!r}; "
            f"allowed: {', '.join(IMPLEMENTATIONS)}"
        )
    check_evaluation(config, lengths)
    check_finetune(config)
    seeds = config.get("seeds", 1)
    if not (isinstance(seeds, int) and seeds >= 1):
        raise fail(f"config.seeds={seeds!r} must be a positive integer (seeds per family)")
    if config.passkey.enabled:
        need = probes.passkey_min_length(config.passkey.digits) - 1
        if lengths[0] < need:
            raise fail(
                f"config.passkey.digits={config.passkey.digits} needs eval lengths >= {need}, "
                f"got {lengths[0]}; use fewer digits or set config.passkey.enabled=False"
            )
        if not config.passkey.depths or any(not 0 <= d <= 1 for d in config.passkey.depths):
            raise fail(
                f"config.passkey.depths={tuple(config.passkey.depths)!r} must be numbers in [0, 1]"
            )
    if config.copy.enabled and not 2 <= config.copy.segment <= lengths[0] // 2:
        raise fail(
            f"config.copy.segment={config.copy.segment} must lie in [2, shortest eval length / 2 = "
            f"{lengths[0] // 2}]"
        )


def check_window_rows(config: ml_collections.ConfigDict, fail=ValueError) -> None:
    """Checks `config.window_rows`: entries of `families`, each read under a sliding window of L
    (row `<entry>+window`, `posattn.eval.lengths.windowed`) that changes what it sees past L."""
    entries = config.get("window_rows", ())
    example = "e.g. ('rope', 't5')"
    if isinstance(entries, str) or not all(isinstance(e, str) for e in entries):
        raise fail(
            f"config.window_rows={entries!r} must be a tuple of config.families entries, {example}"
        )
    if len(set(entries)) != len(entries):
        raise fail(f"config.window_rows={tuple(entries)!r} repeats an entry")
    L = int(config.data.seq_len)
    check_window_layers(config, int(config.model.num_layers), fail)
    for entry in entries:
        if entry not in config.families:
            raise fail(
                f"config.window_rows entry {entry!r} is not an entry of config.families "
                f"{tuple(config.families)!r}: a window row reads that entry's trained models "
                "(several entries: --config.window_rows=\"('rope','t5')\")"
            )
        cfg = ModelConfig.from_keys(family_config(config, entry).model.to_dict())
        problem = window_row_problem(cfg, L)
        if problem:
            raise fail(f"config.window_rows entry {entry!r}: {problem} (drop it)")


def check_window_layers(config: ml_collections.ConfigDict, num_layers: int, fail=ValueError):
    """Checks `config.window_layers` (the layers a window row limits; empty: every layer)
    against a model of `num_layers` layers."""
    layers = tuple(config.get("window_layers", ()))
    if not layers:
        return
    if not config.get("window_rows"):
        raise fail(
            f"config.window_layers={layers!r} has no effect without config.window_rows; name the "
            "entries to read under the window, e.g. --config.window_rows=\"('rope',)\""
        )
    ok = all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
    if not ok or len(set(layers)) != len(layers) or not all(0 <= i < num_layers for i in layers):
        raise fail(
            f"config.window_layers={layers!r} must be distinct layer indices 0 .. "
            f"{num_layers - 1} (the model has {num_layers} layers), e.g. (0,)"
        )


def window_row_problem(cfg: ModelConfig, L: int) -> str | None:
    """Why the model `cfg`, trained at L, gets no window row (None: it may)."""
    if cfg.max_positions is not None:
        return (
            f"its learned absolute positions stop at {cfg.max_positions}; a window does not let "
            "it read a longer window"
        )
    if all(s.window is not None and s.window <= L for s in cfg.layers):
        return f"every layer already has a window <= L = {L}, so a window of L changes nothing"
    return None


# Options an entry of config.rope_scalings may set per kind ("yarn:beta_fast=16,beta_slow=2"),
# and the defaults. "dynamic" keeps Hugging Face's meaning: a configured factor (2, as in HF's
# documentation), the base recomputed from the length the model reads; linear / ntk / yarn take the
# factor eval_len / L.
ROPE_OPTIONS = {
    "linear": {},
    "ntk": {},
    "dynamic": {"factor": 2.0},
    "yarn": {"beta_fast": 32.0, "beta_slow": 1.0},
    # window w = window_multiple x L; leak k >= 2: Leaky ReRoPE (0: ReRoPE); group 0: per
    # length, the smallest that keeps the far distances below L; log_scale 1: queries times
    # max(1, log(i + 1) / log L)
    "rerope": {"window_multiple": 0.5, "leak": 0.0, "log_scale": 0.0},
    "self_extend": {"window_multiple": 0.5, "group": 0.0, "log_scale": 0.0},
}


def rope_row_at(entry: str, train_len: int, eval_len: int) -> tuple[dict | None, dict | None]:
    """(rope_scaling, rope_remap) that an entry of config.rope_scalings reads a model trained at
    `train_len` with at `eval_len`: a Hugging Face scaling (`rope_scaling_row`) or a remap
    (`rope_remap_row`), the other None; both None at eval_len <= train_len."""
    kind, options = rope_scaling_entry(entry)
    if kind in REMAP_KINDS:
        remap = lengths_lib.rope_remap_row(kind, train_len=train_len, eval_len=eval_len, **options)
        return None, remap
    return lengths_lib.rope_scaling_row(
        kind, train_len=train_len, eval_len=eval_len, **options
    ), None


def check_rope_row(entry, L, lengths, head_dim, attention_impl, fail=ValueError) -> None:
    """Checks an entry of config.rope_scalings for a model trained at L and read at `lengths`:
    its dict at every length past L (at 2L at least), as the model will check it."""
    kind, _ = rope_scaling_entry(entry, fail)
    if kind in REMAP_KINDS and attention_impl not in FAR_IMPLEMENTATIONS:
        raise fail(
            f"config.rope_scalings entry {entry!r} scores its far pairs with a second query/key "
            f"pair, which config.eval.attention_impl={attention_impl!r} does not compute; use "
            f"one of {', '.join(map(repr, FAR_IMPLEMENTATIONS))}"
        )
    for T in sorted({2 * L, *(T for T in lengths if T > L)}):
        try:
            scaling, remap = rope_row_at(entry, L, T)
            if scaling is not None:
                rotary.validate_rope_scaling(scaling, head_dim)
        except ValueError as err:
            raise fail(f"config.rope_scalings entry {entry!r} at length {T}: {err}") from None


def rope_scaling_entry(entry: str, fail=ValueError) -> tuple[str, dict[str, float]]:
    """(kind, options) of an entry of config.rope_scalings: "kind" or "kind:key=value,...".

    The options are the kind's defaults (`ROPE_OPTIONS`) updated by the entry's, so "dynamic" is
    {"factor": 2.0} and "yarn:beta_fast=16" is {"beta_fast": 16.0, "beta_slow": 1.0}.
    """
    kind, _, rest = str(entry).partition(":")
    if kind not in ROPE_KINDS:
        raise fail(
            f"config.rope_scalings has {entry!r}; allowed: {', '.join(ROPE_KINDS)}, optionally "
            "with options as 'yarn:beta_fast=16,beta_slow=2' or 'dynamic:factor=4'"
        )
    options = dict(ROPE_OPTIONS[kind])
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in ROPE_OPTIONS[kind]:
            allowed = ", ".join(ROPE_OPTIONS[kind]) or "none"
            raise fail(
                f"config.rope_scalings entry {entry!r}: {item!r} is not key=value with a key of "
                f"{kind!r} (allowed: {allowed})"
            )
        try:
            options[key] = float(value)
        except ValueError:
            raise fail(
                f"config.rope_scalings entry {entry!r}: {key}={value!r} is not a number"
            ) from None
    return kind, options


def family_entry(
    entry: str, config: ml_collections.ConfigDict | None = None, fail=ValueError
) -> tuple[str, dict[str, Any]]:
    """(family, {model key: value}) of an entry of config.families: "fire", or a family with
    settings of its own, "fire:fire_init_c=3.2,fire_init_L=64" (keys of the `model` section).

    An entry is also a layer pattern (`model.layer_pattern`, docs/training.md): entries joined by
    "|" are cycled over the layers ("rope:window=32|nope": a sliding-window RoPE layer, then a
    global NoPE one), and an entry with a per-layer key ("nope:ssmax=True", "rope:window=32")
    puts that layer on every layer. The row's family is then its first entry's.

    Such an entry is a row of its own, trained in its own directory (`entry_dir`): a settings
    sweep is an experiment whose families are one family under several settings.
    """
    parts = str(entry).split("|")
    try:  # the package's one parser of "family:key=value,..." (model.layer_pattern's too)
        parsed = [pattern.parse_entry(part, where="config.families") for part in parts]
    except ValueError as err:
        raise fail(f"{err}") from None
    name, values = parsed[0]
    if len(parts) > 1 or any(key in pattern.LAYER_KEYS for _, v in parsed for key in v):
        return name, {"layer_pattern": tuple(parts)}  # validated with the model's config
    overrides = {}
    for key, value in values.items():
        known = config is None or key in config.model
        if not known or key in ("position",):
            raise fail(
                f"config.families entry {entry!r}: {key!r} is not a key of the "
                "model section (e.g. fire_init_c=3.2; the family is the part before ':')"
            )
        if key in families.keys() and name not in families.owners(key):
            raise fail(
                f"config.families entry {entry!r}: model.{key} is a setting of "
                f"{', '.join(families.owners(key))}, not of {name}"
            )
        overrides[key] = value
    return name, overrides


def row_stem(name: str) -> str:
    """A row's name as its evaluation files spell it (`<stem>.<evaluator>.json`): no ':' or '/'."""
    return name.replace(":", "@").replace("/", "_")


def entry_dir(workdir: pathlib.Path, entry: str) -> pathlib.Path:
    """Where an entry of config.families trains: WORKDIR/<family>, or WORKDIR/<family>@<k=v,...>."""
    return workdir / str(entry).replace(":", "@")


FINETUNE_KINDS = ("linear", "ntk", "yarn")  # "dynamic" rescales per window: nothing fixed to tune


def finetune_enabled(config: ml_collections.ConfigDict) -> bool:
    """Whether the config asks for `rope+<kind>+ft` rows (a missing block is off)."""
    ft = config.get("finetune")
    return bool(ft is not None and ft.enabled and ft.kinds)


def finetune_multiple(config: ml_collections.ConfigDict) -> int:
    return int(config.finetune.multiple)


def finetune_batch_size(config: ml_collections.ConfigDict) -> int:
    """`finetune.batch_size`, or when 0 the training's tokens per step: train.batch_size //
    multiple windows (at least 1)."""
    ft = config.finetune
    if ft.batch_size:
        return int(ft.batch_size)
    return max(1, int(config.train.batch_size) // finetune_multiple(config))


def finetune_scaling(config: ml_collections.ConfigDict, kind: str) -> dict[str, Any]:
    """The fixed Hugging Face `rope_scaling` a `rope+<kind>+ft` row is fine-tuned and evaluated
    under: factor = finetune.multiple at every length."""
    L = int(config.data.seq_len)
    return {
        "rope_type": kind,
        "factor": float(finetune_multiple(config)),
        "original_max_position_embeddings": L,
    }


def finetune_config(
    config: ml_collections.ConfigDict, train_config: ml_collections.ConfigDict, kind: str
) -> ml_collections.ConfigDict:
    """The training config of a `rope+<kind>+ft` fine-tune of the run `train_config` trained: a
    `posattn.train` run started from that run's parameters (`init_from`).

    Its model under `finetune_scaling(kind)`; windows of `finetune.multiple` x L,
    `finetune_batch_size` of them a step, from the training seed's batch stream at steps
    train.steps, train.steps + 1, ... (`data.batch_offset` = train.steps - 1); the training's
    optimizer with fresh moments, `finetune.warmup_steps` of linear warmup then a constant
    `finetune.learning_rate` (min_lr_ratio 1); no evaluation or profile of its own.
    """
    ft, L = config.finetune, int(config.data.seq_len)
    out = ml_collections.ConfigDict(train_config.to_dict())
    out.model.rope_scaling = finetune_scaling(config, kind)
    out.data.seq_len = finetune_multiple(config) * L
    out.data.batch_offset = int(train_config.train.steps) - 1
    out.train.update(
        steps=int(ft.steps),
        learning_rate=float(ft.learning_rate),
        warmup_steps=int(ft.warmup_steps),
        min_lr_ratio=1.0,
        batch_size=finetune_batch_size(config),
        eval_every=0,
        profile_steps=(),
    )
    return out


def check_finetune_keys(config: ml_collections.ConfigDict) -> None:
    """Validates the keys of the `finetune` block (kinds, multiple, steps, warmup, batch size,
    learning rate), for the trained RoPE entries' fine-tunes and a checkpoint's alike."""
    fail = config_lib.ConfigError
    ft = config.finetune
    bad = [k for k in ft.kinds if k not in FINETUNE_KINDS]
    if bad:
        why = (
            " ('dynamic' recomputes its factor from each window's length, so there is no fixed "
            "scaling to fine-tune under)"
            if "dynamic" in bad
            else ""
        )
        raise fail(
            f"config.finetune.kinds has {bad[0]!r}{why}; allowed: {', '.join(FINETUNE_KINDS)} "
            "(or set config.finetune.enabled=False)"
        )
    if len(set(ft.kinds)) != len(ft.kinds):
        raise fail(f"config.finetune.kinds={tuple(ft.kinds)!r} repeats a kind")
    m = ft.multiple
    if isinstance(m, bool) or not isinstance(m, int | float) or m != int(m) or m < 2:
        raise fail(
            f"config.finetune.multiple={m!r} must be an integer >= 2 (the fine-tune length is "
            "multiple x data.seq_len)"
        )
    if not (isinstance(ft.steps, int) and ft.steps >= 1):
        raise fail(f"config.finetune.steps={ft.steps!r} must be a positive integer")
    for key in ("warmup_steps", "batch_size"):
        if not (isinstance(ft[key], int) and ft[key] >= 0):
            raise fail(
                f"config.finetune.{key}={ft[key]!r} must be an integer >= 0"
                + (" (0: train.batch_size // multiple)" if key == "batch_size" else "")
            )
    if not (isinstance(ft.learning_rate, int | float) and ft.learning_rate > 0):
        raise fail(f"config.finetune.learning_rate={ft.learning_rate!r} must be a number > 0")


def check_finetune(config: ml_collections.ConfigDict) -> None:
    """Validates the `finetune` block (the rope+<kind>+ft rows) before any compute."""
    if not finetune_enabled(config):
        return
    fail = config_lib.ConfigError
    ft, m = config.finetune, config.finetune.multiple
    check_finetune_keys(config)
    rotary_entries = [e for e in config.families if is_rotary(e)]
    if not rotary_entries:
        raise fail(
            "config.finetune needs a RoPE entry in config.families (e.g. 'rope'; the rows "
            "fine-tune each trained RoPE model); add one or set config.finetune.enabled=False"
        )
    length = finetune_multiple(config) * int(config.data.seq_len)
    longest = int(config.data.get("passkey_digits", (1, probes.TRAIN_DIGITS))[1])
    if config.data.passkey_fraction and length < probes.passkey_min_length(longest):
        raise fail(
            f"config.finetune.multiple={m}: fine-tune windows of {length} cannot hold the "
            "training passkeys; raise it"
        )
    head_dim = config_lib.validate(family_config(config, rotary_entries[0])).head_dim
    for kind in ft.kinds:
        try:
            rotary.validate_rope_scaling(finetune_scaling(config, kind), head_dim)
        except ValueError as e:
            raise fail(f"config.finetune.kinds: {kind!r} at factor {m}: {e}") from None
    for entry in rotary_entries:  # each fine-tune is a training run: its config checked too
        for kind in ft.kinds:
            try:
                config_lib.validate(finetune_config(config, family_config(config, entry), kind))
            except config_lib.ConfigError as e:
                raise fail(f"config.finetune ({entry}+{kind}+ft): {e}") from None


def family_config(config: ml_collections.ConfigDict, entry: str) -> ml_collections.ConfigDict:
    """The training config of one entry of config.families: the shared model/data/train sections,
    its position and its own settings."""
    out = ml_collections.ConfigDict({k: config[k].to_dict() for k in ("model", "data", "train")})
    name, overrides = family_entry(entry, config)
    out.model.position = name
    for key, value in overrides.items():
        out.model[key] = value
    config_lib.validate(out)
    return out


def is_rotary(entry: str) -> bool:
    """Whether an entry of config.families is a RoPE family (its family registers a rotary
    position signal), so that eval-time scalings and fine-tunes apply to it."""
    name, _, _ = str(entry).partition(":")
    return bool(families.get(name).rotary)
