"""Transparent huge pages for XLA:CPU's scratch buffers: one glibc setting, applied by the commands.

Each run of a compiled program on a CPU allocates the program's scratch (all its intermediates in
one block: 194 MiB for a training step at d_model 128, 4 layers, T 256, batch 16) and frees it when
the run ends. glibc's malloc serves a block that large with a fresh `mmap` every time (its mmap
threshold cannot exceed 32 MiB, and XLA's worker threads allocate from their own arenas, which
cannot hold such a block), so every step maps the block, the kernel zero-fills it one 4 KiB page
at a time as it is first written (~55,000 page faults and ~120 ms of system CPU time a step at
that shape on a 2-core VM) and unmaps it. With glibc's tunable `glibc.malloc.hugetlb=1` (glibc
2.35 and later) malloc asks the kernel for transparent huge pages on the blocks it maps
(`madvise(MADV_HUGEPAGE)`), which then fault in 2 MiB at a time: ~770 faults and ~20 ms a step,
and the step 1.3-1.4x faster (docs/benchmarks.md, "Page faults"). Smaller programs (the length
experiment's default shape, whose scratch is under 32 MiB and reused from the heap) neither gain
nor lose. What is computed does not change, only where its memory comes from.

glibc reads its tunables once, when a process starts. So the commands that run many steps
(`python -m posattn.train`, `posattn.sweep`, `posattn.eval`, `experiments/length_extrapolation.py`)
call `reexec_with_huge_pages()` first: when the setting would take effect and is not set yet, the
command re-executes itself (same process id, same arguments) with it added to `GLIBC_TUNABLES`;
worker processes inherit it. A program that imports posattn sets it in its own environment
before it starts (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python train.py`); the training loop
logs a warning (`scratch_hint`) when its step's scratch is over 32 MiB and the setting is missing.

Nothing is changed off Linux or glibc (older than 2.35 included), where the kernel's transparent
huge pages are "never" or already "always" (`/sys/kernel/mm/transparent_hugepage/enabled`), where
`GLIBC_TUNABLES` already says `glibc.malloc.hugetlb`, or where `POSATTN_HUGE_PAGES=0`.
"""

from __future__ import annotations

import os
import pathlib
import sys
from collections.abc import Mapping

__all__ = [
    "MMAP_LIMIT",
    "OPT_OUT",
    "TUNABLE",
    "huge_pages_environ",
    "reexec_with_huge_pages",
    "scratch_hint",
]

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "POSATTN_HUGE_PAGES"  # "0": leave malloc as the environment has it
MMAP_LIMIT = 32 << 20  # glibc's largest mmap threshold (64-bit): larger blocks are always mapped
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


def huge_pages_environ(environ: Mapping[str, str]) -> dict[str, str] | None:
    """`environ` with `TUNABLE` added to GLIBC_TUNABLES, or None where it would change nothing.

    None: off Linux; not glibc >= 2.35; transparent huge pages not in "madvise" mode (under
    "always" large mappings get them anyway, under "never" they cannot); GLIBC_TUNABLES already
    setting `glibc.malloc.hugetlb` (either way: the environment's choice stands); or
    `POSATTN_HUGE_PAGES=0`.
    """
    if environ.get(OPT_OUT, "1").strip() == "0" or not sys.platform.startswith("linux"):
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables:
        return None
    glibc = _glibc_version()
    if glibc is None or glibc < (2, 35) or _thp_mode() != "madvise":
        return None
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}" if tunables else TUNABLE}


def reexec_with_huge_pages() -> None:
    """Re-executes this command with `TUNABLE` set, where `huge_pages_environ` says it helps.

    Call it first in a command's `__main__`, before anything has started threads or printed: the
    process image is replaced (same pid, same arguments, `sys.orig_argv`), so what ran before is
    run again. Returns without doing anything where nothing would change, or if the exec fails.
    """
    env = huge_pages_environ(os.environ)
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
    .temp_size_in_bytes`) glibc maps afresh on every run, where `TUNABLE` would help and is not
    set (a program of the user's own, started without it); None otherwise."""
    environ = os.environ if environ is None else environ
    if scratch_bytes <= MMAP_LIMIT or huge_pages_environ(environ) is None:
        return None
    return (
        f"each step maps its {scratch_bytes / 2**20:.0f} MiB of scratch afresh and faults it in "
        f"4 KiB pages; start the process with GLIBC_TUNABLES={TUNABLE} to have huge pages, as "
        f"python -m posattn.train does (docs/training.md, 'On a CPU'; {OPT_OUT}=0 silences this)"
    )
