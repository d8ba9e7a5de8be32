"""Confidence intervals for mean losses: a bootstrap blocked by held-out unit (file).

Shape legend: R bootstrap replicates, U units, P seeds (or any other leading axis of values).

Tokens of one file are not independent samples of the text distribution (one file is one topic,
one author, one style): resampling tokens would give intervals far too narrow. The unit of
resampling is the file (Efron & Tibshirani 1993, ch. 8, for dependent data; the "block
bootstrap" with the file as the block). A replicate draws U files with replacement; its loss is
the ratio of the drawn files' summed NLL to their summed token counts (each file weighs by its
scored tokens, as in the point estimate).

The draw is a pure function of (seed, U), so every row of one experiment is resampled with the
same files: differences between two rows (families, or seeds of one family) have their own
paired interval from the same replicates.
"""

from __future__ import annotations

import numpy as np

__all__ = ["bootstrap_weights", "ratio_interval", "paired_interval"]


def bootstrap_weights(num_units: int, *, replicates: int, seed: int) -> np.ndarray:
    """How often each unit is drawn in each replicate: int64[R, U] (each row sums to U)."""
    if num_units < 1 or replicates < 1:
        raise ValueError(f"num_units={num_units!r} and replicates={replicates!r} must be >= 1")
    rng = np.random.default_rng(np.random.SeedSequence([seed, num_units, 0xB007]))
    draws = rng.integers(0, num_units, size=(replicates, num_units))  # (R, U)
    return np.stack([np.bincount(row, minlength=num_units) for row in draws])


def _replicates(sums: np.ndarray, counts: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Per-replicate mean loss float64[R, ...] of sums[..., U] / counts[U]."""
    num = np.einsum("ru,...u->r...", weights, sums)
    den = weights @ counts  # (R,)
    with np.errstate(invalid="ignore", divide="ignore"):
        return num / den.reshape(-1, *([1] * (num.ndim - 1)))


def ratio_interval(
    sums: np.ndarray, counts: np.ndarray, weights: np.ndarray, *, level: float = 0.95
) -> tuple[float, list[float]]:
    """Mean loss and its percentile interval.

    Args:
      sums: float[P, U] summed NLL of each unit, one row per seed (the seeds share the tokens).
      counts: float[U] scored tokens of each unit (the same for every seed).
      weights: int[R, U] from `bootstrap_weights`.
      level: the interval's coverage.

    Returns:
      (the seeds' mean of sum(sums) / sum(counts), [low, high] of that mean over replicates).
    """
    sums, counts = np.atleast_2d(np.asarray(sums, np.float64)), np.asarray(counts, np.float64)
    point = float(np.mean(sums.sum(axis=1) / counts.sum()))
    reps = _replicates(sums, counts, weights).mean(axis=1)  # (R,) the seed mean per replicate
    reps = reps[np.isfinite(reps)]
    tail = 100 * (1 - level) / 2
    return point, [float(np.percentile(reps, tail)), float(np.percentile(reps, 100 - tail))]


def paired_interval(
    sums_a: np.ndarray,
    sums_b: np.ndarray,
    counts: np.ndarray,
    weights: np.ndarray,
    *,
    level: float = 0.95,
) -> tuple[float, list[float]]:
    """Mean of (a - b) and its interval from the same replicates (a and b scored the same tokens).

    `sums_a`, `sums_b` are float[P, U] (P seeds; seed p of a is paired with seed p of b).
    """
    sums_a, sums_b = (np.atleast_2d(np.asarray(x, np.float64)) for x in (sums_a, sums_b))
    if sums_a.shape != sums_b.shape:
        raise ValueError(f"paired sums need equal shapes, got {sums_a.shape} and {sums_b.shape}")
    return ratio_interval(sums_a - sums_b, counts, weights, level=level)
