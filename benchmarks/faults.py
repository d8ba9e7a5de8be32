"""Fault injection: SIGKILL a training run at random moments, resume it each time, compare the losses.

    python benchmarks/faults.py --kills 20 --workdir /tmp/posattn_faults

A reference run trains uninterrupted; the faulty run is started with the same command, killed
with SIGKILL at a random moment once it is training (checkpoints every 2 steps, so many kills land
during a checkpoint write), and restarted, `--kills` times, then allowed to finish. Reported:
kills survived (the restart resumed and the run went on), kills that hit a checkpoint write (an
orbax temporary directory was left behind), checkpoints lost (steps whose checkpoint was damaged or
incomplete and was discarded on resume), and mismatches (steps whose final logged loss differs
from the reference's, bit for bit).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
OVERRIDES = [
    "model.d_model=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "data.seq_len=32",
    "train.batch_size=8",
    "train.eval_every=0",
    "train.warmup_steps=10",
    "train.checkpoint_every=2",
    "train.log_every=1",
    "train.keep_checkpoints=3",
]


def command(workdir: pathlib.Path, steps: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "posattn.train",
        "--config",
        str(ROOT / "configs" / "tiny.py"),
        "--workdir",
        str(workdir),
        f"--config.train.steps={steps}",
    ] + [f"--config.{o}" for o in OVERRIDES]


def logged_losses(workdir: pathlib.Path) -> dict[int, float]:
    path = workdir / "metrics.jsonl"
    out = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out


def checkpoint_steps(workdir: pathlib.Path) -> set[int]:
    folder = workdir / "checkpoints"
    return {int(p.name) for p in folder.iterdir() if p.name.isdigit()} if folder.exists() else set()


def temporary_dirs(workdir: pathlib.Path) -> list[str]:
    folder = workdir / "checkpoints"
    return [p.name for p in folder.iterdir() if "tmp" in p.name] if folder.exists() else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--workdir", type=pathlib.Path, default=pathlib.Path("/tmp/posattn_faults"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    shutil.rmtree(args.workdir, ignore_errors=True)
    reference, faulty = args.workdir / "reference", args.workdir / "faulty"
    env = dict(os.environ, JAX_PLATFORMS="cpu")

    start = time.perf_counter()
    subprocess.run(command(reference, args.steps), check=True, env=env, capture_output=True)
    print(f"reference run: {args.steps} steps in {time.perf_counter() - start:.1f}s", flush=True)

    survived = during_write = 0
    discarded: set[int] = set()
    log = []
    for kill in range(args.kills):
        before = len(logged_losses(faulty))
        proc = subprocess.Popen(
            command(faulty, args.steps),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        while proc.poll() is None and len(logged_losses(faulty)) <= before:
            time.sleep(0.02)  # wait until this restart is training
        if proc.poll() is not None:
            print(f"run finished before kill {kill + 1}; stopping the kills there")
            log.append(proc.communicate()[0])
            break
        time.sleep(rng.uniform(0.0, 0.6))
        saved_before = checkpoint_steps(faulty)
        proc.kill()
        log.append(proc.communicate()[0])
        hit_write = bool(temporary_dirs(faulty))
        during_write += hit_write
        print(
            f"kill {kill + 1:2d}: at step {max(logged_losses(faulty), default=0):4d}, "
            f"checkpoints {sorted(saved_before)[-3:]}, during a write: {hit_write}",
            flush=True,
        )
        survived += 1
    final = subprocess.run(command(faulty, args.steps), env=env, capture_output=True, text=True)
    log.append(final.stdout + final.stderr)
    for text in log:
        for line in text.splitlines():
            if "is damaged" in line:
                discarded.add(int(line.split("checkpoint ")[1].split(" ")[0]))
    ref, got = logged_losses(reference), logged_losses(faulty)
    mismatches = sum(1 for step in ref if got.get(step) != ref[step])
    summary = {
        "kills": args.kills,
        "kills_survived": survived if final.returncode == 0 else 0,
        "kills_during_checkpoint_write": during_write,
        "checkpoints_lost": len(discarded),
        "steps_compared": len(ref),
        "mismatches": mismatches,
        "final_returncode": final.returncode,
        "wall_s": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(summary))
    return 0 if mismatches == 0 and final.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
