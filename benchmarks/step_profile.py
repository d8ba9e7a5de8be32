"""Where a training step's time goes, op by op: a `jax.profiler` trace read back into tables.

Question: which of XLA's compiled ops does a posattn training step run, how many of them, and how
long does each take on this CPU? (`benchmarks/train_throughput.py` times the whole step and a few
pieces alone; this reads the step itself.)

Run (from the repository root):
    python benchmarks/step_profile.py --configs tiny small --families rope alibi
    python benchmarks/step_profile.py --configs tiny --families rope --top 40

For each (config, family) it builds the step exactly as `benchmarks/train_throughput.py` does (its
`Case`: the jitted `train_step` with donated state on stdlib batches), warms it up, traces
--steps consecutive steps with `jax.profiler.trace`, and reads the trace back with
`jax.profiler.ProfileData`: every op XLA:CPU ran (a thunk: a library GEMM, a fused loop, a while
loop, a copy) with its duration. Each op is matched by name to the compiled HLO
(`compiled.as_text()`), which gives its kind, output shape and the JAX operation it came from
(`op_name` metadata), hence its phase: "forward" (under `jvp`), "backward" (under
`transpose(jvp)`) or "update" (the optimiser, clipping, metrics: outside the gradient).

Printed per (config, family): the step's wall time in the trace, the ops per step, then
  * by kind: library GEMMs (XNNPACK/YNNPACK fusions and plain dots), while loops (the attention
    kernel's scan over batch rows, the chunked loss), fused elementwise loops, copies and
    transposes, others;
  * by phase: forward, backward, update;
  * the --top longest ops, with their shape and source operation.
The process runs with posattn's malloc tunables, as `python -m posattn.train` and
train_throughput.py do (`posattn.hostmem`): without them every step maps its scratch afresh and
the ops that first write it (the forward's) take the page faults (the small step's forward ran 2.3x
longer in the trace without them: docs/benchmarks.md, "The step's profile without page faults").
Durations are the trace's own (the profiler adds a little per op); shares are of the summed op
time, which excludes the gaps between ops (dispatch). XLA's own `dot` thunks (the weight
gradients of a step) appear to run asynchronously on the thread pool: their events (0.1-0.4 ms at
the small shape) seem to record the dispatch only, their work showing in the ops beside them
(docs/benchmarks.md, "Keeping the scratch in the heap"). Times vary between machines and with
load: compare configurations only within one run.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import sys
import tempfile

from posattn import hostmem

if __name__ == "__main__":
    hostmem.reexec_with_malloc_tunables()  # the step as train_throughput.py and training run it

import jax  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import train_throughput  # noqa: E402  (the benchmark's Case: the same step, the same batches)
from _machine import cpu_name  # noqa: E402

# Children of an op's event (or the executor itself): not ops.
_SKIP = ("ThunkExecutor", "Slinky", "ThreadpoolListener", "end: ")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = (\(.*?\)|\S+) ([\w-]+)\((.*)$")
_OP_NAME = re.compile(r'op_name="([^"]+)"')


def hlo_index(text: str) -> dict[str, tuple[str, str, str]]:
    """{instruction name: (opcode, output shape, op_name)} of a compiled HLO module's text."""
    index = {}
    for line in text.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            name, shape, opcode, rest = m.groups()
            op = _OP_NAME.search(rest)
            index[name] = (opcode, shape, op.group(1) if op else "")
    return index


def kind_of(name: str, opcode: str) -> str:
    if name.startswith(("ynn_fusion", "xnn_fusion", "onednn")) or opcode in ("dot", "convolution"):
        return "GEMM (library)"
    if opcode == "while":
        return "while loop"
    if opcode == "fusion":
        return "fused loop"
    if opcode in ("copy", "transpose") or "copy" in name or "transpose" in name:
        return "copy / transpose"
    return "other"


def phase_of(op_name: str) -> str:
    if "transpose(jvp" in op_name:
        return "backward"
    if "jvp(" in op_name:
        return "forward"
    return "update"


