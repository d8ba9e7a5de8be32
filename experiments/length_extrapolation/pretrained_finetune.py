"""The position-interpolation / YaRN fine-tune of a published checkpoint: rows `<name>+<kind>+ft`.

Position interpolation as Chen et al. 2023 ("Extending Context Window of Large Language Models
via Positional Interpolation") run it, and YaRN (Peng et al. 2023) the same way: the checkpoint,
trained at L, is fine-tuned briefly at `finetune.multiple` x L under the fixed Hugging Face
`rope_scaling` {rope_type: kind, factor: multiple, original_max_position_embeddings: L}, and its
row reads the tuned parameters under that scaling at every length, as the trained RoPE rows'
`+ft` rows do (`settings.finetune_config`: the same optimizer with fresh moments, warmup then a
constant learning rate; `finetune.batch_size` 0 is train.batch_size // multiple windows a step).

The text: the training split of `data.corpus` (the files the held-out ones are drawn beside:
`posattn.data.corpus.file_splits`), each file encoded alone with the checkpoint's tokenizer and
preceded by its BOS when the tokenizer puts one before a text, packed back to back. They are
written once as a posattn token corpus (`train.bin` / `val.bin`, uint16; `train.u32.bin` /
`val.u32.bin` when ids pass 65535; val: the held-out files' tokens) in
`WORKDIR/<name>/tokens/<key>/`, where the key hashes the tokenizer, the corpus' content and BOS;
the directory is renamed into place whole, so a killed run never leaves half of one.

Each fine-tune is an ordinary `posattn.train.train_and_evaluate` run with
`model.init_from='hf:<path>'` (the architecture from the checkpoint's config.json, AdamW moments
at zero) in `WORKDIR/<name>/finetune/<kind>-<settings hash>/`: a killed run resumes from its
last checkpoint (`train.checkpoint_every`; a SIGTERM saves one) when the same command is run
again, other settings fine-tune beside, never over. `finetuned.json` there records
its settings, the code that ran it and its losses.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from posattn import config as config_lib
from posattn import data as data_lib
from posattn import rotary
from posattn.data.corpus import file_splits

from . import provenance as prov_lib
from .provenance import describe_origin
from .settings import (
    check_finetune_keys,
    finetune_batch_size,
    finetune_config,
    finetune_enabled,
    finetune_multiple,
    finetune_scaling,
)
from .training import (
    finetuned_params,
    read_finetune_marker,
    run_finetune,
    say,
    write_finetune_marker,
)

__all__ = [
    "TrainingTokens",
    "as_evaluated",
    "check",
    "code_sha256",
    "finetune_dir",
    "finetuned",
    "settings_of",
    "tokens_key",
    "training_tokens",
    "tune_config",
]

# Bump when the token files' layout changes (what a file holds, not which text).
TOKENS_FORMAT = 1


def check(config, cfg, name: str, fail) -> None:
    """Validates the `finetune` block for the checkpoint `cfg` (named `name`) before any compute;
    `config` is the resolved one (`data.seq_len` = the checkpoint's L)."""
    if not finetune_enabled(config):
        return
    if not cfg.family.rotary:
        raise fail(
            f"config.finetune.enabled: {name} is a {cfg.position!r} model, not RoPE; its "
            "fine-tune rows (<name>+<kind>+ft) interpolate RoPE positions; set "
            "config.finetune.enabled=False"
        )
    if cfg.settings.scaling is not None:
        raise fail(
            f"config.finetune.enabled: {name}'s config.json already has the rope_scaling "
            f"{cfg.settings.scaling_dict!r}; a fine-tune's scaling would replace it (set "
            "config.finetune.enabled=False)"
        )
    check_finetune_keys(config)
    m = config.finetune.multiple
    batch, devices = finetune_batch_size(config), jax.device_count()
    if batch % devices:
        raise fail(
            f"config.finetune.batch_size: the fine-tune's {batch} windows a step (0: "
            f"train.batch_size // multiple) must be divisible by the {devices} devices; set "
            f"config.finetune.batch_size to a multiple of {devices}"
        )
    for kind in config.finetune.kinds:
        try:
            rotary.validate_rope_scaling(finetune_scaling(config, kind), cfg.head_dim)
        except ValueError as e:
            raise fail(f"config.finetune.kinds: {kind!r} at factor {m}: {e}") from None
        try:  # the run's own config, as train_and_evaluate will check it
            config_lib.validate(tune_config(config, kind, pathlib.Path("tokens")))
        except config_lib.ConfigError as e:
            raise fail(f"config.finetune ({name}+{kind}+ft): {e}") from None


def tune_config(config, kind: str, tokens: pathlib.Path) -> ml_collections.ConfigDict:
    """The `posattn.train` config of the `<name>+<kind>+ft` fine-tune: `settings.finetune_config`
    of a run whose model is the checkpoint (`model.init_from='hf:<path>'`, every other model key
    at its default, so the architecture is config.json's; compute in `pretrained.dtype`, float32
    parameters for the optimizer) on the token corpus `tokens`, from the first batch of its
    stream (`data.batch_offset` 0), with no probe rows."""
    base = config_lib.defaults()
    base.model.update(
        init_from=f"hf:{pathlib.Path(str(config.pretrained.path)).expanduser()}",
        dtype=str(config.pretrained.dtype or "float32"),
        param_dtype="float32",
        attention_impl=str(config.model.attention_impl),
    )
    base.data.update({k: v for k, v in config.data.to_dict().items() if k in base.data})
    base.train.update({k: v for k, v in config.train.to_dict().items() if k in base.train})
    out = finetune_config(config, base, kind)
    out.data.update(
        corpus=str(tokens), batch_offset=0, passkey_fraction=0.0, induction_fraction=0.0
    )
    return out


class TrainingTokens:
    """The token corpus the fine-tunes read: its directory and what it holds (`info`)."""

    def __init__(self, directory: pathlib.Path, info: dict[str, Any]):
        self.directory, self.info = directory, info


def _encode_files(parts: list[bytes], tokenizer, bos: int | None) -> np.ndarray:
    """Every file encoded alone (UTF-8, invalid bytes replaced), BOS before each when given,
    back to back: int64[N]."""
    out = []
    for start in range(0, len(parts), 256):
        texts = [p.decode("utf-8", errors="replace") for p in parts[start : start + 256]]
        for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
            if bos is not None:
                out.append(np.asarray([bos], np.int64))
            out.append(np.asarray(enc.ids, np.int64))
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def tokens_key(tokenizer, corpus_sha256: str, bos: int | None) -> str:
    digest = hashlib.sha256(f"format={TOKENS_FORMAT},bos={bos}\0".encode())
    digest.update(corpus_sha256.encode() + b"\0")
    digest.update(tokenizer.to_str().encode())
    return digest.hexdigest()


def training_tokens(
    config, tokenizer, bos: int | None, corpus: data_lib.Corpus, workdir, name: str, fail
) -> TrainingTokens:
    """The fine-tunes' token corpus in `workdir/<name>/tokens/<key>/`: read when it is there,
    else encoded from `data.corpus`'s training files (module docstring) and written.

    Raises (`fail`, before any compute): the training text, or the held-out text (the val
    split, which the training loop also cuts one window from), is shorter than one fine-tune
    window of multiple x L + 1 tokens.
    """
    key = tokens_key(tokenizer, corpus.sha256, bos)
    directory = pathlib.Path(workdir) / name / "tokens" / key[:16]
    window = finetune_multiple(config) * int(config.data.seq_len)
    marker = directory / "tokens.json"
    if directory.exists():
        info = json.loads(marker.read_text()) if marker.is_file() else {}
        if info.get("key") != key:
            raise fail(
                f"{directory} holds no token files of this tokenizer and corpus (its tokens.json "
                f"is missing or names another key); move it away and rerun to write them"
            )
        say(f"fine-tune text: reused {info['train_tokens']} training tokens in {directory}")
        _check_window(config, info, window, fail)
        return TrainingTokens(directory, info)
    train_parts, val_parts = file_splits(str(config.data.corpus))
    train = _encode_files(train_parts, tokenizer, bos)
    val = _encode_files(val_parts, tokenizer, bos)
    vocab = int(tokenizer.get_vocab_size(with_added_tokens=True))
    wide = max(vocab, int(train.max(initial=0)) + 1, int(val.max(initial=0)) + 1) > 1 << 16
    info = {
        "key": key,
        "corpus": str(config.data.corpus),
        "corpus_sha256": corpus.sha256,
        "train_files": len(train_parts),
        "train_tokens": int(train.size),
        "val_files": len(val_parts),
        "val_tokens": int(val.size),
        "bos": bos,
        "dtype": "uint32" if wide else "uint16",
        "format": TOKENS_FORMAT,
    }
    _check_window(config, info, window, fail)
    dtype, suffix = (np.uint32, ".u32.bin") if wide else (np.uint16, ".bin")
    tmp = directory.with_name(f".{directory.name}.{os.getpid()}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    train.astype(dtype).tofile(tmp / f"train{suffix}")
    val.astype(dtype).tofile(tmp / f"val{suffix}")
    (tmp / "tokens.json").write_text(json.dumps(info, indent=1) + "\n")
    os.replace(tmp, directory)
    say(
        f"fine-tune text: {info['train_files']} training files of {config.data.corpus} as "
        f"{info['train_tokens']} tokens ({info['dtype']}) in {directory}"
    )
    return TrainingTokens(directory, info)


def _check_window(config, info: dict, window: int, fail) -> None:
    for split, what in (("train", "training"), ("val", "held-out")):
        if info[f"{split}_tokens"] < window + 1:
            raise fail(
                f"config.finetune.multiple={finetune_multiple(config)}: the {what} files of "
                f"data.corpus={config.data.corpus!r} hold {info[f'{split}_tokens']} tokens of the "
                f"checkpoint's tokenizer, fewer than one fine-tune window of multiple x L + 1 = "
                f"{window + 1}; use a larger corpus (--config.data.corpus=DIR) or a smaller "
                "config.finetune.multiple"
            )


def settings_of(config, kind: str, tune: ml_collections.ConfigDict, checkpoint_sha: str,
                tokens: TrainingTokens) -> dict:  # fmt: skip
    """Everything a fine-tune depends on besides the code: its training config (the paths of
    the checkpoint and the token files replaced by their content hashes) and the row's scaling."""
    run = json.loads(config_lib.to_json(tune))
    run["model"]["init_from"] = "hf"
    run["data"]["corpus"] = "tokens"
    settings = {
        "scaling": finetune_scaling(config, kind),
        "multiple": finetune_multiple(config),
        "steps": int(config.finetune.steps),
        "learning_rate": float(config.finetune.learning_rate),
        "warmup_steps": int(config.finetune.warmup_steps),
        "batch_size": finetune_batch_size(config),
        "seed": int(config.train.seed),
        "checkpoint_sha256": checkpoint_sha,
        "tokens": tokens.info["key"],
        "run": run,
    }
    return json.loads(json.dumps(settings))


def finetune_dir(workdir, name: str, kind: str, settings: dict) -> pathlib.Path:
    """`WORKDIR/<name>/finetune/<kind>-<settings hash>`: other settings fine-tune beside."""
    sha = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return pathlib.Path(workdir) / name / "finetune" / f"{kind}-{sha}"


def finetuned(
    config, kind: str, name: str, workdir, checkpoint_sha: str, tokens: TrainingTokens, code,
    *, reuse: bool = False,
) -> tuple[Any, dict, dict]:  # fmt: skip
    """(final params, record, settings) of the `<name>+<kind>+ft` fine-tune: read from its
    workdir when `finetuned.json` says it finished there, made by this code (or by any code,
    with `reuse`); else fine-tuned (or resumed) now.

    Raises:
      ProducedByOtherCode: that fine-tune was made by other code and `reuse` is off.
      Interrupted: it stopped before its last step; rerunning resumes it.
      NonFiniteLossError: its loss became NaN or inf.
    """
    tune = tune_config(config, kind, tokens.directory)
    settings = settings_of(config, kind, tune, checkpoint_sha, tokens)
    run_dir = finetune_dir(workdir, name, kind, settings)
    row = f"{name}+{kind}+ft"
    meta = read_finetune_marker(run_dir, code, reuse=reuse)
    if meta is None:
        say(
            f"{row}: fine-tuning for {tune.train.steps} steps of {tune.train.batch_size} x "
            f"{tune.data.seq_len} tokens under {finetune_scaling(config, kind)} in {run_dir}"
        )
        info = run_finetune(tune, run_dir, row)
        meta = write_finetune_marker(run_dir, settings, code, info)
    else:
        say(f"{row}: reused the fine-tune in {run_dir} (by {describe_origin(meta)})")
    restored = finetuned_params(tune, run_dir)
    record = {
        "row": row,
        "steps": int(tune.train.steps),
        "multiple": finetune_multiple(config),
        "length": int(tune.data.seq_len),
        "batch_size": int(tune.train.batch_size),
        "learning_rate": float(tune.train.learning_rate),
        "warmup_steps": int(tune.train.warmup_steps),
        "scaling": finetune_scaling(config, kind),
        "workdir": str(run_dir),
        **meta["info"],
    }
    return restored[1]["params"], record, {"cfg": restored[0], "settings": settings}


def as_evaluated(params, tuned_cfg, eval_cfg):
    """The fine-tune's params in the evaluation model's layer layout and parameter dtype."""
    from posattn.nn.model import convert_layout

    if bool(tuned_cfg.scan_layers) != bool(eval_cfg.scan_layers):
        (params,) = convert_layout((params,), tuned_cfg, scan_layers=bool(eval_cfg.scan_layers))
    dtype = jnp.dtype(eval_cfg.param_dtype)
    return jax.tree.map(lambda x: x if x.dtype == dtype else x.astype(dtype), params)


def code_sha256() -> str:
    """The hash of the code a fine-tune's parameters depend on: the training code
    (`provenance.code_files("training")`) and this module."""
    return prov_lib.source_sha256([*prov_lib.code_files("training"), pathlib.Path(__file__)])
