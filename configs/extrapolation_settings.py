"""The settings the length-extrapolation record uses, each measured: one family under several
settings, 2 seeds each (earlier runs trained them as one vmap program; each seed is now its own
run), trained and evaluated exactly as the record (configs/extrapolation.py) but for a lighter
evaluation.

    python experiments/length_extrapolation.py --config configs/extrapolation_settings.py:fire \
        --workdir runs/settings_fire

One argument per question (experiments/README.md has the results):
  * fire: c and the threshold. The reference initialises c = 0.1 and the threshold at 512 for
    L = 2048: c L = 205, threshold L / 4. At L = 64, c = 0.1 gives c L = 6.4 (log(c x + 1) is then
    almost linear in x); c = 3.2 restores c L = 205. Thresholds L / 4 = 16 and L = 64.
  * t5: buckets and max_distance. T5 uses 32 buckets (16 exact, 16 log-spaced up to 128) at
    L = 512, so its last bucket (offsets >= 128) holds 56% of the training query-key pairs; with
    max_distance = L = 64 it holds 0.7% of them here. 16 buckets to 16 restore the 56%;
    32 to 32 (25%) lie between; 32 to 1024 never reach the last bucket before 16L.
  * sandwich: d-bar, the sinusoids' dimension. NeMo uses the head dim (16 here, a bias near
    zero); the paper treats d-bar as a hyperparameter: 64, 256, 1024.
  * kerple: one (r1, r2) for the stack (the reference) or one per layer, for both kernels.
  * rope: eval-time settings of one trained RoPE model: YaRN's beta_fast / beta_slow and Hugging
    Face's dynamic NTK factor.
"""

from .extrapolation import get_config as record_config

SETTINGS = {
    "fire": (
        "fire:fire_init_c=0.1,fire_init_L=16.0",
        "fire:fire_init_c=3.2,fire_init_L=16.0",
        "fire:fire_init_c=0.1,fire_init_L=64.0",
        "fire:fire_init_c=3.2,fire_init_L=64.0",
    ),
    "t5": (
        "t5:t5_num_buckets=32,t5_max_distance=64",
        "t5:t5_num_buckets=32,t5_max_distance=32",
        "t5:t5_num_buckets=16,t5_max_distance=16",
        "t5:t5_num_buckets=32,t5_max_distance=1024",
    ),
    "sandwich": (
        "sandwich:sandwich_dim=16",
        "sandwich:sandwich_dim=64",
        "sandwich:sandwich_dim=256",
        "sandwich:sandwich_dim=1024",
    ),
    "kerple": (
        "kerple_power:kerple_per_layer=False",
        "kerple_power:kerple_per_layer=True",
        "kerple_log:kerple_per_layer=False",
        "kerple_log:kerple_per_layer=True",
    ),
    "rope": ("rope",),
}
ROPE_SETTINGS = (
    "yarn:beta_fast=32,beta_slow=1",
    "yarn:beta_fast=8,beta_slow=1",
    "yarn:beta_fast=128,beta_slow=1",
    "yarn:beta_fast=32,beta_slow=4",
    "dynamic:factor=1",
    "dynamic:factor=2",
    "dynamic:factor=4",
)


def get_config(arg=None):
    if arg not in SETTINGS:
        raise ValueError(
            f"configs/extrapolation_settings.py needs one of {', '.join(SETTINGS)} after ':', "
            f"got {arg!r} (e.g. --config configs/extrapolation_settings.py:fire)"
        )
    config = record_config()
    config.families = SETTINGS[arg]
    config.rope_scalings = ROPE_SETTINGS if arg == "rope" else ()
    config.finetune.enabled = False  # the record's fine-tune rows are not a setting measured here
    config.seeds = 2
    L = config.data.seq_len
    config.eval.update(
        max_tokens=128 * 16 * L,  # 128k bytes a length (the record: 256k)
        sliding_tokens=1024 * L,
        sliding_max_tokens=1024 * L,
        reference=SETTINGS[arg][0],  # the paired differences are against the first setting
    )
    return config
