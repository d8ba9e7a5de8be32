"""`posattn.hostmem`: where the commands add glibc's huge-page tunable, and the re-exec that
applies it."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT

from posattn import hostmem


@pytest.fixture
def helps(monkeypatch):
    """A machine where the tunable takes effect: Linux, glibc 2.36, THP in "madvise" mode."""
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(hostmem, "_glibc_version", lambda: (2, 36))
    monkeypatch.setattr(hostmem, "_thp_mode", lambda: "madvise")


def test_the_tunable_is_added_and_the_rest_kept(helps):
    environ = {"PATH": "/bin", "HOME": "/h"}
    env = hostmem.huge_pages_environ(environ)
    assert env == {**environ, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert "GLIBC_TUNABLES" not in environ  # the argument is not changed
    env = hostmem.huge_pages_environ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    assert hostmem.huge_pages_environ(env) is None  # once only: no loop of re-execs
    assert hostmem.huge_pages_environ({hostmem.OPT_OUT: "1"}) is not None


@pytest.mark.parametrize(
    "environ, platform, glibc, mode",
    [
        ({hostmem.OPT_OUT: "0"}, "linux", (2, 36), "madvise"),  # asked not to
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "linux", (2, 36), "madvise"),  # chosen
        ({}, "darwin", (2, 36), "madvise"),
        ({}, "linux", None, "madvise"),  # not glibc (musl)
        ({}, "linux", (2, 34), "madvise"),  # glibc without the tunable
        ({}, "linux", (2, 36), "always"),  # large mappings get huge pages already
        ({}, "linux", (2, 36), "never"),  # they cannot get them
        ({}, "linux", (2, 36), None),  # no THP in this kernel
    ],
)
def test_nothing_changes_where_it_cannot_help(monkeypatch, environ, platform, glibc, mode):
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(hostmem, "_glibc_version", lambda: glibc)
    monkeypatch.setattr(hostmem, "_thp_mode", lambda: mode)
    assert hostmem.huge_pages_environ(environ) is None


def test_the_kernels_mode_is_the_bracketed_one(monkeypatch, tmp_path):
    path = tmp_path / "enabled"
    monkeypatch.setattr(hostmem, "_THP_MODE", path)
    assert hostmem._thp_mode() is None  # no such file
    path.write_text("always [madvise] never\n")
    assert hostmem._thp_mode() == "madvise"
    path.write_text("[always] madvise never\n")
    assert hostmem._thp_mode() == "always"


def test_a_command_reexecutes_itself_once_with_the_tunable():
    """The process image is replaced with the same pid and arguments; what ran before the call
    runs twice, what runs after it once, with the tunable in the environment (on a machine where
    it would change nothing, once, with the environment as it was)."""
    code = (
        "import os, sys\n"
        "print('start', os.getpid(), sys.argv[1:], flush=True)\n"
        "from posattn import hostmem\n"
        "hostmem.reexec_with_huge_pages()\n"
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
    expected = hostmem.huge_pages_environ(env)
    assert len(afters) == 1 and len(starts) == (1 if expected is None else 2), proc.stdout
    pid = starts[0].split()[1]
    assert all(line.split()[1] == pid for line in starts + afters)  # the same process
    assert all(line.endswith("['an', 'argument']") for line in starts)  # the same arguments
    tunables = afters[0].split(maxsplit=2)[2:] or [""]
    assert tunables[0] == ("" if expected is None else hostmem.TUNABLE)
    if expected is None:
        pytest.skip("this machine would not gain from the tunable: only the no-op path ran")


def test_the_loop_warns_only_of_scratch_glibc_maps_afresh(helps):
    assert hostmem.scratch_hint(hostmem.MMAP_LIMIT, {}) is None  # served from the heap
    hint = hostmem.scratch_hint(194 << 20, {})
    assert "194 MiB" in hint and f"GLIBC_TUNABLES={hostmem.TUNABLE}" in hint
    assert hostmem.scratch_hint(194 << 20, {"GLIBC_TUNABLES": hostmem.TUNABLE}) is None
    assert hostmem.scratch_hint(194 << 20, {hostmem.OPT_OUT: "0"}) is None


def test_the_loop_reads_a_programs_scratch():
    import jax
    import jax.numpy as jnp

    from posattn.train import loop

    x = jnp.ones((64, 1024))
    compiled = jax.jit(lambda x: jnp.tanh(x.T @ x).sum()).lower(x).compile()
    assert loop._scratch_bytes(compiled) >= 1024 * 1024 * 4  # the [1024, 1024] product
    assert loop._scratch_bytes(object()) == 0
