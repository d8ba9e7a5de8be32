"""Readers beside a running trainer: restore its checkpoints in a loop while it writes them.

    PYTHONPATH=src python benchmarks/readers.py --collisions 20 --workdir /tmp/posattn_readers
    PYTHONPATH=src python benchmarks/readers.py --quick        # 5 collisions, for a busy machine
    PYTHONPATH=src python benchmarks/readers.py --quick --unsafe   # readers opened as writers

A trainer (`python -m posattn.train`, the small model of benchmarks/faults.py) checkpoints every
step (asynchronously) and keeps every checkpoint; this process restores the newest checkpoint
in a loop with `posattn.train.restore_trained`, the reader of `posattn.generate` and evaluation. A
read is a collision when the trainer had a checkpoint write in progress (an orbax temporary
directory) when the read started or ended. Once `--collisions` collisions happened, the trainer is
stopped with SIGTERM (it saves and exits 0). Then every step it trained must have its checkpoint
(checkpoint_every=1) and each must restore and match its fingerprint. Printed: reads,
collisions, the trainer's exit status and last lines on failure, and checkpoints lost (missing or
unrestorable) of the steps trained. `--unsafe` opens the readers' checkpoints with the writer's
options (`Checkpointer(read_only=False)`: orbax's cleanup of temporary directories), as readers
did before they were read-only, to show what that costs.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from faults import command, logged_losses, temporary_dirs  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--collisions", type=int, default=20)
    parser.add_argument("--max_reads", type=int, default=2000)
    default = pathlib.Path("/tmp/posattn_readers")
    parser.add_argument("--workdir", type=pathlib.Path, default=default)
    parser.add_argument("--quick", action="store_true", help="5 collisions")
    parser.add_argument("--unsafe", action="store_true", help="readers opened as writers")
    args = parser.parse_args()
    wanted = 5 if args.quick else args.collisions

    import jax

    from posattn import config as config_lib
    from posattn.train import checkpoint as checkpoint_lib
    from posattn.train import loop

    shutil.rmtree(args.workdir, ignore_errors=True)
    workdir = args.workdir / "run"
    cmd = command(workdir, 100_000) + [
        "--config.train.checkpoint_every=1",
        "--config.train.keep_checkpoints=100000",
    ]
    overrides = cmd[cmd.index("--workdir") + 2 :]
    config = config_lib.load_config(cmd[cmd.index("--config") + 1], overrides)
    checkpoints = workdir / "checkpoints"
    if args.unsafe:  # the readers as they were: writer options (cleanup of temporary dirs)
        original = checkpoint_lib.Checkpointer

        def as_writer(directory, *, read_only=False, **kwargs):
            return original(directory, **kwargs)

        loop.Checkpointer = as_writer

    start = time.perf_counter()
    trainer = subprocess.Popen(
        cmd,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    while trainer.poll() is None and not (checkpoints.is_dir() and logged_losses(workdir)):
        time.sleep(0.05)
    reads = collisions = failed_reads = 0
    while trainer.poll() is None and collisions < wanted and reads < args.max_reads:
        writing = bool(temporary_dirs(workdir))
        try:
            loop.restore_trained(config, checkpoints)
        except Exception:
            failed_reads += 1
        reads += 1
        collisions += writing or bool(temporary_dirs(workdir))
    if trainer.poll() is None:
        trainer.send_signal(signal.SIGTERM)
    output = trainer.communicate(timeout=300)[0]
    loop.Checkpointer = checkpoint_lib.Checkpointer
    trained = max(logged_losses(workdir), default=0)

    # Every step trained was checkpointed (checkpoint_every=1); each must restore.
    reader = checkpoint_lib.Checkpointer(checkpoints, read_only=True)
    lost = []
    try:
        present = set(reader.steps())
        abstract = None
        if present:
            _, state, _ = loop.restore_trained(config, checkpoints)
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        for step in range(1, trained + 1):
            if step not in present:
                lost.append(step)
                continue
            try:
                reader.restore_checked(step, abstract)
            except Exception:
                lost.append(step)
    finally:
        reader.close()
    summary = {
        "readers": "writer options (unsafe)" if args.unsafe else "read-only",
        "reads": reads,
        "failed_reads": failed_reads,
        "collisions": collisions,
        "steps_trained": trained,
        "checkpoints_lost": len(lost),
        "lost_steps": lost[:20],
        "trainer_returncode": trainer.returncode,
        "wall_s": round(time.perf_counter() - start, 1),
    }
    if trainer.returncode != 0:
        print(output[-2000:])
    print(
        f"checkpoints lost: {len(lost)} of {trained} over {collisions} collisions "
        f"({reads} reads; trainer exit status {trainer.returncode})"
    )
    print(json.dumps(summary))
    return 0 if not lost and trainer.returncode == 0 and collisions >= wanted else 1


if __name__ == "__main__":
    sys.exit(main())
