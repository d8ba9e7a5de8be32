"""Which compiled training steps hold the XLA:CPU fusion that computed wrong values (jaxlib 0.10.2).

Question: XLA:CPU hands matrix products to its GEMM library in fused graphs (`ynn_fusion`), and
such a graph computed wrong values when one operand of a batched product was a scalar broadcast
and a reduction consumed the product (docs/attention.md, "Chunked", "A constant cotangent": the
chunked kernel's backward with the constant cotangent of `out.sum()`). Does any training step
posattn compiles hold that pattern?

Run (from the repository root):
    python benchmarks/fusion_audit.py                       # every family, the tiny config
    python benchmarks/fusion_audit.py --configs tiny small --families rope alibi \\
        --overrides model.attention_impl=chunked

For each (config, family) it compiles `train_step` as `benchmarks/train_throughput.py` does (its
CONFIGS over configs/tiny.py, the family as `model.position`, then --overrides), reads the
compiled HLO and lists every library fusion whose `dot` takes, as an operand, a broadcast with
no dimensions (a scalar's). It first audits two programs known to hold the pattern (the few lines
of JAX in docs/attention.md, and the chunked kernel's backward with its barrier taken out), so
that an empty list means "none found" and not "the audit matched nothing": on a jaxlib whose
fusions are named or built otherwise those self-checks fail and it says so. It compiles and
does not run: nothing is timed.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import re
import sys
from unittest import mock

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _machine import cpu_name  # noqa: E402
from train_throughput import CONFIGS, step_setup  # noqa: E402

from posattn import data, families  # noqa: E402
from posattn.attention import attention  # noqa: E402
from posattn.train import steps  # noqa: E402

_HEADER = re.compile(r"^%?([\w.-]+) \(.*\{\s*$")  # a computation's first line
_CALLER = re.compile(r"%(ynn_fusion[\w.-]*) = .*calls=%?([\w.-]+)")
_SCALAR = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = \S+ broadcast\(%?[\w.-]+\), dimensions=\{\}")
_DOT = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = (\S+) dot\(([^)]*)\)")


def computations(text: str) -> dict[str, list[str]]:
    """{name: its instruction lines} of an HLO module's text."""
    out, lines = {}, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            lines = out.setdefault(header.group(1), [])
        elif line.startswith("}"):
            lines = None
        elif lines is not None:
            lines.append(line)
    return out


def scalar_broadcast_dots(text: str) -> list[str]:
    """'fusion: dot shape' for every library fusion whose dot takes a scalar's broadcast."""
    bodies = computations(text)
    found = []
    for fusion, called in _CALLER.findall(text):
        body = bodies.get(called, [])
        scalars = {m.group(1) for m in map(_SCALAR.match, body) if m}
        for m in filter(None, map(_DOT.match, body)):
            operands = {x.strip().lstrip("%") for x in m.group(3).split(",")}
            if operands & scalars:
                found.append(f"{fusion}: {m.group(1)} {m.group(2)}")
    return found


def known_patterns() -> dict[str, list[str]]:
    """The audit of two programs that hold the pattern on jaxlib 0.10.2."""
    x = jax.ShapeDtypeStruct((2, 2, 24, 8), jnp.float32)
    p = jax.ShapeDtypeStruct((2, 2, 24, 48), jnp.float32)

    def few_lines(x, p):  # docs/attention.md's example
        return (p * jnp.einsum("bnth,bnhs->bnts", x, jnp.ones((2, 2, 8, 48)))).sum(2)

    q = jax.ShapeDtypeStruct((2, 24, 4, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 24, 2, 8), jnp.float32)

    def chunked_sum(q, k, v):
        return attention(q, k, v, causal=True, implementation="chunked").sum()

    grad = jax.jit(jax.grad(chunked_sum, argnums=(0, 1, 2)))
    with mock.patch.object(jax.lax, "optimization_barrier", lambda x: x):
        unguarded = grad.lower(q, kv, kv).compile().as_text()
    return {
        "the example of docs/attention.md": scalar_broadcast_dots(
            jax.jit(few_lines).lower(x, p).compile().as_text()
        ),
        "the chunked backward of out.sum(), without its barrier": scalar_broadcast_dots(unguarded),
    }


def train_step_text(config_name: str, family: str, overrides: list[str]) -> str:
    """The compiled HLO text of one (config, family)'s training step (compiled, not run)."""
    config, cfg, optim, tx, graphdef = step_setup(config_name, family, overrides)
    state = jax.eval_shape(steps.jit_init_train_state(cfg, tx), jax.random.key(0))
    corpus = data.load_corpus(config.data.corpus)
    options = data.batch_options(config.data, causal=cfg.causal, vocab_size=cfg.vocab_size)
    B, T = int(config.train.batch_size), int(config.data.seq_len)
    batch = data.train_batch(corpus, seed=0, step=0, batch_size=B, seq_len=T, **options)
    step = jax.jit(functools.partial(steps.train_step, graphdef, optim), donate_argnums=0)
    return step.lower(state, batch).compile().as_text()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["tiny"], choices=sorted(CONFIGS))
    parser.add_argument("--families", nargs="+", default=families.names())
    parser.add_argument("--overrides", nargs="*", default=[], help="key=value config overrides")
    args = parser.parse_args(argv)
    print(f"# {cpu_name()}; jax {jax.__version__} ({jax.default_backend()})")
    known = known_patterns()
    for name, found in known.items():
        print(f"self-check, {name}: {'; '.join(found) or 'NOT FOUND'}")
    missed = [name for name, found in known.items() if not found]
    if missed:
        print(
            "The audit does not find the pattern in programs known to hold it on jaxlib 0.10.2 "
            f"({'; '.join(missed)}): this jaxlib fuses or names its programs otherwise, and an "
            "empty list below would mean nothing."
        )
    print("\n| config | family | library fusions with a scalar's broadcast into a dot |")
    print("|---|---|---|")
    for config_name in args.configs:
        for family in args.families:
            found = scalar_broadcast_dots(train_step_text(config_name, family, args.overrides))
            print(f"| {config_name} | {family} | {'; '.join(found) or 'none'} |")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
