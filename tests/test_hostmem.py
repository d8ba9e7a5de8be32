"""`posattn.hostmem`: where the commands add glibc's malloc tunables, and the re-exec that
applies them."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT

from posattn import hostmem

KEEP = ":".join(hostmem.KEEP_SCRATCH)


@pytest.fixture
def helps(monkeypatch):
    """A machine where every tunable takes effect: Linux, glibc 2.36, THP in "madvise" mode."""
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(hostmem, "_glibc_version", lambda: (2, 36))
    monkeypatch.setattr(hostmem, "_thp_mode", lambda: "madvise")


def test_the_tunables_are_added_and_the_rest_kept(helps):
    environ = {"PATH": "/bin", "HOME": "/h"}
    env = hostmem.malloc_environ(environ)
    assert env == {**environ, "GLIBC_TUNABLES": f"glibc.malloc.hugetlb=1:{KEEP}"}
    assert "GLIBC_TUNABLES" not in environ  # the argument is not changed
    env = hostmem.malloc_environ({"GLIBC_TUNABLES": "glibc.rtld.nns=8"})
    assert env == {"GLIBC_TUNABLES": f"glibc.rtld.nns=8:glibc.malloc.hugetlb=1:{KEEP}"}
    assert hostmem.malloc_environ(env) is None  # once only: no loop of re-execs
    assert hostmem.malloc_environ({hostmem.OPT_OUT: "1"}) is not None
    assert KEEP == (
        "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1073741824"
    )


@pytest.mark.parametrize(
    "glibc, mode",
    [
        ((2, 34), "madvise"),  # glibc without the huge-page tunable
        ((2, 36), "always"),  # large mappings get huge pages already
        ((2, 36), "never"),  # they cannot get them
        ((2, 36), None),  # no THP in this kernel
    ],
)
def test_the_heap_is_kept_where_huge_pages_cannot_help(monkeypatch, glibc, mode):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(hostmem, "_glibc_version", lambda: glibc)
    monkeypatch.setattr(hostmem, "_thp_mode", lambda: mode)
    assert hostmem.malloc_environ({}) == {"GLIBC_TUNABLES": KEEP}


@pytest.mark.parametrize(
    "environ, platform, glibc",
    [
        ({hostmem.OPT_OUT: "0"}, "linux", (2, 36)),  # asked not to
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "linux", (2, 36)),  # chosen
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "linux", (2, 36)),  # chosen
        ({}, "darwin", (2, 36)),
        ({}, "linux", None),  # not glibc (musl)
        ({}, "linux", (2, 25)),  # glibc without tunables
    ],
)
def test_nothing_changes_where_it_cannot_help_or_was_chosen(monkeypatch, environ, platform, glibc):
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(hostmem, "_glibc_version", lambda: glibc)
    monkeypatch.setattr(hostmem, "_thp_mode", lambda: "madvise")
    assert hostmem.malloc_environ(environ) is None


def test_the_kernels_mode_is_the_bracketed_one(monkeypatch, tmp_path):
    path = tmp_path / "enabled"
    monkeypatch.setattr(hostmem, "_THP_MODE", path)
    assert hostmem._thp_mode() is None  # no such file
    path.write_text("always [madvise] never\n")
    assert hostmem._thp_mode() == "madvise"
    path.write_text("[always] madvise never\n")
    assert hostmem._thp_mode() == "always"


def test_a_command_reexecutes_itself_once_with_the_tunables():
    """The process image is replaced with the same pid and arguments; what ran before the call
    runs twice, what runs after it once, with the tunables in the environment (on a machine where
    they would change nothing, once, with the environment as it was)."""
    code = (
        "import os, sys\n"
        "print('start', os.getpid(), sys.argv[1:], flush=True)\n"
        "from posattn import hostmem\n"
        "hostmem.reexec_with_malloc_tunables()\n"
        "print('after', os.getpid(), os.environ.get('GLIBC_TUNABLES', ''))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hostmem.OPT_OUT)}
    proc = subprocess.run(
        [sys.executable, "-c", code, "an", "argument"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=True,
    )
    lines = proc.stdout.splitlines()
    starts = [line for line in lines if line.startswith("start")]
    afters = [line for line in lines if line.startswith("after")]
    expected = hostmem.malloc_environ(env)
    assert len(afters) == 1 and len(starts) == (1 if expected is None else 2), proc.stdout
    pid = starts[0].split()[1]
    assert all(line.split()[1] == pid for line in starts + afters)  # the same process
    assert all(line.endswith("['an', 'argument']") for line in starts)  # the same arguments
    tunables = afters[0].split(maxsplit=2)[2:] or [""]
    assert tunables[0] == ("" if expected is None else expected["GLIBC_TUNABLES"])
    if expected is None:
        pytest.skip("this machine would not gain from the tunables: only the no-op path ran")


def test_the_loop_warns_only_of_scratch_glibc_maps_afresh(helps):
    assert hostmem.scratch_hint(hostmem.MMAP_LIMIT, {}) is None  # served from the heap
    hint = hostmem.scratch_hint(194 << 20, {})
    tunables = hostmem.tunables_string()
    assert "194 MiB" in hint and f"GLIBC_TUNABLES={tunables} " in hint
    assert hostmem.scratch_hint(194 << 20, {"GLIBC_TUNABLES": tunables}) is None
    assert hostmem.scratch_hint(194 << 20, {hostmem.OPT_OUT: "0"}) is None


def test_the_loop_reads_a_programs_scratch():
    import jax
    import jax.numpy as jnp

    from posattn.train import loop

    x = jnp.ones((64, 1024))
    compiled = jax.jit(lambda x: jnp.tanh(x.T @ x).sum()).lower(x).compile()
    assert loop._scratch_bytes(compiled) >= 1024 * 1024 * 4  # the [1024, 1024] product
    assert loop._scratch_bytes(object()) == 0


_FAULTS = """
import resource, jax, jax.numpy as jnp
x, w = jnp.ones((8192, 8)), jnp.ones((8, 1024))
run = jax.jit(lambda x, w: jnp.tanh(jnp.cumsum(x @ w, axis=0)).sum()).lower(x, w).compile()
faults = []
for _ in range(15):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    run(x, w).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(run.memory_analysis().temp_size_in_bytes, *faults)
"""


def _faults_per_run(tunables: str) -> tuple[int, list[int]]:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env["GLIBC_TUNABLES"] = tunables
    proc = subprocess.run(
        [sys.executable, "-c", _FAULTS],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=True,
    )
    scratch, *faults = (int(x) for x in proc.stdout.split())
    return scratch, faults


def test_the_kept_heap_serves_the_scratch_without_page_faults():
    """A program with 64 MiB of scratch, run 15 times: with the tunables that keep the heap, the
    runs after the heap has grown to hold it take no page faults; glibc's defaults map and fault
    the whole block in on every run (4 KiB pages where transparent huge pages are not "always")."""
    if hostmem.tunables_string() is None:
        pytest.skip("not Linux with glibc >= 2.26: no malloc tunables")
    scratch, kept = _faults_per_run(":".join(hostmem.KEEP_SCRATCH))
    pages = scratch // 4096
    assert scratch > hostmem.MMAP_LIMIT
    assert sorted(kept[-5:])[2] < pages // 100, kept  # the median of the last five runs
    if hostmem._thp_mode() != "always":
        _, default = _faults_per_run("glibc.malloc.hugetlb=0")
        assert sorted(default[-5:])[2] > pages // 2, default
