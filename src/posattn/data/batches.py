"""Batches: training batches (a pure function of seed and step, probe rows mixed in), held-out
evaluation batches and windows, the encoder's masked bytes.

Batches are a pure function of (seed, step): a resumed run sees exactly the batches it would have
seen, and on several hosts each process builds only its own rows of the same global batch.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from posattn.data import probes
from posattn.data.corpus import Corpus, DataError

__all__ = [
    "batch_options",
    "batched",
    "eval_batches",
    "eval_windows",
    "mask_tokens",
    "mix_inductions",
    "mix_passkeys",
    "train_batch",
]


def batch_options(data_config, *, causal: bool, vocab_size: int) -> dict:
    """The `train_batch` keywords a config asks for (the encoder's masking, probe mixing), from a
    completed `data` section (`posattn.config.complete`).

    The encoder's `[MASK]` id is `vocab_size`, one past the output vocabulary (as
    `posattn.nn.model.mask_token_id`).
    """
    if causal:
        shortest, longest = (int(d) for d in data_config.passkey_digits)
        if data_config.passkey_fraction:
            _check_passkey_fits(int(data_config.seq_len) + 1, longest)
        return {
            "passkey_fraction": float(data_config.passkey_fraction),
            "passkey_distractors": bool(data_config.passkey_distractors),
            "passkey_digits": (shortest, longest),
            "induction_fraction": float(data_config.induction_fraction),
            "induction_span": int(data_config.induction_span),
            "probe_weight": float(data_config.probe_weight),
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
    passkey_digits: tuple[int, int] = (1, probes.TRAIN_DIGITS),
    induction_fraction: float = 0.0,
    induction_span: int = probes.TRAIN_SPAN,
    probe_weight: float = 1.0,
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
        passkey-retrieval sequence (`posattn.data.probes`: random depth, a key of random digits,
        `passkey_digits` long) so that the skill the extrapolation experiment measures is
        learnable at the training length. Drawn from its own stream of (seed, step), so 0
        leaves every batch exactly as it was; causal LM only.
      passkey_distractors: the passkeys' filler holds distractor numbers of the key's length
        (`probes.passkey_sample(distractors=True)`, the evaluation's format), so that the skill
        learned is retrieval by the `passkey=` cue, not "copy the only digits in the window".
      passkey_digits: (shortest, longest): each passkey row's key length is drawn uniformly from
        this range (`data.passkey_digits`; 1 to 5 by default, any length the evaluation asks).
      induction_fraction: each row not taken by a passkey is, with this probability, its own text
        with a random lowercase string written into it and repeated later in the window
        (`mix_inductions`: the evaluation's induction probe at random spans and gaps inside L),
        so that in-context copying, which the induction probe measures, is rewarded by the
        training loss. Its own stream of (seed, step): 0 leaves every batch as it was.
      induction_span: the longest string of an induction row: each row's span is uniform in
        [4, induction_span] letters.
      probe_weight: the loss weight of the targets a mixed-in row is scored on, as the
        evaluation scores them: a passkey row's key digits after the final `passkey=`, an
        induction row's repeat but its first letter (always the row's last targets). Every
        other target weighs 1. In a 64-byte row those are 1-5 and 3-11 of 64 targets, so at
        weight 1 a fifth of the rows puts ~1-2% of the loss on retrieval; a larger weight
        makes the skill a sizeable share of the loss without giving up text rows
        (experiments/README.md, "Probe rows that teach retrieval at L").

    Returns:
      `inputs`, `targets` int32[b, T] and `weights` float32[b, T] (which targets count, and how
      much), b the number of rows asked for (B/P by default). For the LM, targets are inputs
      shifted by one and every weight is 1 but those of the probes' scored targets
      (`probe_weight`). Any split of the rows concatenates to the global batch.
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
    for key, fraction in (("passkey", passkey_fraction), ("induction", induction_fraction)):
        if not fraction:
            continue
        if mask_rate > 0:
            raise DataError(
                f"data.{key}_fraction mixes {key} sequences into a causal LM's batches; "
                "set it to 0 for the encoder (model.kind='encoder')"
            )
        if corpus.train.dtype != np.uint8:
            raise DataError(
                f"data.{key}_fraction: {key} rows are written in bytes, but corpus "
                f"{corpus.name!r} holds token ids; use a byte-level corpus (text) or set the "
                "fraction to 0"
            )
    if not (np.isfinite(probe_weight) and probe_weight >= 0):
        raise DataError(
            f"data.probe_weight={probe_weight!r} must be a finite weight >= 0 (1: the probe "
            "rows' answers count as any other target)"
        )
    taken = np.zeros(batch_size, bool)
    scored = np.zeros(len(windows), np.int64)  # (b,) trailing targets a probe scores per row
    if passkey_fraction:
        windows, scored_keys = _mix_passkeys(
            windows,
            seed=seed,
            step=step,
            fraction=passkey_fraction,
            rows=rows,
            batch_size=batch_size,
            distractors=passkey_distractors,
            digits=passkey_digits,
        )
        scored += scored_keys
        taken = _chosen_rows(seed, step, _PASSKEY_STREAM, passkey_fraction, batch_size)
    if induction_fraction:
        windows, scored_repeats = _mix_inductions(
            windows,
            seed=seed,
            step=step,
            fraction=induction_fraction,
            rows=rows,
            batch_size=batch_size,
            skip=taken,
            max_span=induction_span,
        )
        scored += scored_repeats
    inputs, targets = windows[:, :-1], windows[:, 1:]
    if mask_rate <= 0:
        weights = np.ones(targets.shape, np.float32)
        if probe_weight != 1.0:
            weights[np.arange(seq_len)[None, :] >= seq_len - scored[:, None]] = probe_weight
        return {"inputs": inputs, "targets": targets, "weights": weights}
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
    digits: tuple[int, int] = (1, probes.TRAIN_DIGITS),
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
      digits: the shortest and longest key; each row's length is drawn uniformly between.
    """
    return _mix_passkeys(
        windows,
        seed=seed,
        step=step,
        fraction=fraction,
        rows=rows,
        batch_size=batch_size,
        distractors=distractors,
        digits=digits,
    )[0]


