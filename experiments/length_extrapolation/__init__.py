"""Length extrapolation: train every position family identically at length L, evaluate at L..16L.

    python experiments/length_extrapolation.py --workdir runs/extrapolation
    python experiments/length_extrapolation.py --config configs/extrapolation_paper.py \
        --config.data.corpus=/data/wikitext103 --workdir runs/extrapolation_paper

Question: past the training length, which families keep their loss (ALiBi, T5, Kerple,
Sandwich, FIRE), which break (sinusoidal, RoPE, NoPE), which cannot run at all (learned), how much
eval-time RoPE scaling rescues, and whether the ones that keep their loss also *use* the longer
context (per-position loss, passkey retrieval, copying) or only tolerate it.

The experiment is rows x evaluators:

* `settings`: the config's entries parsed and checked before any compute;
* `rows`: the rows, built once from the config (trained entries, eval-time RoPE scalings of any
  RoPE entry, fine-tunes);
* `training`: each seed of each entry trained by `posattn.train.train_and_evaluate` (or reused),
  restored, fine-tuned;
* `run`: for each row and seed, every evaluator of `posattn.eval.registry` the config enables, at
  every length, cached per (row, seed, evaluator);
* `results`: results.json from the outputs; `report`: results.md and the plots from results.json;
* `provenance`: commits and the code hash (syntax trees without docstrings) the caches are
  keyed on.

experiments/README.md has the protocol, the keys and the record.
"""

from .main import COMMAND, main
from .provenance import ProducedByOtherCode, code_sha256
from .results import plain_losses
from .rows import Row, build_rows
from .run import run, seed_list
from .settings import (
    check_experiment,
    entry_dir,
    eval_lengths,
    family_config,
    family_entry,
    induction_gaps,
    rope_scaling_entry,
)
from .training import Interrupted, restore_model

__all__ = [
    "COMMAND",
    "Interrupted",
    "ProducedByOtherCode",
    "Row",
    "build_rows",
    "check_experiment",
    "code_sha256",
    "entry_dir",
    "eval_lengths",
    "family_config",
    "family_entry",
    "induction_gaps",
    "main",
    "plain_losses",
    "restore_model",
    "rope_scaling_entry",
    "run",
    "seed_list",
]
