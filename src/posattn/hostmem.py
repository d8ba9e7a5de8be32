"""glibc malloc settings for XLA:CPU's scratch buffers, applied by the commands as they start.

Each run of a compiled program on a CPU allocates the program's scratch (all its intermediates in
one block: 194 MiB for a training step at d_model 128, 4 layers, T 256, batch 16) and frees it when
the run ends. glibc's malloc serves a block that large with a fresh `mmap` every time (its mmap
threshold cannot exceed 32 MiB, and XLA's worker threads allocate from their own arenas, whose
64 MiB heaps cannot hold such a block), so every step maps the block, the kernel zero-fills it as
it is first written and unmaps it at the end: ~55,000 page faults and ~120 ms of system CPU time a
step at that shape on a 2-core VM, in 4 KiB pages.

Two remedies, both glibc tunables (docs/benchmarks.md, "Page faults" and "Keeping the scratch in
the heap"):
* `glibc.malloc.hugetlb=1` (glibc 2.35 and later): malloc asks for transparent huge pages on what
  it maps (`madvise(MADV_HUGEPAGE)`), so the block faults in 2 MiB at a time: ~770 faults and
  20-40 ms of system time a step, the step 1.3-1.4x faster than in 4 KiB pages.
* `glibc.malloc.arena_max=1`, `glibc.malloc.mmap_max=0` and `glibc.malloc.trim_threshold=1 GiB`:
  one arena for every thread, no block mapped on its own, and up to 1 GiB of free memory kept at
  the top of the heap. The block then comes from the heap, goes back to it at the end of the
  step, and the next step reuses it: no page faults once the heap holds it. The small step's
  median was 3-15% lower again on a 2-core AVX2 VM. A process keeps up to `TRIM_THRESHOLD` of
  freed memory instead of returning it to the system.
The length experiment's default command (its step's scratch is under 32 MiB, reused from the heap
anyway) took the same time with the second remedy as with the first alone, and its peak RSS was
0.89 GiB against 1.23. What is computed does not change, only where its memory comes from.

glibc reads its tunables once, when a process starts. So the commands that run many steps
(`python -m posattn.train`, `posattn.sweep`, `posattn.eval`, `experiments/length_extrapolation.py`)
call `reexec_with_malloc_tunables()` first: when the settings would take effect and none is set
yet, the command re-executes itself (same process id, same arguments) with them added to
`GLIBC_TUNABLES`; worker processes inherit them. A program that imports posattn sets them in its
own environment before it starts (`GLIBC_TUNABLES=<tunables_string()> python train.py`); the
training loop logs a warning (`scratch_hint`) when its step's scratch is over 32 MiB and they are
missing.

Nothing is changed off Linux or glibc (older than 2.26, which has no tunables, included), where
`GLIBC_TUNABLES` already sets any `glibc.malloc.` tunable (the environment's choice stands: to time
huge pages alone, `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`), or where `POSATTN_HUGE_PAGES=0`.
Huge pages are asked for only where the kernel's transparent huge pages are in "madvise" mode
(`/sys/kernel/mm/transparent_hugepage/enabled`; under "always" large mappings get them anyway,
under "never" they cannot) and glibc is 2.35 or later.
"""

from __future__ import annotations

import os
import pathlib
import sys
from collections.abc import Mapping

__all__ = [
    "HUGE_PAGES",
    "KEEP_SCRATCH",
    "MMAP_LIMIT",
    "OPT_OUT",
    "TRIM_THRESHOLD",
    "malloc_environ",
    "reexec_with_malloc_tunables",
    "scratch_hint",
    "tunables_string",
]

OPT_OUT = "POSATTN_HUGE_PAGES"  # "0": leave malloc as the environment has it
MMAP_LIMIT = 32 << 20  # glibc's largest mmap threshold (64-bit): larger blocks are always mapped
TRIM_THRESHOLD = 1 << 30  # free memory kept at the heap's top: a step's scratch up to 1 GiB
HUGE_PAGES = "glibc.malloc.hugetlb=1"
KEEP_SCRATCH = (
    "glibc.malloc.arena_max=1",
    "glibc.malloc.mmap_max=0",
    f"glibc.malloc.trim_threshold={TRIM_THRESHOLD}",
)
_THP_MODE = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _glibc_version() -> tuple[int, ...] | None:
    """(major, minor) of the C library when it is glibc, else None."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        return tuple(int(x) for x in version.split(".")[:2]) if name == "glibc" else None
    except (AttributeError, OSError, ValueError):
        return None


def _thp_mode() -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), None if unknown."""
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def tunables_string() -> str | None:
    """The `GLIBC_TUNABLES` value the commands set here; None off Linux with glibc 2.26+."""
    glibc = _glibc_version()
    if not sys.platform.startswith("linux") or glibc is None or glibc < (2, 26):
        return None
    huge = glibc >= (2, 35) and _thp_mode() == "madvise"
    return ":".join(((HUGE_PAGES,) if huge else ()) + KEEP_SCRATCH)


def malloc_environ(environ: Mapping[str, str]) -> dict[str, str] | None:
    """`environ` with `tunables_string()` added to GLIBC_TUNABLES, or None where nothing is added.

    None: off Linux, off glibc or on a glibc older than 2.26; GLIBC_TUNABLES already setting a
    `glibc.malloc.` tunable (the environment's choice stands); or `POSATTN_HUGE_PAGES=0`.
    """
    if environ.get(OPT_OUT, "1").strip() == "0":
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    ours = tunables_string()
    if ours is None or "glibc.malloc." in tunables:
        return None
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{ours}" if tunables else ours}


def reexec_with_malloc_tunables() -> None:
    """Re-executes this command with `tunables_string()` set, where `malloc_environ` adds it.

    Call it first in a command's `__main__`, before anything has started threads or printed: the
    process image is replaced (same pid, same arguments, `sys.orig_argv`), so what ran before is
    run again. Returns without doing anything where nothing would change, or if the exec fails.
    """
    env = malloc_environ(os.environ)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:
        return


def scratch_hint(scratch_bytes: int, environ: Mapping[str, str] | None = None) -> str | None:
    """A warning for a CPU program whose scratch (`compiled.memory_analysis()
    .temp_size_in_bytes`) glibc maps afresh on every run, where the tunables would be added and
    are not set (a program of the user's own, started without them); None otherwise."""
    environ = os.environ if environ is None else environ
    if scratch_bytes <= MMAP_LIMIT or malloc_environ(environ) is None:
        return None
    return (
        f"each step maps its {scratch_bytes / 2**20:.0f} MiB of scratch afresh and faults it in "
        f"page by page; start the process with GLIBC_TUNABLES={tunables_string()} to keep it in "
        f"malloc's heap, as python -m posattn.train does (docs/training.md, 'On a CPU'; "
        f"{OPT_OUT}=0 silences this)"
    )
