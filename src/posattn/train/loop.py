"""Train a language model; the same command on the same workdir resumes.

    python -m posattn.train --config configs/tiny.py --workdir runs/tiny [--config.key=value ...]

The run is `train_and_evaluate(config, workdir)`, which tests call too; a fine-tune is the same
call with `init_from=OTHER_WORKDIR` (that run's parameters, fresh optimiser moments). It reads top
to bottom: setup (validate, distributed, mesh, data, model, checkpoint: everything that can fail
does so before any compute), then `run_loop`, the one training loop, which `posattn.sweep` and the
length-extrapolation experiment use as well (each run hands it one `Job`): batches as a pure
function of (seed, step), each process building only the rows its devices hold; one compiled
step with donated state; metrics (with step time, tokens/s and MFU) flushed every `log_every`
steps and checked; evaluation; checkpoints; SIGTERM on any process stopping every process after
the same step; profiles.

A workdir holds `config.json`, `metrics.jsonl` (a line per training step with `step` and `loss`,
evaluation lines with `eval_`-prefixed keys), `checkpoints/`, and optionally `profile/` and
TensorBoard event files. docs/training.md describes all of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from posattn import cli, hostmem
from posattn import config as config_lib
from posattn import data as data_lib
from posattn.nn.model import TransformerLM
from posattn.train import loggers as loggers_lib
from posattn.train import sharding, steps
from posattn.train import workdir as workdir_lib
from posattn.train.checkpoint import (
    Checkpointer,
    IncompatibleCheckpointError,
    NonFiniteStateError,
)
from posattn.train.workdir import WorkdirBusyError

__all__ = [
    "Job",
    "LoopResult",
    "NonFiniteLossError",
    "PEAK_FLOPS",
    "Schedule",
    "WorkdirBusyError",
    "device_peak_flops",
    "main",
    "restore_for_resume",
    "restore_trained",
    "run_loop",
    "train_and_evaluate",
]

_log = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """The loss, or the train state about to be saved, became NaN or inf; the message names the
    step, the last good checkpoint and how to go on."""


def nonfinite_advice(directory: pathlib.Path, last_checkpoint: int | None) -> str:
    """What a run stopped by a NaN or inf can do next (every saved checkpoint is finite)."""
    if last_checkpoint is None:
        return (
            f"No checkpoint was saved in {directory}. Start again (a new --workdir, or this one "
            "after deleting it) with a lower train.learning_rate, a longer train.warmup_steps, a "
            "lower train.grad_clip or another train.b2, or check the data."
        )
    where = directory / str(last_checkpoint)
    return (
        f"The last good checkpoint is {where} (step {last_checkpoint}; every saved checkpoint is "
        "checked finite). Rerunning the same command resumes from it with the same settings. To "
        "go on from it with other settings (a lower train.learning_rate, a longer "
        "train.warmup_steps, another train.b2: a workdir refuses a different config), start a "
        f"new workdir from it: --restart_from={where} --workdir NEW_DIR; or check the data."
    )


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str | os.PathLike,
    *,
    init_from: str | os.PathLike | None = None,
    stop_after: int | None = None,
    restart_from: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Trains (or resumes) the run described by `config` in `workdir`; returns the final metrics.

    Pretraining and fine-tunes alike: a fine-tune is a run whose parameters start from another
    run's (`init_from`), in a workdir of its own (checkpoints, metrics.jsonl, resumable).

    Args:
      config: a validated-on-entry ConfigDict (see `configs/`).
      workdir: where config.json, metrics.jsonl and checkpoints/ live; an existing run resumes.
      init_from: a posattn workdir whose latest checkpoint's parameters this run starts from,
        with fresh optimiser moments and this config's optimiser and data settings. Its model
        may differ from that run's only in how it computes (`posattn.hf.config.TRAINING_KEYS`:
        a `rope_scaling` for position interpolation, dtypes, remat, the layer layout,
        attention_impl). Read when the workdir holds no checkpoint yet; a resumed run continues
        from its own.
      stop_after: stop after this step as a preemption would (checkpoint saved, run resumable):
        for time-sliced jobs, and for tests of exact resumption.
      restart_from: a checkpoint of another run (`OTHER/checkpoints/N`) that this new workdir
        starts from, with this config's optimiser settings (learning rate, betas, weight decay,
        schedule): how a run stopped by a NaN goes on with other settings. The model and data
        settings must be the checkpoint's; the workdir must hold no checkpoint yet.
    """
    # ---- Setup: everything that can fail does so before any compute. ----
    config = config_lib.complete(config)  # every key present: its default is written once
    cfg = config_lib.validate(config)
    train_cfg, data_cfg = config.train, config.data
    sharding.maybe_initialize_distributed(bool(train_cfg.distributed))
    workdir = pathlib.Path(workdir)
    lead = jax.process_index() == 0
    mesh = sharding.make_mesh(train_cfg.fsdp)
    B = train_cfg.batch_size
    if B % mesh.size or B % jax.process_count():
        raise config_lib.ConfigError(
            f"config.train.batch_size={B} must be divisible by the number of devices "
            f"({mesh.size}); use a multiple of {mesh.size}"
        )
    loggers_lib.check(train_cfg)
    source = None
    if init_from is not None:
        source = _init_source(init_from, cfg, restart_from)
    corpus = data_lib.load_corpus(data_cfg.corpus)
    corpus.check_vocab(cfg.vocab_size)
    data_lib.check_length(corpus, data_cfg.seq_len)
    if train_cfg.eval_every:
        check_eval_split(corpus, seq_len=data_cfg.seq_len, batch_size=B)
    if lead:  # only once every check has passed: a refused config leaves no directory behind
        workdir_lib.make_workdir(workdir)
    with workdir_lib.lock(workdir) if lead else contextlib.nullcontext():
        if lead:  # config.json is written once the checkpoints' own config agrees (in _train)
            workdir_lib.check_config(workdir, config)
        return _train(config, cfg, corpus, workdir, lead, stop_after, mesh, restart_from, source)


