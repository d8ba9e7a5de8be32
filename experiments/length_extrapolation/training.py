"""Training (or reusing) one seed of one entry, restoring it, and the position-interpolation
fine-tunes of the `+ft` rows.

Seed k of an entry is a `posattn.train.train_and_evaluate` run of the entry's config with
`train.seed` = k: the first seed (`train.seed`) in `WORKDIR/<entry>/`, the others in
`WORKDIR/<entry>/seed<k>/`, so adding seeds never retrains one already trained. Its
`trained.json` records the config, the code that trained it and the corpus; a run trained by
other code (or on another corpus) is refused unless `reuse`.

A fine-tune (`finetuned`) is a `train_and_evaluate` run too, started from a trained seed's
parameters (`init_from`) under `settings.finetune_config`, in its own workdir
`WORKDIR/<entry>/finetune/<kind>-seed<k>-<settings hash>/` (checkpoints, metrics.jsonl; an
interrupted fine-tune resumes); `finetuned.json` there records its settings, code and losses.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx

from posattn import config as config_lib
from posattn.nn.model import TransformerLM
from posattn.train import NonFiniteLossError, restore_trained, train_and_evaluate

from .provenance import ProducedByOtherCode, describe_origin, same_origin
from .settings import (
    entry_dir,
    finetune_batch_size,
    finetune_config,
    finetune_multiple,
    finetune_scaling,
)

__all__ = [
    "Interrupted",
    "finetune",
    "finetune_dir",
    "finetuned",
    "finished_run",
    "member_dir",
    "restore_model",
    "seed_config",
    "train_member",
]


class Interrupted(RuntimeError):
    """A training stopped before its last step (preempted); rerunning resumes it."""


def member_dir(workdir: pathlib.Path, entry: str, seed: int, first_seed: int) -> pathlib.Path:
    """Where seed `seed` of an entry trains: the entry's directory for the first seed, else
    `seed<k>/` inside it."""
    base = entry_dir(workdir, entry)
    return base if int(seed) == int(first_seed) else base / f"seed{int(seed)}"


def seed_config(train_config: ml_collections.ConfigDict, seed: int) -> ml_collections.ConfigDict:
    """`train_config` with `train.seed` = seed (the same object when it already is)."""
    if int(train_config.train.seed) == int(seed):
        return train_config
    out = ml_collections.ConfigDict(train_config.to_dict())
    out.train.seed = int(seed)
    return out


def finished_run(train_config, run_dir: pathlib.Path, code: dict, *, reuse: bool) -> dict | None:
    """`trained.json`'s record when it says this exact config finished in `run_dir`, else None.

    Raises:
      ProducedByOtherCode: that run was trained by other code (or on another corpus) and `reuse`
        is off; the message says how to proceed.
    """
    marker = run_dir / "trained.json"
    if not marker.exists():
        return None
    info = json.loads(marker.read_text())
    if not _same_config(info.get("config"), train_config):
        return None
    if same_origin(info, code) or reuse:
        return info
    raise ProducedByOtherCode(
        f"{run_dir} was trained by {describe_origin(info)}; this is commit "
        f"{str(code['commit'])[:12]}, code sha256 {code['code_sha256'][:12]}, corpus sha256 "
        f"{code['corpus_sha256'][:12]}. Rerun with --reuse to report its numbers (results.json "
        f"then lists that row's own commit), or move {run_dir} away to retrain it with this code."
    )


def _same_config(saved, config) -> bool:
    """Whether `saved` (a trained.json's config) is `config`, a key it lacks (added to the
    library since, e.g. data.batch_offset) holding its default."""
    if not isinstance(saved, dict):
        return False
    now = json.loads(config_lib.to_json(config))
    defaults = json.loads(config_lib.to_json(config_lib.defaults()))
    filled = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items()}
    for section, keys in now.items():
        if isinstance(keys, dict) and isinstance(filled.get(section), dict):
            for key in keys:
                if key not in filled[section] and key in defaults.get(section, {}):
                    filled[section][key] = defaults[section][key]
    return filled == now


def train_member(
    train_config, run_dir: pathlib.Path, code: dict, *, reuse: bool = False
) -> tuple[dict, bool]:
    """(trained.json's record, whether it was reused): trains one run unless `trained.json` says
    this exact config already finished there (made by this code, or by any code with `reuse`)."""
    info = finished_run(train_config, run_dir, code, reuse=reuse)
    if info is not None:
        return info, True
    config = json.loads(config_lib.to_json(train_config))
    start = time.perf_counter()
    result = train_and_evaluate(train_config, run_dir)  # resumes; refuses another config
    if not result.get("finished"):
        raise Interrupted(
            f"training in {run_dir} stopped at step {result.get('step')}; rerun to resume"
        )
    info = {
        "seconds": round(time.perf_counter() - start, 1),
        "final_train_loss": result.get("loss"),
        "steps": int(train_config.train.steps),
        "config": config,
        "code": code,
    }
    (run_dir / "trained.json").write_text(json.dumps(info) + "\n")
    return info, False


def restore_model(train_config, run_dir: pathlib.Path, *, attention_impl: str):
    """(cfg, graphdef, params, constants) of the finished run in `run_dir`, read with
    `attention_impl`."""
    restored = restore_trained(train_config, run_dir / "checkpoints")
    if restored is None or restored[2] != int(train_config.train.steps):
        raise RuntimeError(
            f"{run_dir} holds no finished checkpoint; delete {run_dir / 'trained.json'} and rerun"
        )
    cfg, state, _ = restored
    cfg = dataclasses.replace(cfg, attention_impl=attention_impl)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(params=0))))
    return cfg, graphdef, state["params"], state["constants"]


def params_sha256(params) -> str:
    """A content hash of a parameter tree (which trained model a fine-tune started from)."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        array = np.asarray(jax.device_get(leaf))
        digest.update(str((array.shape, array.dtype)).encode() + b"\0")
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def _finetune_settings(config, train_config, kind: str, seed: int, trained_sha: str) -> dict:
    """Everything a fine-tune depends on besides the code and the corpus."""
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


def finetune_dir(fam_dir: pathlib.Path, kind: str, seed: int, settings: dict) -> pathlib.Path:
    """The workdir of one fine-tune: `<entry>/finetune/<kind>-seed<k>-<settings hash>`, so that
    other settings (another learning rate, a retrained model) fine-tune beside, never over."""
    sha = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return fam_dir / "finetune" / f"{kind}-seed{int(seed)}-{sha}"


def finetune(config, train_config, kind: str, source: pathlib.Path, run_dir: pathlib.Path) -> dict:
    """Runs (or resumes) the fine-tune of the trained run in `source` in the workdir `run_dir`:
    `finetune_config` started from `source`'s parameters (`init_from`: fresh AdamW moments).
    Position interpolation as Chen et al. 2023 run it. Returns `run_finetune`'s record."""
    tune_config = finetune_config(config, train_config, kind)
    return run_finetune(tune_config, run_dir, f"{kind}+ft", init_from=source)


def run_finetune(tune_config, run_dir: pathlib.Path, row: str, *, init_from=None) -> dict:
    """`posattn.train.train_and_evaluate(tune_config, run_dir, init_from=init_from)`, which
    resumes a killed run, for the fine-tune of row `row` (a trained entry's or a checkpoint's).

    Returns:
      {"seconds", "first_train_loss", "final_train_loss"} (first: the first step's batch, before
      any update; read from the run's metrics.jsonl, so a resumed fine-tune reports its whole run).

    Raises:
      Interrupted: it stopped before its last step (preempted); rerunning resumes it.
      NonFiniteLossError: its loss or state became NaN or inf.
    """
    start = time.perf_counter()
    try:
        result = train_and_evaluate(tune_config, run_dir, init_from=init_from)
    except NonFiniteLossError as e:
        raise NonFiniteLossError(
            f"{row}: {e} In the experiment: lower config.finetune.learning_rate or raise "
            f"config.finetune.warmup_steps (and move {run_dir} away)"
        ) from None
    if not result.get("finished"):
        raise Interrupted(
            f"the fine-tune in {run_dir} stopped at step {result.get('step')}; rerun to resume"
        )
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if "loss" in x]
    return {
        "seconds": round(time.perf_counter() - start, 1),
        "first_train_loss": losses[0],
        "final_train_loss": losses[-1],
    }


