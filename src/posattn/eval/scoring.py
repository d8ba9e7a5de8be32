"""Loss at every length under both protocols, as per-unit sums an interval can be drawn from.

Shape legend: U units (held-out files), W windows, T window length, G curve bins.

`score_lengths` runs a model over an `EvalPlan` (`posattn.eval.heldout`) and returns, per length,
the summed NLL and the token count of every unit for:

* the non-overlapping protocol over all positions (`sum`, `count`), and over positions >= L
  alone (`beyond_sum`, `beyond_count`; None at T <= L): the latter separates extrapolation from
  the early-token effect (the mean over a window of T improves with T merely because the
  low-context positions become a smaller share of it);
* the sliding protocol (`sliding_sum`, `sliding_count`, and per block `sliding_block_sums`):
  every scored token has T - stride .. T - 1 tokens of context, so a family that uses more
  context improves with T and one that only tolerates it stays level; at most
  `sliding_max_tokens // T` windows a length (the first blocks of the plan's list);
* at the longest length, the per-position curve in log-spaced bins (`curve`: sums and counts per
  unit and bin), so that each bin gets an interval too.

Means, intervals and differences are computed from these sums (`posattn.eval.intervals`), so
that rows of one experiment share the resampling and seeds can be averaged before it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flax import nnx

from posattn.eval import lengths as lengths_lib
from posattn.eval.heldout import EvalPlan, EvalText

__all__ = ["curve_edges", "loss_evaluator", "score_lengths", "to_json", "windows_per_pass"]


def windows_per_pass(length: int, batch_tokens: int) -> int:
    """Windows of `length` tokens per forward pass for about `batch_tokens` tokens (at least 1)."""
    return max(1, batch_tokens // length)


def curve_edges(length: int, bins: int) -> np.ndarray:
    """Edges int[G + 1] of about `bins` log-spaced runs of positions 0..length-1 (each run as
    wide as the ones before it, so late positions average many predictions)."""
    return np.unique(np.geomspace(1, length + 1, bins + 1).astype(int)) - 1


def _nll(graphdef, params, constants, windows: np.ndarray, batch_tokens: int) -> np.ndarray:
    """NLL float64[W, T] of windows int32[W, T + 1]."""
    batch = windows_per_pass(windows.shape[1] - 1, batch_tokens)
    parts = [nll for nll, _ in lengths_lib.forward(graphdef, params, constants, windows, batch)]
    return np.concatenate(parts)


def _by_unit(values: np.ndarray, units: np.ndarray, num_units: int) -> np.ndarray:
    """Sums of values[W, ...] per unit: float64[U, ...]."""
    out = np.zeros((num_units, *values.shape[1:]))
    np.add.at(out, units, values)
    return out


def score_lengths(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    constants: nnx.State,
    tokens: np.ndarray,
    plan: EvalPlan,
    *,
    lengths: Sequence[int],
    train_len: int,
    batch_tokens: int,
    curve_bins: int,
    curve_length: int | None = None,
    sliding_max_tokens: int = 0,
) -> list[dict | None]:
    """Per-unit NLL sums of one model at each length (None where it cannot read the length).

    Args:
      graphdef, params, constants: the split model (a causal LM).
      tokens: the held-out tokens the plan indexes.
      plan: the chunks and blocks to score (`posattn.eval.heldout.make_plan`).
      lengths: eval lengths, each <= plan.max_len.
      train_len: L; positions >= L are the ones no training window had.
      batch_tokens: tokens per forward pass (windows per pass = batch_tokens // T).
      curve_bins: bins of the per-position curve.
      curve_length: the length whose per-position curve is kept (default: the longest of
        `lengths`).
      sliding_max_tokens: tokens read per length by the sliding protocol (windows x T; at
        least one window); 0 reads every block at every length.

    Returns:
      One dict per length with float64[U] arrays `sum`, `count`, `beyond_sum`, `beyond_count`
      (None when T <= L), `sliding_sum`, `sliding_count`, `sliding_block_sums` (float64[k], the
      first k blocks in plan order; None without sliding blocks), and at
      `curve_length` `curve` = {"edges": int[G + 1], "sum": [U, G], "count": [U, G]}.
    """
    cfg = lengths_lib.model_config_of(graphdef, params, constants)
    U, out = plan.num_units, []
    curve_length = max(int(x) for x in lengths) if curve_length is None else int(curve_length)
    for length in lengths:
        length = int(length)
        if not lengths_lib.can_read(cfg, length):
            out.append(None)
            continue
        windows, units = plan.windows(tokens, length)
        nll = _nll(graphdef, params, constants, windows, batch_tokens)  # (W, T)
        ones = np.full(len(units), float(length))
        row = {"sum": _by_unit(nll.sum(axis=1), units, U), "count": _by_unit(ones, units, U)}
        if length > train_len:
            beyond = nll[:, train_len:]
            row["beyond_sum"] = _by_unit(beyond.sum(axis=1), units, U)
            row["beyond_count"] = _by_unit(np.full(len(units), float(beyond.shape[1])), units, U)
        else:
            row["beyond_sum"] = row["beyond_count"] = None
        if length == curve_length:
            edges = curve_edges(length, curve_bins)
            binned = np.add.reduceat(nll, edges[:-1], axis=1)  # (W, G)
            widths = np.diff(edges).astype(np.float64)
            row["curve"] = {
                "edges": edges,
                "sum": _by_unit(binned, units, U),
                "count": _by_unit(np.broadcast_to(widths, binned.shape), units, U),
            }
        if plan.block_ends.size:
            cap = max(1, sliding_max_tokens // length) if sliding_max_tokens else None
            slide, s_units, scored = plan.sliding(tokens, length, cap)
            s_nll = _nll(graphdef, params, constants, slide, batch_tokens)[:, -scored:]
            row["sliding_block_sums"] = s_nll.sum(axis=1)  # (k,)
            row["sliding_sum"] = _by_unit(row["sliding_block_sums"], s_units, U)
            row["sliding_count"] = _by_unit(np.full(len(s_units), float(scored)), s_units, U)
        else:
            row["sliding_sum"] = row["sliding_count"] = row["sliding_block_sums"] = None
        out.append(row)
    return out


def to_json(value: Any) -> Any:
    """`value` with NumPy arrays and scalars turned into lists and Python numbers (recursively)."""
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def loss_evaluator(model, text: EvalText, length: int, settings: Mapping[str, Any]) -> dict | None:
    """The "loss" evaluator (`posattn.eval.registry`): the per-unit sums of `score_lengths` at one
    length (both protocols; the per-position `curve` at the longest of `settings["lengths"]`), or
    None where the model cannot read `length`. Settings: `per_position_bins`,
    `sliding_max_tokens` and the shared `train_len`, `lengths`, `batch_tokens`."""
    (row,) = score_lengths(
        *model,
        text.val,
        text.plan,
        lengths=[int(length)],
        train_len=int(settings["train_len"]),
        batch_tokens=int(settings["batch_tokens"]),
        curve_bins=int(settings["per_position_bins"]),
        curve_length=max(int(x) for x in settings["lengths"]),
        sliding_max_tokens=int(settings["sliding_max_tokens"]),
    )
    return None if row is None else to_json(row)
