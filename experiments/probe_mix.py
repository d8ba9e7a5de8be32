"""Which training mix makes the retrieval probes learnable at L: a few families trained under the
length-extrapolation config (`configs/extrapolation.py`) with different probe rows, scored at L.

    python experiments/probe_mix.py --workdir runs/probe_mix --families rope,alibi,nope \
        --mixes default,w8,lean8,lean4,ind8,pk8 --only-trained      # the README's table
    python experiments/probe_mix.py --workdir runs/probe_mix_4000 --families rope \
        --mixes lean4 --steps 4000                                   # its 4000-step row

A mix is a set of `data` keys (`MIXES`: `passkey_fraction`, `induction_fraction`,
`probe_weight`); everything else is the experiment's default training (2000 steps, L = 64, one
seed, `train.seed` 0). Each (mix, family) trains once in `WORKDIR/<mix>/<family>/` (a finished
run is reused; an interrupted one resumes) and is scored at L on:

* held-out text: the experiment's evaluation text at L (`posattn.eval.heldout.eval_text` with the
  default `eval.*` settings: the same bytes as the experiment's loss at L), nats per byte with a
  95% bootstrap interval over held-out files, and the paired change against the first mix;
* passkey: 4-digit keys among distractor numbers at depths 0 and 1 (the experiment's probe; its
  first 32 samples a depth are the experiment's), NLL per key digit (chance ln 10 = 2.30) and the
  share of digits right;
* induction: an 8-letter random string repeated after L/2 bytes of held-out text (the
  experiment's probe, same sampling), NLL per letter of the repeat but its first (chance over
  letters ln 26 = 3.26) and argmax accuracy.

Probe intervals are mean +- 1.96 standard errors over the samples (independent draws). The table
goes to stdout and `WORKDIR/probe_mix-<mixes>.json`. experiments/README.md ("Probe rows that teach
retrieval at L") has the measured table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys
import time

import numpy as np

from posattn import hostmem

if __name__ == "__main__":
    hostmem.reexec_with_malloc_tunables()  # first, before JAX starts (posattn.hostmem)

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

from length_extrapolation import settings as settings_lib  # noqa: E402
from length_extrapolation import training as training_lib  # noqa: E402

from posattn import data as data_lib  # noqa: E402
from posattn.data import probes  # noqa: E402
from posattn.eval import heldout, intervals, scoring  # noqa: E402
from posattn.eval import lengths as lengths_lib  # noqa: E402
from posattn.train import train_and_evaluate  # noqa: E402

# name -> data keys. "default" is configs/extrapolation.py as it was before `data.probe_weight`
# (weight 1); "pk8" is its default since.
MIXES = {
    "text": dict(passkey_fraction=0.0, induction_fraction=0.0, probe_weight=1.0),
    "default": dict(passkey_fraction=0.2, induction_fraction=0.0, probe_weight=1.0),
    "ind": dict(passkey_fraction=0.2, induction_fraction=0.2, probe_weight=1.0),
    "w4": dict(passkey_fraction=0.2, induction_fraction=0.2, probe_weight=4.0),
    "w8": dict(passkey_fraction=0.2, induction_fraction=0.2, probe_weight=8.0),
    "w16": dict(passkey_fraction=0.2, induction_fraction=0.2, probe_weight=16.0),
    "ind0.5": dict(passkey_fraction=0.2, induction_fraction=0.5, probe_weight=1.0),
    "lean8": dict(passkey_fraction=0.1, induction_fraction=0.1, probe_weight=8.0),
    "lean4": dict(passkey_fraction=0.1, induction_fraction=0.1, probe_weight=4.0),
    "lean16": dict(passkey_fraction=0.1, induction_fraction=0.1, probe_weight=16.0),
    "ind8": dict(passkey_fraction=0.1, induction_fraction=0.2, probe_weight=8.0),
    "pk8": dict(passkey_fraction=0.2, induction_fraction=0.0, probe_weight=8.0),
    "s24": dict(passkey_fraction=0.2, induction_fraction=0.2, probe_weight=8.0, induction_span=24),
    "s24w4": dict(
        passkey_fraction=0.2, induction_fraction=0.2, probe_weight=4.0, induction_span=24
    ),
    "s24p1": dict(
        passkey_fraction=0.1, induction_fraction=0.2, probe_weight=8.0, induction_span=24
    ),
    "s24p3i3": dict(
        passkey_fraction=0.3, induction_fraction=0.3, probe_weight=8.0, induction_span=24
    ),
    "s24i3w12": dict(
        passkey_fraction=0.2, induction_fraction=0.3, probe_weight=12.0, induction_span=24
    ),
    "s24i3": dict(
        passkey_fraction=0.2, induction_fraction=0.3, probe_weight=8.0, induction_span=24
    ),
}


def _experiment_config():
    spec = importlib.util.spec_from_file_location(
        "extrapolation", ROOT / "configs" / "extrapolation.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def _mean_ci(values: np.ndarray) -> tuple[float, float]:
    """(mean, half-width of the 95% normal interval) over independent samples."""
    return float(values.mean()), float(1.96 * values.std(ddof=1) / np.sqrt(values.size))


def _probe(graphdef, params, constants, made, scored: list[slice], batch_tokens: int) -> dict:
    """Per-sample mean NLL and argmax accuracy over each sample's scored tokens."""
    seqs = np.stack([m.tokens for m in made]).astype(np.int32)  # (n, T + 1)
    batch = scoring.windows_per_pass(seqs.shape[1] - 1, batch_tokens)
    nll, pred = map(
        np.concatenate,
        zip(*lengths_lib.forward(graphdef, params, constants, seqs, batch), strict=True),
    )  # (n, T) each
    loss, acc = [], []
    for r, (m, where) in enumerate(zip(made, scored, strict=True)):
        positions = probes.target_positions(where)
        loss.append(nll[r, positions].mean())
        acc.append((pred[r, positions] == m.tokens[where]).mean())
    (loss_mean, loss_ci), (acc_mean, acc_ci) = _mean_ci(np.array(loss)), _mean_ci(np.array(acc))
    return {"loss": loss_mean, "loss_ci": loss_ci, "acc": acc_mean, "acc_ci": acc_ci}


