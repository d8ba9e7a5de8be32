"""Length extrapolation on a 2-core CPU: every family trained at L = 64 bytes, evaluated to 16L.

    python experiments/length_extrapolation.py --workdir runs/extrapolation
    python experiments/length_extrapolation.py --config configs/extrapolation.py:128 \
        --workdir runs/extrapolation_128

(`:128` trains at L = 128 and scales the lengths that depend on it.)

What the numbers are and why (experiments/README.md has the measured times and the table):
  * model: 2 layers, d_model 64, 4 heads of 16 (~0.1M parameters in the blocks plus the 256 x 64
    byte embedding). Two layers is the least that can form an induction head, which the probes
    need; at this size a CPU step is mostly fixed overhead, so width buys little.
  * data: bytes of the Python standard library (real text; held-out files are the evaluation
    split), L = 64, batch 32 x 64 = 2048 bytes per step; 20% of the rows are passkey sequences
    (keys of 1-5 digits at random depths) so that retrieval is learnable at L
    (`posattn.eval.probes`).
  * 2000 steps (4.1M bytes per family, 14% of the 30.2M training bytes) at peak learning
    rate 6e-3 (60 warmup steps, cosine to 10%): the budget that keeps ten families plus evaluation
    under 15 minutes on two CPU cores (~60 s of training per family); 6e-3 gave every family tried
    a lower loss at L than 3e-3 (measured at 600 steps).
  * evaluation at L, 2L, 4L, 8L, 16L on the same first 8192 held-out bytes (8 windows of 16L, 128
    of L); passkey 5 depths x 4 samples per length with a 1-digit key (a 2-layer model trained
    this briefly retrieves the digit after "passkey=" but has not learned general induction, so
    later digits are at chance: measured in experiments/README.md); copy task 8 samples of a
    12-letter segment per length (at chance at this budget, for the same reason).
Family settings tied to L, scaled from the papers' ratios: the learned table holds exactly L
positions (nothing past L), T5's log buckets end at max_distance = L (every bucket is trained, as
the paper's 128 at L = 512), FIRE's threshold starts at L / 4 (the reference's 512 at 2048).
"""

import ml_collections

from posattn.config import defaults

FAMILIES = (
    "nope",
    "sinusoidal",
    "learned",
    "rope",
    "t5",
    "alibi",
    "kerple_power",
    "kerple_log",
    "sandwich",
    "fire",
)


def get_config(arg=None):
    L = int(arg) if arg else 64
    config = defaults()
    config.model.update(
        d_model=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        max_len=L,
        attention_impl="auto",
        t5_num_buckets=32,
        t5_max_distance=max(L, 32),
        fire_init_L=float(L // 4),
    )
    config.data.update(corpus="stdlib", seq_len=L, passkey_fraction=0.2)
    config.train.update(
        steps=2000,
        batch_size=32,
        learning_rate=6e-3,
        warmup_steps=60,
        min_lr_ratio=0.1,
        checkpoint_every=500,
        keep_checkpoints=1,
        log_every=50,
        eval_every=0,
        seed=0,
    )
    config.families = FAMILIES
    config.rope_scalings = ("linear", "ntk", "dynamic", "yarn")  # extra rows rope+<kind>
    config.eval = ml_collections.ConfigDict(
        dict(
            multiples=(1, 2, 4, 8, 16),  # eval lengths = multiples x L, unless `lengths` is given
            lengths=(),
            max_tokens=8 * 16 * L,  # predicted tokens per length: the same bytes at every length
            batch_size=8,  # windows per forward pass
            attention_impl="auto",  # "blockwise" keeps long windows linear in memory
            per_position_bins=32,  # the per-position curve (at the longest length), log-spaced bins
            seed=1234,
        )
    )
    config.passkey = ml_collections.ConfigDict(
        dict(depths=(0.0, 0.25, 0.5, 0.75, 1.0), samples=4, digits=1, enabled=True)
    )
    config.copy = ml_collections.ConfigDict(dict(samples=8, segment=12, enabled=True))
    return config
