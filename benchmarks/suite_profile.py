"""Where the test suite's time goes: XLA compiles per test and per program.

    python benchmarks/suite_profile.py                       # the whole suite (-n auto, as CI)
    python benchmarks/suite_profile.py tests/nn -n 0 --durations=20   # any pytest arguments

Runs `python -m pytest -q ARGS` with this file loaded as a pytest plugin (in every
xdist worker). The plugin listens to JAX's own compile events (`jax.monitoring`) and writes,
per worker, every test's wall seconds and the seconds and count of its XLA compiles (all of
them, and those under 0.2 s: mostly the one-op programs of eager, op-by-op calls), and each
compiled function's name with its total, and the seconds spent tracing functions to jaxprs and
lowering those to StableHLO (nested traces count in each enclosing one). Afterwards the script
prints the totals, the programs that took the most compile time and the tests that took the most
wall time. Compiles in
subprocesses that tests start (the multi-device and worker-process tests) are not seen: their
time is wall time of the test without compile time. A compile answered by the persistent
compilation cache counts as a (short) compile.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import pytest

_COMPILE = "/jax/core/compile/backend_compile_duration"
_TRACE = "/jax/core/compile/jaxpr_trace_duration"  # Python tracing to a jaxpr
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # the jaxpr to StableHLO
_SMALL = 0.2  # seconds: a one-op program compiles in well under this on a CPU
_OUT = "POSATTN_SUITE_PROFILE_DIR"

_test = collections.Counter()  # the running test's seconds per kind
_count = collections.Counter()
_programs = collections.defaultdict(lambda: [0, 0.0])  # name -> [count, seconds]
_rows: list[dict] = []


def _listen(event: str, duration: float, fun_name: str | None = None, **_):
    if event in (_TRACE, _LOWER):
        _test["trace" if event == _TRACE else "lower"] += duration
        return
    if event != _COMPILE:
        return
    _test["compile"] += duration
    _count["compile"] += 1
    if duration < _SMALL:
        _test["small"] += duration
        _count["small"] += 1
    entry = _programs[fun_name or "?"]
    entry[0] += 1
    entry[1] += duration


def pytest_configure(config):
    import jax

    jax.monitoring.register_event_duration_secs_listener(_listen)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _test.clear()
    _count.clear()
    start = time.perf_counter()
    yield
    _rows.append(
        {
            "test": item.nodeid,
            "wall": time.perf_counter() - start,
            "compile": _test["compile"],
            "compiles": _count["compile"],
            "small": _test["small"],
            "smalls": _count["small"],
            "trace": _test["trace"],
            "lower": _test["lower"],
        }
    )


def pytest_unconfigure(config):
    out = os.environ.get(_OUT)
    if not out:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    path = pathlib.Path(out) / f"{worker}.json"
    path.parent.mkdir(parents=True, exist_ok=True)  # the plugin may run without the script
    path.write_text(json.dumps({"tests": _rows, "programs": dict(_programs)}))


def _summarise(out: pathlib.Path, wall: float, top: int) -> None:
    rows, programs = [], collections.defaultdict(lambda: [0, 0.0])
    for path in sorted(out.glob("*.json")):
        found = json.loads(path.read_text())
        rows += found["tests"]
        for name, (n, seconds) in found["programs"].items():
            programs[name][0] += n
            programs[name][1] += seconds
    if not rows:
        print("no test ran under the plugin", file=sys.stderr)
        return
    keys = ("wall", "compile", "compiles", "small", "smalls", "trace", "lower")
    total = {k: sum(r.get(k, 0.0) for r in rows) for k in keys}
    print(f"\n# {len(rows)} tests, {wall:.0f} s wall; summed over workers:")
    print(f"test time {total['wall']:.0f} s")
    print(
        f"XLA compiles {total['compile']:.0f} s ({total['compile'] / total['wall']:.0%} of it), "
        f"{total['compiles']} programs"
    )
    print(
        f"  of which under {_SMALL} s (one-op programs of eager calls, mostly): "
        f"{total['small']:.0f} s, {total['smalls']} programs"
    )
    print(
        f"tracing to jaxprs {total['trace']:.0f} s, lowering them to StableHLO "
        f"{total['lower']:.0f} s ({(total['trace'] + total['lower']) / total['wall']:.0%})"
    )
    print(f"\n# the {top} programs with the most compile time (seconds, compiles, name)")
    for name, (n, seconds) in sorted(programs.items(), key=lambda x: -x[1][1])[:top]:
        print(f"{seconds:8.1f} {n:6d}  {name}")
    files = collections.defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        entry = files[r["test"].split("::")[0]]
        entry[0] += r["wall"]
        entry[1] += r["compile"]
    print(f"\n# the {top} files with the most test time (seconds, of it compiling, file)")
    for name, (seconds, compiling) in sorted(files.items(), key=lambda x: -x[1][0])[:top]:
        print(f"{seconds:8.1f} {compiling:8.1f}  {name}")
    print(f"\n# the {top} slowest tests (wall, compile, compiles, under {_SMALL} s, test)")
    for r in sorted(rows, key=lambda r: -r["wall"])[:top]:
        numbers = f"{r['wall']:7.1f} {r['compile']:7.1f} {r['compiles']:6d} {r['small']:6.1f}"
        print(f"{numbers}  {r['test']}")


def main(argv: list[str]) -> int:
    top = 25
    root = pathlib.Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="suite-profile-") as out:
        env = dict(os.environ, **{_OUT: out})
        here = str(pathlib.Path(__file__).resolve().parent)
        env["PYTHONPATH"] = os.pathsep.join(x for x in (here, env.get("PYTHONPATH")) if x)
        command = [sys.executable, "-m", "pytest", "-q", "-p", "suite_profile"]
        start = time.perf_counter()
        code = subprocess.call([*command, *argv], cwd=root, env=env)
        _summarise(pathlib.Path(out), time.perf_counter() - start, top)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
