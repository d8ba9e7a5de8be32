"""Synthetic memory probes: passkey retrieval and the copy task
(docs/conventions.md), as byte sequences.

Both probes are teacher-forced: a model reads the whole sequence once, its argmax prediction at
each position is compared with the true next byte, and only the positions that can be answered
by looking back (the passkey's digits, the repeated segment) are scored. Everything here is NumPy
and a pure function of its arguments (an explicit `np.random.Generator` or seed), so the same
probe can be rebuilt anywhere: in a training batch (`posattn.data.train_batch` mixes passkeys
in with `data.passkey_fraction`, induction rows with
`data.induction_fraction`) and in the evaluation (`experiments/length_extrapolation.py`).

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

With `distractors=True` (the evaluation's form) the filler also holds sentences with numbers of
the key's length ("Room 4821 is free. "), so "copy the digits in the window" no longer solves it:
only the digits after the earlier `passkey=` are the answer.

Induction (Olsson et al. 2022, the repeated-random-tokens test): a random string of letters
written into real text and repeated after a gap of g bytes; the loss on the repeat (all but its
first byte) measures in-context retrieval continuously, by gap and by window length, before a
model copies perfectly (chance: ln 26 nats per letter).

Copy: a segment of random lowercase letters is written somewhere in a
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
    "TRAIN_SPAN",
    "CopySample",
    "InductionSample",
    "PasskeySample",
    "copy_sample",
    "induction_sample",
    "passkey_min_length",
    "passkey_sample",
    "score_copy",
    "score_passkey",
    "target_positions",
]

# The landmark-attention filler sentences (no digits, so the key is the only number in a window).
FILLER = (
    b"The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
NEEDLE_PREFIX = b"passkey="
TRAIN_DIGITS = 5  # the longest training key by default (`data.passkey_digits` = (1, 5))
TRAIN_SPAN = 12  # the longest training induction string by default (`data.induction_span`)
_ASCII_DIGITS = np.frombuffer(b"0123456789", np.uint8)
_ASCII_LOWER = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
_DISTRACTOR = (b"Room ", b" is free. ")  # a filler sentence around a random number


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


def _draw(rng: np.random.Generator, alphabet: np.ndarray, size: int) -> np.ndarray:
    """`size` symbols of `alphabet` drawn uniformly with replacement: the values (and the state
    the generator is left in) of `rng.choice(alphabet, size=size)`, at half its cost, which
    counts in a training batch's many probe rows."""
    return alphabet[rng.integers(0, alphabet.size, size=size)]


def passkey_min_length(digits: int) -> int:
    """The shortest sequence that holds the needle and the query (no filler at all)."""
    return 2 * (len(NEEDLE_PREFIX) + digits) + 2  # needle "passkey=D. " + query "passkey=D"


def passkey_sample(
    rng: np.random.Generator,
    *,
    length: int,
    depth: float,
    digits: int = 5,
    distractors: bool = False,
) -> PasskeySample:
    """A passkey sequence of exactly `length` bytes whose last `digits` bytes are the answer.

    Args:
      rng: the source of the digits and of the filler's phase (where in the sentences it starts,
        so that a model cannot locate the needle by counting characters).
      length: total bytes (a model reads `length - 1` inputs and predicts `length - 1` targets).
      depth: 0 (needle first) .. 1 (needle right before the query), the fraction of the filler
        that precedes the needle.
      digits: the key's length.
      distractors: one filler sentence in three (at random) is "Room <number> is free. " with a
        random number of `digits` digits, so the key is not the only number in the window.

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
    key = _draw(rng, _ASCII_DIGITS, digits)  # (digits,)
    needle = np.concatenate(
        [np.frombuffer(NEEDLE_PREFIX, np.uint8), key, np.frombuffer(b". ", np.uint8)]
    )
    query = np.concatenate([np.frombuffer(NEEDLE_PREFIX, np.uint8), key])
    n_fill = length - needle.size - query.size
    phase = int(rng.integers(len(FILLER)))
    if distractors:
        filler = _distractor_filler(rng, phase + n_fill, digits)[phase:]  # (n_fill,)
    else:
        reps = (phase + n_fill) // len(FILLER) + 1
        filler = np.frombuffer(FILLER * reps, np.uint8)[phase : phase + n_fill]  # (n_fill,)
    at = int(round(depth * n_fill))
    tokens = np.concatenate([filler[:at], needle, filler[at:], query])
    return PasskeySample(tokens=tokens, answer=slice(length - digits, length), needle_at=at)


def _distractor_filler(rng: np.random.Generator, size: int, digits: int) -> np.ndarray:
    """`size` bytes of filler sentences, one in three (at random) a number sentence."""
    sentences = [x + b". " for x in FILLER.split(b". ") if x.strip()]
    parts, total = [], 0
    while total < size:
        if rng.random() < 1 / 3:
            number = _draw(rng, _ASCII_DIGITS, digits).tobytes()
            part = _DISTRACTOR[0] + number + _DISTRACTOR[1]
        else:
            part = sentences[int(rng.integers(len(sentences)))]
        parts.append(part)
        total += len(part)
    return np.frombuffer(b"".join(parts), np.uint8)[:size]


@dataclasses.dataclass(frozen=True)
class InductionSample:
    tokens: np.ndarray  # uint8[n]
    source: slice  # the random string's first occurrence
    repeat: slice  # its repetition at the end, `gap` bytes after the source; [1:] is scored
    gap: int


def induction_sample(
    rng: np.random.Generator, background: np.ndarray, *, span: int, gap: int
) -> InductionSample:
    """`background` (real text) with a random lowercase string of `span` letters written so that
    its repeat ends the sequence and `gap` bytes of text separate the two copies.

    Args:
      rng: picks the letters.
      background: uint8[n] real text; the result has the same length.
      span: letters in the string (>= 2: the repeat's first letter is not scored).
      gap: bytes between the end of the first copy and the start of the repeat (>= 0).
    """
    n = background.size
    if span < 2 or gap < 0 or n < 2 * span + gap:
        raise ValueError(
            f"induction span={span} (>= 2) and gap={gap} (>= 0) need 2 * span + gap <= {n} bytes"
        )
    letters = _draw(rng, _ASCII_LOWER, span)
    tokens = np.array(background, np.uint8, copy=True)
    first = n - 2 * span - gap
    tokens[first : first + span] = letters
    tokens[n - span :] = letters
    return InductionSample(
        tokens=tokens, source=slice(first, first + span), repeat=slice(n - span, n), gap=gap
    )


def target_positions(where: slice) -> np.ndarray:
    """The prediction positions int[k] of the tokens `where` (token j is predicted at j - 1)."""
    return np.arange(where.start - 1, where.stop - 1)


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
    letters = _draw(rng, _ASCII_LOWER, segment)
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
