"""Retrieval probes scored by loss and accuracy: passkey among distractors, and induction by gap.

Shape legend: A lengths, Dp depths, G gaps, n samples per cell.

Both probes are teacher-forced byte sequences from `posattn.data.probes`; a model reads each once
(`posattn.eval.lengths` runs it, batched by tokens per pass) and is scored on the positions that
can only be answered by looking back:

* passkey (`passkey_scores`): a key of `digits` digits at a depth of filler that holds distractor
  numbers of the same length; per (length, depth): exact match of the whole key (argmax), the
  share of digits right, and the mean NLL per digit (chance: ln 10 = 2.30 nats);
* induction (`induction_scores`): a random lowercase string repeated after `gap` bytes of real
  held-out text; per (length, gap): mean NLL per letter of the repeat (all but its first letter;
  chance ln 26 = 3.26 nats) and argmax accuracy. A gap past L asks for retrieval over a distance
  no training window held; the same gap at several lengths separates distance from position.

Sample s of a cell is drawn from (seed, length, depth or gap, s), so every model of an
experiment reads the same probes. A cell the model cannot read (learned table) or that does not
fit its length (gap too long) is NaN.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from flax import nnx

from posattn.data import probes
from posattn.eval import lengths as lengths_lib
from posattn.eval.scoring import windows_per_pass

__all__ = ["induction_scores", "passkey_scores"]


def _score(
    graphdef,
    params,
    constants,
    tokens: np.ndarray,
    where: list[np.ndarray],
    targets,
    batch_tokens: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Per sample: (mean NLL over its positions `where[i]`, share of argmax hits there)."""
    seqs = np.asarray(tokens, np.int32)  # (n, T + 1)
    batch = windows_per_pass(seqs.shape[1] - 1, batch_tokens)
    nll, pred = map(
        np.concatenate,
        zip(*lengths_lib._run(graphdef, params, constants, seqs, batch), strict=True),
    )  # (n, T) each
    rows = np.arange(len(seqs))
    loss = np.array([nll[r, w].mean() for r, w in zip(rows, where, strict=True)])
    hit = np.array([(pred[r, w] == t).mean() for r, w, t in zip(rows, where, targets, strict=True)])
    exact = np.array(
        [np.all(pred[r, w] == t) for r, w, t in zip(rows, where, targets, strict=True)]
    )
    return loss, hit, exact


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
      (nats)}, each float64[A, Dp], NaN where the model cannot read the length.
    """
    cfg = lengths_lib.model_config_of(graphdef, params, constants)
    out = {k: np.full((len(lengths), len(depths)), np.nan) for k in ("acc", "digit_acc", "loss")}
    for a, length in enumerate(lengths):
        if not lengths_lib._can_read(cfg, int(length)):
            continue
        made = [
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
        out["digit_acc"][a] = hit.reshape(shape).mean(axis=1)
        out["acc"][a] = exact.reshape(shape).mean(axis=1)
    return out


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
        if not lengths_lib._can_read(cfg, int(length)) or not fits:
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
