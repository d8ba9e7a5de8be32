"""Many runs as one compiled program: a `jax.vmap` over stacked train states.

    python -m posattn.sweep --config configs/sweep_tiny.py --workdir runs/sweep [--config.k=v ...]

The config's `sweep` section (see `posattn.sweep.plan`) has a discrete part (family, depth, ...:
looped in Python, one compiled program each) and a continuous part (seeds, optimiser
hyperparameters, RoPE base, ALiBi slope scale, initialisation scales). A program builds each
member's initial state exactly as `posattn.train` would (`steps.init_train_state` with that
member's config and seed), stacks them on a leading axis, and trains them with one jitted
`jax.vmap(steps.train_step)`; the leading axis is sharded over the mesh's `sweep` axis, so a pod
trains its members in parallel. Member k sees exactly the batches its single run would see
(batches are a pure function of (train.seed, step)).

A member whose loss or parameters stop being finite is frozen at its last good state and recorded
as diverged; the others carry on (a learning-rate sweep is expected to find the edge).

Workdir: `config.json`, `sweep.json` (one record per member, schema in docs/sweeps.md),
`sweep.md` and `sweep.png` (final loss against each swept value), and per program
`programs/p<i>/{metrics.jsonl, checkpoints/, result.json}`. The sweep state of a program is
checkpointed as one unit; rerunning the command resumes.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import pathlib
import sys
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from posattn import cli
from posattn import config as config_lib
from posattn import data as data_lib
from posattn.eval import heldout, scoring, summary
from posattn.nn.model import TransformerLM
from posattn.sweep import plan as sweep_plan
from posattn.sweep import report as sweep_report
from posattn.train import loggers as loggers_lib
from posattn.train import sharding, steps
from posattn.train import workdir as workdir_lib
from posattn.train.checkpoint import Checkpointer, IncompatibleCheckpointError
from posattn.train.loop import Job, Schedule, check_eval_split, restore_for_resume, run_loop

__all__ = ["main", "run_sweep", "sweep_mesh"]


def run_sweep(
    config: ml_collections.ConfigDict,
    workdir: str | pathlib.Path,
    *,
    cli_overrides=(),
    config_path: str | None = None,
    stop_after: int | None = None,
) -> list[dict[str, Any]]:
    """Trains (or resumes) every member of the sweep in `config`; returns the sweep.json records.

    Args:
      config: a training config with a `sweep` section.
      workdir: the sweep's directory; an existing sweep resumes.
      cli_overrides: the `--config.key=value` strings already applied to `config` (recorded in each
        member's reproducing overrides).
      config_path: the config file, for the reproducing commands in sweep.json.
      stop_after: stop each unfinished program after this step as a preemption would (saved,
        resumable); the programs after it do not start.
    """
    # ---- Setup: every member validated, and the extrapolation function found, before compute. ----
    config = config_lib.complete(config)  # every key present: its default is written once
    programs = sweep_plan.plan(config, cli_overrides=cli_overrides)
    lengths = tuple(int(x) for x in config.sweep.get("eval_lengths", ()) or ())
    sharding.maybe_initialize_distributed(bool(config.train.distributed))
    loggers_lib.check(config.train)
    workdir = pathlib.Path(workdir)
    lead = jax.process_index() == 0
    corpus = data_lib.load_corpus(config.data.corpus)
    text = _eval_text(corpus, lengths, config) if lengths else None
    for program in programs:
        for member in program.members:
            corpus.check_vocab(member.cfg.vocab_size)
            data_lib.check_length(corpus, member.config.data.seq_len)
            check_eval_split(  # every program evaluates at its end
                corpus,
                seq_len=member.config.data.seq_len,
                batch_size=member.config.train.batch_size,
            )
        sweep_mesh(
            len(program.members), program.members[0].config.train
        )  # fails early if it cannot
        _abstract_member(program)
    if lead:  # only once every check has passed: a refused config leaves no directory behind
        workdir_lib.make_workdir(workdir)
    with workdir_lib.lock(workdir) if lead else contextlib.nullcontext():
        if lead:
            workdir_lib.write_or_check_config(workdir, config)
        records, complete = [], True
        for program in programs:
            result = _run_program(
                program,
                corpus,
                workdir / "programs" / f"p{program.index}",
                lead,
                stop_after,
                lengths,
                text,
                config,
            )
            if result is None:
                complete = False
                break
            records += result
        if lead:
            sweep_report.write(
                workdir, programs, records, complete=complete, config_path=config_path
            )
    return records


def sweep_mesh(members: int, train: ml_collections.ConfigDict) -> Mesh:
    """A (sweep, data, fsdp) mesh: as many devices on `sweep` as divide the member count.

    The rest of the devices split each member's batch (data) and parameters (fsdp), as in
    `posattn.train.sharding.make_mesh`.
    """
    n, B = jax.device_count(), int(train.batch_size)
    fsdp = sharding.check_fsdp(train.fsdp, n)
    for size in sorted((d for d in range(1, n // fsdp + 1) if (n // fsdp) % d == 0), reverse=True):
        if members % size == 0 and B % (n // size) == 0:
            return jax.make_mesh(
                (size, n // fsdp // size, fsdp),
                ("sweep", "data", "fsdp"),
                axis_types=(AxisType.Auto,) * 3,
            )
    raise config_lib.ConfigError(
        f"config.train.batch_size={B} with {members} sweep members cannot be laid out on {n} "
        "devices: the batch must be divisible by the devices left after the sweep axis; use a "
        f"multiple of {n}"
    )


def _sweep_step(
    graphdef, optim: steps.OptimConfig, sweep_state: dict, batch: dict
) -> tuple[dict, dict]:
    """`steps.train_step` on every member at once; members that stop being finite are frozen."""
    state, alive = sweep_state["members"], sweep_state["alive"]
    new, metrics = jax.vmap(functools.partial(steps.train_step, graphdef, optim))(state, batch)
    ok = alive & jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["param_norm"])  # (K,)

    def keep(n, o):
        return jnp.where(ok.reshape(ok.shape + (1,) * (jnp.ndim(n) - 1)), n, o)

    new = jax.tree.map(keep, new, state)
    return {"members": new, "alive": ok}, {**metrics, "alive": ok}


def _sweep_eval(graphdef, params, constants, batch):
    return jax.vmap(functools.partial(steps.eval_step, graphdef))(params, constants, batch)


# Jitted (step, eval) pairs, kept by equality of what determines them, so that a sweep resumed or
# rerun in the same process (a notebook, a test) reuses the compiled programs. A graphdef holds the
# ModelConfig, so (graphdef, optimiser, mesh, member count) fixes the state's shapes and shardings.
_PROGRAMS: list[tuple[tuple, tuple]] = []


def _programs_for(graphdef, optim: steps.OptimConfig, mesh: Mesh, members: int, state_sh, batch_sh):
    key = (graphdef, optim, mesh, members)
    for known, fns in _PROGRAMS:
        if known == key:
            return fns
    replicated = NamedSharding(mesh, P())
    fns = (
        jax.jit(
            functools.partial(_sweep_step, graphdef, optim),
            in_shardings=(state_sh, batch_sh),
            out_shardings=(state_sh, replicated),
            donate_argnums=0,
        ),
        jax.jit(functools.partial(_sweep_eval, graphdef), out_shardings=replicated),
    )
    _PROGRAMS.insert(0, (key, fns))
    del _PROGRAMS[8:]
    return fns


def _stack(trees: list) -> Any:
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees)


def _put(host_tree, shardings) -> Any:
    """Host arrays -> global arrays on `shardings` (each process supplies its own shards)."""
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx]),
        host_tree,
        shardings,
    )


def _initial_members(program: sweep_plan.Program) -> list[dict]:
    """Each member's initial state, as its single run builds it (`steps.init_train_state`).

    Run eagerly, op by op, without compiling a whole-model init for each member's config
    (seconds each on a CPU; the primitives' compilations are shared by every member). At the
    shipped configs' shapes that is bitwise the jitted init of `posattn.train` (checked for rope,
    alibi, fire and t5); at some others a few arrays differ in their last bit (docs/sweeps.md).
    """
    states = []
    for member in program.members:
        tx = steps.make_optimizer(steps.OptimConfig.from_config(member.config.train))
        state = steps.init_train_state(member.cfg, tx, jax.random.key(member.config.train.seed))
        if member.cfg.init_from:  # a published checkpoint's weights, as posattn.train starts
            from posattn import hf

            state = {**state, "params": hf.load_params(member.cfg.init_from[3:], member.cfg)}
        states.append(jax.device_get(state))
    _warn_duplicates(program, states)
    return states


def _warn_duplicates(program: sweep_plan.Program, states: list[dict]) -> None:
    """Says so when two members start identical and see the same batches (a swept key with no
    effect here)."""
    seen = {}
    for member, state in zip(program.members, states, strict=True):
        digest = hashlib.sha1(str(member.config.train.seed).encode())
        for leaf in jax.tree.leaves(state):
            digest.update(np.ascontiguousarray(leaf).tobytes())
        twin = seen.setdefault(digest.hexdigest(), member)
        if twin is not member:
            print(
                f"posattn.sweep: warning: members {twin.index} ({twin.overrides}) and "
                f"{member.index} ({member.overrides}) are the same run: the swept value has no "
                "effect on this program (e.g. a RoPE base for a non-RoPE family)",
                flush=True,
            )


def _run_program(
    program, corpus, pdir: pathlib.Path, lead: bool, stop_after, lengths, text, config
) -> list[dict] | None:
    """Trains one program's members together; returns their records, or None if it stopped early."""
    first = program.members[0]
    train_cfg, cfg, K = first.config.train, first.cfg, len(program.members)
    total, B, T = train_cfg.steps, train_cfg.batch_size, first.config.data.seq_len
    done = pdir / "result.json"
    if done.exists():
        saved = json.loads(done.read_text())
        if saved.get("steps") == total:
            return saved["records"]
    pdir.mkdir(parents=True, exist_ok=True)
    seeds = [int(m.config.train.seed) for m in program.members]

    # The program: one graphdef and optimiser structure for all members; what differs between them
    # (seed, injected hyperparameters, RoPE frequencies, slopes) lives in the stacked arrays.
    optim = steps.OptimConfig.from_config(train_cfg)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(params=0))))
    one = _abstract_member(program)
    abstract = {
        "members": jax.tree.map(lambda x: jax.ShapeDtypeStruct((K, *x.shape), x.dtype), one),
        "alive": jax.ShapeDtypeStruct((K,), jnp.bool_),
    }
    mesh = sweep_mesh(K, train_cfg)
    state_sh = sharding.state_shardings(mesh, abstract, leading_axis="sweep")
    batch_sh = NamedSharding(mesh, P("sweep", ("data", "fsdp")))
    options = data_lib.batch_options(
        first.config.data, causal=cfg.causal, vocab_size=cfg.vocab_size
    )

    ckpt = Checkpointer(pdir / "checkpoints", max_to_keep=train_cfg.keep_checkpoints)
    restored = restore_for_resume(ckpt, abstract, state_sh, corpus, pdir)
    if restored is not None:
        state, start = restored
        workdir_lib.say(lead, f"resuming sweep program {program.index} from step {start}")
    else:
        host = {"members": _stack(_initial_members(program)), "alive": np.ones((K,), bool)}
        state, start = _put(host, state_sh), 0
    metrics = workdir_lib.MetricsFile(
        pdir / "metrics.jsonl",
        keep_through=start,
        loggers=loggers_lib.open_loggers(train_cfg, pdir, first.config.to_dict()) if lead else (),
        enabled=lead,
    )
    last_loss, diverged = sweep_report.read_history(pdir / "metrics.jsonl", program)  # trimmed

    step_fn, eval_fn = _programs_for(graphdef, optim, mesh, K, state_sh, batch_sh)
    eval_data = _stacked(
        {
            s: data_lib.eval_batches(
                corpus,
                seed=s,
                batch_size=B,
                seq_len=T,
                max_batches=first.config.train.eval_batches,
                **options,
            )
            for s in set(seeds)
        },
        seeds,
    )

    offset = int(first.config.data.batch_offset)  # as posattn.train reads data.batch_offset

    def batch_at(step: int) -> dict:
        def block(index):  # (members, rows): each member's rows of its own batch of `step`
            members, rows = index
            per_seed = {}
            for s in seeds[members]:
                if s not in per_seed:
                    per_seed[s] = data_lib.train_batch(
                        corpus,
                        seed=s,
                        step=step + offset,
                        batch_size=B,
                        seq_len=T,
                        rows=rows,
                        **options,
                    )
            return {k: np.stack([per_seed[s][k] for s in seeds[members]]) for k in per_seed[s]}

        return sharding.global_batch(block, batch_sh, (K, B))

    def evaluate(step: int, state) -> list[float]:
        nll, count = np.zeros(K), np.zeros(K)
        for full in eval_data:
            batch = sharding.global_batch(
                lambda i, full=full: {k: v[i] for k, v in full.items()}, batch_sh, (K, B)
            )
            s, c = eval_fn(state["members"]["params"], state["members"]["constants"], batch)
            nll, count = nll + np.asarray(s, np.float64), count + np.asarray(c, np.float64)
        if not count.all():  # never report a loss over no tokens as 0.0
            raise data_lib.DataError(
                f"sweep program {program.index}: evaluation at step {step} scored no tokens; "
                "the validation split fills no evaluation batch"
            )
        values = list(nll / count)
        for m, v in zip(program.members, values, strict=True):
            metrics.write(
                {
                    "step": step,
                    "member": m.index,
                    "eval_loss": sweep_report.finite(v),
                    "eval_tokens": int(count[0]),
                }
            )
        return values

    def emit(step: int, values: dict, timing: dict, last_checkpoint: int) -> None:
        sweep_report.write_step(metrics, step, values, timing, program, diverged, last_loss)

    def record(step: int) -> dict:
        return {
            "step": step,
            "corpus": corpus.name,
            "corpus_sha256": corpus.sha256,
            "members": [m.overrides for m in program.members],
        }

    # ---- The loop of posattn.train; the members' records need an evaluation at the end. ----
    job = Job(
        step=step_fn,
        batch_at=batch_at,
        emit=emit,
        record=record,
        evaluate=evaluate,
        name=f"sweep p{program.index} ({K} members)",
        where=f" of sweep program {program.index}",
        tokens_per_step=K * B * T,
        peak_flops=train_cfg.get("peak_flops"),
        profile_dir=pdir / "profile",
    )
    schedule = Schedule.from_config(train_cfg, stop_after=stop_after, eval_at_end=True)
    with metrics:
        out = run_loop(state, start, job, schedule, ckpt, mesh)
        state, step, last_eval = out.state, out.step, out.last_eval
        if step == total and (last_eval is None or start == total):
            with jax.set_mesh(mesh):
                last_eval = evaluate(total, state)
    if step != total:
        return None
    extrapolation = (
        _extrapolate(program, state, graphdef, text, lengths, config) if lengths else None
    )
    records = []
    for k, member in enumerate(program.members):
        records.append(
            {
                "member": member.index,
                "program": program.index,
                "overrides": member.overrides,
                "swept": {
                    key: member.overrides[key] for key in (*program.settings, *program.swept)
                },
                "final_step": total,
                "final_train_loss": last_loss[k],
                "diverged_at_step": diverged.get(member.index),
                "eval_loss": sweep_report.finite(last_eval[k]),
                **(
                    {"eval_lengths": list(lengths), "loss_at_lengths": extrapolation[k]}
                    if lengths
                    else {}
                ),
            }
        )
    if lead:
        done.write_text(json.dumps({"steps": total, "records": records}, indent=2) + "\n")
    return records


