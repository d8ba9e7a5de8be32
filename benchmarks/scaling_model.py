"""Memory of rematerialised blocks and compile time of scanned layers, from the compiler itself.

Questions: how much does `model.remat` ("full", "dots") lower the training step's peak memory,
and does `model.scan_layers` keep the step's compile time flat as the model deepens?

Run through benchmarks/scaling.py (its sections "remat" and "scan"):
    python benchmarks/scaling.py --sections remat scan

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

import functools
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
    train = config_lib.load_config("configs/tiny.py", ["train.steps=100", "train.warmup_steps=10"])
    optim = steps.OptimConfig.from_config(train.train)
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
