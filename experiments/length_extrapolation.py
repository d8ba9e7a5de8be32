"""Length extrapolation: train every position family identically at length L, evaluate at L..16L.

    python experiments/length_extrapolation.py --workdir runs/extrapolation
    python experiments/length_extrapolation.py --config configs/extrapolation_paper.py \
        --config.data.corpus=/data/wikitext103 --workdir runs/extrapolation_paper

Question: past the training length, which families keep their loss (ALiBi, T5, Kerple,
Sandwich, FIRE), which break (sinusoidal, RoPE, NoPE), which cannot run at all (learned), how much
eval-time RoPE scaling rescues, and whether the ones that keep their loss also *use* the longer
context (per-position loss, passkey retrieval, copying) or only tolerate it.

Protocol: every family is trained by `posattn.train.train_and_evaluate` with the same config
except `model.position`, so all see the same batches (a pure function of seed and step, passkey
rows included) and the same initialisation seed; each family's run lives in `WORKDIR/<family>/`
(checkpointed, resumable; a finished one is skipped, and so is its evaluation once
`WORKDIR/<family>/eval.json` holds it for the same evaluation settings).

Provenance: `trained.json` and `eval.json` record the commit, whether the tree was clean and a
hash of the code that produced them (`src/posattn/**/*.py`, this script and `configs/*.py`), and
the corpus hash. A run trained by other code (or on another corpus) is refused unless `--reuse` is
given; an evaluation made by other code is redone (or, with `--reuse`, kept). results.json lists
each row's own training and evaluation provenance, so reused numbers never carry the current
commit. Evaluation
(`posattn.eval.lengths`): mean next-byte NLL on non-overlapping held-out windows of each length, the
per-position NLL at the longest length, passkey exact-match accuracy per (length, depth), and
copy accuracy per length. RoPE is also evaluated with eval-time scaling (rows `rope+linear`,
`rope+ntk`, `rope+dynamic`, `rope+yarn`): the trained RoPE parameters with the Hugging Face
`rope_scaling` {rope_type, factor = eval_len / L, original_max_position_embeddings = L}
(`posattn.eval.lengths.rope_scaling_row`); at eval_len <= L they are plain RoPE. "dynamic" keeps
Hugging Face's meaning: a configured factor s (2 by default) and the base recomputed from the
window length T it reads, b (s T / L - (s - 1))^(d/(d-2)). An entry may set a kind's options
("yarn:beta_fast=16,beta_slow=2", "dynamic:factor=4"; `ROPE_OPTIONS`), giving the row
`rope+<entry>`, so one run compares settings of the same trained model.
Rows `rope+<kind>+ft` (kinds
linear, ntk, yarn; `finetune` in the config) run position interpolation as Chen et al. 2023 do,
with a short fine-tune: the trained RoPE params fine-tuned at `finetune.multiple` x L under the
scaling of factor `finetune.multiple`, evaluated with that factor at every length (cached in
`WORKDIR/rope/finetune/<kind>-seed<k>.npz`).

Writes `WORKDIR/results.json` (`train_len`, `corpus`, `families`: {name: {eval_len, loss,
passkey_acc}}, plus extra top-level keys), `results.md` and PNGs.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np
from flax import nnx

from posattn import cli, families, rotary
from posattn import config as config_lib
from posattn import data as data_lib
from posattn.attention import IMPLEMENTATIONS
from posattn.data import probes
from posattn.eval import attention_stats, heldout, intervals, retrieval, scoring, summary
from posattn.eval import lengths as evaluate
from posattn.nn import pattern
from posattn.nn.model import TransformerLM
from posattn.train import (
    NonFiniteLossError,
    WorkdirBusyError,
    restore_trained,
    train_and_evaluate,
)
from posattn.train import steps as steps_lib

__all__ = ["eval_lengths", "family_config", "main", "run"]

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "configs" / "extrapolation.py"
ROPE_KINDS = ("linear", "ntk", "dynamic", "yarn")
COMMAND = cli.Command(
    "python experiments/length_extrapolation.py",
    "Trains every family at length L and evaluates it at multiples of L: results.json, "
    "results.md and plots in the workdir (a rerun reuses the trained families).",
    default_config=DEFAULT_CONFIG,
    flags=(
        cli.WORKDIR,
        cli.Flag(
            "reuse",
            "report finished runs and evaluations made by other code (or on another corpus); "
            "results.json then lists each row's own commit",
            False,
            bool,
        ),
    ),
)


# ----------------------------------------------------------------------------------------------
# Configuration.


def eval_lengths(config: ml_collections.ConfigDict) -> list[int]:
    """`eval.lengths` if given, else `eval.multiples` x the training length."""
    if config.eval.lengths:
        return [int(x) for x in config.eval.lengths]
    return [int(m * config.data.seq_len) for m in config.eval.multiples]


def induction_gaps(config: ml_collections.ConfigDict) -> list[int]:
    """`induction.gaps` if given, else `induction.gap_multiples` x the training length."""
    if config.induction.gaps:
        return [int(x) for x in config.induction.gaps]
    return [int(round(m * config.data.seq_len)) for m in config.induction.gap_multiples]


def check_evaluation(config: ml_collections.ConfigDict, lengths: list[int]) -> None:
    """Validates the evaluation keys (`eval`, `passkey`, `induction`) before any compute."""
    fail = config_lib.ConfigError
    ev = config.eval
    for key in ("max_tokens", "batch_size", "per_position_bins", "bootstrap", "sliding_stride"):
        if not (isinstance(ev[key], int) and ev[key] > 0):
            raise fail(f"config.eval.{key}={ev[key]!r} must be a positive integer")
    for key in ("sliding_tokens", "sliding_max_tokens", "attention_windows"):
        if not (isinstance(ev[key], int) and ev[key] >= 0):
            raise fail(f"config.eval.{key}={ev[key]!r} must be an integer >= 0")
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
    entries = [family_entry(e, config, fail) for e in config.families]
    if len(set(config.families)) != len(config.families):
        raise fail(f"config.families={tuple(config.families)!r} repeats an entry")
    for entry in config.families:
        try:
            config_lib.validate(family_config(config, entry))
        except config_lib.ConfigError as err:
            raise fail(f"config.families entry {entry!r}: {err}") from None
    scalings = [rope_scaling_entry(e, fail) for e in config.rope_scalings]
    names = [f"rope+{e}" for e in config.rope_scalings]
    if len(set(names)) != len(names):
        raise fail(f"config.rope_scalings={tuple(config.rope_scalings)!r} repeats an entry")
    L = config.data.seq_len
    for entry, (kind, options) in zip(config.rope_scalings, scalings, strict=True):
        try:  # the dict at 2L, as the model will check it
            rotary.validate_rope_scaling(
                evaluate.rope_scaling_row(kind, train_len=L, eval_len=2 * L, **options),
                config.model.d_model // config.model.num_heads,
            )
        except ValueError as err:
            raise fail(f"config.rope_scalings entry {entry!r}: {err}") from None
    if config.rope_scalings and not any(name == "rope" for name, _ in entries):
        raise fail(
            "config.rope_scalings needs 'rope' in config.families "
            "(the rows rescale the trained RoPE model)"
        )
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


# Options an entry of config.rope_scalings may set per kind ("yarn:beta_fast=16,beta_slow=2"),
# and the defaults. "dynamic" keeps Hugging Face's meaning: a configured factor (2, as in HF's
# documentation), the base recomputed from the length the model reads; linear / ntk / yarn take the
# factor eval_len / L.
ROPE_OPTIONS = {
    "linear": {},
    "ntk": {},
    "dynamic": {"factor": 2.0},
    "yarn": {"beta_fast": 32.0, "beta_slow": 1.0},
}


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

    Such an entry is a row of its own, trained in its own directory (`entry_dir`): a settings
    sweep is an experiment whose families are one family under several settings.
    """
    try:  # the package's one parser of "family:key=value,..." (model.layer_pattern's too)
        name, values = pattern.parse_entry(str(entry), where="config.families")
    except ValueError as err:
        raise fail(f"{err}") from None
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


