"""The run: for each row, train or reuse each seed, then every enabled evaluator at every length.

The work is split in units, one seed of one entry (its training, then its rows' evaluations):
`_unit`, run in worker processes one core each or in this process (`workers.py`,
`config.workers`); this process then combines the units' outputs in the config's order.

Caches: a row's evaluator output for one seed lives in
`<seed dir>/evaluations/<row>.<evaluator>.json` and is reused when it holds the same key (the
row's settings, the evaluator's settings, the evaluation text's fingerprint, the parameters'
content hash, the training config) and was made by the same code
(`provenance.evaluator_code_sha256`; with `reuse`, by any code). Rows that read the same model at
a length (a RoPE scaling row at T <= L and its trained row) share one evaluation in the run.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import time
from typing import Any

import ml_collections
import numpy as np

from posattn import config as config_lib
from posattn import data as data_lib
from posattn.attention import native
from posattn.eval import heldout, registry

from . import provenance as prov_lib
from . import report, results
from . import workers as workers_lib
from .rows import ModelKey, Row, build_rows, row_model
from .settings import (
    check_experiment,
    eval_lengths,
    finetune_enabled,
    finetune_multiple,
    row_stem,
)
from .training import (
    finetuned,
    finished_run,
    member_dir,
    params_sha256,
    restore_model,
    say,
    seed_config,
    train_member,
)

__all__ = ["eval_settings_sha", "evaluators_of", "run", "seed_list"]

# Shared settings that change how numbers are computed (batching), not what they are.
_NOT_IN_KEY = ("batch_tokens",)


def seed_list(config: ml_collections.ConfigDict) -> list[int]:
    """The training seeds of every entry: `seeds` consecutive ones from `train.seed`."""
    return [int(config.train.seed) + k for k in range(int(config.get("seeds", 1)))]


def evaluators_of(config) -> list[tuple[registry.Evaluator, dict]]:
    """(evaluator, its own settings) of every registered evaluator the config enables."""
    sections = {k: config[k].to_dict() for k in config if hasattr(config[k], "to_dict")}
    out = []
    for name in registry.names():
        evaluator = registry.get(name)
        own = registry.settings_of(evaluator, sections)
        if own is not None:
            out.append((evaluator, own))
    return out


def eval_settings_sha(config) -> str:
    """A hash of the evaluation sections (`eval`, `passkey`, `induction`, `copy`,
    `rope_scalings`, `window_rows`, `window_layers`): results of other evaluation settings are
    written beside, never over."""
    keys = ("eval", "passkey", "induction", "copy")
    settings = {k: config[k].to_dict() for k in keys if k in config}
    settings["rope_scalings"] = list(config.rope_scalings)
    for key in ("window_rows", "window_layers"):  # absent from the runs' made before the keys
        if config.get(key):
            settings[key] = list(config[key])
    text = json.dumps(json.loads(json.dumps(settings)), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _write_json(path: pathlib.Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value) + "\n")
    os.replace(tmp, path)


class _Seed:
    """One trained seed of one entry: its restored model, and the models its rows read."""

    def __init__(self, config, row: Row, seed: int, run_dir, entry_dir, code, reuse):
        self.config, self.seed, self.run_dir, self.entry_dir = config, seed, run_dir, entry_dir
        self.code, self.reuse = code, reuse
        self.train_config = seed_config(row.train_config, seed)
        self.cfg, self.graphdef, self.params, self.constants = restore_model(
            self.train_config, run_dir, attention_impl=config.eval.attention_impl
        )
        self._models: dict[ModelKey, tuple] = {}
        self._params: dict[str | None, tuple[Any, str]] = {}
        self.finetune_info: dict[str, dict] = {}
        self.evaluations = run_dir / "evaluations"
        self._trained = json.loads(config_lib.to_json(self.train_config))

    def cache_key(self, row: Row) -> dict:
        """What identifies this seed's evaluations of `row` besides the row, the evaluator's
        settings and the text: the parameters it reads and the training config."""
        return {"params": self.params_of(row.finetune)[1], "trained": self._trained}

    def params_of(self, kind: str | None) -> tuple[Any, str]:
        """(params, content hash) of the trained model (kind None) or of its fine-tune."""
        if kind not in self._params:
            params = self.params
            if kind is not None:
                params, info = finetuned(
                    self.config,
                    kind,
                    self.seed,
                    self.run_dir,
                    self.entry_dir,
                    self.train_config,
                    self.params,
                    self.code,
                    reuse=self.reuse,
                )
                self.finetune_info[kind] = info
            self._params[kind] = (params, params_sha256(params))
        return self._params[kind]

    def model(self, key: ModelKey, length: int) -> tuple:
        """The split model `key` names, for windows of `length` tokens (`rows.row_model`: a RoPE
        entry's eval-time scalings and fine-tunes share compiled programs length by length)."""
        slot = (key, length) if self.cfg.family.rotary else (key, None)
        if slot not in self._models:
            params, _ = self.params_of(key.finetune)
            graph = row_model(self.cfg, self.graphdef, self.constants, key, length)
            self._models[slot] = (graph[0], params, graph[1])
        return self._models[slot]


def evaluate_row(row, member, evaluators, shared, text, memo, lengths, prov, corpus_sha, reuse):
    """{evaluator: [value per length]} of one row read from `member`, and {evaluator: code
    record}: each evaluator's record in `member.evaluations` when its key (the row, the
    evaluator's settings, the text and `member.cache_key(row)`) matches and it was made by this
    code (or by any code, with `reuse`), else evaluated now and written there.

    `member` is one trained seed (`_Seed`) or a published checkpoint
    (`pretrained.Checkpoint`): `model(key, length)`, `cache_key(row)` and `evaluations`. `memo`
    holds the values of (model, evaluator, length) already computed, shared by the rows that read
    the same model at a length.
    """
    out, by = {}, {}
    for evaluator, own in evaluators:
        settings = {**own, **shared}
        key = {
            "row": row.settings(),
            "evaluator": evaluator.name,
            "settings": {k: v for k, v in settings.items() if k not in _NOT_IN_KEY},
            "text": text.plan.fingerprint,
            **member.cache_key(row),
        }
        key = json.loads(json.dumps(key))
        code = prov_lib.code_record(prov, corpus_sha, prov_lib.evaluator_code_sha256(evaluator))
        path = member.evaluations / f"{row_stem(row.name)}.{evaluator.name}.json"
        if path.exists():
            saved = json.loads(path.read_text())
            if saved.get("key") == key and (prov_lib.same_origin(saved, code) or reuse):
                out[evaluator.name], by[evaluator.name] = saved["values"], saved.get("code") or {}
                say(f"{row.name} {evaluator.name}: reused {path}")
                continue
            if saved.get("key") == key:
                say(
                    f"{row.name} {evaluator.name}: {path.name} was made by "
                    f"{prov_lib.describe_origin(saved)}; evaluating again"
                )
        values = []
        for length in lengths:
            model_key = row.reads(member.config, length)
            slot = (model_key, evaluator.name, length)
            if slot not in memo:
                memo[slot] = evaluator.run(member.model(model_key, length), text, length, settings)
            values.append(memo[slot])
        _write_json(path, {"key": key, "code": code, "values": values})
        out[evaluator.name], by[evaluator.name] = values, code
    return out, by


def combine(evaluator: registry.Evaluator, per_seed: list) -> Any:
    """One row's value of `evaluator` from its values per seed (`Evaluator.combine`)."""
    if evaluator.combine == "all":
        return per_seed
    if evaluator.combine == "first":
        return per_seed[0]
    return results.mean_over_seeds(per_seed)


def _training_record(infos: list[dict], seeds: list[int]) -> dict:
    """results.json's `training` entry of one row: one seed's record, or the seeds' merged."""
    plain = [{k: v for k, v in i.items() if k not in ("config", "code")} for i in infos]
    if len(plain) == 1:
        return plain[0]
    return {
        "seconds": round(sum(i["seconds"] for i in plain), 1),
        "final_train_loss": float(np.mean([i["final_train_loss"] for i in plain])),
        "final_train_loss_seeds": [i["final_train_loss"] for i in plain],
        "seeds": seeds,
        "steps": plain[0]["steps"],
    }


def _finetune_record(config, row, infos: list[dict], seeds: list[int]) -> dict:
    base = {"row": row.name, "steps": int(config.finetune.steps)}
    base["multiple"] = finetune_multiple(config)
    if len(infos) == 1:
        return {**base, "seed": seeds[0], **infos[0]}
    return {
        **base,
        "seconds": round(sum(i["seconds"] for i in infos), 1),
        "final_train_loss": float(np.mean([i["final_train_loss"] for i in infos])),
        "final_train_loss_seeds": [i["final_train_loss"] for i in infos],
        "seeds": seeds,
    }


def _output_dir(workdir: pathlib.Path, config) -> pathlib.Path:
    """Where results.json goes: the workdir, unless a results.json of other evaluation settings is
    there (then `results-<settings hash>/` beside it)."""
    sha = eval_settings_sha(config)
    existing = workdir / "results.json"
    if existing.exists():
        try:
            old = json.loads(existing.read_text())
            old_sha = old.get("eval_settings_sha256") or eval_settings_sha(
                ml_collections.ConfigDict(old["config"])
            )
        except (ValueError, KeyError, TypeError):
            old_sha = None
        if old_sha != sha:
            out = workdir / f"results-{sha}"
            say(f"{existing} holds other evaluation settings; writing these results in {out}")
            return out
    return workdir


def _unit_parts(job: dict, entry: str, seed: int):
    """(the entry's rows, its trained row, the seed's training config, its run dir, the first
    seed's dir) of one unit."""
    config, workdir = job["config"], job["workdir"]
    rows = [r for r in build_rows(config) if r.entry == entry]
    head = next(r for r in rows if r.trained)
    first = seed_list(config)[0]
    run_dir = member_dir(workdir, entry, seed, first)
    return (
        rows,
        head,
        seed_config(head.train_config, seed),
        run_dir,
        member_dir(workdir, entry, first, first),
    )


def _trained(job: dict, head: Row, seed: int, tc, run_dir, then: str = "") -> tuple[dict, bool]:
    """`train_member`'s (record, reused) for one seed, said in the log (`then` ends the line)."""
    code, reuse = job["code"], job["reuse"]
    if finished_run(tc, run_dir, code, reuse=reuse) is None:
        say(f"{head.name} seed {seed}: training ({tc.train.steps} steps at L={tc.data.seq_len})")
    info, reused = train_member(tc, run_dir, code, reuse=reuse)
    what = "reused (trained earlier" if reused else "trained (in this run"
    say(
        f"{head.name} seed {seed}: {what}, {info['seconds']} s, by "
        f"{prov_lib.describe_origin(info)}), last step's train loss "
        f"{info['final_train_loss']:.4f}{then}"
    )
    return info, reused


def _train(job: dict, entry: str, seed: int) -> tuple[dict, bool]:
    """The training part of a unit, run in a worker before the unit's evaluation (`_unit`, which
    gets the result): the seed trained (or reused), then its entry's fine-tunes (the `+ft` rows)
    made (or reused) where `_unit` reads them."""
    rows, head, tc, run_dir, base = _unit_parts(job, entry, seed)
    trained = _trained(job, head, seed, tc, run_dir)
    kinds = [r.finetune for r in rows if r.finetune is not None]
    if kinds:
        member = _Seed(job["config"], head, seed, run_dir, base, job["code"], job["reuse"])
        for kind in kinds:
            member.params_of(kind)
    return trained


def _unit(job: dict, entry: str, seed: int, trained: tuple[dict, bool] | None = None) -> dict:
    """One seed of one entry: trained (or reused), then every row of the entry evaluated (or read
    from its caches). Runs here or in a worker process (`workers.run_units`): `job` is plain data
    and the rows and evaluators are rebuilt from its config. `trained`: `_train`'s result, where
    it ran first (then this only evaluates)."""
    config, reuse, code = job["config"], job["reuse"], job["code"]
    evaluators = evaluators_of(config)
    if [e.name for e, _ in evaluators] != job["evaluators"]:
        raise config_lib.ConfigError(
            f"the evaluators registered in this worker process "
            f"({[e.name for e, _ in evaluators]}) are not the run's ({job['evaluators']}): an "
            "evaluator registered after its module was imported (in a script's main block) is "
            "unknown to worker processes; register it at import time, or set config.workers=1"
        )
    rows, head, tc, run_dir, base = _unit_parts(job, entry, seed)
    evaluating = f"evaluating at {job['lengths']}"
    if trained is None:
        trained = _trained(job, head, seed, tc, run_dir, then=f"; {evaluating}")
    else:
        say(f"{head.name} seed {seed}: {evaluating}")
    info = trained[0]
    member = _Seed(config, head, seed, run_dir, base, code, reuse)
    memo: dict = {}
    out: dict[str, Any] = {"info": info, "values": {}, "by": {}, "spent": {}}
    for row in rows:
        start = time.perf_counter()
        out["values"][row.name], out["by"][row.name] = evaluate_row(
            row,
            member,
            evaluators,
            job["shared"],
            job["text"],
            memo,
            job["lengths"],
            job["prov"],
            job["corpus_sha"],
            reuse,
        )
        out["spent"][row.name] = time.perf_counter() - start
    out["finetune"] = member.finetune_info
    return out


def _unit_cached(job, rows, head, seed, evaluators) -> bool:
    """Whether a unit looks computed already: its training finished and every evaluation file
    of its rows exists (then it runs here, reading its caches, rather than in a worker)."""
    workdir, code, seeds = job["workdir"], job["code"], seed_list(job["config"])
    run_dir = member_dir(workdir, head.entry, seed, seeds[0])
    tc = seed_config(head.train_config, seed)
    if finished_run(tc, run_dir, code, reuse=job["reuse"]) is None:
        return False
    files = [
        run_dir / "evaluations" / f"{row_stem(r.name)}.{e.name}.json"
        for r in rows
        if r.entry == head.entry
        for e, _ in evaluators
    ]
    return all(f.exists() for f in files)


# A unit's time against the others' in the default (its training; experiments/README.md): FIRE's
# MLP bias makes its step ~1.5x a plain one. Only the order in which workers take units uses it.
_TRAINING_COST = {"fire": 1.5}


def _run_units(job, requested, rows, trained_rows, seeds, evaluators) -> tuple[dict, int]:
    """({(entry, seed): `_unit`'s output} of every unit, the worker processes used): the units
    left to compute in `workers.worker_count` processes, the longest first (the most rows, then
    `_TRAINING_COST`), the cached ones here."""
    keys = [(head.entry, seed) for head in trained_rows for seed in seeds]
    heads = {head.entry: head for head in trained_rows}
    cost = {
        h.entry: sum(r.entry == h.entry for r in rows)
        + _TRAINING_COST.get(h.train_config.model.position, 1.0)
        for h in trained_rows
    }
    pending = [
        (entry, seed)
        for entry, seed in keys
        if not _unit_cached(job, rows, heads[entry], seed, evaluators)
    ]
    pending.sort(key=lambda k: -cost[k[0]])  # stable: the config's order among equals
    count = workers_lib.worker_count(requested, len(pending))
    impls = {job["config"].eval.attention_impl}
    impls |= {h.train_config.model.attention_impl for h in trained_rows}
    if count and impls & {"auto", "native"}:
        native.build_in_background()  # one build, while the workers start (a cold cache: ~9 s)
    # In workers, every unit's training (and fine-tunes) starts before any evaluation: the
    # evaluations, a fraction of a training each, are then the last to finish, so the workers
    # end together rather than one computing a whole unit alone (experiments/README.md).
    done = workers_lib.run_units(_unit, job, pending, count, first=_train if count else None)
    for key in keys:
        if key not in done:
            done[key] = _unit(job, *key)
    return done, count


def run(
    config: ml_collections.ConfigDict, workdir: str | os.PathLike, *, reuse: bool = False
) -> dict[str, Any]:
    """Trains (or reuses) every seed of every entry, evaluates every row with every enabled
    evaluator, writes results.json, results.md and the plots; returns the results.

    Args:
      config: the experiment config (configs/extrapolation.py).
      workdir: one subdirectory per entry, plus results.json, results.md and the plots.
      reuse: report finished runs and evaluations made by other code (or on another corpus)
        instead of refusing them; each row of results.json names its own provenance.
    """
    check_experiment(config)
    requested = workers_lib.check_workers(config)
    workdir = pathlib.Path(workdir)
    lengths = eval_lengths(config)
    corpus = data_lib.load_corpus(config.data.corpus)
    data_lib.check_length(corpus, max(lengths), split="val")
    evaluators = evaluators_of(config)
    probing = [e.section for e, _ in evaluators if e.section in ("passkey", "induction", "copy")]
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
    rows = build_rows(config)
    seeds = seed_list(config)
    ev = config.eval
    text = heldout.eval_text(
        corpus,
        lengths=lengths,
        max_tokens=ev.max_tokens,
        sliding_tokens=ev.sliding_tokens,
        stride=ev.sliding_stride,
        seed=ev.seed,
    )
    prov = prov_lib.provenance()  # the code as the run starts, not as it is when it ends
    # Each evaluator's code hash, which its cached records carry (the report compares the two).
    prov["evaluator_code_sha256"] = {
        e.name: prov_lib.evaluator_code_sha256(e) for e, _ in evaluators
    }
    code = prov_lib.code_record(prov, corpus.sha256)
    trained_rows = [r for r in rows if r.trained]
    rotary_entries = {r.entry for r in rows if r.finetune is not None}
    for row in trained_rows:  # refuse runs made by other code before any training
        for seed in seeds:
            run_dir = member_dir(workdir, row.entry, seed, seeds[0])
            finished_run(seed_config(row.train_config, seed), run_dir, code, reuse=reuse)
    workdir.mkdir(parents=True, exist_ok=True)
    shared = {
        "train_len": int(config.data.seq_len),
        "lengths": lengths,
        "batch_tokens": int(ev.batch_size) * max(lengths),
        "seed": int(ev.seed),
    }
    job = {
        "config": config,
        "workdir": workdir,
        "text": text,
        "code": code,
        "prov": prov,
        "corpus_sha": corpus.sha256,
        "lengths": lengths,
        "shared": shared,
        "reuse": reuse,
        "evaluators": [e.name for e, _ in evaluators],
    }
    begin = time.perf_counter()
    done, workers = _run_units(job, requested, rows, trained_rows, seeds, evaluators)
    outputs, training, origins, seconds, tuned, probe_seeds = {}, {}, {}, {}, {}, {}
    for head in trained_rows:
        entry_rows = [r for r in rows if r.entry == head.entry]
        units = [done[(head.entry, seed)] for seed in seeds]
        infos = [u["info"] for u in units]
        training[head.name] = _training_record(infos, seeds)
        for unit in units:
            for kind, info in unit["finetune"].items():
                tuned.setdefault(kind, []).append(info)
        for row in entry_rows:
            per_seed = [u["values"][row.name] for u in units]
            outputs[row.name] = {
                e.name: combine(e, [s[e.name] for s in per_seed]) for e, _ in evaluators
            }
            if len(per_seed) > 1:  # a probe is learned by one model: keep each seed's too
                probe_seeds[row.name] = {
                    e.name: [s[e.name] for s in per_seed]
                    for e, _ in evaluators
                    if e.name in ("passkey", "induction")
                }
            seconds[row.name] = round(sum(u["spent"][row.name] for u in units), 1)
            evaluated = next((u["by"][row.name] for u in units if u["by"][row.name]), {})
            named = "loss" if "loss" in evaluated else next(iter(evaluated), None)
            origins[row.name] = {
                "trained": infos[0].get("code") or {},
                "evaluated": {**evaluated[named], "evaluator": named} if named else {},
            }
            if row.finetune is not None and row.finetune in tuned:
                # Keyed by kind; by <entry>+<kind> when several RoPE entries are fine-tuned.
                name = row.finetune if len(rotary_entries) == 1 else f"{row.entry}+{row.finetune}"
                training.setdefault("finetune", {})[name] = _finetune_record(
                    config, row, tuned.pop(row.finetune), seeds
                )
            line = results.describe_row(outputs[row.name])
            say(f"{row.name}: {line} (eval {seconds[row.name]} s)")
    out_dir = _output_dir(workdir, config)
    out_dir.mkdir(parents=True, exist_ok=True)
    found = results.assemble(
        config,
        corpus,
        lengths,
        text,
        outputs,
        training,
        timing={
            "total_seconds": round(time.perf_counter() - begin, 1),
            "eval_seconds": seconds,
            "workers": workers,
        },
        provenance=prov,
        origins=origins,
        probe_seeds=probe_seeds,
    )
    found["eval_settings_sha256"] = eval_settings_sha(config)
    (out_dir / "results.json").write_text(json.dumps(found, indent=1) + "\n")
    report.write(found, out_dir)
    say(
        f"wrote {out_dir / 'results.json'}, results.md and plots in "
        f"{found['timing']['total_seconds']:.0f} s"
    )
    return found
