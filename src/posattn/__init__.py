"""posattn: position encodings for transformers in JAX/Flax.

Pure functions live in `posattn.positions` (absolute embeddings and relative-bias families),
`posattn.rotary` (RoPE and its scalings) and `posattn.attention` (the attention core). The family
registry (`posattn.families`) turns a family name into those functions; the Flax NNX modules in
`posattn.nn.layers` / `posattn.nn.model` only own parameters and call them.
"""

__version__ = "0.1.0"
