"""The induction head past the training length: does the head that copies at L still find its
target when the window is longer than any the model trained on?

    python experiments/heads_by_length.py runs/extrapolation

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

It prints a markdown table, a line per row and seed: the head (layer.head), its induction weight
at each length (`-` where the model cannot read the length: the learned table), and the largest
induction weight of any head at the longest length. Fine-tuned and eval-time rows are not
trained directories and are not read.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from seed_table import head_draw, seed_dirs  # noqa: E402


def _lengths(workdir: pathlib.Path, L: int) -> list[int]:
    """The run's evaluation lengths (results.json), or 1, 2, 4, 8, 16 x L without one."""
    try:
        fams = json.loads((workdir / "results.json").read_text())["families"]
        return [int(t) for t in next(iter(fams.values()))["eval_len"]]
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        return [m * L for m in (1, 2, 4, 8, 16)]


def head_rows(workdir: pathlib.Path) -> list[str]:
    """The table's lines (module docstring)."""
    from posattn.data import load_corpus
    from posattn.eval import lengths as lengths_lib
    from posattn.eval.attention_stats import head_scores, repeated_strings
    from posattn.generate import GenerateError, load_model

    seed, count = head_draw(workdir)
    lines, corpora, header = [], {}, None
    for family_dir in sorted(p for p in workdir.iterdir() if (p / "checkpoints").is_dir()):
        for train_seed, sd in seed_dirs(family_dir):
            try:
                cfg, graphdef, params, constants, _ = load_model(sd)
                data = json.loads((sd / "config.json").read_text())["data"]
                L, corpus_name = int(data["seq_len"]), data["corpus"]
            except (GenerateError, KeyError, ValueError) as e:
                lines.append(f"| {family_dir.name} | {train_seed} | not restored ({e}) |")
                continue
            lengths = _lengths(workdir, L)
            if header is None:
                header = lengths
            if corpus_name not in corpora:
                corpora[corpus_name] = load_corpus(corpus_name).val
            val = corpora[corpus_name]
            rng = np.random.default_rng(seed)
            strings = repeated_strings(rng, count, L // 2, cfg.vocab_size)  # (count, L)
            at = rng.integers(0, val.size - max(lengths), size=count)  # the text's offsets
            weights, top = [], None
            for T in lengths:
                if not lengths_lib.can_read(cfg, T):
                    weights.append(None)
                    continue
                text = np.stack([val[a : a + T - L] for a in at]).astype(np.int32)
                found = head_scores(
                    graphdef,
                    params,
                    constants,
                    np.concatenate([text, strings], axis=1),
                    period=L // 2,
                    start=T - L,
                )["induction"]  # [layer][head]
                if top is None:  # the head that copies at L (the first length)
                    top = max(
                        ((w, y, h) for y, hs in enumerate(found) for h, w in enumerate(hs)),
                        key=lambda x: x[0],
                    )[1:]
                weights.append((found[top[0]][top[1]], max(max(hs) for hs in found)))
            cells = " | ".join("-" if w is None else f"{w[0]:.2f}" for w in weights)
            last = weights[-1]
            lines.append(
                f"| {family_dir.name} | {train_seed} | {top[0]}.{top[1]} | {cells} | "
                f"{'-' if last is None else f'{last[1]:.2f}'} |"
            )
    if header is None:
        return lines
    head = " | ".join(str(t) for t in header)
    return [
        f"| row | seed | head (at {header[0]}) | {head} | any head at {header[-1]} |",
        "|---|---:|---:|" + "---:|" * (len(header) + 1),
        *lines,
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workdir", type=pathlib.Path, help="a length_extrapolation.py workdir")
    args = parser.parse_args(argv)
    if not args.workdir.is_dir():
        print(
            f"{args.workdir} is not a directory: pass a length_extrapolation.py --workdir",
            file=sys.stderr,
        )
        return 2
    lines = head_rows(args.workdir)
    if not lines:
        print(
            f"{args.workdir} holds no trained checkpoints (<family>/checkpoints/): pass the "
            "--workdir of a finished length_extrapolation.py run",
            file=sys.stderr,
        )
        return 2
    print(
        "Induction weight of each seed's copying head (chosen at L) with T - L bytes of held-out "
        "text before the string and its repeat"
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
