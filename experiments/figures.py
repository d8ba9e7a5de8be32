"""Standard figures of position encoding, drawn from posattn's own functions.

Question: do the library's position functions reproduce the standard pictures
(experiments/figures.md)? Every number and
curve below comes from `posattn.rotary` (`apply_rope`, `rope_frequencies`, `rope_angles`,
`rope_decay_bound`), `posattn.positions` (`t5_bucket`) or the family registry (`posattn.families`,
which calls `positions.t5_bucket` and `positions.alibi_bias`); this script only picks inputs,
arranges arrays and draws.

  rope_2d_example   the 2-D worked example of docs/conventions.md (q = [1, 0.5], k = [0.8, 0.3],
                    0.5 rad per position): PNG, plus the table as markdown and JSON.
  rope_decay        RoFormer §3.4.3's relative upper bound against the offset for a few bases
                    (RoFormer figure 2).
  t5_buckets        T5 bucket of each offset, 32 buckets, max distance 1024.
  t5_vs_alibi       T5 and ALiBi bias matrices as heat maps.
  rope_scaling      extrapolation vs interpolation for RoPE: plain, PI, NTK-aware, YaRN.
  figure_data.json  the numbers experiments/figures.md quotes.

Run (about 5 s of CPU time; the wall time is longer on a busy machine):
    python experiments/figures.py --outdir experiments/figures
What each figure shows: experiments/figures.md.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
import numpy as np  # noqa: E402

from posattn import families, positions, rotary  # noqa: E402

DPI = 100
COLORS = {
    "plain RoPE": "tab:red",
    "PI (linear)": "tab:blue",
    "NTK-aware": "tab:orange",
    "YaRN": "tab:green",
}


def _save(fig, path: pathlib.Path) -> pathlib.Path:
    fig.savefig(path, dpi=DPI)  # every figure uses the constrained layout
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------
# The worked example of docs/conventions.md (RoPE layouts and frequencies): one pair (H = 2),
# q = [1, 0.5], k = [0.8, 0.3], 0.5 rad per position. Pairs with the same offset m - n give the
# same score, (m, n) and (n, m) do not.
# ----------------------------------------------------------------------------------------------
EXAMPLE_Q, EXAMPLE_K, EXAMPLE_THETA = (1.0, 0.5), (0.8, 0.3), 0.5
EXAMPLE_PAIRS = ((0, 0), (5, 5), (0, 2), (7, 9), (2, 0), (9, 7), (0, 5), (10, 15))
EXAMPLE_GRID = 16


def rope_2d_scores(num_positions: int) -> np.ndarray:
    """score[m, n] = <R(m) q, R(n) k> for the worked example's q, k and angle, m, n in
    [0, num_positions)."""
    # q and k as two "heads" of one (T, N=2, H=2) array, both rotated at every position.
    x = jnp.broadcast_to(jnp.array([EXAMPLE_Q, EXAMPLE_K], jnp.float32), (num_positions, 2, 2))
    inv_freq = jnp.array(
        [EXAMPLE_THETA], jnp.float32
    )  # F = 1: the worked example's 0.5 rad per position
    rotated = np.asarray(
        jax.jit(rotary.apply_rope)(x, jnp.arange(num_positions), inv_freq), np.float64
    )
    return rotated[:, 0] @ rotated[:, 1].T  # (m, n)


def _example(outdir: pathlib.Path) -> dict[str, pathlib.Path]:
    scores = rope_2d_scores(EXAMPLE_GRID)
    rows = [
        {"m": m, "n": n, "offset": m - n, "score": round(float(scores[m, n]), 6)}
        for m, n in EXAMPLE_PAIRS
    ]
    # Spread of the score along each diagonal m - n = const: float32 rounding only.
    spread = max(np.ptp(np.diagonal(scores, o)) for o in range(-EXAMPLE_GRID + 1, EXAMPLE_GRID))
    table = {
        "q": EXAMPLE_Q,
        "k": EXAMPLE_K,
        "theta_rad_per_position": EXAMPLE_THETA,
        "convention": "score = <R(m) q, R(n) k>, m the query position, n the key position",
        "rows": rows,
        "max_spread_along_a_diagonal": float(spread),
    }
    md = ["| query m | key n | m - n | score |", "|---|---|---|---|"]
    md += [f"| {r['m']} | {r['n']} | {r['offset']:+d} | {r['score']:.6f} |" for r in rows]
    paths = {
        "rope_2d_example_json": outdir / "rope_2d_example.json",
        "rope_2d_example_md": outdir / "rope_2d_example.md",
    }
    paths["rope_2d_example_json"].write_text(json.dumps(table, indent=1) + "\n")
    paths["rope_2d_example_md"].write_text("\n".join(md) + "\n")

    fig, (ax0, ax1) = plt.subplots(
        1, 2, figsize=(11, 4.3), gridspec_kw={"width_ratios": [1, 1.25]}, layout="constrained"
    )
    im = ax0.imshow(scores, cmap="RdBu_r", vmin=-1.15, vmax=1.15, origin="upper")
    for r in rows:
        ax0.add_patch(plt.Rectangle((r["n"] - 0.5, r["m"] - 0.5), 1, 1, fill=False, lw=1.5))
    ax0.set(
        xlabel="key position n", ylabel="query position m", title="<R(m)q, R(n)k>, table rows boxed"
    )
    fig.colorbar(im, ax=ax0, label="score (constant along each diagonal)")
    offsets = np.arange(-(EXAMPLE_GRID - 1), EXAMPLE_GRID)
    by_offset = [scores[max(o, 0), max(-o, 0)] for o in offsets]  # one (m, n) per offset
    ax1.plot(offsets, by_offset, "o-", ms=3, color="k")
    for offset in sorted({r["offset"] for r in rows}):
        same = [r for r in rows if r["offset"] == offset]
        ax1.plot(offset, same[0]["score"], "o", ms=7, mfc="none", color="tab:red")
        ax1.annotate(
            " ".join(f"({r['m']},{r['n']})" for r in same),
            (offset, same[0]["score"]),
            textcoords="offset points",
            xytext=(6, -3),
            fontsize=8,
            color="tab:red",
        )
    ax1.axhline(0, color="0.7", lw=0.8)
    ax1.set(
        xlabel="offset m - n",
        ylabel="score",
        title="q=[1, 0.5], k=[0.8, 0.3], 0.5 rad per position: score vs offset",
    )
    ax1.grid(alpha=0.3)
    paths["rope_2d_example"] = _save(fig, outdir / "rope_2d_example.png")
    return paths


# ----------------------------------------------------------------------------------------------
# RoFormer §3.4.3 long-term decay, head dim 128 as in the paper's plot.
# ----------------------------------------------------------------------------------------------
DECAY_HEAD_DIM = 128
DECAY_BASES = (500.0, 10000.0, 500000.0)
DECAY_MAX_OFFSET = 2**16


def _decay(outdir: pathlib.Path, data: dict) -> dict[str, pathlib.Path]:
    inv_freq = jnp.stack([rotary.rope_frequencies(DECAY_HEAD_DIM, base=b)[0] for b in DECAY_BASES])
    offsets = jnp.arange(DECAY_MAX_OFFSET)
    bound = np.asarray(
        jax.jit(jax.vmap(rotary.rope_decay_bound, in_axes=(None, 0)))(offsets, inv_freq)
    )
    # bound: (bases, offsets)
    num_octaves = int(math.log2(DECAY_MAX_OFFSET))
    octaves = [(0, 1)] + [(2**i, 2 ** (i + 1)) for i in range(num_octaves)]  # [lo, hi) windows
    means = np.stack(
        [bound[:, lo:hi].mean(axis=1) for lo, hi in octaves], axis=1
    )  # (bases, windows)
    data["decay"] = {
        "head_dim": DECAY_HEAD_DIM,
        "octave_windows": octaves,
        "mean_bound": {
            str(b): [round(float(x), 2) for x in means[i]] for i, b in enumerate(DECAY_BASES)
        },
    }

    # Four geometric windows per octave for the right panel: min, mean and max of every offset.
    edges = np.unique(np.round(np.geomspace(1, DECAY_MAX_OFFSET, num_octaves * 4 + 1)).astype(int))
    windows = list(zip(edges[:-1], edges[1:], strict=True))
    centres = [math.sqrt(lo * hi) for lo, hi in windows]

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.3), layout="constrained")
    for i, b in enumerate(DECAY_BASES):
        color = f"C{i}"
        ax0.plot(np.arange(257), bound[i, :257], color=color, lw=1.2, label=f"base {b:g}")
        ax1.fill_between(
            centres,
            [bound[i, lo:hi].min() for lo, hi in windows],
            [bound[i, lo:hi].max() for lo, hi in windows],
            color=color,
            alpha=0.15,
            lw=0,
        )
        ax1.plot(
            centres,
            [bound[i, lo:hi].mean() for lo, hi in windows],
            color=color,
            lw=1.8,
            label=f"base {b:g}",
        )
    ax0.set(
        xlabel="relative distance m - n",
        ylabel="relative upper bound (1/F) Σ_j |S_j|",
        title=f"RoFormer's view: offsets 0..256, head dim {DECAY_HEAD_DIM}",
        xlim=(0, 256),
    )
    ax1.set(
        xscale="log",
        xlabel="relative distance m - n (log)",
        ylabel="relative upper bound",
        title="offsets 1..2^16: window mean (line), min..max (band)",
        xlim=(1, DECAY_MAX_OFFSET),
    )
    for ax in (ax0, ax1):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return {"rope_decay": _save(fig, outdir / "rope_decay.png")}


# ----------------------------------------------------------------------------------------------
# T5 buckets: 32 buckets, max distance 1024, causal (language modelling).
# ----------------------------------------------------------------------------------------------
T5_BUCKETS, T5_MAX_DISTANCE, T5_SPAN = 32, 1024, 4096
_t5_bucket = jax.jit(
    positions.t5_bucket, static_argnames=("bidirectional", "num_buckets", "max_distance")
)


def _t5_buckets(outdir: pathlib.Path, data: dict) -> dict[str, pathlib.Path]:
    offsets = np.arange(T5_SPAN + 1)
    bucket = np.asarray(
        _t5_bucket(
            jnp.asarray(offsets),
            bidirectional=False,
            num_buckets=T5_BUCKETS,
            max_distance=T5_MAX_DISTANCE,
        )
    )
    first = [int(offsets[bucket == b].min()) for b in range(T5_BUCKETS)]
    last = [int(offsets[bucket == b].max()) for b in range(T5_BUCKETS)]
    last[-1] = None  # the last bucket takes every larger offset
    data["t5_buckets"] = {
        "num_buckets": T5_BUCKETS,
        "max_distance": T5_MAX_DISTANCE,
        "bidirectional": False,
        "ranges": list(zip(first, last, strict=True)),
    }

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.3), layout="constrained")
    ax0.step(offsets, bucket, where="post", color="k", lw=1.2)
    ax0.axvline(T5_BUCKETS // 2, color="tab:blue", ls=":", label="end of the exact buckets (16)")
    ax0.axvline(
        first[-1], color="0.4", ls="-.", label=f"bucket {T5_BUCKETS - 1} starts: {first[-1]}"
    )
    ax0.axvline(T5_MAX_DISTANCE, color="tab:red", ls="--", label=f"max_distance {T5_MAX_DISTANCE}")
    ax0.set_xscale("symlog", linthresh=T5_BUCKETS // 2, linscale=1.0)
    ticks = [0, 4, 8, 12, 16] + [2**i for i in range(5, int(math.log2(T5_SPAN)) + 1)]
    ax0.set_xticks(ticks, [str(t) for t in ticks], fontsize=8)
    ax0.minorticks_off()
    ax0.set(
        xlabel="offset i - j (linear to 16, log beyond)",
        ylabel="bucket b(i - j)",
        title=f"causal T5 buckets: {T5_BUCKETS} buckets, max distance {T5_MAX_DISTANCE}",
        xlim=(0, T5_SPAN),
        ylim=(-0.5, T5_BUCKETS - 0.5),
    )
    ax0.legend(fontsize=8, loc="lower right")
    widths = [b - a + 1 for a, b in zip(first[:-1], last[:-1], strict=True)]
    ax1.bar(range(T5_BUCKETS - 1), widths, color="tab:blue")
    ax1.bar(
        [T5_BUCKETS - 1],
        [T5_SPAN - first[-1] + 1],
        color="0.7",
        hatch="//",
        label=f"bucket {T5_BUCKETS - 1}: every offset >= {first[-1]} (unbounded)",
    )
    ax1.set(
        yscale="log",
        xlabel="bucket",
        ylabel="number of offsets in the bucket (log)",
        title=f"bucket widths (bar {T5_BUCKETS - 1} cut at offset {T5_SPAN})",
    )
    ax1.legend(fontsize=8, loc="upper left")
    for ax in (ax0, ax1):
        ax.grid(alpha=0.3)
    return {"t5_buckets": _save(fig, outdir / "t5_buckets.png")}


# ----------------------------------------------------------------------------------------------
# T5 vs ALiBi bias, through the registry: the biases the model adds.
# ----------------------------------------------------------------------------------------------
HEATMAP_LEN, HEATMAP_HEADS = 64, 8


def _t5_vs_alibi(outdir: pathlib.Path) -> dict[str, pathlib.Path]:
    ctx = families.Context(num_heads=HEATMAP_HEADS, head_dim=64)
    settings = families.T5Settings()  # the defaults: 32 buckets, max distance 128
    pos = jnp.arange(HEATMAP_LEN)
    future = np.triu(np.ones((HEATMAP_LEN, HEATMAP_LEN), bool), k=1)  # causal mask: j > i

    def bias_of(name):
        family = families.get(name)
        spec, own = family.bias, family.settings()  # each family's default settings
        params = spec.init(jax.random.key(0), ctx, own)
        return params, np.asarray(jax.jit(spec.bind(ctx, own))(params, pos, pos))  # (N, T, S)

    bucket = np.asarray(
        _t5_bucket(
            pos[:, None] - pos[None, :],
            bidirectional=False,
            num_buckets=settings.num_buckets,
            max_distance=settings.max_distance,
        )
    )
    _, t5 = bias_of("t5")
    alibi_params, alibi = bias_of("alibi")
    slopes = np.asarray(alibi_params["slopes"])
    panels = [
        (
            bucket,
            "Blues",
            None,
            f"T5 bucket b(i-j) ({settings.num_buckets} buckets, max distance "
            f"{settings.max_distance})",
            "bucket",
        ),
        (
            t5[0],
            "RdBu_r",
            "sym",
            "T5 bias u[b(i-j)], head 1, at initialisation (learned in training)",
            "bias",
        ),
        (alibi[0], "Blues_r", None, f"ALiBi bias, head 1: -{slopes[0]:g} (i-j)", "bias"),
        (
            alibi[-1],
            "Blues_r",
            None,
            f"ALiBi bias, head {HEATMAP_HEADS}: -{slopes[-1]:g} (i-j)",
            "bias",
        ),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(11, 9.5), layout="constrained")
    for ax, (values, cmap, sym, title, label) in zip(axes.ravel(), panels, strict=True):
        cm = plt.get_cmap(cmap).with_extremes(bad="white")
        vmax = np.abs(values[~future]).max() if sym else None
        im = ax.imshow(
            np.ma.masked_array(values, future),
            cmap=cm,
            vmin=-vmax if sym else None,
            vmax=vmax,
            interpolation="nearest",
        )
        ax.set(title=title, xlabel="key position j", ylabel="query position i")
        ax.title.set_fontsize(9)
        fig.colorbar(im, ax=ax, label=label, shrink=0.9)
    fig.suptitle(
        f"causal biases added to q·k, {HEATMAP_LEN} positions (white: future keys, masked)"
    )
    return {"t5_vs_alibi": _save(fig, outdir / "t5_vs_alibi.png")}


# ----------------------------------------------------------------------------------------------
# Extrapolation vs interpolation for RoPE (fig. 2.9 in spirit): a Llama-2-like head (H = 128, base
# 10^4) trained at m_l = 4096 and run at m = 4 m_l.
# ----------------------------------------------------------------------------------------------
SCALE_HEAD_DIM, SCALE_TRAIN_LEN, SCALE_FACTOR = 128, 4096, 4
SCALINGS = {
    "plain RoPE": None,
    "PI (linear)": {"rope_type": "linear", "factor": float(SCALE_FACTOR)},
    "NTK-aware": {"rope_type": "ntk", "factor": float(SCALE_FACTOR)},
    "YaRN": {
        "rope_type": "yarn",
        "factor": float(SCALE_FACTOR),
        "original_max_position_embeddings": SCALE_TRAIN_LEN,
    },
}


def _unwrapped_angles(length: int, inv_freq) -> np.ndarray:
    """p * theta_k for p in [0, length), float64 [length, F]: rope_angles, unwrapped along p."""
    angles = jax.jit(rotary.rope_angles)(jnp.arange(length), inv_freq)  # (length, F), mod 2 pi
    return np.unwrap(
        np.asarray(angles, np.float64), axis=0
    )  # a step theta_k <= 1 < pi: unwrap is exact


def _rope_scaling(outdir: pathlib.Path, data: dict) -> dict[str, pathlib.Path]:
    length = SCALE_TRAIN_LEN * SCALE_FACTOR
    plain = rotary.rope_frequencies(SCALE_HEAD_DIM)[0]
    freqs = {
        name: rotary.rope_frequencies(SCALE_HEAD_DIM, scaling=s) for name, s in SCALINGS.items()
    }
    angles = {
        name: _unwrapped_angles(length, inv_freq) for name, (inv_freq, _) in freqs.items()
    }  # (m, F)
    # Angles seen in training: plain RoPE at positions [0, m_l], the end of the window included, so
    # that PI's last position (m - 1) / s = m_l - 1/s counts as inside.
    seen = angles["plain RoPE"][SCALE_TRAIN_LEN]  # (F,)
    full_turn = seen >= 2 * math.pi  # these pairs saw every angle in training
    ratios, summary = {}, {}
    for name, (inv_freq, factor) in freqs.items():
        ratios[name] = np.asarray(inv_freq, np.float64) / np.asarray(plain, np.float64)
        reach = angles[name].max(axis=0)
        outside = np.flatnonzero(~full_turn & (reach > seen))
        summary[name] = {
            "pairs_outside": outside.tolist(),
            "attention_factor": factor,
            "max_overshoot": float((reach / seen)[outside].max()) if outside.size else 1.0,
        }
    pair = int(
        np.argmin(np.abs(seen - math.pi / 2))
    )  # a low-frequency pair that saw ~a quarter turn
    data["rope_scaling"] = {
        "head_dim": SCALE_HEAD_DIM,
        "train_len": SCALE_TRAIN_LEN,
        "factor": SCALE_FACTOR,
        "pairs_with_a_full_turn_in_training": int(full_turn.sum()),
        "shown_pair": pair,
        "methods": summary,
    }

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8), layout="constrained")
    styles = {"PI (linear)": "-", "YaRN": "--"}  # they coincide on low-frequency pairs
    ax = axes[0]
    ax.axvspan(0, SCALE_TRAIN_LEN, color="0.85", label=f"trained positions [0, {SCALE_TRAIN_LEN})")
    ax.axhspan(0, seen[pair], color="tab:blue", alpha=0.12, label="angles seen in training")
    p = np.arange(length)
    for name in SCALINGS:
        ax.plot(
            p, angles[name][:, pair], styles.get(name, "-"), color=COLORS[name], lw=1.8, label=name
        )
    ax.set(
        xlabel="position p",
        ylabel=f"rotation angle p·θ'_k of pair k = {pair} (rad)",
        xlim=(0, length),
        ylim=(0, None),
        title=f"one low-frequency pair (k = {pair}) up to {SCALE_FACTOR}× the trained length",
    )
    ax.legend(fontsize=8, loc="upper left")

    ax = axes[1]
    k = np.arange(SCALE_HEAD_DIM // 2)
    first_short = int(np.argmin(full_turn))  # pairs k >= this turned less than once in training
    ax.axvspan(
        -0.5,
        first_short - 0.5,
        color="0.85",
        label=f"pairs 0..{first_short - 1}: ≥ one full turn in training, every angle seen",
    )
    ax.axhspan(0, 1, color="tab:blue", alpha=0.12, label="inside the angles seen in training")
    for name in SCALINGS:
        reach = angles[name].max(axis=0) / seen
        out = summary[name]["pairs_outside"]
        ax.plot(
            k,
            reach,
            styles.get(name, "-"),
            color=COLORS[name],
            lw=1.8,
            label=f"{name}: {len(out)} pairs outside (×)",
        )
        ax.plot(out, reach[out], "x", color=COLORS[name], ms=6)
    ax.set(
        xlabel="pair k (high → low frequency)",
        xlim=(-0.5, k[-1] + 0.5),
        ylim=(0, 2 * SCALE_FACTOR - 0.5),
        ylabel=f"largest angle over [0, {length}) / over [0, {SCALE_TRAIN_LEN}]",
        title="which pairs leave the angles seen in training",
    )
    ax.legend(fontsize=8, loc="upper left")

    ax = axes[2]
    for name in SCALINGS:
        label = (
            name
            if summary[name]["attention_factor"] == 1
            else f"{name} (cos, sin × {summary[name]['attention_factor']:.3f})"
        )
        ax.plot(k, ratios[name], styles.get(name, "-"), color=COLORS[name], lw=1.8, label=label)
    ticks = [1 / SCALE_FACTOR, 1 / math.sqrt(SCALE_FACTOR), 1.0]
    ax.set(
        yscale="log",
        xlabel="pair k (high → low frequency)",
        ylabel="θ'_k / θ_k (log)",
        title="the price: angle step per position, relative to training",
        ylim=(0.2, 1.25),
    )
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.legend(fontsize=8, loc="lower left")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"RoPE beyond the trained length: head dim {SCALE_HEAD_DIM}, base 10^4, trained at "
        f"{SCALE_TRAIN_LEN}, run at {length} (factor {SCALE_FACTOR})"
    )
    return {"rope_scaling": _save(fig, outdir / "rope_scaling.png")}


def make_figures(outdir) -> dict[str, pathlib.Path]:
    """Writes every figure (PNG), the worked-example table (markdown + JSON) and figure_data.json.

    Args:
      outdir: directory to write into (created if missing).

    Returns:
      {name: path} of every file written.
    """
    outdir = pathlib.Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    data: dict = {}
    paths = _example(outdir)
    paths |= _decay(outdir, data)
    paths |= _t5_buckets(outdir, data)
    paths |= _t5_vs_alibi(outdir)
    paths |= _rope_scaling(outdir, data)
    paths["figure_data"] = outdir / "figure_data.json"
    paths["figure_data"].write_text(json.dumps(data, indent=1) + "\n")
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outdir", required=True, help="directory for the PNGs, tables and JSON")
    for name, path in make_figures(parser.parse_args(argv).outdir).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
