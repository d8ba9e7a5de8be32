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
(`posattn.eval.lengths.rope_scaling_row`); at eval_len <= L they are plain RoPE. "dynamic" recomputes
its base from the window length it reads, which in a whole-window evaluation is eval_len, so it
stretches the base by (s * eval_len / L - (s - 1))^(d/(d-2)) = (s^2 - s + 1)^(d/(d-2)), as
Hugging Face does when its factor is set to the extension ratio.

Writes `WORKDIR/results.json` (`train_len`, `corpus`, `families`: {name: {eval_len, loss,
passkey_acc}}, plus extra top-level keys), `results.md` and PNGs.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx

from posattn import cli, families
from posattn import config as config_lib
from posattn.attention import IMPLEMENTATIONS
from posattn.eval import lengths as evaluate
from posattn.eval import probes
from posattn.nn.model import TransformerLM
from posattn.train import NonFiniteLossError, WorkdirBusyError, restore_trained, train_and_evaluate
from posattn.train import data as data_lib

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


def check_experiment(config: ml_collections.ConfigDict) -> None:
    """Validates the experiment's own sections (the training sections are validated by load_config)."""
    fail = config_lib.ConfigError
    unknown = [f for f in config.families if f not in families.names()]
    if unknown or not config.families:
        raise fail(
            f"config.families={tuple(config.families)!r}: unknown {unknown}; known: {', '.join(families.names())}"
        )
    bad = [k for k in config.rope_scalings if k not in ROPE_KINDS]
    if bad:
        raise fail(f"config.rope_scalings has {bad[0]!r}; allowed: {', '.join(ROPE_KINDS)}")
    if config.rope_scalings and "rope" not in config.families:
        raise fail(
            "config.rope_scalings needs 'rope' in config.families (the rows rescale the trained RoPE model)"
        )
    lengths = eval_lengths(config)
    if not lengths or any(x < 2 for x in lengths) or lengths != sorted(set(lengths)):
        raise fail(
            f"eval lengths {lengths} (config.eval.lengths / eval.multiples) must be distinct, increasing, >= 2"
        )
    if config.eval.attention_impl not in IMPLEMENTATIONS:
        raise fail(
            f"config.eval.attention_impl={config.eval.attention_impl!r}; allowed: {', '.join(IMPLEMENTATIONS)}"
        )
    for key in ("max_tokens", "batch_size", "per_position_bins"):
        if not (isinstance(config.eval[key], int) and config.eval[key] > 0):
            raise fail(f"config.eval.{key}={config.eval[key]!r} must be a positive integer")
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


def family_config(config: ml_collections.ConfigDict, family: str) -> ml_collections.ConfigDict:
    """The training config of one family: the shared model/data/train sections, its position."""
    out = ml_collections.ConfigDict({k: config[k].to_dict() for k in ("model", "data", "train")})
    out.model.position = family
    config_lib.validate(out)
    return out


