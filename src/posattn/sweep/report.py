"""What a sweep leaves behind: metrics lines, `sweep.json` (a record per member), `sweep.md`, plots.

The sweep.json schema is documented in docs/sweeps.md. The table has one row per member; the plot
has one panel per swept key, final training loss (and evaluation loss) against the key's value,
one colour per program (the discrete choices); with `sweep.eval_lengths`, `sweep_lengths.png`
shows each member's loss against the evaluation length.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from posattn.sweep import plan as sweep_plan

__all__ = ["finite", "read_history", "write", "write_step"]


def write(
    workdir: pathlib.Path,
    programs: Sequence[sweep_plan.Program],
    records: list[dict[str, Any]],
    *,
    complete: bool,
    config_path: str | None,
) -> None:
    """Writes sweep.json, sweep.md and sweep.png for the finished members (all, when `complete`)."""
    members = {m.index: m for p in programs for m in p.members}
    records = [
        dict(r, command=members[r["member"]].command(config_path, f"runs/member_{r['member']}"))
        for r in records
    ]
    swept = _swept_keys(programs)
    summary = {
        "config": config_path,
        "complete": complete,
        "num_members": len(members),
        "programs": [
            {
                "program": p.index,
                "set": p.settings,
                "continuous": list(p.swept),
                "members": [m.index for m in p.members],
            }
            for p in programs
        ],
        "swept": swept,
        "members": records,
    }
    (workdir / "sweep.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (workdir / "sweep.md").write_text(_table(records, swept, complete, config_path))
    if records:
        _plot(workdir / "sweep.png", records, swept)
    if any(r.get("loss_at_lengths") for r in records):
        _plot_lengths(workdir / "sweep_lengths.png", records)


def write_step(
    metrics_file, step: int, values: dict, timing: dict, program, diverged: dict, last_loss: list
) -> None:
    """Writes one line per live member for `step` (updating `last_loss` in place); records the
    step at which a member diverged, in `diverged`. `timing` (step time, tokens/s, MFU of the
    whole program) is the same on every member's line."""
    for k, member in enumerate(program.members):
        if member.index in diverged:
            continue
        line = {
            "step": step,
            "member": member.index,
            **{n: finite(v[k]) for n, v in values.items() if n != "alive"},
            **timing,
        }
        if not values["alive"][k]:
            diverged[member.index] = step
            line["diverged"] = True
            last_loss[k] = None
            print(
                f"posattn.sweep: member {member.index} ({member.overrides}) diverged at step "
                f"{step} (loss {float(values['loss'][k])}); it is frozen, the others continue",
                flush=True,
            )
        else:
            last_loss[k] = line["loss"]
        metrics_file.write(line)


def read_history(path: pathlib.Path, program) -> tuple[list, dict[int, int]]:
    """(last training loss per member, {member: step it diverged}) from a resumed metrics file."""
    position = {m.index: k for k, m in enumerate(program.members)}
    last, diverged = [None] * len(position), {}
    if path.exists():
        for text in path.read_text().splitlines():
            line = json.loads(text)
            if "loss" in line and line.get("member") in position:
                last[position[line["member"]]] = line["loss"]
                if line.get("diverged"):
                    diverged[line["member"]] = line["step"]
    return last, diverged


def finite(value) -> float | None:
    value = float(value)
    return value if np.isfinite(value) else None


def _swept_keys(programs) -> list[str]:
    keys = []
    for p in programs:
        for key in (*p.settings, *p.swept):
            if key not in keys:
                keys.append(key)
    return keys


def _fmt(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _table(records, swept, complete: bool, config_path) -> str:
    lengths = next((r["eval_lengths"] for r in records if "eval_lengths" in r), None)
    head = ["member", *swept, "final train loss", "eval loss", "diverged at"]
    head += [f"loss@{n}" for n in lengths or ()]
    lines = [f"# Sweep {config_path or ''}".rstrip(), ""]
    if not complete:
        lines += ["**Incomplete**: rerun the same command to finish the remaining programs.", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        row = [
            r["member"],
            *(r["swept"].get(k) for k in swept),
            r["final_train_loss"],
            r["eval_loss"],
            r["diverged_at_step"],
        ]
        row += list(r.get("loss_at_lengths") or ())
        lines.append("| " + " | ".join(_fmt(v) for v in row) + " |")
    lines += ["", "Rerun one member alone: the `command` of its record in sweep.json.", ""]
    return "\n".join(lines)


def _plot(path: pathlib.Path, records, swept) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    numeric = [
        k
        for k in swept
        if all(
            isinstance(r["swept"].get(k), (int, float)) and not isinstance(r["swept"].get(k), bool)
            for r in records
            if k in r["swept"]
        )
    ]
    panels = numeric or swept[:1]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    programs = sorted({r["program"] for r in records})
    colours = plt.get_cmap("tab10")
    for ax, key in zip(axes[0], panels, strict=True):
        for i, p in enumerate(programs):
            rows = [r for r in records if r["program"] == p and key in r["swept"]]
            if not rows:
                continue
            label = (
                ", ".join(
                    f"{k.split('.')[-1]}={v}"
                    for k, v in rows[0]["swept"].items()
                    if k not in numeric
                )
                or f"program {p}"
            )
            xs = [r["swept"][key] for r in rows]
            ax.scatter(
                xs,
                [_nan(r["final_train_loss"]) for r in rows],
                color=colours(i % 10),
                label=f"{label} (train)",
            )
            ax.scatter(
                xs,
                [_nan(r["eval_loss"]) for r in rows],
                color=colours(i % 10),
                marker="x",
                label=f"{label} (eval)",
            )
        values = [r["swept"][key] for r in records if key in r["swept"]]
        if key in numeric and min(values) > 0 and max(values) / min(values) >= 10:
            ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.set_ylabel("final loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_lengths(path: pathlib.Path, records) -> None:
    """Loss against evaluation length, one line per member (the extrapolation curves)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for r in records:
        label = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in r["swept"].items())
        ax.plot(r["eval_lengths"], [_nan(v) for v in r["loss_at_lengths"]], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _nan(value):
    return math.nan if value is None else value
