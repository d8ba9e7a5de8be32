"""Held-out text read through a checkpoint's own tokenizer: tokens, the bytes each token covers,
BOS at the start of every window, and the bytes a protocol scores (for bits per byte).

Shape legend: U units (held-out files), W windows, T window length, N tokens.

A byte-level family and a published checkpoint read the same held-out files (the corpus of
`posattn.data.load_corpus`, e.g. the Python standard library) but cut them into different tokens,
so a loss per token does not compare across tokenizers. Bits per byte does:

    bits/byte = (summed NLL of the scored tokens, nats) / (ln 2 * UTF-8 bytes of their text).

`tokenize_held_out` encodes each held-out file alone (decoded as UTF-8, invalid bytes replaced by
U+FFFD: the text the model reads) and records, for every token, the UTF-8 bytes it covers: token
i covers the bytes between the end of the text covered by tokens 0..i-1 and the end of its own
(tokenizer offsets; a character split over several byte-level tokens counts once, for the first
token that reaches its end; whitespace a pre-tokenizer drops goes to the token after it). So the
bytes of any run of consecutive tokens are exactly the UTF-8 bytes of the text from the end of
the token before the run to the end of its last token, and the bytes of a file's tokens sum to
its text's bytes up to any dropped trailing whitespace.

BOS (`bos_token`): a model whose tokenizer puts a token before every encoded text (its
tokenizer_config.json's `add_bos_token`, or else the special token its tokenizer.json
post-processor prepends, as Llama's and Gemma's do) reads every window with that token at
position 0 (`BosPlan`): the window's first token is replaced by BOS, so the scored targets (the
window's tokens 1..T) are the same with or without it and every length still scores the same
tokens. GPT-2, GPT-NeoX, Qwen2 and MPT tokenizers add nothing: their windows start in the text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from posattn import data as data_lib
from posattn.eval.heldout import EvalPlan

__all__ = [
    "BosPlan",
    "TokenizedText",
    "bos_token",
    "load_tokenizer",
    "scored_bytes",
    "tokenize_held_out",
    "with_bos",
]


def load_tokenizer(path: str | pathlib.Path):
    """The `tokenizers.Tokenizer` of a checkpoint directory's tokenizer.json (ValueError if it
    has none)."""
    path = pathlib.Path(path)
    file = path / "tokenizer.json"
    if not file.is_file():
        raise ValueError(
            f"{path} has no tokenizer.json; the evaluation encodes the text with the checkpoint's "
            "own tokenizer (save it with transformers' tokenizer.save_pretrained)"
        )
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(file))


def bos_token(path: str | pathlib.Path, tokenizer) -> tuple[int | None, str]:
    """(BOS id or None, the rule that decided it) for a checkpoint directory (module docstring).

    1. tokenizer_config.json sets `add_bos_token`: true takes its `bos_token` (or config.json's
       `bos_token_id`), false none;
    2. else the special token(s) the tokenizer.json post-processor puts before an encoded text
       (`encode(text, add_special_tokens=True)` against `add_special_tokens=False`).
    """
    path = pathlib.Path(path)
    config = pathlib.Path(path) / "tokenizer_config.json"
    settings = json.loads(config.read_text()) if config.is_file() else {}
    if "add_bos_token" in settings:
        if not settings["add_bos_token"]:
            return None, "tokenizer_config.json add_bos_token=false"
        token = settings.get("bos_token")
        if isinstance(token, Mapping):
            token = token.get("content")
        if token is not None and tokenizer.token_to_id(str(token)) is not None:
            return int(tokenizer.token_to_id(str(token))), (
                f"tokenizer_config.json add_bos_token=true, bos_token {token!r}"
            )
        model_config = json.loads((path / "config.json").read_text())
        if model_config.get("bos_token_id") is None:
            raise ValueError(
                f"{config}: add_bos_token is true but neither its bos_token nor config.json's "
                "bos_token_id names a token of tokenizer.json"
            )
        return int(model_config["bos_token_id"]), (
            "tokenizer_config.json add_bos_token=true, config.json bos_token_id"
        )
    probe = "a"
    plain = tokenizer.encode(probe, add_special_tokens=False).ids
    full = tokenizer.encode(probe, add_special_tokens=True).ids
    prefix = []
    for i, token in enumerate(full):
        if full[i : i + len(plain)] == plain:
            break
        prefix.append(token)
    if not prefix:
        return None, "the tokenizer.json post-processor adds no token before a text"
    if len(prefix) > 1:
        raise ValueError(
            f"{path / 'tokenizer.json'}: its post-processor puts {len(prefix)} tokens {prefix} "
            "before every text; one BOS token is supported"
        )
    name = tokenizer.id_to_token(prefix[0])
    return int(prefix[0]), f"the tokenizer.json post-processor prepends {name!r}"


def _utf8_lengths(text: str) -> np.ndarray:
    """UTF-8 bytes of each character of `text`: int64[len(text)]."""
    points = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    return 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000).astype(np.int64)


def _encode(tokenizer, text: str) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int64[N], UTF-8 bytes each token covers int64[N]) of one text."""
    enc = tokenizer.encode(text, add_special_tokens=False)
    ids = np.asarray(enc.ids, np.int64)
    if ids.size == 0:
        return ids, ids.copy()
    byte_end = np.concatenate([[0], np.cumsum(_utf8_lengths(text))])  # bytes before char c
    ends = np.asarray([end for _, end in enc.offsets], np.int64)
    covered = np.maximum.accumulate(byte_end[ends])  # bytes covered by tokens 0..i
    return ids, np.diff(covered, prepend=0)


