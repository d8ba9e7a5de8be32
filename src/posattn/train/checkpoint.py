"""Checkpoints (the only module that imports orbax).

A checkpoint is a composite of the train state (parameters, optimiser state, step: restored
against `ShapeDtypeStruct` targets that carry the current shardings, which is how a run moves to
another device count) and a JSON record (step, data position, config, corpus hash). Orbax writes
each step into a temporary directory and renames it when complete, so a process killed mid-write
leaves the previous checkpoints untouched; a checkpoint that is damaged anyway (a truncated file)
fails to restore or to match the fingerprint recorded beside it, is reported and removed, and
the one before it is used.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

__all__ = ["Checkpointer"]

_log = logging.getLogger(__name__)


class Checkpointer:
    """Saves and restores train states under `directory` (async, keeps the newest `max_to_keep`)."""

    def __init__(
        self, directory: str | pathlib.Path, *, max_to_keep: int = 3, async_save: bool = True
    ):
        self.directory = pathlib.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            create=True,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, record: dict, *, force: bool = True) -> bool:
        """Starts saving `state` and `record` as checkpoint `step` (returns before the write ends).

        The record also gets a fingerprint of every array of `state`, checked on restore: orbax
        and tensorstore do not notice a flipped byte in a data file, we do.
        """
        record = dict(record, fingerprint=fingerprint(state))
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record)
        )
        return self._manager.save(step, args=args, force=force)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores checkpoint `step` onto the shardings carried by `abstract_state`."""
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), record=ocp.args.JsonRestore()
        )
        restored = self._manager.restore(step, args=args)
        return restored["state"], dict(restored["record"])

    def restore_latest(self, abstract_state: Any) -> tuple[Any, dict] | None:
        """The newest checkpoint that restores cleanly, or None if there is none.

        A damaged checkpoint (truncated or corrupted files) is reported and skipped, and the one
        before it is tried, so a crash during a write never costs more than one interval.
        """
        damaged = []
        for step in reversed(self.steps()):
            try:
                state, record = self.restore(step, abstract_state)
                expected = record.get("fingerprint")
                if expected is not None and fingerprint(state) != expected:
                    raise ValueError(
                        f"checkpoint {step}'s arrays do not match the fingerprint saved with them"
                    )
                _check_finite(state, step)
                for bad in damaged:  # so that the resumed run can write those steps again
                    self._manager.delete(bad)
                return state, record
            except Exception as e:  # orbax/tensorstore raise many types for damaged files
                _log.warning(
                    "checkpoint %d in %s is damaged (%s: %s); falling back to an older one",
                    step,
                    self.directory,
                    type(e).__name__,
                    str(e).splitlines()[0][:300],
                )
                damaged.append(step)
        for bad in damaged:
            self._manager.delete(bad)
        return None

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


@jax.jit
def _fingerprints(leaves: list[jax.Array]) -> list[jax.Array]:
    out = []
    for x in leaves:
        bits = x.reshape(-1)
        if bits.dtype.itemsize == 4:
            bits = jax.lax.bitcast_convert_type(bits, jnp.uint32)
        elif bits.dtype.itemsize == 2:
            bits = jax.lax.bitcast_convert_type(bits, jnp.uint16).astype(jnp.uint32)
        else:
            bits = bits.astype(jnp.uint32)
        # A position-weighted sum modulo 2^32 (Knuth's multiplicative constant): any flipped bit
        # or swapped pair of values changes it.
        weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
        out.append(jnp.sum(bits * weights, dtype=jnp.uint32))
    return out


def fingerprint(state: Any) -> list[int]:
    """One 32-bit checksum per array of `state` (computed where the arrays live)."""
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(state)]  # Python scalars restore as arrays
    return [int(v) for v in jax.device_get(_fingerprints(leaves))]


def _check_finite(state: Any, step: int) -> None:
    leaves = [
        x
        for x in jax.tree.leaves(state)
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
    ]
    if not all(bool(jnp.all(jnp.isfinite(x))) for x in leaves):
        raise ValueError(f"checkpoint {step} holds non-finite values")
