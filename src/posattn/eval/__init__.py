"""Evaluation of trained models: `lengths` (the jitted forward pass, loss vs length on a prefix,
RoPE eval-time scalings), `heldout` (which held-out tokens an evaluation scores: file-aware,
the same bytes at every length), `scoring` (per-file loss sums under the non-overlapping and
sliding protocols), `intervals` and `summary` (bootstrap by file, seeds, paired differences),
`probes` and `retrieval` (passkey among distractors, induction by gap, copy; scored by loss and
accuracy), `attention_stats` (entropy, distance and mass beyond L per layer and head)."""
