"""Cost of the length-extrapolation evaluation of one row, against the previous evaluation.

    PYTHONPATH=src python benchmarks/extrapolation_eval_cost.py [--family alibi] \
        [--config.key=value ...]

Times, in one process on one (untrained: cost does not depend on the weights) model of the
experiment's config: (a) the previous evaluation (the first 8192 held-out bytes at each length,
8 windows per pass, passkey 5 depths x 4 samples, copy 8 samples) and (b) the current one with the
config's `eval`, `passkey`, `induction` keys, each part separately, first call (compiles) and
second call (compiled), and prints the ratio (b) / (a); then one forward pass at the longest
length with attention "auto" against `eval.attention_impl`. Record `lscpu` model name beside
numbers.
"""

import argparse
import dataclasses
import importlib.util
import pathlib
import time

import jax
from flax import nnx

from posattn import config as config_lib
from posattn import data
from posattn.eval import attention_stats, retrieval, scoring
from posattn.eval import lengths as evaluate
from posattn.nn.model import TransformerLM
from posattn.train import steps

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _experiment():
    spec = importlib.util.spec_from_file_location(
        "length_extrapolation", ROOT / "experiments" / "length_extrapolation.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    args, overrides = parser.parse_known_args()
    config = config_lib.load_config(args.config, [o.removeprefix("--config.") for o in overrides])
    exp = _experiment()
    lengths = exp.eval_lengths(config)
    cfg = config_lib.validate(exp.family_config(config, args.family))
    graphdef, params, constants = steps.init_model(cfg, jax.random.key(0))
    # The previous evaluation read with attention_impl "auto"; the current one with eval's (as
    # the experiment's restore_model does).
    eval_cfg = dataclasses.replace(cfg, attention_impl=config.eval.attention_impl)
    eval_graphdef = nnx.graphdef(
        nnx.eval_shape(lambda: TransformerLM(eval_cfg, rngs=nnx.Rngs(params=0)))
    )
    corpus = data.load_corpus(config.data.corpus)
    text = exp.eval_text(config, corpus, lengths)
    L, ev = config.data.seq_len, config.eval
    assert cfg.attention_impl == "auto", cfg.attention_impl  # the model section's setting
    model = (eval_graphdef, params, constants)
    batch_tokens = exp._batch_tokens(config, lengths)

    def old():
        for length in lengths:
            evaluate.nll_by_position(
                graphdef,
                params,
                constants,
                corpus.val,
                length=length,
                max_tokens=8 * 16 * L,
                batch_size=8,
            )
        evaluate.passkey_accuracy(
            graphdef,
            params,
            constants,
            lengths=lengths,
            depths=[0, 0.25, 0.5, 0.75, 1],
            samples=4,
            digits=1,
            seed=0,
            batch_size=8,
        )
        evaluate.copy_accuracy(
            graphdef,
            params,
            constants,
            corpus.val,
            lengths=lengths,
            samples=8,
            segment=12,
            seed=0,
            batch_size=8,
        )

    parts = {
        "loss (both protocols)": lambda: scoring.score_lengths(
            *model,
            text.val,
            text.plan,
            lengths=lengths,
            train_len=L,
            batch_tokens=batch_tokens,
            curve_bins=ev.per_position_bins,
            sliding_max_tokens=ev.sliding_max_tokens,
        ),
        "passkey": lambda: retrieval.passkey_scores(
            *model,
            lengths=lengths,
            depths=list(config.passkey.depths),
            samples=config.passkey.samples,
            digits=config.passkey.digits,
            seed=0,
            batch_tokens=batch_tokens,
        ),
        "induction": lambda: retrieval.induction_scores(
            *model,
            text.val,
            lengths=lengths,
            gaps=exp.induction_gaps(config),
            span=config.induction.span,
            samples=config.induction.samples,
            seed=0,
            batch_tokens=batch_tokens,
        ),
        "attention stats": lambda: [
            attention_stats.attention_stats(
                *model, exp._attention_windows(text, n, ev.attention_windows), train_len=L
            )
            for n in lengths
        ],
    }
    base = _timed(old)
    print(
        f"family {args.family}, lengths {lengths}, plan: {text.plan.chunk_starts.size} chunks, "
        f"{text.plan.block_ends.size} sliding blocks"
    )
    print(f"previous evaluation: first {base[0]:.1f} s, second {base[1]:.1f} s")
    total = [0.0, 0.0]
    for name, fn in parts.items():
        t = _timed(fn)
        total = [total[0] + t[0], total[1] + t[1]]
        print(f"{name}: first {t[0]:.1f} s, second {t[1]:.1f} s")
    print(
        f"current evaluation: first {total[0]:.1f} s ({total[0] / base[0]:.2f}x the previous), "
        f"second {total[1]:.1f} s ({total[1] / base[1]:.2f}x)"
    )

    # The attention implementation alone: one pass of `eval.batch_size` windows of the longest
    # length, "auto" (the model's) against eval.attention_impl, best of 5 after compiling.
    T = lengths[-1]
    windows, _ = text.plan.windows(text.val, T)
    rows = windows[: ev.batch_size]
    for name, gd in (("auto", graphdef), (config.eval.attention_impl, eval_graphdef)):

        def one_pass(gd=gd):
            out = evaluate.token_stats(gd, params, constants, rows[:, :-1], rows[:, 1:], chunk=T)
            jax.block_until_ready(out)

        one_pass()
        best = min(_timed(one_pass)[1] for _ in range(5))
        print(f"forward pass at T = {T}, {ev.batch_size} windows, attention {name!r}: {best:.3f} s")


if __name__ == "__main__":
    main()