def passkey_at(model, *, length: int, samples: int, seed: int, batch_tokens: int) -> dict:
    """The experiment's passkey probe at `length` (4 digits, distractors, depths 0 and 1)."""
    made = [
        probes.passkey_sample(
            np.random.default_rng([seed, length, d, s, 0xD15]),
            length=length + 1,
            depth=depth,
            digits=4,
            distractors=True,
        )
        for d, depth in enumerate((0.0, 1.0))
        for s in range(samples)
    ]
    return _probe(*model, made, [m.answer for m in made], batch_tokens)


def induction_at(model, text, *, length: int, samples: int, seed: int, batch_tokens: int) -> dict:
    """The experiment's induction probe at `length`: span 8, gap L/2 (its first gap)."""
    n, gap, made = length + 1, length // 2, []
    for s in range(samples):
        rng = np.random.default_rng([seed, length, 0, s, 0x1D])
        start = int(rng.integers(0, text.size - n))
        made.append(probes.induction_sample(rng, text[start : start + n], span=8, gap=gap))
    return _probe(
        *model, made, [slice(m.repeat.start + 1, m.repeat.stop) for m in made], batch_tokens
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, type=pathlib.Path)
    parser.add_argument("--families", default="rope,alibi,nope")
    parser.add_argument("--mixes", default="default,pk8,w8", help=f"of {sorted(MIXES)}")
    parser.add_argument("--steps", type=int, default=None, help="train.steps (default: config's)")
    parser.add_argument(
        "--learning-rate", type=float, default=None, help="train.learning_rate (default: config's)"
    )
    parser.add_argument("--samples", type=int, default=128, help="probe samples (a depth)")
    parser.add_argument(
        "--only-trained",
        action="store_true",
        help="score the runs whose last checkpoint exists, skip (and name) the others",
    )
    args = parser.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    mixes = [m for m in args.mixes.split(",") if m]
    unknown = [m for m in mixes if m not in MIXES]
    if unknown:
        parser.error(f"unknown mix(es) {unknown}; choose from {sorted(MIXES)}")

    base = _experiment_config()
    L, seed = int(base.data.seq_len), int(base.eval.seed)
    batch_tokens = int(base.eval.batch_size) * 16 * L
    corpus = data_lib.load_corpus(base.data.corpus)
    text = heldout.eval_text(
        corpus,
        lengths=[16 * L],
        max_tokens=int(base.eval.max_tokens),
        sliding_tokens=0,
        stride=L,
        seed=seed,
    )
    weights = intervals.bootstrap_weights(
        text.plan.num_units, replicates=int(base.eval.bootstrap), seed=seed
    )
    val = np.asarray(corpus.val, np.uint8)
    results, sums = [], {}
    for mix in mixes:
        for family in families:
            config = _experiment_config()
            config.data.update(MIXES[mix])
            if args.steps:
                config.train.steps = int(args.steps)
            if args.learning_rate:
                config.train.learning_rate = float(args.learning_rate)
            train_config = settings_lib.family_config(config, family)
            run_dir = args.workdir / mix / family
            if (
                args.only_trained
                and not (run_dir / "checkpoints" / str(config.train.steps)).exists()
            ):
                print(f"{mix:>8} {family:>6}  not trained (--only-trained): skipped", flush=True)
                continue
            start = time.perf_counter()
            result = train_and_evaluate(train_config, run_dir)
            if not result.get("finished"):
                raise SystemExit(f"{run_dir} stopped at step {result.get('step')}; rerun")
            seconds = time.perf_counter() - start
            _, graphdef, params, constants = training_lib.restore_model(
                train_config, run_dir, attention_impl="auto"
            )
            model = (graphdef, params, constants)
            (row,) = scoring.score_lengths(
                *model,
                text.val,
                text.plan,
                lengths=[L],
                train_len=L,
                batch_tokens=batch_tokens,
                curve_bins=4,
            )
            sums[mix, family] = (row["sum"], row["count"])
            loss, ci = intervals.ratio_interval(row["sum"][None], row["count"], weights)
            out = {
                "mix": mix,
                "family": family,
                **MIXES[mix],
                "steps": int(config.train.steps),
                "learning_rate": float(config.train.learning_rate),
                "seconds": round(seconds, 1),
                "text_loss": loss,
                "text_loss_ci": ci,
                "passkey": passkey_at(
                    model, length=L, samples=args.samples, seed=seed, batch_tokens=batch_tokens
                ),
                "induction": induction_at(
                    model,
                    val,
                    length=L,
                    samples=args.samples,
                    seed=seed,
                    batch_tokens=batch_tokens,
                ),
            }
            first = (mixes[0], family)
            if first in sums and mix != mixes[0]:
                delta, dci = intervals.paired_interval(
                    row["sum"][None], sums[first][0][None], row["count"], weights
                )
                out["text_delta"], out["text_delta_ci"] = delta, dci
            results.append(out)
            print(_line(out), flush=True)
            (args.workdir / f"probe_mix-{'-'.join(mixes)}.json").write_text(
                json.dumps(results, indent=1) + "\n"
            )
    print()
    print(table(results, mixes[0]))
    return 0


