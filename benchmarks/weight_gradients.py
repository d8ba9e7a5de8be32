"""A weight gradient's two orientations on XLA:CPU: x^T dy against (dy^T x)^T.

Question: a weight gradient x^T dy (x [M, A], dy [M, B]: a product contracting the rows of both)
runs on XLA:CPU as an Eigen `dot`; does its speed depend on which way round it is computed, and is
the result the same? (`posattn.nn.layers.dense` computes the one whose result is wide.)

Run (from the repository root):
    python benchmarks/weight_gradients.py
    taskset -c 0 python benchmarks/weight_gradients.py --repeats 100    # one core

For each product of a training step at the shapes of `benchmarks/train_throughput.py` (tiny:
M = 2048 tokens, d_model 64, MLP 256, vocabulary 256; small: M = 4096, d_model 128, MLP 512),
both orientations are jitted and timed alternately, best and median of --repeats calls (wall
clock, `block_until_ready`):
  * "x^T dy": `lax.dot_general(x, dy)` contracting dim 0 of both, result [A, B], as JAX's own
    matmul gradient asks for it;
  * "(dy^T x)^T": the product [B, A] behind an optimization barrier, then transposed.
Printed: the times, GFLOP/s, the ratio of the medians, and whether the two results are bitwise
equal. Times vary between machines and with load: compare the orientations within one run.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _machine import cpu_name  # noqa: E402

_TN = (((0,), (0,)), ((), ()))

# (config, M, A, B, what it is): x [M, A], dy [M, B]. The tied output layer's table [V, D] gets
# d logits^T h: the MLP-out orientation at tiny (V = 256, D = 64), computed wide as h^T d logits.
PRODUCTS = [
    ("tiny", 2048, 64, 192, "q/k/v"),
    ("tiny", 2048, 64, 64, "output projection"),
    ("tiny", 2048, 64, 256, "MLP in"),
    ("tiny", 2048, 256, 64, "MLP out"),
    ("small", 4096, 128, 384, "q/k/v"),
    ("small", 4096, 128, 128, "output projection"),
    ("small", 4096, 128, 512, "MLP in"),
    ("small", 4096, 512, 128, "MLP out"),
]


def _times(fn, args, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    print(f"# {cpu_name()}; jax {jax.__version__} ({jax.default_backend()})")
    print(
        "\n| config | product | x^T dy [A, B] | x^T dy ms (best / median) | (dy^T x)^T ms "
        "(best / median) | median ratio | bitwise equal |"
    )
    print("|---|---|---|---|---|---|---|")
    straight = jax.jit(lambda x, dy: jax.lax.dot_general(x, dy, _TN))
    swapped = jax.jit(lambda x, dy: jax.lax.optimization_barrier(jax.lax.dot_general(dy, x, _TN)).T)
    for config, M, A, B, what in PRODUCTS:
        kx, kd = jax.random.split(jax.random.PRNGKey(M + A + B))
        x, dy = jax.random.normal(kx, (M, A)), jax.random.normal(kd, (M, B))
        equal = np.array_equal(straight(x, dy), swapped(x, dy))
        a, b = [], []
        for _ in range(2):  # alternating halves
            a += _times(straight, (x, dy), args.repeats // 2)
            b += _times(swapped, (x, dy), args.repeats // 2)
        gflop = 2 * M * A * B / 1e9
        cells = [
            f"{1e3 * min(t):.2f} / {1e3 * np.median(t):.2f} ({gflop / np.median(t):.0f} GFLOP/s)"
            for t in (a, b)
        ]
        print(
            f"| {config} | {what} | [{A}, {B}] | {cells[0]} | {cells[1]} | "
            f"{np.median(a) / np.median(b):.2f}x | {'yes' if equal else 'no'} |"
        )


if __name__ == "__main__":
    main()
