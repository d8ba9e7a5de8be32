"""Scaling benchmark: does the work split across devices? (compile-time measurements)

Question: under a device mesh, is each device's share of attention forward + backward 1/D of the
single-device program, for every implementation, data parallel and data x fsdp?

Run (from the repository root; about two minutes of compiling on 2 CPU cores):
    python benchmarks/scaling.py                      # every section
    python benchmarks/scaling.py --sections attention --shape 64,64,4,16
    python benchmarks/scaling.py --sections remat scan --rounds 2

The script re-executes itself with 8 simulated CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`, set before jax starts) and builds the
meshes for D = 2, 4, 8 from the first D devices.

Section "attention": forward + backward (`jax.grad` of <attention(q, k, v), dO>, gradients to q,
k, v and the ALiBi slopes) of `posattn.attention.attention` with a causal ALiBi `(BiasFn, params)`
bias; q, k, v, dO sharded over the batch on the mesh's batch axes (`data`, or `data` x `fsdp` with
fsdp = 2), slopes replicated. Per implementation and mesh it prints the per-device FLOPs of
`compiled.cost_analysis()` divided by those of the same program compiled for one device (ideal
1/D), and whether the compiled program all-gathers anything. Nothing runs; only compiles.

XLA's cost analysis counts the body of a loop once, whatever its trip count. So that the FLOPs
count the whole work, the ratio comes from programs whose loops make one trip: `chunked` takes the
whole (local) batch as one chunk (CHUNK_LOGITS and MAX_CHUNK_ROWS raised while compiling them) and
`blockwise` tiles are at least T (--shape T <= 512, its default tile; a longer T is refused). With
the default chunking the single-device program of `chunked` loops over B / R chunks and a device's
over B / (D R), and the ratio would be that of one chunk, about 1, whatever the split. The
all-gather column is read from both programs, the one-trip one and the default one (which is what
a model runs; with one row per chunk, a `lax.scan` over the sharded batch, XLA cannot partition
it without gathering the batch).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from _machine import cpu_name  # benchmarks/_machine.py, beside this script

DEVICES = 8
_CHILD = "POSATTN_SCALING_CHILD"


def _reexec_with_devices() -> None:
    """Runs this script again with DEVICES simulated CPU devices (jax reads XLA_FLAGS once)."""
    flags = os.environ.get("XLA_FLAGS", "")
    env = dict(
        os.environ,
        XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={DEVICES}".strip(),
        JAX_PLATFORMS="cpu",
        **{_CHILD: "1"},
    )
    sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))


def _meshes(jax, D):
    """(name, mesh) pairs over the first D devices: data parallel and data x fsdp (fsdp = 2)."""
    from jax.sharding import AxisType

    devices = jax.devices()[:D]
    out = [("data", jax.make_mesh((D,), ("data",), (AxisType.Auto,), devices=devices))]
    if D >= 4:
        out.append(
            (
                "data x fsdp",
                jax.make_mesh(
                    (D // 2, 2), ("data", "fsdp"), (AxisType.Auto, AxisType.Auto), devices=devices
                ),
            )
        )
    elif D == 2:
        out.append(
            (
                "data x fsdp",
                jax.make_mesh(
                    (1, 2), ("data", "fsdp"), (AxisType.Auto, AxisType.Auto), devices=devices
                ),
            )
        )
    return out


def attention_section(args) -> None:
    """Per-device FLOP ratio of attention forward + backward for every implementation x mesh x D."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from posattn.attention import attention, blockwise, chunked

    B, T, N, K, H = args.shape
    if T > min(blockwise.DEFAULT_BLOCK_Q, blockwise.DEFAULT_BLOCK_K):
        raise SystemExit(f"--shape: T = {T} must be at most the blockwise tile (one loop trip)")
    default_chunking = (chunked.CHUNK_LOGITS, chunked.MAX_CHUNK_ROWS)
    one_chunk = (B * N * T * T, B)  # one chunk: see the module docstring
    print(f"\n## attention: per-device FLOPs / single-device FLOPs (B, T, N, K, H) = {args.shape}")
    print("causal, ALiBi (BiasFn, params), float32, forward + backward; ideal = 1/D\n")

    def alibi(slopes, q_pos, k_pos):
        offset = jnp.abs(q_pos[:, None] - k_pos[None, :]).astype(jnp.float32)
        return -slopes[:, None, None] * offset

    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, T, K, H), jnp.float32)
    slopes = jax.ShapeDtypeStruct((N,), jnp.float32)

    def compiled(impl, mesh=None, one_trip=True):
        chunked.CHUNK_LOGITS, chunked.MAX_CHUNK_ROWS = one_chunk if one_trip else default_chunking

        def loss(q, k, v, d_out, slopes):
            out = attention(q, k, v, bias=(alibi, slopes), causal=True, implementation=impl)
            return jnp.sum(out * d_out)

        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 4)))
        specs = [q, kv, kv, q, slopes]
        if mesh is None:
            return step.lower(*specs).compile()
        rows = NamedSharding(mesh, P(mesh.axis_names))
        specs = [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows if x.ndim == 4 else None)
            for x in specs
        ]
        specs[-1] = jax.ShapeDtypeStruct(
            slopes.shape, slopes.dtype, sharding=NamedSharding(mesh, P())
        )
        with jax.set_mesh(mesh):
            return step.lower(*specs).compile()

    def flops(c):
        cost = c.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return float(cost["flops"])

    header = "| implementation | mesh | " + " | ".join(f"D={d}" for d in args.devices) + " |"
    print(header)
    print("|" + "---|" * (2 + len(args.devices)))
    for impl in args.implementations:
        single = flops(compiled(impl))
        rows = {}
        for D in args.devices:
            for name, mesh in _meshes(jax, D):
                c = compiled(impl, mesh)
                text = c.as_text()
                if impl == "chunked":  # the only implementation whose loops chunking changes
                    text += compiled(impl, mesh, one_trip=False).as_text()
                gathers = "all-gather" in text
                rows.setdefault(name, []).append(
                    f"{flops(c) / single:.3f} (1/D={1 / D:.3f}){' all-gather' if gathers else ''}"
                )
        for name, cells in rows.items():
            print(f"| {impl} | {name} | " + " | ".join(cells) + " |")


