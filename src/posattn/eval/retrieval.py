"""Retrieval probes scored by loss and accuracy: passkey among distractors, and induction by gap.

Shape legend: A lengths, Dp depths, G gaps, n samples per cell.

Both probes are teacher-forced byte sequences from `posattn.data.probes`; a model reads each once
(`posattn.eval.lengths` runs it, batched by tokens per pass) and is scored on the positions that
can only be answered by looking back:

* passkey (`passkey_scores`): a key of `digits` digits at a depth of filler that holds distractor
  numbers of the same length; per (length, depth): exact match of the whole key (argmax), the
  share of digits right, and the mean NLL per digit (chance: ln 10 = 2.30 nats);
  `passkey_places` says where each wrong digit came from (later or earlier in the key, elsewhere
  in the sequence);
* copy (`copy_scores`): a random-letter segment repeated inside real text; per length the share
  of the repeat's letters (all but its first) predicted by argmax;
* induction (`induction_scores`): a random lowercase string repeated after `gap` bytes of real
  held-out text; per (length, gap): mean NLL per letter of the repeat (all but its first letter;
  chance ln 26 = 3.26 nats) and argmax accuracy. A gap past L asks for retrieval over a distance
  no training window held; the same gap at several lengths separates distance from position.

Sample s of a cell is drawn from (seed, length, depth or gap, s), so every model of an
experiment reads the same probes. A cell the model cannot read (learned table) or that does not
fit its length (gap too long) is NaN.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flax import nnx

from posattn.data import probes
from posattn.eval import lengths as lengths_lib
from posattn.eval.scoring import windows_per_pass

__all__ = [
    "PLACES",
    "copy_evaluator",
    "copy_scores",
    "induction_evaluator",
    "induction_gaps",
    "induction_scores",
    "passkey_evaluator",
    "passkey_places",
    "passkey_places_at_random",
    "passkey_samples",
    "passkey_scores",
]


def _score(
    graphdef,
    params,
    constants,
    tokens: np.ndarray,
    where: list[np.ndarray],
    targets,
    batch_tokens: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per sample: (mean NLL over its positions `where[i]`, share of argmax hits there, whether
    every one of them is a hit)."""
    seqs = np.asarray(tokens, np.int32)  # (n, T + 1)
    batch = windows_per_pass(seqs.shape[1] - 1, batch_tokens)
    nll, pred = map(
        np.concatenate,
        zip(*lengths_lib.forward(graphdef, params, constants, seqs, batch), strict=True),
    )  # (n, T) each
    rows = np.arange(len(seqs))
    loss = np.array([nll[r, w].mean() for r, w in zip(rows, where, strict=True)])
    hit = np.array([(pred[r, w] == t).mean() for r, w, t in zip(rows, where, targets, strict=True)])
    exact = np.array(
        [np.all(pred[r, w] == t) for r, w, t in zip(rows, where, targets, strict=True)]
    )
    return loss, hit, exact


def passkey_samples(
    *,
    length: int,
    depths: Sequence[float],
    samples: int,
    digits: int,
    seed: int,
    distractors: bool = True,
) -> list[probes.PasskeySample]:
    """The passkey probe's sequences at one length, depth by depth (`samples` each, sample s of
    depth index d drawn from (seed, length, d, s)): what `passkey_scores` reads."""
    return [
        probes.passkey_sample(
            np.random.default_rng([seed, int(length), d, s, 0xD15]),
            length=int(length) + 1,
            depth=float(depths[d]),
            digits=digits,
            distractors=distractors,
        )
        for d in range(len(depths))
        for s in range(samples)
    ]


def passkey_scores(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    constants: nnx.State,
    *,
    lengths: Sequence[int],
    depths: Sequence[float],
    samples: int,
    digits: int,
    seed: int,
    batch_tokens: int,
    distractors: bool = True,
) -> dict[str, np.ndarray]:
    """Passkey retrieval per (length, depth).

    Returns:
      {"acc": exact-match share, "digit_acc": share of digits right, "loss": mean NLL per digit
      (nats), "se": the standard error of the loss over samples (each sample's NLL per digit;
      NaN for one sample)}, each float64[A, Dp], NaN where the model cannot read the length or
      the length cannot hold a passkey of `digits` digits (`probes.passkey_min_length` - 1).
    """
    cfg = lengths_lib.model_config_of(graphdef, params, constants)
    keys = ("acc", "digit_acc", "loss", "se")
    out = {k: np.full((len(lengths), len(depths)), np.nan) for k in keys}
    fits = probes.passkey_min_length(digits) - 1  # a sample is length + 1 bytes
    for a, length in enumerate(lengths):
        if not lengths_lib.can_read(cfg, int(length)) or int(length) < fits:
            continue
        made = passkey_samples(
            length=int(length),
            depths=depths,
            samples=samples,
            digits=digits,
            seed=seed,
            distractors=distractors,
        )
        where = [probes.target_positions(m.answer) for m in made]
        targets = [m.tokens[m.answer] for m in made]
        loss, hit, exact = _score(
            graphdef,
            params,
            constants,
            np.stack([m.tokens for m in made]),
            where,
            targets,
            batch_tokens,
        )
        shape = (len(depths), samples)
        out["loss"][a] = loss.reshape(shape).mean(axis=1)
        if samples > 1:
            out["se"][a] = loss.reshape(shape).std(axis=1, ddof=1) / np.sqrt(samples)
        out["digit_acc"][a] = hit.reshape(shape).mean(axis=1)
        out["acc"][a] = exact.reshape(shape).mean(axis=1)
    return out