def check_eval_split(corpus: data_lib.Corpus, *, seq_len: int, batch_size: int) -> None:
    """Refuses (DataError) a validation split that fills no evaluation batch: `eval_batches`
    would be empty and every evaluation would score no tokens."""
    windows = (corpus.val.size - 1) // seq_len if corpus.val.size > 0 else 0
    if windows < batch_size:
        raise data_lib.DataError(
            f"corpus {corpus.name!r}: the val split has {corpus.val.size} tokens, {windows} "
            f"windows of data.seq_len={seq_len}, fewer than one evaluation batch of "
            f"train.batch_size={batch_size}; use a larger corpus, a smaller batch_size or "
            "seq_len, or train.eval_every=0"
        )


def restore_for_resume(
    ckpt: Checkpointer,
    abstract,
    shardings,
    corpus: data_lib.Corpus,
    where: pathlib.Path,
    config: ml_collections.ConfigDict | None = None,
) -> tuple[Any, int] | None:
    """(state, step) of the latest checkpoint that restores, laid out as `shardings`, or None.

    Refuses (DataError) a checkpoint written on a corpus whose content hash differs from
    `corpus`'s: resuming would silently continue on other data. With `config`, refuses
    (ConfigError, naming the keys) a checkpoint trained with a config that computes something
    else, whatever config.json says (it may be missing or edited). `where` names the run.
    """
    targets = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    restored = ckpt.restore_latest(targets)
    if restored is None:
        return None
    state, record = restored
    _check_corpus(record, corpus, where)
    if config is not None and isinstance(record.get("config"), dict):
        workdir_lib.check_config(where, config, saved=record["config"])
    return state, int(record["step"])


def _check_corpus(record: dict, corpus: data_lib.Corpus, where) -> None:
    if record.get("corpus_sha256") not in (None, corpus.sha256):
        raise data_lib.DataError(
            f"{where} was trained on a corpus with sha256 {record['corpus_sha256'][:12]}..., but "
            f"{corpus.name!r} now hashes to {corpus.sha256[:12]}...; use a new --workdir"
        )


_OPTIMISER_HYPERPARAMS = ("learning_rate", "b1", "b2", "weight_decay")


