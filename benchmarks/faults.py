"""Fault injection: SIGKILL a training run at random moments, resume it, compare the losses.

    python benchmarks/faults.py --kills 20 --workdir /tmp/posattn_faults

A reference run trains uninterrupted; the faulty run is started with the same command, killed
with SIGKILL at a random moment once it is training and has a checkpoint (checkpoints every 2
steps, so many kills land during a checkpoint write), and restarted, `--kills` times, then allowed
to finish. Per kill: the step it hit, the newest complete checkpoint at that moment, the step the
restart restored (from its `resuming ... from step N` line) and the steps lost (retrained). A kill
counts as survived only when the restart restored a step. Reported in total: kills survived, kills
that hit a checkpoint write (an orbax temporary directory was left behind), checkpoints lost (a
restart restored an older step than the newest complete checkpoint at its kill), damaged
checkpoints (moved to checkpoints/damaged/), steps lost per kill, and mismatches (steps whose final
logged loss differs from the reference's, bit for bit).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
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


def restored_step(output: str) -> int | None:
    """The step a process of the run resumed from (its `resuming ... from step N` line), if any."""
    found = re.search(r"resuming .* from step (\d+)", output)
    return int(found.group(1)) if found else None


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

    kills = []  # one dict per kill; "restored" is filled from the restart's output
    outputs = []  # the output of every process of the faulty run, in order
    for kill in range(args.kills):
        before = len(logged_losses(faulty))
        proc = subprocess.Popen(
            command(faulty, args.steps),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        # Wait until this (re)start is training and there is a checkpoint to resume from.
        while proc.poll() is None and (
            len(logged_losses(faulty)) <= before or not checkpoint_steps(faulty)
        ):
            time.sleep(0.02)
        if proc.poll() is not None:
            print(f"run finished before kill {kill + 1}; stopping the kills there")
            outputs.append(proc.communicate()[0])
            break
        time.sleep(rng.uniform(0.0, 0.6))
        saved_before = checkpoint_steps(faulty)
        proc.kill()
        outputs.append(proc.communicate()[0])
        kills.append(
            {
                "at_step": max(logged_losses(faulty), default=0),
                "newest_checkpoint": max(saved_before, default=0),
                "during_write": bool(temporary_dirs(faulty)),
            }
        )
    final = subprocess.run(command(faulty, args.steps), env=env, capture_output=True, text=True)
    outputs.append(final.stdout + final.stderr)
    # The restart after kill k is process k + 1: what it restored says what the kill cost.
    for k, record in enumerate(kills):
        restored = restored_step(outputs[k + 1])
        record["restored"] = restored
        record["steps_lost"] = None if restored is None else record["at_step"] - restored
        print(
            f"kill {k + 1:2d}: at step {record['at_step']:4d}, newest checkpoint "
            f"{record['newest_checkpoint']:4d}, during a write: {record['during_write']!s:5}, "
            f"restart restored step {restored}, steps lost {record['steps_lost']}",
            flush=True,
        )
    survived = [r for r in kills if r["restored"] is not None]
    lost = [r["steps_lost"] for r in survived]
    damaged_dir = faulty / "checkpoints" / "damaged"
    ref, got = logged_losses(reference), logged_losses(faulty)
    mismatches = sum(1 for step in ref if got.get(step) != ref[step])
    summary = {
        "kills": len(kills),
        "kills_survived": len(survived),
        "kills_during_checkpoint_write": sum(r["during_write"] for r in kills),
        "checkpoints_lost": sum(
            1 for r in kills if r["restored"] is None or r["restored"] < r["newest_checkpoint"]
        ),
        "damaged_checkpoints_moved_aside": len(list(damaged_dir.iterdir()))
        if damaged_dir.exists()
        else 0,
        "steps_lost_per_kill": lost,
        "steps_lost_max": max(lost, default=None),
        "steps_lost_mean": round(sum(lost) / len(lost), 2) if lost else None,
        "steps_compared": len(ref),
        "mismatches": mismatches,
        "final_returncode": final.returncode,
        "wall_s": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(summary))
    ok = mismatches == 0 and final.returncode == 0 and len(survived) == len(kills)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