def _line(r: dict) -> str:
    p, i = r["passkey"], r["induction"]
    return (
        f"{r['mix']:>8} {r['family']:>6}  text {r['text_loss']:.3f}  passkey {p['loss']:.2f}"
        f"+-{p['loss_ci']:.2f} (acc {p['acc']:.2f})  induction {i['loss']:.2f}+-{i['loss_ci']:.2f}"
        f" (acc {i['acc']:.2f})  {r['seconds']:.0f} s"
    )


def table(results: list[dict], first: str) -> str:
    """The Markdown table of experiments/README.md."""
    lines = [
        "| mix (passkey / induction fraction, probe weight) | family | text loss at L [95%] | "
        f"Δ text vs {first} [95%] | passkey NLL per digit | passkey digit acc | "
        "induction NLL per letter | induction acc |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        p, i = r["passkey"], r["induction"]
        delta = (
            f"{r['text_delta']:+.3f} [{r['text_delta_ci'][0]:+.3f}, {r['text_delta_ci'][1]:+.3f}]"
            if "text_delta" in r
            else "-"
        )
        lines.append(
            f"| {r['mix']} ({r['passkey_fraction']:g} / {r['induction_fraction']:g}, "
            f"{r['probe_weight']:g}) | {r['family']} | {r['text_loss']:.3f} "
            f"[{r['text_loss_ci'][0]:.3f}, {r['text_loss_ci'][1]:.3f}] | {delta} | "
            f"{p['loss']:.2f} ± {p['loss_ci']:.2f} | {p['acc']:.2f} | "
            f"{i['loss']:.2f} ± {i['loss_ci']:.2f} | {i['acc']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
