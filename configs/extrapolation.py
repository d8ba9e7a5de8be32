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
    split), L = 64, batch 32 x 64 = 2048 bytes per step, with the probes' skills mixed in
    (`posattn.data.probes`): 20% of the rows are passkey sequences (keys of 4-8 digits at random
    depths, distractor numbers in the filler: the evaluated format, needle and question inside
    the L + 1 bytes) and 30% induction rows (the row's own text with a random string of 4-24
    letters written into it and repeated at its end after a random gap), the answers weighing 8
    in the loss (`data.probe_weight`: the key's digits, the repeat but its first letter). At
    weight 1 2000 steps teach neither probe; with strings of at most 12 letters (the earlier
    default span) 2000 steps teach induction to none but ALiBi and RoPE partly; with 4-24
    letters and 30% of the rows the induction probe at L falls to 0.3-0.8 nats per letter (ln 26
    = 3.26 is a uniform guess) for six of the ten families, for 0.14-0.27 nats of text loss at L
    against training without induction rows (experiments/README.md, "Induction rows of up to 24
    letters"). With keys of 1-5 digits (the default before `data.passkey_digits`) four families
    retrieve the passkey and T5 and FIRE find the key but read its digits out of order; keys of
    4-8 digits give it to the same six that copy, T5 and FIRE in 9 of 12 seeds against 5 of 12,
    their text at L within 0.03 nats (experiments/README.md, "Training keys of 4-8 digits"); in
    10% of the rows they give it to 4 of 12, so both the rows and the keys' length count ("Long
    keys in half the rows").
  * 2000 steps (4.1M bytes per family, 14% of the 30.2M training bytes) at peak learning rate 6e-3
    (60 warmup steps, cosine to 10%): the budget that keeps ten families plus evaluation under 15
    minutes on the two-core CPUs measured (training 72-128 s a family on one core of an AVX2
    EPYC, 552-708 s for the command; experiments/README.md, "The command's time"); 3e-3 costs
    0.04-0.15 nats of text at L in nine families of ten and 1e-2 ties 6e-3, neither teaching more
    probes (experiments/README.md, "The peak learning rate, measured"). With the earlier keys of 1-5
    digits, `--config.train.steps=3000` bought the passkey at L for five or six families and
    0.04-0.12 nats of text at L for 12% more time on an AVX-512 CPU (experiments/README.md, "The
    whole experiment at 3000 steps"), and the record of then ran 3000 steps ("Record:
    2026-12-03"); with keys of 4-8 digits this config at three seeds learns both probes for the
    same six families ("Record: 2026-12-04").
  * evaluation at L, 2L, 4L, 8L, 16L (`posattn.eval.heldout`, `scoring`): chunks of 16L drawn
    round-robin over the held-out files, the same bytes at every length, under two protocols
    (non-overlapping windows, plus positions >= L alone; sliding windows of stride L scoring each
    window's last L positions, as Press et al. 2022), each number with a 95% interval from a
    bootstrap over files. `eval.max_tokens` is the scored bytes per length of the first
    protocol, `eval.sliding_tokens` the sliding protocol's at L and `eval.sliding_max_tokens` the
    bytes its windows may read per length (so 16L scores 1/16 of L's blocks): 32k / 32k / 32k
    here to keep the default near its 15 minutes, 256k each in the record
    (`--config.eval.max_tokens=262144 --config.eval.sliding_tokens=262144
    --config.eval.sliding_max_tokens=262144`: 256 chunks from all 72 files long enough for 16L).
  * probes, 32 samples a cell, scored by loss and accuracy: a 4-digit passkey among distractor
    numbers at depths 0 and 1; induction (a random 8-letter string repeated after a gap of L/2
    or 4L bytes of held-out text); attention entropy / distance / mass beyond L on 4 windows.
Family settings, each chosen by a measurement (`configs/extrapolation_settings.py`: one family
under several settings, 2 seeds, the record's training; experiments/README.md has the tables): the
setting with the lowest loss at 16L among those that tie at L, the papers' scaled value where
they tie at 16L too. T5: 32 buckets to max_distance = L / 2 (16L loss 1.64 vs 2.04 with L and
1.77 with 16 buckets to L / 4); FIRE: c = 0.1 and the threshold at L / 4 as the reference
(c = 3.2, which keeps the paper's c L, is worse by 0.16 at 16L; a threshold of L ties);
Sandwich: d-bar = 256 (16, the head dim, gives 2.29 at 16L; 256 gives 1.39); Kerple: one (r1, r2)
for the stack, as the reference. The learned table holds exactly L positions (nothing past L).
These choices were made on text alone; with the probes in training they are why Kerple and
Sandwich rarely copy (no head free of position: at d-bar 64 Sandwich copies in both seeds, and
Kerple copies in the runs where a head's (r1, r2) reaches its floor; experiments/README.md, "Why
Kerple and Sandwich learn neither probe"). Every run that copies has a second-layer induction head
and NoPE forms no previous-token head, in 2, 3 or 4 layers (`python experiments/seed_table.py
WORKDIR --heads`; experiments/README.md, "The heads that copy, and why NoPE has none").
"""

import ml_collections

from posattn.config import defaults

LEARNING_RATE = 6e-3  # the training's peak

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
        t5_max_distance=max(L // 2, 32),
        fire_init_L=float(L // 4),
        sandwich_dim=256,
    )
    config.data.update(
        corpus="stdlib",
        seq_len=L,
        passkey_fraction=0.2,
        passkey_distractors=True,
        # keys of 4-8 digits (module docstring); 2 * (8 + digits) + 2 bytes must fit L + 1
        passkey_digits=(4, min(8, (L - 1) // 2 - 8)),
        induction_fraction=0.3,
        induction_span=min(24, (L + 1) // 2),  # strings of 4-24 letters (both copies fit L + 1)
        probe_weight=8.0,  # the probes' answers' loss weight (module docstring)
    )
    config.train.update(
        steps=2000,
        batch_size=32,
        learning_rate=LEARNING_RATE,
        warmup_steps=60,
        min_lr_ratio=0.1,
        checkpoint_every=500,
        keep_checkpoints=1,
        log_every=50,
        eval_every=0,
        seed=0,
    )
    config.families = FAMILIES
    # Training seeds per family (from train.seed on), each its own run (adding seeds never
    # retrains one); > 1 reports mean ± standard error over seeds. The record runs 3.
    config.seeds = 1
    # Worker processes that train and evaluate the units (one seed of one entry) side by side,
    # each on its own core: 0 picks one per CPU core (at most one per unit left and per ~3 GiB
    # of memory; this process on an accelerator), 1 runs everything in this process. Worker runs
    # give the same numbers whatever their count; one process with several XLA threads differs
    # from them in the last bits (experiments/README.md, "Worker processes").
    config.workers = 0
    # Extra rows rope+<kind>; also the position remaps 'rerope' and 'self_extend' (with options,
    # 'rerope:log_scale=1'), not in the default: experiments/README.md, "Position remaps at eval
    # time".
    config.rope_scalings = ("linear", "ntk", "dynamic", "yarn")
    # Entries of `families` also read under a sliding window of L at every layer (row
    # <entry>+window: at T > L each query sees the last L keys, the distances of training);
    # e.g. ('nope', 'rope', 't5', 'fire'). The record: experiments/README.md, "A window of L".
    config.window_rows = ()
    config.window_layers = ()  # the layers the window limits (from 0); (): every layer
    # Position interpolation as Chen et al. 2023 run it: the trained RoPE model fine-tuned at
    # multiple x L under rope_scaling {kind, factor = multiple, original L}, kept at every length
    # (rows rope+<kind>+ft). Same optimizer as training, fresh moments, `warmup_steps` then a
    # constant `learning_rate`; batch_size 0: train.batch_size // multiple (same tokens a step).
    config.finetune = ml_collections.ConfigDict(
        dict(
            kinds=("linear", "ntk", "yarn"),
            multiple=4,
            steps=150,
            learning_rate=LEARNING_RATE / 10,
            warmup_steps=10,
            batch_size=0,
            enabled=True,
        )
    )
    config.eval = ml_collections.ConfigDict(
        dict(
            multiples=(1, 2, 4, 8, 16),  # eval lengths = multiples x L, unless `lengths` is given
            lengths=(),
            # Target tokens per length, non-overlapping protocol: chunks of the longest length
            # drawn round-robin over the held-out files, the same tokens at every length. The
            # record sets 256 * 1024 (experiments/README.md); this default fits the 15 minutes.
            max_tokens=32 * 16 * L,
            # Sliding protocol: blocks of `sliding_stride` scored tokens (all of them scored at L),
            # at most `sliding_max_tokens` tokens read per length (a window of T reads T).
            sliding_tokens=512 * L,
            sliding_max_tokens=512 * L,
            sliding_stride=L,  # tokens scored per sliding window (<= L)
            bootstrap=1000,  # replicates of the bootstrap over held-out files (95% intervals)
            reference="alibi",  # paired differences of every row against this one
            attention_windows=4,  # windows per length for the attention statistics (0: off)
            head_strings=32,  # random strings (L / 2 letters, twice) for the heads' scores at L
            batch_size=8,  # windows of the longest length per forward pass (same tokens at every T)
            attention_impl="auto",  # "blockwise" keeps long windows linear in memory
            per_position_bins=32,  # the per-position curve (at the longest length), log-spaced bins
            seed=1234,
        )
    )
    config.passkey = ml_collections.ConfigDict(
        dict(depths=(0.0, 1.0), samples=32, digits=4, distractors=True, enabled=True)
    )
    config.induction = ml_collections.ConfigDict(
        dict(gap_multiples=(0.5, 4), gaps=(), span=8, samples=32, enabled=True)
    )
    config.copy = ml_collections.ConfigDict(dict(samples=8, segment=12, enabled=False))
    return config