def restart_state(
    checkpoint: str | os.PathLike,
    config: ml_collections.ConfigDict,
    targets,
    corpus: data_lib.Corpus,
) -> tuple[Any, int]:
    """(state, step) of `checkpoint` (`DIR/N`, opened read-only) with `config`'s optimiser
    hyperparameters written into its optimiser state (the moments are kept).

    Raises:
      ConfigError: no such checkpoint, or its model/data settings differ from `config`'s.
      DataError: it was trained on another corpus.
    """
    path = pathlib.Path(checkpoint)
    if not path.name.isdigit():
        raise config_lib.ConfigError(
            f"--restart_from={checkpoint} must name one checkpoint, DIR/checkpoints/<step>"
        )
    reader = Checkpointer(path.parent, read_only=True)
    try:
        step = int(path.name)
        if step not in reader.steps():
            raise config_lib.ConfigError(
                f"--restart_from={checkpoint}: no checkpoint {step} in {path.parent} (there: "
                f"{reader.steps() or 'none'})"
            )
        try:
            state, record = reader.restore_checked(step, targets)
        except (IncompatibleCheckpointError, MemoryError):
            raise
        except Exception as e:  # damaged: orbax raises many types
            raise config_lib.ConfigError(
                f"--restart_from={checkpoint} does not restore ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:300]}); pick an older checkpoint"
            ) from None
    finally:
        reader.close()
    _check_corpus(record, corpus, path)
    saved = record.get("config")
    if isinstance(saved, dict):
        differ = [
            d
            for d in workdir_lib.config_differences(saved, config)
            if not d[0].startswith("train.")
        ]
        if differ:
            detail = ", ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in differ[:5])
            raise config_lib.ConfigError(
                f"--restart_from={checkpoint} was trained with other model or data settings "
                f"({detail}); a restart may change only train.* settings"
            )
    hyper = steps.hyperparams(state["opt_state"])
    values = {
        name: jax.device_put(
            np.asarray(config.train[name], dtype=hyper[name].dtype), hyper[name].sharding
        )
        for name in _OPTIMISER_HYPERPARAMS
    }
    return dict(state, opt_state=steps.with_hyperparams(state["opt_state"], values)), step


@dataclasses.dataclass(frozen=True)
class _Source:
    """The run `init_from` names: its workdir, config and validated model config."""

    workdir: pathlib.Path
    config: ml_collections.ConfigDict
    cfg: Any


def _init_source(init_from, cfg, restart_from) -> _Source:
    """Checks `init_from` before any compute: a posattn workdir with checkpoints, whose model
    differs from `cfg` only in how it computes (`posattn.hf.config.TRAINING_KEYS`, as a
    fine-tune of a published checkpoint)."""
    from posattn.hf.config import TRAINING_KEYS

    fail = config_lib.ConfigError
    if restart_from is not None:
        raise fail(
            "--init_from and --restart_from both start a new run from another one; give one "
            "(--restart_from keeps the optimiser's moments, --init_from only the parameters)"
        )
    if cfg.init_from:
        raise fail(
            f"--init_from={init_from} and config.model.init_from={cfg.init_from!r} both name "
            "the starting parameters; give one"
        )
    source = pathlib.Path(init_from)
    saved = source / "config.json"
    if not saved.is_file() or not (source / "checkpoints").is_dir():
        raise fail(
            f"--init_from={init_from} is not a posattn workdir (it holds no config.json and "
            "checkpoints/); name the directory a run trained in"
        )
    try:
        source_config = workdir_lib.read_config(source)
        source_cfg = config_lib.validate(source_config)
    except (ValueError, config_lib.ConfigError) as e:
        raise fail(f"--init_from={init_from}: its config.json does not validate ({e})") from None
    before, now = source_cfg.keys(), cfg.keys()
    differ = [
        (k, before.get(k), now.get(k))
        for k in sorted(set(before) | set(now))
        if before.get(k) != now.get(k) and k not in TRAINING_KEYS
    ]
    if differ:
        detail = ", ".join(f"model.{k}: {old!r} -> {new!r}" for k, old, new in differ[:5])
        raise fail(
            f"--init_from={init_from} trained another model ({detail}); a run started from it "
            f"may change only {', '.join(k for k in TRAINING_KEYS if k != 'init_from')}"
        )
    return _Source(source, source_config, source_cfg)


