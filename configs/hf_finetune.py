"""Fine-tune a published Hugging Face checkpoint: the model section stays at its defaults, so the
architecture comes from the checkpoint (docs/checkpoints.md).

python -m posattn.train --config configs/hf_finetune.py --workdir runs/pi \
    --config.model.init_from=hf:path/to/checkpoint --config.data.corpus=path/to/tokens \
    '--config.model.rope_scaling={"rope_type": "linear", "factor": 2.0}'
"""

from posattn.config import defaults


def get_config():
    config = defaults()
    config.data.seq_len = 1024
    config.train.update(
        steps=1000,
        batch_size=8,
        learning_rate=2e-5,
        warmup_steps=20,
        checkpoint_every=200,
        eval_every=200,
        eval_batches=4,
    )
    return config
