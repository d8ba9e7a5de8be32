"""Decode speed and KV-cache size: multi-head vs grouped vs multi-query keys/values, by
context.

    python benchmarks/decode.py [--d_model 256] [--num_layers 4] [--num_heads 8] [--batch 4]
        [--contexts 512,2048,8192] [--steps 32] [--position rope] [--json out.json]

For each context length C and each key/value grouping (K = N multi-head, K = N/4 grouped, K = 1
multi-query; plus multi-head with cross-layer sharing of 2), a cache of capacity C + steps is
filled to C positions with random keys/values (their values do not change the cost) and `steps`
greedy decode steps run in one jitted `lax.scan` (`posattn.nn.decode.decode_loop`). Reported:
tokens/s (batch x steps / best wall time of `--repeats` rounds, compile excluded), the cache's
bytes, and both relative to multi-head attention at the same context, measured in this process
(absolute numbers on a shared machine are noise; the ratios are what to read).

`--dynamic` adds RoPE with dynamic NTK (m_l = C / 2, so every step is past it) under the three
`dynamic_ntk` modes: "exact" recomputes the prefix each step, "rerotate" rotates every cached key
each step, "hf" keeps the cache as written. Variants of one context are timed round-robin.

`--window W` adds sliding-window layers (`model.layer_pattern`): RoPE with window W on every
layer (Mistral), three windowed layers per global NoPE layer (Command A), and FoX on every layer
(its cache also keeps float32 log f per key and head). A windowed layer's cache is a ring of W
rows, so its bytes stop growing with the context. `--quick` is a smoke run at tiny sizes (a few
seconds of compute; its timings mean nothing, its bytes are exact).

`--staleness WORKDIR` instead measures what the dynamic-NTK modes cost in accuracy, on a RoPE
model trained by `posattn.train` (at data.seq_len = m_l) and held-out text of `--text_len` tokens:
each mode's cached logits against the full-forward oracle of every prefix (max |logit error|) and
the mean next-token loss past m_l, beside plain RoPE without scaling.

The numbers in docs/decoding.md come from this script; the command is printed with the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from posattn import data as data_lib
from posattn.config import ModelConfig
from posattn.eval import lengths as evaluate
from posattn.generate import load_model
from posattn.nn import decode
from posattn.train import steps


def filled_cache(
    cfg: ModelConfig, *, batch: int, context: int, capacity: int, dynamic_ntk: str, key
):
    """A cache holding `context` positions of random keys/values (and tokens, if it keeps them)."""
    cache = decode.init_cache(cfg, batch_size=batch, capacity=capacity, dynamic_ntk=dynamic_ntk)
    keys = jax.random.split(key, 2 * len(cache.k) + 1)
    # keys[::2] has one key more than cache.k: the last one, keys[-1], is the tokens' key.
    k = tuple(
        jax.random.normal(kk, x.shape, x.dtype) for kk, x in zip(keys[::2], cache.k, strict=False)
    )
    v = tuple(
        jax.random.normal(kk, x.shape, x.dtype) for kk, x in zip(keys[1::2], cache.v, strict=True)
    )
    tokens = (
        None
        if cache.tokens is None
        else jax.random.randint(keys[-1], cache.tokens.shape, 0, cfg.vocab_size)
    )
    return dataclasses.replace(
        cache, k=k, v=v, tokens=tokens, lengths=jnp.full((batch,), context, jnp.int32)
    )


def prepare(
    cfg: ModelConfig, *, batch: int, context: int, num_steps: int, dynamic_ntk: str = "exact"
):
    """(a compiled zero-argument run of `num_steps` decode steps, the cache's bytes, the
    formula's)."""
    graphdef, params, constants = steps.init_model(cfg, jax.random.key(0))
    capacity = context + num_steps
    cache = filled_cache(
        cfg,
        batch=batch,
        context=context,
        capacity=capacity,
        dynamic_ntk=dynamic_ntk,
        key=jax.random.key(1),
    )
    loop = jax.jit(functools.partial(decode.decode_loop, graphdef, steps=num_steps))
    first = jnp.zeros((batch,), jnp.int32)

    def run():
        return jax.block_until_ready(loop(params, constants, cache, first, jax.random.key(2)))

    run()  # compile
    return run, cache.nbytes, decode.cache_bytes(cfg, batch_size=batch, capacity=capacity)


def best_times(runs: list, repeats: int) -> list[float]:
    """Best wall time of each run over `repeats` rounds, interleaved so that load drifts hit all
    alike."""
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            start = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def staleness(workdir: str, *, text_len: int, batch: int, factor: float) -> list[dict]:
    """Accuracy of the dynamic-NTK modes on held-out text (see the module docstring)."""
    cfg, _, params, _, step = load_model(workdir)
    config = json.loads(open(f"{workdir}/config.json").read())
    m_l = int(config["data"]["seq_len"])
    if not cfg.family.rotary:
        raise SystemExit(f"--staleness needs a RoPE model; {workdir} holds {cfg.position!r}")
    corpus = data_lib.load_corpus(config["data"]["corpus"])
    windows = jnp.asarray(
        data_lib.eval_windows(corpus.val, seq_len=text_len, max_windows=batch)
    )  # (B, T+1)
    inputs, targets = windows[:, :-1], windows[:, 1:]
    prompt = m_l // 2
    rows = []

    def nll(logits, t):  # logits (B, n, V) predicting targets[:, t:t+n]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, targets[:, t : t + logits.shape[1], None], axis=-1)[
            ..., 0
        ]

    def prefix_oracle(model):  # the full forward of every prefix, last position each: (B, T, V)
        lengths = jnp.arange(1, text_len + 1)
        out = jax.lax.map(
            lambda n: model(inputs, kv_lengths=jnp.full((batch,), n))[:, n - 1], lengths
        )
        return out.transpose(1, 0, 2)

    for name, scaling in (
        ("plain RoPE (no scaling)", None),
        (
            "dynamic NTK",
            {"rope_type": "dynamic", "factor": factor, "original_max_position_embeddings": m_l},
        ),
    ):
        # The trained parameters under eval-time scaling (its frequencies live in graph and
        # constants).
        graphdef, constants = evaluate.with_rope_scaling(cfg, scaling)
        c = cfg.replace(rope_scaling=scaling)

        @jax.jit
        def oracle_fn(params, constants, graphdef=graphdef):
            return prefix_oracle(nnx.merge(graphdef, params, constants))

        oracle = oracle_fn(params, constants)
        past = slice(m_l, text_len)  # positions whose prefix is longer than m_l
        rows.append(
            {
                "model": name,
                "mode": "full forward (oracle)",
                "max_logit_error": 0.0,
                "loss_past_m_l": float(jnp.mean(nll(oracle, 0)[:, past])),
            }
        )
        for mode in decode.DYNAMIC_NTK_MODES if scaling else ():

            @jax.jit
            def cached_fn(params, constants, graphdef=graphdef, c=c, mode=mode):
                cache = decode.init_cache(c, batch_size=batch, capacity=text_len, dynamic_ntk=mode)
                first, cache = decode.prefill(
                    graphdef,
                    params,
                    constants,
                    cache,
                    inputs[:, :prompt],
                    jnp.full((batch,), prompt),
                )

                def body(cache, tok):
                    logits, cache = decode.decode_step(graphdef, params, constants, cache, tok)
                    return cache, logits

                _, rest = jax.lax.scan(body, cache, inputs[:, prompt:].T)
                return jnp.concatenate(
                    [first[:, None], rest.transpose(1, 0, 2)], axis=1
                )  # (B, T-P+1, V)

            got = cached_fn(params, constants)
            want = oracle[:, prompt - 1 :]
            rows.append(
                {
                    "model": name,
                    "mode": mode,
                    "max_logit_error": float(jnp.max(jnp.abs(got - want))),
                    "loss_past_m_l": float(jnp.mean(nll(got, prompt - 1)[:, m_l - prompt + 1 :])),
                }
            )
        print(f"{name}: done", flush=True)
    print(
        f"\n{workdir} (step {step}, {cfg.position}, m_l = data.seq_len = {m_l}), "
        f"{batch} held-out windows of {text_len} tokens, prompt {prompt}, factor {factor}\n"
    )
    print("| model | cache | max abs logit error vs oracle | loss past m_l (nats/token) |")
    print("|---|---|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['mode']} | {r['max_logit_error']:.2e} | "
            f"{r['loss_past_m_l']:.4f} |"
        )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--num_layers", type=int, default=4)
    p.add_argument("--num_heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--contexts", default="512,2048,8192")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--position", default="rope")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--dynamic", action="store_true", help="also time dynamic NTK's three modes")
    p.add_argument("--json", default=None, help="write the rows to this file")
    p.add_argument("--window", type=int, default=0, help="also time sliding-window layers and FoX")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one round: a smoke run")
    p.add_argument(
        "--staleness",
        default=None,
        metavar="WORKDIR",
        help="measure the dynamic-NTK modes' accuracy",
    )
    p.add_argument("--text_len", type=int, default=256)
    p.add_argument("--factor", type=float, default=2.0)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.d_model, args.num_layers, args.num_heads, args.batch = 32, 4, 4, 2
        args.contexts, args.steps, args.repeats = "64,256", 4, 1
        args.window = args.window or 32
    if args.staleness:
        rows = staleness(
            args.staleness, text_len=args.text_len, batch=args.batch, factor=args.factor
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "command": " ".join(
                            ["python benchmarks/decode.py", *(argv or sys.argv[1:])]
                        ),
                        "rows": rows,
                    },
                    f,
                    indent=2,
                )
        return 0

    N = args.num_heads
    base = ModelConfig.from_keys(
        position=args.position,
        d_model=args.d_model,
        num_layers=args.num_layers,
        num_heads=N,
        num_kv_heads=N,
        dtype=args.dtype,
        max_len=max(int(c) for c in args.contexts.split(",")) * 2,
    )
    grouped = N // 4 if N >= 8 else N // 2
    variants = [
        ("multi-head", dict(num_kv_heads=N), "exact"),
        (f"grouped K={grouped}", dict(num_kv_heads=grouped), "exact"),
        ("multi-query", dict(num_kv_heads=1), "exact"),
        ("multi-head, kv_share=2", dict(num_kv_heads=N, kv_share=2), "exact"),
    ]
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        todo = list(variants)
        if args.window:
            w = args.window
            todo += [
                (f"window {w}, every layer", dict(layer_pattern=(f"rope:window={w}",)), "exact"),
                (
                    f"window {w}, 3 per global",
                    dict(layer_pattern=(f"rope:window={w}",) * 3 + ("nope",)),
                    "exact",
                ),
                ("FoX, every layer", dict(position="fox"), "exact"),
            ]
        if args.dynamic and base.family.rotary:
            scaling = (
                ("factor", 2.0),
                ("original_max_position_embeddings", context // 2),
                ("rope_type", "dynamic"),
            )
            todo += [
                (f"multi-head, dynamic NTK {mode}", dict(rope_scaling=scaling), mode)
                for mode in decode.DYNAMIC_NTK_MODES
            ]
        prepared = [
            prepare(
                base.replace(**change),
                batch=args.batch,
                context=context,
                num_steps=args.steps,
                dynamic_ntk=mode,
            )
            for _, change, mode in todo
        ]
        times = best_times([run for run, _, _ in prepared], args.repeats)
        for (name, _, _), (_, nbytes, formula), seconds in zip(todo, prepared, times, strict=True):
            rows.append(
                {
                    "context": context,
                    "variant": name,
                    "tokens_per_s": args.batch * args.steps / seconds,
                    "cache_bytes": nbytes,
                    "cache_bytes_formula": formula,
                    "speed_vs_mha": times[0] / seconds,
                    "bytes_vs_mha": nbytes / prepared[0][1],
                }
            )
            print(_line(rows[-1]), flush=True)

    command = "python benchmarks/decode.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(
        f"\n{command}\n{jax.devices()[0].device_kind}, d_model={args.d_model}, "
        f"layers={args.num_layers}, heads={N}, batch={args.batch}, {args.steps} steps, "
        f"{args.dtype}, position={args.position}\n"
    )
    print("| context | keys/values | tokens/s | vs multi-head | cache MiB | vs multi-head |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['context']} | {r['variant']} | {r['tokens_per_s']:,.0f} | "
            f"{r['speed_vs_mha']:.2f}x | {r['cache_bytes'] / 2**20:,.1f} | "
            f"{r['bytes_vs_mha']:.3f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"command": command, "device": jax.devices()[0].device_kind, "rows": rows},
                f,
                indent=2,
            )
    if any(r["cache_bytes"] != r["cache_bytes_formula"] for r in rows):
        raise AssertionError("an allocated cache differs from decode.cache_bytes")
    return 0


def _line(r: dict) -> str:
    return (
        f"C={r['context']:>6} {r['variant']:<26} {r['tokens_per_s']:>10,.0f} tok/s "
        f"({r['speed_vs_mha']:.2f}x)  "
        f"cache {r['cache_bytes'] / 2**20:8.1f} MiB ({r['bytes_vs_mha']:.3f})"
    )


if __name__ == "__main__":
    sys.exit(main())
