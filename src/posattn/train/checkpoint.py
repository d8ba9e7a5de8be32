"""Checkpoints (the only module that imports orbax).

A checkpoint is a composite of the train state (parameters, optimiser state, step: restored
against `ShapeDtypeStruct` targets that carry the current shardings, which is how a run moves to
another device count) and a JSON record (step, data position, config, corpus hash, and a
fingerprint of every array).

Restore tells two failures apart, because they call for opposite actions:

- **Incompatible**: the saved tree, shapes or dtypes differ from what this code and config build
  (a renamed parameter, another width, another optimiser). The checkpoint is fine; the code is
  not the code that wrote it. Restore compares the saved metadata with the target before reading
  any array and raises `IncompatibleCheckpointError`, naming every differing path; no file is
  touched, so the run can be continued with the code that wrote it.
- **Damaged**: the files cannot be read (a truncated data file, unreadable metadata), the arrays
  do not match the fingerprint saved beside them (orbax and tensorstore do not notice a flipped
  byte in a data file), or they hold NaN or inf. The checkpoint is moved aside into
  `<directory>/damaged/<step>` (kept for inspection, never deleted), reported, and the one before
  it is tried. Orbax writes each step into a temporary directory and renames it when complete, so
  a process killed mid-write leaves the previous checkpoints untouched.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

__all__ = [
    "Checkpointer",
    "DamagedCheckpoint",
    "IncompatibleCheckpointError",
    "NonFiniteStateError",
    "fingerprint",
]

_log = logging.getLogger(__name__)


class _NoReadOnlyNotice(logging.Filter):
    """orbax announces every read-only manager at WARNING level; a reader is not news."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Given directory is read only")


logging.getLogger("absl").addFilter(_NoReadOnlyNotice())

DAMAGED = "damaged"  # subdirectory of the checkpoint directory holding damaged checkpoints


class IncompatibleCheckpointError(RuntimeError):
    """A checkpoint's tree, shapes or dtypes differ from what this code builds (nothing touched).

    Attributes:
      step: the checkpoint's step.
      missing: paths this code builds that the checkpoint lacks.
      unexpected: paths the checkpoint holds that this code does not build.
      changed: `(path, saved, now)` for arrays whose shape or dtype differ.
    """

    def __init__(
        self,
        directory: pathlib.Path,
        step: int,
        missing: list[str],
        unexpected: list[str],
        changed: list[tuple[str, str, str]],
    ):
        self.directory, self.step = directory, step
        self.missing, self.unexpected, self.changed = missing, unexpected, changed
        lines = [
            f"checkpoint {step} in {directory} was written by code that builds a different train "
            "state from this code and config:"
        ]
        lines += _listing("in this code, not in the checkpoint (missing)", missing)
        lines += _listing("in the checkpoint, not in this code (unexpected)", unexpected)
        lines += _listing(
            "shape or dtype changed (saved -> now)",
            [f"{p}: {saved} -> {now}" for p, saved, now in changed],
        )
        lines.append(
            "No checkpoint was changed. To continue this run, restore it with the code that wrote "
            "it (the commit and config it was trained with); to start over with this code, move "
            f"the checkpoints away (mv {directory} {directory}.old) or use another --workdir."
        )
        super().__init__("\n".join(lines))


class NonFiniteStateError(FloatingPointError):
    """A train state holding NaN or inf was about to be saved (nothing was written).

    Attributes:
      step: the step it would have been saved as.
      arrays: the paths of the non-finite arrays.
    """

    def __init__(self, step: int, arrays: list[str]):
        self.step, self.arrays = step, arrays
        shown = ", ".join(arrays[:3]) + (f" and {len(arrays) - 3} more" if len(arrays) > 3 else "")
        super().__init__(
            f"the train state of step {step} holds NaN or inf in {len(arrays)} arrays ({shown}); "
            "it was not saved"
        )


@dataclasses.dataclass(frozen=True)
class DamagedCheckpoint:
    """A checkpoint that failed to restore and was moved aside to `moved_to`."""

    step: int
    reason: str
    moved_to: pathlib.Path


def _listing(title: str, items: list[str], limit: int = 16) -> list[str]:
    if not items:
        return []
    shown = [f"    {x}" for x in items[:limit]]
    if len(items) > limit:
        shown.append(f"    ... and {len(items) - limit} more")
    return [f"  {title}: {len(items)}", *shown]


