"""Flax NNX modules: `layers` (norm, position modules, attention, MLP, block), `model` (the
language model), `decode` (KV cache, prefill, decode steps, sampling). They own parameters and call
the pure functions below them (`posattn.positions`, `posattn.rotary`, `posattn.attention`)."""
