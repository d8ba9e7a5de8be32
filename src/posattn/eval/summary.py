"""From per-unit NLL sums (`posattn.eval.scoring`) to the numbers a table reports.

Shape legend: P seeds, U units (held-out files), R bootstrap replicates, G curve bins.

A row (a family, or RoPE under one scaling) has, per seed and length, the per-unit sums of one
protocol. `summarize_row` turns them into, per length: the mean over seeds of the loss, its 95%
interval (a bootstrap over files of that mean, `posattn.eval.intervals`), each seed's loss, the
standard error over seeds, the paired change from the first length (same files, same
replicates), the same for positions >= L and for the sliding protocol, and the scored token
counts. `paired_difference` compares two rows on the same files and seeds.

Intervals here are over the evaluation text only (which files were scored); the spread over
training seeds is `loss_seeds` and its standard error `loss_se`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from posattn.eval import intervals

__all__ = ["mean_losses", "paired_difference", "summarize_curve", "summarize_row"]


def mean_losses(scores: Sequence[dict | None], key: str = "") -> list[float | None]:
    """One model's mean loss per length from its `score_lengths` dicts (no interval): the summed
    NLL over the summed count of protocol `key` ("", "beyond_" or "sliding_"); None where the
    model cannot read the length or the protocol has nothing there."""
    return [
        None
        if s is None or s.get(f"{key}sum") is None
        else float(np.sum(s[f"{key}sum"]) / np.sum(s[f"{key}count"]))
        for s in scores
    ]


def _stack(scores: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(sums float64[P, U], counts float64[U]) of `key` over seeds, or None when absent."""
    if any(s is None or s.get(f"{key}sum") is None for s in scores):
        return None
    sums = np.stack([np.asarray(s[f"{key}sum"], np.float64) for s in scores])
    return sums, np.asarray(scores[0][f"{key}count"], np.float64)


def _replicates(sums, counts, weights) -> np.ndarray:
    """The seed-mean loss of each replicate: float64[R]."""
    num = weights @ sums.T  # (R, P)
    with np.errstate(invalid="ignore", divide="ignore"):  # a replicate may draw no scored unit
        return (num / (weights @ counts)[:, None]).mean(axis=1)


def _ci(values: np.ndarray, level: float) -> list[float]:
    values = values[np.isfinite(values)]
    tail = 100 * (1 - level) / 2
    return [float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))]


def _protocol(per_length, key, weights, level, base_index=0) -> dict[str, list]:
    """Loss, interval, per-seed losses, seed standard error and change from the base length."""
    out = {k: [] for k in ("loss", "ci", "seeds", "se", "delta", "delta_ci", "tokens")}
    stacks = [None if scores is None else _stack(scores, key) for scores in per_length]
    base = stacks[base_index] if base_index < len(stacks) else None
    base_reps = None if base is None else _replicates(*base, weights)
    for stack in stacks:
        if stack is None:
            for k in out:
                out[k].append(None)
            continue
        sums, counts = stack
        seeds = sums.sum(axis=1) / counts.sum()  # (P,)
        reps = _replicates(sums, counts, weights)
        out["loss"].append(float(seeds.mean()))
        out["ci"].append(_ci(reps, level))
        out["seeds"].append([float(x) for x in seeds])
        out["se"].append(float(seeds.std(ddof=1) / np.sqrt(seeds.size)) if seeds.size > 1 else None)
        out["tokens"].append(int(round(counts.sum())))
        if base is None:
            out["delta"].append(None)
            out["delta_ci"].append(None)
        else:
            base_seeds = base[0].sum(axis=1) / base[1].sum()
            out["delta"].append(float(seeds.mean() - base_seeds.mean()))
            out["delta_ci"].append(_ci(reps - base_reps, level))
    return out


def _prefix(scores: Sequence[dict], k: int, block_units: np.ndarray, num_units: int):
    """(sums float64[P, U], counts float64[U]) of the first k sliding blocks of each seed."""
    units = block_units[:k]
    per_block = np.sum(scores[0]["sliding_count"]) / len(scores[0]["sliding_block_sums"])
    sums = np.stack(
        [np.bincount(units, np.asarray(s["sliding_block_sums"][:k]), num_units) for s in scores]
    )
    return sums, np.bincount(units, minlength=num_units) * per_block


def _sliding_delta(per_length, block_units, num_units, weights, level) -> tuple[list, list]:
    """Change of the sliding loss from the first length, on the blocks both lengths scored (a
    longer length may score only a prefix of the blocks)."""
    deltas, cis = [], []
    base = per_length[0]
    for scores in per_length:
        if (
            scores is None
            or base is None
            or any(s.get("sliding_block_sums") is None for s in (*scores, *base))
        ):
            deltas.append(None)
            cis.append(None)
            continue
        k = min(len(scores[0]["sliding_block_sums"]), len(base[0]["sliding_block_sums"]))
        (a, ca), (b, cb) = (_prefix(x, k, block_units, num_units) for x in (scores, base))
        deltas.append(float(np.mean(a.sum(axis=1) / ca.sum() - b.sum(axis=1) / cb.sum())))
        cis.append(_ci(_replicates(a, ca, weights) - _replicates(b, cb, weights), level))
    return deltas, cis