def _mix_passkeys(
    windows: np.ndarray,
    *,
    seed: int,
    step: int,
    fraction: float,
    rows: slice,
    batch_size: int,
    distractors: bool,
    digits: tuple[int, int],
) -> tuple[np.ndarray, np.ndarray]:
    """`mix_passkeys` and int[b]: the key's digits of each replaced row (its last targets), 0 for
    a row left as it was."""
    if not 0.0 <= fraction <= 1.0:
        raise DataError(f"data.passkey_fraction={fraction!r} must lie in [0, 1]")
    shortest, longest = digits
    if not 1 <= shortest <= longest:
        raise DataError(
            f"data.passkey_digits={tuple(digits)!r} must be (shortest, longest) with "
            "1 <= shortest <= longest"
        )
    if fraction:
        _check_passkey_fits(windows.shape[1], longest)
    chosen = _chosen_rows(seed, step, _PASSKEY_STREAM, fraction, batch_size)
    out = windows.copy()
    scored = np.zeros(len(windows), np.int64)
    for local, row in enumerate(range(rows.start, rows.stop)):
        if chosen[row]:
            rng = np.random.default_rng(np.random.SeedSequence([seed, step, _PASSKEY_STREAM, row]))
            digits = int(rng.integers(shortest, longest + 1))  # 1..5 by default
            out[local] = probes.passkey_sample(
                rng,
                length=windows.shape[1],
                depth=float(rng.random()),
                digits=digits,
                distractors=distractors,
            ).tokens
            scored[local] = digits
    return out, scored


