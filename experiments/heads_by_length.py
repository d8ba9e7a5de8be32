"""The induction head past the training length: does the head that copies at L still find its
target when the window is longer than any the model trained on?

    python experiments/heads_by_length.py runs/extrapolation
    python experiments/heads_by_length.py runs/extrapolation --results R/results.json

(`--results`: the run's results.json when it is not WORKDIR's own, as for a run with other
evaluation settings, which the experiment writes in WORKDIR/results-<hash>/.)

For each trained seed of a length-extrapolation workdir this restores the checkpoint
(`posattn.generate.load_model`), takes the head with the largest induction weight at L
(`posattn.eval.attention_stats.head_scores`, the experiment's "Heads at L") and reads it at every
evaluation length T: the same random strings of L / 2 letters written twice now end a window
whose first T - L tokens are held-out text, so the string and its repeat are as far apart as at
L while the queries can also see T - L tokens further back. A head whose weight on the target
holds is still an induction head at T; one whose weight falls is drawn to the far keys, which no
training window had. The strings are drawn as the experiment's attention evaluator draws them
(`eval.seed`, `eval.head_strings` of results.json's config; 1234 and 32 without one), the text
from the corpus's held-out split at offsets drawn from the same seed.

It also follows the previous-token head that most likely feeds the copying one (the largest
previous-token weight in the layers below it, chosen at L), over the same queries, so that a
failure past L can be placed: the first layer's local head losing its target, or the induction
head losing its own with the local head intact.

Rows: each trained seed; its window row when the run's `window_rows` names its entry
(`<entry>+window`: every layer, or those of `window_layers`, limited to the last L keys past L,
the trained model at L); for a
RoPE seed, each eval-time scaling of the run's `rope_scalings`
(results.json's config; `<entry>+<scaling>`, the trained model itself at L) and each fine-tune
found for it in `<entry>/finetune/` (`<entry>+<kind>+ft`, read with its own scaling at every
length). It prints a markdown table, a line per row and seed: the two heads (layer.head), at each
length "induction / previous-token / outside" (the two heads' weights on their targets, and the
copying head's weight on the T - L bytes before the string: where its lost weight went; `-`
where the model cannot read the length: the learned table), and the largest induction weight of
any head at the longest length.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from seed_table import head_draw, not_a_directory, seed_dirs  # noqa: E402


def _read_results(path: pathlib.Path) -> dict:
    """The run's results.json (read once), or {} where there is none to read."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _lengths(results: dict, L: int) -> list[int]:
    """The run's evaluation lengths (`results`, its results.json), or 1, 2, 4, 8, 16 x L without
    one."""
    try:
        return [int(t) for t in next(iter(results["families"].values()))["eval_len"]]
    except (KeyError, TypeError, ValueError, StopIteration):
        return [m * L for m in (1, 2, 4, 8, 16)]


def _heads_at_L(found: dict) -> tuple[tuple[int, int], tuple[int, int]]:
    """(layer, head) of the largest induction weight, and of the largest previous-token weight
    in the layers below it (every layer when it is in the first): the head that copies and the
    one most likely to feed it."""
    ind = found["induction"]
    y, h = max(
        ((y, h) for y in range(len(ind)) for h in range(len(ind[y]))),
        key=lambda yh: ind[yh[0]][yh[1]],
    )
    prev = found["previous_token"]
    below = range(y) if y > 0 else range(len(prev))
    py, ph = max(
        ((py, ph) for py in below for ph in range(len(prev[py]))),
        key=lambda yh: prev[yh[0]][yh[1]],
    )
    return (y, h), (py, ph)


def _run_rows(results: dict, key: str) -> list[str]:
    """The entries of the run's config list `key` (`families`, `rope_scalings`, `window_rows`,
    `window_layers`; the config in `results`, its results.json; none without one)."""
    try:
        return [str(e) for e in results["config"][key]]
    except (KeyError, TypeError):
        return []


