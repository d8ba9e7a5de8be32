"""Data below both training and evaluation: corpora (`corpus`: text files with their held-out
files' spans, token files), batches (`batches`: training batches as a pure function of seed and
step, evaluation windows) and the synthetic probes (`probes`: passkey, induction, copy) that
training mixes in and evaluation scores. Only numpy: nothing here imports `train/` or `eval/`."""

from posattn.data.batches import (
    batch_options,
    batched,
    eval_batches,
    eval_windows,
    mask_tokens,
    mix_passkeys,
    train_batch,
)
from posattn.data.corpus import Corpus, DataError, check_length, load_corpus

__all__ = [
    "Corpus",
    "DataError",
    "batch_options",
    "batched",
    "check_length",
    "eval_batches",
    "eval_windows",
    "load_corpus",
    "mask_tokens",
    "mix_passkeys",
    "train_batch",
]
