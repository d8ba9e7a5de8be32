"""Rows of kind `pretrained`: a published Hugging Face checkpoint read at multiples of its training
length on the experiment's held-out text, through its own tokenizer.

    python experiments/length_extrapolation.py --config configs/extrapolation_pretrained.py \
        --config.pretrained.path=path/to/checkpoint --workdir runs/pretrained

The same protocols, intervals and evaluators as the trained families (`posattn.eval`): the
held-out files of `data.corpus` (default the Python standard library, as the byte-level rows) are
tokenised file by file (`posattn.eval.tokenized`), the plan is drawn over them as for a trained
row, every window starts with BOS where the checkpoint's tokenizer puts one before a text, and
every loss is reported per token and in bits per byte (summed NLL / (ln 2 x UTF-8 bytes of the
scored text)). Byte-level probes (`Evaluator.byte_level`: passkey, induction, copy) are skipped,
each with a note in results.json's `pretrained.skipped`. A RoPE checkpoint gets one row per
`rope_scalings` entry (`<name>+yarn`: its config's rope_scaling replaced by the eval-time one),
and with `finetune.enabled` one row per `finetune.kinds` entry (`<name>+yarn+ft`): the
checkpoint fine-tuned at `finetune.multiple` x L under that fixed scaling on the training files
of `data.corpus`, read under it at every length (`pretrained_finetune`: the token files in
`WORKDIR/<name>/tokens/`, each fine-tune a `posattn.train` run in `WORKDIR/<name>/finetune/`).

Every check (the path, config.json, tokenizer.json, the training length, the scalings, the
lengths, the fine-tune's settings and the length of its text) runs before any compute.
Evaluations are cached as the trained rows' are, in `WORKDIR/<name>/evaluations/`, keyed by the
checkpoint files' content hash (a fine-tune row's also by the fine-tune's settings and its
parameters' content hash).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx

from posattn import config as config_lib
from posattn import data as data_lib
from posattn.eval import heldout, intervals, registry, summary, tokenized
from posattn.nn.model import TransformerLM

from . import pretrained_finetune, report, results
from . import provenance as prov_lib
from .rows import ModelKey, Row, build_pretrained_rows, row_model
from .run import combine, eval_settings_sha, evaluate_row, evaluators_of
from .settings import (
    REMAP_KINDS,
    check_evaluation,
    check_rope_row,
    check_window_layers,
    eval_lengths,
    finetune_enabled,
    rope_scaling_entry,
    window_row_problem,
)
from .training import params_sha256, say

__all__ = ["Checkpoint", "bits_per_byte", "check_pretrained", "enabled", "files_sha256", "run"]

# config.json keys that give a checkpoint's training length, in the order they are read.
TRAIN_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx", "seq_length")


def enabled(config: ml_collections.ConfigDict) -> bool:
    """Whether the config evaluates a checkpoint (`pretrained.path` set)."""
    section = config.get("pretrained")
    return section is not None and bool(section.get("path"))


def _fail(message: str) -> config_lib.ConfigError:
    return config_lib.ConfigError(message)


def _train_len(config, hf: dict) -> tuple[int, str]:
    given = config.pretrained.train_len
    if given:
        if not (isinstance(given, int) and given >= 2):
            raise _fail(f"config.pretrained.train_len={given!r} must be an integer >= 2 (0: read)")
        return int(given), "config.pretrained.train_len"
    for key in TRAIN_LEN_KEYS:
        if isinstance(hf.get(key), int) and hf[key] >= 2:
            return int(hf[key]), f"config.json {key}"
    raise _fail(
        f"{config.pretrained.path}/config.json names no training length "
        f"({', '.join(TRAIN_LEN_KEYS)}); set --config.pretrained.train_len"
    )


def check_pretrained(config: ml_collections.ConfigDict) -> tuple[ml_collections.ConfigDict, dict]:
    """Validates the `pretrained` block before any compute; returns the resolved config
    (`data.seq_len` = the checkpoint's training length, skipped evaluators turned off) and what
    was read (name, model config, tokenizer, BOS, training length, skipped evaluators)."""
    from posattn import hf as hf_lib

    section = config.pretrained
    path = pathlib.Path(str(section.path)).expanduser()
    if not path.is_dir():
        raise _fail(
            f"config.pretrained.path={str(section.path)!r} is not a directory; give a Hugging Face "
            "checkpoint directory (config.json, model.safetensors, tokenizer.json)"
        )
    if not (path / "config.json").is_file():
        raise _fail(f"config.pretrained.path: {path} has no config.json")
    hf = json.loads((path / "config.json").read_text())
    dtype = section.dtype or None
    if dtype not in (None, "float32", "bfloat16"):
        raise _fail(f"config.pretrained.dtype={dtype!r}; allowed: 'float32', 'bfloat16'")
    cfg, model_type = hf_lib.load_config(path, dtype=dtype)  # HfConfigError names the key
    try:
        tokenizer = tokenized.load_tokenizer(path)
        bos, bos_rule = tokenized.bos_token(path, tokenizer)
    except ValueError as e:
        raise _fail(f"config.pretrained.path: {e}") from None
    if section.bos not in ("auto", "always", "never"):
        raise _fail(f"config.pretrained.bos={section.bos!r}; allowed: 'auto', 'always', 'never'")
    if section.bos == "never":
        bos, bos_rule = None, "config.pretrained.bos='never'"
    elif section.bos == "always" and bos is None:
        if hf.get("bos_token_id") is None:
            raise _fail(
                "config.pretrained.bos='always' but config.json has no bos_token_id and the "
                "tokenizer adds none"
            )
        bos, bos_rule = int(hf["bos_token_id"]), "config.pretrained.bos='always' (bos_token_id)"
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab > cfg.vocab_size or (bos is not None and bos >= cfg.vocab_size):
        raise _fail(
            f"{path}: tokenizer.json has {vocab} tokens (BOS {bos}), the model "
            f"{cfg.vocab_size}: the tokenizer is not this model's"
        )
    L, L_from = _train_len(config, hf)
    name = str(section.name or path.name).replace("+", "-").replace(":", "-")
    resolved = ml_collections.ConfigDict(config.to_dict())
    resolved.data.seq_len = L
    resolved.eval.sliding_stride = int(config.eval.sliding_stride or L)
    windows = int(section.eval_windows)
    if windows < 1:
        raise _fail(f"config.pretrained.eval_windows={windows!r} must be a positive integer")
    tuned = tuple(config.finetune.kinds) if finetune_enabled(config) else ()
    window_rows = tuple(config.get("window_rows", ()))
    if window_rows not in ((), (name,)):
        raise _fail(
            f"config.window_rows={window_rows!r}: the only entry of a checkpoint's run is its "
            f"name; set config.window_rows=('{name}',) for a row {name}+window, or ()"
        )
    problem = window_row_problem(cfg, L) if window_rows else None
    if problem:
        raise _fail(f"config.window_rows: {name}: {problem}; set it to ()")
    check_window_layers(config, cfg.num_layers, _fail)
    names = (
        name,
        *(f"{name}+{s}" for s in config.rope_scalings),
        *(f"{name}+{k}+ft" for k in tuned),
        *(f"{name}+window" for _ in window_rows),
    )
    if resolved.eval.reference not in names:
        resolved.eval.reference = name
    lengths = eval_lengths(resolved)
    if not lengths or any(x < 2 for x in lengths) or lengths != sorted(set(lengths)):
        raise _fail(
            f"eval lengths {lengths} (config.eval.lengths / eval.multiples x L = {L}) must be "
            "distinct, increasing, >= 2"
        )
    longest = lengths[-1]
    for key, value in (
        ("max_tokens", windows * longest),
        ("sliding_tokens", windows * resolved.eval.sliding_stride),
        ("sliding_max_tokens", windows * longest),
    ):
        if not resolved.eval[key]:  # 0: sized from the checkpoint's lengths
            resolved.eval[key] = int(value)
    if config.rope_scalings:
        if not cfg.family.rotary:
            raise _fail(
                f"config.rope_scalings={tuple(config.rope_scalings)!r}: {name} is a "
                f"{cfg.position!r} model, not RoPE; set config.rope_scalings=()"
            )
        scalings = [
            e for e in config.rope_scalings if rope_scaling_entry(e, _fail)[0] not in REMAP_KINDS
        ]
        if cfg.settings.scaling is not None and scalings:
            raise _fail(
                f"config.rope_scalings {tuple(scalings)!r}: {name}'s config.json already has the "
                f"rope_scaling {cfg.settings.scaling_dict!r}; an eval-time scaling would replace "
                f"it (drop them; the remaps {', '.join(REMAP_KINDS)} keep it and may stay)"
            )
        impl = resolved.eval.attention_impl
        for entry in config.rope_scalings:
            check_rope_row(entry, L, lengths, cfg.head_dim, impl, _fail)
    pretrained_finetune.check(resolved, cfg, name, _fail)
    skipped = {}
    for evaluator in registry.names():
        ev = registry.get(evaluator)
        if ev.byte_level and ev.section in resolved and resolved[ev.section].get("enabled"):
            skipped[evaluator] = (
                f"its probes are byte sequences (digits and letters as byte ids); {name} reads "
                "tokens of its own tokenizer"
            )
            resolved[ev.section].enabled = False
    check_evaluation(resolved, lengths)
    info = {
        "name": name,
        "path": str(path),
        "model_type": model_type,
        "position": cfg.position,
        "train_len": L,
        "train_len_from": L_from,
        "vocab_size": cfg.vocab_size,
        "tokenizer_vocab": vocab,
        "bos": bos,
        "bos_token": None if bos is None else tokenizer.id_to_token(bos),
        "bos_rule": bos_rule,
        "dtype": dtype or "float32",
        "skipped": skipped,
    }
    return resolved, {**info, "_tokenizer": tokenizer, "_cfg": cfg}


def files_sha256(path: pathlib.Path) -> str:
    """A content hash of a checkpoint directory's config, tokenizer and weight files."""
    digest = hashlib.sha256()
    names = ["config.json", "tokenizer.json", "tokenizer_config.json"]
    names += sorted(p.name for p in path.iterdir() if p.name.endswith(".safetensors"))
    names += ["model.safetensors.index.json"]
    for name in names:
        file = path / name
        if not file.is_file():
            continue
        digest.update(name.encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()


class Checkpoint:
    """A loaded checkpoint and the models its rows read: its own parameters, and those of its
    fine-tunes (`params_of(kind)`, made or read by `tune(kind)`)."""

    def __init__(
        self, config, path: pathlib.Path, cfg, dtype: str, evaluations: pathlib.Path, tune=None
    ):
        """`config`: the resolved experiment config; `dtype`: the evaluation's ("float32" or
        "bfloat16", part of the cache key); `evaluations`: where the rows' evaluation records are
        cached. `tune(kind)` -> (params, record, {"cfg": the fine-tune's
        ModelConfig, "settings"}): the fine-tune of kind `kind` (`pretrained_finetune.finetuned`);
        None: no fine-tunes."""
        from posattn import hf as hf_lib

        self.config, self.dtype, self.evaluations = config, dtype, evaluations
        attention_impl = config.eval.attention_impl

        model = hf_lib.from_pretrained(path, dtype=None if cfg.dtype == "float32" else cfg.dtype)
        self.cfg = model.cfg.replace(attention_impl=attention_impl)
        _, self.params, self.constants = nnx.split(model, nnx.Param, ...)
        abstract = nnx.eval_shape(lambda: TransformerLM(self.cfg, rngs=nnx.Rngs(params=0)))
        self.graphdef = nnx.graphdef(abstract)
        self.sha256 = files_sha256(path)
        self._models: dict[ModelKey, tuple] = {}
        self._tune = tune
        self._tuned: dict[str, tuple] = {}
        self.finetune_records: dict[str, dict] = {}

    def params_of(self, kind: str | None):
        """The checkpoint's parameters (kind None), or its fine-tune of kind `kind` (the run's
        final parameters in the evaluation's layout and dtype)."""
        if kind is None:
            return self.params
        return self._fine_tune(kind)[0]

    def cache_key(self, row: Row) -> dict:
        """What identifies the evaluations of `row` besides the row, the evaluator's settings and
        the text: the checkpoint's files, the dtype and, for a fine-tune row, its settings' hash
        and its parameters' hash."""
        key = {"checkpoint": self.sha256, "dtype": self.dtype}
        if row.finetune is not None:
            _, settings_sha, params_sha = self._fine_tune(row.finetune)
            key["finetune"] = {"settings_sha256": settings_sha, "params_sha256": params_sha}
        return key

    def _fine_tune(self, kind: str) -> tuple:
        if kind not in self._tuned:
            if self._tune is None:
                raise ValueError(f"fine-tune {kind!r}: this checkpoint was loaded without one")
            params, record, extra = self._tune(kind)
            params = pretrained_finetune.as_evaluated(params, extra["cfg"], self.cfg)
            text = json.dumps(extra["settings"], sort_keys=True).encode()
            self._tuned[kind] = (
                params,
                hashlib.sha256(text).hexdigest(),
                params_sha256(params),
            )
            self.finetune_records[kind] = record
        return self._tuned[kind]

    def model(self, key: ModelKey, length: int) -> tuple:
        """The split model `key` names, for windows of `length` tokens: a RoPE checkpoint's rows
        read one graph per length (`posattn.eval.lengths.rope_row_model`), sharing programs."""
        slot = (key, length) if self.cfg.family.rotary else (key, None)
        if slot not in self._models:
            params = self.params_of(key.finetune)
            graph = row_model(self.cfg, self.graphdef, self.constants, key, length)
            self._models[slot] = (graph[0], params, graph[1])
        return self._models[slot]


def bits_per_byte(config, text, token_bytes, outputs: dict, lengths) -> dict[str, dict]:
    """{row: per-length bits-per-byte statistics}: the loss evaluator's per-unit NLL sums over
    the UTF-8 bytes of the scored targets (`tokenized.scored_bytes`), with the same bootstrap
    over files as the loss (`summary.summarize_row`)."""
    ev, L = config.eval, int(config.data.seq_len)
    weights = intervals.bootstrap_weights(
        text.plan.num_units, replicates=int(ev.bootstrap), seed=int(ev.seed)
    )
    counts = [
        tokenized.scored_bytes(
            text.plan,
            token_bytes,
            length,
            train_len=L,
            sliding_max_tokens=int(ev.sliding_max_tokens),
        )
        for length in lengths
    ]
    out = {}
    for name, row in outputs.items():
        if "loss" not in row:
            continue
        per_length = []
        for i, by in enumerate(counts):
            scores = [seed[i] for seed in row["loss"]]  # the loss output is [seed][length]
            if any(s is None for s in scores):
                per_length.append(None)
                continue
            seeds = []
            for s in scores:
                converted = {}
                for key in ("", "beyond_", "sliding_"):
                    missing = s.get(f"{key}sum") is None or by[f"{key}count"] is None
                    converted[f"{key}sum"] = (
                        None if missing else np.asarray(s[f"{key}sum"]) / np.log(2.0)
                    )
                    converted[f"{key}count"] = None if missing else by[f"{key}count"]
                seeds.append(converted)
            per_length.append(seeds)
        stats = summary.summarize_row(per_length, weights)
        out[name] = {
            "bits_per_byte": stats["loss"],
            "bits_per_byte_ci": stats["loss_ci"],
            "bits_per_byte_delta_L": stats["delta_L"],
            "bits_per_byte_delta_L_ci": stats["delta_L_ci"],
            "bits_per_byte_beyond_L": stats["loss_beyond_L"],
            "bits_per_byte_beyond_L_ci": stats["loss_beyond_L_ci"],
            "bits_per_byte_sliding": stats["loss_sliding"],
            "bits_per_byte_sliding_ci": stats["loss_sliding_ci"],
            "scored_utf8_bytes": stats["eval_bytes"],
            "scored_utf8_bytes_sliding": stats["eval_bytes_sliding"],
        }
    return out


def finetune_lines(found: dict) -> list[str]:
    """results.md's table of the checkpoint's fine-tunes (rows `<name>+<kind>+ft`)."""
    info = found["pretrained"]
    text = info["finetune_text"]
    out = [
        "",
        "### Fine-tunes",
        "",
        f"Position interpolation / YaRN fine-tunes of {info['name']} (rows `<name>+<kind>+ft`): "
        f"the checkpoint trained at multiple x L under the rope_scaling of factor = multiple, "
        f"which the rows keep at every length, on the {text['train_files']} training files of "
        f"`{text['corpus']}` ({text['train_tokens']} tokens of its tokenizer); train loss: the "
        "first and the last step's batch.",
        "",
        "| row | steps | length | batch | learning rate | first train loss | "
        "last train loss | seconds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for record in info["finetune"].values():
        out.append(
            f"| {report.md_name(record['row'])} | {record['steps']} | {record['length']} | "
            f"{record['batch_size']} | {record['learning_rate']:g} | "
            f"{record['first_train_loss']:.4f} | {record['final_train_loss']:.4f} | "
            f"{record['seconds']} |"
        )
    return out


def run(config: ml_collections.ConfigDict, workdir, *, reuse: bool = False) -> dict[str, Any]:
    """Evaluates the checkpoint `config.pretrained.path` (its rows, every enabled evaluator that
    reads tokens, every length); writes results.json, results.md and the plots in `workdir`."""
    config, info = check_pretrained(config)
    tokenizer, cfg = info.pop("_tokenizer"), info.pop("_cfg")

    workdir = pathlib.Path(workdir)
    lengths = eval_lengths(config)
    name = info["name"]
    rows: list[Row] = build_pretrained_rows(config, name, bool(cfg.family.rotary))
    tuning = finetune_enabled(config)  # check_pretrained refused it for a non-RoPE checkpoint
    evaluators = evaluators_of(config)
    text_corpus = data_lib.load_corpus(config.data.corpus)
    tok = tokenized.tokenize_held_out(text_corpus, tokenizer, name=f"{config.data.corpus}")
    corpus = tok.corpus
    data_lib.check_length(corpus, max(lengths), split="val")
    ev = config.eval
    base = heldout.eval_text(
        corpus,
        lengths=lengths,
        max_tokens=ev.max_tokens,
        sliding_tokens=ev.sliding_tokens,
        stride=ev.sliding_stride,
        seed=ev.seed,
    )
    text = heldout.EvalText(base.val, tokenized.with_bos(base.plan, info["bos"]), base.unit)
    say(
        f"{name} ({info['model_type']}, L = {info['train_len']} from {info['train_len_from']}): "
        f"{tok.info['files']} held-out files, {tok.info['tokens']} tokens, "
        f"{tok.info['bytes']} bytes ({tok.info['bytes_per_token']:.2f} a token); BOS "
        f"{info['bos_token']!r} ({info['bos_rule']}); evaluating at {lengths}"
    )
    for evaluator, why in info["skipped"].items():
        say(f"{evaluator}: skipped ({why})")
    tokens = tune = None
    if tuning:  # the fine-tunes' text, checked (and written) before any compute
        tokens = pretrained_finetune.training_tokens(
            config, tokenizer, info["bos"], text_corpus, workdir, name, _fail
        )
    prov = prov_lib.provenance()
    begin = time.perf_counter()
    if tuning:
        tune_code = prov_lib.code_record(
            prov, tokens.info["key"], pretrained_finetune.code_sha256()
        )

        def tune(kind):  # called once the checkpoint (and its content hash) is loaded
            return pretrained_finetune.finetuned(
                config, kind, name, workdir, checkpoint.sha256, tokens, tune_code, reuse=reuse
            )

    evaluations = workdir / name / "evaluations"
    checkpoint = Checkpoint(
        config, pathlib.Path(info["path"]), cfg, info["dtype"], evaluations, tune
    )
    info["files_sha256"] = checkpoint.sha256
    shared = {
        "train_len": int(config.data.seq_len),
        "lengths": lengths,
        "batch_tokens": int(ev.batch_size) * max(lengths),
        "seed": int(ev.seed),
    }
    memo: dict = {}
    outputs, seconds, origins = {}, {}, {}
    for row in rows:
        start = time.perf_counter()
        values, by = evaluate_row(
            row, checkpoint, evaluators, shared, text, memo, lengths, prov, corpus.sha256, reuse
        )
        # One "seed": the loss output of a row is [seed][length], as for a trained row.
        outputs[row.name] = {e.name: combine(e, [values[e.name]]) for e, _ in evaluators}
        seconds[row.name] = round(time.perf_counter() - start, 1)
        origins[row.name] = by.get("loss") or next(iter(by.values()), {})
        say(f"{row.name}: {results.describe_row(outputs[row.name])} (eval {seconds[row.name]} s)")
    jax.clear_caches()
    found = results.assemble(
        config,
        corpus,
        lengths,
        text,
        outputs,
        {},
        timing={"total_seconds": round(time.perf_counter() - begin, 1), "eval_seconds": seconds},
        provenance=prov,
        origins={},
    )
    for row_name, stats in bits_per_byte(config, text, tok.token_bytes, outputs, lengths).items():
        found["families"][row_name].update(stats)
    found["loss_unit"] = f"nats per token ({name}'s tokenizer)"
    found["pretrained"] = {
        **info,
        "text": tok.info,
        "rows": {r.name: r.settings() for r in rows},
        "evaluated_by": origins,  # the code record of each row's evaluation (its loss)
    }
    if tuning:
        # One record per kind, as results.json's training.finetune of the trained rows.
        found["pretrained"]["finetune"] = dict(checkpoint.finetune_records)
        found["pretrained"]["finetune_text"] = {"directory": str(tokens.directory), **tokens.info}
    found["eval_settings_sha256"] = eval_settings_sha(config)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "results.json").write_text(json.dumps(found, indent=1) + "\n")
    report.write(found, workdir)
    if tuning:
        md = workdir / "results.md"
        md.write_text(md.read_text().rstrip("\n") + "\n" + "\n".join(finetune_lines(found)) + "\n")
    say(f"wrote {workdir / 'results.json'}, results.md and plots")
    return found
