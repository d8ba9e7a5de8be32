"""The experiment's units of work (one seed of one entry: its training, then its rows'
evaluations) run in worker processes, one per CPU core, or in this process. In workers a unit's
training (with its fine-tunes) and its evaluation are two tasks: every training is started
before any evaluation, so that the short evaluations, not a whole unit, end the run and the
workers finish together (experiments/README.md, "Trainings before evaluations").

Why: at the default's shape (d_model 64, T 64, batch 32) a training step is a few hundred small
ops, bound by their overhead rather than by arithmetic, and one process uses a second core
poorly. Two processes, each pinned to its own core, compute two units at once: the default
command measured 1.12-1.21x faster on two cores (experiments/README.md, "Worker processes"), and
a machine with more cores runs more units at once. Each unit writes what it always wrote (the
run's checkpoints, `trained.json`, the evaluation caches).

The numbers: every unit is computed by one XLA thread on one core, so they are the same whatever
the machine's core count, the worker count or the order. They differ in their last bits from a
one-process run (`workers=1`) with several threads, because XLA:CPU splits some products by its
thread count, and training amplifies that (experiments/README.md has the measured differences).

`config.workers`: 0 (the default) picks the count (`worker_count`): on CPU one per usable core,
at most one per unit left to compute and one per ~3 GiB of available memory; this process on an
accelerator (one device, one process). 1 runs everything in this process, as before.

Signals: each worker runs in its own process group, so a Ctrl-C reaches this process only; it
passes SIGTERM to every worker (the training loop then saves a checkpoint and stops, as it does
alone), and a second Ctrl-C passes SIGINT (which stops at once). A worker whose parent dies gets
SIGTERM from the kernel (Linux): it saves and stops, then exits, so no orphan keeps training.
Either way the run fails with "rerun to resume" (or its parent is gone), and rerunning the same
command resumes every unit where it stopped.
"""

from __future__ import annotations

import concurrent.futures as futures
import ctypes
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from posattn import config as config_lib

from .training import Interrupted, say

__all__ = ["WorkerDied", "check_workers", "run_units", "usable_cpus", "worker_count"]

# Memory a worker may need: the default's largest process peaked at 1.3 GB with two workers, and
# the whole command at 1.7 GB in one process (experiments/README.md); 3 GiB leaves room for more.
_BYTES_PER_WORKER = 3 << 30


class WorkerDied(RuntimeError):
    """A worker process ended without an answer (killed, or out of memory)."""


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_workers(config) -> int:
    """`config.workers` checked (before any compute): an int >= 0; > 1 only on CPU."""
    workers = config.get("workers", 0)
    if not (isinstance(workers, int) and not isinstance(workers, bool) and workers >= 0):
        raise config_lib.ConfigError(
            f"config.workers={workers!r} must be an integer >= 0 (0: one process per CPU core; "
            "1: everything in this process)"
        )
    if workers > 1 and jax.default_backend() != "cpu":
        raise config_lib.ConfigError(
            f"config.workers={workers}: worker processes run on CPU only, and JAX's backend here "
            f"is {jax.default_backend()!r} (one device, one process); set config.workers=1 or 0"
        )
    return workers


def worker_count(requested: int, pending: int) -> int:
    """How many worker processes compute `pending` units; 0: this process does.

    `requested` is `config.workers`: 1 is this process; 0 on CPU is one worker a usable core, at
    most one a pending unit and one per ~3 GiB of available memory (one worker for one unit, so
    that every unit is computed on one core however many are left), and this process on an
    accelerator."""
    if requested == 1 or pending == 0:
        return 0
    if requested > 1:
        return min(requested, pending)
    if jax.default_backend() != "cpu":
        return 0
    memory = _available_memory()
    by_memory = max(1, memory // _BYTES_PER_WORKER) if memory else pending
    return max(1, min(len(usable_cpus()), pending, by_memory))


def _die_with_parent(parent: int) -> None:
    """SIGTERM to this process when `parent` exits (Linux's PR_SET_PDEATHSIG), so that a worker
    of a killed run saves its checkpoint and stops instead of training on alone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl
        os.kill(os.getpid(), signal.SIGTERM)


class _Stopped(BaseException):
    """A busy worker's SIGTERM outside a training loop. A BaseException, as KeyboardInterrupt is,
    so that no `except Exception` it passes through takes it for a failure of its own: restoring
    a checkpoint, for one, would report a good checkpoint as damaged (and a trainer's resume
    would move it aside). `_call` turns it into Interrupted for the parent."""


def _stop(signum, frame):
    """A worker's SIGTERM outside training: a unit being evaluated (or restored, or between its
    training and its fine-tunes) ends with Interrupted (the training loop installs its own
    handler while it runs: it saves a checkpoint, then stops). An idle worker ignores it: it has
    nothing to save, and dying would break the pool and end the others before they saved."""
    if _busy.is_set():
        raise _Stopped(signal.Signals(signum).name)


_busy = threading.Event()  # a unit is running in this worker


def _watch_parent(parent: int) -> None:
    """Ends this worker once its parent is gone and no unit runs (the parent's death sent
    SIGTERM: the running unit saves and stops first); a pool worker would otherwise wait for
    work forever."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent and not _busy.is_set():
            os._exit(1)


