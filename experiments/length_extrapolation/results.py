"""results.json from the rows' evaluator outputs: the per-length statistics with intervals (the
one loss protocol's summary, `posattn.eval.summary`), the probe and attention blocks, training and
provenance.

The keys are the documented ones (experiments/README.md); an evaluator this module does not know
(`KNOWN`) is reported under `evaluators.<name>.<row>` as its output combined over seeds, one value
per length.
"""

from __future__ import annotations

import platform
from typing import Any

import numpy as np

from posattn.eval import heldout, intervals, registry, summary

from .settings import induction_gaps

__all__ = [
    "KNOWN",
    "assemble",
    "describe_row",
    "fmt_list",
    "mean_over_seeds",
    "se_over_seeds",
    "passkey_by_length",
    "plain_losses",
]

# Evaluators whose outputs have blocks of their own in results.json.
KNOWN = ("loss", "attention", "passkey", "induction", "copy")


def mean_over_seeds(values: list) -> Any:
    """The elementwise mean of JSON values of one structure, one per seed (None where any seed
    has None; strings and booleans from the first seed)."""
    first = values[0]
    if isinstance(first, dict):
        return {k: mean_over_seeds([v[k] for v in values]) for k in first}
    if isinstance(first, list):
        return [mean_over_seeds(list(x)) for x in zip(*values, strict=True)]
    if any(v is None for v in values):
        return None
    if isinstance(first, bool) or not isinstance(first, int | float):
        return first
    return float(np.mean(values))


def se_over_seeds(values: list) -> Any:
    """The elementwise standard error over seeds (sample standard deviation / sqrt(seeds)) of
    nested lists of numbers, one per seed (None where any seed has None)."""
    first = values[0]
    if isinstance(first, list):
        return [se_over_seeds(list(x)) for x in zip(*values, strict=True)]
    if any(v is None for v in values):
        return None
    return float(np.std(values, ddof=1) / np.sqrt(len(values)))


def _legacy_row(out: dict) -> dict:
    """One row's evaluator outputs as the blocks below read them: `scores` (first seed, per
    length), `seed_scores`, `curve`, `seed_curves`, `passkey` / `induction` grids
    [length][cell], `passkey_grid`, `attention` and `copy_acc` per length."""
    row: dict[str, Any] = {}
    if "loss" in out:
        seed_scores, seed_curves = [], []
        for per_length in out["loss"]:
            scores, curve = [], None
            for s in per_length:
                if s is None:
                    scores.append(None)
                    continue
                s = dict(s)
                c = s.pop("curve", None)
                curve = c if c is not None else curve
                scores.append(s)
            seed_scores.append(scores)
            seed_curves.append(curve)
        row["scores"], row["curve"] = seed_scores[0], seed_curves[0]
        if len(seed_scores) > 1:
            row["seed_scores"] = seed_scores
            row["seed_curves"] = seed_curves if seed_curves[0] else None
    for name in ("passkey", "induction"):
        if name in out:
            per_length = out[name]
            row[name] = {k: [cells[k] for cells in per_length] for k in per_length[0]}
    if "passkey" in row:
        row["passkey_grid"] = row["passkey"]["acc"]
    if "attention" in out:
        row["attention"] = out["attention"]
    if "copy" in out:
        row["copy_acc"] = out["copy"]
    return row


def assemble(
    config,
    corpus,
    lengths,
    text,
    outputs,
    training,
    *,
    timing,
    provenance,
    origins,
    probe_seeds=None,
) -> dict[str, Any]:
    """results.json from {row: {evaluator: combined output}}; `probe_seeds` ({row: {"passkey" |
    "induction": [one output per seed]}}, rows of two or more seeds) adds each seed's probe
    losses and their standard error over seeds."""
    rows = {name: _legacy_row(out) for name, out in outputs.items()}
    for name, by_probe in (probe_seeds or {}).items():
        for probe, per_seed in by_probe.items():
            rows[name][f"{probe}_seeds"] = [_legacy_row({probe: o})[probe] for o in per_seed]
    found = _assemble(config, corpus, lengths, rows, training, timing, provenance, origins)
    blocks, stats = evaluation_blocks(config, text, lengths, rows)
    found.update(blocks)
    for name, row_stats in stats.items():  # loss (mean over seeds), loss_ci, loss_seeds, ...
        found["families"][name].update(row_stats)
    others = {
        e: {name: out[e] for name, out in outputs.items() if e in out}
        for e in dict.fromkeys(k for out in outputs.values() for k in out)
        if e not in KNOWN
    }
    if others:
        found["evaluators"] = others
    return found


