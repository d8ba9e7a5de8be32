"""Data: byte-level corpora from real text on the machine, and nanoGPT token files.

`load_corpus(spec)` understands:
  * `"stdlib"`: the Python standard library's source (`*.py` under `sysconfig` stdlib, without
    site-packages), files in sorted order, each file held out for validation by a hash of its
    relative path (so the split is stable when files are added), bytes as tokens (vocab 256);
  * a text file or a directory of text files (every file, sorted; held out by file the same way;
    a single file is split 95/5 by position);
  * a directory holding nanoGPT's `train.bin` / `val.bin` (uint16 tokens, memory-mapped), or a
    single `.bin` file (split 95/5).
Its `sha256` identifies the exact content, so a result records which corpus it came from.

Batches are a pure function of (seed, step): a resumed run sees exactly the batches it would have
seen, and on several hosts each process builds only its own rows of the same global batch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import sysconfig
from collections.abc import Iterator

import numpy as np

from posattn.eval import probes

__all__ = [
    "Corpus",
    "DataError",
    "batch_options",
    "batched",
    "check_length",
    "eval_batches",
    "eval_windows",
    "load_corpus",
    "mask_tokens",
    "mix_passkeys",
    "train_batch",
]

_HELD_OUT_PERCENT = 5


class DataError(ValueError):
    """A corpus that cannot be used as asked; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Token arrays of a corpus (uint8 bytes or uint16 memmaps) and where they came from."""

    name: str
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    sha256: str
    num_files: int

    def describe(self) -> dict:
        return {
            "corpus": self.name,
            "sha256": self.sha256,
            "files": self.num_files,
            "train_tokens": int(self.train.size),
            "val_tokens": int(self.val.size),
            "vocab_size": self.vocab_size,
        }

    def check_vocab(self, vocab_size: int) -> None:
        """Rejects a corpus whose token ids do not fit a model's vocabulary."""
        if self.vocab_size > vocab_size:
            raise DataError(
                f"corpus {self.name!r} has token ids up to {self.vocab_size - 1} but "
                f"model.vocab_size={vocab_size}; "
                f"set --config.model.vocab_size={self.vocab_size} (or more)"
            )


def _stdlib_files() -> tuple[pathlib.Path, list[pathlib.Path]]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts]
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _is_held_out(relative: str) -> bool:
    return int(hashlib.sha1(relative.encode()).hexdigest(), 16) % 100 < _HELD_OUT_PERCENT


def _from_files(name: str, root: pathlib.Path, files: list[pathlib.Path]) -> Corpus:
    digest = hashlib.sha256()
    train_parts, val_parts = [], []
    for path in files:
        relative = path.relative_to(root).as_posix()
        content = path.read_bytes()
        if b"\x00" in content[:4096]:
            continue  # a binary file in a text directory
        digest.update(relative.encode() + b"\0" + content + b"\0")
        (val_parts if _is_held_out(relative) else train_parts).append(content)
    if not val_parts and len(train_parts) > 1:
        val_parts.append(train_parts.pop())  # tiny directories: still hold out one file

    def to_array(parts):
        return np.frombuffer(b"\n".join(parts), dtype=np.uint8)

    return Corpus(
        name,
        to_array(train_parts),
        to_array(val_parts),
        256,
        digest.hexdigest(),
        len(train_parts) + len(val_parts),
    )


def _split_by_position(name: str, tokens: np.ndarray, vocab: int, digest: str) -> Corpus:
    cut = int(tokens.size * (100 - _HELD_OUT_PERCENT) / 100)
    return Corpus(name, tokens[:cut], tokens[cut:], vocab, digest, 1)


def _token_vocab(*arrays: np.ndarray) -> int:
    """One past the largest id, read in chunks (works on memmaps of any size)."""
    top = 0
    for a in arrays:
        for start in range(0, a.size, 1 << 24):
            top = max(top, int(a[start : start + (1 << 24)].max(initial=0)))
    return top + 1


def _hash_arrays(*arrays: np.ndarray) -> str:
    digest = hashlib.sha256()
    for a in arrays:
        for start in range(0, a.size, 1 << 24):
            digest.update(np.ascontiguousarray(a[start : start + (1 << 24)]).tobytes())
    return digest.hexdigest()


