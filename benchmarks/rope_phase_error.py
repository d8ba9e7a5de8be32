"""Phase error of posattn.rotary's angles against float64, and what the accuracy costs.

Question: how far are the float32 angles `rope_angles(p, theta)` (and the rotation `apply_rope`
applies) from p * theta mod 2 pi, with the float32 theta taken as exact, compared with the plain
float32 product `p * theta` that Meta Llama and Hugging Face compute?

Run:
    python benchmarks/rope_phase_error.py
Results and their meaning: docs/rope.md, "Precision at long positions".
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from posattn.rotary import apply_rope, rope_angles, rope_frequencies

CHUNK = 2**16


def wrapped(angle):
    return (angle + np.pi) % (2 * np.pi) - np.pi


def sweep(theta, positions_chunks):
    """Max |phase error| of rope_angles, of the rotation apply_rope applies, and of p * theta in
    float32."""
    angles = jax.jit(rope_angles)
    # Rotating the unit vector (1, 0) of every pair gives (cos, sin) of the angle actually applied.
    unit = jnp.tile(jnp.array([1.0, 0.0], jnp.float32), theta.shape[0])[None, None, :]  # (1, 1, H)
    rotate = jax.jit(
        lambda p: apply_rope(jnp.broadcast_to(unit, (p.shape[0], 1, unit.shape[-1])), p, theta)
    )
    ours = applied = naive = 0.0
    for p in positions_chunks:
        exact = p[:, None].astype(np.float64) * theta.astype(np.float64)
        ours = max(ours, np.abs(wrapped(np.asarray(angles(p, theta), np.float64) - exact)).max())
        pairs = np.asarray(rotate(p), np.float64).reshape(p.shape[0], -1, 2)  # (T, F, 2)
        applied = max(
            applied, np.abs(wrapped(np.arctan2(pairs[..., 1], pairs[..., 0]) - exact)).max()
        )
        product = (p[:, None].astype(np.float32) * theta).astype(np.float64)
        naive = max(naive, np.abs(wrapped(product - exact)).max())
    return ours, applied, naive


def cost(theta, length=8192, repeats=20):
    """Microseconds per call of the accurate and of the plain angles for `length` positions."""
    positions = jnp.arange(length, dtype=jnp.int32)
    accurate = jax.jit(rope_angles)
    plain = jax.jit(lambda p, t: p.astype(jnp.float32)[:, None] * t)
    timings = []
    for fn in (accurate, plain):
        fn(positions, theta).block_until_ready()
        start = time.perf_counter()
        for _ in range(repeats):
            fn(positions, theta).block_until_ready()
        timings.append((time.perf_counter() - start) / repeats * 1e6)
    return timings


def main():
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}")
    print(
        "| frequencies (head_dim 128) | positions | rope_angles | applied rotation "
        "| float32 p*theta |"
    )
    print("|---|---|---|---|---|")
    for base in (10000.0, 500000.0):
        theta = np.asarray(rope_frequencies(128, base=base)[0])
        ranges = {
            "all 0 .. 2^20 - 1": (
                np.arange(s, s + CHUNK, dtype=np.int32) for s in range(0, 2**20, CHUNK)
            ),
            "40k random in (-2^24, 2^24)": [
                rng.integers(-(2**24) + 1, 2**24, 40_000).astype(np.int32)
            ],
        }
        for label, chunks in ranges.items():
            ours, applied, naive = sweep(theta, chunks)
            print(f"| base {base:g} | {label} | {ours:.2e} | {applied:.2e} | {naive:.2e} |")
    theta = rope_frequencies(128)[0]
    accurate, plain = cost(theta)
    print(
        f"\ncost, 8192 positions x 64 frequencies, jit on {jax.default_backend()}: "
        f"rope_angles {accurate:.0f} us, plain product {plain:.0f} us"
    )


if __name__ == "__main__":
    main()