class TokenizedText(NamedTuple):
    """The held-out text as tokens: what `heldout.eval_text` reads (`corpus`, whose val split is
    the tokens and val_spans the files), the bytes each token covers (`token_bytes`, aligned with
    `corpus.val`), and a description (`info`)."""

    corpus: data_lib.Corpus
    token_bytes: np.ndarray
    info: dict[str, Any]


def tokenize_held_out(corpus: data_lib.Corpus, tokenizer, *, name: str) -> TokenizedText:
    """Encodes each held-out file of a file corpus (`Corpus.val_spans`) with `tokenizer`.

    Returns:
      `TokenizedText`: a `Corpus` named `name` whose val split holds every held-out file's tokens
      (uint32, files back to back) with their spans, an empty train split, the tokenizer's
      vocabulary and a content hash of the text and the tokenizer; and the bytes of each token.
    """
    if corpus.val_spans is None:
        raise data_lib.DataError(
            f"corpus {corpus.name!r} has no file boundaries (a token file or a single text file); "
            "a checkpoint's tokenizer reads text: use 'stdlib' or a directory of text files"
        )
    ids, sizes, spans = [], [], []
    start = 0
    digest = hashlib.sha256(corpus.sha256.encode())
    digest.update(tokenizer.to_str().encode())
    raw = np.asarray(corpus.val)
    for a, b in np.asarray(corpus.val_spans):
        text = raw[a:b].tobytes().decode("utf-8", errors="replace")
        file_ids, file_bytes = _encode(tokenizer, text)
        ids.append(file_ids)
        sizes.append(file_bytes)
        spans.append((start, start + file_ids.size))
        start += file_ids.size
    tokens = np.concatenate(ids).astype(np.uint32)
    token_bytes = np.concatenate(sizes).astype(np.int64)
    digest.update(tokens.tobytes())
    vocab = int(tokenizer.get_vocab_size(with_added_tokens=True))
    out = data_lib.Corpus(
        name,
        np.zeros(0, np.uint32),
        tokens,
        vocab,
        digest.hexdigest(),
        len(spans),
        np.asarray(spans, np.int64).reshape(-1, 2),
    )
    info = {
        "files": len(spans),
        "tokens": int(tokens.size),
        "bytes": int(token_bytes.sum()),
        "bytes_per_token": float(token_bytes.sum() / max(1, tokens.size)),
        "text_sha256": corpus.sha256,
    }
    return TokenizedText(out, token_bytes, info)


@dataclasses.dataclass(frozen=True)
class BosPlan(EvalPlan):
    """An `EvalPlan` whose windows start with BOS: token 0 of every window (an input, never a
    target) is `bos`, so the model reads BOS at position 0 and the scored targets are unchanged."""

    bos: int = 0

    def windows(self, tokens: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
        windows, units = super().windows(tokens, length)
        windows[:, 0] = self.bos
        return windows, units

    def sliding(self, tokens: np.ndarray, length: int, max_windows: int | None = None):
        windows, units, scored = super().sliding(tokens, length, max_windows)
        windows[:, 0] = self.bos
        return windows, units, scored


def with_bos(plan: EvalPlan, bos: int | None) -> EvalPlan:
    """`plan` itself (bos None), or its `BosPlan` (its fingerprint records the BOS id)."""
    if bos is None:
        return plan
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(EvalPlan)}
    fields["fingerprint"] = hashlib.sha256(f"{plan.fingerprint},bos={bos}".encode()).hexdigest()
    return BosPlan(**{**fields, "fingerprint": fields["fingerprint"][:16]}, bos=int(bos))


def scored_bytes(
    plan: EvalPlan,
    token_bytes: np.ndarray,
    length: int,
    *,
    train_len: int,
    sliding_max_tokens: int = 0,
) -> dict[str, np.ndarray | None]:
    """UTF-8 bytes of the targets each protocol scores at `length`, per unit: float64[U] arrays
    `count` (non-overlapping windows), `beyond_count` (their positions >= L; None at T <= L) and
    `sliding_count` (None without sliding blocks), taken from the same windows as
    `posattn.eval.scoring.score_lengths` (the targets are tokens 1..T of a window of T + 1)."""
    U = plan.num_units

    def by_unit(values, units):
        out = np.zeros(U)
        np.add.at(out, units, values)
        return out

    windows, units = EvalPlan.windows(plan, token_bytes, length)  # bytes, not tokens: no BOS
    out: dict[str, np.ndarray | None] = {"count": by_unit(windows[:, 1:].sum(axis=1), units)}
    out["beyond_count"] = (
        by_unit(windows[:, train_len + 1 :].sum(axis=1), units) if length > train_len else None
    )
    out["sliding_count"] = None
    if plan.block_ends.size:
        cap = max(1, sliding_max_tokens // length) if sliding_max_tokens else None
        slide, s_units, scored = EvalPlan.sliding(plan, token_bytes, length, cap)
        out["sliding_count"] = by_unit(slide[:, -scored:].sum(axis=1), s_units)
    return out
