"""The training step at two commits, in alternating windows: which is faster, and do they agree?

Question: does a change make the step faster, by more than the machine's own drift? Rounds run
one after the other (`benchmarks/train_throughput.py` at each commit) see a VM's speed move by as
much as a change's gain; windows of a few steps alternated between two live processes see the
same stretches of it.

Run (from the repository root, in a git checkout):
    python benchmarks/step_ab.py --against REV
    python benchmarks/step_ab.py --against HEAD~1 --configs tiny small --families rope alibi
    taskset -c 0 python benchmarks/step_ab.py --against REV --configs tiny   # one core
    python benchmarks/step_ab.py --xla-flags="--xla_cpu_use_onednn=true"    # an XLA option

REV's tree is exported (`git archive`) to a temporary directory. For each (config, family) two
worker processes are started, one on REV's `src/` and `benchmarks/train_throughput.py`, one on
this checkout's (uncommitted changes included), each building the step as
`benchmarks/train_throughput.py` does (its `Case`: the jitted `train_step`, donated state, the same
stdlib batches) and warming it up. The parent then asks them in turn, --pairs times (the order
swapped every pair), to run --steps consecutive steps and report their mean, so that only one
computes at a time. Printed per (config, family): each side's best and median window, the median
and quartiles of the pairs' ratios (this checkout / REV; below 1: faster), and whether the two
training states were bitwise equal after the warm-up and at the end (a change that keeps the
step's math and its rounding keeps them equal). Times vary between machines and with load.

With --xla-flags FLAGS, this checkout's worker runs with FLAGS added to XLA_FLAGS; without
--against, the other side is this checkout too, without them: whether an XLA:CPU option makes the
step faster, and whether it keeps its bits.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tarfile
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def worker(benchmarks: str, config: str, family: str, steps: int) -> None:
    """Serves one step over stdin/stdout: `run` (ms a step over `steps` steps), `digest`, `quit`."""
    sys.path.insert(0, benchmarks)
    import jax
    import numpy as np
    import train_throughput

    case = train_throughput.Case(config, family, steps_per_round=steps, overrides=[])

    def digest() -> str:
        leaves = jax.tree_util.tree_leaves(case.state)
        return hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in leaves)).hexdigest()[:16]

    print(json.dumps({"ready": digest()}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "run":
            print(json.dumps({"ms": case.run_steps()[0] * 1e3}), flush=True)
        elif command == "digest":
            print(json.dumps({"digest": digest()}), flush=True)
        else:
            return


class Worker:
    def __init__(
        self, tree: pathlib.Path, config: str, family: str, steps: int, xla_flags: str = ""
    ):
        env = dict(os.environ, PYTHONPATH=str(tree / "src"))
        if xla_flags:
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
        command = [sys.executable, __file__, "--worker", str(tree / "benchmarks")]
        command += ["--configs", config, "--families", family, "--steps", str(steps)]
        self.process = subprocess.Popen(
            command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.ready = self._read()["ready"]

    def _read(self) -> dict:
        for line in self.process.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"a worker exited ({self.process.wait()}) before answering")

    def ask(self, command: str) -> dict:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.process.stdin.write("quit\n")
        self.process.stdin.close()
        self.process.wait()


def export(rev: str, into: pathlib.Path) -> str:
    """REV's tree under `into` (git archive); returns its short hash."""
    found = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "--verify", f"{rev}^{{commit}}"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if found.returncode != 0:
        raise SystemExit(
            f"step_ab.py: {rev!r} is not a commit of the git checkout at {ROOT} "
            f"({found.stderr.strip() or 'git failed'}); pass --against a commit, e.g. HEAD~1"
        )
    commit = found.stdout.strip()
    archive = into / "tree.tar"
    subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", "-o", str(archive), commit], check=True
    )
    with tarfile.open(archive) as tar:
        tar.extractall(into / "tree", filter="data")
    return commit


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", help="the commit to compare this checkout with")
    parser.add_argument("--configs", nargs="+", default=["small"])
    parser.add_argument("--families", nargs="+", default=["rope"])
    parser.add_argument(
        "--steps", type=int, help="steps a window (default: 40 at tiny, 5 otherwise, ~1 s)"
    )
    parser.add_argument("--pairs", type=int, default=24, help="windows of each side")
    parser.add_argument(
        "--xla-flags", default="", help="XLA_FLAGS added for this checkout's side only"
    )
    parser.add_argument("--worker", metavar="BENCHMARKS", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:  # as `python -m posattn.train` and train_throughput.py run (posattn.hostmem)
        from posattn import hostmem

        hostmem.reexec_with_malloc_tunables()
        return worker(args.worker, args.configs[0], args.families[0], args.steps or 5)
    if not args.against and not args.xla_flags:
        parser.error(
            "--against REV (or --xla-flags FLAGS, this checkout with and without) is required"
        )
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _machine import cpu_name

    ours = f"this checkout with {args.xla_flags}" if args.xla_flags else "this checkout"
    with tempfile.TemporaryDirectory() as scratch:
        if args.against:
            commit = export(args.against, pathlib.Path(scratch))
            base = pathlib.Path(scratch) / "tree"
        else:
            commit, base = "this checkout", ROOT
        print(f"# {cpu_name()}; {ours} against {commit}; {args.pairs} pairs of windows")
        print(
            "\n| config | family | steps a window | "
            f"{commit} ms a step (best / median) | {ours} (best / median) | "
            "ratio of pairs (median, quartiles) | states equal (warm-up, end) |"
        )
        print("|---|---|---|---|---|---|---|")
        for config in args.configs:
            for family in args.families:
                steps = args.steps or (40 if config == "tiny" else 5)
                sides = [
                    Worker(base, config, family, steps),
                    Worker(ROOT, config, family, steps, args.xla_flags),
                ]
                times = [[], []]
                for i in range(args.pairs):
                    for side in (0, 1) if i % 2 == 0 else (1, 0):
                        times[side].append(sides[side].ask("run")["ms"])
                equal = (
                    sides[0].ready == sides[1].ready,
                    sides[0].ask("digest") == sides[1].ask("digest"),
                )
                for side in sides:
                    side.close()
                ratios = sorted(b / a for a, b in zip(*times, strict=True))
                quartiles = statistics.quantiles(ratios, n=4)
                cells = [f"{min(t):.1f} / {statistics.median(t):.1f}" for t in times]
                print(
                    f"| {config} | {family} | {steps} | {cells[0]} | {cells[1]} | "
                    f"{statistics.median(ratios):.3f} ({quartiles[0]:.3f}-{quartiles[2]:.3f}) | "
                    f"{'yes' if equal[0] else 'no'}, {'yes' if equal[1] else 'no'} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