def _call(fn, job, key):
    _busy.set()
    try:
        return fn(job, *key)
    except _Stopped as e:
        raise Interrupted(f"stopped by {e} outside a training loop") from None
    finally:
        _busy.clear()


def _start_worker(cpus, parent: int) -> None:
    os.setpgrp()  # Ctrl-C reaches the parent only; it passes the signal on
    signal.signal(signal.SIGTERM, _stop)
    _die_with_parent(parent)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    cpu = cpus.get() if cpus is not None else None
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def run_units(
    fn: Callable[..., Any],
    job: Any,
    keys: Sequence[Any],
    workers: int,
    *,
    first: Callable[..., Any] | None = None,
) -> dict[Any, Any]:
    """{key: fn(job, *key)} for every key, in `workers` processes (0: here, in order). The keys
    are started in the order given (longest first is the caller's choice).

    With `first`, each key's `first(job, *key)` runs before it, and the result is passed on:
    `fn(job, *key, result)`. Every key's `first` is started before any `fn`, and a key's `fn`
    once its `first` has finished, in any worker: the long parts (the trainings) first, the short
    ones (their evaluations) last, so that the workers finish together."""
    if workers == 0:
        if first is None:
            return {key: fn(job, *key) for key in keys}
        return {key: fn(job, *key, first(job, *key)) for key in keys}
    context = multiprocessing.get_context("spawn")  # JAX's threads do not survive fork
    cpus = usable_cpus()
    queue = None
    if workers <= len(cpus) and hasattr(os, "sched_setaffinity"):
        queue = context.Queue()
        for cpu in cpus[:workers]:
            queue.put(cpu)
    where = " (one core each)" if queue else ""
    units = f"{len(keys)} unit{'s' if len(keys) > 1 else ''}"
    say(f"{units} in {workers} worker process{'es' if workers > 1 else ''}{where}")
    pool = futures.ProcessPoolExecutor(
        workers, mp_context=context, initializer=_start_worker, initargs=(queue, os.getpid())
    )
    received: list[int] = []

    def tell_workers(sent: int) -> None:
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            try:
                os.kill(process.pid, sent)
            except (ProcessLookupError, AttributeError, TypeError):
                pass

    def forward(signum, frame):
        received.append(signum)
        tell_workers(signal.SIGTERM if len(received) == 1 else signal.SIGINT)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, forward)
    out: dict[Any, Any] = {}
    failure: BaseException | None = None
    try:
        # future -> (key, whether it is the key's `first`)
        running = {
            pool.submit(_call, first or fn, job, key): (key, first is not None) for key in keys
        }
        while running and not isinstance(failure, WorkerDied):
            finished, _ = futures.wait(running, return_when=futures.FIRST_COMPLETED)
            for done in finished:
                key, is_first = running.pop(done)
                if done.cancelled():
                    continue
                try:
                    result = done.result()
                except futures.process.BrokenProcessPool:
                    failure = failure or WorkerDied(
                        "a worker process ended without an answer (killed, or out of memory?); "
                        "rerun to resume, or set --config.workers=1 to run in one process"
                    )
                    break
                except Exception as e:  # the first failure stops the others, which save and stop
                    if failure is None:
                        failure = e
                        for other in running:
                            other.cancel()
                        if not received:
                            tell_workers(signal.SIGTERM)
                    continue
                if not is_first:
                    out[key] = result
                elif failure is None and not received:  # nothing new once stopping
                    running[pool.submit(_call, fn, job, (*key, result))] = (key, False)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for sig, old in previous.items():
            signal.signal(sig, old)
    if received and (failure is None or isinstance(failure, WorkerDied | Interrupted)):
        name = signal.Signals(received[0]).name
        raise Interrupted(f"stopped by {name}; rerun the same command to resume")
    if failure is not None:
        raise failure
    return out
