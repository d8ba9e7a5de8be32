"""A model that trains in seconds on a CPU: the smoke-test size.

python -m posattn.train --config configs/tiny.py --workdir runs/tiny --config.model.position=alibi
"""

from posattn.config import defaults


def get_config():
    config = defaults()
    config.model.update(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2)
    config.data.seq_len = 64
    config.train.update(
        steps=200,
        batch_size=8,
        learning_rate=3e-3,
        warmup_steps=20,
        checkpoint_every=100,
        eval_every=100,
        eval_batches=2,
    )
    return config