def finetuned(
    config, kind, seed, source, fam_dir, train_config, trained_params, code, *, reuse=False
) -> tuple[Any, dict]:
    """(params, info) of the fine-tune of the trained run in `source` (seed `seed`): from its
    workdir (`finetune_dir`) when `finetuned.json` there says it finished, made by this code (or
    by any code, with `reuse`); else fine-tuned (or resumed) there now.

    Raises:
      ProducedByOtherCode: that fine-tune was made by other code and `reuse` is off.
    """
    settings = _finetune_settings(config, train_config, kind, seed, params_sha256(trained_params))
    run_dir = finetune_dir(fam_dir, kind, seed, settings)
    row = f"{fam_dir.name}+{kind}+ft"
    tune_config = finetune_config(config, train_config, kind)
    meta = read_finetune_marker(run_dir, code, reuse=reuse)
    if meta is None:
        old = fam_dir / "finetune" / f"{kind}-seed{int(seed)}.npz"
        if old.exists():
            say(
                f"{row}: {old} was saved by an earlier version of this experiment and is not "
                f"read any more; fine-tuning again in {run_dir} (the .npz can be deleted)"
            )
        say(
            f"{row}: fine-tuning seed {seed} for {config.finetune.steps} steps at "
            f"{tune_config.data.seq_len} in {run_dir}"
        )
        info = finetune(config, train_config, kind, source, run_dir)
        meta = write_finetune_marker(run_dir, settings, code, info)
    return finetuned_params(tune_config, run_dir)[1]["params"], meta["info"]


