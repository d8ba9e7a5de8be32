"""A weight gradient's two orientations on XLA:CPU, x^T dy against (dy^T x)^T, and the native
library's product.

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
  * "(dy^T x)^T": the product [B, A] behind an optimization barrier, then transposed;
  * "native": `posattn.attention.native.weight_gradient` in the orientation `dense` runs it
    (wide: for A > B, the product of dy and x, transposed), as the step computes it since the
    library has it (where the library did not build, this column says so).
Printed: the times, GFLOP/s, the ratio of the medians of XLA's two orientations and whether their
results are bitwise equal; then the native product's time, the ratio of XLA's wide orientation's
median to its median (above 1: the native product is faster), and the largest error of XLA's
wide result and of the native one against float64, relative to the largest |entry|. Times vary
between machines and with load: compare within one run.
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

from posattn.attention import native  # noqa: E402

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
        "(best / median) | median ratio | bitwise equal | native ms (best / median) | "
        "XLA wide / native | error: XLA wide, native |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    ours = None
    if native.available():
        ours = jax.jit(
            lambda x, dy: (
                native.weight_gradient(dy, x).T
                if x.shape[1] > dy.shape[1]
                else native.weight_gradient(x, dy)
            )
        )
    straight = jax.jit(lambda x, dy: jax.lax.dot_general(x, dy, _TN))
    swapped = jax.jit(lambda x, dy: jax.lax.optimization_barrier(jax.lax.dot_general(dy, x, _TN)).T)
    for config, M, A, B, what in PRODUCTS:
        kx, kd = jax.random.split(jax.random.PRNGKey(M + A + B))
        x, dy = jax.random.normal(kx, (M, A)), jax.random.normal(kd, (M, B))
        equal = np.array_equal(straight(x, dy), swapped(x, dy))
        a, b, c = [], [], []
        for _ in range(2):  # alternating halves
            a += _times(straight, (x, dy), args.repeats // 2)
            b += _times(swapped, (x, dy), args.repeats // 2)
            if ours is not None:
                c += _times(ours, (x, dy), args.repeats // 2)
        gflop = 2 * M * A * B / 1e9
        cells = [
            f"{1e3 * min(t):.2f} / {1e3 * np.median(t):.2f} ({gflop / np.median(t):.0f} GFLOP/s)"
            for t in (a, b, c)
            if t
        ]
        row = (
            f"| {config} | {what} | [{A}, {B}] | {cells[0]} | {cells[1]} | "
            f"{np.median(a) / np.median(b):.2f}x | {'yes' if equal else 'no'} |"
        )
        if ours is None:
            row += f" unavailable: {native.why_unavailable()} | - | - |"
        else:
            wide = b if A > B else a  # the orientation dense ran on XLA:CPU
            exact = np.asarray(x, np.float64).T @ np.asarray(dy, np.float64)
            errors = [
                np.abs(np.asarray(fn(x, dy), np.float64) - exact).max() / np.abs(exact).max()
                for fn in ((swapped if A > B else straight), ours)
            ]
            row += (
                f" {cells[2]} | {np.median(wide) / np.median(c):.2f}x | "
                f"{errors[0]:.1e}, {errors[1]:.1e} |"
            )
        print(row)


if __name__ == "__main__":
    main()
