"""The evaluation's forward pass (`posattn.eval.lengths.token_stats`) compiled two ways, timed
side by side: XLA:CPU's default (its GEMM library fusing elementwise neighbours into graphs)
against `lengths.forward_compiler_options()` (one library call per matrix product), and each
against the attention implementation the config asks for.

    python benchmarks/eval_forward.py [--families alibi rope] [--rounds 3] [--impls auto chunked]
    python benchmarks/eval_forward.py --families rope --impls native auto blockwise \
        --rope_remap "{'type': 'rerope', 'window': 32}"   # a remap row's forward, beside RoPE's

Per family and length of the length-extrapolation config (`configs/extrapolation.py`: L = 64,
lengths L..16L): an untrained model (cost does not depend on the weights), batches of
`eval.batch_size * 16 * L` tokens (the experiment's), compile time of the first call and the best
of `--rounds` calls after it, and the ratio default / ours. Name the CPU beside the numbers (the
first line prints it). With `--rope_remap DICT` each implementation of a RoPE family also runs
under that eval-time remap (rows `<impl> + remap`; "native" refuses a remap and is skipped).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from posattn import cli
from posattn import config as config_lib
from posattn.attention import FAR_IMPLEMENTATIONS
from posattn.eval import lengths as lengths_lib
from posattn.train import steps

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _machine import cpu_name  # noqa: E402


def _config():
    spec = importlib.util.spec_from_file_location("c", ROOT / "configs" / "extrapolation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["alibi", "rope"])
    parser.add_argument("--impls", nargs="+", default=["auto"], help="model.attention_impl")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rope_remap", default="", help="also under this remap (a dict)")
    args = parser.parse_args(argv)
    remap = cli.rope_remap(args.rope_remap)
    print(f"# {cpu_name()}; jax {jax.__version__} ({jax.default_backend()})")
    print(
        "\n| family | attention | T | compile ms: default / ours | run ms: default / ours | "
        "run default / ours |\n|---|---|---|---|---|---|"
    )
    for family in args.families:
        variants = [(impl, None) for impl in args.impls]
        if remap is not None and family == "rope":
            variants += [(impl, remap) for impl in args.impls if impl in FAR_IMPLEMENTATIONS]
        for impl, rope_remap in variants:
            config = _config()
            config.model.position = family
            config.model.attention_impl = impl
            config.model.rope_remap = rope_remap
            label = impl if rope_remap is None else f"{impl} + remap"
            L = int(config.data.seq_len)
            graphdef, params, constants = steps.init_model(
                config_lib.model_config(config), jax.random.key(0)
            )
            for T in [m * L for m in config.eval.multiples]:
                B = int(config.eval.batch_size) * 16 * L // T
                rng = np.random.default_rng(0)
                inputs, targets = (
                    jnp.asarray(rng.integers(0, 256, (B, T)), jnp.int32) for _ in "ab"
                )
                fn = functools.partial(lengths_lib._token_stats, graphdef, chunk=T)
                row = []
                for options in (None, lengths_lib.forward_compiler_options()):
                    lowered = jax.jit(fn, compiler_options=options).lower(
                        params, constants, inputs, targets
                    )
                    start = time.perf_counter()
                    compiled = lowered.compile()
                    compile_ms = (time.perf_counter() - start) * 1e3
                    jax.block_until_ready(compiled(params, constants, inputs, targets))
                    row.append([compile_ms, compiled, float("inf")])
                for _ in range(args.rounds):  # interleaved
                    for cell in row:
                        start = time.perf_counter()
                        jax.block_until_ready(cell[1](params, constants, inputs, targets))
                        cell[2] = min(cell[2], (time.perf_counter() - start) * 1e3)
                (c0, _, r0), (c1, _, r1) = row
                print(
                    f"| {family} | {label} | {T} | {c0:.0f} / {c1:.0f} | {r0:.1f} / {r1:.1f} | "
                    f"{r0 / r1:.2f}x |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