def describe_row(out: dict) -> str:
    """One line for the log: the loss per length (the mean over seeds, as results.json's `loss`;
    sliding) and the passkey."""
    row = _legacy_row(out)
    if "scores" not in row:
        return "no loss evaluated"
    seeds = [{"scores": s} for s in row.get("seed_scores") or [row["scores"]]]

    def mean(key: str = "") -> list[float | None]:
        per_length = zip(*(plain_losses(s, key) for s in seeds), strict=True)
        return [None if None in v else float(np.mean(v)) for v in per_length]

    loss = "loss" if len(seeds) == 1 else f"loss over {len(seeds)} seeds"
    text = f"{loss} {fmt_list(mean())} (sliding {fmt_list(mean('sliding_'))})"
    if "passkey_grid" in row:
        text += f", passkey {fmt_list(passkey_by_length(row))}"
    return text


def _assemble(config, corpus, lengths, rows, training, timing, provenance, origins) -> dict:
    fams = {name: {"eval_len": lengths, "loss": plain_losses(row)} for name, row in rows.items()}
    for name, row in rows.items():
        fams[name]["passkey_acc"] = passkey_by_length(row) if "passkey_grid" in row else None
    return {
        "train_len": int(config.data.seq_len),
        "corpus": corpus.name,
        "families": fams,
        # Extra keys (the three above are the contract; readers ignore the others).
        "corpus_sha256": corpus.sha256,
        "loss_unit": "nats per token (byte)" if corpus.val.dtype == np.uint8 else "nats per token",
        "copy_acc": {n: r["copy_acc"] for n, r in rows.items() if "copy_acc" in r} or None,
        "training": {
            n: {k: v for k, v in t.items() if k not in ("config", "code")}
            for n, t in training.items()
        },
        "timing": timing,
        "config": config.to_dict(),
        "provenance": provenance,
        # Who produced each row: with --reuse, rows trained or evaluated by other code keep
        # their own commit and code hash here (the top-level provenance is this run's).
        "row_provenance": origins or {},
        "python_version": platform.python_version(),
    }


def plain_losses(row: dict, key: str = "") -> list[float | None]:
    """One seed's mean loss per length from a row's per-unit sums (no interval)."""
    return [
        None
        if s is None or s.get(f"{key}sum") is None
        else float(np.sum(s[f"{key}sum"]) / np.sum(s[f"{key}count"]))
        for s in row["scores"]
    ]


def _seeds_of(row: dict) -> list[list[dict] | None]:
    """Per length, the score dicts of every seed (`seed_scores` when several were trained)."""
    per_seed = row.get("seed_scores") or [row["scores"]]
    return [
        None if any(seed[i] is None for seed in per_seed) else [seed[i] for seed in per_seed]
        for i in range(len(per_seed[0]))
    ]


