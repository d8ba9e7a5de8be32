"""Train a language model; the same command on the same workdir resumes.

    python -m posattn.train --config configs/tiny.py --workdir runs/tiny [--config.key=value ...]

The run is `train_and_evaluate(config, workdir)`, which tests call too. It reads top to bottom:
setup (validate, distributed, mesh, data, model, checkpoint), the loop (batches as a pure function
of (seed, step), one jitted step with donated state, metrics flushed every `log_every` steps and
checked for NaN, evaluation, checkpoints), and the exit (final checkpoint, files closed).

A workdir holds `config.json`, `metrics.jsonl` (a line per training step with `step` and `loss`,
evaluation lines with `eval_`-prefixed keys) and `checkpoints/`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import pathlib
import sys
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from posattn import cli
from posattn import config as config_lib
from posattn.nn.model import TransformerLM
from posattn.train import data as data_lib
from posattn.train import sharding, steps
from posattn.train import workdir as workdir_lib
from posattn.train.checkpoint import Checkpointer, IncompatibleCheckpointError
from posattn.train.workdir import WorkdirBusyError

__all__ = ["NonFiniteLossError", "WorkdirBusyError", "main", "train_and_evaluate"]

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
    with workdir_lib.lock(workdir) if lead else contextlib.nullcontext():
        corpus = data_lib.load_corpus(data_cfg.corpus)
        corpus.check_vocab(cfg.vocab_size)
        data_lib.check_length(corpus, data_cfg.seq_len)
        if lead:
            workdir_lib.write_or_check_config(workdir, config)
        return _train(config, cfg, corpus, workdir, lead, stop_after)


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
    config: ml_collections.ConfigDict, checkpoints: pathlib.Path
) -> tuple[Any, Any, int] | None:
    """(validated model config, train state, step) of the latest checkpoint in `checkpoints`, on
    one local device (for evaluation and generation), or None when none restores."""
    cfg = config_lib.validate(config)
    tx = steps.make_optimizer(steps.OptimConfig.from_config(config.train))
    abstract = jax.eval_shape(functools.partial(steps.init_train_state, cfg, tx), jax.random.key(0))
    device = SingleDeviceSharding(jax.local_devices()[0])
    ckpt = Checkpointer(checkpoints)
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
    config, cfg, corpus, workdir: pathlib.Path, lead: bool, stop_after: int | None
) -> dict[str, Any]:
    train_cfg, data_cfg = config.train, config.data
    B, T, total = train_cfg.batch_size, data_cfg.seq_len, train_cfg.steps
    mesh = sharding.make_mesh(train_cfg.get("fsdp", 1))
    if B % mesh.size or B % jax.process_count():
        raise config_lib.ConfigError(
            f"config.train.batch_size={B} must be divisible by the number of devices ({mesh.size}); "
            f"use a multiple of {mesh.size}"
        )
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
    metrics_file = (
        workdir_lib.MetricsFile(workdir / "metrics.jsonl", keep_through=start) if lead else None
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

    def run_eval(step: int) -> dict[str, float]:
        nll, count = 0.0, 0.0
        for local in eval_data:
            batch = sharding.global_batch(_local_rows(local), batch_sh, B)
            s, c = eval_fn(state["params"], state["constants"], batch)
            nll, count = nll + float(s), count + float(c)
        result = {"step": step, "eval_loss": nll / max(count, 1.0), "eval_tokens": int(count)}
        if metrics_file:
            metrics_file.write(result)
        return result

    def record(step: int) -> dict:
        return {
            "step": step,
            "seed": int(train_cfg.seed),
            "corpus": corpus.name,
            "corpus_sha256": corpus.sha256,
            "config": config.to_dict(),
        }

    # ---- The loop. ----
    log_every = train_cfg.get("log_every", 10)
    eval_every = train_cfg.get("eval_every", 0)
    ckpt_every = train_cfg.checkpoint_every
    pending: list[tuple[int, dict]] = []
    last_good, last_eval, final = start, None, {}
    bar = workdir_lib.progress_bar(lead, total, start, cfg.position)
    tick, tokens_since = time.perf_counter(), 0
    with jax.set_mesh(mesh), workdir_lib.preemption_flag() as preempted:
        step = start
        for step in range(start + 1, total + 1):
            local = data_lib.train_batch(
                corpus,
                seed=train_cfg.seed,
                step=step,
                batch_size=B,
                seq_len=T,
                process_index=jax.process_index(),
                process_count=jax.process_count(),
                **options,
            )
            state, metrics = step_fn(state, sharding.global_batch(local, batch_sh, B))
            pending.append((step, metrics))
            tokens_since += B * T
            stopping = preempted() or step == stop_after
            checkpoint_now = step % ckpt_every == 0 or step == total or stopping
            if step % log_every == 0 or checkpoint_now:
                now = time.perf_counter()
                rate = tokens_since / max(now - tick, 1e-9)
                tick, tokens_since = now, 0
                final = _flush(pending, metrics_file, bar, rate, last_good, ckpt)
                pending = []
            if eval_every and (step % eval_every == 0 or step == total):
                last_eval = run_eval(step)
            if checkpoint_now:
                ckpt.save(step, state, record(step))
                last_good = step
            if stopping:
                why = "preempted (SIGTERM)" if preempted() else "stopped as asked"
                workdir_lib.say(
                    lead,
                    f"{why} at step {step}: checkpoint saved; rerun the same command to resume",
                )
                break
        if bar is not None:
            bar.close()
        ckpt.close()
    if metrics_file:
        metrics_file.close()
    result = {
        "step": step,
        **final,
        **(last_eval or {}),
        "preempted": bool(preempted()),
        "finished": step == total,
    }
    return result


# ----------------------------------------------------------------------------------------------
# Helpers of the loop.


def _flush(pending, metrics_file, bar, tokens_per_sec, last_good, ckpt) -> dict:
    """Fetches pending metrics, writes one line per step, and stops on a non-finite loss."""
    fetched = jax.device_get([m for _, m in pending])
    line = {}
    for (step, _), values in zip(pending, fetched):
        line = {
            "step": step,
            **{k: float(v) for k, v in values.items()},
            "tokens_per_sec": tokens_per_sec,
        }
        if not np.isfinite(line["loss"]):
            if metrics_file:
                metrics_file.write(line)
                metrics_file.close()
            ckpt.close()
            raise NonFiniteLossError(
                f"loss is {line['loss']} at step {step}: training stopped. The last good checkpoint "
                f"(step {last_good}) is intact; rerunning resumes from it. Lower train.learning_rate, "
                "raise train.warmup_steps or check the data."
            )
        if metrics_file:
            metrics_file.write(line)
    if bar is not None and line:
        bar.update(line["step"] - bar.n)
        bar.set_postfix(loss=f"{line['loss']:.4f}", tok_s=f"{tokens_per_sec:,.0f}")
    return line


def _local_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    n, i = jax.process_count(), jax.process_index()
    return {k: v[i * (len(v) // n) : (i + 1) * (len(v) // n)] for k, v in batch.items()}


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