def remat_section(args) -> None:
    """model.remat: the step's temporaries and peak memory (benchmarks/scaling_model.py)."""
    import scaling_model

    D, L, B, T = args.remat_shape
    print(f"\n## remat: train step, d_model {D}, {L} layers, batch {B}, length {T} (RoPE, bytes)")
    print("| layout | remat | temp MiB | peak MiB | temp / none | peak / none |")
    print("|---|---|---|---|---|---|")
    rows = scaling_model.remat_memory(D, L, B, T) + scaling_model.remat_memory(
        D, L, B, T, scan_layers=True
    )
    for r in rows:
        print(
            f"| {r['layout']} | {r['remat']} | {r['temp'] / 2**20:.1f} | {r['peak'] / 2**20:.1f} "
            f"| {r['temp_ratio']:.3f} | {r['peak_ratio']:.3f} |"
        )


def scan_section(args) -> None:
    """model.scan_layers: seconds to trace and compile the training step at several depths."""
    import scaling_model

    print(
        f"\n## scan_layers: trace + compile seconds of the train step, d_model "
        f"{args.scan_d_model}, best of {args.rounds}"
    )
    rows = scaling_model.scan_compile_times(
        tuple(args.layers), args.scan_d_model, rounds=args.rounds
    )
    print("| layers | loop s | scan s | loop / scan |\n|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['layers']} | {r['loop']:.2f} | {r['scan']:.2f} | {r['loop'] / r['scan']:.2f} |"
        )
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        print(
            f"growth {first['layers']} -> {last['layers']} layers: loop "
            f"{last['loop'] / first['loop']:.2f}x, scan {last['scan'] / first['scan']:.2f}x"
        )


SECTIONS = {"attention": attention_section, "remat": remat_section, "scan": scan_section}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS), metavar="SECTION"
    )
    parser.add_argument(
        "--shape",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=(16, 512, 8, 8, 64),
        help="attention B,T,N,K,H (default 16,512,8,8,64)",
    )
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument(
        "--remat-shape",
        type=int,
        nargs=4,
        default=(128, 8, 8, 256),
        metavar=("D", "LAYERS", "B", "T"),
        help="remat section: d_model, layers, batch, length",
    )
    parser.add_argument("--layers", type=int, nargs="+", default=(4, 32), help="scan section")
    parser.add_argument("--scan-d-model", type=int, default=64, help="scan section")
    parser.add_argument("--rounds", type=int, default=1, help="scan section: best of")
    parser.add_argument(
        "--implementations", nargs="+", default=["reference", "xla", "chunked", "blockwise"]
    )
    args = parser.parse_args(argv)
    if len(args.shape) == 4:  # B,T,N,H: multi-head
        args.shape = (*args.shape[:3], args.shape[2], args.shape[3])
    if len(args.shape) != 5:
        parser.error(f"--shape must be B,T,N,K,H or B,T,N,H, got {args.shape}")
    if any(d < 1 or d > DEVICES for d in args.devices):
        parser.error(f"--devices must lie in 1..{DEVICES}, got {args.devices}")
    import jax

    print(f"# benchmarks/scaling.py {' '.join(sys.argv[1:])}")
    print(
        f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} devices, "
        f"CPU: {cpu_name()}"
    )
    for name in args.sections:
        SECTIONS[name](args)


if __name__ == "__main__":
    if os.environ.get(_CHILD) != "1":
        _reexec_with_devices()
    main()