def check_finetune(config: ml_collections.ConfigDict) -> None:
    """Validates the `finetune` block (the rope+<kind>+ft rows) before any compute."""
    if not finetune_enabled(config):
        return
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
    if "rope" not in config.families:
        raise fail(
            "config.finetune needs 'rope' in config.families (the rows fine-tune the trained "
            "RoPE model); add it or set config.finetune.enabled=False"
        )
    m = ft.multiple
    if isinstance(m, bool) or not isinstance(m, int | float) or m != int(m) or m < 2:
        raise fail(
            f"config.finetune.multiple={m!r} must be an integer >= 2 (the fine-tune length is "
            "multiple x data.seq_len)"
        )
    for key in ("steps",):
        if not (isinstance(ft[key], int) and ft[key] >= 1):
            raise fail(f"config.finetune.{key}={ft[key]!r} must be a positive integer")
    for key in ("warmup_steps", "batch_size"):
        if not (isinstance(ft[key], int) and ft[key] >= 0):
            raise fail(
                f"config.finetune.{key}={ft[key]!r} must be an integer >= 0"
                + (" (0: train.batch_size // multiple)" if key == "batch_size" else "")
            )
    if not (isinstance(ft.learning_rate, int | float) and ft.learning_rate > 0):
        raise fail(f"config.finetune.learning_rate={ft.learning_rate!r} must be a number > 0")
    length = finetune_multiple(config) * int(config.data.seq_len)
    if config.data.passkey_fraction and length < probes.passkey_min_length(probes.TRAIN_DIGITS):
        raise fail(
            f"config.finetune.multiple={m}: fine-tune windows of {length} cannot hold the "
            "training passkeys; raise it"
        )
    head_dim = config_lib.validate(family_config(config, "rope")).head_dim
    for kind in ft.kinds:
        try:
            rotary.validate_rope_scaling(finetune_scaling(config, kind), head_dim)
        except ValueError as e:
            raise fail(f"config.finetune.kinds: {kind!r} at factor {m}: {e}") from None


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


# Evaluation keys that change how a row's cached per-file sums are combined or computed, not
# what they are: a change reuses `eval.json`.
_NOT_IN_SUMS = ("batch_size", "bootstrap", "reference")


def _eval_settings(config, lengths) -> dict:
    """Everything an evaluation result depends on besides the trained parameters."""
    return {
        "lengths": lengths,
        "rope_scalings": list(config.rope_scalings),
        **{f"eval.{k}": v for k, v in config.eval.to_dict().items() if k not in _NOT_IN_SUMS},
        **{f"passkey.{k}": v for k, v in config.passkey.to_dict().items()},
        **{f"copy.{k}": v for k, v in config.copy.to_dict().items()},
        **{f"induction.{k}": v for k, v in config.induction.to_dict().items()},
    }


# ----------------------------------------------------------------------------------------------
# Training and restoring one family.


class Interrupted(RuntimeError):
    """A family's training stopped before its last step (preempted); rerunning resumes it."""


class ProducedByOtherCode(RuntimeError):
    """A finished run in the workdir was trained by other code or on another corpus."""


def _same_origin(saved: dict, code: dict) -> bool:
    """Whether a trained.json/eval.json record was produced by this code on this corpus."""
    keys = ("code_sha256", "corpus_sha256")
    return all(saved.get("code", {}).get(k) == code[k] for k in keys)


def _describe_origin(saved: dict) -> str:
    origin = saved.get("code") or {}
    if not origin:
        return "code that did not record its commit"
    clean = {True: "clean", False: "with uncommitted changes", None: "tree state unknown"}
    return (
        f"commit {str(origin.get('commit'))[:12]} ({clean[origin.get('clean')]}), code sha256 "
        f"{str(origin.get('code_sha256'))[:12]}, "
        f"corpus sha256 {str(origin.get('corpus_sha256'))[:12]}"
    )


def _finished_run(train_config, fam_dir: pathlib.Path, code: dict, *, reuse: bool) -> dict | None:
    """`trained.json`'s record when it says this exact config finished in `fam_dir`, else None.

    Raises:
      ProducedByOtherCode: that run was trained by other code (or on another corpus) and `reuse`
        is off; the message says how to proceed.
    """
    marker = fam_dir / "trained.json"
    if not marker.exists():
        return None
    info = json.loads(marker.read_text())
    if info.get("config") != json.loads(config_lib.to_json(train_config)):
        return None
    if _same_origin(info, code) or reuse:
        return info
    raise ProducedByOtherCode(
        f"{fam_dir} was trained by {_describe_origin(info)}; this is commit "
        f"{str(code['commit'])[:12]}, code sha256 {code['code_sha256'][:12]}, corpus sha256 "
        f"{code['corpus_sha256'][:12]}. Rerun with --reuse to report its numbers (results.json "
        f"then lists that row's own commit), or move {fam_dir} away to retrain it with this code."
    )


def _train(train_config, fam_dir: pathlib.Path, code: dict, *, reuse: bool = False) -> dict:
    """Trains one family unless `trained.json` says this exact config already finished there
    (made by this code, or by any code with `reuse`: see `_finished_run`)."""
    info = _finished_run(train_config, fam_dir, code, reuse=reuse)
    if info is not None:
        return info
    config = json.loads(config_lib.to_json(train_config))
    start = time.perf_counter()
    result = train_and_evaluate(
        train_config, fam_dir
    )  # resumes; refuses a workdir of another config
    if not result.get("finished"):
        raise Interrupted(
            f"training in {fam_dir} stopped at step {result.get('step')}; rerun to resume"
        )
    info = {
        "seconds": round(time.perf_counter() - start, 1),
        "final_train_loss": result.get("loss"),
        "steps": int(train_config.train.steps),
        "config": config,
        "code": code,
    }
    (fam_dir / "trained.json").write_text(json.dumps(info) + "\n")
    return info


def restore_model(train_config, fam_dir: pathlib.Path, *, attention_impl: str):
    """(cfg, graphdef, params, constants) of the finished run in `fam_dir`, with
    `attention_impl`."""
    restored = restore_trained(train_config, fam_dir / "checkpoints")
    if restored is None or restored[2] != int(train_config.train.steps):
        raise RuntimeError(
            f"{fam_dir} holds no finished checkpoint; delete {fam_dir / 'trained.json'} and rerun"
        )
    cfg, state, _ = restored
    cfg = dataclasses.replace(cfg, attention_impl=attention_impl)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(params=0))))
    return cfg, graphdef, state["params"], state["constants"]


# ----------------------------------------------------------------------------------------------
# Evaluating one model (a family, or RoPE under one scaling).


class EvalText(NamedTuple):
    """The held-out tokens and the plan every row scores (`posattn.eval.heldout`)."""

    val: np.ndarray
    plan: heldout.EvalPlan
    unit: str


def eval_text(config: ml_collections.ConfigDict, corpus, lengths: list[int]) -> EvalText:
    """Draws the chunks and sliding blocks every length of every row scores."""
    ev = config.eval
    held = heldout.held_out_units(corpus, block=2 * (max(lengths) + 1))
    plan = heldout.make_plan(
        held,
        max_len=max(lengths),
        tokens=int(ev.max_tokens),
        sliding_tokens=int(ev.sliding_tokens),
        stride=int(ev.sliding_stride),
        seed=int(ev.seed),
    )
    return EvalText(held.tokens, plan, held.unit)


def _batch_tokens(config, lengths) -> int:
    """Tokens per forward pass: `eval.batch_size` windows of the longest length."""
    return int(config.eval.batch_size) * max(lengths)


def _nan_to_none(grid) -> list:
    return [[None if np.isnan(x) else float(x) for x in row] for row in np.asarray(grid)]


def _attention_windows(text: EvalText, length: int, count: int) -> np.ndarray:
    """`count` windows of `length` inputs from distinct chunks (the first of each chunk)."""
    windows, _ = text.plan.windows(text.val, length)
    per_chunk = text.plan.max_len // length
    return windows[::per_chunk][:count, :-1]


