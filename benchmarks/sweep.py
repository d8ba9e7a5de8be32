"""Wall time of an 8-member vmap sweep against the same 8 runs one after another.

    python benchmarks/sweep.py                    # as a user runs them: 1 sweep command vs 8
                                                  # train commands
    python benchmarks/sweep.py --mode in-process  # same process: train_and_evaluate x 8 vs
                                                  # run_sweep
    python benchmarks/sweep.py --steps 50         # shorter runs (compilation weighs more)

Both sides include everything a user waits for: compilation, initialisation, training, evaluation
and checkpoints (and, in `cli` mode, interpreter start-up and imports). The members are those of
configs/sweep_tiny.py (2 families x 2 seeds x 2 learning rates: two compiled programs of four
members); each single run is the `command` its sweep.json record gives. Timings on a shared machine
are noisy, so the script prints the ratio of two measurements taken in the same process, one after
the other.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "sweep_tiny.py"


def _cli(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", *args], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("cli", "in-process"), default="cli")
    parser.add_argument(
        "--steps", type=int, default=None, help="train.steps (default: the config's)"
    )
    args = parser.parse_args()
    extra = [f"--config.train.steps={args.steps}"] if args.steps else []

    from posattn import config as config_lib
    from posattn import sweep
    from posattn.sweep import plan as sweep_config

    config = config_lib.load_config(CONFIG, extra)
    programs = sweep_config.plan(config, cli_overrides=extra)
    members = [m for p in programs for m in p.members]
    assert len(members) == 8, len(members)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        if args.mode == "cli":
            t_sweep = _cli(
                ["posattn.sweep", "--config", str(CONFIG), "--workdir", str(tmp / "sweep"), *extra]
            )
            t_single = sum(
                _cli(
                    [
                        "posattn.train",
                        "--config",
                        str(CONFIG),
                        "--workdir",
                        str(tmp / f"m{m.index}"),
                        *[sweep_config.format_override(k, v) for k, v in m.overrides.items()],
                    ]
                )
                for m in members
            )
        else:
            from posattn.train import train_and_evaluate

            start = time.perf_counter()
            sweep.run_sweep(config, tmp / "sweep", cli_overrides=extra)
            t_sweep = time.perf_counter() - start
            start = time.perf_counter()
            for m in members:
                train_and_evaluate(m.config, tmp / f"m{m.index}")
            t_single = time.perf_counter() - start
        records = json.loads((tmp / "sweep" / "sweep.json").read_text())["members"]
    load = os.getloadavg()[0]
    print(
        f"mode={args.mode} steps={config.train.steps} members=8 programs={len(programs)} "
        f"cpus={os.cpu_count()} load1={load:.1f}"
    )
    print(f"8 sequential single runs: {t_single:.1f} s")
    print(f"one 8-member sweep:       {t_sweep:.1f} s")
    print(f"speed-up (single runs / sweep): {t_single / t_sweep:.2f}x")
    print("final train losses:", ", ".join(f"{r['final_train_loss']:.3f}" for r in records))


if __name__ == "__main__":
    main()
