"""The training step's narrow products: XLA:CPU's library against a plain register-tiled product.

Question: at the experiment's shapes (d_model 64, MLP 256, 2048 rows a step) the step's products
run well below the CPU's square-product rate (docs/benchmarks.md). Is XLA:CPU's library (YNNPACK
on jax 0.10) behind at these shapes, so that a product of our own would pay, or is the shortfall
their context in the step (operands from the previous op, fused epilogues)?

Run (from the repository root):
    taskset -c 0 python benchmarks/narrow_products.py      # one core, as a unit of the experiment
    python benchmarks/narrow_products.py --repeats 1000

The comparison is a product written in the plainest way that keeps its accumulators in registers: a
tile of 6 rows x 64 columns (24 vectors of 16 floats, GCC's vector extensions, -O3 -march=native),
the contraction innermost, no packing; an operand given transposed ([K, M], the weight gradients'
X^T dY) is read in place. It is compiled as the native attention kernel is (the same compiler and
flags, `posattn.attention.native`) into a temporary directory and called through ctypes on numpy
arrays, single-threaded. XLA's side is `jax.jit(a @ b)` (or `a.T @ b`) on the process's threads: pin
the process to one core to compare like with like. The two are called alternately --repeats times,
so that both see the same stretches of the machine's speed; printed per form: each side's best and
median ms and GFLOP/s at best, the median of the pairs' ratios (XLA / ours: above 1, ours is faster)
and the largest difference from XLA relative to the largest |entry|.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _machine import cpu_name  # noqa: E402

from posattn.attention import native  # noqa: E402

_SOURCE = r"""
#include <cstdint>
#include <cstring>
#include <type_traits>

typedef float v16 __attribute__((vector_size(64)));
static inline v16 Load(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
static inline void Store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

// C[M, N] = A B with A [M, K] (or A^T with A stored [K, M] when TA), B [K, N], row-major;
// N a multiple of 64. Tiles of R rows x 4 vectors, accumulated over the whole contraction.
template <int R, bool TA>
static void Product(const float* A, const float* B, float* C, int64_t M, int64_t K, int64_t N) {
  constexpr int V = 4;
  for (int64_t n0 = 0; n0 < N; n0 += 16 * V) {
    int64_t m0 = 0;
    auto tile = [&](auto rows) {
      constexpr int RR = decltype(rows)::value;
      v16 acc[RR][V] = {};
      for (int64_t k = 0; k < K; ++k) {
        v16 b[V];
        for (int v = 0; v < V; ++v) b[v] = Load(B + k * N + n0 + 16 * v);
        for (int r = 0; r < RR; ++r) {
          const float a = TA ? A[k * M + m0 + r] : A[(m0 + r) * K + k];
          for (int v = 0; v < V; ++v) acc[r][v] += a * b[v];
        }
      }
      for (int r = 0; r < RR; ++r)
        for (int v = 0; v < V; ++v) Store(C + (m0 + r) * N + n0 + 16 * v, acc[r][v]);
    };
    for (; m0 + R <= M; m0 += R) tile(std::integral_constant<int, R>());
    for (; m0 < M; ++m0) tile(std::integral_constant<int, 1>());
  }
}

extern "C" void product(const float* A, const float* B, float* C, int64_t M, int64_t K,
                        int64_t N, int transposed) {
  if (transposed) Product<6, true>(A, B, C, M, K, N);
  else Product<6, false>(A, B, C, M, K, N);
}
"""

# (M, K, N, A transposed): the tiny step's forward forms (x W for the MLP's 64 -> 256, its
# 256 -> 64, the fused q/k/v 64 -> 192) and its weight gradients (X^T dY, contraction 2048).
FORMS = [
    (2048, 64, 256, False),
    (2048, 256, 64, False),
    (2048, 64, 192, False),
    (64, 2048, 256, True),
    (256, 2048, 64, True),
    (64, 2048, 192, True),
]


def _build(tmp: str) -> ctypes.CDLL:
    compiler = native._compiler()
    if compiler is None:
        raise SystemExit("no C++ compiler found (set CXX, or install g++)")
    source, library = os.path.join(tmp, "product.cc"), os.path.join(tmp, "product.so")
    pathlib.Path(source).write_text(_SOURCE)
    subprocess.run([compiler, *native._FLAGS, "-o", library, source], check=True)
    lib = ctypes.CDLL(library)
    pointer = ctypes.POINTER(ctypes.c_float)
    lib.product.argtypes = [pointer, pointer, pointer, *[ctypes.c_int64] * 3, ctypes.c_int]
    return lib


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=400, help="alternating calls of each side")
    args = parser.parse_args(argv)
    threads = len(os.sched_getaffinity(0))
    print(f"# {cpu_name()}; {threads} CPU(s) for this process; jax {jax.__version__}")
    print(f"# {args.repeats} alternating calls of each side\n")
    print("| product | XLA ms (best / median) | ours ms (best / median) | XLA / ours | diff. |")
    print("|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    pointer = ctypes.POINTER(ctypes.c_float)
    with tempfile.TemporaryDirectory() as tmp:
        lib = _build(tmp)
        for M, K, N, transposed in FORMS:
            a = rng.standard_normal((K, M) if transposed else (M, K), dtype=np.float32)
            b = rng.standard_normal((K, N), dtype=np.float32)
            c = np.empty((M, N), np.float32)
            xla = jax.jit((lambda x, y: x.T @ y) if transposed else (lambda x, y: x @ y))
            aj, bj = jax.device_put(a), jax.device_put(b)
            want = np.asarray(xla(aj, bj))
            ptrs = [x.ctypes.data_as(pointer) for x in (a, b, c)]

            def ours(ptrs=ptrs, M=M, K=K, N=N, transposed=transposed):
                lib.product(*ptrs, M, K, N, int(transposed))

            ours()
            diff = float(np.abs(c - want).max() / np.abs(want).max())
            t_xla, t_ours = [], []
            for _ in range(args.repeats):
                start = time.perf_counter()
                xla(aj, bj).block_until_ready()
                t_xla.append(time.perf_counter() - start)
                start = time.perf_counter()
                ours()
                t_ours.append(time.perf_counter() - start)
            gflop = 2 * M * K * N / 1e9
            ratio = float(np.median(np.array(t_xla) / np.array(t_ours)))
            name = f"[{K}, {M}]^T [{K}, {N}]" if transposed else f"[{M}, {K}] [{K}, {N}]"
            cells = [
                f"{min(t) * 1e3:.3f} / {np.median(t) * 1e3:.3f} ({gflop / min(t):.0f} GFLOP/s)"
                for t in (t_xla, t_ours)
            ]
            print(f"| {name} | {cells[0]} | {cells[1]} | {ratio:.2f} | {diff:.0e} |")


if __name__ == "__main__":
    main()