def _evaluate_model(model, text: EvalText, config, lengths, *, only: list[int] | None = None):
    """Per-unit loss sums (both protocols), per-position curve, probes and attention statistics
    at `only` (default: every length)."""
    graphdef, params, constants = model
    todo = lengths if only is None else only
    ev, L = config.eval, int(config.data.seq_len)
    batch_tokens = _batch_tokens(config, lengths)
    scores = scoring.score_lengths(
        graphdef,
        params,
        constants,
        text.val,
        text.plan,
        lengths=todo,
        train_len=L,
        batch_tokens=batch_tokens,
        curve_bins=ev.per_position_bins,
        curve_length=lengths[-1],
        sliding_max_tokens=int(ev.sliding_max_tokens),
    )
    curve = next((s.pop("curve") for s in scores if s is not None and "curve" in s), None)

    def as_lists(s):
        return None if s is None else {k: _to_list(v) for k, v in s.items()}

    out = {
        "eval_len": todo,
        "scores": [as_lists(s) for s in scores],
        "curve": as_lists(curve),
    }
    if ev.attention_windows:
        cfg = evaluate.model_config_of(graphdef, params, constants)
        out["attention"] = [
            attention_stats.attention_stats(
                graphdef,
                params,
                constants,
                _attention_windows(text, length, ev.attention_windows),
                train_len=L,
            )
            if evaluate.max_length(cfg) is None or length <= evaluate.max_length(cfg)
            else None
            for length in todo
        ]
    if config.passkey.enabled:
        grids = retrieval.passkey_scores(
            graphdef,
            params,
            constants,
            lengths=todo,
            depths=list(config.passkey.depths),
            samples=config.passkey.samples,
            digits=config.passkey.digits,
            seed=ev.seed,
            batch_tokens=batch_tokens,
            distractors=bool(config.passkey.distractors),
        )
        out["passkey"] = {k: _nan_to_none(v) for k, v in grids.items()}
        out["passkey_grid"] = out["passkey"]["acc"]
    if config.induction.enabled:
        grids = retrieval.induction_scores(
            graphdef,
            params,
            constants,
            text.val,
            lengths=todo,
            gaps=induction_gaps(config),
            span=config.induction.span,
            samples=config.induction.samples,
            seed=ev.seed,
            batch_tokens=batch_tokens,
        )
        out["induction"] = {k: _nan_to_none(v) for k, v in grids.items()}
    if config.copy.enabled:
        out["copy_acc"] = evaluate.copy_accuracy(
            graphdef,
            params,
            constants,
            text.val,
            lengths=todo,
            samples=config.copy.samples,
            segment=config.copy.segment,
            seed=ev.seed,
            batch_size=ev.batch_size,
        )
    return out


def _to_list(value):
    return value.tolist() if isinstance(value, np.ndarray) else value


_PER_LENGTH = ("scores", "attention", "copy_acc")  # lists over lengths
_GRIDS = ("passkey", "induction")  # dicts of [length][cell] grids


def _rope_rows(cfg, params, plain: dict, text, config, lengths) -> dict[str, dict]:
    """rope+<kind> rows: plain RoPE up to L, the trained params under each scaling past it."""
    L = config.data.seq_len
    rows = {}
    for entry in config.rope_scalings:
        kind, options = rope_scaling_entry(entry)
        row = json.loads(json.dumps(plain))  # a deep copy: the <= L entries are plain RoPE's
        row["curve"] = None
        for i, length in enumerate(lengths):
            scaling = evaluate.rope_scaling_row(kind, train_len=L, eval_len=length, **options)
            if scaling is None:
                continue  # <= L: the plain RoPE numbers
            graphdef, constants = evaluate.with_rope_scaling(cfg, scaling)
            one = _evaluate_model(
                (graphdef, params, constants), text, config, lengths, only=[length]
            )
            for key in _PER_LENGTH:
                if key in one:
                    row[key][i] = one[key][0]
            for key in _GRIDS:
                if key in one:
                    for name, grid in one[key].items():
                        row[key][name][i] = grid[0]
            if "passkey" in one:
                row["passkey_grid"] = row["passkey"]["acc"]
            if length == lengths[-1]:
                row["curve"] = one["curve"]
        rows[f"rope+{entry}"] = row
    return rows


# ----------------------------------------------------------------------------------------------
# Position interpolation with a fine-tune: rope+<kind>+ft rows.