def _abstract_member(program: sweep_plan.Program):
    """One member's abstract train state, after checking that every member's has the same layout.

    A second guard behind `sweep_plan.CONTINUOUS`: a swept key that changed shapes, dtypes or
    the state's structure would make the members unstackable.
    """
    layouts = []
    for member in program.members:
        tx = steps.make_optimizer(steps.OptimConfig.from_config(member.config.train))
        try:
            abstract = jax.eval_shape(
                functools.partial(steps.init_train_state, member.cfg, tx), jax.random.key(0)
            )
        except ValueError as e:  # e.g. a RoPE base the frequency function refuses
            raise config_lib.ConfigError(
                f"sweep member {member.index} ({member.overrides}): {e}"
            ) from None
        leaves, structure = jax.tree.flatten(abstract)
        layouts.append((structure, [(x.shape, x.dtype) for x in leaves]))
        if layouts[-1] != layouts[0]:
            raise config_lib.ConfigError(
                f"sweep member {member.index} ({member.overrides}) has a different state layout "
                f"from member {program.members[0].index} of its program; the swept key changes "
                "shapes and belongs in config.sweep.discrete"
            )
        if member is program.members[0]:
            first = abstract
    return first


def _stacked(per_seed: dict[int, list[dict]], seeds: list[int]) -> list[dict]:
    """Per-member eval batches, stacked: [K, B, T] each."""
    count = len(per_seed[seeds[0]])
    return [
        {k: np.stack([per_seed[s][i][k] for s in seeds]) for k in per_seed[seeds[0]][i]}
        for i in range(count)
    ]


