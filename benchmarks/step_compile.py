"""What XLA:CPU spends compiling a training step, part by part.

Question: most of the test suite's time, and a run's start, is XLA compiling (docs/benchmarks.md,
"The test suite's time"); of a training step's compile, how much is the model's forward pass, its
gradient, and the optimiser's update, and how many fused kernels does each make?

Run (from the repository root):
    python benchmarks/step_compile.py                                  # tiny and small, 4 families
    python benchmarks/step_compile.py --configs tiny --families rope fire --repeats 3

For each (config, family) of `benchmarks/train_throughput.py`'s configs, it lowers and compiles,
with XLA's in-memory and persistent caches cleared before each compile so that every one is a
real compile:
  * "step": `posattn.train.steps.train_step` as `posattn.train` jits it (donated state);
  * "forward": the step's loss alone (`steps.loss_fn`);
  * "gradient": `jax.value_and_grad` of that loss;
  * "update": the optimiser alone on a given gradient (`tx.update`, `optax.apply_updates` and the
    bounds' projection, as in the step);
  * "init": the run's initialisation (`steps.jit_init_train_state`, compiled as a run compiles it).
Printed: the best compile seconds over --repeats, the kernels XLA runs at the program's top level
(fused loops and library calls: `fusion`, `custom-call` and `dot` instructions of the entry
computation), the scratch each run of it allocates (`compiled.memory_analysis()
.temp_size_in_bytes`: over 32 MiB, glibc maps it afresh every run, `posattn.hostmem`) and the
parameter leaves. Seconds vary with the machine and its load: compare rows
within one run.
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import re
import sys
import time

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import train_throughput  # noqa: E402  (its configs: the shapes docs/benchmarks.md measures)
from _machine import cpu_name  # noqa: E402

from posattn.train import steps  # noqa: E402

_KERNEL = re.compile(r"= \S+ (fusion|custom-call|dot)\(")


def entry_kernels(compiled) -> int:
    text = compiled.as_text()
    return len(_KERNEL.findall(text[text.index("ENTRY") :]))


def compile_seconds(lower, repeats: int) -> tuple[float, int, int]:
    """(best seconds to lower and compile a program from scratch, its top-level kernels, the
    scratch bytes it allocates on each run); `lower()` returns the program lowered."""
    best, compiled = float("inf"), None
    for _ in range(repeats):
        jax.clear_caches()
        start = time.perf_counter()
        compiled = lower().compile()
        best = min(best, time.perf_counter() - start)
    return best, entry_kernels(compiled), compiled.memory_analysis().temp_size_in_bytes


def parts(config_name: str, family: str):
    """(parameter leaves, [(part, lower)]) of one (config, family): `lower()` lowers the part."""
    config, cfg, optim, tx, graphdef = train_throughput.step_setup(config_name, family)
    init = steps.jit_init_train_state(cfg, tx)
    key = jax.random.key(0)
    state = init(key)
    tokens = jnp.zeros((int(config.train.batch_size), int(config.data.seq_len)), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}

    def forward(state, batch):
        return steps.loss_fn(state["params"], state["constants"], graphdef, batch)

    def gradient(state, batch):
        return jax.value_and_grad(steps.loss_fn)(
            state["params"], state["constants"], graphdef, batch
        )

    def update(state, grads):
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return steps.project_bounds(optax.apply_updates(state["params"], updates)), opt_state

    step = jax.jit(functools.partial(steps.train_step, graphdef, optim), donate_argnums=0)
    return len(jax.tree.leaves(state["params"])), [
        ("step", lambda: step.lower(state, batch)),
        ("forward", lambda: jax.jit(forward).lower(state, batch)),
        ("gradient", lambda: jax.jit(gradient).lower(state, batch)),
        ("update", lambda: jax.jit(update).lower(state, state["params"])),
        ("init", lambda: init.lower(key)),
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["tiny", "small"])
    parser.add_argument("--families", nargs="+", default=["rope", "alibi", "t5", "fire"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)
    print(
        f"# {cpu_name()}, {os.cpu_count()} cores; jax {jax.__version__} "
        f"({jax.default_backend()}); best of {args.repeats} compiles a part"
    )
    print()
    print(
        "| config | family | parameter leaves | part | compile s | kernels | share of the step "
        "| scratch bytes |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|")
    for config_name in args.configs:
        for family in args.families:
            leaves, programs = parts(config_name, family)
            step = None
            for name, lower in programs:
                seconds, kernels, scratch = compile_seconds(lower, args.repeats)
                step = step or seconds
                print(
                    f"| {config_name} | {family} | {leaves} | {name} | {seconds:.2f} | {kernels} "
                    f"| {seconds / step:.0%} | {scratch:,} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
