"""results.md and the plots, from results.json alone (`write(results, out_dir)`)."""

from __future__ import annotations

import pathlib

import numpy as np

__all__ = ["markdown", "plots", "write"]


def write(results: dict, out_dir: pathlib.Path) -> None:
    """results.md and the PNGs of `results` in `out_dir`."""
    (out_dir / "results.md").write_text(markdown(results))
    plots(results, out_dir)


def _table(title: str, lengths, rows: dict[str, list], fmt: str) -> list[str]:
    lines = [
        f"### {title}",
        "",
        "| row | " + " | ".join(str(x) for x in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for name, values in rows.items():
        lines.append(
            f"| {name} | "
            + " | ".join("null" if v is None else format(v, fmt) for v in values)
            + " |"
        )
    return lines + [""]


def _cell(value, ci=None, fmt=".4f", se=None) -> str:
    if value is None:
        return "null"
    text = format(value, fmt) + ("" if se is None else f" ± {se:.4f}")
    return text if ci is None else f"{text} [{ci[0]:{fmt}}, {ci[1]:{fmt}}]"


def _ci_table(title: str, lengths, rows: dict[str, tuple[list, list]], fmt=".4f") -> list[str]:
    """A table of value [± seed standard error] [low, high] per length (rows: name -> (values,
    intervals[, standard errors]))."""
    lines = [
        f"### {title}",
        "",
        "| row | " + " | ".join(str(x) for x in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for name, (values, cis, *ses) in rows.items():
        cis = cis or [None] * len(values)
        ses = (ses[0] if ses else None) or [None] * len(values)
        cells = [_cell(v, c, fmt, e) for v, c, e in zip(values, cis, ses, strict=True)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + [""]


def _seed_note(fams: dict) -> str:
    seeds = {len(s) for f in fams.values() for s in f.get("loss_seeds", []) if s}
    if seeds == {1}:
        return "One training seed per row: no seed interval (the bracket is over text only)."
    return (
        f"{'/'.join(str(x) for x in sorted(seeds))} training seeds per row: each loss is the "
        "mean over seeds ± its standard error over seeds, then the interval over text; paired "
        "differences pair seed k of one row with seed k of the other; `loss_seeds` in "
        "results.json."
    )


def markdown(results: dict) -> str:
    """results.md: loss with intervals under both protocols, positions >= L, paired differences,
    the probes, training and provenance."""
    fams, lengths = results["families"], next(iter(results["families"].values()))["eval_len"]
    prov, L, ev = results["provenance"], results["train_len"], results["evaluation"]

    def per_length(key):  # the first row that reads each length
        return [
            next((f[key][i] for f in fams.values() if f.get(key) and f[key][i] is not None), None)
            for i in range(len(lengths))
        ]

    scored, sliding = per_length("eval_bytes"), per_length("eval_bytes_sliding")
    out = [
        f"# Length extrapolation: trained at L = {L}, corpus {results['corpus']}",
        "",
        f"Commit {prov['commit']}"
        f"{' (with uncommitted changes)' if prov['uncommitted_changes'] else ''}, "
        f"{prov['date']}, {prov['machine']}, {prov['cpu_count']} CPUs, "
        f"{', '.join(prov['devices'])}; "
        f"total {results['timing']['total_seconds']:.0f} s.",
        "",
        f"Loss: mean next-token cross-entropy, {results['loss_unit']}; `null`: the model cannot "
        f"read that length (learned table). Text: {ev['chunks']} chunks of {lengths[-1]} tokens "
        f"from {ev['units_scored']} of the {ev['units']} held-out units ({ev['unit']}), the same "
        f"tokens at every length; scored tokens per length {scored}. Brackets: 95% intervals, "
        f"bootstrap over units ({ev['bootstrap']['replicates']} replicates). {_seed_note(fams)}",
        "",
        corpus_sentence(results),
        "",
    ]
    out += _other_code_lines(results)
    out += _ci_table(
        "Loss (nats), non-overlapping windows (every position of a window read from scratch)",
        lengths,
        {n: (f["loss"], f.get("loss_ci"), f.get("loss_se")) for n, f in fams.items()},
    )
    out += _ci_table(
        "Change from L (paired: same units, same replicates)",
        lengths,
        {n: (f["delta_L"], f["delta_L_ci"]) for n, f in fams.items() if "delta_L" in f},
        "+.4f",
    )
    out += _ci_table(
        "Change from L, sliding windows (paired on the blocks both lengths scored)",
        lengths,
        {
            n: (f["delta_L_sliding"], f["delta_L_sliding_ci"])
            for n, f in fams.items()
            if "delta_L" in f
        },
        "+.4f",
    )
    out += _ci_table(
        f"Loss over positions >= L = {L} only (non-overlapping windows)",
        lengths,
        {
            n: (f["loss_beyond_L"], f["loss_beyond_L_ci"])
            for n, f in fams.items()
            if "loss_beyond_L" in f
        },
    )
    if any(v is not None for f in fams.values() for v in f.get("loss_sliding", [])):
        out += _ci_table(
            f"Loss, sliding windows (stride {ev['sliding_stride']}: each scored token has "
            f"T - {ev['sliding_stride']} .. T - 1 tokens of context; at most "
            f"{ev['sliding_max_tokens'] or 'all'} tokens read a length, so a long length scores "
            "the "
            f"first of the {ev['sliding_blocks']} blocks from {ev['units_scored_sliding']} units; "
            f"scored tokens per length {sliding}; changes between lengths are paired on the "
            "blocks both scored)",
            lengths,
            {n: (f["loss_sliding"], f["loss_sliding_ci"]) for n, f in fams.items()},
        )
    paired = ev["paired"]
    if paired["reference"]:
        out += _ci_table(
            f"Paired difference from {paired['reference']} (non-overlapping; negative: lower loss)",
            lengths,
            {n: (d["all"]["delta"], d["all"]["ci"]) for n, d in paired["minus_reference"].items()},
            "+.4f",
        )
    if results["passkey"]:
        pk = results["passkey"]

        def mean(grid):
            return [None if any(x is None for x in r) else float(np.mean(r)) for r in grid]

        out += _table(
            f"Passkey exact match ({pk['digits']} digits, distractors {pk['distractors']}, "
            f"mean over depths {pk['depths']}, {pk['samples']} samples a cell)",
            lengths,
            {n: f["passkey_acc"] for n, f in fams.items()},
            ".2f",
        )
        out += _table(
            f"Passkey loss per digit (nats; chance ln 10 = {pk['chance_loss']:.2f})",
            lengths,
            {n: mean(g) for n, g in pk["loss"].items()},
            ".3f",
        )
    if results["induction"]:
        ind = results["induction"]
        for at in sorted({0, len(lengths) - 1}):
            out += _table(
                f"Induction loss per letter (nats; chance ln 26 = {ind['chance_loss']:.2f}) at "
                f"length {lengths[at]}, by gap (bytes between the copies; {ind['span']} letters, "
                f"{ind['samples']} samples a cell)",
                ind["gaps"],
                {n: g[at] for n, g in ind["loss"].items()},
                ".3f",
            )
    if results["copy_acc"]:
        out += _table(
            "Copy accuracy (repeated random-letter segment)", lengths, results["copy_acc"], ".2f"
        )
    out += _attention_table(results, lengths)
    out += [
        "### Training",
        "",
        "Train loss: the last step's batch (passkey rows included).",
        "",
        "| family | steps | train loss | seconds |",
        "|---|---:|---:|---:|",
    ]
    out += [
        f"| {n} | {t['steps']} | {t['final_train_loss']:.4f} | {t['seconds']} |"
        for n, t in results["training"].items()
        if n != "finetune"
    ]
    tuned = results["training"].get("finetune")
    if tuned:
        out += [
            "",
            "Position-interpolation fine-tunes (rows `<entry>+<kind>+ft`): a trained RoPE model at "
            "multiple x L under the scaling of factor = multiple, which the rows keep at every "
            "length; train loss: the last step's batch (mean over seeds).",
            "",
            "| row | steps | length | train loss | seconds |",
            "|---|---:|---:|---:|---:|",
        ]
        out += [
            f"| {t.get('row', kind)} | {t['steps']} | {t['multiple'] * L} | "
            f"{t['final_train_loss']:.4f} | {t['seconds']} |"
            for kind, t in tuned.items()
        ]
    return "\n".join(out) + "\n"


def _attention_table(results: dict, lengths) -> list[str]:
    """Per row and layer, at L and at the longest length: attention entropy, mean attended
    distance (means over heads) and the mass on keys >= L away (mean over heads, and its largest
    head)."""
    block = results.get("attention_stats")
    if not block:
        return []
    first, last = lengths[0], lengths[-1]
    out = [
        f"### Attention per layer at {first} and {last} (the last min(T, L) queries of "
        f"{block['windows']} windows; means over heads, the largest head in brackets)",
        "",
        f"| row | layer | entropy {first} | entropy {last} | distance {first} | "
        f"distance {last} | mass >= L at {last} |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, per_length in block["rows"].items():
        if not per_length or per_length[0] is None or per_length[-1] is None:
            continue
        at_first, at_last = per_length[0], per_length[-1]
        for layer in range(len(at_last["entropy"])):

            def mean(stats, key, layer=layer):
                return float(np.mean(stats[key][layer]))

            mass = at_last["mass_beyond_L"][layer]
            out.append(
                f"| {name} | {layer} | {mean(at_first, 'entropy'):.2f} | "
                f"{mean(at_last, 'entropy'):.2f} | {mean(at_first, 'distance'):.1f} | "
                f"{mean(at_last, 'distance'):.1f} | {float(np.mean(mass)):.2f} "
                f"[{float(np.max(mass)):.2f}] |"
            )
    return out + [""]


def corpus_sentence(results: dict) -> str:
    """Which corpus the numbers compare with (its content hash; for `stdlib`, the Python too)."""
    sha = results.get("corpus_sha256") or "unknown"
    python = results.get("python_version") or results["provenance"].get("python")
    where = (
        f", the standard library of Python {python}: another Python version is another corpus"
        if results["corpus"] == "stdlib"
        else ""
    )
    return (
        f"Corpus `{results['corpus']}` (sha256 `{sha[:16]}`{where}). These numbers compare only "
        "with results whose corpus has this hash."
    )


def _other_code_lines(results: dict) -> list[str]:
    """A note naming the rows trained or evaluated by other code than this run's (--reuse)."""
    mine = results["provenance"].get("code_sha256")
    lines = []
    for name, origin in (results.get("row_provenance") or {}).items():
        for stage in ("trained", "evaluated"):
            who = origin.get(stage) or {}
            if who.get("code_sha256") != mine:
                commit = str(who.get("commit"))[:12] if who else "unrecorded"
                clean = "" if who.get("clean", True) else " with uncommitted changes"
                lines.append(f"- `{name}` {stage} by commit {commit}{clean} (reused)")
    if not lines:
        return []
    return ["Rows produced by other code than this run's:", "", *lines, ""]


def plots(results: dict, workdir: pathlib.Path) -> None:
    """loss_vs_length.png (three panels: non-overlapping, positions >= L, sliding; 95%
    intervals), per_position.png (with interval bands), passkey_heatmap.png, induction.png,
    attention_stats.png (and copy_vs_length.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L, fams = results["train_len"], results["families"]
    lengths = next(iter(fams.values()))["eval_len"]
    # A fine-tuned row <entry>+<kind>+ft takes the colour of its eval-time row <entry>+<kind>.
    base = {
        n: n[: -len("+ft")] if n.endswith("+ft") and n[: -len("+ft")] in fams else n for n in fams
    }
    palette = list(dict.fromkeys(base.values()))
    colors = {name: plt.cm.tab20(palette.index(base[name]) % 20) for name in fams}

    def style(name):
        if name.endswith("+ft"):  # fine-tuned: dash-dot, square markers
            return dict(ls="-.", marker="s", ms=3, color=colors[name])
        return dict(ls="--" if "+" in name else "-", marker="o", ms=3, color=colors[name])

    finite = [v for f in fams.values() for v in f["loss"][:1] if v is not None]
    top = 2.5 * max(finite) if finite else None

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), sharey=True)
    panels = (
        ("loss", "loss_ci", "non-overlapping windows"),
        ("loss_beyond_L", "loss_beyond_L_ci", f"positions >= L = {L} only"),
        ("loss_sliding", "loss_sliding_ci", "sliding windows"),
    )
    for ax, (key, ci_key, title) in zip(axes, panels, strict=True):
        for name, f in fams.items():
            pts = [
                (x, y, c)
                for x, y, c in zip(f["eval_len"], f[key], f[ci_key], strict=True)
                if y is not None
            ]
            if not pts:
                continue
            xs, ys, cis = zip(*pts, strict=True)
            ax.errorbar(
                xs,
                ys,
                yerr=[
                    [y - c[0] for y, c in zip(ys, cis, strict=True)],
                    [c[1] - y for y, c in zip(ys, cis, strict=True)],
                ],
                label=name,
                capsize=2,
                **style(name),
            )
        ax.set(xscale="log", xlabel="eval length (tokens)", title=title, ylim=(None, top))
        ax.set_xticks(lengths, [str(x) for x in lengths])
        ax.set_xticks([], minor=True)
        ax.axvline(L, color="gray", lw=0.8)
    axes[0].set_ylabel(f"loss ({results['loss_unit']}), 95% interval")
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"Held-out loss vs length, trained at L = {L}")
    fig.tight_layout(), fig.savefig(workdir / "loss_vs_length.png", dpi=120), plt.close(fig)

    pp = results["per_position"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, c in pp["curves"].items():
        x = np.add(c["position"], 1)
        ax.plot(x, c["loss"], label=name, **style(name))
        lo, hi = zip(*c["ci"], strict=True)
        ax.fill_between(x, lo, hi, color=colors[name], alpha=0.15, lw=0)
    ax.set(
        xscale="log",
        xlabel="tokens of context (position + 1; log-spaced bins)",
        ylabel="mean loss in bin (95% interval)",
        ylim=(None, top),
        title=f"Per-position loss, windows of {pp['eval_len']} (L = {L})",
    )
    ax.axvline(L, color="gray", lw=0.8)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout(), fig.savefig(workdir / "per_position.png", dpi=120), plt.close(fig)

    if results["induction"]:
        ind = results["induction"]
        fig, axes = plt.subplots(
            1, len(lengths), figsize=(3.2 * len(lengths), 3.6), sharey=True, squeeze=False
        )
        for a, (ax, length) in enumerate(zip(axes[0], lengths, strict=True)):
            for name, grid in ind["loss"].items():
                pts = [
                    (g + 1, y) for g, y in zip(ind["gaps"], grid[a], strict=True) if y is not None
                ]
                if pts:
                    ax.plot(*zip(*pts, strict=True), label=name, **style(name))
            ax.axhline(ind["chance_loss"], color="gray", lw=0.8, ls=":")
            ax.axvline(L + 1, color="gray", lw=0.8)
            ax.set(xscale="log", xlabel="gap + 1 (bytes)", title=f"length {length}")
        axes[0, 0].set_ylabel("loss on the repeat (nats/letter)")
        axes[0, -1].legend(fontsize=6, ncol=2)
        fig.suptitle(
            f"Induction: random {ind['span']}-letter string repeated after a gap (L = {L})"
        )
        fig.tight_layout(), fig.savefig(workdir / "induction.png", dpi=120), plt.close(fig)

    if results["attention_stats"]:
        attention_figure(results, workdir / "attention_stats.png", style)

    if results["passkey"]:
        grids = results["passkey"]["acc"]
        cols = 5
        fig, axes = plt.subplots(
            -(-len(grids) // cols),
            cols,
            figsize=(2.8 * cols, 2.6 * -(-len(grids) // cols)),
            squeeze=False,
            layout="constrained",
        )
        # More axes than grids: the spare ones are turned off below.
        for ax, (name, grid) in zip(axes.flat, grids.items(), strict=False):
            img = np.array(
                [[np.nan if v is None else v for v in row] for row in grid]
            ).T  # (depths, lengths)
            im = ax.imshow(img, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
            ax.set_title(name, fontsize=8)
            ax.set_xticks(range(len(lengths)), [str(x) for x in lengths], fontsize=6)
            ax.set_yticks(
                range(len(results["passkey"]["depths"])), results["passkey"]["depths"], fontsize=6
            )
        for ax in axes.flat[len(grids) :]:
            ax.axis("off")
        fig.colorbar(im, ax=axes, shrink=0.6, label="exact-match accuracy")
        fig.suptitle(f"Passkey: length (x) by depth (y), trained at L = {L}")
        fig.savefig(workdir / "passkey_heatmap.png", dpi=120), plt.close(fig)

    if results["copy_acc"]:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, acc in results["copy_acc"].items():
            pts = [(x, y) for x, y in zip(lengths, acc, strict=True) if y is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=name, **style(name))
        ax.set(
            xscale="log",
            xlabel="eval length",
            ylabel="copy accuracy",
            ylim=(0, 1),
            title=f"Copy task vs length, trained at L = {L}",
        )
        ax.set_xticks(lengths, [str(x) for x in lengths])
        ax.axvline(L, color="gray", lw=0.8)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout(), fig.savefig(workdir / "copy_vs_length.png", dpi=120), plt.close(fig)


def attention_figure(results: dict, path: pathlib.Path, style) -> None:
    """attention_stats.png: entropy, mean distance and mass beyond L (mean over heads) vs length,
    one column per layer."""
    import matplotlib.pyplot as plt

    block, L = results["attention_stats"], results["train_len"]
    lengths = next(iter(results["families"].values()))["eval_len"]
    first = next(s for r in block["rows"].values() for s in r if s is not None)
    layers_ = len(first["entropy"])
    names = (
        ("entropy", "entropy (nats)"),
        ("distance", "mean distance (tokens)"),
        ("mass_beyond_L", f"mass on keys >= {L} away"),
    )
    fig, axes = plt.subplots(3, layers_, figsize=(4.5 * layers_, 9), squeeze=False, sharex=True)
    for m, (key, label) in enumerate(names):
        for layer in range(layers_):
            ax = axes[m, layer]
            for name, per_length in block["rows"].items():
                pts = [
                    (x, float(np.mean(s[key][layer])))
                    for x, s in zip(lengths, per_length, strict=True)
                    if s is not None
                ]
                if pts:
                    ax.plot(*zip(*pts, strict=True), label=name, **style(name))
            ax.set(xscale="log", ylabel=label if layer == 0 else None)
            ax.axvline(L, color="gray", lw=0.8)
            if m == 0:
                ax.set_title(f"layer {layer} (mean over heads)")
            ax.set_xticks(lengths, [str(x) for x in lengths])
            ax.set_xticks([], minor=True)
            if m == 2:
                ax.set_xlabel("eval length")
    axes[0, -1].legend(fontsize=6, ncol=2)
    fig.suptitle(f"Attention per layer, last min(T, L) queries of {block['windows']} windows")
    fig.tight_layout(), fig.savefig(path, dpi=110), plt.close(fig)
