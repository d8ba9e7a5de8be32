"""Training (or reusing) one seed of one entry, restoring it, and the position-interpolation
fine-tunes of the `+ft` rows.

Seed k of an entry is a `posattn.train.train_and_evaluate` run of the entry's config with
`train.seed` = k: the first seed (`train.seed`) in `WORKDIR/<entry>/`, the others in
`WORKDIR/<entry>/seed<k>/`, so adding seeds never retrains one already trained. Its
`trained.json` records the config, the code that trained it and the corpus; a run trained by
other code (or on another corpus) is refused unless `reuse`.

Fine-tunes keep their own path (not `train_and_evaluate`): `finetune_params` runs the training's
optimizer for `finetune.steps` steps in one process and `finetuned` caches the result in
`WORKDIR/<entry>/finetune/<kind>-seed<k>.npz` (not resumable midway: an interrupted fine-tune
starts again).
"""

from __future__ import annotations

import dataclasses
import functools
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
from posattn import data as data_lib
from posattn.eval import lengths as lengths_lib
from posattn.nn.model import TransformerLM
from posattn.train import NonFiniteLossError, restore_trained, train_and_evaluate
from posattn.train import steps as steps_lib

from .provenance import ProducedByOtherCode, describe_origin, same_origin
from .settings import (
    entry_dir,
    finetune_batch_size,
    finetune_multiple,
    finetune_scaling,
)

__all__ = [
    "Interrupted",
    "finetune_params",
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
    if info.get("config") != json.loads(config_lib.to_json(train_config)):
        return None
    if same_origin(info, code) or reuse:
        return info
    raise ProducedByOtherCode(
        f"{run_dir} was trained by {describe_origin(info)}; this is commit "
        f"{str(code['commit'])[:12]}, code sha256 {code['code_sha256'][:12]}, corpus sha256 "
        f"{code['corpus_sha256'][:12]}. Rerun with --reuse to report its numbers (results.json "
        f"then lists that row's own commit), or move {run_dir} away to retrain it with this code."
    )


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
    graphdef, constants = lengths_lib.with_rope_scaling(cfg, finetune_scaling(config, kind))
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
            f"{kind}+ft: the fine-tune's loss is {losses[bad]} at step {bad}; lower "
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


def finetuned(
    config, cfg, params, corpus, kind, seed, fam_dir, train_config, code, *, reuse=False
) -> tuple[Any, dict]:
    """(params, info) of `finetune_params`, from `fam_dir/finetune/<kind>-seed<seed>.npz` when it
    holds these settings (the finetune block, the training config, the trained parameters' hash)
    and was made by this code (or by any code, with `reuse`); else fine-tuned now and saved."""
    path = fam_dir / "finetune" / f"{kind}-seed{seed}.npz"
    row = f"{fam_dir.name}+{kind}+ft"
    settings = _finetune_settings(config, train_config, kind, seed, params_sha256(params))
    leaves, treedef = jax.tree.flatten(params)
    if path.exists():
        with np.load(path, allow_pickle=False) as saved:
            meta = json.loads(str(saved["meta"]))
            if meta.get("settings") == settings and (same_origin(meta, code) or reuse):
                tuned = [
                    jax.numpy.asarray(saved[f"p{i}"], dtype=leaf.dtype)
                    for i, leaf in enumerate(leaves)
                ]
                return jax.tree.unflatten(treedef, tuned), meta["info"]
        if meta.get("settings") == settings:
            say(f"{row}: {path} was made by {describe_origin(meta)}; fine-tuning again")
    say(
        f"{row}: fine-tuning seed {seed} for {config.finetune.steps} steps at "
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


def say(message: str) -> None:
    print(f"extrapolation: {message}", flush=True)