# The experiment's default `eval.seed`: the sweep scores the text the experiment scores.
EVAL_SEED = 1234


def _eval_text(corpus, lengths, config) -> heldout.EvalText:
    """The held-out text of the experiment's loss protocol for `sweep.eval_lengths`: chunks of
    the longest length drawn round-robin over the held-out files, `sweep.eval_max_tokens` target
    tokens a length (default 16384), seed `EVAL_SEED`; checked before any compute."""
    max_tokens = int(config.sweep.get("eval_max_tokens", 0) or 16384)
    if min(lengths) < 1:
        raise config_lib.ConfigError(
            f"config.sweep.eval_lengths={tuple(lengths)!r} must be positive lengths"
        )
    try:
        return heldout.eval_text(
            corpus,
            lengths=lengths,
            max_tokens=max_tokens,
            sliding_tokens=0,
            stride=min(lengths),
            seed=EVAL_SEED,
        )
    except ValueError as e:
        raise config_lib.ConfigError(f"config.sweep.eval_lengths={tuple(lengths)!r}: {e}") from None


def _extrapolate(program, state, graphdef, text, lengths, config) -> list[list]:
    """Each member's loss at `lengths` under the experiment's loss protocol
    (`posattn.eval.scoring.score_lengths` on `_eval_text`: non-overlapping windows, every
    position scored), on each member's own (unstacked) parameters."""
    first = program.members[0].config
    batch_size = int(config.sweep.get("eval_batch_size", 0) or first.train.batch_size)
    host = jax.device_get(
        {"params": state["members"]["params"], "constants": state["members"]["constants"]}
    )
    out = []
    for k in range(len(program.members)):
        params, constants = jax.tree.map(lambda x, k=k: x[k], (host["params"], host["constants"]))
        scores = scoring.score_lengths(
            graphdef,
            params,
            constants,
            text.val,
            text.plan,
            lengths=list(lengths),
            train_len=int(first.data.seq_len),
            batch_tokens=batch_size * max(lengths),
            curve_bins=1,
        )
        values = summary.mean_losses(scores)
        out.append([None if v is None else sweep_report.finite(v) for v in values])
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def body() -> int:
        args = cli.parse(cli.SWEEP, argv)
        workdir = args.workdir
        records = run_sweep(
            args.config, workdir, cli_overrides=args.overrides, config_path=args.config_path
        )
        print(
            f"posattn.sweep: {len(records)} members done; see {pathlib.Path(workdir) / 'sweep.md'}"
        )
        return 0

    return cli.report_errors(
        "posattn.sweep",
        argv,
        body,
        user_errors=(data_lib.DataError,),
        run_errors=(workdir_lib.WorkdirBusyError, IncompatibleCheckpointError),
    )