def load_corpus(spec: str) -> Corpus:
    """Loads a corpus by name or path (see the module docstring)."""
    if spec == "stdlib":
        root, files = _stdlib_files()
        return _from_files("stdlib", root, files)
    path = pathlib.Path(spec).expanduser()
    if not path.exists():
        raise DataError(
            f"data.corpus={spec!r}: no such file or directory; use 'stdlib', a text file or "
            "directory, or a directory with nanoGPT train.bin/val.bin"
        )
    if path.is_dir() and (path / "train.bin").exists():
        if not (path / "val.bin").exists():
            raise DataError(
                f"{path} has train.bin but no val.bin (nanoGPT layout: both, uint16 tokens)"
            )
        train = np.memmap(path / "train.bin", dtype=np.uint16, mode="r")
        val = np.memmap(path / "val.bin", dtype=np.uint16, mode="r")
        return Corpus(str(path), train, val, _token_vocab(train, val), _hash_arrays(train, val), 2)
    if path.is_file() and path.suffix == ".bin":
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        return _split_by_position(str(path), tokens, _token_vocab(tokens), _hash_arrays(tokens))
    if path.is_file():
        content = path.read_bytes()
        return _split_by_position(
            str(path), np.frombuffer(content, np.uint8), 256, hashlib.sha256(content).hexdigest()
        )
    files = sorted(
        (p for p in path.rglob("*") if p.is_file()), key=lambda p: p.relative_to(path).as_posix()
    )
    if not files:
        raise DataError(f"data.corpus={spec!r} is an empty directory")
    return _from_files(str(path), path, files)


def check_length(corpus: Corpus, seq_len: int, *, split: str = "both") -> None:
    """Refuses a corpus too short to cut one window of `seq_len + 1` tokens from a split."""
    for name in ("train", "val") if split == "both" else (split,):
        size = getattr(corpus, name).size
        if size < seq_len + 1:
            raise DataError(
                f"corpus {corpus.name!r}: the {name} split has {size} tokens, fewer than one "
                "window of "
                f"seq_len + 1 = {seq_len + 1}; use a larger corpus or a shorter data.seq_len"
            )


def batch_options(data_config, *, causal: bool, vocab_size: int) -> dict:
    """The `train_batch` keywords a config asks for (the encoder's masking, passkey mixing).

    The encoder's `[MASK]` id is `vocab_size`, one past the output vocabulary (as
    `posattn.nn.model.mask_token_id`).
    """
    if causal:
        return {
            "passkey_fraction": float(data_config.passkey_fraction),
            "passkey_distractors": bool(data_config.get("passkey_distractors", False)),
        }
    return {"mask_rate": float(data_config.mask_rate), "mask_id": vocab_size}


def eval_batches(
    corpus: Corpus,
    *,
    seed: int,
    batch_size: int,
    seq_len: int,
    max_batches: int,
    mask_rate: float = 0.0,
    mask_id: int | None = None,
    **unused,
) -> list[dict[str, np.ndarray]]:
    """Fixed held-out batches: the first `max_batches * batch_size` non-overlapping val windows.

    For the encoder the masked positions are drawn once from `seed`, so every evaluation of a run
    scores the same positions. Keywords of `batch_options` that only concern training are ignored.
    """
    windows = eval_windows(corpus.val, seq_len=seq_len, max_windows=max_batches * batch_size)
    windows = windows[: len(windows) // batch_size * batch_size]
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xE7A1]))
    batches = []
    for chunk in batched(windows, batch_size):
        if mask_rate > 0:
            chosen = rng.random((batch_size, seq_len)) < mask_rate
            batches.append(mask_tokens(chunk[:, 1:], chosen, mask_id))
        else:
            batches.append(
                {
                    "inputs": chunk[:, :-1],
                    "targets": chunk[:, 1:],
                    "weights": np.ones((batch_size, seq_len), np.float32),
                }
            )
    return batches