def _init_params(source: _Source, cfg, mesh, targets) -> tuple[Any, int]:
    """(parameters, step) of the latest checkpoint of `source` that restores, as `targets` (the
    new run's abstract parameters, with their shardings) holds them: in `cfg`'s layer layout
    (`model.scan_layers`) and dtypes.

    Raises:
      ConfigError: no checkpoint of `source` restores, or its parameters do not fit `targets`.
    """
    tx = steps.make_optimizer(steps.OptimConfig.from_config(source.config.train))
    abstract = jax.eval_shape(
        functools.partial(steps.init_train_state, source.cfg, tx), jax.random.key(0)
    )
    reader = Checkpointer(source.workdir / "checkpoints", read_only=True)
    try:
        restored = reader.restore_latest(
            jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                abstract,
                sharding.state_shardings(mesh, abstract),
            )
        )
    finally:
        reader.close()
    if restored is None:
        raise config_lib.ConfigError(
            f"--init_from={source.workdir}: no checkpoint in {source.workdir / 'checkpoints'} "
            "restores"
        )
    state, record = restored
    params = state["params"]
    if source.cfg.scan_layers != cfg.scan_layers:
        from posattn.nn.model import convert_layout

        (params,) = convert_layout((params,), source.cfg, scan_layers=cfg.scan_layers)
    shapes = jax.tree.map(lambda x: x.shape, params)
    if jax.tree.structure(params) != jax.tree.structure(targets) or shapes != jax.tree.map(
        lambda t: t.shape, targets
    ):
        raise config_lib.ConfigError(
            f"--init_from={source.workdir}: its parameters (step {record['step']}) do not fit "
            "this model's; start from a run of the same architecture"
        )
    params = jax.tree.map(
        lambda p, t: jax.device_put(p.astype(t.dtype), t.sharding), params, targets
    )
    return params, int(record["step"])


def restore_trained(
    config: ml_collections.ConfigDict, checkpoints: pathlib.Path
) -> tuple[Any, Any, int] | None:
    """(validated model config, train state, step) of the latest checkpoint in `checkpoints`, on
    one local device (for evaluation and generation), or None when none restores.

    A reader: the checkpoints are opened read-only (`Checkpointer(read_only=True)`), so it may
    run while a trainer writes to the same directory; nothing is created, cleaned or moved."""
    cfg = config_lib.validate(config)
    tx = steps.make_optimizer(steps.OptimConfig.from_config(config.train))
    abstract = jax.eval_shape(functools.partial(steps.init_train_state, cfg, tx), jax.random.key(0))
    device = SingleDeviceSharding(jax.local_devices()[0])
    ckpt = Checkpointer(checkpoints, read_only=True)  # never touches a running trainer's files
    try:
        restored = ckpt.restore_latest(
            jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract
            )
        )
    finally:
        ckpt.close()
    return None if restored is None else (cfg, restored[0], int(restored[1]["step"]))