def _row_models(workdir: pathlib.Path, results: dict):
    """(row, seed, cfg, L, corpus, model_at) for every trained seed, its window row, each
    eval-time RoPE scaling of a RoPE seed and each fine-tune; model_at(T) is the split model the
    row reads at T (None where it cannot read T), or the row is (row, seed, error message)."""
    from flax import nnx
    from length_extrapolation.settings import entry_dir, rope_row_at

    from posattn.eval import lengths as lengths_lib
    from posattn.generate import GenerateError, load_model
    from posattn.nn.model import TransformerLM

    def plain(graphdef, params, constants, cfg):
        return lambda T: (graphdef, params, constants) if lengths_lib.can_read(cfg, T) else None

    def windowed(graphdef, params, constants, cfg, L):
        small = lengths_lib.windowed(cfg, L, [int(i) for i in layers] or None)
        graph = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(small, rngs=nnx.Rngs(0))))
        return lambda T: (graph if T > L else graphdef, params, constants)

    def scaled(cfg, params, L, entry):
        def at(T):
            scaling, remap = rope_row_at(entry, L, T)
            graphdef, constants = lengths_lib.rope_row_model(cfg, scaling, T, remap)
            return graphdef, params, constants

        return at

    scalings = _run_rows(results, "rope_scalings")
    windows = {entry_dir(workdir, e).name for e in _run_rows(results, "window_rows")}
    layers = _run_rows(results, "window_layers")
    # A directory's row as results.json names it ("fire:fire_norm_cap=63" trains in
    # "fire@fire_norm_cap=63"); the directory's own name without a results.json.
    entries = {entry_dir(workdir, e).name: e for e in _run_rows(results, "families")}
    for family_dir in sorted(p for p in workdir.iterdir() if (p / "checkpoints").is_dir()):
        entry = entries.get(family_dir.name, family_dir.name)
        for train_seed, sd in seed_dirs(family_dir):
            tunes = sorted((family_dir / "finetune").glob(f"*-seed{train_seed}-*"))
            for name, where in [(entry, sd)] + [
                (f"{entry}+{t.name.split('-')[0]}+ft", t) for t in tunes
            ]:
                try:
                    cfg, graphdef, params, constants, _ = load_model(where)
                    data = json.loads((sd / "config.json").read_text())["data"]  # the trained L
                    L, corpus = int(data["seq_len"]), str(data["corpus"])
                except (GenerateError, KeyError, ValueError) as e:
                    yield name, train_seed, f"not restored ({e})"
                    continue
                yield name, train_seed, cfg, L, corpus, plain(graphdef, params, constants, cfg)
                if where == sd and family_dir.name in windows:
                    model_at = windowed(graphdef, params, constants, cfg, L)
                    yield f"{name}+window", train_seed, cfg, L, corpus, model_at
                if where != sd or not cfg.family.rotary:
                    continue
                for scaling in scalings:
                    model_at = scaled(cfg, params, L, scaling)
                    yield f"{entry}+{scaling}", train_seed, cfg, L, corpus, model_at


def head_rows(workdir: pathlib.Path, results: pathlib.Path | None = None) -> list[str]:
    """The table's lines (module docstring); `results` is the run's results.json (default
    WORKDIR/results.json)."""
    from length_extrapolation.report import md_name

    from posattn.data import load_corpus
    from posattn.eval.attention_stats import head_scores, repeated_strings

    path = workdir / "results.json" if results is None else results
    seed, count = head_draw(workdir, path)
    run = _read_results(path)
    lines, corpora, header = [], {}, None
    for found_row in _row_models(workdir, run):
        if len(found_row) == 3:
            name, train_seed, error = found_row
            lines.append(f"| {md_name(name)} | {train_seed} | {error} |")
            continue
        name, train_seed, cfg, L, corpus_name, model_at = found_row
        lengths = _lengths(run, L)
        if header is None:
            header = lengths
        if corpus_name not in corpora:
            corpora[corpus_name] = load_corpus(corpus_name).val
        val = corpora[corpus_name]
        rng = np.random.default_rng(seed)
        strings = repeated_strings(rng, count, L // 2, cfg.vocab_size)  # (count, L)
        at = rng.integers(0, val.size - max(lengths), size=count)  # the text's offsets
        cells, top = [], None
        for T in lengths:
            model = model_at(T)
            if model is None:
                cells.append(None)
                continue
            text = np.stack([val[a : a + T - L] for a in at]).astype(np.int32)
            found = head_scores(
                *model, np.concatenate([text, strings], axis=1), period=L // 2, start=T - L
            )  # {"previous_token", "induction"}: [layer][head]
            if top is None:  # the heads at L (the first length)
                top = _heads_at_L(found)
            (y, h), (py, ph) = top
            early = found["before_start"][y][h] if "before_start" in found else 0.0
            cells.append(
                (
                    found["induction"][y][h],
                    found["previous_token"][py][ph],
                    early,
                    max(max(hs) for hs in found["induction"]),
                )
            )
        text_cells = " | ".join(
            "-" if c is None else f"{c[0]:.2f} / {c[1]:.2f} / {c[2]:.2f}" for c in cells
        )
        (y, h), (py, ph) = top
        last = "-" if cells[-1] is None else f"{cells[-1][3]:.2f}"
        lines.append(
            f"| {md_name(name)} | {train_seed} | {y}.{h}, {py}.{ph} | {text_cells} | {last} |"
        )
    if header is None:
        return lines
    head = " | ".join(str(t) for t in header)
    return [
        f"| row | seed | heads at {header[0]}: induction, previous-token | {head} | "
        f"any head's induction at {header[-1]} |",
        "|---|---:|---:|" + "---:|" * (len(header) + 1),
        *lines,
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workdir", type=pathlib.Path, help="a length_extrapolation.py workdir")
    parser.add_argument(
        "--results",
        type=pathlib.Path,
        default=None,
        help="the run's results.json (default WORKDIR/results.json; a run of other evaluation "
        "settings, window_rows for one, writes it in WORKDIR/results-<hash>/)",
    )
    args = parser.parse_args(argv)
    if not_a_directory(args.workdir):
        return 2
    if args.results is not None and not args.results.is_file():
        print(f"--results {args.results} is not a file: pass a run's results.json", file=sys.stderr)
        return 2
    lines = head_rows(args.workdir, args.results)
    if not lines:
        print(
            f"{args.workdir} holds no trained checkpoints (<family>/checkpoints/): pass the "
            "--workdir of a finished length_extrapolation.py run",
            file=sys.stderr,
        )
        return 2
    print(
        "Each seed's copying head and the previous-token head below it (chosen at L): their "
        "weights, induction / previous-token / the copying head's weight outside the string, "
        "with T - L bytes of held-out text before the string and its repeat"
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
