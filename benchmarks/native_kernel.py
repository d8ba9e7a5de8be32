"""The native CPU attention kernel alone: forward, and forward + backward, at fixed shapes.

Question: how long does `posattn.attention.native`'s kernel take for one layer's attention at the
shapes of `benchmarks/train_throughput.py` and at published models' head dims, and does a change
to the kernel change what it computes?

Run (from the repository root):
    python benchmarks/native_kernel.py           # training shapes; no bias, a bias, a trained bias
    python benchmarks/native_kernel.py --repeats 50
    python benchmarks/native_kernel.py --shapes h64 h128   # heads of 64 and 128
    python benchmarks/native_kernel.py --shapes step64 step128   # one query: a decoding step
    taskset -c 0 python benchmarks/native_kernel.py --against HEAD~1 --repeats 30   # two kernels

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
results as well as time. Times vary between machines and with load.

With --against REV, REV's kernel source (`git show`) is built beside this checkout's, with the same
compiler and flags, and registered under its own FFI names in the same process; each program is
compiled for both kernels and they run in turn, --repeats times each (the order swapped every
time), so that both see the same stretches of the machine's speed. Printed per program: each
kernel's best and median, REV's best over this checkout's (above 1: this checkout faster), and
whether the two kernels' outputs have the same sha256.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import pathlib
import re
import subprocess
import sys
import tempfile
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


def _digest(out) -> str:
    """The first 12 hex digits of the sha256 of the outputs' bytes."""
    leaves = jax.tree_util.tree_leaves(out)
    return hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in leaves)).hexdigest()[:12]


def _time(fn, args, repeats: int) -> tuple[float, float, str]:
    digest = _digest(jax.block_until_ready(fn(*args)))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times) * 1e3, float(np.median(times)) * 1e3, digest


ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = "src/posattn/attention/native/attention.cc"


def build_revision(rev: str, into: pathlib.Path) -> str:
    """REV's kernel built under `into` and registered as FFI targets `<name>@REV`; returns REV."""
    shown = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:{SOURCE}"], capture_output=True, text=True,
        check=False,
    )  # fmt: skip
    if shown.returncode != 0:
        raise SystemExit(
            f"native_kernel.py: no {SOURCE} at {rev!r} in the git checkout at {ROOT} "
            f"({shown.stderr.strip() or 'git failed'}); pass --against a commit that has it"
        )
    source, library = into / "attention.cc", into / "attention.so"
    source.write_text(shown.stdout)
    command = [native._compiler(), *native._FLAGS, f"-I{jax.ffi.include_dir()}", str(source)]
    built = subprocess.run([*command, "-o", str(library)], capture_output=True, text=True)
    if built.returncode != 0:
        raise SystemExit(
            f"native_kernel.py: building {rev}'s kernel failed:\n{built.stderr[-1500:]}"
        )
    loaded = ctypes.CDLL(str(library))
    for name, symbol in (
        (native._FORWARD, loaded.PosattnAttentionForward),
        (native._BACKWARD, loaded.PosattnAttentionBackward),
    ):
        jax.ffi.register_ffi_target(f"{name}@{rev}", jax.ffi.pycapsule(symbol), platform="cpu")
    return rev


@contextlib.contextmanager
def _targets(rev: str | None):
    """Programs traced inside call REV's kernel (None: this checkout's)."""
    saved = native._FORWARD, native._BACKWARD
    if rev is not None:
        native._FORWARD, native._BACKWARD = (f"{name}@{rev}" for name in saved)
    try:
        yield
    finally:
        native._FORWARD, native._BACKWARD = saved


def _compare(shape: str, bias_kind: str, rev: str, repeats: int) -> dict:
    """{program: [(best ms, median ms, sha256)] of REV's kernel and this checkout's}, run in
    turn. Each side traces its own programs, so that no cached trace holds the other's names."""
    sides = []
    for side in (rev, None):
        with _targets(side):
            inputs, programs = _programs(*SHAPES[shape], bias_kind, KEYS.get(shape))
            lowered = {p: fn.lower(*inputs) for p, fn in programs.items()}
        target = native._FORWARD if side is None else f"{native._FORWARD}@{side}"
        for program, low in lowered.items():
            if not re.search(rf"{re.escape(target)}(?![\w@])", low.as_text()):
                raise RuntimeError(f"{program} at {side or 'this checkout'} does not call {target}")
        sides.append({p: low.compile() for p, low in lowered.items()})
    results = {}
    for program in sides[0]:
        compiled = [side[program] for side in sides]
        times = [[], []]
        digests = [_digest(jax.block_until_ready(c(*inputs))) for c in compiled]
        for i in range(repeats):
            for side in (0, 1) if i % 2 == 0 else (1, 0):
                start = time.perf_counter()
                jax.block_until_ready(compiled[side](*inputs))
                times[side].append(time.perf_counter() - start)
        results[program] = [
            (min(t) * 1e3, float(np.median(t)) * 1e3, d)
            for t, d in zip(times, digests, strict=True)
        ]
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(TRAINING_SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=20, help="timed runs of each program")
    parser.add_argument("--against", help="a commit whose kernel to run in turn with this one")
    args = parser.parse_args(argv)
    if not native.available():
        raise SystemExit(f"the native kernel is not available here: {native.why_unavailable()}")
    print(f"# {cpu_name()}; jax {jax.__version__} ({jax.default_backend()}); {args.repeats} runs")
    if args.against:
        with tempfile.TemporaryDirectory() as scratch:
            against(args.shapes, build_revision(args.against, pathlib.Path(scratch)), args.repeats)
        return
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


def against(shapes, rev: str, repeats: int) -> None:
    print(f"\n| shape [B, T, N, H] | bias | program | {rev} ms (best / median) | this checkout "
          f"| {rev} best / this best | same sha256 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name in shapes:
        for bias_kind in BIASES:
            for program, sides in _compare(name, bias_kind, rev, repeats).items():
                (b0, m0, d0), (b1, m1, d1) = sides
                over = f" over {KEYS[name]} keys" if name in KEYS else ""
                print(
                    f"| {name} {SHAPES[name]}{over} | {bias_kind} | {program} | {b0:.2f} / "
                    f"{m0:.2f} | {b1:.2f} / {m1:.2f} | {b0 / b1:.3f} | "
                    f"{'yes' if d0 == d1 else f'no: `{d0}` `{d1}`'} |"
                )


if __name__ == "__main__":
    main()