def _train(
    config,
    cfg,
    corpus,
    workdir: pathlib.Path,
    lead: bool,
    stop_after: int | None,
    mesh,
    restart_from=None,
    source: _Source | None = None,
) -> dict[str, Any]:
    train_cfg, data_cfg = config.train, config.data
    B, T = train_cfg.batch_size, data_cfg.seq_len
    optim = steps.OptimConfig.from_config(train_cfg)
    tx = steps.make_optimizer(optim)
    key = jax.random.key(train_cfg.seed)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(params=0))))
    init = functools.partial(steps.init_train_state, cfg, tx)
    abstract = jax.eval_shape(init, key)
    state_sh = sharding.state_shardings(mesh, abstract)
    batch_sh = sharding.batch_sharding(mesh)
    replicated = NamedSharding(mesh, P())
    options = data_lib.batch_options(data_cfg, causal=cfg.causal, vocab_size=cfg.vocab_size)

    ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=train_cfg.keep_checkpoints)
    if restart_from is not None and ckpt.steps():
        ckpt.close()
        raise config_lib.ConfigError(
            f"--restart_from starts a new run, but {workdir} already holds checkpoints "
            f"{ckpt.steps()}; rerun without --restart_from to resume it, or use a new --workdir"
        )
    try:
        if restart_from is not None:
            targets = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_sh
            )
            restored = restart_state(restart_from, config, targets, corpus)
        else:
            restored = restore_for_resume(ckpt, abstract, state_sh, corpus, workdir, config)
    except BaseException:
        ckpt.close()
        raise
    if restored is not None:
        state, start = restored
        how = f"restarting from {restart_from}" if restart_from is not None else "resuming"
        workdir_lib.say(lead, f"{how} {workdir} from step {start}")
    else:
        # The starting parameters: a published checkpoint's (posattn.hf), another run's, or
        # (None) drawn from the key; AdamW's moments at 0 either way.
        params, start, origin = None, 0, None
        if cfg.init_from:
            from posattn import hf

            params = hf.load_params(cfg.init_from[3:], cfg, shardings=state_sh["params"])
            origin = cfg.init_from
        elif source is not None:
            targets = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                abstract["params"],
                state_sh["params"],
            )
            try:
                params, at = _init_params(source, cfg, mesh, targets)
            except BaseException:
                ckpt.close()
                raise
            origin = f"{source.workdir} (its step {at})"
        platform = mesh.devices.flat[0].platform
        init = steps.jit_init_train_state(cfg, tx, out_shardings=state_sh, platform=platform)
        state = init(key) if params is None else init(key, params)
        if origin is not None:
            workdir_lib.say(lead, f"starting from {origin}")
    if lead:
        workdir_lib.write_config(workdir, config)
    metrics = workdir_lib.MetricsFile(
        workdir / "metrics.jsonl",
        keep_through=start,
        loggers=loggers_lib.open_loggers(train_cfg, workdir, config.to_dict()) if lead else (),
        enabled=lead,
        expect_through=restart_from is None,
    )

    step_fn = jax.jit(
        functools.partial(steps.train_step, graphdef, optim),
        in_shardings=(state_sh, batch_sh),
        out_shardings=(state_sh, replicated),
        donate_argnums=0,
    )
    eval_fn = jax.jit(functools.partial(steps.eval_step, graphdef), out_shardings=replicated)
    eval_data = data_lib.eval_batches(
        corpus,
        seed=train_cfg.seed,
        batch_size=B,
        seq_len=T,
        max_batches=train_cfg.eval_batches,
        **options,
    )

    offset = int(data_cfg.batch_offset)  # step s reads the batch stream's batch s + offset

    def batch_at(step: int) -> dict[str, jax.Array]:
        def rows(index):
            return data_lib.train_batch(
                corpus, seed=train_cfg.seed, step=step + offset, batch_size=B, seq_len=T,
                rows=index[0], **options,
            )  # fmt: skip

        return sharding.global_batch(rows, batch_sh, (B,))

    def evaluate(step: int, state) -> dict[str, float]:
        nll, count = 0.0, 0.0
        for full in eval_data:
            batch = sharding.global_batch(
                lambda i, full=full: {k: v[i] for k, v in full.items()}, batch_sh, (B,)
            )
            s, c = eval_fn(state["params"], state["constants"], batch)
            nll, count = nll + float(s), count + float(c)
        if count <= 0:  # never report a loss over no tokens as 0.0
            raise data_lib.DataError(
                f"evaluation at step {step} scored no tokens: the validation split of "
                f"{corpus.name!r} fills no batch of train.batch_size={B} windows of "
                f"data.seq_len={T}; use a larger corpus or a smaller batch_size or seq_len"
            )
        result = {"step": step, "eval_loss": nll / count, "eval_tokens": int(count)}
        metrics.write(result)
        return result

    final: dict[str, Any] = {}

    def emit(step: int, values: dict, timing: dict, last_checkpoint: int) -> None:
        line = {"step": step, **{k: float(v) for k, v in values.items()}, **timing}
        metrics.write(line)
        final.update(line)
        if not np.isfinite(line["loss"]):
            raise NonFiniteLossError(
                f"loss is {line['loss']} at step {step}: training stopped. "
                + nonfinite_advice(ckpt.directory, last_checkpoint)
            )

    def record(step: int) -> dict:
        return {
            "step": step,
            "seed": int(train_cfg.seed),
            "corpus": corpus.name,
            "corpus_sha256": corpus.sha256,
            "config": config.to_dict(),
        }

    job = Job(
        step=step_fn,
        batch_at=batch_at,
        emit=emit,
        record=record,
        evaluate=evaluate,
        name=f"train {cfg.position}",
        tokens_per_step=B * T,
        peak_flops=train_cfg.get("peak_flops"),
        profile_dir=workdir / "profile",
    )
    with metrics:
        out = run_loop(
            state, start, job, Schedule.from_config(train_cfg, stop_after=stop_after), ckpt, mesh
        )
    return {
        "step": out.step,
        **final,
        **(out.last_eval or {}),
        "preempted": out.preempted,
        "finished": out.step == train_cfg.steps,
    }


