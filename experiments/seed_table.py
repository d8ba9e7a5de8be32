"""Each training seed of a length-extrapolation run, one line each: the probes and the text at L.

    python experiments/seed_table.py runs/extrapolation             # every row, every seed
    python experiments/seed_table.py runs/kerple --params           # and the learned positions
    python experiments/seed_table.py runs/nope --heads              # and the heads that copy
    python experiments/seed_table.py runs/t5 --digits               # and the passkey's digits
    python experiments/seed_table.py runs/remap --length 1024       # at 1024, and the change

`results.json` reports a row's mean over seeds; whether a probe is learned is a property of one
trained model, so this reads the per-seed evaluations: a run's workdir keeps them in
`<family>/evaluations/` (the first seed, `train.seed`) and `<family>/seed<k>/evaluations/`
(seed k), a committed
record in `evaluations/<row>.seed<k>.<evaluator>.json`. It prints a markdown table at the
training length L, a line per row and seed:

* text: the non-overlapping loss at L, nats per byte (the `loss` evaluator's sums, or, where a
  record keeps no loss files, `results.json`'s `loss_seeds`);
* passkey: NLL per key digit at each depth (chance ln 10 = 2.30) and the share of keys exact;
* induction: NLL per letter at the first gap (L / 2 in the default config; chance over letters
  ln 26 = 3.26) ± 1.96 standard errors over the samples.

`--length T` prints the same at the eval length T instead of L (one of the run's lengths), with
the text's change from L seed by seed.

`--params` also restores each seed's checkpoint (a workdir only: `posattn.generate.load_model`)
and prints the parameters of its attention biases that hold at most 16 numbers (Kerple's r1 and
r2, FIRE's c and threshold), a line per layer; `blocks[0]` alone is one set shared by the stack.
`--heads` (a workdir only) prints, for each seed, layer and head, the weight on the previous
token and on the token after the query's earlier occurrence, on the random strings of L / 2
letters written twice that the experiment's attention evaluator reads at L (`eval.head_strings`
of them, drawn from `eval.seed`; `posattn.eval.attention_stats.head_scores`), so the first seed's
lines are results.json's: a previous-token head in one layer and an induction head in a later
one are how a model copies (Olsson et al. 2022).
`--digits` (a workdir only) reads each seed's passkey probe at L again (the experiment's samples:
`results.json`'s passkey settings and `eval.seed`) and prints, for each digit of the key in turn,
the share right and where the wrong ones came from: a later or an earlier digit of the key, another
digit of the sequence, or none (`posattn.eval.retrieval.passkey_places`). A model that found the
key and lost its place in it reads a later digit; one that never found it reads a distractor's.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # length_extrapolation

LN10, LN26 = float(np.log(10.0)), float(np.log(26.0))


def _first_seed(config_path: pathlib.Path) -> int:
    """The run's first seed (`train.seed`, whose run is the family directory itself); 0 when
    the directory keeps no readable config."""
    try:
        return int(json.loads(config_path.read_text())["train"]["seed"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def seed_dirs(family_dir: pathlib.Path) -> list[tuple[int, pathlib.Path]]:
    extra = [p for p in family_dir.iterdir() if p.is_dir() and re.fullmatch(r"seed\d+", p.name)]
    first = _first_seed(family_dir / "config.json")
    return [(first, family_dir)] + sorted((int(p.name[4:]), p) for p in extra)


EVALUATORS = ("loss", "passkey", "induction")


def evaluation_files(workdir: pathlib.Path) -> dict[tuple[str, int], dict[str, pathlib.Path]]:
    """(row, seed) -> {evaluator: file}, from a workdir (`<family>/[seed<k>/]evaluations/
    <row>.<evaluator>.json`) or a record (`evaluations/<row>.seed<k>.<evaluator>.json`)."""
    found: dict[tuple[str, int], dict[str, pathlib.Path]] = {}
    pattern = re.compile(r"(.+?)(?:\.seed(\d+))?\.(" + "|".join(EVALUATORS) + r")\.json")
    dirs = [(None, workdir / "evaluations")] + [
        (seed, sd / "evaluations")
        for family_dir in sorted(p for p in workdir.iterdir() if p.is_dir())
        for seed, sd in seed_dirs(family_dir)
    ]
    for seed, ev in dirs:
        if not ev.is_dir():
            continue
        for path in sorted(ev.iterdir()):
            m = pattern.fullmatch(path.name)
            if m:
                key = (m.group(1), seed if seed is not None else int(m.group(2) or 0))
                found.setdefault(key, {})[m.group(3)] = path
    return found


class TableError(ValueError):
    """A file this table reads is not an evaluation; the message names it."""


def _first(path: pathlib.Path | None, length: int | None = None) -> dict | None:
    """The evaluator's values at `length` (None: the first length, L), or None when there is no
    file."""
    if path is None:
        return None
    try:
        found = json.loads(path.read_text())
        index = 0 if length is None else _index(found["key"]["settings"]["lengths"], length, path)
        return found["values"][index]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        if isinstance(e, TableError):
            raise
        raise TableError(
            f"{path} is not an evaluation written by length_extrapolation.py ({e!r}); "
            "delete it and rerun the experiment's command to evaluate that row again"
        ) from None


def _index(lengths: list[int], length: int, where) -> int:
    if length not in lengths:
        raise TableError(f"{where} has no evaluation at length {length}; its lengths: {lengths}")
    return lengths.index(length)


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _results_text(
    workdir: pathlib.Path, length: int | None = None
) -> tuple[dict[tuple[str, int], float], dict[str, str]]:
    """((row stem, seed) -> text loss at `length` (None: L) from `results.json`'s `loss_seeds`,
    row stem -> row name), empty without one; a row's evaluation files spell its name as its
    stem (`row_stem`: "rope@window=32|nope" for the row "rope:window=32|nope")."""
    from length_extrapolation.settings import row_stem

    path = workdir / "results.json"
    if not path.is_file():
        return {}, {}
    try:
        found = json.loads(path.read_text())
        first = int(found["config"]["train"]["seed"])  # the seeds run from train.seed on
        losses = {}
        for row, entry in found["families"].items():
            at = 0 if length is None else _index(entry["eval_len"], length, path)
            for i, loss in enumerate((entry.get("loss_seeds") or [[]])[at] or []):
                if loss is not None:
                    losses[(row_stem(row), first + i)] = loss
        return losses, {row_stem(row): row for row in found["families"]}
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        raise TableError(
            f"{path} is not a results.json written by length_extrapolation.py ({e!r}); "
            "rerun the experiment's command on its workdir to write it again"
        ) from None


def seed_lines(workdir: pathlib.Path, length: int | None = None) -> list[str]:
    """The table's lines at `length` (None: L); with a length, a column of the text's change
    from L too."""
    from length_extrapolation.report import md_name

    at = "L" if length is None else str(length)
    lines = [
        f"| row | seed | text at {at} | passkey per digit, by depth | keys exact "
        "| induction per letter |",
        "|---|---:|---:|---|---|---:|",
    ]
    if length is not None:
        lines = [lines[0].replace(" | passkey", " | change from L | passkey", 1)]
        lines.append("|---|---:|---:|---:|---|---|---:|")
    from_results, names = _results_text(workdir, length)
    at_l, _ = _results_text(workdir) if length is not None else ({}, {})

    def text_of(loss, stem, seed, source):
        if loss is not None:
            return float(np.sum(loss["sum"]) / np.sum(loss["count"]))
        return source.get((stem, seed))

    for (stem, seed), files in sorted(evaluation_files(workdir).items()):
        loss, pk, ind = (_first(files.get(name), length) for name in EVALUATORS)
        value, row = text_of(loss, stem, seed, from_results), names.get(stem, stem)
        text = _fmt(value, ".3f")
        if length is not None:
            start = text_of(_first(files.get("loss")), stem, seed, at_l)
            change = None if value is None or start is None else value - start
            text += f" | {_fmt(change, '+.3f')}"
        pk_loss = " / ".join(_fmt(x) for x in pk["loss"]) if pk else "-"
        pk_acc = " / ".join(_fmt(x) for x in pk["acc"]) if pk else "-"
        ind_cell = "-"
        if ind and ind["loss"][0] is not None:
            ind_cell = f"{ind['loss'][0]:.2f} ± {1.96 * ind['se'][0]:.2f}"
        lines.append(f"| {md_name(row)} | {seed} | {text} | {pk_loss} | {pk_acc} | {ind_cell} |")
    return lines


def param_lines(workdir: pathlib.Path, max_size: int = 16) -> list[str]:
    import jax

    from posattn.generate import GenerateError, load_model

    lines = []
    for family_dir in sorted(p for p in workdir.iterdir() if (p / "checkpoints").is_dir()):
        for seed, sd in seed_dirs(family_dir):
            try:
                _, _, params, _, step = load_model(sd)
            except GenerateError as e:
                lines.append(f"{family_dir.name} seed {seed}: not restored ({e})")
                continue
            found = []
            for path, leaf in jax.tree_util.tree_leaves_with_path(params):
                name = jax.tree_util.keystr(path)
                if "['bias']" not in name or np.size(leaf) > max_size:
                    continue
                short = name.replace("['attn']['bias']['values']", "").replace(".value", "")
                found.append(f"    {short} {np.array2string(np.asarray(leaf), precision=3)}")
            if found:
                lines.append(f"{family_dir.name} seed {seed} (step {step}):")
                lines.extend(found)
    return lines


def head_draw(workdir: pathlib.Path, results: pathlib.Path | None = None) -> tuple[int, int]:
    """(seed, strings) of the heads' random strings: the experiment's (`eval.seed`,
    `eval.head_strings` of the config in results.json, `results` or WORKDIR/results.json), so a
    row's first seed prints what results.json holds; the default config's seed (1234) and the
    evaluator's default count where the run has no results.json (or turned the scores off)."""
    from posattn.eval import registry

    strings = int(registry.get("attention").defaults["head_strings"])
    results = workdir / "results.json" if results is None else results
    try:
        ev = json.loads(results.read_text())["config"]["eval"]
        return int(ev.get("seed", 1234)), int(ev.get("head_strings", strings)) or strings
    except (OSError, ValueError, KeyError, TypeError):
        return 1234, strings


