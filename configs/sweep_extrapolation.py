"""RoPE base and ALiBi slope scale against length extrapolation: two programs of four members.

    python -m posattn.sweep --config configs/sweep_extrapolation.py \
        --workdir runs/sweep_extrapolation

Each family sweeps its own knob (a RoPE base means nothing to ALiBi and a slope scale nothing to
RoPE), so the programs are listed explicitly. Every member trains at `data.seq_len` = 64 and is
then scored under the experiment's loss protocol (docs/sweeps.md) at the `sweep.eval_lengths`, 1x
to 8x the training length: the sweep.json records and sweep.md table carry loss@T for each. The
question: does a larger RoPE base (slower rotations) or a smaller ALiBi slope (a weaker recency
bias) trade in-distribution loss for extrapolation?
"""

import ml_collections

from .tiny import get_config as tiny_config


def get_config():
    config = tiny_config()
    config.train.update(steps=500, checkpoint_every=250, eval_every=250)
    config.sweep = ml_collections.ConfigDict()
    config.sweep.programs = (
        {
            "set": {"model.position": "rope"},
            "continuous": {"model.rope_base": (100.0, 1000.0, 10000.0, 100000.0)},
        },
        {
            "set": {"model.position": "alibi"},
            "continuous": {"model.alibi_slope_scale": (0.25, 0.5, 1.0, 2.0)},
        },
    )
    config.sweep.combine = "grid"
    config.sweep.eval_lengths = (64, 128, 256, 512)
    config.sweep.eval_max_tokens = 8192  # predicted tokens per length (a multiple of the longest)
    config.sweep.eval_batch_size = 8
    return config