def profile(case: train_throughput.Case, steps: int) -> list[tuple[str, int]]:
    """(op name, duration ns) of every op the trace saw over `steps` steps."""
    case.batches = case.batches[:steps]
    for _ in range(2):
        case.run_steps()
    with tempfile.TemporaryDirectory() as logdir:
        with jax.profiler.trace(logdir):
            case.run_steps()
        (path,) = pathlib.Path(logdir).rglob("*.xplane.pb")
        data = jax.profiler.ProfileData.from_file(str(path))
    events = []
    for plane in data.planes:
        for line in plane.lines:
            if line.name.startswith("tf_XLA"):
                ops = [ev for ev in line.events if not ev.name.startswith(_SKIP)]
                events.extend(exclusive(ops))
    return events


def exclusive(ops) -> list[tuple[str, int]]:
    """(name, duration ns) of one thread's op events, each without the ops nested in it (a while
    loop's event spans the ops of its body, which are events of their own)."""
    ops = sorted(ops, key=lambda ev: (ev.start_ns, -ev.duration_ns))
    out, stack = [], []  # stack: [index in out, end time] of the enclosing ops
    for ev in ops:
        while stack and ev.start_ns >= stack[-1][1]:
            stack.pop()
        if stack:
            out[stack[-1][0]][1] -= ev.duration_ns
        stack.append([len(out), ev.start_ns + ev.duration_ns])
        out.append([ev.name, ev.duration_ns])
    return [(name, max(d, 0)) for name, d in out]


def report(case, steps: int, top: int) -> None:
    compiled = case.step.lower(case.state, case.batches[0]).compile()
    index = hlo_index(compiled.as_text())
    events = profile(case, steps)
    total = sum(d for _, d in events)
    by_kind, by_phase, by_op = (collections.defaultdict(lambda: [0, 0]) for _ in range(3))
    for name, d in events:
        opcode, shape, op_name = index.get(name, ("?", "?", ""))
        for table, key in (
            (by_kind, kind_of(name, opcode)),
            (by_phase, phase_of(op_name)),
            (by_op, name),
        ):
            table[key][0] += 1
            table[key][1] += d
    ms = 1e-6 / steps
    print(f"\n## {case.name} / {case.family}: B {case.B}, T {case.T}")
    print(
        f"\n{len(events) / steps:.0f} ops a step, {total * ms:.1f} ms of op time a step "
        f"(traced over {steps} steps)\n"
    )
    for title, table in (("kind", by_kind), ("phase", by_phase)):
        print(f"| {title} | ops a step | ms a step | share |\n|---|---|---|---|")
        for key, (n, d) in sorted(table.items(), key=lambda kv: -kv[1][1]):
            print(f"| {key} | {n / steps:.0f} | {d * ms:.2f} | {100 * d / total:.0f}% |")
        print()
    print("| op | kind | shape | from | ms a step |\n|---|---|---|---|---|")
    for name, (_, d) in sorted(by_op.items(), key=lambda kv: -kv[1][1])[:top]:
        opcode, shape, op_name = index.get(name, ("?", "?", ""))
        source = op_name.removeprefix("jit(train_step)/")
        shape = shape if len(shape) <= 40 else shape[:37] + "..."
        print(f"| {name} | {kind_of(name, opcode)} | `{shape}` | {source} | {d * ms:.2f} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--configs", nargs="+", default=["tiny", "small"], choices=list(train_throughput.CONFIGS)
    )
    parser.add_argument("--families", nargs="+", default=["rope", "alibi"])
    parser.add_argument("--steps", type=int, default=10, help="steps traced")
    parser.add_argument("--top", type=int, default=15, help="longest ops listed")
    args = parser.parse_args(argv)
    print(
        f"# {cpu_name()}; jax {jax.__version__} ({jax.default_backend()}); "
        f"load average {train_throughput.load_average()}"
    )
    for config_name in args.configs:
        for family in args.families:
            case = train_throughput.Case(
                config_name, family, steps_per_round=args.steps, overrides=[]
            )
            report(case, args.steps, args.top)


if __name__ == "__main__":
    main()