class Checkpointer:
    """Saves and restores train states under `directory` (async, keeps the newest `max_to_keep`).

    With `read_only=True` (every reader: generation, evaluation, an experiment reusing a run) it
    never changes the directory, so it can run beside the trainer that writes it: no directory is
    created, the writer's in-progress `*.orbax-checkpoint-tmp*` directories are left alone (the
    writer's own restart removes those of a dead writer), no old checkpoint is deleted, and a
    checkpoint that does not restore is skipped with a warning instead of being moved aside. A
    missing directory holds no checkpoint. Only the writer (`read_only=False`, under the workdir's
    lock) cleans up.

    Attributes:
      set_aside: the damaged checkpoints the last `restore_latest` moved aside (a writer) or
        skipped (a reader: `moved_to` is where they still are).
    """

    def __init__(
        self,
        directory: str | pathlib.Path,
        *,
        max_to_keep: int = 3,
        async_save: bool = True,
        read_only: bool = False,
    ):
        self.directory = pathlib.Path(directory).absolute()
        self.read_only = read_only
        self.set_aside: list[DamagedCheckpoint] = []
        self._manager = None
        if read_only:
            if not self.directory.is_dir():
                return  # nothing to read; never create it
            options = ocp.CheckpointManagerOptions(
                read_only=True,
                save_interval_steps=0,
                create=False,
                max_to_keep=None,
                enable_async_checkpointing=False,
                cleanup_tmp_directories=False,
            )
        else:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                create=True,
                enable_async_checkpointing=async_save,
                cleanup_tmp_directories=True,
            )
        # Handlers named up front, so that a fresh process can read a checkpoint's metadata.
        handlers = {"state": ocp.StandardCheckpointHandler(), "record": ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=handlers
        )

    def steps(self) -> list[int]:
        if self._manager is None:
            return []
        if self.read_only:
            self._manager.reload()  # the writer may have added or removed steps since
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return max(self.steps(), default=None)

    def save(self, step: int, state: Any, record: dict, *, force: bool = True) -> bool:
        """Starts saving `state` and `record` as checkpoint `step` (returns before the write ends).

        The record also gets a fingerprint of every array of `state`, checked on restore: orbax
        and tensorstore do not notice a flipped byte in a data file, we do. The same pass over
        the arrays checks that every floating value is finite: a state holding NaN or inf (the
        loss can still be finite at the step where the parameters or the optimiser's moments
        overflow) is never written.

        Raises:
          NonFiniteStateError: `state` holds NaN or inf (nothing written).
          PermissionError: a read-only Checkpointer.
        """
        if self.read_only or self._manager is None:
            raise PermissionError(f"{self.directory} was opened read-only; it cannot be saved to")
        sums, bad = _fingerprint_and_check(state)
        if bad:
            raise NonFiniteStateError(step, bad)
        record = dict(record, fingerprint=sums)
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record)
        )
        return self._manager.save(step, args=args, force=force)

    def check_compatible(self, step: int, abstract_state: Any) -> None:
        """Raises `IncompatibleCheckpointError` unless checkpoint `step` holds the arrays (paths,
        shapes, dtypes) of `abstract_state`. Reads only the saved metadata, never an array.

        Raises:
          IncompatibleCheckpointError: naming every missing, unexpected or changed path.
          Exception: whatever orbax raises when the metadata cannot be read (damage).
        """
        metadata = self._manager.item_metadata(step)
        saved_tree = None if metadata is None else metadata["state"]
        if saved_tree is None:
            raise ValueError(f"checkpoint {step} has no readable metadata for its train state")
        saved = _flat_arrays(getattr(saved_tree, "tree", saved_tree))
        now = _flat_arrays(ocp.tree.serialize_tree(abstract_state, keep_empty_nodes=True))
        missing = sorted(now.keys() - saved.keys(), key=_shallow_first)
        unexpected = sorted(saved.keys() - now.keys(), key=_shallow_first)
        changed = [
            (path, _describe(saved[path]), _describe(now[path]))
            for path in sorted(now.keys() & saved.keys(), key=_shallow_first)
            if _differ(saved[path], now[path])
        ]
        if missing or unexpected or changed:
            raise IncompatibleCheckpointError(self.directory, step, missing, unexpected, changed)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores checkpoint `step` onto the shardings carried by `abstract_state`.

        Raises:
          IncompatibleCheckpointError: the saved tree differs from `abstract_state` (checked
            before any array is read; no file is touched).
          Exception: whatever orbax raises for unreadable files.
        """
        self.check_compatible(step, abstract_state)
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), record=ocp.args.JsonRestore()
        )
        restored = self._manager.restore(step, args=args)
        return restored["state"], dict(restored["record"])

    def restore_checked(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """`restore`, then the arrays checked against their fingerprint and for NaN or inf.

        Raises:
          IncompatibleCheckpointError: as `restore`.
          ValueError: the arrays do not match their fingerprint, or hold NaN or inf.
          Exception: whatever orbax raises for unreadable files.
        """
        state, record = self.restore(step, abstract_state)
        expected = record.get("fingerprint")
        sums, bad = _fingerprint_and_check(state)
        if expected is not None and sums != expected:
            raise ValueError("its arrays do not match the fingerprint saved with them")
        if bad:
            raise ValueError(f"non-finite values in {len(bad)} arrays, the first {bad[0]}")
        return state, record

    def restore_latest(self, abstract_state: Any) -> tuple[Any, dict] | None:
        """The newest checkpoint that restores cleanly, or None if there is none.

        A damaged checkpoint (unreadable or truncated files, arrays that do not match their
        fingerprint, non-finite values) is moved into `<directory>/damaged/` and reported, and the
        one before it is tried, so a crash during a write never costs more than one interval.

        Raises:
          IncompatibleCheckpointError: a checkpoint was written by code that builds another train
            state; raised before anything is moved, so every checkpoint stays where it was.
        """
        damaged: list[tuple[int, str]] = []
        result = None
        for step in reversed(self.steps()):
            try:
                state, record = self.restore_checked(step, abstract_state)
            except IncompatibleCheckpointError:
                raise
            except MemoryError:
                raise  # the machine, not the checkpoint
            except Exception as e:  # orbax/tensorstore raise many types for damaged files
                if "RESOURCE_EXHAUSTED" in str(e):
                    raise  # out of device memory: the machine, not the checkpoint
                damaged.append((step, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"))
                continue
            result = state, record
            break
        if self.read_only:  # a reader never moves the writer's files
            self.set_aside = [
                DamagedCheckpoint(step, reason, self.directory / str(step))
                for step, reason in damaged
            ]
        else:
            self.set_aside = [self._move_aside(step, reason) for step, reason in damaged]
            if damaged:
                self._manager.reload()
        for bad in self.set_aside:
            _log.warning(
                "checkpoint %d in %s does not restore (%s); %s; %s",
                bad.step,
                self.directory,
                bad.reason,
                "left where it is (read-only)" if self.read_only else f"moved to {bad.moved_to}",
                f"{'using' if self.read_only else 'resuming from'} checkpoint "
                f"{result[1].get('step')}"
                if result is not None
                else "no older checkpoint restores",
            )
        return result

    def _move_aside(self, step: int, reason: str) -> DamagedCheckpoint:
        """Renames checkpoint `step` into `<directory>/damaged/<step>[.n]` (never deletes it)."""
        if jax.process_count() > 1:  # every process names the same target
            ocp.multihost.sync_global_processes(f"posattn_damaged_checkpoint_{step}_name")
        source = self.directory / str(step)
        target = self.directory / DAMAGED / str(step)
        n = 1
        while target.exists():
            target = self.directory / DAMAGED / f"{step}.{n}"
            n += 1
        if jax.process_index() == 0:
            target.parent.mkdir(parents=True, exist_ok=True)
            source.rename(target)
        if jax.process_count() > 1:
            ocp.multihost.sync_global_processes(f"posattn_damaged_checkpoint_{step}")
        return DamagedCheckpoint(step=step, reason=reason, moved_to=target)

    def wait(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()

    def close(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()


def _flat_arrays(tree: Any) -> dict[str, Any]:
    """{"a/b/0/value": leaf} for the array leaves of a serialised (orbax) tree."""
    flat = ocp.tree.to_flat_dict(tree)
    return {"/".join(str(k) for k in path): x for path, x in flat.items() if hasattr(x, "shape")}


def _shallow_first(path: str) -> tuple[int, str]:
    # A parameter's own path is shorter than its optimiser moments' paths: list it first.
    return path.count("/"), path


def _differ(saved: Any, now: Any) -> bool:
    if tuple(saved.shape) != tuple(now.shape):
        return True
    dtypes = getattr(saved, "dtype", None), getattr(now, "dtype", None)
    return None not in dtypes and np.dtype(dtypes[0]) != np.dtype(dtypes[1])  # unknown: no claim


def _describe(leaf: Any) -> str:
    dtype = getattr(leaf, "dtype", None)
    return f"{tuple(leaf.shape)} {np.dtype(dtype).name if dtype is not None else '?'}"


def _checksum(x: Any, xp: Any) -> tuple[Any, Any]:
    """(checksum, all finite) of one array with `xp` = numpy or jax.numpy: the same bits either
    way (uint32 products and sums wrap alike)."""
    floating = jnp.issubdtype(x.dtype, jnp.floating)
    finite = xp.all(xp.isfinite(x.astype(xp.float32))) if floating else xp.bool_(True)
    bits = x.reshape(-1)
    if bits.dtype.itemsize == 4:
        bits = bits.view(xp.uint32)
    elif bits.dtype.itemsize == 2:
        bits = bits.view(xp.uint16).astype(xp.uint32)
    else:
        bits = bits.astype(xp.uint32)
    # A position-weighted sum modulo 2^32 (Knuth's multiplicative constant): any flipped bit or
    # swapped pair of values changes it.
    weights = xp.arange(bits.size, dtype=xp.uint32) * xp.uint32(2654435761) + xp.uint32(1)
    return xp.sum(bits * weights, dtype=xp.uint32), finite


@jax.jit
def _fingerprints(leaves: list[jax.Array]) -> tuple[list[jax.Array], list[jax.Array]]:
    """(checksum, all finite) of every leaf, in one program (one read of each array)."""
    pairs = [_checksum(x, jnp) for x in leaves]
    return [c for c, _ in pairs], [f for _, f in pairs]


_HOST_BYTES = 1 << 26  # up to 64 MiB of host-resident arrays: NumPy, no program to compile


def _host_array(x: Any) -> np.ndarray | None:
    """`x` as `_fingerprints` would read it (Python and NumPy values at JAX's default dtypes),
    without a copy for a CPU array; None for what only a compiled program reads: an array on an
    accelerator or across hosts, or a dtype other than 2- and 4-byte floats, integers, bool."""
    if isinstance(x, jax.Array):
        cpu = x.is_fully_addressable and all(d.platform == "cpu" for d in x.devices())
        return np.asarray(x) if cpu and _host_dtype(x.dtype) else None
    if isinstance(x, np.ndarray | np.generic | int | float | bool):
        a = np.asarray(x)
        a = a.astype(jax.dtypes.canonicalize_dtype(a.dtype), copy=False)
        return a if _host_dtype(a.dtype) else None
    return None


def _host_dtype(dtype: Any) -> bool:
    if jnp.issubdtype(dtype, jax.dtypes.extended):  # PRNG keys and other JAX-only types
        return False
    if jnp.issubdtype(dtype, jnp.floating):
        return np.dtype(dtype).itemsize in (2, 4)
    return np.dtype(dtype).kind in "iub" and np.dtype(dtype).itemsize in (1, 2, 4)


def _host_fingerprints(arrays: list[np.ndarray]) -> tuple[list[int], list[bool]]:
    """`_fingerprints` in NumPy."""
    pairs = [_checksum(a, np) for a in arrays]
    return [int(c) for c, _ in pairs], [bool(f) for _, f in pairs]


def _fingerprint_and_check(state: Any) -> tuple[list[int], list[str]]:
    """(one 32-bit checksum per array, the paths of the arrays holding NaN or inf)."""
    paths_leaves = jax.tree_util.tree_leaves_with_path(state)
    host = [_host_array(x) for _, x in paths_leaves]
    if all(a is not None for a in host) and sum(a.nbytes for a in host) <= _HOST_BYTES:
        # A small state on this host: no program to compile for its tree (0.67 s a tree on
        # average, 19 in the default experiment under JAX_LOG_COMPILES=1 on a 2-core EPYC).
        sums, finite = _host_fingerprints(host)
    else:
        leaves = [jnp.asarray(x) for _, x in paths_leaves]  # Python scalars restore as arrays
        sums, finite = jax.device_get(_fingerprints(leaves))
    paths = [jax.tree_util.keystr(p) for p, _ in paths_leaves]
    bad = [p for p, ok in zip(paths, finite, strict=True) if not ok]
    return [int(v) for v in sums], bad


def fingerprint(state: Any) -> list[int]:
    """One 32-bit checksum per array of `state` (computed where the arrays live)."""
    return _fingerprint_and_check(state)[0]