def train_batch(
    corpus: Corpus,
    *,
    seed: int,
    step: int,
    batch_size: int,
    seq_len: int,
    process_index: int = 0,
    process_count: int = 1,
    rows: slice | None = None,
    mask_rate: float = 0.0,
    mask_id: int | None = None,
    passkey_fraction: float = 0.0,
    passkey_distractors: bool = False,
) -> dict[str, np.ndarray]:
    """The training batch of `step`: random windows of the train split, a pure function of
    (seed, step).

    Args:
      corpus: the corpus (its train split is used).
      seed, step: the batch's identity; the same pair always gives the same batch.
      batch_size, seq_len: the global batch shape [B, T].
      process_index, process_count: this host's share: rows `[i * B/P, (i + 1) * B/P)`.
      rows: the rows of the global batch to build (overrides `process_index`/`process_count`):
        the block one device holds, as `posattn.train.sharding.global_batch` asks for it.
      mask_rate, mask_id: the encoder's masked-byte objective (BERT-style; every chosen position
        becomes `[MASK]` and is predicted); 0 for the causal LM.
      passkey_fraction: each row of the global batch is, with this probability, replaced by a
        passkey-retrieval sequence (`posattn.eval.probes`: random depth, a key of 1 to 5 random
        digits) so that the skill the extrapolation experiment measures is learnable at the training
        length. Drawn from its own stream of (seed, step), so 0 leaves every batch exactly as it
        was; causal LM only.
      passkey_distractors: the passkeys' filler holds distractor numbers of the key's length
        (`probes.passkey_sample(distractors=True)`, the evaluation's format), so that the skill
        learned is retrieval by the `passkey=` cue, not "copy the only digits in the window".

    Returns:
      `inputs`, `targets` int32[b, T] and `weights` float32[b, T] (which targets count), b the
      number of rows asked for (B/P by default). For the LM, targets are inputs shifted by one and
      every weight is 1. Any split of the rows concatenates to the global batch.
    """
    rng = np.random.default_rng(np.random.SeedSequence([seed, step, 0x5EED]))
    starts = rng.integers(0, corpus.train.size - seq_len, size=batch_size)  # (B,)
    if rows is None:
        rows = slice(
            process_index * (batch_size // process_count),
            (process_index + 1) * (batch_size // process_count),
        )
    rows = slice(*rows.indices(batch_size)[:2])
    windows = np.asarray(
        corpus.train[starts[rows, None] + np.arange(seq_len + 1)], dtype=np.int32
    )  # (b, T+1)
    if passkey_fraction:
        if mask_rate > 0:
            raise DataError(
                "data.passkey_fraction mixes passkey sequences into a causal LM's batches; "
                "set it to 0 for the encoder (model.kind='encoder')"
            )
        if corpus.train.dtype != np.uint8:
            raise DataError(
                f"data.passkey_fraction: passkeys are written in bytes, but corpus {corpus.name!r} "
                "holds token ids; use a byte-level corpus (text) or set the fraction to 0"
            )
        windows = mix_passkeys(
            windows,
            seed=seed,
            step=step,
            fraction=passkey_fraction,
            rows=rows,
            batch_size=batch_size,
            distractors=passkey_distractors,
        )
    inputs, targets = windows[:, :-1], windows[:, 1:]
    if mask_rate <= 0:
        return {"inputs": inputs, "targets": targets, "weights": np.ones(targets.shape, np.float32)}
    chosen = rng.random((batch_size, seq_len))[rows] < mask_rate  # drawn for the global batch
    return mask_tokens(targets, chosen, mask_id)


def mix_passkeys(
    windows: np.ndarray,
    *,
    seed: int,
    step: int,
    fraction: float,
    rows: slice,
    batch_size: int,
    distractors: bool = False,
) -> np.ndarray:
    """This process's `rows` of the global batch with the chosen rows replaced by passkey sequences.

    Which global rows are replaced, and each one's content, depend only on (seed, step, row), so
    every process agrees on the global batch and builds only its own rows.

    Args:
      windows: int32[b, T+1], this process's rows `rows` of the global batch.
      seed, step: the batch's identity.
      fraction: the probability that a row is a passkey sequence, in [0, 1].
      rows: which global rows `windows` holds.
      batch_size: the global batch size B.
      distractors: distractor numbers in the filler (`probes.passkey_sample`).
    """
    if not 0.0 <= fraction <= 1.0:
        raise DataError(f"data.passkey_fraction={fraction!r} must lie in [0, 1]")
    if fraction and windows.shape[1] < probes.passkey_min_length(probes.TRAIN_DIGITS):
        raise DataError(
            f"data.passkey_fraction={fraction} needs windows of at least "
            f"{probes.passkey_min_length(probes.TRAIN_DIGITS)} bytes to hold a passkey; "
            f"data.seq_len={windows.shape[1] - 1} is too short (raise it or set the fraction to 0)"
        )
    chosen = (
        np.random.default_rng(np.random.SeedSequence([seed, step, 0x9A55])).random(batch_size)
        < fraction
    )
    out = windows.copy()
    for local, row in enumerate(range(rows.start, rows.stop)):
        if chosen[row]:
            rng = np.random.default_rng(np.random.SeedSequence([seed, step, 0x9A55, row]))
            digits = int(
                rng.integers(1, probes.TRAIN_DIGITS + 1)
            )  # keys of 1..5 digits: any eval key length
            out[local] = probes.passkey_sample(
                rng,
                length=windows.shape[1],
                depth=float(rng.random()),
                digits=digits,
                distractors=distractors,
            ).tokens
    return out


def mask_tokens(tokens: np.ndarray, chosen: np.ndarray, mask_id: int) -> dict[str, np.ndarray]:
    """The encoder's masked-byte example: `chosen` positions become `mask_id` and are predicted."""
    return {
        "inputs": np.where(chosen, mask_id, tokens).astype(np.int32),
        "targets": tokens.astype(np.int32),
        "weights": chosen.astype(np.float32),
    }


def eval_windows(tokens: np.ndarray, *, seq_len: int, max_windows: int | None = None) -> np.ndarray:
    """Non-overlapping windows of `seq_len + 1` tokens from the start of `tokens`: int32[W, T+1].

    Consecutive windows share one token (the last target of one is the first input of the next),
    so every token of the split is predicted exactly once.
    """
    count = (tokens.size - 1) // seq_len
    if max_windows is not None:
        count = min(count, max_windows)
    index = np.arange(count)[:, None] * seq_len + np.arange(seq_len + 1)
    return np.asarray(tokens[index], dtype=np.int32)


def batched(windows: np.ndarray, batch_size: int) -> Iterator[np.ndarray]:
    """Consecutive slices of `batch_size` rows (the last may be shorter)."""
    for start in range(0, len(windows), batch_size):
        yield windows[start : start + batch_size]
