"""Corpora: byte-level text from the machine, and nanoGPT token files.

`load_corpus(spec)` understands:
  * `"stdlib"`: the Python standard library's source (`*.py` under `sysconfig` stdlib, without
    site-packages), files in sorted order, each file held out for validation by a hash of its
    relative path (so the split is stable when files are added), bytes as tokens (vocab 256);
  * a text file or a directory of text files (every file, sorted; held out by file the same way;
    a single file is split 95/5 by position);
  * a directory holding nanoGPT's `train.bin` / `val.bin` (uint16 tokens, memory-mapped; uint32 in
    `train.u32.bin` / `val.u32.bin`, for vocabularies past 65536), or a
    single `.bin` file (split 95/5).
Its `sha256` identifies the exact content, so a result records which corpus it came from. A file
corpus records where each held-out file lies in its val split (`Corpus.val_spans`), so that an
evaluation can draw text from every file without reading the files again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import pathlib
import sysconfig

import numpy as np

__all__ = ["Corpus", "DataError", "check_length", "file_splits", "load_corpus"]

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
    # int64[U, 2]: [start, stop) of each held-out file in `val` (files are joined by one b"\n");
    # None for a corpus without file boundaries (token files, a single text file).
    val_spans: np.ndarray | None = None

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


def _split_files(root: pathlib.Path, files: list[pathlib.Path]):
    """(content digest, training files' bytes, held-out files' bytes) of a file corpus."""
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
    return digest, train_parts, val_parts


def _from_files(name: str, root: pathlib.Path, files: list[pathlib.Path]) -> Corpus:
    digest, train_parts, val_parts = _split_files(root, files)

    def to_array(parts):
        return np.frombuffer(b"\n".join(parts), dtype=np.uint8)

    sizes = np.asarray([len(part) for part in val_parts], np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes[:-1] + 1)]).astype(np.int64)[: sizes.size]
    spans = np.stack([starts, starts + sizes], axis=1)
    spans.setflags(write=False)  # like the token arrays (views of bytes): a corpus is read-only
    return Corpus(
        name,
        to_array(train_parts),
        to_array(val_parts),
        256,
        digest.hexdigest(),
        len(train_parts) + len(val_parts),
        spans,
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


def _token_file(path: pathlib.Path) -> np.memmap:
    """Memory-mapped tokens: uint16 (nanoGPT), or uint32 for a name ending in .u32.bin."""
    return np.memmap(
        path, dtype=np.uint32 if path.name.endswith(".u32.bin") else np.uint16, mode="r"
    )


@functools.cache
def _stdlib_corpus() -> Corpus:
    """The standard library's corpus, read once a process: its files do not change while Python
    runs, and every training run, evaluation and experiment unit of a process asks for it (~1 s
    a read of its ~1800 files)."""
    root, files = _stdlib_files()
    return _from_files("stdlib", root, files)


def load_corpus(spec: str) -> Corpus:
    """Loads a corpus by name or path (see the module docstring). Its arrays are read-only."""
    if spec == "stdlib":
        return _stdlib_corpus()
    path = pathlib.Path(spec).expanduser()
    if not path.exists():
        raise DataError(
            f"data.corpus={spec!r}: no such file or directory; use 'stdlib', a text file or "
            "directory, or a directory with nanoGPT train.bin/val.bin"
        )
    wide = path.is_dir() and (path / "train.u32.bin").exists()  # uint32: vocabularies past 2^16
    if path.is_dir() and ((path / "train.bin").exists() or wide):
        suffix = ".u32.bin" if wide else ".bin"
        if not (path / f"val{suffix}").exists():
            raise DataError(
                f"{path} has train{suffix} but no val{suffix} (nanoGPT layout: both, uint16 "
                "tokens, or uint32 in train.u32.bin/val.u32.bin)"
            )
        train = _token_file(path / f"train{suffix}")
        val = _token_file(path / f"val{suffix}")
        return Corpus(str(path), train, val, _token_vocab(train, val), _hash_arrays(train, val), 2)
    if path.is_file() and path.suffix == ".bin":
        tokens = _token_file(path)
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


def file_splits(spec: str) -> tuple[list[bytes], list[bytes]]:
    """(the training files' bytes, the held-out files' bytes), one entry a file in the order
    `load_corpus(spec)` joins them, of a file corpus: "stdlib" or a directory of text files.
    For text that is read file by file (a tokenizer encoding each file alone)."""
    if spec == "stdlib":
        root, files = _stdlib_files()
    else:
        root = pathlib.Path(spec).expanduser()
        token_dir = (root / "train.bin").exists() or (root / "train.u32.bin").exists()
        if not root.is_dir() or token_dir:
            raise DataError(
                f"data.corpus={spec!r} is not a directory of text files; files are read one by "
                "one only from 'stdlib' or a directory of text files"
            )
        files = sorted(
            (p for p in root.rglob("*") if p.is_file()),
            key=lambda p: p.relative_to(root).as_posix(),
        )
    _, train_parts, val_parts = _split_files(root, files)
    return train_parts, val_parts


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
