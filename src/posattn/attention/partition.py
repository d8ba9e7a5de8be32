"""Attention under a device mesh: every implementation runs inside `jax.shard_map` over the batch.

XLA partitions the materialised implementations by itself, but not the loops of `chunked` and
`blockwise` (a `lax.scan` over batch chunks, `fori_loop`s over tiles): under a batch-sharded mesh
it gathers q, k, v onto every device and each device computes the whole batch. Running the
implementation per device on its own batch rows removes that: no activation crosses devices in
the forward, and in the backward only the gradients of the replicated bias parameters (and of a
traced scale) are summed over the batch axes (the transpose of shard_map sums the cotangent of an
operand replicated over an axis over that axis).

The mesh is the ambient one (`jax.set_mesh`), or else the mesh of q's sharding: an input committed
to a mesh (`jax.device_put(x, NamedSharding(mesh, ...))`) carries it under `jax.jit` even with no
mesh in context or inside the legacy `with mesh:` block, and that mesh is then passed to
`jax.shard_map` itself (which would otherwise ask for `jax.set_mesh`). With no mesh in context and
uncommitted inputs (only `jit(in_shardings=...)` knows the mesh) no mesh is visible while tracing:
the implementation runs as is and XLA's partitioner splits it.

The batch axes are the mesh axes that shard q's batch dimension when that is known
(Explicit axes), otherwise the mesh axes named in BATCH_AXES; axes of size 1 and axes that are
already Manual (inside another shard_map) are left out, and trailing axes are dropped until their
product divides the batch. Outside a mesh, or when no axis remains, the implementation runs as is.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

# Mesh axes that split the batch when q's sharding does not say (Auto axes): the data-parallel
# axis and the fully-sharded-data-parallel axis, as `posattn.train.sharding` names them.
BATCH_AXES = ("data", "fsdp")


def mesh_of(q):
    """The mesh q is traced under (the ambient one, else its sharding's; module docstring), or
    None outside one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is not None and not mesh.empty:
        return mesh
    sharding = getattr(jax.typeof(q), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    return None if mesh is None or mesh.empty else mesh


def batch_axes(q) -> tuple[object, tuple[str, ...]] | None:
    """(mesh, batch axis names) for q's batch dimension, or None when attention runs unsharded."""
    mesh = mesh_of(q)
    if mesh is None:
        return None
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    sizes = dict(mesh.shape)
    spec = getattr(getattr(jax.typeof(q), "sharding", None), "spec", None)
    named = spec[0] if spec is not None and len(spec) else None
    if named is not None:
        candidates = (named,) if isinstance(named, str) else tuple(named)
    else:
        candidates = tuple(a for a in mesh.axis_names if a in BATCH_AXES)
    axes = [a for a in candidates if types[a] != AxisType.Manual and sizes[a] > 1]
    B = q.shape[0]
    while axes and B % math.prod(sizes[a] for a in axes):
        axes.pop()
    return (mesh, tuple(axes)) if axes else None


def over_batch(
    fn: Callable, q, k, v, *, bias, q_offset, kv_lengths, scale, log_forget=None, far=None
):
    """fn(q, k, v, bias, q_offset, kv_lengths, scale, log_forget, far) -> out, run per device over
    the batch axes of the ambient mesh (see the module docstring), or directly outside a mesh.

    q, k, v, kv_lengths, log_forget, far (a (q, k) pair or None) and a per-row q_offset are split
    over the batch; the bias (an array or the parameters of a BiasFn), a scalar q_offset and a
    traced scale are replicated.
    """
    found = batch_axes(q)
    if found is None:
        return fn(q, k, v, bias, q_offset, kv_lengths, scale, log_forget, far)
    mesh, axes = found
    rows = P(axes)
    bias_fn, bias_operand = bias if isinstance(bias, tuple) else (None, bias)
    static_scale = isinstance(scale, (int, float, np.number))
    static_scale_value = scale if static_scale else None

    def body(q, k, v, bias_operand, q_offset, kv_lengths, scale, log_forget, far):
        b = bias_operand if bias_fn is None else (bias_fn, bias_operand)
        scale = static_scale_value if static_scale else scale
        return fn(q, k, v, b, q_offset, kv_lengths, scale, log_forget, far)

    in_specs = (
        rows,
        rows,
        rows,
        P(),
        rows if q_offset.ndim == 1 else P(),
        P() if kv_lengths is None else rows,
        P(),
        P() if log_forget is None else rows,
        P() if far is None else (rows, rows),
    )
    # check_vma=False: the kernels' loops start from replicated zeros that become per-device
    # values; the transpose then sums the cotangents of the replicated operands (the bias
    # parameters, a traced scale) over the batch axes.
    sharded = jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=rows, axis_names=set(axes), check_vma=False
    )
    return sharded(
        q,
        k,
        v,
        bias_operand,
        q_offset,
        kv_lengths,
        None if static_scale else scale,
        log_forget,
        far,
    )
