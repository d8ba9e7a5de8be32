"""Defaults shared by every config: each config file starts from `base()` and changes what it needs."""

import ml_collections


def base() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.model = ml_collections.ConfigDict(
        dict(
            position="rope",  # nope sinusoidal learned rope t5 alibi kerple_power kerple_log sandwich fire
            kind="decoder",  # decoder (causal LM) | encoder (bidirectional, masked bytes)
            vocab_size=256,  # bytes
            d_model=128,
            num_layers=4,
            num_heads=4,
            num_kv_heads=4,
            d_ff=0,  # d_ff 0 -> 4 * d_model
            max_len=1024,  # learned absolute table size
            kv_share=1,  # cross-layer KV sharing group size (1 = off)
            dtype="float32",  # compute dtype (bfloat16 keeps float32 parameters and softmax)
            param_dtype="float32",  # float32 | bfloat16 parameters (AdamW moments stay float32)
            remat="none",  # none | full | dots: blocks recomputed in backward (dots keeps matmuls)
            scan_layers=False,  # blocks stacked, run by one scan (compile time flat in depth)
            attention_impl="auto",
            rope_base=10000.0,
            rope_scaling=None,
            rope_layout="interleaved",
            t5_num_buckets=32,
            t5_max_distance=128,
            alibi_slope_scale=1.0,
            fire_mlp_width=32,
            fire_init_c=0.1,
            fire_init_L=512.0,
            init_scale=1.0,
        )
    )
    config.data = ml_collections.ConfigDict(
        dict(
            corpus="stdlib",  # stdlib | text file or directory | dir with nanoGPT train.bin/val.bin
            seq_len=128,
            mask_rate=0.15,  # encoder only
            passkey_fraction=0.0,  # share of training rows replaced by passkey sequences (posattn.eval.probes)
        )
    )
    config.train = ml_collections.ConfigDict(
        dict(
            steps=1000,
            batch_size=16,
            learning_rate=1e-3,
            warmup_steps=100,
            min_lr_ratio=0.1,
            weight_decay=0.1,
            grad_clip=1.0,
            b1=0.9,
            b2=0.95,
            seed=0,
            checkpoint_every=500,
            keep_checkpoints=3,
            log_every=10,
            eval_every=0,
            eval_batches=4,
            fsdp=1,  # size of the fsdp mesh axis (1 = pure data parallel)
            distributed=False,  # call jax.distributed.initialize() (pods, SLURM); env vars also work
        )
    )
    return config
