"""Synthetic memory probes: passkey retrieval and the copy task (SPEC §5), as byte sequences.

Both probes are teacher-forced: a model reads the whole sequence once, its argmax prediction at
each position is compared with the true next byte, and only the positions that can be answered
by looking back (the passkey's digits, the repeated segment) are scored. Everything here is NumPy
and a pure function of its arguments (an explicit `np.random.Generator` or seed), so the same
probe can be rebuilt anywhere: in a training batch (`posattn.train.data.train_batch` mixes passkeys in
with `data.passkey_fraction`) and in the evaluation (`experiments/length_extrapolation.py`).

Passkey (Mohtashami & Jaggi 2023, "Landmark Attention", the format also used by Chen et al. 2023
for position interpolation): a random digit string hidden at a chosen depth of repeated filler
sentences, asked for at the end. Their prompt is ~100 bytes; ours is compacted so that the whole
task fits into the 64-128-byte windows a CPU run trains on:

    <filler ...> passkey=48213. <filler ...> passkey=48213
                 ^ needle at `depth`           ^ query; the 5 digits after it are scored

Depth 0 puts the needle at the very start (farthest from the query), depth 1 right before it.
The filler contains no digit and no `=`, and the query repeats the needle's prefix, so the task is
exactly "find the earlier `passkey=` and copy what follows": retrieval across the window, which a
two-layer model can solve with an induction head (Olsson et al. 2022) keyed on the unique `=`.

Copy (the seeds' second probe): a segment of random lowercase letters is written somewhere in a
window of real text and repeated at the window's end. Random letters cannot be predicted from the
language itself (chance is 1/26), so the score measures copying from the earlier occurrence.
The first letter of the repeat is not scored: nothing announces that a repeat starts there.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = [
    "FILLER",
    "NEEDLE_PREFIX",
    "TRAIN_DIGITS",
    "CopySample",
    "PasskeySample",
    "copy_sample",
    "passkey_min_length",
    "passkey_sample",
    "score_copy",
    "score_passkey",
]

# The landmark-attention filler sentences (no digits, so the key is the only number in a window).
FILLER = (
    b"The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
NEEDLE_PREFIX = b"passkey="
TRAIN_DIGITS = 5  # the longest key of the passkeys mixed into training batches (1..5 digits)
_ASCII_DIGITS = np.frombuffer(b"0123456789", np.uint8)
_ASCII_LOWER = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)


@dataclasses.dataclass(frozen=True)
class PasskeySample:
    """One passkey sequence of `len(tokens)` bytes; `answer` indexes the digits' positions in it."""

    tokens: np.ndarray  # uint8[n]
    answer: slice  # the query's digits: tokens[answer] are scored
    needle_at: int  # where the needle starts (for checks and plots)


@dataclasses.dataclass(frozen=True)
class CopySample:
    tokens: np.ndarray  # uint8[n]
    source: slice  # the segment's first occurrence
    repeat: slice  # its repetition at the end; tokens[repeat][1:] are scored


def passkey_min_length(digits: int) -> int:
    """The shortest sequence that holds the needle and the query (no filler at all)."""
    return 2 * (len(NEEDLE_PREFIX) + digits) + 2  # needle "passkey=D. " + query "passkey=D"


def passkey_sample(
    rng: np.random.Generator, *, length: int, depth: float, digits: int = 5
) -> PasskeySample:
    """A passkey sequence of exactly `length` bytes whose last `digits` bytes are the answer.

    Args:
      rng: the source of the digits and of the filler's phase (where in the sentences it starts,
        so that a model cannot locate the needle by counting characters).
      length: total bytes (a model reads `length - 1` inputs and predicts `length - 1` targets).
      depth: 0 (needle first) .. 1 (needle right before the query), the fraction of the filler
        that precedes the needle.
      digits: the key's length.

    Returns:
      The sample; raises ValueError when `length` cannot hold the needle and the query.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey depth={depth!r} must lie in [0, 1]")
    if digits < 1:
        raise ValueError(f"passkey digits={digits!r} must be at least 1")
    if length < passkey_min_length(digits):
        raise ValueError(
            f"a passkey sequence of {digits} digits needs length >= {passkey_min_length(digits)}, "
            f"got {length}; use fewer digits or longer windows"
        )
    key = rng.choice(_ASCII_DIGITS, size=digits)  # (digits,)
    needle = np.concatenate(
        [np.frombuffer(NEEDLE_PREFIX, np.uint8), key, np.frombuffer(b". ", np.uint8)]
    )
    query = np.concatenate([np.frombuffer(NEEDLE_PREFIX, np.uint8), key])
    n_fill = length - needle.size - query.size
    phase = int(rng.integers(len(FILLER)))
    reps = (phase + n_fill) // len(FILLER) + 1
    filler = np.frombuffer(FILLER * reps, np.uint8)[phase : phase + n_fill]  # (n_fill,)
    at = int(round(depth * n_fill))
    tokens = np.concatenate([filler[:at], needle, filler[at:], query])
    return PasskeySample(tokens=tokens, answer=slice(length - digits, length), needle_at=at)


def copy_sample(rng: np.random.Generator, background: np.ndarray, *, segment: int) -> CopySample:
    """`background` (real text, kept) with a random-letter segment written at a random early place
    and again at the very end.

    Args:
      rng: picks the letters and the source position, uniform in [0, n - 2 * segment].
      background: uint8[n] bytes of real text; the result has the same length.
      segment: letters in the segment (>= 2: the first letter of the repeat is not scored).
    """
    n = background.size
    if segment < 2 or n < 2 * segment:
        raise ValueError(
            f"copy segment={segment} must be >= 2 and fit twice into the window of {n} bytes"
        )
    letters = rng.choice(_ASCII_LOWER, size=segment)
    start = int(rng.integers(0, n - 2 * segment + 1))
    tokens = np.array(background, np.uint8, copy=True)
    tokens[start : start + segment] = letters
    tokens[n - segment :] = letters
    return CopySample(
        tokens=tokens, source=slice(start, start + segment), repeat=slice(n - segment, n)
    )


def _predicted(predictions: np.ndarray, where: slice) -> np.ndarray:
    # predictions[t] is the model's guess for tokens[t + 1]: token k is predicted at position k - 1.
    return predictions[where.start - 1 : where.stop - 1]


def score_passkey(sample: PasskeySample, predictions: np.ndarray) -> bool:
    """Exact match: every digit of the answer predicted (teacher-forced argmax) correctly.

    Args:
      sample: the probe.
      predictions: int[len(tokens) - 1], argmax next-byte predictions over `tokens[:-1]`.
    """
    return bool(np.all(_predicted(predictions, sample.answer) == sample.tokens[sample.answer]))


def score_copy(sample: CopySample, predictions: np.ndarray) -> tuple[int, int]:
    """(correct, scored): letters 2..m of the repeat predicted correctly, out of m - 1."""
    scored = slice(sample.repeat.start + 1, sample.repeat.stop)
    hits = _predicted(predictions, scored) == sample.tokens[scored]
    return int(np.sum(hits)), int(hits.size)