def _eval_settings(config, lengths) -> dict:
    """Everything an evaluation result depends on besides the trained parameters."""
    return {
        "lengths": lengths,
        "rope_scalings": list(config.rope_scalings),
        **{f"eval.{k}": v for k, v in config.eval.to_dict().items() if k != "batch_size"},
        **{f"passkey.{k}": v for k, v in config.passkey.to_dict().items()},
        **{f"copy.{k}": v for k, v in config.copy.to_dict().items()},
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
    """(cfg, graphdef, params, constants) of the finished run in `fam_dir`, with `attention_impl`."""
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


def _evaluate_model(model, corpus, config, lengths, *, only: list[int] | None = None) -> dict:
    """Loss, per-position curve, passkey and copy accuracy at `only` (default: every length)."""
    graphdef, params, constants = model
    todo = lengths if only is None else only
    ev = config.eval
    loss, curve = [], None
    for length in todo:
        per_pos = evaluate.nll_by_position(
            graphdef,
            params,
            constants,
            corpus.val,
            length=length,
            max_tokens=ev.max_tokens,
            batch_size=ev.batch_size,
        )
        loss.append(None if per_pos is None else float(per_pos.mean()))
        if length == lengths[-1] and per_pos is not None:
            curve = bin_curve(per_pos, ev.per_position_bins)
    out = {"eval_len": todo, "loss": loss, "per_position": curve}
    if config.passkey.enabled:
        acc = evaluate.passkey_accuracy(
            graphdef,
            params,
            constants,
            lengths=todo,
            depths=list(config.passkey.depths),
            samples=config.passkey.samples,
            digits=config.passkey.digits,
            seed=ev.seed,
            batch_size=ev.batch_size,
        )
        out["passkey_grid"] = [[None if np.isnan(x) else float(x) for x in row] for row in acc]
    if config.copy.enabled:
        out["copy_acc"] = evaluate.copy_accuracy(
            graphdef,
            params,
            constants,
            corpus.val,
            lengths=todo,
            samples=config.copy.samples,
            segment=config.copy.segment,
            seed=ev.seed,
            batch_size=ev.batch_size,
        )
    return out


def _rope_rows(cfg, params, plain: dict, corpus, config, lengths) -> dict[str, dict]:
    """rope+<kind> rows: plain RoPE up to L, the trained params under each scaling past it."""
    L = config.data.seq_len
    rows = {}
    for kind in config.rope_scalings:
        row = {k: list(v) if isinstance(v, list) else v for k, v in plain.items()}
        row["per_position"] = None
        for i, length in enumerate(lengths):
            scaling = evaluate.rope_scaling_row(kind, train_len=L, eval_len=length)
            if scaling is None:
                continue  # <= L: the plain RoPE numbers
            graphdef, constants = evaluate.with_rope_scaling(cfg, scaling)
            one = _evaluate_model(
                (graphdef, params, constants), corpus, config, lengths, only=[length]
            )
            row["loss"][i] = one["loss"][0]
            if "passkey_grid" in one:
                row["passkey_grid"][i] = one["passkey_grid"][0]
            if "copy_acc" in one:
                row["copy_acc"][i] = one["copy_acc"][0]
            if length == lengths[-1]:
                row["per_position"] = one["per_position"]
        rows[f"rope+{kind}"] = row
    return rows


def _evaluate_family(
    config, family, fam_dir, corpus, lengths, train_config, code: dict, *, reuse: bool = False
) -> tuple[dict[str, dict], dict]:
    """(rows, the code that evaluated them): from eval.json when it holds these settings and was
    made by this code (or by any code, with `reuse`), else evaluated now."""
    cache = fam_dir / "eval.json"
    settings = {
        **_eval_settings(config, lengths),
        "trained": json.loads(config_lib.to_json(train_config)),
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
    rows = {family: _evaluate_model((graphdef, params, constants), corpus, config, lengths)}
    if family == "rope" and config.rope_scalings:
        rows.update(_rope_rows(cfg, params, rows[family], corpus, config, lengths))
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
    if config.passkey.enabled and corpus.val.dtype != np.uint8:
        raise config_lib.ConfigError(
            f"config.passkey.enabled: the probes are bytes, corpus {corpus.name!r} holds "
            "token ids; set config.passkey.enabled=False and config.copy.enabled=False"
        )
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
        _finished_run(family_config(config, family), workdir / family, code, reuse=reuse)
    begin = time.perf_counter()
    rows, training, origins = {}, {}, {}
    for family in config.families:
        fam_dir = workdir / family
        train_config = family_config(config, family)
        _say(f"{family}: training ({train_config.train.steps} steps at L={config.data.seq_len})")
        training[family] = _train(train_config, fam_dir, code, reuse=reuse)
        _say(
            f"{family}: trained in {training[family]['seconds']} s, last step's train loss "
            f"{training[family]['final_train_loss']:.4f}; evaluating at {lengths}"
        )
        new, evaluated_by = _evaluate_family(
            config, family, fam_dir, corpus, lengths, train_config, code, reuse=reuse
        )
        for name in new:
            origins[name] = {
                "trained": training[family].get("code") or {},
                "evaluated": evaluated_by,
            }
        for name, row in new.items():
            _say(
                f"{name}: loss {fmt_list(row['loss'])}"
                + (f", passkey {fmt_list(passkey_by_length(row))}" if "passkey_grid" in row else "")
            )
        rows.update(new)
    results = _assemble(
        config, corpus, lengths, rows, training, time.perf_counter() - begin, provenance, origins
    )
    (workdir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (workdir / "results.md").write_text(markdown(results))
    plots(results, workdir)
    _say(
        f"wrote {workdir / 'results.json'}, results.md and plots in {results['timing']['total_seconds']:.0f} s"
    )
    return results


def _assemble(
    config, corpus, lengths, rows, training, seconds, provenance, origins=None
) -> dict[str, Any]:
    fams = {}
    for name, row in rows.items():
        fams[name] = {
            "eval_len": lengths,
            "loss": row["loss"],
            "passkey_acc": passkey_by_length(row) if "passkey_grid" in row else None,
        }
    return {
        "train_len": int(config.data.seq_len),
        "corpus": corpus.name,
        "families": fams,
        # Extra keys (the three above are the contract; readers ignore the others).
        "corpus_sha256": corpus.sha256,
        "loss_unit": "nats per token (byte)" if corpus.val.dtype == np.uint8 else "nats per token",
        "passkey": {
            "depths": list(config.passkey.depths),
            "digits": config.passkey.digits,
            "samples": config.passkey.samples,
            "acc": {n: r["passkey_grid"] for n, r in rows.items() if "passkey_grid" in r},
        }
        if config.passkey.enabled
        else None,
        "copy_acc": {n: r["copy_acc"] for n, r in rows.items() if "copy_acc" in r} or None,
        "per_position": {
            "eval_len": lengths[-1],
            "bins": config.eval.per_position_bins,
            "curves": {n: r["per_position"] for n, r in rows.items() if r.get("per_position")},
        },
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


def bin_curve(per_position: np.ndarray, bins: int) -> dict[str, list[float]]:
    """Mean NLL over log-spaced runs of positions (about `bins` of them; each as wide as the ones
    before it, so late positions average many predictions and stay readable on a log axis).

    Returns {"position": the mean position of each run, "loss": its mean NLL}.
    """
    edges = (
        np.unique(np.geomspace(1, per_position.size + 1, bins + 1).astype(int)) - 1
    )  # over positions 0..T
    parts = [np.arange(a, b) for a, b in zip(edges[:-1], edges[1:])]
    return {
        "position": [float(p.mean()) for p in parts],
        "loss": [float(per_position[p].mean()) for p in parts],
    }


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


def markdown(results: dict) -> str:
    """results.md: the loss table (families x lengths), passkey and copy accuracy, provenance."""
    fams, lengths = results["families"], next(iter(results["families"].values()))["eval_len"]
    prov, L = results["provenance"], results["train_len"]
    out = [
        f"# Length extrapolation: trained at L = {L}, corpus {results['corpus']}",
        "",
        f"Commit {prov['commit']}{' (with uncommitted changes)' if prov['uncommitted_changes'] else ''}, "
        f"{prov['date']}, {prov['machine']}, {prov['cpu_count']} CPUs, {', '.join(prov['devices'])}; "
        f"total {results['timing']['total_seconds']:.0f} s.",
        "",
        f"Loss: mean next-token cross-entropy, {results['loss_unit']}, non-overlapping held-out windows; "
        "`null`: the model cannot read that length (learned table).",
        "",
        corpus_sentence(results),
        "",
    ]
    out += _other_code_lines(results)
    out += _table(
        "Loss (nats) by eval length", lengths, {n: f["loss"] for n, f in fams.items()}, ".4f"
    )
    if results["passkey"]:
        out += _table(
            f"Passkey exact-match accuracy ({results['passkey']['digits']} digits, mean over depths "
            f"{results['passkey']['depths']})",
            lengths,
            {n: f["passkey_acc"] for n, f in fams.items()},
            ".2f",
        )
    if results["copy_acc"]:
        out += _table(
            "Copy accuracy (repeated random-letter segment)", lengths, results["copy_acc"], ".2f"
        )
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
    ]
    return "\n".join(out) + "\n"


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
    """loss_vs_length.png, per_position.png, passkey_heatmap.png (and copy_vs_length.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L, fams = results["train_len"], results["families"]
    lengths = next(iter(fams.values()))["eval_len"]
    colors = {name: plt.cm.tab20(i % 20) for i, name in enumerate(fams)}
    style = lambda name: dict(ls="--" if "+" in name else "-", marker="o", ms=3, color=colors[name])
    finite = [v for f in fams.values() for v in f["loss"][:1] if v is not None]
    top = 2.5 * max(finite) if finite else None

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, f in fams.items():
        pts = [(x, y) for x, y in zip(f["eval_len"], f["loss"]) if y is not None]
        if pts:
            ax.plot(*zip(*pts), label=name, **style(name))
    ax.set(
        xscale="log",
        xlabel="eval length (tokens)",
        ylabel=f"loss ({results['loss_unit']})",
        title=f"Held-out loss vs length, trained at L = {L}",
        ylim=(None, top),
    )
    ax.set_xticks(lengths, [str(x) for x in lengths])
    ax.axvline(L, color="gray", lw=0.8)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout(), fig.savefig(workdir / "loss_vs_length.png", dpi=120), plt.close(fig)

    pp = results["per_position"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, c in pp["curves"].items():
        ax.plot(np.add(c["position"], 1), c["loss"], label=name, **style(name))
    ax.set(
        xscale="log",
        xlabel="tokens of context (position + 1; log-spaced bins)",
        ylabel="mean loss in bin",
        ylim=(None, top),
        title=f"Per-position loss, windows of {pp['eval_len']} (L = {L})",
    )
    ax.axvline(L, color="gray", lw=0.8)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout(), fig.savefig(workdir / "per_position.png", dpi=120), plt.close(fig)

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
        for ax, (name, grid) in zip(axes.flat, grids.items()):
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
            pts = [(x, y) for x, y in zip(lengths, acc) if y is not None]
            if pts:
                ax.plot(*zip(*pts), label=name, **style(name))
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
