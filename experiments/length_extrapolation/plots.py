"""The experiment's figures, from results.json alone (`plots(results, out_dir)`).

Readable as a paper's figures: one hue per family (a RoPE scaling kind keeps its hue in its
eval-time and fine-tuned rows, told apart by the line: dashed, dash-dot; a family's window row
is its hue dashed), the trained families, the RoPE variants and the window rows in separate
panels, each axis scaled to the data it shows, the training
length marked and labelled, chance levels drawn and named (and said when every row sits at
chance), lengths written out on log axes.
"""

from __future__ import annotations

import pathlib

import numpy as np

__all__ = ["plots"]

# Distinct hues (matplotlib's tab10, then two more): a family keeps its hue in every figure.
_HUES = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
    "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#000000", "#b8860b",
)  # fmt: skip


def _window(name: str) -> bool:
    """Whether the row reads a trained family under an eval-time sliding window of L."""
    return name.endswith("+window")


def _variant(name: str) -> str | None:
    """The eval-time scaling of a RoPE-variant row ("rope+yarn", "rope:rope_base=5e5+yarn+ft"
    give "yarn"), None for a trained family's own row and its window row."""
    parts = name.split("+")
    return parts[1] if len(parts) > 1 and not _window(name) else None


def _hue_key(name: str) -> str:
    """Rows share a hue when they share this: the family of a trained row (its name before any
    settings) and of its window row, the scaling kind of a RoPE-variant row."""
    return _variant(name) or name.split("+")[0].split(":")[0]


class _Style:
    def __init__(self, names):
        # Families and scaling kinds are drawn in separate panels, each set with its own hues; a
        # kind never takes the hue of a family drawn beside it (the RoPE row in its panel).
        families = list(dict.fromkeys(_hue_key(n) for n in names if _variant(n) is None))
        self.hue = {k: _HUES[i % len(_HUES)] for i, k in enumerate(families)}
        free = [h for h in _HUES if h not in self.hue.values()] + list(_HUES)
        kinds = list(dict.fromkeys(_hue_key(n) for n in names if _variant(n) is not None))
        taken = {self.hue[n.split("+")[0].split(":")[0]] for n in names if _variant(n)}
        free = [h for h in (*reversed(_HUES[:10]), *free) if h not in taken]
        self.hue |= {k: free[i % len(free)] for i, k in enumerate(kinds)}
        # A family under several settings ("fire", "fire:fire_init_c=3.2"): markers tell them
        # apart; a window row takes its family row's.
        self.marker = {}
        own = [n for n in names if not n.endswith("+ft") and not _window(n)]
        for n in names:
            base = n.removesuffix("+window")
            same = [m for m in own if _hue_key(m) == _hue_key(base)]
            self.marker[n] = "osD^v<>"[same.index(base) % 7] if base in same else "s"

    def __call__(self, name: str) -> dict:
        ls = "-." if name.endswith("+ft") else ("--" if _variant(name) or _window(name) else "-")
        return dict(ls=ls, marker=self.marker[name], ms=3, color=self.hue[_hue_key(name)])


def _groups(fams: dict) -> list[tuple[str, list[str]]]:
    """(title, rows) per panel: the trained families, then each RoPE entry with its variants,
    then the families read under a window of L (--) beside their own rows."""
    trained = [n for n in fams if _variant(n) is None and not _window(n)]
    groups = [("trained families", trained)]
    variants = [n for n in fams if _variant(n) is not None]
    if variants:
        bases = [b for b in trained if any(v.split("+")[0] == b for v in variants)]
        groups.append(
            ("RoPE: eval-time scalings and remaps (--), fine-tunes (-.)", bases + variants)
        )
    windows = [n for n in fams if _window(n)]
    if windows:
        bases = [b for b in trained if f"{b}+window" in windows]
        groups.append(("a sliding window of L at eval time (--)", bases + windows))
    return groups