def read_finetune_marker(run_dir: pathlib.Path, code: dict, *, reuse: bool) -> dict | None:
    """The `finetuned.json` record of the fine-tune in `run_dir` (None: not finished there).

    Raises:
      ProducedByOtherCode: it was made by other code than `code` and `reuse` is off.
    """
    marker = run_dir / "finetuned.json"
    meta = json.loads(marker.read_text()) if marker.exists() else None
    if meta is not None and not (same_origin(meta, code) or reuse):
        raise ProducedByOtherCode(
            f"{run_dir} was fine-tuned by {describe_origin(meta)}; this is commit "
            f"{str(code['commit'])[:12]}, code sha256 {code['code_sha256'][:12]}. Rerun with "
            f"--reuse to report its numbers, or move {run_dir} away to fine-tune again."
        )
    return meta


def write_finetune_marker(run_dir: pathlib.Path, settings: dict, code: dict, info: dict) -> dict:
    """Writes (atomically: a killed run never leaves half of one) and returns the record that
    says the fine-tune in `run_dir` finished: its settings, the code that ran it, its losses."""
    meta = {"settings": settings, "code": code, "info": info}
    marker = run_dir / "finetuned.json"
    tmp = marker.with_name(f".{marker.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(meta) + "\n")
    os.replace(tmp, marker)
    return meta


def finetuned_params(tune_config, run_dir: pathlib.Path):
    """`restore_trained` of the fine-tune in `run_dir` at its last step: (cfg, state, step).

    Raises:
      RuntimeError: its checkpoints hold no finished run (the marker says otherwise).
    """
    restored = restore_trained(tune_config, run_dir / "checkpoints")
    if restored is None or restored[2] != int(tune_config.train.steps):
        raise RuntimeError(
            f"{run_dir} holds no finished checkpoint; delete {run_dir / 'finetuned.json'} and "
            "rerun to fine-tune again"
        )
    return restored


def say(message: str) -> None:
    print(f"extrapolation: {message}", flush=True)
