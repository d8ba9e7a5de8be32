"""An 8-member sweep that runs in a few minutes on a CPU: 2 families x 2 seeds x 2 learning rates.

    python -m posattn.sweep --config configs/sweep_tiny.py --workdir runs/sweep_tiny

The discrete part (the family) gives one compiled program each; the continuous part (seed and
learning rate, every combination) is stacked on the vmap axis of that program. Any member reruns
alone with `python -m posattn.train --config configs/sweep_tiny.py --config.<key>=<value> ...`
(the exact command is in its sweep.json record); the `sweep` section is ignored there.
"""

import ml_collections

from .tiny import get_config as tiny_config


def get_config():
    config = tiny_config()
    config.sweep = ml_collections.ConfigDict()
    config.sweep.discrete = ml_collections.ConfigDict({"model": {"position": ("rope", "alibi")}})
    config.sweep.continuous = ml_collections.ConfigDict(
        {
            "train": {"seed": (0, 1), "learning_rate": (1e-3, 3e-3)},
        }
    )
    config.sweep.combine = "grid"
    config.sweep.eval_lengths = ()  # e.g. (64, 128, 256): extrapolation losses per member
    return config