def _params_sha256(params) -> str:
    """A content hash of a parameter tree (which trained model a fine-tune started from)."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        array = np.asarray(jax.device_get(leaf))
        digest.update(str((array.shape, array.dtype)).encode() + b"\0")
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def _finetune_settings(config, train_config, kind: str, seed: int, trained_sha: str) -> dict:
    """Everything a fine-tuned parameter file depends on besides the code and the corpus."""
    ft = config.finetune
    settings = {
        "scaling": finetune_scaling(config, kind),
        "multiple": finetune_multiple(config),
        "steps": int(ft.steps),
        "learning_rate": float(ft.learning_rate),
        "warmup_steps": int(ft.warmup_steps),
        "batch_size": finetune_batch_size(config),
        "seed": int(seed),
        "trained": json.loads(config_lib.to_json(train_config)),
        "trained_params_sha256": trained_sha,
    }
    return json.loads(json.dumps(settings))


def finetune_params(cfg, params, corpus, config, kind: str, *, seed: int) -> tuple[Any, dict]:
    """Fine-tunes trained RoPE `params` at `finetune.multiple` x L under the fixed scaling of
    `kind` (factor = multiple), as position interpolation is run by Chen et al. 2023.

    The training's optimizer (`posattn.train.steps`: AdamW, clipping, weight decay) with fresh
    moments, `finetune.warmup_steps` of linear warmup then a constant `finetune.learning_rate`;
    batches of `finetune_batch_size` windows (the training's tokens per step) from the training
    corpus by `train_batch` with the training seed at steps train.steps, train.steps + 1, ...
    (batches the pretraining never drew), passkey rows mixed in as the training config asks.

    Returns:
      (fine-tuned params, {"seconds", "first_train_loss", "final_train_loss"}).
    """
    ft, L = config.finetune, int(config.data.seq_len)
    cfg = dataclasses.replace(cfg, attention_impl=config.model.attention_impl)
    graphdef, constants = evaluate.with_rope_scaling(cfg, finetune_scaling(config, kind))
    optim = dataclasses.replace(
        steps_lib.OptimConfig.from_config(config.train),
        learning_rate=float(ft.learning_rate),
        total_steps=int(ft.steps),
        warmup_steps=int(ft.warmup_steps),
        min_lr_ratio=1.0,  # constant after the warmup
    )
    tx = steps_lib.make_optimizer(optim)
    params = jax.tree.map(lambda x: jax.numpy.array(x, copy=True), params)  # donated below
    state = {
        "params": params,
        "constants": constants,
        "opt_state": tx.init(jax.tree.map(lambda p: p.astype(np.float32), params)),
        "step": jax.numpy.zeros((), jax.numpy.int32),
    }
    step_fn = jax.jit(functools.partial(steps_lib.train_step, graphdef, optim), donate_argnums=0)
    options = data_lib.batch_options(config.data, causal=cfg.causal, vocab_size=cfg.vocab_size)
    shape = dict(batch_size=finetune_batch_size(config), seq_len=finetune_multiple(config) * L)
    start, losses = time.perf_counter(), []
    for i in range(int(ft.steps)):
        batch = data_lib.train_batch(
            corpus, seed=seed, step=int(config.train.steps) + i, **shape, **options
        )
        state, metrics = step_fn(state, batch)
        losses.append(metrics["loss"])
    losses = [float(x) for x in jax.device_get(losses)]
    if not all(np.isfinite(losses)):
        bad = next(i for i, x in enumerate(losses) if not np.isfinite(x))
        raise NonFiniteLossError(
            f"rope+{kind}+ft: the fine-tune's loss is {losses[bad]} at step {bad}; lower "
            "config.finetune.learning_rate or raise config.finetune.warmup_steps"
        )
    info = {
        "seconds": round(time.perf_counter() - start, 1),
        "first_train_loss": losses[0],
        "final_train_loss": losses[-1],
    }
    return state["params"], info


def _save_npz(path: pathlib.Path, arrays: dict[str, np.ndarray]) -> None:
    """Writes `arrays` to `path` atomically (a temporary file in the same folder, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _finetuned(
    config, cfg, params, corpus, kind, seed, fam_dir, train_config, code, *, reuse=False
) -> tuple[Any, dict]:
    """(params, info) of `finetune_params`, from `fam_dir/finetune/<kind>-seed<seed>.npz` when it
    holds these settings (the finetune block, the training config, the trained parameters' hash)
    and was made by this code (or by any code, with `reuse`); else fine-tuned now and saved."""
    path = fam_dir / "finetune" / f"{kind}-seed{seed}.npz"
    settings = _finetune_settings(config, train_config, kind, seed, _params_sha256(params))
    leaves, treedef = jax.tree.flatten(params)
    if path.exists():
        with np.load(path, allow_pickle=False) as saved:
            meta = json.loads(str(saved["meta"]))
            if meta.get("settings") == settings and (_same_origin(meta, code) or reuse):
                tuned = [
                    jax.numpy.asarray(saved[f"p{i}"], dtype=leaf.dtype)
                    for i, leaf in enumerate(leaves)
                ]
                return jax.tree.unflatten(treedef, tuned), meta["info"]
        if meta.get("settings") == settings:
            _say(f"rope+{kind}+ft: {path} was made by {_describe_origin(meta)}; fine-tuning again")
    _say(
        f"rope+{kind}+ft: fine-tuning seed {seed} for {config.finetune.steps} steps at "
        f"{finetune_multiple(config) * int(config.data.seq_len)}"
    )
    tuned, info = finetune_params(cfg, params, corpus, config, kind, seed=seed)
    meta = {"settings": settings, "code": code, "info": info}
    arrays = {
        f"p{i}": np.asarray(jax.device_get(x), np.float32)
        for i, x in enumerate(jax.tree.leaves(tuned))
    }
    _save_npz(path, {**arrays, "meta": np.array(json.dumps(meta))})
    return tuned, info


def _finetune_rows(
    cfg, params, text, config, lengths, *, corpus, fam_dir, train_config, code, seed, reuse=False
) -> dict[str, dict]:
    """rope+<kind>+ft rows: the trained RoPE params fine-tuned at multiple x L under the scaling
    of factor `finetune.multiple`, evaluated with that same scaling at every length (<= L
    included: that is the model a position-interpolation fine-tune leaves)."""
    rows = {}
    for kind in config.finetune.kinds:
        tuned, info = _finetuned(
            config, cfg, params, corpus, kind, seed, fam_dir, train_config, code, reuse=reuse
        )
        graphdef, constants = evaluate.with_rope_scaling(cfg, finetune_scaling(config, kind))
        row = _evaluate_model((graphdef, tuned, constants), text, config, lengths)
        row["finetune"] = {
            "steps": int(config.finetune.steps),
            "multiple": finetune_multiple(config),
            "seed": int(seed),
            **info,
        }
        rows[f"rope+{kind}+ft"] = row
    return rows


def _finetune_eval_settings(config) -> dict:
    """What the rope family's eval.json depends on from the finetune block ({} when off)."""
    if not finetune_enabled(config):
        return {}
    return {"finetune": {**config.finetune.to_dict(), "batch_size": finetune_batch_size(config)}}


def _merge_finetune_info(infos: list[dict]) -> dict:
    """One row's fine-tune record over seeds: seconds summed, final loss mean and per seed."""
    first = infos[0]
    return {
        "steps": first["steps"],
        "multiple": first["multiple"],
        "seconds": round(sum(i["seconds"] for i in infos), 1),
        "final_train_loss": float(np.mean([i["final_train_loss"] for i in infos])),
        "final_train_loss_seeds": [i["final_train_loss"] for i in infos],
        "seeds": [i["seed"] for i in infos],
    }


def _evaluate_family(
    config,
    family,
    fam_dir,
    text,
    lengths,
    train_config,
    code: dict,
    *,
    reuse: bool = False,
    corpus=None,
) -> tuple[dict[str, dict], dict]:
    """(rows, the code that evaluated them): from eval.json when it holds these settings and was
    made by this code (or by any code, with `reuse`), else evaluated now. `corpus` (its train
    split) is what the rope+<kind>+ft rows fine-tune on."""
    cache = fam_dir / "eval.json"
    tune = family == "rope" and finetune_enabled(config)
    settings = {
        **_eval_settings(config, lengths),
        "plan": text.plan.fingerprint,
        "trained": json.loads(config_lib.to_json(train_config)),
        **(_finetune_eval_settings(config) if tune else {}),
    }
    settings = json.loads(json.dumps(settings))  # as eval.json holds them (tuples as lists)
    if cache.exists():
        saved = json.loads(cache.read_text())
        if saved.get("settings") == settings and (_same_origin(saved, code) or reuse):
            return saved["rows"], saved.get("code") or {}
        if saved.get("settings") == settings:
            _say(f"{family}: eval.json was made by {_describe_origin(saved)}; evaluating again")
    start = time.perf_counter()
    cfg, graphdef, params, constants = restore_model(
        train_config, fam_dir, attention_impl=config.eval.attention_impl
    )
    rows = {family: _evaluate_model((graphdef, params, constants), text, config, lengths)}
    rows[family]["eval_seconds"] = round(time.perf_counter() - start, 1)
    if family == "rope" and config.rope_scalings:  # plain RoPE only, not a variant of it
        rows.update(_rope_rows(cfg, params, rows[family], text, config, lengths))
    if tune:
        rows.update(
            _finetune_rows(
                cfg,
                params,
                text,
                config,
                lengths,
                corpus=corpus,
                fam_dir=fam_dir,
                train_config=train_config,
                code=code,
                seed=int(train_config.train.seed),
                reuse=reuse,
            )
        )
    if family == "rope" and (config.rope_scalings or tune):
        for row in rows.values():
            row["eval_seconds"] = round(time.perf_counter() - start, 1)
    cache.write_text(json.dumps({"settings": settings, "code": code, "rows": rows}) + "\n")
    return rows, code


# ----------------------------------------------------------------------------------------------
# Several seeds of one family: one vmap program through the sweep machinery.


def seed_list(config: ml_collections.ConfigDict) -> list[int]:
    """The training seeds of every family: `seeds` consecutive ones from `train.seed`."""
    return [int(config.train.seed) + k for k in range(int(config.get("seeds", 1)))]


def seeds_config(config: ml_collections.ConfigDict, family: str) -> ml_collections.ConfigDict:
    """The `posattn.sweep` config that trains `config.seeds` seeds of one family entry."""
    sweep_config = ml_collections.ConfigDict(family_config(config, family).to_dict())
    sweep_config.sweep = ml_collections.ConfigDict(
        {"continuous": {"train": {"seed": tuple(seed_list(config))}}, "eval_lengths": ()}
    )
    return sweep_config


def _train_seeds(config, family: str, fam_dir: pathlib.Path, code: dict, *, reuse: bool = False):
    """Trains `config.seeds` seeds of one family as one `jax.vmap` program (`posattn.sweep`, in
    `fam_dir/seeds/`; resumable, a finished one is not retrained: `seeds/trained.json` records
    the code that trained it, checked as `_finished_run` checks a single run) and restores each
    seed's final parameters on one device.

    Returns:
      (training info, graphdef-free members [(params, constants)] in seed order, validated cfg).
    """
    from posattn.sweep import plan as sweep_plan
    from posattn.sweep import run as sweep_run
    from posattn.train.checkpoint import Checkpointer

    train_config = family_config(config, family)
    sweep_config = seeds_config(config, family)
    finished = _finished_run(sweep_config, fam_dir / "seeds", code, reuse=reuse)
    start = time.perf_counter()
    records = sweep_run.run_sweep(sweep_config, fam_dir / "seeds")
    seconds = round(time.perf_counter() - start, 1)
    if finished is not None:
        seconds, code = finished["seconds"], finished["code"]
    if len(records) != len(seed_list(config)):
        raise Interrupted(f"the seed sweep in {fam_dir / 'seeds'} stopped early; rerun to resume")
    program = sweep_plan.plan(sweep_config)[0]
    K = len(program.members)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    one = sweep_run._abstract_member(program)
    abstract = {
        "members": jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((K, *x.shape), x.dtype, sharding=device), one
        ),
        "alive": jax.ShapeDtypeStruct((K,), np.bool_, sharding=device),
    }
    ckpt = Checkpointer(fam_dir / "seeds" / "programs" / "p0" / "checkpoints")
    try:
        restored = ckpt.restore_latest(abstract)
    finally:
        ckpt.close()
    steps_ = int(train_config.train.steps)
    if restored is None or int(restored[1]["step"]) != steps_:
        raise Interrupted(f"{fam_dir / 'seeds'} holds no finished seed sweep; rerun to resume")
    state = jax.device_get(restored[0]["members"])
    members = [
        jax.tree.map(lambda x, k=k: x[k], (state["params"], state["constants"])) for k in range(K)
    ]
    if finished is None:
        marker = {
            "seconds": seconds,
            "config": json.loads(config_lib.to_json(sweep_config)),
            "code": code,
        }
        (fam_dir / "seeds" / "trained.json").write_text(json.dumps(marker) + "\n")
    info = {
        "seconds": seconds,
        "final_train_loss": float(np.mean([r["final_train_loss"] for r in records])),
        "final_train_loss_seeds": [r["final_train_loss"] for r in records],
        "seeds": seed_list(config),
        "steps": steps_,
        "code": code,
    }
    return info, members, config_lib.validate(train_config)


def _mean_grids(grids: list) -> list:
    """Elementwise mean of [length][cell] grids over seeds (None stays None)."""
    out = []
    for rows in zip(*grids, strict=True):
        out.append(
            [
                None if any(v is None for v in cells) else float(np.mean(cells))
                for cells in zip(*rows, strict=True)
            ]
        )
    return out


def combine_seeds(per_seed: list[dict[str, dict]]) -> dict[str, dict]:
    """One row per name from each seed's rows: the loss sums of every seed (`seed_scores`,
    `seed_curves`), probe grids averaged over seeds, attention statistics of the first seed."""
    out = {}
    for name, first in per_seed[0].items():
        row = dict(first)
        seeds = [rows[name] for rows in per_seed]
        row["seed_scores"] = [r["scores"] for r in seeds]
        row["seed_curves"] = [r["curve"] for r in seeds] if first.get("curve") else None
        for key in ("passkey", "induction"):
            if key in first:
                row[key] = {k: _mean_grids([r[key][k] for r in seeds]) for k in first[key]}
        if "passkey" in first:
            row["passkey_grid"] = row["passkey"]["acc"]
        if "copy_acc" in first:
            row["copy_acc"] = _mean_grids([[[v] for v in r["copy_acc"]] for r in seeds])
            row["copy_acc"] = [v[0] for v in row["copy_acc"]]
        out[name] = row
    return out


def _evaluate_seeds(
    config,
    family,
    fam_dir,
    text,
    lengths,
    members,
    cfg,
    code: dict,
    *,
    reuse: bool = False,
    corpus=None,
) -> tuple[dict[str, dict], dict]:
    """(each seed's rows combined, the code that evaluated them): from `fam_dir/eval.json` when it
    holds these settings and seeds and was made by this code (or by any code, with `reuse`), else
    evaluated now. Each seed's rope+<kind>+ft rows fine-tune that seed's trained params."""
    cache = fam_dir / "eval.json"
    tune = family == "rope" and finetune_enabled(config)
    settings = {
        **_eval_settings(config, lengths),
        "plan": text.plan.fingerprint,
        **(_finetune_eval_settings(config) if tune else {}),
    }
    settings["trained"] = {
        "seeds": seed_list(config),
        **json.loads(config_lib.to_json(family_config(config, family))),
    }
    settings = json.loads(json.dumps(settings))  # as eval.json holds them (tuples as lists)
    if cache.exists():
        saved = json.loads(cache.read_text())
        if saved.get("settings") == settings and (_same_origin(saved, code) or reuse):
            return saved["rows"], saved.get("code") or {}
        if saved.get("settings") == settings:
            _say(f"{family}: eval.json was made by {_describe_origin(saved)}; evaluating again")
    start = time.perf_counter()
    cfg = dataclasses.replace(cfg, attention_impl=config.eval.attention_impl)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(params=0))))
    per_seed = []
    train_config = family_config(config, family)
    for seed, (params, constants) in zip(seed_list(config), members, strict=True):
        rows = {family: _evaluate_model((graphdef, params, constants), text, config, lengths)}
        if family == "rope" and config.rope_scalings:
            rows.update(_rope_rows(cfg, params, rows[family], text, config, lengths))
        if tune:
            rows.update(
                _finetune_rows(
                    cfg,
                    params,
                    text,
                    config,
                    lengths,
                    corpus=corpus,
                    fam_dir=fam_dir,
                    train_config=train_config,
                    code=code,
                    seed=seed,
                    reuse=reuse,
                )
            )
        per_seed.append(rows)
    rows = combine_seeds(per_seed)
    for name, row in rows.items():
        if "finetune" in row:
            row["finetune"] = _merge_finetune_info([r[name]["finetune"] for r in per_seed])
    for row in rows.values():
        row["eval_seconds"] = round(time.perf_counter() - start, 1)
    cache.write_text(json.dumps({"settings": settings, "code": code, "rows": rows}) + "\n")
    return rows, code


