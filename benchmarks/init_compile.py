"""Compiling a run's initialisation: XLA:CPU's default level against the one posattn uses.

Question: how long does `posattn.train` spend compiling `init_train_state` (every run compiles it
once, before its first step), and does the faster compile (`steps.jit_init_train_state`: XLA's
backend optimisation level 1 on a CPU) give the same state? And a run that starts from given
parameters (a fine-tune, a published checkpoint: `init_train_state(..., params)`), whose drawn
parameters XLA drops, how long does its compile take?

Run (from the repository root):
    python benchmarks/init_compile.py                      # every family, both shapes
    python benchmarks/init_compile.py --families rope t5 --shapes experiment

Shapes, both from configs/tiny.py through the command-line override path:
  experiment  the length-extrapolation experiment's model (d_model 64, 2 layers, 4 / 4 heads);
  test        the test suite's small model (tests/conftest.py: d_model 32, 2 layers, 4 / 2 heads).

For each (shape, family) the state is lowered and compiled with the default options and with
posattn's, alternately, --rounds times (a new jitted function each time and JAX's persistent
cache off, so every compile is a compile); it prints the median seconds of each, their ratio,
and whether every array of the two states is bitwise equal; then the median seconds of posattn's
compile of the same initialisation given parameters (the drawn state's). With a level in XLA_FLAGS
(`--xla_backend_optimization_level=N`), "default" is that level, which posattn then keeps. The
numbers, with their machine: docs/training.md.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from posattn import config as config_lib  # noqa: E402
from posattn import families as families_lib  # noqa: E402
from posattn.train import steps  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from _machine import cpu_name  # noqa: E402

SHAPES = {
    "experiment": ["model.d_model=64", "model.num_heads=4", "model.num_kv_heads=4"],
    "test": ["model.d_model=32", "model.num_heads=4", "model.num_kv_heads=2", "data.seq_len=32"],
}


def measure(shape: str, family: str, rounds: int) -> tuple[float, float, bool, float]:
    config = config_lib.load_config(
        ROOT / "configs" / "tiny.py", [*SHAPES[shape], f"model.position={family}"]
    )
    cfg = config_lib.validate(config)
    tx = steps.make_optimizer(steps.OptimConfig.from_config(config.train))
    key = jax.random.key(int(config.train.seed))
    jitted = {
        "default": lambda: jax.jit(functools.partial(steps.init_train_state, cfg, tx)),
        # what `steps.jit_init_train_state` compiles on a CPU when XLA_FLAGS name no level
        "fast": lambda: jax.jit(
            functools.partial(steps.init_train_state, cfg, tx),
            compiler_options=steps._CPU_INIT_COMPILER_OPTIONS,
        ),
    }
    times: dict[str, list[float]] = {"default": [], "fast": [], "given": []}
    states, params = {}, None
    for _ in range(rounds):
        for name, make in jitted.items():
            lowered = make().lower(key)  # a new function each round: nothing cached in memory
            start = time.perf_counter()
            compiled = lowered.compile()
            times[name].append(time.perf_counter() - start)
            state = compiled(key)
            states[name], params = [np.asarray(x) for x in jax.tree.leaves(state)], state["params"]
        lowered = jitted["fast"]().lower(key, params)
        start = time.perf_counter()
        lowered.compile()
        times["given"].append(time.perf_counter() - start)
    same = all(np.array_equal(a, b) for a, b in zip(states["default"], states["fast"], strict=True))
    median = {name: statistics.median(t) for name, t in times.items()}
    return median["default"], median["fast"], same, median["given"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(families_lib.names()))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.families) - set(families_lib.names()))
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(families_lib.names())}")
    if jax.default_backend() != "cpu":
        parser.error(f"this measures XLA:CPU; JAX's backend here is {jax.default_backend()!r}")
    jax.config.update("jax_enable_compilation_cache", False)
    print(f"# {cpu_name()}, {len(jax.devices())} device(s), jax {jax.__version__}")
    print(
        "| shape | family | default compile (s) | posattn's (s) | ratio | same state "
        "| posattn's, parameters given (s) |"
    )
    print("|---|---|---:|---:|---:|---|---:|")
    totals = [0.0, 0.0, 0.0]
    for shape in args.shapes:
        for family in args.families:
            slow, fast, same, given = measure(shape, family, args.rounds)
            totals = [totals[0] + slow, totals[1] + fast, totals[2] + given]
            print(
                f"| {shape} | {family} | {slow:.2f} | {fast:.2f} | {slow / fast:.2f}x | "
                f"{'bitwise' if same else 'DIFFERENT'} | {given:.2f} |",
                flush=True,
            )
    print(
        f"| all | | {totals[0]:.1f} | {totals[1]:.1f} | {totals[0] / totals[1]:.2f}x | | "
        f"{totals[2]:.1f} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
