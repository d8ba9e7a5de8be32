"""A relative bias materialised per offset and gathered, against per (query, key) pair.

Question: a kernel that materialises the [T, S] bias ("native", "chunked") can evaluate a bias
that depends on i - j only at the T + S - 1 offsets and gather it
(`posattn.families.BiasSpec.tabulate`, on for Sandwich); how much does that save, and on the
evaluation's whole attention call?

    python benchmarks/bias_table.py [--families sandwich kerple_log t5] [--rounds 5]

Per family (the experiment's heads: 4 of 16) and length T = S of the length-extrapolation
experiment (64 .. 1024), both forms of the same bound bias, one after the other in one process: the
materialised bias alone (`masks.masked_logit_bias`, causal) and causal `attention(...,
implementation="auto")` forward on the experiment's evaluation batch (8 windows of T), best of
--rounds calls after a compile, and the ratio direct / tabulated. Name the CPU beside the numbers
(the first line prints it).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

import jax

from posattn import families
from posattn.attention import attention, masks

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _machine import cpu_name  # noqa: E402
from train_throughput import timed  # noqa: E402


def best_ms(fn, *args, rounds: int) -> float:
    """Best milliseconds of `rounds` calls after one that compiles."""
    jax.block_until_ready(fn(*args))
    return timed(fn, *args, repeats=rounds) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["sandwich"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[64, 256, 1024])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"# {cpu_name()}; jax {jax.__version__} ({jax.default_backend()})")
    print()
    print(
        "| family | T = S | bias alone: direct / tabulated ms | ratio | attention: direct / "
        "tabulated ms | ratio |"
    )
    print("|---|---:|---|---:|---|---:|")
    ctx = families.Context(num_heads=4, head_dim=16)
    for name in args.families:
        spec = families.get(name).bias
        if spec is None or not spec.relative:
            raise SystemExit(f"{name}: no relative bias to tabulate")
        bound = spec.bind(ctx, families.get(name).settings())
        params = spec.init(jax.random.key(0), ctx, families.get(name).settings())
        forms = [dataclasses.replace(bound, tabulate=t) for t in (False, True)]
        for T in args.lengths:
            q = jax.random.normal(jax.random.key(1), (8, T, 4, 16))
            bias_ms, attn_ms = [], []
            for fn in forms:
                bias = jax.jit(
                    lambda p, fn=fn, T=T: masks.masked_logit_bias(
                        (fn, p), None, 0, T, T, causal=True, kv_lengths=None, window=None
                    )[0]
                )
                attend = jax.jit(lambda q, p, fn=fn: attention(q, q, q, bias=(fn, p), causal=True))
                bias_ms.append(best_ms(bias, params, rounds=args.rounds))
                attn_ms.append(best_ms(attend, q, params, rounds=args.rounds))
            print(
                f"| {name} | {T} | {bias_ms[0]:.2f} / {bias_ms[1]:.2f} | "
                f"{bias_ms[0] / bias_ms[1]:.1f}x | {attn_ms[0]:.2f} / {attn_ms[1]:.2f} | "
                f"{attn_ms[0] / attn_ms[1]:.1f}x |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