def summarize_row(
    per_length: Sequence[Sequence[dict] | None],
    weights: np.ndarray,
    *,
    block_units: np.ndarray | None = None,
    level: float = 0.95,
) -> dict[str, list]:
    """Per-length numbers of one row.

    Args:
      per_length: for each length, the `score_lengths` dicts of every seed (None where the model
        cannot read the length).
      weights: int[R, U] from `intervals.bootstrap_weights` (shared by every row).
      block_units: int[Bk], the unit of each sliding block in plan order; with it the sliding
        change from the first length is taken on the blocks both lengths scored.
      level: interval coverage.

    Returns:
      Lists over lengths (None where not defined): `loss`, `loss_ci`, `loss_seeds`, `loss_se`,
      `delta_L` / `delta_L_ci` (change from the first length), `eval_bytes`; `loss_beyond_L`,
      `loss_beyond_L_ci`; `loss_sliding`, `loss_sliding_ci`, `delta_L_sliding`,
      `delta_L_sliding_ci`, `eval_bytes_sliding`.
    """
    plain = _protocol(per_length, "", weights, level)
    beyond = _protocol(per_length, "beyond_", weights, level)
    slide = _protocol(per_length, "sliding_", weights, level)
    if block_units is not None:
        slide["delta"], slide["delta_ci"] = _sliding_delta(
            per_length, np.asarray(block_units), weights.shape[1], weights, level
        )
    return {
        "loss": plain["loss"],
        "loss_ci": plain["ci"],
        "loss_seeds": plain["seeds"],
        "loss_se": plain["se"],
        "delta_L": plain["delta"],
        "delta_L_ci": plain["delta_ci"],
        "eval_bytes": plain["tokens"],
        "loss_beyond_L": beyond["loss"],
        "loss_beyond_L_ci": beyond["ci"],
        "loss_sliding": slide["loss"],
        "loss_sliding_ci": slide["ci"],
        "loss_sliding_seeds": slide["seeds"],
        "delta_L_sliding": slide["delta"],
        "delta_L_sliding_ci": slide["delta_ci"],
        "eval_bytes_sliding": slide["tokens"],
    }


def paired_difference(
    a: Sequence[Sequence[dict] | None],
    b: Sequence[Sequence[dict] | None],
    weights: np.ndarray,
    *,
    key: str = "",
    level: float = 0.95,
) -> dict[str, list]:
    """Row a minus row b per length (same files, seed p of a against seed p of b).

    Args:
      a, b: per length, the seeds' `score_lengths` dicts of each row (equal seed counts).
      key: "" (all positions), "beyond_" or "sliding_".

    Returns:
      {"delta": [float | None], "ci": [[low, high] | None]} over lengths.
    """
    out = {"delta": [], "ci": []}
    for sa, sb in zip(a, b, strict=True):
        stack_a = None if sa is None else _stack(sa, key)
        stack_b = None if sb is None else _stack(sb, key)
        if stack_a is None or stack_b is None or stack_a[0].shape != stack_b[0].shape:
            out["delta"].append(None)
            out["ci"].append(None)
            continue
        delta, ci = intervals.paired_interval(
            stack_a[0], stack_b[0], stack_a[1], weights, level=level
        )
        out["delta"].append(delta)
        out["ci"].append(ci)
    return out


def summarize_curve(curves: Sequence[dict], weights: np.ndarray, *, level: float = 0.95) -> dict:
    """The per-position curve of one row: mean over seeds per bin and its interval.

    Args:
      curves: each seed's `curve` dict ({"edges": int[G + 1], "sum": [U, G], "count": [U, G]}).

    Returns:
      {"position": mean position of each bin, "loss": [G], "ci": [[low, high]] * G}.
    """
    edges = np.asarray(curves[0]["edges"])
    sums = np.stack([np.asarray(c["sum"], np.float64) for c in curves])  # (P, U, G)
    counts = np.asarray(curves[0]["count"], np.float64)  # (U, G)
    loss, ci = [], []
    for g in range(len(edges) - 1):
        point, interval = intervals.ratio_interval(
            sums[:, :, g], counts[:, g], weights, level=level
        )
        loss.append(point)
        ci.append(interval)
    position = [float((a + b - 1) / 2) for a, b in zip(edges[:-1], edges[1:], strict=True)]
    return {"position": position, "loss": loss, "ci": ci}
