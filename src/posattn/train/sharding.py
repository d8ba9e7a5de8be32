"""Meshes and shardings: data parallel on `data`, parameters optionally sharded on `fsdp`.

The same code runs on one device, on N simulated CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`) and on a multi-host pod. The batch is split
over every device (both mesh axes); with `fsdp > 1` each parameter is split along its largest axis
that the fsdp axis divides (others stay replicated), ZeRO-3 style: XLA gathers them for compute.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from posattn.config import ConfigError

__all__ = [
    "any_process",
    "batch_sharding",
    "check_fsdp",
    "divisors",
    "global_batch",
    "make_mesh",
    "maybe_initialize_distributed",
    "state_shardings",
]

_log = logging.getLogger(__name__)


def maybe_initialize_distributed(force: bool = False) -> None:
    """Joins a multi-process run when the environment says so (or `force`), before any JAX work.

    `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID` (e.g. 127.0.0.1:1234, 2, 0)
    start an explicit cluster (on CPU with gloo collectives); `force` calls
    `jax.distributed.initialize()` with no arguments, which detects TPU pods and SLURM/MPI jobs.
    """
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not (address or force) or jax.distributed.is_initialized():
        return
    if address:
        if os.environ.get("JAX_PLATFORMS", "").startswith("cpu") or not _has_accelerator_hint():
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
        )
    else:
        jax.distributed.initialize()
    _log.info(
        "process %d of %d, %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.device_count(),
    )


def any_process(flag: bool) -> bool:
    """True on every process if `flag` is True on any: a collective every process must call.

    With one process this is `flag`; with several, an all-gather of one int per process
    (`jax.experimental.multihost_utils.process_allgather`).
    """
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray([int(flag)], np.int32))))


def _has_accelerator_hint() -> bool:
    return any(os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "TPU_NAME", "TPU_WORKER_ID"))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_fsdp(fsdp, devices: int) -> int:
    """`fsdp` if it divides the device count, else a ConfigError naming the allowed sizes."""
    if isinstance(fsdp, bool) or not isinstance(fsdp, int) or fsdp < 1 or devices % fsdp:
        raise ConfigError(
            f"config.train.fsdp={fsdp!r} must divide the number of devices ({devices}); "
            f"allowed: {', '.join(map(str, divisors(devices)))}"
        )
    return fsdp


def make_mesh(fsdp: int = 1) -> Mesh:
    """A (data, fsdp) mesh over every device; `fsdp` must divide the device count (ConfigError)."""
    n = jax.device_count()
    check_fsdp(fsdp, n)
    return jax.make_mesh(
        (n // fsdp, fsdp), ("data", "fsdp"), axis_types=(AxisType.Auto, AxisType.Auto)
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch rows split over every device of the mesh."""
    return NamedSharding(mesh, P(("data", "fsdp")))


def _param_spec(shape: tuple[int, ...], fsdp: int) -> P:
    if fsdp == 1 or not shape:
        return P()
    candidates = [(size, axis) for axis, size in enumerate(shape) if size % fsdp == 0]
    if not candidates:
        return P()
    _, axis = max(candidates)
    spec = [None] * len(shape)
    spec[axis] = "fsdp"
    return P(*spec)


def state_shardings(mesh: Mesh, abstract_state, *, leading_axis: str | None = None):
    """NamedShardings for a train state: fsdp-split parameters and Adam moments, others replicated.

    Args:
      mesh: the (data, fsdp) mesh (or one with a leading `sweep` axis).
      abstract_state: a pytree of arrays or ShapeDtypeStructs.
      leading_axis: shard every array's first dimension on this mesh axis (a vmap sweep's members).
    """
    fsdp = mesh.shape.get("fsdp", 1)

    def spec(x):
        shape = tuple(x.shape)
        if leading_axis is not None and shape:
            inner = _param_spec(shape[1:], fsdp)
            return NamedSharding(mesh, P(leading_axis, *inner))
        return NamedSharding(mesh, _param_spec(shape, fsdp))

    return jax.tree.map(spec, abstract_state)


def global_batch(
    build: Callable[[tuple[slice, ...]], dict[str, np.ndarray]],
    sharding: NamedSharding,
    leading: tuple[int, ...],
) -> dict[str, jax.Array]:
    """Global arrays laid out as `sharding`, each process building only the rows it holds.

    The one way batches reach the devices, for a run on one device or on many hosts: `leading` is
    the shape of the dimensions the sharding splits (a batch's rows `(B,)`, or a sweep's
    `(members, B)`); `build(index)` returns the host arrays of the block `index` (a tuple of
    slices over `leading`, trailing dimensions whole). It is called once, for the smallest block
    that covers every block this process's devices hold (on a pod, the process's own rows), and
    each device gets its part. Since a batch is a pure function of (seed, step, row), every
    process agrees on the global array without building it.
    """
    placed = []
    for device, index in sharding.addressable_devices_indices_map(tuple(leading)).items():
        placed.append(
            (device, tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, leading, strict=True)))
        )
    box = tuple(
        slice(min(ix[d].start for _, ix in placed), max(ix[d].stop for _, ix in placed))
        for d in range(len(leading))
    )
    host = build(box)

    def part(index):
        return tuple(
            slice(s.start - b.start, s.stop - b.start) for s, b in zip(index, box, strict=True)
        )

    out = {}
    for name, array in host.items():
        shape = (*leading, *array.shape[len(leading) :])
        shards = [jax.device_put(array[part(index)], device) for device, index in placed]
        out[name] = jax.make_array_from_single_device_arrays(shape, sharding, shards)
    return out