def _check_passkey_fits(row_bytes: int, longest: int) -> None:
    need = probes.passkey_min_length(longest)
    if row_bytes < need:
        raise DataError(
            f"data.passkey_fraction: a passkey of data.passkey_digits up to {longest} digits "
            f"needs rows of at least {need} bytes; data.seq_len={row_bytes - 1} is too short "
            "(raise it, shorten the keys, or set the fraction to 0)"
        )


def mix_inductions(
    windows: np.ndarray,
    *,
    seed: int,
    step: int,
    fraction: float,
    rows: slice,
    batch_size: int,
    skip: np.ndarray | None = None,
    max_span: int = probes.TRAIN_SPAN,
) -> np.ndarray:
    """This process's `rows` of the global batch with chosen rows turned into induction rows.

    An induction row keeps its own text and gets a random lowercase string of 4 to `max_span`
    letters written into it and repeated at its end after a random gap
    (`probes.induction_sample`, the evaluation's probe, with every span and gap that fits the
    window). The choice and content depend only on (seed, step, row), as for the passkeys.

    Args:
      windows: int32[b, T+1], this process's rows `rows` of the global batch.
      seed, step: the batch's identity.
      fraction: the probability that a row (not in `skip`) becomes an induction row, in [0, 1].
      rows: which global rows `windows` holds.
      batch_size: the global batch size B.
      skip: bool[B], global rows already taken (by passkeys), left as they are.
      max_span: the longest string (>= 4; `data.induction_span`).
    """
    return _mix_inductions(
        windows,
        seed=seed,
        step=step,
        fraction=fraction,
        rows=rows,
        batch_size=batch_size,
        skip=skip,
        max_span=max_span,
    )[0]


def _mix_inductions(
    windows: np.ndarray,
    *,
    seed: int,
    step: int,
    fraction: float,
    rows: slice,
    batch_size: int,
    skip: np.ndarray | None,
    max_span: int = probes.TRAIN_SPAN,
) -> tuple[np.ndarray, np.ndarray]:
    """`mix_inductions` and int[b]: the scored letters of each induction row (its repeat but the
    first letter: the row's last span - 1 targets), 0 for a row left as it was."""
    if not 0.0 <= fraction <= 1.0:
        raise DataError(f"data.induction_fraction={fraction!r} must lie in [0, 1]")
    n = windows.shape[1]
    if fraction and max_span < 4:
        raise DataError(f"data.induction_span={max_span!r} must be at least 4 letters")
    if fraction and n < 2 * max_span:
        raise DataError(
            f"data.induction_fraction={fraction} needs windows of at least "
            f"{2 * max_span} bytes to hold a string of data.induction_span={max_span} letters "
            f"and its repeat; data.seq_len={n - 1} is too short (raise it, lower the span or "
            "set the fraction to 0)"
        )
    chosen = _chosen_rows(seed, step, _INDUCTION_STREAM, fraction, batch_size)
    if skip is not None:
        chosen &= ~skip
    out = windows.copy()
    scored = np.zeros(len(windows), np.int64)
    for local, row in enumerate(range(rows.start, rows.stop)):
        if chosen[row]:
            rng = np.random.default_rng(
                np.random.SeedSequence([seed, step, _INDUCTION_STREAM, row])
            )
            span = int(rng.integers(4, max_span + 1))
            gap = int(rng.integers(0, n - 2 * span + 1))
            sample = probes.induction_sample(
                rng, windows[local].astype(np.uint8), span=span, gap=gap
            )
            out[local] = sample.tokens
            scored[local] = span - 1
    return out, scored


_PASSKEY_STREAM = 0x9A55
_INDUCTION_STREAM = 0x1DC7


def _chosen_rows(seed: int, step: int, stream: int, fraction: float, batch_size: int) -> np.ndarray:
    """bool[B]: which global rows of (seed, step) a probe `stream` replaces."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, step, stream]))
    return rng.random(batch_size) < fraction


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
