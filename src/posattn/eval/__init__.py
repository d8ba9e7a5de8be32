"""Evaluation of trained models: `lengths` (loss vs length, per-position loss, RoPE eval-time
scalings) and `probes` (passkey and the other synthetic probes)."""
