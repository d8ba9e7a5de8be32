"""GPT-2 small (Radford et al. 2019): d_model 768, 12 heads of 64, 12 layers,
context 1024. For accelerators; `jax.eval_shape` builds it at no cost in the tests.

    python -m posattn.train --config configs/gpt2_small.py --workdir runs/gpt2_small \
        --config.model.position=alibi --config.data.corpus=/data/openwebtext
"""

from posattn.config import defaults


def get_config():
    config = defaults()
    config.model.update(
        d_model=768, num_layers=12, num_heads=12, num_kv_heads=12, max_len=1024, dtype="bfloat16"
    )
    config.data.seq_len = 1024
    config.train.update(
        steps=100_000,
        batch_size=64,
        learning_rate=6e-4,
        warmup_steps=2000,
        weight_decay=0.1,
        checkpoint_every=2000,
        eval_every=2000,
        eval_batches=20,
    )
    return config