def restored_seeds(workdir: pathlib.Path):
    """Yields (row, seed, model) for each trained seed of the workdir: model is (cfg, graphdef,
    params, constants, L) restored from its checkpoint (`posattn.generate.load_model`), or the
    reason it could not be restored (a string)."""
    from length_extrapolation.report import md_name

    from posattn.generate import GenerateError, load_model

    for family_dir in sorted(p for p in workdir.iterdir() if (p / "checkpoints").is_dir()):
        for train_seed, sd in seed_dirs(family_dir):
            try:
                cfg, graphdef, params, constants, _ = load_model(sd)
                L = int(json.loads((sd / "config.json").read_text())["data"]["seq_len"])
            except (GenerateError, KeyError, ValueError) as e:
                yield md_name(family_dir.name), train_seed, f"not restored ({e})"
                continue
            yield md_name(family_dir.name), train_seed, (cfg, graphdef, params, constants, L)


def head_lines(workdir: pathlib.Path) -> list[str]:
    """Each trained seed's previous-token and induction scores per layer and head
    (`posattn.eval.attention_stats.head_scores`) on the random strings of L / 2 tokens written
    twice that the experiment's attention evaluator draws (`repeated_strings`, `head_draw`)."""
    from posattn.eval.attention_stats import head_scores, repeated_strings

    seed, count = head_draw(workdir)
    lines = [
        "| row | seed | layer | previous-token weight, by head | induction weight, by head |",
        "|---|---:|---:|---|---|",
    ]
    for row, train_seed, model in restored_seeds(workdir):
        if isinstance(model, str):
            lines.append(f"| {row} | {train_seed} | {model} | | |")
            continue
        cfg, graphdef, params, constants, L = model
        tokens = repeated_strings(np.random.default_rng(seed), count, L // 2, cfg.vocab_size)
        scores = head_scores(graphdef, params, constants, tokens, period=L // 2)
        for layer, (prev, ind) in enumerate(
            zip(scores["previous_token"], scores["induction"], strict=True)
        ):
            lines.append(
                f"| {row} | {train_seed} | {layer} | "
                f"{' '.join(f'{x:.2f}' for x in prev)} | {' '.join(f'{x:.2f}' for x in ind)} |"
            )
    return lines


def passkey_draw(workdir: pathlib.Path) -> dict:
    """The passkey probe's settings as the experiment drew it at L (results.json's `passkey` and
    `eval` sections, the evaluators' defaults where the run has no results.json)."""
    from posattn.eval import registry

    try:
        config = json.loads((workdir / "results.json").read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        config = {}
    settings = registry.settings_of(registry.get("passkey"), config)
    if settings is None:  # the run turned the probe off; read it as the default would
        settings = dict(registry.get("passkey").defaults)
    ev = config.get("eval") or {}
    multiples = ev.get("multiples") or [1, 2, 4, 8, 16]
    settings.update(seed=int(ev.get("seed", 1234)), batch_size=int(ev.get("batch_size", 8)))
    settings["lengths"] = [int(x) for x in ev.get("lengths") or []] or [int(m) for m in multiples]
    settings["multiples"] = not ev.get("lengths")
    return settings


def digit_lines(workdir: pathlib.Path) -> list[str]:
    """Each trained seed's passkey at L, digit by digit: the share right and where the wrong
    ones came from (`passkey_places`, pooled over the probe's depths), each cell a number per
    key digit, first to last; first, for each L, what a reader that draws one of the digits
    before each key digit at random would get (`passkey_places_at_random`)."""
    from posattn.eval.retrieval import PLACES, passkey_places, passkey_places_at_random

    draw = passkey_draw(workdir)
    probe = {
        "depths": draw["depths"],
        "samples": int(draw["samples"]),
        "digits": int(draw["digits"]),
        "seed": draw["seed"],
        "distractors": bool(draw["distractors"]),
    }
    heads = ("right", "a later key digit", "an earlier key digit", "another digit", "no digit")

    def cells(places) -> str:
        return " | ".join(" ".join(f"{x:.2f}" for x in places[k].mean(axis=0)) for k in PLACES)

    at_random: dict[int, str] = {}
    lines = []
    for row, train_seed, model in restored_seeds(workdir):
        if isinstance(model, str):
            lines.append(f"| {row} | {train_seed} | {model} |" + " |" * (len(heads) - 1))
            continue
        _, graphdef, params, constants, L = model
        longest = max(draw["lengths"]) * (L if draw["multiples"] else 1)
        places = passkey_places(
            graphdef,
            params,
            constants,
            length=L,
            batch_tokens=draw["batch_size"] * longest,
            **probe,
        )
        lines.append(f"| {row} | {train_seed} | {cells(places)} |")
        if L not in at_random:
            chance = passkey_places_at_random(length=L, **probe)
            at_random[L] = f"| a digit before it, at random (L = {L}) | | {cells(chance)} |"
    header = ["| row | seed | " + " | ".join(heads) + " |", "|---|---:|" + "---|" * len(heads)]
    return header + list(at_random.values()) + lines


def not_a_directory(workdir: pathlib.Path) -> bool:
    """Whether `workdir` is not a directory, saying so on stderr (the scripts' first check)."""
    if workdir.is_dir():
        return False
    print(
        f"{workdir} is not a directory: pass a length_extrapolation.py --workdir", file=sys.stderr
    )
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workdir", type=pathlib.Path, help="a length_extrapolation.py workdir")
    parser.add_argument(
        "--params", action="store_true", help="also print the learned position parameters"
    )
    parser.add_argument(
        "--heads",
        action="store_true",
        help="also print each head's previous-token and induction weight (a workdir only)",
    )
    parser.add_argument(
        "--length",
        type=int,
        default=None,
        help="the eval length to read (default: L), with the text's change from L",
    )
    parser.add_argument(
        "--digits",
        action="store_true",
        help="also print where each digit of the passkey at L came from (a workdir only)",
    )
    args = parser.parse_args(argv)
    if not_a_directory(args.workdir):
        return 2
    try:
        lines = seed_lines(args.workdir, args.length)
    except TableError as e:
        print(e, file=sys.stderr)
        return 2
    if len(lines) == 2:  # the header alone
        print(
            f"{args.workdir} holds no per-seed evaluations (<family>/evaluations/*.json): "
            "pass the --workdir of a finished length_extrapolation.py run",
            file=sys.stderr,
        )
        return 2
    at = "L" if args.length is None else f"length {args.length}"
    print(f"At {at} (chance: passkey ln 10 = {LN10:.2f} a digit, induction ln 26 = {LN26:.2f})")
    print("\n".join(lines))
    if args.params:
        print("\nLearned position parameters (attention biases of at most 16 numbers):")
        print("\n".join(param_lines(args.workdir)) or "    none")
    if args.heads:
        print(
            "\nHeads at L on random strings of L / 2 letters written twice (Olsson et al. 2022): "
            "the weight on the previous token, and on the token after the query's earlier "
            "occurrence"
        )
        print("\n".join(head_lines(args.workdir)))
    if args.digits:
        print(
            "\nThe passkey at L, digit by digit (first to last, both depths): the share right, "
            "and where the wrong ones came from"
        )
        print("\n".join(digit_lines(args.workdir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