def _mark_L(ax, L, *, x=None) -> None:
    """The training length as a labelled vertical line."""
    x = L if x is None else x
    ax.axvline(x, color="gray", lw=0.8, ls="-", zorder=0)
    ax.annotate(
        f"L = {L}", (x, 0), xycoords=("data", "axes fraction"), xytext=(3, 4),
        textcoords="offset points", fontsize=7, color="gray",
    )  # fmt: skip


def _length_axis(ax, lengths, label="eval length (tokens)") -> None:
    ax.set_xscale("log")
    ax.set_xticks(lengths, [str(x) for x in lengths])
    ax.set_xticks([], minor=True)
    ax.set_xlabel(label)


def _fit(ax, values) -> None:
    """The y axis scaled to the data shown (5% margins)."""
    values = [v for v in values if v is not None and np.isfinite(v)]
    if values:
        lo, hi = min(values), max(values)
        pad = 0.05 * (hi - lo) if hi > lo else 0.05 * max(abs(hi), 1e-3)
        ax.set_ylim(lo - pad, hi + pad)


def plots(results: dict, out_dir: pathlib.Path) -> None:
    """loss_vs_length.png, per_position.png, induction.png, passkey_heatmap.png,
    attention_stats.png and copy_vs_length.png (those whose blocks results.json has)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = results["families"]
    style = _Style(list(fams))
    _loss_figure(plt, results, style, out_dir / "loss_vs_length.png")
    _per_position_figure(plt, results, style, out_dir / "per_position.png")
    if results.get("induction"):
        _induction_figure(plt, results, style, out_dir / "induction.png")
    if results.get("passkey"):
        _passkey_figure(plt, results, out_dir / "passkey_heatmap.png")
    if results.get("attention_stats"):
        _attention_figure(plt, results, style, out_dir / "attention_stats.png")
    if results.get("copy_acc"):
        _copy_figure(plt, results, style, out_dir / "copy_vs_length.png")
    if any("bits_per_byte" in f for f in fams.values()):
        _bits_figure(plt, results, style, out_dir / "bits_per_byte_vs_length.png")


def _bits_figure(plt, results, style, path) -> None:
    """Bits per byte vs length (both windowings), the rows that report it (`pretrained` rows)."""
    L, fams = results["train_len"], results["families"]
    lengths = next(iter(fams.values()))["eval_len"]
    names = [n for n, f in fams.items() if "bits_per_byte" in f]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), squeeze=False)
    for ax, (key, title) in zip(
        axes[0],
        (("bits_per_byte", "non-overlapping windows"), ("bits_per_byte_sliding", "sliding")),
        strict=True,
    ):
        shown = []
        for name in names:
            f = fams[name]
            pts = [
                (x, y, c)
                for x, y, c in zip(f["eval_len"], f[key], f[f"{key}_ci"], strict=True)
                if y is not None
            ]
            if not pts:
                continue
            xs, ys, cis = zip(*pts, strict=True)
            low = [y - c[0] for y, c in zip(ys, cis, strict=True)]
            high = [c[1] - y for y, c in zip(ys, cis, strict=True)]
            ax.errorbar(xs, ys, yerr=[low, high], label=name, capsize=2, **style(name))
            shown += [c[0] for c in cis] + [c[1] for c in cis]
        _fit(ax, shown)
        _length_axis(ax, lengths)
        _mark_L(ax, L)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("bits per UTF-8 byte, 95% interval")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"Held-out bits per byte vs length, L = {L}")
    fig.tight_layout(), fig.savefig(path, dpi=120), plt.close(fig)


def _loss_figure(plt, results, style, path) -> None:
    L, fams = results["train_len"], results["families"]
    lengths = next(iter(fams.values()))["eval_len"]
    protocols = (
        ("loss", "loss_ci", "non-overlapping windows"),
        ("loss_beyond_L", "loss_beyond_L_ci", f"positions >= L = {L} only"),
        ("loss_sliding", "loss_sliding_ci", "sliding windows"),
    )
    groups = _groups(fams)
    fig, axes = plt.subplots(
        len(groups), 3, figsize=(16, 4.6 * len(groups)), squeeze=False, sharex=True
    )
    for g, (group, names) in enumerate(groups):
        for p, (key, ci_key, title) in enumerate(protocols):
            ax, shown = axes[g, p], []
            for name in names:
                f = fams[name]
                pts = [
                    (x, y, c)
                    for x, y, c in zip(f["eval_len"], f[key], f[ci_key], strict=True)
                    if y is not None
                ]
                if not pts:
                    continue
                xs, ys, cis = zip(*pts, strict=True)
                low = [y - c[0] for y, c in zip(ys, cis, strict=True)]
                high = [c[1] - y for y, c in zip(ys, cis, strict=True)]
                ax.errorbar(xs, ys, yerr=[low, high], label=name, capsize=2, **style(name))
                shown += [c[0] for c in cis] + [c[1] for c in cis]
            _fit(ax, shown)
            _length_axis(ax, lengths)
            _mark_L(ax, L)
            ax.set_title(f"{group}: {title}", fontsize=9)
            if p == 0:
                ax.set_ylabel(f"loss ({results['loss_unit']}), 95% interval")
        axes[g, 0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"Held-out loss vs length, trained at L = {L}")
    fig.tight_layout(), fig.savefig(path, dpi=120), plt.close(fig)


def _per_position_figure(plt, results, style, path) -> None:
    L, pp = results["train_len"], results["per_position"]
    groups = [(g, [n for n in names if n in pp["curves"]]) for g, names in _groups(pp["curves"])]
    groups = [(g, names) for g, names in groups if names]
    if not groups:  # no row has a per-position curve
        return
    fig, axes = plt.subplots(1, len(groups), figsize=(7.5 * len(groups), 4.6), squeeze=False)
    for ax, (group, names) in zip(axes[0], groups, strict=True):
        shown = []
        for name in names:
            c = pp["curves"][name]
            x = np.add(c["position"], 1)
            ax.plot(x, c["loss"], label=name, **style(name))
            lo, hi = zip(*c["ci"], strict=True)
            ax.fill_between(x, lo, hi, color=style(name)["color"], alpha=0.15, lw=0)
            shown += list(lo) + list(hi)
        _fit(ax, shown)
        ax.set(
            xscale="log",
            xlabel="tokens of context (position + 1; log-spaced bins)",
            ylabel="mean loss in bin (95% interval)",
            title=f"{group}: windows of {pp['eval_len']}",
        )
        _mark_L(ax, L)
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f"Per-position loss, trained at L = {L}")
    fig.tight_layout(), fig.savefig(path, dpi=120), plt.close(fig)


def _induction_figure(plt, results, style, path) -> None:
    L, ind = results["train_len"], results["induction"]
    lengths = next(iter(results["families"].values()))["eval_len"]
    chance = ind["chance_loss"]
    fig, axes = plt.subplots(
        1, len(lengths), figsize=(3.3 * len(lengths), 3.8), sharey=True, squeeze=False
    )
    every = []
    for a, (ax, length) in enumerate(zip(axes[0], lengths, strict=True)):
        gaps = []
        for name, grid in ind["loss"].items():
            pts = [(g, y) for g, y in zip(ind["gaps"], grid[a], strict=True) if y is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=name, **style(name))
                gaps += [g for g, _ in pts]
                every += [y for _, y in pts]
        ax.axhline(chance, color="gray", lw=0.8, ls=":")
        ax.annotate(
            f"chance: ln 26 = {chance:.2f}", (0, chance), xycoords=("axes fraction", "data"),
            xytext=(3, 3), textcoords="offset points", fontsize=7, color="gray",
        )  # fmt: skip
        if gaps:
            ticks = sorted(set(gaps))
            ax.set_xscale("symlog", linthresh=max(1, min(ticks) or 1))
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.set_xticks([], minor=True)
        ax.set(xlabel="gap between the copies (bytes)", title=f"window of {length} bytes")
    axes[0, 0].set_ylabel("loss on the repeat (nats per letter)")
    axes[0, -1].legend(fontsize=6, ncol=2)
    verdict = ""
    if every and min(every) >= chance - 0.05:
        verdict = ": every row at or worse than chance (no in-context copying)"
    fig.suptitle(
        f"Induction: a random {ind['span']}-letter string repeated after a gap, L = {L}{verdict}",
        fontsize=10,
    )
    fig.tight_layout(), fig.savefig(path, dpi=120), plt.close(fig)


def _passkey_figure(plt, results, path) -> None:
    L, pk = results["train_len"], results["passkey"]
    lengths = next(iter(results["families"].values()))["eval_len"]
    grids, cols = pk["acc"], 5
    rows = -(-len(grids) // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(2.9 * cols, 2.7 * rows), squeeze=False, layout="constrained"
    )
    values = []
    for ax, (name, grid) in zip(axes.flat, grids.items(), strict=False):
        img = np.array([[np.nan if v is None else v for v in row] for row in grid]).T
        values += [v for v in img.ravel() if np.isfinite(v)]
        im = ax.imshow(img, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
        ax.set_title(name, fontsize=8)
        ax.set_xticks(range(len(lengths)), [str(x) for x in lengths], fontsize=6)
        ax.set_yticks(range(len(pk["depths"])), [str(d) for d in pk["depths"]], fontsize=6)
        ax.set_xlabel("eval length", fontsize=7)
        ax.set_ylabel("needle depth", fontsize=7)
    for ax in axes.flat[len(grids) :]:
        ax.axis("off")
    fig.colorbar(im, ax=axes, shrink=0.6, label="exact-match accuracy (chance ~0)")
    verdict = ": every cell 0, no row retrieves the key" if values and max(values) == 0 else ""
    fig.suptitle(f"Passkey among distractors, trained at L = {L}{verdict}", fontsize=10)
    fig.savefig(path, dpi=120), plt.close(fig)


def _attention_figure(plt, results, style, path) -> None:
    block, L = results["attention_stats"], results["train_len"]
    lengths = next(iter(results["families"].values()))["eval_len"]
    first = next(s for r in block["rows"].values() for s in r if s is not None)
    layers = len(first["entropy"])
    metrics = (
        ("entropy", "entropy (nats)"),
        ("distance", "mean distance (tokens)"),
        ("mass_beyond_L", f"attention on keys >= {L} away"),
    )
    fig, axes = plt.subplots(3, layers, figsize=(4.6 * layers, 9), squeeze=False, sharex=True)
    for m, (key, label) in enumerate(metrics):
        for layer in range(layers):
            ax, shown = axes[m, layer], []
            for name, per_length in block["rows"].items():
                pts = [
                    (x, float(np.mean(s[key][layer])))
                    for x, s in zip(lengths, per_length, strict=True)
                    if s is not None
                ]
                if pts:
                    ax.plot(*zip(*pts, strict=True), label=name, **style(name))
                    shown += [y for _, y in pts]
            _fit(ax, shown)
            _length_axis(ax, lengths, "eval length (tokens)" if m == 2 else "")
            _mark_L(ax, L)
            ax.set_ylabel(label if layer == 0 else None)
            if m == 0:
                ax.set_title(f"layer {layer} (mean over heads)")
    axes[0, -1].legend(fontsize=6, ncol=2)
    fig.suptitle(f"Attention per layer, last min(T, L) queries of {block['windows']} windows")
    fig.tight_layout(), fig.savefig(path, dpi=110), plt.close(fig)


def _copy_figure(plt, results, style, path) -> None:
    L = results["train_len"]
    lengths = next(iter(results["families"].values()))["eval_len"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, acc in results["copy_acc"].items():
        pts = [(x, y) for x, y in zip(lengths, acc, strict=True) if y is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), label=name, **style(name))
    ax.axhline(1 / 26, color="gray", lw=0.8, ls=":")
    ax.annotate(
        "chance: 1/26", (0, 1 / 26), xycoords=("axes fraction", "data"), xytext=(3, 3),
        textcoords="offset points", fontsize=7, color="gray",
    )  # fmt: skip
    _length_axis(ax, lengths)
    _mark_L(ax, L)
    ax.set(ylabel="copy accuracy", ylim=(0, 1), title=f"Copy task vs length, trained at L = {L}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout(), fig.savefig(path, dpi=120), plt.close(fig)