# ----------------------------------------------------------------------------------------------
# The one loop, shared by `posattn.train` and `posattn.sweep`.


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When the loop flushes metrics, evaluates, checkpoints, profiles and stops.

    Attributes:
      total: the last step (`train.steps`).
      log_every: metrics are fetched and written every this many steps (and before evaluations
        and checkpoints, so that their time is not counted as steps').
      checkpoint_every: a checkpoint every this many steps, at `total`, and when stopping early.
      eval_every: evaluate every this many steps and at `total` (0: never).
      eval_at_end: evaluate at `total` even when `eval_every` is 0.
      stop_after: stop after this step as a preemption would (saved, resumable).
      profile_steps: `(first, count)`: a `jax.profiler` trace of steps first .. first+count-1.
    """

    total: int
    log_every: int = 10
    checkpoint_every: int = 500
    eval_every: int = 0
    eval_at_end: bool = False
    stop_after: int | None = None
    profile_steps: tuple[int, int] | None = None

    @classmethod
    def from_config(cls, train, *, stop_after: int | None = None, eval_at_end: bool = False):
        profile = tuple(train.profile_steps or ()) or None
        return cls(
            total=int(train.steps),
            log_every=int(train.log_every),
            checkpoint_every=int(train.checkpoint_every),
            eval_every=int(train.eval_every),
            eval_at_end=eval_at_end,
            stop_after=stop_after,
            profile_steps=None if profile is None else (int(profile[0]), int(profile[1])),
        )

    def agrees(self, step: int) -> bool:
        """Whether the processes agree on SIGTERM after `step`: at every flush (when the host
        waits for the devices anyway), so that a multi-host run adds no host sync per step."""
        return step % self.log_every == 0 or step % self.checkpoint_every == 0 or step == self.total

    def evaluates(self, step: int) -> bool:
        if step == self.total:
            return bool(self.eval_every) or self.eval_at_end
        return bool(self.eval_every) and step % self.eval_every == 0


@dataclasses.dataclass
class LoopResult:
    state: Any
    step: int  # the last step taken (== start when there was nothing to do)
    preempted: bool  # stopped by SIGTERM (on any process)
    last_eval: Any  # what `job.evaluate` returned last, or None


@dataclasses.dataclass(frozen=True)
class Job:
    """What one run gives the loop: `posattn.train` builds one, each program of `posattn.sweep`
    another (its members stacked), and the loop does the rest.

    Attributes:
      step: `(state, batch) -> (state, metrics)`, jitted with donated state: compiled once ahead,
        its `cost_analysis()` FLOPs give the MFU (a plain function runs as it is).
      batch_at: `step -> batch` of global arrays (`posattn.train.sharding.global_batch`), a pure
        function of the step, so a resumed run sees the batches it would have seen.
      emit: `(step, values, timing, last_checkpoint)` for every step, at each flush: writes the
        step's metric lines (one for a run, one per live member for a sweep); may raise to stop
        the run. `values` are the step's fetched metrics; `timing` holds `step_time` (seconds,
        the mean over the flush interval, evaluations and checkpoints excluded),
        `tokens_per_sec` and `mfu` (None where the device's peak is unknown); `last_checkpoint`
        is None before the first checkpoint of a fresh run.
      record: `step -> dict`, the JSON record saved beside that step's checkpoint.
      evaluate: `(step, state) -> result`, run on `Schedule.evaluates` steps (None: never).
      name: the progress bar's label; `where` (" of sweep program 2") ends the loop's messages.
      tokens_per_step: every member's batch tokens, for `tokens_per_sec`.
      peak_flops: the device's peak FLOP/s for the MFU (None: `PEAK_FLOPS` by device kind).
      profile_dir: where the trace of `Schedule.profile_steps` goes.
    """

    step: Callable[[Any, Any], tuple[Any, dict]]
    batch_at: Callable[[int], Any]
    emit: Callable[[int, dict, dict, int | None], None]
    record: Callable[[int], dict]
    evaluate: Callable[[int, Any], Any] | None = None
    name: str = "train"
    where: str = ""
    tokens_per_step: int = 0
    peak_flops: float | None = None
    profile_dir: pathlib.Path | None = None


def run_loop(
    state: Any, start: int, job: Job, schedule: Schedule, checkpointer: Checkpointer, mesh
) -> LoopResult:
    """Steps `state` from `start` to `schedule.total` under `mesh`: the loop of every training
    run, calling `job`'s functions (`Job` says when and with what).

    Every `log_every` steps (and before evaluations and checkpoints) the pending metrics are
    fetched and emitted. A checkpoint (`checkpointer.save(step, state, job.record(step))`) is
    written every `checkpoint_every` steps, at the end, and when stopping early; a state holding
    NaN or inf is never saved: the run stops with `NonFiniteLossError` naming the last checkpoint
    saved, which is therefore good.

    SIGTERM on any process stops every process after the same step: with several processes the
    flag is agreed by a collective every `log_every` steps (`Schedule.agrees`,
    `posattn.train.sharding.any_process`; with one, it is read after every step), so all
    processes save the same checkpoint and return normally; the same command then resumes
    exactly. The checkpointer is closed on the way out, whatever happens.
    """
    lead = jax.process_index() == 0
    step_fn, where = job.step, job.where
    bar = workdir_lib.progress_bar(lead, schedule.total, start, job.name)
    flops = None
    pending: list[tuple[int, Any]] = []
    # A run resumed from step `start` was restored from its checkpoint; a fresh run has none.
    last_checkpoint = start if start > 0 else None
    last_eval, preempted = None, False
    steps_since, tick = 0, time.perf_counter()
    profiler = _Profiler(schedule.profile_steps, job.profile_dir)
    step = start
    try:
        with jax.set_mesh(mesh), workdir_lib.preemption_flag() as received:
            for step in range(start + 1, schedule.total + 1):
                batch = job.batch_at(step)
                if flops is None and hasattr(step_fn, "lower"):
                    compiled = step_fn.lower(state, batch).compile()
                    flops, step_fn = _flops(compiled), compiled
                    if lead and jax.default_backend() == "cpu":
                        hint = hostmem.scratch_hint(_scratch_bytes(compiled))
                        if hint:
                            _log.warning(hint)
                    tick = time.perf_counter()  # compilation is not a step
                profiler.before(step)
                state, metrics = step_fn(state, batch)
                profiler.after(step, state)
                pending.append((step, metrics))
                steps_since += 1
                if jax.process_count() == 1 or schedule.agrees(step):
                    preempted = sharding.any_process(received())
                stopping = preempted or step == schedule.stop_after
                checkpoint_now = (
                    step % schedule.checkpoint_every == 0 or step == schedule.total or stopping
                )
                evaluating = job.evaluate is not None and schedule.evaluates(step)
                if step % schedule.log_every == 0 or checkpoint_now or evaluating:
                    fetched = jax.device_get([m for _, m in pending])
                    elapsed = time.perf_counter() - tick
                    timing = _timing(
                        elapsed / steps_since, job.tokens_per_step, flops, job.peak_flops
                    )
                    for (s, _), values in zip(pending, fetched, strict=True):
                        job.emit(s, values, timing, last_checkpoint)
                    _show(bar, step, fetched[-1], timing)
                    pending, steps_since = [], 0
                if evaluating:
                    last_eval = job.evaluate(step, state)
                if checkpoint_now:
                    try:
                        checkpointer.save(step, state, job.record(step))
                    except NonFiniteStateError as e:
                        raise NonFiniteLossError(
                            f"{e}{where}: training stopped (the loss of this step was finite; "
                            "the update was not). "
                            + nonfinite_advice(checkpointer.directory, last_checkpoint)
                        ) from None
                    last_checkpoint = step
                tick = tick if steps_since else time.perf_counter()
                if stopping:
                    # The signal may have reached another process only: SIGTERM, as before.
                    signame = received.name or "SIGTERM"
                    why = (
                        ("interrupted" if signame == "SIGINT" else "preempted") + f" ({signame})"
                        if preempted
                        else "stopped as asked"
                    )
                    workdir_lib.say(
                        lead,
                        f"{why} at step {step}{where}: checkpoint saved; rerun the same command "
                        "to resume",
                    )
                    break
    finally:
        profiler.close()
        if bar is not None:
            bar.close()
        checkpointer.close()
    return LoopResult(state=state, step=step, preempted=preempted, last_eval=last_eval)


# Peak dense bfloat16 FLOP/s of one JAX device, by `device_kind` (NVIDIA's and Google Cloud's
# data sheets; a TPU v4/v5p device is one chip of two cores). The first match wins.
PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("A100", 312e12),
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),  # v5e
    ("TPU v5e", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v5", 459e12),
    ("TPU v6 lite", 918e12),  # v6e (Trillium)
    ("TPU v6e", 918e12),
)


def device_peak_flops(device_kind: str) -> float | None:
    """The device's peak dense bfloat16 FLOP/s from `PEAK_FLOPS`, or None (e.g. a CPU)."""
    for known, peak in PEAK_FLOPS:
        if known.lower() in device_kind.lower():
            return peak
    return None


def _flops(compiled) -> float | None:
    """FLOPs per device of a compiled program (XLA's cost analysis), or None if it has none."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # some backends have no cost model
        return None
    if isinstance(analysis, (list, tuple)):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else {}
    value = (analysis or {}).get("flops")
    return float(value) if value and value > 0 else None


def _scratch_bytes(compiled) -> int:
    """The bytes of scratch a compiled program allocates on each run (0 if XLA does not say)."""
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # no memory analysis on this backend or JAX
        return 0


def _timing(step_time: float, tokens_per_step: int, flops, peak_flops) -> dict[str, Any]:
    """Step time (s), tokens/s and MFU: model FLOPs per device / step time / the device's peak."""
    step_time = max(step_time, 1e-9)
    peak = peak_flops or device_peak_flops(jax.devices()[0].device_kind)
    mfu = flops / step_time / peak if flops and peak else None
    return {"step_time": step_time, "tokens_per_sec": tokens_per_step / step_time, "mfu": mfu}


def _show(bar, step: int, values: dict, timing: dict) -> None:
    if bar is None:
        return
    bar.update(step - bar.n)
    postfix = {"tok_s": f"{timing['tokens_per_sec']:,.0f}"}
    if np.ndim(values.get("loss")) == 0:
        postfix = {"loss": f"{float(values['loss']):.4f}", **postfix}
    if timing["mfu"] is not None:
        postfix["mfu"] = f"{timing['mfu']:.1%}"
    bar.set_postfix(postfix)


class _Profiler:
    """A `jax.profiler` trace of steps `first .. first + count - 1` into `directory`.

    A run resumed past `first` is not traced. With several processes, process i > 0 writes
    under `directory/process_<i>`.
    """

    def __init__(self, steps: tuple[int, int] | None, directory: pathlib.Path | None):
        self.first, self.last = (steps[0], steps[0] + steps[1] - 1) if steps else (0, -1)
        self.directory = directory
        if directory is not None and jax.process_index() > 0:
            self.directory = directory / f"process_{jax.process_index()}"
        self.active = False

    def before(self, step: int) -> None:
        if step == self.first and self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after(self, step: int, state) -> None:
        if self.active and step == self.last:
            jax.block_until_ready(state)
            self.close()

    def close(self) -> None:
        if self.active:
            self.active = False
            jax.profiler.stop_trace()


TRAIN_COMMAND = cli.Command(
    cli.TRAIN.prog,
    cli.TRAIN.description,
    flags=(
        cli.WORKDIR,
        cli.Flag(
            "restart_from",
            "start this new workdir from another run's checkpoint (DIR/checkpoints/N) with this "
            "config's optimiser settings, e.g. a lower learning rate after a NaN",
            None,
            metavar="CHECKPOINT",
        ),
        cli.Flag(
            "init_from",
            "start this new workdir from another run's parameters (its latest checkpoint; fresh "
            "optimiser moments), e.g. a fine-tune under a model.rope_scaling",
            None,
            metavar="WORKDIR",
        ),
    ),
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def body() -> int:
        args = cli.parse(TRAIN_COMMAND, argv)
        result = train_and_evaluate(
            args.config, args.workdir, init_from=args.init_from, restart_from=args.restart_from
        )
        summary = {
            k: v for k, v in result.items() if k in ("step", "loss", "eval_loss", "preempted")
        }
        print(f"posattn.train: done {json.dumps(summary)}")
        return 0

    return cli.report_errors(
        "posattn.train",
        argv,
        body,
        user_errors=(data_lib.DataError,),
        run_errors=(WorkdirBusyError, NonFiniteLossError, IncompatibleCheckpointError),
    )