def evaluation_blocks(config, text: heldout.EvalText, lengths, rows: dict[str, dict]):
    """The top-level evaluation, per-position, probe and attention blocks of results.json, and
    each row's per-length statistics with intervals (from the rows' per-unit sums).

    Returns:
      (blocks, {row name: `summary.summarize_row` lists}).
    """
    ev = config.eval
    weights = intervals.bootstrap_weights(
        text.plan.num_units, replicates=int(ev.bootstrap), seed=int(ev.seed)
    )
    stats = {
        name: summary.summarize_row(_seeds_of(row), weights, block_units=text.plan.block_units)
        for name, row in rows.items()
    }
    reference = ev.reference if ev.reference in rows else None
    paired = {}
    if reference:
        for name, row in rows.items():
            if name != reference:
                paired[name] = {
                    key or "all": summary.paired_difference(
                        _seeds_of(row), _seeds_of(rows[reference]), weights, key=key
                    )
                    for key in ("", "beyond_", "sliding_")
                }
    L = int(config.data.seq_len)
    out = {
        "evaluation": {
            "protocols": {
                "non_overlapping": "windows of T read from scratch, every position scored",
                "beyond_L": "the same windows, positions >= L only",
                "sliding": f"windows of T ending at each block, the last {ev.sliding_stride} "
                "positions scored",
            },
            "unit": text.unit,
            "units": text.plan.num_units,
            "units_scored": int(np.unique(text.plan.chunk_units).size),
            "units_scored_sliding": int(np.unique(text.plan.block_units).size),
            "chunks": int(text.plan.chunk_starts.size),
            "sliding_blocks": int(text.plan.block_ends.size),
            "sliding_stride": int(ev.sliding_stride),
            "sliding_max_tokens": int(ev.sliding_max_tokens),
            "bootstrap": {"replicates": int(ev.bootstrap), "level": 0.95, "blocked_by": text.unit},
            "plan": text.plan.fingerprint,
            "paired": {"reference": reference, "minus_reference": paired},
        },
        "per_position": {
            "eval_len": lengths[-1],
            "bins": ev.per_position_bins,
            "curves": {
                n: summary.summarize_curve(r.get("seed_curves") or [r["curve"]], weights)
                for n, r in rows.items()
                if r.get("curve")
            },
        },
        "passkey": None,
        "induction": None,
        "attention_stats": None,
    }
    if config.passkey.enabled:
        out["passkey"] = {
            "depths": list(config.passkey.depths),
            "digits": config.passkey.digits,
            "distractors": bool(config.passkey.distractors),
            "samples": config.passkey.samples,
            "chance_loss": float(np.log(10)),
            **{
                key: {n: r["passkey"].get(key) for n, r in rows.items() if "passkey" in r}
                for key in ("acc", "digit_acc", "loss", "se")  # no "se": evaluated before it
            },
            **_seed_blocks(rows, "passkey", ("acc", "loss")),
        }
    if config.induction.enabled:
        out["induction"] = {
            "gaps": induction_gaps(config),
            "span": config.induction.span,
            "samples": config.induction.samples,
            "chance_loss": float(np.log(26)),
            **{
                key: {n: r["induction"][key] for n, r in rows.items() if "induction" in r}
                for key in ("loss", "acc", "se")
            },
            **_seed_blocks(rows, "induction", ("loss",)),
        }
    if ev.attention_windows:
        out["attention_stats"] = {
            "windows": int(ev.attention_windows),
            "queries": f"the last min(T, {L}) of each window",
            "beyond": f"keys at distance >= {L}",
            "rows": {n: r["attention"] for n, r in rows.items() if "attention" in r},
        }
        scored = [r["attention"][0] for r in rows.values() if r.get("attention")]
        if any(at_L and "induction" in at_L for at_L in scored):  # the evaluator scored heads
            strings = registry.settings_of(registry.get("attention"), config)["head_strings"]
            out["attention_stats"]["heads"] = (
                f"at {L} only, on {strings} random strings of {L // 2} tokens written twice: "
                "previous_token, the weight on the previous token; induction, the weight on the "
                "token after the query's earlier occurrence (Olsson et al. 2022)"
            )
    return out, stats


def _seed_blocks(rows: dict, probe: str, keys: tuple[str, ...]) -> dict:
    """`<key>_seeds` ({row: [seed][length][cell]}) and `loss_seed_se` ({row: [length][cell]})
    for the rows of several seeds (no keys when no row has them)."""
    have = {n: r[f"{probe}_seeds"] for n, r in rows.items() if len(r.get(f"{probe}_seeds", [])) > 1}
    if not have:
        return {}
    out = {f"{key}_seeds": {n: [s[key] for s in per] for n, per in have.items()} for key in keys}
    out["loss_seed_se"] = {n: se_over_seeds(v) for n, v in out["loss_seeds"].items()}
    return out


def passkey_by_length(row: dict) -> list[float | None]:
    """Passkey accuracy per length, averaged over depths (None where the model cannot run)."""
    return [
        None if any(x is None for x in cells) else float(np.mean(cells))
        for cells in row["passkey_grid"]
    ]


def fmt_list(values) -> str:
    return "[" + ", ".join("-" if v is None else f"{v:.3f}" for v in values) + "]"
