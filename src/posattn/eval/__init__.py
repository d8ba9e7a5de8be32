"""Evaluation of trained models.

`registry` (name -> evaluator: `run(model, text, length, settings)`; loss, attention, passkey,
induction, copy), `lengths` (the jitted forward pass every evaluator reads with, RoPE eval-time
scalings), and the one loss protocol: `heldout` (which held-out tokens are scored: file-aware,
the same bytes at every length), `scoring` (per-file loss sums under the non-overlapping and
sliding windowings), `intervals` and `summary` (bootstrap by file, seeds, paired differences);
`retrieval` (passkey among distractors, induction by gap, copy; scored by loss and accuracy),
`attention_stats` (entropy, distance and mass beyond L per layer and head; previous-token and
induction scores).
`python -m posattn.eval` runs any evaluator on any trained workdir.
"""
