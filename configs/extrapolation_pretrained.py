"""Length extrapolation of a published Hugging Face checkpoint, read as the trained families are.

    python experiments/length_extrapolation.py --config configs/extrapolation_pretrained.py \
        --config.pretrained.path=path/to/checkpoint --workdir runs/pretrained

The checkpoint directory holds config.json, its safetensors weights and tokenizer.json (any
architecture `posattn.hf` loads: docs/checkpoints.md). Its rows: the checkpoint as it is, and for
a RoPE checkpoint one row per `rope_scalings` entry (`<name>+yarn`: the eval-time scaling of
factor T / L put in its config; add `'rerope:log_scale=1'` or `'self_extend:log_scale=1'` for
the training-free position remaps, which also take a checkpoint with a rope_scaling of its own:
docs/rope.md, "Position remaps"). The held-out text is the byte experiment's (`data.corpus`,
default the Python standard library's held-out files), tokenised file by file with the
checkpoint's tokenizer; every window starts with BOS when the tokenizer puts one before a text
(`pretrained.bos`, docs/checkpoints.md has the rule). Losses per token and in bits per byte.

What the numbers are:
  * `pretrained.train_len` 0: L is read from config.json (`max_position_embeddings`, GPT-2's
    `n_positions`, MPT's `max_seq_len`, ...); lengths are `eval.multiples` x L unless
    `eval.lengths` is given.
  * `eval.max_tokens`, `eval.sliding_tokens`, `eval.sliding_max_tokens` 0: `pretrained.
    eval_windows` chunks of the longest length (non-overlapping), as many sliding blocks of
    `eval.sliding_stride` (0: L) tokens, each length's sliding windows reading at most that many
    chunks' tokens. A chunk must fit in one held-out file: the standard library's held-out files
    hold a few thousand tokens each (its longest a few tens of thousands), so for a long-context
    checkpoint give `eval.lengths` or a corpus of long documents (`data.corpus=DIR`).
  * passkey, induction and copy are byte-level probes: skipped, with a note in results.json.
    The attention statistics hold a float32 [heads, L, T] softmax per layer and window, and the
    heads' scores at L one [heads, L, L] per string (`eval.head_strings`): for a large model at
    long T set `eval.attention_windows=0` (both off) or `eval.head_strings=0`.
  * `finetune` (off by default; `--config.finetune.enabled=True`, a RoPE checkpoint only): rows
    `<name>+<kind>+ft` for each of `finetune.kinds`, position interpolation (Chen et al. 2023)
    and YaRN (Peng et al. 2023) as the trained RoPE rows' `+ft`: the checkpoint fine-tuned at
    `finetune.multiple` x L under rope_scaling {kind, factor = multiple, original L}, kept at
    every length; `finetune.steps` steps of `finetune.batch_size` windows (0: train.batch_size
    // multiple), the `train` section's optimizer with fresh moments, `warmup_steps` then a
    constant `learning_rate`. The defaults follow Chen et al.'s recipe (learning rate 2e-5, 20
    warmup steps; they ran 1000 steps of 64 windows), shortened to 200 steps of
    train.batch_size // 2 = 16 windows of 2L: a choice, not a measured optimum. The text: the
    training files of `data.corpus` (the held-out files' siblings), encoded with the
    checkpoint's tokenizer into token files under WORKDIR/<name>/tokens/ (docs/checkpoints.md).
"""

import ml_collections

from .extrapolation import get_config as byte_config


def get_config(arg=None):
    del arg
    config = byte_config()  # the byte experiment's evaluation sections and text
    config.families = ()
    config.rope_scalings = ("linear", "ntk", "dynamic", "yarn")  # RoPE checkpoints only
    # The fine-tune rows <name>+<kind>+ft (module docstring); each is a posattn training run.
    config.finetune.update(
        kinds=("linear", "yarn"),
        multiple=2,
        steps=200,
        learning_rate=2e-5,
        warmup_steps=20,
        batch_size=0,  # train.batch_size // multiple windows of multiple x L a step
        enabled=False,
    )
    config.pretrained = ml_collections.ConfigDict(
        dict(
            path="",  # the Hugging Face checkpoint directory (required)
            name="",  # the row's name ("" : the directory's name)
            train_len=0,  # L (0: from config.json)
            bos="auto",  # "auto" (the tokenizer's rule), "always" (bos_token_id), "never"
            dtype="float32",  # or "bfloat16" (parameters and compute)
            eval_windows=16,  # sizes the text when eval.max_tokens / sliding_tokens are 0
        )
    )
    config.eval.update(
        multiples=(1, 2, 4, 8),
        max_tokens=0,
        sliding_tokens=0,
        sliding_max_tokens=0,
        sliding_stride=0,  # 0: L
        attention_windows=2,
        head_strings=4,
        batch_size=1,
        reference="",
    )
    return config