PLACES = ("right", "later", "earlier", "window", "other")


def passkey_places(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    constants: nnx.State,
    *,
    length: int,
    depths: Sequence[float],
    samples: int,
    digits: int,
    seed: int,
    batch_tokens: int,
    distractors: bool = True,
) -> dict[str, np.ndarray]:
    """Where each digit of the key goes wrong, at one length: `passkey_scores`' samples, each
    key digit's argmax put in the first of these classes it fits (`PLACES`):

    * "right": the digit asked for;
    * "later": a digit the key holds after it (the model found the key, and read ahead of its
      place in it);
    * "earlier": a digit the key holds before it;
    * "window": another digit of the sequence (a distractor's, where the key holds none);
    * "other": not a digit of the sequence.

    A key that repeats a digit counts a prediction of it as "later" before "earlier", so the two
    are upper and lower bounds where keys repeat (4 random digits: 50% of keys repeat one).

    Returns:
      {class: float64[Dp, digits]}, the share of the depth's samples whose digit j falls in the
      class; the classes of one (depth, digit) sum to 1, and "right" averaged over digits is
      `passkey_scores`' digit_acc at that length.
    """
    made = passkey_samples(
        length=length,
        depths=depths,
        samples=samples,
        digits=digits,
        seed=seed,
        distractors=distractors,
    )
    seqs = np.stack([m.tokens for m in made]).astype(np.int32)  # (Dp * n, T + 1)
    batch = windows_per_pass(seqs.shape[1] - 1, batch_tokens)
    pred = np.concatenate(
        [p for _, p in lengths_lib.forward(graphdef, params, constants, seqs, batch)]
    )  # (Dp * n, T)
    counts = {k: np.zeros((len(depths), digits)) for k in PLACES}
    for i, m in enumerate(made):
        key = m.tokens[m.answer]
        got = pred[i, probes.target_positions(m.answer)]
        seen = set(m.tokens[: m.answer.start].tolist())
        for j in range(digits):
            counts[_place(int(got[j]), key, j, seen)][i // samples, j] += 1
    return {k: v / samples for k, v in counts.items()}


def passkey_places_at_random(
    *,
    length: int,
    depths: Sequence[float],
    samples: int,
    digits: int,
    seed: int,
    distractors: bool = True,
) -> dict[str, np.ndarray]:
    """`passkey_places` of a reader that knows a digit comes next and nothing more: each key
    digit predicted as one of the digits the sequence holds before it (the needle's key, the
    distractors, the query's digits so far), drawn uniformly over their occurrences. The
    expected shares, as `passkey_places` returns them: the reference for a model's."""
    made = passkey_samples(
        length=length,
        depths=depths,
        samples=samples,
        digits=digits,
        seed=seed,
        distractors=distractors,
    )
    counts = {k: np.zeros((len(depths), digits)) for k in PLACES}
    for i, m in enumerate(made):
        key = m.tokens[m.answer]
        seen = set(m.tokens[: m.answer.start].tolist())
        for j in range(digits):
            before = m.tokens[: m.answer.start + j]
            drawn = before[(before >= ord("0")) & (before <= ord("9"))]
            for g in drawn.tolist():
                counts[_place(g, key, j, seen)][i // samples, j] += 1 / drawn.size
    return {k: v / samples for k, v in counts.items()}


def _place(g: int, key: np.ndarray, j: int, seen: set[int]) -> str:
    """The `PLACES` class of byte `g` predicted for digit j of `key` (`passkey_places`)."""
    if g == key[j]:
        return "right"
    if g in key[j + 1 :]:
        return "later"
    if g in key[:j]:
        return "earlier"
    if g in seen and ord("0") <= g <= ord("9"):
        return "window"
    return "other"


def induction_scores(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    constants: nnx.State,
    tokens: np.ndarray,
    *,
    lengths: Sequence[int],
    gaps: Sequence[int],
    span: int,
    samples: int,
    seed: int,
    batch_tokens: int,
) -> dict[str, np.ndarray]:
    """Induction (repeated random string) per (length, gap).

    Args:
      tokens: held-out real text; sample s of a cell reads a background window at a position
        drawn from (seed, length, gap index, s).
      gaps: bytes between the two copies; a cell with 2 * span + gap > length + 1 is NaN.
      span: letters in the random string.

    Returns:
      {"loss": mean NLL per scored letter (nats), "acc": argmax accuracy, "se": the standard
      error of the loss over samples}, each float64[A, G].
    """
    cfg = lengths_lib.model_config_of(graphdef, params, constants)
    out = {k: np.full((len(lengths), len(gaps)), np.nan) for k in ("loss", "acc", "se")}
    for a, length in enumerate(lengths):
        n = int(length) + 1
        fits = [g for g in range(len(gaps)) if 2 * span + int(gaps[g]) <= n]
        if not lengths_lib.can_read(cfg, int(length)) or not fits:
            continue
        made = []
        for g in fits:
            for s in range(samples):
                rng = np.random.default_rng([seed, int(length), g, s, 0x1D])
                start = int(rng.integers(0, tokens.size - n))
                background = np.asarray(tokens[start : start + n], np.uint8)
                made.append(probes.induction_sample(rng, background, span=span, gap=int(gaps[g])))
        scored = [slice(m.repeat.start + 1, m.repeat.stop) for m in made]
        where = [probes.target_positions(w) for w in scored]
        targets = [m.tokens[w] for m, w in zip(made, scored, strict=True)]
        loss, hit, _ = _score(
            graphdef,
            params,
            constants,
            np.stack([m.tokens for m in made]),
            where,
            targets,
            batch_tokens,
        )
        loss, hit = loss.reshape(len(fits), samples), hit.reshape(len(fits), samples)
        out["loss"][a, fits] = loss.mean(axis=1)
        out["acc"][a, fits] = hit.mean(axis=1)
        out["se"][a, fits] = loss.std(axis=1, ddof=1) / np.sqrt(samples) if samples > 1 else np.nan
    return out


def copy_scores(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    constants: nnx.State,
    tokens: np.ndarray,
    *,
    lengths: Sequence[int],
    samples: int,
    segment: int,
    seed: int,
    batch_tokens: int,
) -> list[float | None]:
    """Copy-task accuracy per length: the share of a repeated random-letter segment's letters
    (all but the first) predicted correctly; the background is real text, window w of sample w
    cut from `tokens` at a position drawn from (seed, length, w). None where the model cannot
    read the length."""
    cfg = lengths_lib.model_config_of(graphdef, params, constants)
    out: list[float | None] = []
    for length in lengths:
        length = int(length)
        if not lengths_lib.can_read(cfg, length):
            out.append(None)
            continue
        made = []
        for s in range(samples):
            rng = np.random.default_rng([seed, length, s, 0xC0])
            start = int(rng.integers(0, tokens.size - length - 1))
            made.append(
                probes.copy_sample(
                    rng, np.asarray(tokens[start : start + length + 1], np.uint8), segment=segment
                )
            )
        pred = lengths_lib.predict(
            graphdef,
            params,
            constants,
            np.stack([m.tokens for m in made]),
            batch_size=windows_per_pass(length, batch_tokens),
        )
        scores = np.array(
            [probes.score_copy(m, p) for m, p in zip(made, pred, strict=True)]
        )  # (samples, 2)
        out.append(float(scores[:, 0].sum() / scores[:, 1].sum()))
    return out


def induction_gaps(settings: Mapping[str, Any]) -> list[int]:
    """`gaps` if given, else `gap_multiples` x `train_len` (bytes between the two copies)."""
    if settings.get("gaps"):
        return [int(x) for x in settings["gaps"]]
    return [int(round(m * settings["train_len"])) for m in settings["gap_multiples"]]


def _cells(grid: np.ndarray) -> list[float | None]:
    return [None if np.isnan(x) else float(x) for x in grid]


def passkey_evaluator(model, text, length: int, settings: Mapping[str, Any]) -> dict:
    """The "passkey" evaluator (`posattn.eval.registry`) at one length: {"acc", "digit_acc",
    "loss", "se"}, each a list over `depths` (None where the model cannot read the length or
    the length is too short for the passkey's digits)."""
    grids = passkey_scores(
        *model,
        lengths=[int(length)],
        depths=list(settings["depths"]),
        samples=int(settings["samples"]),
        digits=int(settings["digits"]),
        seed=int(settings["seed"]),
        batch_tokens=int(settings["batch_tokens"]),
        distractors=bool(settings["distractors"]),
    )
    return {k: _cells(v[0]) for k, v in grids.items()}


def induction_evaluator(model, text, length: int, settings: Mapping[str, Any]) -> dict:
    """The "induction" evaluator at one length: {"loss", "acc", "se"}, each a list over the gaps
    of `induction_gaps(settings)` (None where the cell does not fit or cannot be read)."""
    grids = induction_scores(
        *model,
        text.val,
        lengths=[int(length)],
        gaps=induction_gaps(settings),
        span=int(settings["span"]),
        samples=int(settings["samples"]),
        seed=int(settings["seed"]),
        batch_tokens=int(settings["batch_tokens"]),
    )
    return {k: _cells(v[0]) for k, v in grids.items()}


def copy_evaluator(model, text, length: int, settings: Mapping[str, Any]) -> float | None:
    """The "copy" evaluator at one length: the accuracy of `copy_scores` (None: cannot read)."""
    (value,) = copy_scores(
        *model,
        text.val,
        lengths=[int(length)],
        samples=int(settings["samples"]),
        segment=int(settings["segment"]),
        seed=int(settings["seed"]),
        batch_tokens=int(settings["batch_tokens"]),
    )
    return value
