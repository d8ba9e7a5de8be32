"""Cost of the length-extrapolation evaluation of one row, against one plain forward pass.

    PYTHONPATH=src python benchmarks/extrapolation_eval_cost.py [--family alibi] [--smoke] \
        [--config.key=value ...]

Times, in one process on one (untrained: cost does not depend on the weights) model of the
experiment's config: (a) one forward pass over the non-overlapping windows of every length (the
least any loss evaluation reads) and (b) each evaluator of `posattn.eval.registry` the config
enables, at every length, first call (compiles) and second call (compiled), and prints the
ratio (b) / (a); then one forward pass at the longest length with attention "auto" against
`eval.attention_impl`. `--smoke` shrinks the evaluation (a check that it runs, not a
measurement). Record `lscpu` model name beside numbers.
"""

import argparse
import dataclasses
import pathlib
import sys
import time

import jax
import numpy as np
from flax import nnx

from posattn import config as config_lib
from posattn import data
from posattn.eval import heldout
from posattn.eval import lengths as lengths_lib
from posattn.nn.model import TransformerLM
from posattn.train import steps

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import length_extrapolation as exp  # noqa: E402
from length_extrapolation.run import evaluators_of  # noqa: E402

SMOKE = [
    "eval.multiples=(1,2)",
    "eval.max_tokens=256",
    "eval.sliding_tokens=128",
    "eval.sliding_max_tokens=128",
    "passkey.samples=2",
    "induction.samples=2",
]


def _timed(fn):
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    start = time.perf_counter()
    fn()
    return first, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="alibi")
    parser.add_argument("--config", default=str(ROOT / "configs" / "extrapolation.py"))
    parser.add_argument("--smoke", action="store_true")
    args, overrides = parser.parse_known_args()
    overrides = [o.removeprefix("--config.") for o in overrides] + (SMOKE if args.smoke else [])
    config = config_lib.load_config(args.config, overrides)
    lengths = exp.eval_lengths(config)
    cfg = config_lib.validate(exp.family_config(config, args.family))
    graphdef, params, constants = steps.init_model(cfg, jax.random.key(0))
    eval_cfg = dataclasses.replace(cfg, attention_impl=config.eval.attention_impl)
    eval_graphdef = nnx.graphdef(
        nnx.eval_shape(lambda: TransformerLM(eval_cfg, rngs=nnx.Rngs(params=0)))
    )
    ev = config.eval
    text = heldout.eval_text(
        data.load_corpus(config.data.corpus),
        lengths=lengths,
        max_tokens=ev.max_tokens,
        sliding_tokens=ev.sliding_tokens,
        stride=ev.sliding_stride,
        seed=ev.seed,
    )
    model = (eval_graphdef, params, constants)
    shared = {
        "train_len": int(config.data.seq_len),
        "lengths": lengths,
        "batch_tokens": int(ev.batch_size) * max(lengths),
        "seed": int(ev.seed),
    }

    def plain():
        for n in lengths:
            windows, _ = text.plan.windows(text.val, n)
            batch = max(1, shared["batch_tokens"] // n)
            for _ in lengths_lib.forward(*model, windows, batch):
                pass

    base = _timed(plain)
    print(
        f"family {args.family}, lengths {lengths}, plan: {text.plan.chunk_starts.size} chunks, "
        f"{text.plan.block_ends.size} sliding blocks"
    )
    print(f"one forward pass (baseline): first {base[0]:.1f} s, second {base[1]:.1f} s")
    total = [0.0, 0.0]
    for evaluator, own in evaluators_of(config):

        def one(evaluator=evaluator, own=own):
            for n in lengths:
                evaluator.run(model, text, n, {**own, **shared})

        t = _timed(one)
        total = [total[0] + t[0], total[1] + t[1]]
        print(f"{evaluator.name}: first {t[0]:.1f} s, second {t[1]:.1f} s ({t[1] / base[1]:.2f}x)")
    print(
        f"every evaluator: first {total[0]:.1f} s ({total[0] / base[0]:.2f}x the baseline), "
        f"second {total[1]:.1f} s ({total[1] / base[1]:.2f}x)"
    )

    # The attention implementation alone: one pass of `eval.batch_size` windows of the longest
    # length, "auto" (the model's) against eval.attention_impl, best of 5 after compiling.
    T = lengths[-1]
    windows, _ = text.plan.windows(text.val, T)
    rows = np.asarray(windows[: ev.batch_size])
    for name, gd in (("auto", graphdef), (config.eval.attention_impl, eval_graphdef)):

        def one_pass(gd=gd):
            out = lengths_lib.token_stats(gd, params, constants, rows[:, :-1], rows[:, 1:], chunk=T)
            jax.block_until_ready(out)

        one_pass()
        best = min(_timed(one_pass)[1] for _ in range(5))
        print(f"forward pass at T = {T}, {ev.batch_size} windows, attention {name!r}: {best:.3f} s")


if __name__ == "__main__":
    main()
