"""Memory of rematerialised blocks and compile time of scanned layers, from the compiler itself.

Questions: how much does `model.remat` ("full", "dots") lower the training step's peak memory,
and does `model.scan_layers` keep the step's compile time flat as the model deepens?

Run (from the repository root):
    .venv/bin/python benchmarks/scaling_model.py                 # both tables
    .venv/bin/python benchmarks/scaling_model.py --only remat    # or --only scan

Both measure `posattn.train.steps.train_step` (AdamW, clipping, metrics) jitted with donated
state, as `posattn.train` runs it, lowered from abstract shapes (nothing is allocated or run):
  remat_memory       one step at --remat-shape (d_model, layers, batch, length; RoPE, bytes),
                     compiled for "none", "full" and "dots", with the layers unrolled (loop) and
                     scanned (`model.scan_layers`); `compiled.memory_analysis()` gives
                     the temporaries (activations kept for the backward, workspace) and the peak
                     (arguments + outputs - donated aliases + temporaries). Ratios are against
                     "none" in the same process.
  scan_compile_times wall-clock seconds of `jit(...).lower(...).compile()` (tracing included) at
                     4 and 32 layers (--layers), loop and scanned layouts, d_model --scan-d-model,
                     best of --rounds (each round a fresh jit of a new graph definition, so
                     nothing is cached).
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from posattn import config as config_lib
from posattn.nn.model import TransformerLM
from posattn.train import steps


def _cfg(**model) -> config_lib.ModelConfig:
    config = config_lib.load_config(
        "configs/tiny.py", [f"--config.model.{k}={v}" for k, v in model.items()]
    )
    return config_lib.validate(config)


def _compile_step(cfg: config_lib.ModelConfig, batch: int, length: int):
    """(compiled train step, seconds to trace, lower and compile it) from abstract shapes."""
    optim = steps.OptimConfig(total_steps=100, warmup_steps=10)
    tx = steps.make_optimizer(optim)
    start = time.perf_counter()
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(params=0))))
    state = jax.eval_shape(functools.partial(steps.init_train_state, cfg, tx), jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    step = jax.jit(functools.partial(steps.train_step, graphdef, optim), donate_argnums=0)
    compiled = step.lower(state, {"inputs": tokens, "targets": tokens}).compile()
    return compiled, time.perf_counter() - start


def remat_memory(d_model=128, layers=8, batch=8, length=256, scan_layers=False) -> list[dict]:
    """Temporaries and peak bytes of one step per `model.remat`, and their ratios to "none"."""
    rows = []
    for remat in ("none", "full", "dots"):
        cfg = _cfg(
            d_model=d_model,
            num_layers=layers,
            num_heads=max(1, d_model // 64),
            num_kv_heads=max(1, d_model // 64),
            remat=remat,
            scan_layers=scan_layers,
        )
        compiled, _ = _compile_step(cfg, batch, length)
        m = compiled.memory_analysis()
        peak = (
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            - m.alias_size_in_bytes
            + m.temp_size_in_bytes
        )
        rows.append(
            {"layout": "scan" if scan_layers else "loop", "remat": remat}
            | {"temp": m.temp_size_in_bytes, "peak": peak}
        )
    for row in rows:
        row["temp_ratio"] = row["temp"] / rows[0]["temp"]
        row["peak_ratio"] = row["peak"] / rows[0]["peak"]
    return rows


def scan_compile_times(layers=(4, 32), d_model=64, batch=4, length=64, rounds=1) -> list[dict]:
    """Seconds to trace, lower and compile one step, loop vs scanned layers, per depth."""
    rows = []
    for depth in layers:
        row = {"layers": depth}
        for layout, scan in (("loop", False), ("scan", True)):
            times = []
            for r in range(rounds):
                # A distinct init_scale per round: a new graph definition, so no cache is hit.
                cfg = _cfg(
                    d_model=d_model, num_layers=depth, scan_layers=scan, init_scale=1.0 + r / 1000
                )
                times.append(_compile_step(cfg, batch, length)[1])
            row[layout] = min(times)
        rows.append(row)
    return rows


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(
            line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line
        )
    except (OSError, StopIteration):
        return "unknown"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("remat", "scan"))
    parser.add_argument(
        "--remat-shape",
        type=int,
        nargs=4,
        default=(128, 8, 8, 256),
        metavar=("D", "LAYERS", "B", "T"),
    )
    parser.add_argument("--layers", type=int, nargs="+", default=(4, 32))
    parser.add_argument("--scan-d-model", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    print(f"# {' '.join(sys.argv)}")
    print(f"# {jax.devices()[0].platform}: {_cpu()}, jax {jax.__version__}")
    if args.only in (None, "remat"):
        D, L, B, T = args.remat_shape
        print(f"\nremat: train step, d_model {D}, {L} layers, batch {B}, length {T} (RoPE, bytes)")
        print(
            f"{'layout':>6} {'remat':>6} {'temp MiB':>10} {'peak MiB':>10} {'temp/none':>10} "
            f"{'peak/none':>10}"
        )
        rows = remat_memory(D, L, B, T) + remat_memory(D, L, B, T, scan_layers=True)
        for r in rows:
            print(
                f"{r['layout']:>6} {r['remat']:>6} "
                f"{r['temp'] / 2**20:10.1f} {r['peak'] / 2**20:10.1f} "
                f"{r['temp_ratio']:10.3f} {r['peak_ratio']:10.3f}"
            )
    if args.only in (None, "scan"):
        print(
            f"\nscan_layers: seconds to trace + compile the train step, d_model "
            f"{args.scan_d_model}, best of {args.rounds}"
        )
        rows = scan_compile_times(tuple(args.layers), args.scan_d_model, rounds=args.rounds)
        print(f"{'layers':>6} {'loop s':>8} {'scan s':>8} {'loop/scan':>10}")
        for r in rows:
            print(
                f"{r['layers']:>6} {r['loop']:8.2f} {r['scan']:8.2f} {r['loop'] / r['scan']:10.2f}"
            )
        if len(rows) > 1:
            first, last = rows[0], rows[-1]
            print(
                f"growth {first['layers']} -> {last['layers']} layers: loop "
                f"{last['loop'] / first['loop']:.2f}x, scan {last['scan'] / first['scan']:.2f}x"
            )


if __name__ == "__main__":
    main()
