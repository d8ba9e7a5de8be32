"""The native CPU attention kernel alone: forward, and forward + backward, at fixed shapes.

Question: how long does `posattn.attention.native`'s kernel take for one layer's attention at the
shapes of `benchmarks/train_throughput.py` and at published models' head dims, and does a change
to the kernel change what it computes?

Run (from the repository root):
    python benchmarks/native_kernel.py           # training shapes; no bias, a bias, a trained bias
    python benchmarks/native_kernel.py --repeats 50
    python benchmarks/native_kernel.py --shapes h64 h128   # heads of 64 and 128
    python benchmarks/native_kernel.py --shapes step64 step128   # one query: a decoding step

Shapes [B, T, N, H]: small (16, 256, 4, 32) and tiny (32, 64, 4, 16), the training shapes of
`benchmarks/train_throughput.py` (the default), and h64 (4, 256, 8, 64) and h128 (2, 256, 8, 128),
the head dims of published models, and step64 and step128, one query (8, 1, 8, 64 or 128) over 1024
keys, a decoding step (`--shapes`); causal, float32, inputs from a fixed seed. The bias
column: "no"; "yes", a [1, N, T, S] logit bias (ALiBi's slopes times the offsets) with no bias
gradient, as in an ALiBi layer's step (its slopes are constants); "trained", the same bias with its
gradient asked for as well, as for a bias that trains (T5's buckets, Kerple, FIRE). Each program
is jitted, run once, then timed --repeats times (wall clock, `block_until_ready`); best and median
are printed with a sha256 of the outputs' bytes (the forward's output; the backward's dq, dk, dv
and, when trained, the bias gradient), so two commits' kernels can be compared for identical
results as well as time. Times vary between machines and with load: compare kernels by running this
at each commit, alternately, on one machine.
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _machine import cpu_name  # noqa: E402

from posattn.attention import native  # noqa: E402

SHAPES = {
    "small": (16, 256, 4, 32),
    "tiny": (32, 64, 4, 16),
    # heads of 64 and 128, as published models have them
    "h64": (4, 256, 8, 64),
    "h128": (2, 256, 8, 128),
    # one query over 1024 keys: a decoding step
    "step64": (8, 1, 8, 64),
    "step128": (8, 1, 8, 128),
}
KEYS = {"step64": 1024, "step128": 1024}  # S where it is not T
TRAINING_SHAPES = ("small", "tiny")
BIASES = ("no", "yes", "trained")


def _programs(B: int, T: int, N: int, H: int, bias_kind: str, S: int | None = None):
    """The programs of one shape: T queries at positions S - T .. S - 1 over S keys (S = T)."""
    S = T if S is None else S
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, g = (
        jax.random.normal(key, (B, length, N, H))
        for key, length in zip(keys, (T, S, S, T), strict=True)
    )
    bias = None
    if bias_kind != "no":
        slopes = 2.0 ** (-8.0 * jnp.arange(1, N + 1) / N)
        offsets = jnp.arange(S)[None, :] - (S - T + jnp.arange(T))[:, None]
        bias = (slopes[:, None, None] * jnp.minimum(offsets, 0))[None]

    trained = bias_kind == "trained"

    def forward(q, k, v, bias=bias):
        return native.native_attention(
            q, k, v, bias, scale=H**-0.5, bias_grad=trained, causal_offset=S - T
        )

    def loss(q, k, v, *bias):
        return (forward(q, k, v, *bias) * g).sum()

    if trained:  # the bias an argument, so that its gradient is asked for
        grads = jax.grad(loss, argnums=(0, 1, 2, 3))
        return (q, k, v, bias), {"forward + backward": jax.jit(grads)}
    grads = jax.grad(loss, argnums=(0, 1, 2))
    return (q, k, v), {"forward": jax.jit(forward), "forward + backward": jax.jit(grads)}


def _time(fn, args, repeats: int) -> tuple[float, float, str]:
    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    leaves = jax.tree_util.tree_leaves(out)
    digest = hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in leaves)).hexdigest()
    return min(times) * 1e3, float(np.median(times)) * 1e3, digest[:12]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(TRAINING_SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=20, help="timed runs of each program")
    args = parser.parse_args(argv)
    if not native.available():
        raise SystemExit(f"the native kernel is not available here: {native.why_unavailable()}")
    print(f"# {cpu_name()}; jax {jax.__version__} ({jax.default_backend()}); {args.repeats} runs")
    print("\n| shape [B, T, N, H] | bias | program | ms (best / median) | outputs sha256 |")
    print("|---|---|---|---|---|")
    for name in args.shapes:
        for bias_kind in BIASES:
            inputs, programs = _programs(*SHAPES[name], bias_kind, KEYS.get(name))
            for program, fn in programs.items():
                best, median, digest = _time(fn, inputs, args.repeats)
                over = f" over {KEYS[name]} keys" if name in KEYS else ""
                print(
                    f"| {name} {SHAPES[name]}{over} | {bias_kind} | {program} | "
                    f"{best:.2f} / {median:.2f} | `{digest}` |"
                )


if __name__ == "__main__":
    main()
