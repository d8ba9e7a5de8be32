"""Which held-out tokens an evaluation scores: file-aware windows, the same bytes at every length.

Shape legend: U units (held-out files), C chunks, W windows, T window length, S stride.

The held-out split of a file corpus (`posattn.data.load_corpus`) is its held-out files
joined by one newline each. Scoring its first bytes (as a plain prefix evaluation does) measures
one or two files; a number that is to carry a comparison between families needs text drawn from
every file, and an interval that knows consecutive windows of one file are not independent
samples. So:

* `held_out_units` takes where each held-out file starts and stops in `corpus.val` from the
  corpus, which records it when it loads (`Corpus.val_spans`). A corpus without file boundaries
  (a nanoGPT token file, a single text file) is cut into blocks of `block` tokens, which then
  play the files' part.
* `make_plan` draws, per protocol, the pieces to score, spread over the units round-robin (one
  piece per unit in a random unit order, then a second per unit, ...) so that every unit long
  enough contributes before any contributes twice; the draw is a pure function of the seed.
* Non-overlapping protocol (Press et al. 2022, §4's "nonoverlapping inference"): *chunks* of
  `max_len + 1` tokens inside one unit. At length T a chunk is cut into `max_len // T` windows
  read from scratch, so every length scores the same target tokens (exactly, when T divides the
  longest length; otherwise the first `(max_len // T) * T` of each chunk).
* Sliding protocol (Press et al. 2022, §B "sliding window evaluation"): *blocks* of `stride`
  target tokens with at least `max_len - stride` tokens of the same unit before them, kept in the
  round-robin order of the draw. At length T the window is the T tokens that end at a block, and
  only its last `stride` predictions are scored, so every scored token has T - stride .. T - 1
  tokens of context. A window of T costs T tokens for `stride` scored ones, so a length may take
  only the first blocks of the list (`sliding(..., max_windows)`): the blocks a long length
  scores are a prefix of those a short one scores, still spread over the units, and a change
  between two lengths is measured on their common prefix (`posattn.eval.summary`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from posattn import data as data_lib

__all__ = ["EvalPlan", "EvalText", "HeldOut", "eval_text", "held_out_units", "make_plan"]


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """The held-out tokens and the units (files, or blocks) they are made of."""

    tokens: np.ndarray  # int[N], the corpus's val split
    spans: np.ndarray  # int64[U, 2], [start, stop) of each unit in `tokens`
    unit: str  # "file" or "block of <n> tokens"


def held_out_units(corpus: data_lib.Corpus, *, block: int) -> HeldOut:
    """The held-out split of `corpus` and its units.

    Args:
      corpus: a loaded corpus.
      block: unit size in tokens for a corpus without file boundaries.

    Returns:
      `HeldOut`; its units are the held-out files when the corpus is "stdlib" or a directory of
      text files, else consecutive blocks of `block` tokens (the last one possibly shorter).
    """
    tokens = corpus.val
    if corpus.val_spans is not None:
        return HeldOut(tokens, np.asarray(corpus.val_spans, np.int64), "file")
    if block < 2:
        raise ValueError(f"block={block!r} must be at least 2 tokens")
    starts = np.arange(0, tokens.size, block, dtype=np.int64)
    spans = np.stack([starts, np.minimum(starts + block, tokens.size)], axis=1)
    return HeldOut(tokens, spans, f"block of {block} tokens")


@dataclasses.dataclass(frozen=True)
class EvalPlan:
    """What every length scores: chunks (non-overlapping protocol) and blocks (sliding)."""

    max_len: int
    stride: int
    chunk_starts: np.ndarray  # int64[C], first token of each chunk of max_len + 1 tokens
    chunk_units: np.ndarray  # int64[C]
    block_ends: np.ndarray  # int64[Bk], one past the last target token of each sliding block
    block_units: np.ndarray  # int64[Bk] (blocks in round-robin order: any prefix is spread)
    num_units: int
    fingerprint: str  # a hash of the tokens the plan reads (equal plans score equal tokens)

    def windows(self, tokens: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Non-overlapping windows int32[W, length + 1] and their units int64[W]."""
        per_chunk = self.max_len // length
        if per_chunk < 1:
            raise ValueError(f"length={length} exceeds the plan's longest length {self.max_len}")
        starts = self.chunk_starts[:, None] + length * np.arange(per_chunk)  # (C, m)
        index = starts.reshape(-1, 1) + np.arange(length + 1)  # (W, T+1)
        return np.asarray(tokens[index], np.int32), np.repeat(self.chunk_units, per_chunk)

    def sliding(
        self, tokens: np.ndarray, length: int, max_windows: int | None = None
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """Sliding windows int32[k, length + 1] ending at the first k = min(blocks, max_windows)
        blocks, their units int64[k], and how many trailing positions of each window are scored
        (min(stride, length))."""
        if length > self.max_len:
            raise ValueError(f"length={length} exceeds the plan's longest length {self.max_len}")
        ends = self.block_ends[: max_windows if max_windows is not None else None]
        index = (ends - length - 1)[:, None] + np.arange(length + 1)  # (k, T+1)
        units = self.block_units[: ends.size]
        return np.asarray(tokens[index], np.int32), units, min(self.stride, length)


def _spread(candidates: list[np.ndarray], count: int, rng: np.random.Generator):
    """Up to `count` candidates taken round-robin over units in a random order (shuffled within
    each unit). Returns (chosen values int64[n], their units int64[n]) in the order taken."""
    order = rng.permutation(len(candidates))  # the units' turn within a round
    rank_of_unit = np.empty(len(candidates), np.int64)
    rank_of_unit[order] = np.arange(len(candidates))
    values, units, keys = [], [], []
    for u, cand in enumerate(candidates):
        if cand.size:
            values.append(rng.permutation(cand))
            units.append(np.full(cand.size, u))
            keys.append(np.arange(cand.size) * len(candidates) + rank_of_unit[u])  # round, turn
    if not values:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    values, units, keys = (np.concatenate(x) for x in (values, units, keys))
    take = np.argsort(keys, kind="stable")[:count]
    return values[take].astype(np.int64), units[take].astype(np.int64)


def make_plan(
    held: HeldOut,
    *,
    max_len: int,
    tokens: int,
    sliding_tokens: int,
    stride: int,
    seed: int,
) -> EvalPlan:
    """Draws the chunks and blocks every length will score.

    Args:
      held: the held-out split and its units.
      max_len: the longest eval length.
      tokens: target tokens per length for the non-overlapping protocol (rounded up to whole
        chunks: `ceil(tokens / max_len)` chunks of `max_len` targets).
      sliding_tokens: target tokens of the sliding protocol (`ceil(/ stride)` blocks, all of
        them scored at a length whose windows are not capped); 0 for none.
      stride: the sliding protocol's stride (tokens scored per window), 1 .. max_len.
      seed: the draw.

    Returns:
      The plan. When the split holds fewer chunks or blocks than asked, all of them (the count
      actually scored is what the results record as `eval_bytes`).
    """
    if not 1 <= stride <= max_len:
        raise ValueError(f"stride={stride!r} must lie in [1, max_len={max_len}]")
    if tokens < 1 or sliding_tokens < 0:
        raise ValueError(f"tokens={tokens!r} must be >= 1 and sliding_tokens >= 0")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5E1D]))
    lo, hi = held.spans[:, 0], held.spans[:, 1]
    chunks = [
        np.arange(a, b - max_len, max_len) for a, b in zip(lo, hi, strict=True)
    ]  # chunk in [a, b)
    chunk_starts, chunk_units = _spread(chunks, -(-tokens // max_len), rng)
    if chunk_starts.size == 0:
        raise ValueError(
            f"no held-out unit holds {max_len + 1} tokens (the longest eval length + 1); "
            "use shorter eval lengths or a corpus with longer held-out files"
        )
    blocks = [np.arange(a + max_len + 1, b + 1, stride) for a, b in zip(lo, hi, strict=True)]
    count = -(-sliding_tokens // stride)
    block_ends, block_units = _spread(blocks, count, rng) if count else (np.zeros(0, np.int64),) * 2
    digest = hashlib.sha256()
    for array in (
        chunk_starts,
        block_ends,
        np.asarray(held.tokens[: min(held.tokens.size, 1 << 16)]),
    ):
        digest.update(np.ascontiguousarray(array).tobytes())
    digest.update(f"{max_len},{stride},{held.tokens.size}".encode())
    return EvalPlan(
        max_len=max_len,
        stride=stride,
        chunk_starts=chunk_starts,
        chunk_units=chunk_units,
        block_ends=block_ends,
        block_units=block_units,
        num_units=len(held.spans),
        fingerprint=digest.hexdigest()[:16],
    )


class EvalText(NamedTuple):
    """The held-out text every evaluator reads: the tokens, the plan drawn over their units, and
    what a unit is ("file" or "block of <n> tokens")."""

    val: np.ndarray
    plan: EvalPlan
    unit: str


def eval_text(
    corpus: data_lib.Corpus,
    *,
    lengths: Sequence[int],
    max_tokens: int,
    sliding_tokens: int,
    stride: int,
    seed: int,
) -> EvalText:
    """The evaluation text of the one loss protocol: the plan of `make_plan` over the held-out
    units of `corpus` (blocks of 2 (max(lengths) + 1) tokens where it has no file boundaries),
    for the longest of `lengths`.

    The experiment (`eval.max_tokens`, `eval.sliding_tokens`, `eval.sliding_stride`, `eval.seed`)
    and the sweep (`sweep.eval_max_tokens`, no sliding blocks, seed 1234) draw their text here, so
    equal settings score equal tokens.
    """
    longest = max(int(x) for x in lengths)
    held = held_out_units(corpus, block=2 * (longest + 1))
    plan = make_plan(
        held,
        max_len=longest,
        tokens=int(max_tokens),
        sliding_tokens=int(sliding_tokens),
        stride=int(stride),
        seed=int(seed),
    )
    return EvalText(held.tokens, plan, held.unit)