# ----------------------------------------------------------------------------------------------
# The run.


def run(
    config: ml_collections.ConfigDict, workdir: str | os.PathLike, *, reuse: bool = False
) -> dict[str, Any]:
    """Trains and evaluates every family of `config`; writes and returns the results.

    Args:
      config: the experiment config (configs/extrapolation.py).
      workdir: one subdirectory per family, plus results.json, results.md and the plots.
      reuse: report finished runs and evaluations made by other code (or on another corpus)
        instead of refusing them; each row of results.json names its own provenance.
    """
    check_experiment(config)
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    lengths = eval_lengths(config)
    corpus = data_lib.load_corpus(config.data.corpus)
    data_lib.check_length(corpus, max(lengths), split="val")
    probing = [k for k in ("passkey", "induction", "copy") if config[k].enabled]
    if probing and corpus.val.dtype != np.uint8:
        raise config_lib.ConfigError(
            f"config.{probing[0]}.enabled: the probes are bytes, corpus {corpus.name!r} holds "
            "token ids; set config.passkey.enabled, config.induction.enabled and "
            "config.copy.enabled to False"
        )
    if finetune_enabled(config):
        data_lib.check_length(
            corpus, finetune_multiple(config) * int(config.data.seq_len), split="train"
        )
    text = eval_text(config, corpus, lengths)
    provenance = _provenance()  # the code as the run starts, not as it is when the run ends
    code = {
        "commit": provenance["commit"],
        "clean": None
        if provenance["uncommitted_changes"] is None
        else not provenance["uncommitted_changes"],
        "code_sha256": provenance["code_sha256"],
        "corpus_sha256": corpus.sha256,
    }
    for family in config.families:  # refuse runs made by other code before any training
        if len(seed_list(config)) > 1:
            _finished_run(
                seeds_config(config, family),
                entry_dir(workdir, family) / "seeds",
                code,
                reuse=reuse,
            )
        else:
            _finished_run(
                family_config(config, family), entry_dir(workdir, family), code, reuse=reuse
            )
    begin = time.perf_counter()
    rows, training, origins = {}, {}, {}
    for family in config.families:
        fam_dir = entry_dir(workdir, family)
        train_config = family_config(config, family)
        _say(f"{family}: training ({train_config.train.steps} steps at L={config.data.seq_len})")
        if len(seed_list(config)) > 1:
            training[family], members, cfg = _train_seeds(
                config, family, fam_dir, code, reuse=reuse
            )
        else:
            training[family] = _train(train_config, fam_dir, code, reuse=reuse)
        _say(
            f"{family}: trained in {training[family]['seconds']} s, last step's train loss "
            f"{training[family]['final_train_loss']:.4f}; evaluating at {lengths}"
        )
        if len(seed_list(config)) > 1:
            new, evaluated_by = _evaluate_seeds(
                config,
                family,
                fam_dir,
                text,
                lengths,
                members,
                cfg,
                code,
                reuse=reuse,
                corpus=corpus,
            )
        else:
            new, evaluated_by = _evaluate_family(
                config,
                family,
                fam_dir,
                text,
                lengths,
                train_config,
                code,
                reuse=reuse,
                corpus=corpus,
            )
        tuned = {
            n[len("rope+") : -len("+ft")]: r["finetune"] for n, r in new.items() if "finetune" in r
        }
        if tuned:
            training["finetune"] = tuned
        for name in new:
            origins[name] = {
                "trained": training[family].get("code") or {},
                "evaluated": evaluated_by,
            }
        for name, row in new.items():
            _say(
                f"{name}: loss {fmt_list(plain_losses(row))} "
                f"(sliding {fmt_list(plain_losses(row, 'sliding_'))}; eval {row['eval_seconds']} s)"
                + (f", passkey {fmt_list(passkey_by_length(row))}" if "passkey_grid" in row else "")
            )
        rows.update(new)
    results = _assemble(
        config, corpus, lengths, rows, training, time.perf_counter() - begin, provenance, origins
    )
    blocks, stats = evaluation_blocks(config, text, lengths, rows)
    results.update(blocks)
    for name, row_stats in stats.items():  # loss (mean over seeds), loss_ci, loss_seeds, ...
        results["families"][name].update(row_stats)
    (workdir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (workdir / "results.md").write_text(markdown(results))
    plots(results, workdir)
    _say(
        f"wrote {workdir / 'results.json'}, results.md and plots in "
        f"{results['timing']['total_seconds']:.0f} s"
    )
    return results


def _assemble(
    config, corpus, lengths, rows, training, seconds, provenance, origins=None
) -> dict[str, Any]:
    fams = {name: {"eval_len": lengths, "loss": plain_losses(row)} for name, row in rows.items()}
    for name, row in rows.items():
        fams[name]["passkey_acc"] = passkey_by_length(row) if "passkey_grid" in row else None
    return {
        "train_len": int(config.data.seq_len),
        "corpus": corpus.name,
        "families": fams,
        # Extra keys (the three above are the contract; readers ignore the others).
        "corpus_sha256": corpus.sha256,
        "loss_unit": "nats per token (byte)" if corpus.val.dtype == np.uint8 else "nats per token",
        "copy_acc": {n: r["copy_acc"] for n, r in rows.items() if "copy_acc" in r} or None,
        "training": {
            n: {k: v for k, v in t.items() if k not in ("config", "code")}
            for n, t in training.items()
        },
        "timing": {
            "total_seconds": round(seconds, 1),
            "eval_seconds": {n: r.get("eval_seconds") for n, r in rows.items()},
        },
        "config": config.to_dict(),
        "provenance": provenance,
        # Who produced each row: with --reuse, rows trained or evaluated by other code keep
        # their own commit and code hash here (the top-level provenance is this run's).
        "row_provenance": origins or {},
        "python_version": platform.python_version(),
    }


def plain_losses(row: dict, key: str = "") -> list[float | None]:
    """One seed's mean loss per length from a row's per-unit sums (no interval)."""
    return [
        None
        if s is None or s.get(f"{key}sum") is None
        else float(np.sum(s[f"{key}sum"]) / np.sum(s[f"{key}count"]))
        for s in row["scores"]
    ]


def _seeds_of(row: dict) -> list[list[dict] | None]:
    """Per length, the score dicts of every seed (`seed_scores` when several were trained)."""
    per_seed = row.get("seed_scores") or [row["scores"]]
    return [
        None if any(seed[i] is None for seed in per_seed) else [seed[i] for seed in per_seed]
        for i in range(len(per_seed[0]))
    ]


def evaluation_blocks(config, text: EvalText, lengths, rows: dict[str, dict]):
    """The top-level evaluation, per-position, probe and attention blocks of results.json, and
    each row's per-length statistics with intervals (from the rows' per-unit sums).

    Returns:
      (blocks, {row name: `summary.summarize_row` lists}).
    """
    ev = config.eval
    weights = intervals.bootstrap_weights(
        text.plan.num_units, replicates=int(ev.bootstrap), seed=int(ev.seed)
    )
    stats = {
        name: summary.summarize_row(_seeds_of(row), weights, block_units=text.plan.block_units)
        for name, row in rows.items()
    }
    reference = ev.reference if ev.reference in rows else None
    paired = {}
    if reference:
        for name, row in rows.items():
            if name != reference:
                paired[name] = {
                    key or "all": summary.paired_difference(
                        _seeds_of(row), _seeds_of(rows[reference]), weights, key=key
                    )
                    for key in ("", "beyond_", "sliding_")
                }
    L = int(config.data.seq_len)
    out = {
        "evaluation": {
            "protocols": {
                "non_overlapping": "windows of T read from scratch, every position scored",
                "beyond_L": "the same windows, positions >= L only",
                "sliding": f"windows of T ending at each block, the last {ev.sliding_stride} "
                "positions scored",
            },
            "unit": text.unit,
            "units": text.plan.num_units,
            "units_scored": int(np.unique(text.plan.chunk_units).size),
            "units_scored_sliding": int(np.unique(text.plan.block_units).size),
            "chunks": int(text.plan.chunk_starts.size),
            "sliding_blocks": int(text.plan.block_ends.size),
            "sliding_stride": int(ev.sliding_stride),
            "sliding_max_tokens": int(ev.sliding_max_tokens),
            "bootstrap": {"replicates": int(ev.bootstrap), "level": 0.95, "blocked_by": text.unit},
            "plan": text.plan.fingerprint,
            "paired": {"reference": reference, "minus_reference": paired},
        },
        "per_position": {
            "eval_len": lengths[-1],
            "bins": ev.per_position_bins,
            "curves": {
                n: summary.summarize_curve(r.get("seed_curves") or [r["curve"]], weights)
                for n, r in rows.items()
                if r.get("curve")
            },
        },
        "passkey": None,
        "induction": None,
        "attention_stats": None,
    }
    if config.passkey.enabled:
        out["passkey"] = {
            "depths": list(config.passkey.depths),
            "digits": config.passkey.digits,
            "distractors": bool(config.passkey.distractors),
            "samples": config.passkey.samples,
            "chance_loss": float(np.log(10)),
            **{
                key: {n: r["passkey"][key] for n, r in rows.items() if "passkey" in r}
                for key in ("acc", "digit_acc", "loss")
            },
        }
    if config.induction.enabled:
        out["induction"] = {
            "gaps": induction_gaps(config),
            "span": config.induction.span,
            "samples": config.induction.samples,
            "chance_loss": float(np.log(26)),
            **{
                key: {n: r["induction"][key] for n, r in rows.items() if "induction" in r}
                for key in ("loss", "acc", "se")
            },
        }
    if ev.attention_windows:
        out["attention_stats"] = {
            "windows": int(ev.attention_windows),
            "queries": f"the last min(T, {L}) of each window",
            "beyond": f"keys at distance >= {L}",
            "rows": {n: r["attention"] for n, r in rows.items() if "attention" in r},
        }
    return out, stats


def _provenance() -> dict[str, Any]:
    def git(*args):
        try:
            return subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain")
    return {
        "commit": git("rev-parse", "HEAD") or None,
        "uncommitted_changes": bool(status) if status is not None else None,
        "code_sha256": code_sha256(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpu_count": os.cpu_count(),
        "devices": [str(d) for d in jax.devices()],
        "python": platform.python_version(),
        "jax": jax.__version__,
    }


def code_files(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """The files whose content the results depend on: the package, this script, the configs."""
    files = [
        *(root / "src" / "posattn").rglob("*.py"),
        root / "experiments" / pathlib.Path(__file__).name,
        *(root / "configs").glob("*.py"),
    ]
    return sorted({f for f in files if f.is_file()})


def code_sha256(root: pathlib.Path = ROOT) -> str:
    """sha256 over (relative path, content) of `code_files`: the same for the same code, whatever
    the commit or the state of the tree."""
    digest = hashlib.sha256()
    for path in code_files(root):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------
# Tables and plots.


def passkey_by_length(row: dict) -> list[float | None]:
    """Passkey accuracy per length, averaged over depths (None where the model cannot run)."""
    return [
        None if any(x is None for x in cells) else float(np.mean(cells))
        for cells in row["passkey_grid"]
    ]


def fmt_list(values) -> str:
    return "[" + ", ".join("-" if v is None else f"{v:.3f}" for v in values) + "]"


def _table(title: str, lengths, rows: dict[str, list], fmt: str) -> list[str]:
    lines = [
        f"### {title}",
        "",
        "| row | " + " | ".join(str(x) for x in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for name, values in rows.items():
        lines.append(
            f"| {name} | "
            + " | ".join("null" if v is None else format(v, fmt) for v in values)
            + " |"
        )
    return lines + [""]


def _cell(value, ci=None, fmt=".4f", se=None) -> str:
    if value is None:
        return "null"
    text = format(value, fmt) + ("" if se is None else f" ± {se:.4f}")
    return text if ci is None else f"{text} [{ci[0]:{fmt}}, {ci[1]:{fmt}}]"


def _ci_table(title: str, lengths, rows: dict[str, tuple[list, list]], fmt=".4f") -> list[str]:
    """A table of value [± seed standard error] [low, high] per length (rows: name -> (values,
    intervals[, standard errors]))."""
    lines = [
        f"### {title}",
        "",
        "| row | " + " | ".join(str(x) for x in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for name, (values, cis, *ses) in rows.items():
        cis = cis or [None] * len(values)
        ses = (ses[0] if ses else None) or [None] * len(values)
        cells = [_cell(v, c, fmt, e) for v, c, e in zip(values, cis, ses, strict=True)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + [""]


def _seed_note(fams: dict) -> str:
    seeds = {len(s) for f in fams.values() for s in f.get("loss_seeds", []) if s}
    if seeds == {1}:
        return "One training seed per row: no seed interval (the bracket is over text only)."
    return (
        f"{'/'.join(str(x) for x in sorted(seeds))} training seeds per row: each loss is the "
        "mean over seeds ± its standard error over seeds, then the interval over text; paired "
        "differences pair seed k of one row with seed k of the other; `loss_seeds` in "
        "results.json."
    )


def markdown(results: dict) -> str:
    """results.md: loss with intervals under both protocols, positions >= L, paired differences,
    the probes, training and provenance."""
    fams, lengths = results["families"], next(iter(results["families"].values()))["eval_len"]
    prov, L, ev = results["provenance"], results["train_len"], results["evaluation"]

    def per_length(key):  # the first row that reads each length
        return [
            next((f[key][i] for f in fams.values() if f.get(key) and f[key][i] is not None), None)
            for i in range(len(lengths))
        ]

    scored, sliding = per_length("eval_bytes"), per_length("eval_bytes_sliding")
    out = [
        f"# Length extrapolation: trained at L = {L}, corpus {results['corpus']}",
        "",
        f"Commit {prov['commit']}"
        f"{' (with uncommitted changes)' if prov['uncommitted_changes'] else ''}, "
        f"{prov['date']}, {prov['machine']}, {prov['cpu_count']} CPUs, "
        f"{', '.join(prov['devices'])}; "
        f"total {results['timing']['total_seconds']:.0f} s.",
        "",
        f"Loss: mean next-token cross-entropy, {results['loss_unit']}; `null`: the model cannot "
        f"read that length (learned table). Text: {ev['chunks']} chunks of {lengths[-1]} tokens "
        f"from {ev['units_scored']} of the {ev['units']} held-out units ({ev['unit']}), the same "
        f"tokens at every length; scored tokens per length {scored}. Brackets: 95% intervals, "
        f"bootstrap over units ({ev['bootstrap']['replicates']} replicates). {_seed_note(fams)}",
        "",
        corpus_sentence(results),
        "",
    ]
    out += _other_code_lines(results)
    out += _ci_table(
        "Loss (nats), non-overlapping windows (every position of a window read from scratch)",
        lengths,
        {n: (f["loss"], f.get("loss_ci"), f.get("loss_se")) for n, f in fams.items()},
    )
    out += _ci_table(
        "Change from L (paired: same units, same replicates)",
        lengths,
        {n: (f["delta_L"], f["delta_L_ci"]) for n, f in fams.items() if "delta_L" in f},
        "+.4f",
    )
    out += _ci_table(
        "Change from L, sliding windows (paired on the blocks both lengths scored)",
        lengths,
        {
            n: (f["delta_L_sliding"], f["delta_L_sliding_ci"])
            for n, f in fams.items()
            if "delta_L" in f
        },
        "+.4f",
    )
    out += _ci_table(
        f"Loss over positions >= L = {L} only (non-overlapping windows)",
        lengths,
        {
            n: (f["loss_beyond_L"], f["loss_beyond_L_ci"])
            for n, f in fams.items()
            if "loss_beyond_L" in f
        },
    )
    if any(v is not None for f in fams.values() for v in f.get("loss_sliding", [])):
        out += _ci_table(
            f"Loss, sliding windows (stride {ev['sliding_stride']}: each scored token has "
            f"T - {ev['sliding_stride']} .. T - 1 tokens of context; at most "
            f"{ev['sliding_max_tokens'] or 'all'} tokens read a length, so a long length scores "
            "the "
            f"first of the {ev['sliding_blocks']} blocks from {ev['units_scored_sliding']} units; "
            f"scored tokens per length {sliding}; changes between lengths are paired on the "
            "blocks both scored)",
            lengths,
            {n: (f["loss_sliding"], f["loss_sliding_ci"]) for n, f in fams.items()},
        )
    paired = ev["paired"]
    if paired["reference"]:
        out += _ci_table(
            f"Paired difference from {paired['reference']} (non-overlapping; negative: lower loss)",
            lengths,
            {n: (d["all"]["delta"], d["all"]["ci"]) for n, d in paired["minus_reference"].items()},
            "+.4f",
        )
    if results["passkey"]:
        pk = results["passkey"]

        def mean(grid):
            return [None if any(x is None for x in r) else float(np.mean(r)) for r in grid]

        out += _table(
            f"Passkey exact match ({pk['digits']} digits, distractors {pk['distractors']}, "
            f"mean over depths {pk['depths']}, {pk['samples']} samples a cell)",
            lengths,
            {n: f["passkey_acc"] for n, f in fams.items()},
            ".2f",
        )
        out += _table(
            f"Passkey loss per digit (nats; chance ln 10 = {pk['chance_loss']:.2f})",
            lengths,
            {n: mean(g) for n, g in pk["loss"].items()},
            ".3f",
        )
    if results["induction"]:
        ind = results["induction"]
        for at in sorted({0, len(lengths) - 1}):
            out += _table(
                f"Induction loss per letter (nats; chance ln 26 = {ind['chance_loss']:.2f}) at "
                f"length {lengths[at]}, by gap (bytes between the copies; {ind['span']} letters, "
                f"{ind['samples']} samples a cell)",
                ind["gaps"],
                {n: g[at] for n, g in ind["loss"].items()},
                ".3f",
            )
    if results["copy_acc"]:
        out += _table(
            "Copy accuracy (repeated random-letter segment)", lengths, results["copy_acc"], ".2f"
        )
    out += _attention_table(results, lengths)
    out += [
        "### Training",
        "",
        "Train loss: the last step's batch (passkey rows included).",
        "",
        "| family | steps | train loss | seconds |",
        "|---|---:|---:|---:|",
    ]
    out += [
        f"| {n} | {t['steps']} | {t['final_train_loss']:.4f} | {t['seconds']} |"
        for n, t in results["training"].items()
        if n != "finetune"
    ]
    tuned = results["training"].get("finetune")
    if tuned:
        out += [
            "",
            "Position-interpolation fine-tunes (rows `rope+<kind>+ft`): the trained RoPE model at "
            "multiple x L under the scaling of factor = multiple, which the rows keep at every "
            "length; train loss: the last step's batch (mean over seeds).",
            "",
            "| row | steps | length | train loss | seconds |",
            "|---|---:|---:|---:|---:|",
        ]
        out += [
            f"| rope+{kind}+ft | {t['steps']} | {t['multiple'] * L} | "
            f"{t['final_train_loss']:.4f} | {t['seconds']} |"
            for kind, t in tuned.items()
        ]
    return "\n".join(out) + "\n"


def _attention_table(results: dict, lengths) -> list[str]:
    """Per row and layer, at L and at the longest length: attention entropy, mean attended
    distance (means over heads) and the mass on keys >= L away (mean over heads, and its largest
    head)."""
    block = results.get("attention_stats")
    if not block:
        return []
    first, last = lengths[0], lengths[-1]
    out = [
        f"### Attention per layer at {first} and {last} (the last min(T, L) queries of "
        f"{block['windows']} windows; means over heads, the largest head in brackets)",
        "",
        f"| row | layer | entropy {first} | entropy {last} | distance {first} | "
        f"distance {last} | mass >= L at {last} |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, per_length in block["rows"].items():
        if not per_length or per_length[0] is None or per_length[-1] is None:
            continue
        at_first, at_last = per_length[0], per_length[-1]
        for layer in range(len(at_last["entropy"])):

            def mean(stats, key, layer=layer):
                return float(np.mean(stats[key][layer]))

            mass = at_last["mass_beyond_L"][layer]
            out.append(
                f"| {name} | {layer} | {mean(at_first, 'entropy'):.2f} | "
                f"{mean(at_last, 'entropy'):.2f} | {mean(at_first, 'distance'):.1f} | "
                f"{mean(at_last, 'distance'):.1f} | {float(np.mean(mass)):.2f} "
                f"[{float(np.max(mass)):.2f}] |"
            )
    return out + [""]


def corpus_sentence(results: dict) -> str:
    """Which corpus the numbers compare with (its content hash; for `stdlib`, the Python too)."""
    sha = results.get("corpus_sha256") or "unknown"
    python = results.get("python_version") or results["provenance"].get("python")
    where = (
        f", the standard library of Python {python}: another Python version is another corpus"
        if results["corpus"] == "stdlib"
        else ""
    )
    return (
        f"Corpus `{results['corpus']}` (sha256 `{sha[:16]}`{where}). These numbers compare only "
        "with results whose corpus has this hash."
    )


def _other_code_lines(results: dict) -> list[str]:
    """A note naming the rows trained or evaluated by other code than this run's (--reuse)."""
    mine = results["provenance"].get("code_sha256")
    lines = []
    for name, origin in (results.get("row_provenance") or {}).items():
        for stage in ("trained", "evaluated"):
            who = origin.get(stage) or {}
            if who.get("code_sha256") != mine:
                commit = str(who.get("commit"))[:12] if who else "unrecorded"
                clean = "" if who.get("clean", True) else " with uncommitted changes"
                lines.append(f"- `{name}` {stage} by commit {commit}{clean} (reused)")
    if not lines:
        return []
    return ["Rows produced by other code than this run's:", "", *lines, ""]


def plots(results: dict, workdir: pathlib.Path) -> None:
    """loss_vs_length.png (three panels: non-overlapping, positions >= L, sliding; 95%
    intervals), per_position.png (with interval bands), passkey_heatmap.png, induction.png,
    attention_stats.png (and copy_vs_length.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L, fams = results["train_len"], results["families"]
    lengths = next(iter(fams.values()))["eval_len"]
    # A fine-tuned row rope+<kind>+ft takes the colour of its eval-time row rope+<kind>.
    base = {
        n: n[: -len("+ft")] if n.endswith("+ft") and n[: -len("+ft")] in fams else n for n in fams
    }
    palette = list(dict.fromkeys(base.values()))
    colors = {name: plt.cm.tab20(palette.index(base[name]) % 20) for name in fams}

    def style(name):
        if name.endswith("+ft"):  # fine-tuned: dash-dot, square markers
            return dict(ls="-.", marker="s", ms=3, color=colors[name])
        return dict(ls="--" if "+" in name else "-", marker="o", ms=3, color=colors[name])

    finite = [v for f in fams.values() for v in f["loss"][:1] if v is not None]
    top = 2.5 * max(finite) if finite else None

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), sharey=True)
    panels = (
        ("loss", "loss_ci", "non-overlapping windows"),
        ("loss_beyond_L", "loss_beyond_L_ci", f"positions >= L = {L} only"),
        ("loss_sliding", "loss_sliding_ci", "sliding windows"),
    )
    for ax, (key, ci_key, title) in zip(axes, panels, strict=True):
        for name, f in fams.items():
            pts = [
                (x, y, c)
                for x, y, c in zip(f["eval_len"], f[key], f[ci_key], strict=True)
                if y is not None
            ]
            if not pts:
                continue
            xs, ys, cis = zip(*pts, strict=True)
            ax.errorbar(
                xs,
                ys,
                yerr=[
                    [y - c[0] for y, c in zip(ys, cis, strict=True)],
                    [c[1] - y for y, c in zip(ys, cis, strict=True)],
                ],
                label=name,
                capsize=2,
                **style(name),
            )
        ax.set(xscale="log", xlabel="eval length (tokens)", title=title, ylim=(None, top))
        ax.set_xticks(lengths, [str(x) for x in lengths])
        ax.set_xticks([], minor=True)
        ax.axvline(L, color="gray", lw=0.8)
    axes[0].set_ylabel(f"loss ({results['loss_unit']}), 95% interval")
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"Held-out loss vs length, trained at L = {L}")
    fig.tight_layout(), fig.savefig(workdir / "loss_vs_length.png", dpi=120), plt.close(fig)

    pp = results["per_position"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, c in pp["curves"].items():
        x = np.add(c["position"], 1)
        ax.plot(x, c["loss"], label=name, **style(name))
        lo, hi = zip(*c["ci"], strict=True)
        ax.fill_between(x, lo, hi, color=colors[name], alpha=0.15, lw=0)
    ax.set(
        xscale="log",
        xlabel="tokens of context (position + 1; log-spaced bins)",
        ylabel="mean loss in bin (95% interval)",
        ylim=(None, top),
        title=f"Per-position loss, windows of {pp['eval_len']} (L = {L})",
    )
    ax.axvline(L, color="gray", lw=0.8)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout(), fig.savefig(workdir / "per_position.png", dpi=120), plt.close(fig)

    if results["induction"]:
        ind = results["induction"]
        fig, axes = plt.subplots(
            1, len(lengths), figsize=(3.2 * len(lengths), 3.6), sharey=True, squeeze=False
        )
        for a, (ax, length) in enumerate(zip(axes[0], lengths, strict=True)):
            for name, grid in ind["loss"].items():
                pts = [
                    (g + 1, y) for g, y in zip(ind["gaps"], grid[a], strict=True) if y is not None
                ]
                if pts:
                    ax.plot(*zip(*pts, strict=True), label=name, **style(name))
            ax.axhline(ind["chance_loss"], color="gray", lw=0.8, ls=":")
            ax.axvline(L + 1, color="gray", lw=0.8)
            ax.set(xscale="log", xlabel="gap + 1 (bytes)", title=f"length {length}")
        axes[0, 0].set_ylabel("loss on the repeat (nats/letter)")
        axes[0, -1].legend(fontsize=6, ncol=2)
        fig.suptitle(
            f"Induction: random {ind['span']}-letter string repeated after a gap (L = {L})"
        )
        fig.tight_layout(), fig.savefig(workdir / "induction.png", dpi=120), plt.close(fig)

    if results["attention_stats"]:
        attention_figure(results, workdir / "attention_stats.png", style)

    if results["passkey"]:
        grids = results["passkey"]["acc"]
        cols = 5
        fig, axes = plt.subplots(
            -(-len(grids) // cols),
            cols,
            figsize=(2.8 * cols, 2.6 * -(-len(grids) // cols)),
            squeeze=False,
            layout="constrained",
        )
        # More axes than grids: the spare ones are turned off below.
        for ax, (name, grid) in zip(axes.flat, grids.items(), strict=False):
            img = np.array(
                [[np.nan if v is None else v for v in row] for row in grid]
            ).T  # (depths, lengths)
            im = ax.imshow(img, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
            ax.set_title(name, fontsize=8)
            ax.set_xticks(range(len(lengths)), [str(x) for x in lengths], fontsize=6)
            ax.set_yticks(
                range(len(results["passkey"]["depths"])), results["passkey"]["depths"], fontsize=6
            )
        for ax in axes.flat[len(grids) :]:
            ax.axis("off")
        fig.colorbar(im, ax=axes, shrink=0.6, label="exact-match accuracy")
        fig.suptitle(f"Passkey: length (x) by depth (y), trained at L = {L}")
        fig.savefig(workdir / "passkey_heatmap.png", dpi=120), plt.close(fig)

    if results["copy_acc"]:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, acc in results["copy_acc"].items():
            pts = [(x, y) for x, y in zip(lengths, acc, strict=True) if y is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=name, **style(name))
        ax.set(
            xscale="log",
            xlabel="eval length",
            ylabel="copy accuracy",
            ylim=(0, 1),
            title=f"Copy task vs length, trained at L = {L}",
        )
        ax.set_xticks(lengths, [str(x) for x in lengths])
        ax.axvline(L, color="gray", lw=0.8)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout(), fig.savefig(workdir / "copy_vs_length.png", dpi=120), plt.close(fig)


def attention_figure(results: dict, path: pathlib.Path, style) -> None:
    """attention_stats.png: entropy, mean distance and mass beyond L (mean over heads) vs length,
    one column per layer."""
    import matplotlib.pyplot as plt

    block, L = results["attention_stats"], results["train_len"]
    lengths = next(iter(results["families"].values()))["eval_len"]
    first = next(s for r in block["rows"].values() for s in r if s is not None)
    layers_ = len(first["entropy"])
    names = (
        ("entropy", "entropy (nats)"),
        ("distance", "mean distance (tokens)"),
        ("mass_beyond_L", f"mass on keys >= {L} away"),
    )
    fig, axes = plt.subplots(3, layers_, figsize=(4.5 * layers_, 9), squeeze=False, sharex=True)
    for m, (key, label) in enumerate(names):
        for layer in range(layers_):
            ax = axes[m, layer]
            for name, per_length in block["rows"].items():
                pts = [
                    (x, float(np.mean(s[key][layer])))
                    for x, s in zip(lengths, per_length, strict=True)
                    if s is not None
                ]
                if pts:
                    ax.plot(*zip(*pts, strict=True), label=name, **style(name))
            ax.set(xscale="log", ylabel=label if layer == 0 else None)
            ax.axvline(L, color="gray", lw=0.8)
            if m == 0:
                ax.set_title(f"layer {layer} (mean over heads)")
            ax.set_xticks(lengths, [str(x) for x in lengths])
            ax.set_xticks([], minor=True)
            if m == 2:
                ax.set_xlabel("eval length")
    axes[0, -1].legend(fontsize=6, ncol=2)
    fig.suptitle(f"Attention per layer, last min(T, L) queries of {block['windows']} windows")
    fig.tight_layout(), fig.savefig(path, dpi=110), plt.close(fig)


def _say(message: str) -> None:
    print(f"extrapolation: {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = cli.parse(COMMAND, argv)
        run(args.config, args.workdir, reuse=args.reuse)
    except (config_lib.ConfigError, data_lib.DataError) as e:
        print(f"length_extrapolation: error: {e}", file=sys.stderr)
        return 2
    except (Interrupted, WorkdirBusyError, NonFiniteLossError, ProducedByOtherCode) as e:
        print(f"length_extrapolation: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
