"""Train a language model; the same command on the same workdir resumes.

    python -m posattn.train --config configs/tiny.py --workdir runs/tiny [--config.key=value ...]

The run is `train_and_evaluate(config, workdir)`, which tests call too. It reads top to bottom:
setup (validate, distributed, mesh, data, model, checkpoint: everything that can fail does so
before any compute), then `run_loop`, the one training loop, which `posattn.sweep` and the
length-extrapolation experiment use as well: batches as a pure function of (seed, step), each
process building only the rows its devices hold; one compiled step with donated state; metrics
(with step time, tokens/s and MFU) flushed every `log_every` steps and checked; evaluation;
checkpoints; SIGTERM on any process stopping every process after the same step; profiles.

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

from posattn import cli
from posattn import config as config_lib
from posattn import data as data_lib
from posattn.nn.model import TransformerLM
from posattn.train import sharding, steps
from posattn.train import workdir as workdir_lib
from posattn.train.checkpoint import Checkpointer, IncompatibleCheckpointError
from posattn.train.workdir import WorkdirBusyError

__all__ = [
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
    """The loss became NaN or inf; the message names the step and the last good checkpoint."""


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str | os.PathLike, *, stop_after: int | None = None
) -> dict[str, Any]:
    """Trains (or resumes) the run described by `config` in `workdir`; returns the final metrics.

    Args:
      config: a validated-on-entry ConfigDict (see `configs/`).
      workdir: where config.json, metrics.jsonl and checkpoints/ live; an existing run resumes.
      stop_after: stop after this step as a preemption would (checkpoint saved, run resumable):
        for time-sliced jobs, and for tests of exact resumption.
    """
    # ---- Setup: everything that can fail does so before any compute. ----
    cfg = config_lib.validate(config)
    train_cfg, data_cfg = config.train, config.data
    sharding.maybe_initialize_distributed(bool(train_cfg.get("distributed", False)))
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    lead = jax.process_index() == 0
    mesh = sharding.make_mesh(train_cfg.get("fsdp", 1))
    B = train_cfg.batch_size
    if B % mesh.size or B % jax.process_count():
        raise config_lib.ConfigError(
            f"config.train.batch_size={B} must be divisible by the number of devices "
            f"({mesh.size}); use a multiple of {mesh.size}"
        )
    if train_cfg.get("tensorboard", False):
        workdir_lib.require_tensorboard()
    with workdir_lib.lock(workdir) if lead else contextlib.nullcontext():
        corpus = data_lib.load_corpus(data_cfg.corpus)
        corpus.check_vocab(cfg.vocab_size)
        data_lib.check_length(corpus, data_cfg.seq_len)
        if lead:
            workdir_lib.write_or_check_config(workdir, config)
        return _train(config, cfg, corpus, workdir, lead, stop_after, mesh)


def restore_for_resume(
    ckpt: Checkpointer, abstract, shardings, corpus: data_lib.Corpus, where: pathlib.Path
) -> tuple[Any, int] | None:
    """(state, step) of the latest checkpoint that restores, laid out as `shardings`, or None.

    Refuses (DataError) a checkpoint written on a corpus whose content hash differs from
    `corpus`'s: resuming would silently continue on other data. `where` names the run.
    """
    targets = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    restored = ckpt.restore_latest(targets)
    if restored is None:
        return None
    state, record = restored
    if record.get("corpus_sha256") not in (None, corpus.sha256):
        raise data_lib.DataError(
            f"{where} was trained on a corpus with sha256 {record['corpus_sha256'][:12]}..., but "
            f"{corpus.name!r} now hashes to {corpus.sha256[:12]}...; use a new --workdir"
        )
    return state, int(record["step"])


def restore_trained(
    config: ml_collections.ConfigDict, checkpoints: pathlib.Path, *, read_only: bool = False
) -> tuple[Any, Any, int] | None:
    """(validated model config, train state, step) of the latest checkpoint in `checkpoints`, on
    one local device (for evaluation and generation), or None when none restores; `read_only`:
    nothing under `checkpoints` is created, cleaned up or moved."""
    cfg = config_lib.validate(config)
    tx = steps.make_optimizer(steps.OptimConfig.from_config(config.train))
    abstract = jax.eval_shape(functools.partial(steps.init_train_state, cfg, tx), jax.random.key(0))
    device = SingleDeviceSharding(jax.local_devices()[0])
    ckpt = Checkpointer(checkpoints, read_only=read_only)
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
    config, cfg, corpus, workdir: pathlib.Path, lead: bool, stop_after: int | None, mesh
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

    ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=train_cfg.get("keep_checkpoints", 3))
    restored = restore_for_resume(ckpt, abstract, state_sh, corpus, workdir)
    if restored is not None:
        state, start = restored
        workdir_lib.say(lead, f"resuming {workdir} from step {start}")
    else:
        state = jax.jit(init, out_shardings=state_sh)(key)
        start = 0
    metrics = workdir_lib.MetricsFile(
        workdir / "metrics.jsonl",
        keep_through=start,
        tensorboard=bool(train_cfg.get("tensorboard", False)),
        enabled=lead,
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
        max_batches=train_cfg.get("eval_batches", 4),
        **options,
    )

    def batch_at(step: int) -> dict[str, jax.Array]:
        def rows(index):
            return data_lib.train_batch(
                corpus, seed=train_cfg.seed, step=step, batch_size=B, seq_len=T, rows=index[0],
                **options,
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
        result = {"step": step, "eval_loss": nll / max(count, 1.0), "eval_tokens": int(count)}
        metrics.write(result)
        return result

    final: dict[str, Any] = {}

    def emit(step: int, values: dict, timing: dict, last_checkpoint: int) -> None:
        line = {"step": step, **{k: float(v) for k, v in values.items()}, **timing}
        metrics.write(line)
        final.update(line)
        if not np.isfinite(line["loss"]):
            raise NonFiniteLossError(
                f"loss is {line['loss']} at step {step}: training stopped. The last good "
                f"checkpoint (step {last_checkpoint}) is intact; rerunning resumes from it. Lower "
                "train.learning_rate, raise train.warmup_steps or check the data."
            )

    def record(step: int) -> dict:
        return {
            "step": step,
            "seed": int(train_cfg.seed),
            "corpus": corpus.name,
            "corpus_sha256": corpus.sha256,
            "config": config.to_dict(),
        }

    with metrics:
        out = run_loop(
            state,
            start,
            step_fn=step_fn,
            batch_at=batch_at,
            schedule=Schedule.from_config(train_cfg, stop_after=stop_after),
            emit=emit,
            evaluate=evaluate,
            checkpointer=ckpt,
            record=record,
            mesh=mesh,
            lead=lead,
            name=f"train {cfg.position}",
            tokens_per_step=B * T,
            peak_flops=train_cfg.get("peak_flops"),
            profile_dir=workdir / "profile",
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
        profile = tuple(train.get("profile_steps") or ()) or None
        return cls(
            total=int(train.steps),
            log_every=int(train.get("log_every", 10)),
            checkpoint_every=int(train.checkpoint_every),
            eval_every=int(train.get("eval_every", 0)),
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
    last_eval: Any  # what `evaluate` returned last, or None


def run_loop(
    state: Any,
    start: int,
    *,
    step_fn: Callable,
    batch_at: Callable[[int], Any],
    schedule: Schedule,
    emit: Callable[[int, dict, dict, int], None],
    checkpointer: Checkpointer,
    record: Callable[[int], dict],
    mesh,
    lead: bool,
    name: str,
    tokens_per_step: int,
    evaluate: Callable[[int, Any], Any] | None = None,
    peak_flops: float | None = None,
    profile_dir: pathlib.Path | None = None,
    where: str = "",
) -> LoopResult:
    """Steps `state` from `start` to `schedule.total`: the loop of every training run.

    Batches are `batch_at(step)` (global arrays; see `posattn.train.sharding.global_batch`). The
    step is `step_fn(state, batch) -> (state, metrics)`, jitted with donated state; it is
    compiled once ahead, and its `cost_analysis()` FLOPs give the MFU. Every `log_every` steps
    the pending metrics are fetched and `emit(step, values, timing, last_checkpoint)` is called
    for each step (it writes the lines; it may raise to stop the run): `timing` holds
    `step_time` (seconds, the mean over the interval, evaluation and checkpoints excluded),
    `tokens_per_sec` and `mfu` (None where the device's peak is unknown). `evaluate(step, state)`
    runs on `schedule.evaluates` steps. A checkpoint (`checkpointer.save(step, state,
    record(step))`) is written every `checkpoint_every` steps, at the end, and when stopping early.

    SIGTERM on any process stops every process after the same step: with several processes the
    flag is agreed by a collective every `log_every` steps (`Schedule.agrees`,
    `posattn.train.sharding.any_process`; with one, it is read after every step), so all
    processes save the same checkpoint and return normally; the same command then resumes
    exactly. The checkpointer is closed on the way out, whatever happens.
    """
    bar = workdir_lib.progress_bar(lead, schedule.total, start, name)
    flops = None
    pending: list[tuple[int, Any]] = []
    last_checkpoint, last_eval, preempted = start, None, False
    steps_since, tick = 0, time.perf_counter()
    profiler = _Profiler(schedule.profile_steps, profile_dir)
    step = start
    try:
        with jax.set_mesh(mesh), workdir_lib.preemption_flag() as received:
            for step in range(start + 1, schedule.total + 1):
                batch = batch_at(step)
                if flops is None and hasattr(step_fn, "lower"):
                    compiled = step_fn.lower(state, batch).compile()
                    flops, step_fn = _flops(compiled), compiled
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
                evaluating = evaluate is not None and schedule.evaluates(step)
                if step % schedule.log_every == 0 or checkpoint_now or evaluating:
                    fetched = jax.device_get([m for _, m in pending])
                    elapsed = time.perf_counter() - tick
                    timing = _timing(elapsed / steps_since, tokens_per_step, flops, peak_flops)
                    for (s, _), values in zip(pending, fetched, strict=True):
                        emit(s, values, timing, last_checkpoint)
                    _show(bar, step, fetched[-1], timing)
                    pending, steps_since = [], 0
                if evaluating:
                    last_eval = evaluate(step, state)
                if checkpoint_now:
                    checkpointer.save(step, state, record(step))
                    last_checkpoint = step
                tick = tick if steps_since else time.perf_counter()
                if stopping:
                    why = "preempted (SIGTERM)" if preempted else "stopped as asked"
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = cli.parse(cli.TRAIN, argv)
        result = train_and_evaluate(args.config, args.workdir)
    except (
        config_lib.ConfigError,
        data_lib.DataError,
        WorkdirBusyError,
        NonFiniteLossError,
        IncompatibleCheckpointError,
    ) as e:
        print(f"posattn.train: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, (config_lib.ConfigError, data_lib.DataError)) else 1
    summary = {k: v for k, v in result.items() if k in ("step", "loss", "eval_loss", "preempted")}
    print(f"posattn.train: done {json.dumps(summary)}")
    return 0
