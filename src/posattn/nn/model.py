"""Language models: a decoder-only LM and a bidirectional encoder, with tied embeddings.

Shape legend: B batch, T length, D d_model, V vocabulary.

`TransformerLM(cfg, rngs=...)` builds either, by `cfg.kind`:
  * "decoder": causal attention, next-token logits;
  * "encoder": bidirectional attention (T5's bidirectional buckets are used for real here),
    trained to recover masked bytes; its input vocabulary has one extra `[MASK]` id = V.
Sizes go from `configs/tiny.py` to GPT-2 small (`configs/gpt2_small.py`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from posattn import positions
from posattn.nn import layers
from posattn.nn.config import ModelConfig

__all__ = ["TransformerLM", "cross_entropy", "mask_token_id"]


def mask_token_id(cfg: ModelConfig) -> int:
    """The encoder's `[MASK]` input id (one past the output vocabulary)."""
    return cfg.vocab_size


class TransformerLM(nnx.Module):
    """Decoder-only LM (or bidirectional encoder) composed from the family registry."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        family = cfg.family
        D = cfg.d_model
        self.cfg = cfg
        vocab_in = cfg.vocab_size + (0 if cfg.causal else 1)
        # fairseq's transformer_lm (the ALiBi paper's code): embeddings ~ N(0, D^-1/2) multiplied
        # by sqrt(D) at the input, learned positions ~ N(0, D^-1/2) added unscaled.
        self.embed = nnx.Param(
            cfg.init_scale / math.sqrt(D) * jax.random.normal(rngs.params(), (vocab_in, D))
        )
        if family.embedding == "learned":
            self.pos_embed = nnx.Param(
                cfg.init_scale
                / math.sqrt(D)
                * jax.random.normal(rngs.params(), (cfg.settings.max_len, D))
            )
        # The family's modules get the family's own settings; the blocks get plain sizes.
        rotary_module = layers.Rotary(cfg.head_dim, cfg.settings) if family.rotary else None
        shared_bias = None
        if family.bias is not None and family.bias.shared_across_layers:
            shared_bias = layers.PositionBias(family.bias, cfg.context, cfg.settings, rngs=rngs)

        def bias_for_layer():
            if family.bias is None:
                return None
            return shared_bias or layers.PositionBias(
                family.bias, cfg.context, cfg.settings, rngs=rngs
            )

        self.blocks = nnx.List(
            [
                layers.Block(
                    D,
                    cfg.num_heads,
                    cfg.num_kv_heads,
                    cfg.ff_dim,
                    num_layers=cfg.num_layers,
                    causal=cfg.causal,
                    scale_free=family.scale_free,
                    init_scale=cfg.init_scale,
                    implementation=cfg.attention_impl,
                    dtype=layers.compute_dtype(cfg.dtype),
                    owns_kv=i % cfg.kv_share == 0,
                    rotary_module=rotary_module,
                    bias_module=bias_for_layer(),
                    rngs=rngs,
                )
                for i in range(cfg.num_layers)
            ]
        )
        self.final_norm = layers.RMSNorm(D)

    def embed_tokens(self, tokens: jax.Array, *, q_offset=0) -> jax.Array:
        """Token embeddings plus the absolute position embedding, if the family has one."""
        cfg, family = self.cfg, self.cfg.family
        x = jnp.take(self.embed[...], tokens, axis=0) * math.sqrt(cfg.d_model)  # (B, T, D)
        pos = layers.token_positions(q_offset, tokens.shape[1])  # (T,) or (B, T)
        if family.embedding == "sinusoidal":
            x = x + _sinusoidal(pos, cfg.d_model)
        elif family.embedding == "learned":
            x = x + positions.learned_embedding(self.pos_embed[...], pos)
        return x.astype(layers.compute_dtype(cfg.dtype))

    def hidden(self, tokens: jax.Array, *, kv_lengths=None) -> jax.Array:
        """Final normalised hidden states [B, T, D] (float32) of tokens at positions 0..T-1."""
        x = self.embed_tokens(tokens)
        kv = None
        for i, block in enumerate(self.blocks):
            if i % self.cfg.kv_share == 0:
                kv = None  # this layer computes its own keys/values; the next kv_share-1 reuse them
            x, kv = block(x, kv_lengths=kv_lengths, kv=kv)
        return self.final_norm(x).astype(jnp.float32)

    def extend(
        self,
        tokens: jax.Array,
        kvs,
        *,
        q_offset,
        kv_lengths,
        seq_len,
        keys_rotated: bool = True,
        attend_len: int | None = None,
    ):
        """Hidden states of a chunk of tokens at positions q_offset + t, reading and writing a KV cache.

        The KV-cache counterpart of `hidden` (the cache itself and its bookkeeping live in
        `posattn.nn.decode`).

        Args:
          tokens: int[B, T], the chunk (a prompt, or one new token per row).
          kvs: one (k, v) pair, [B, S, K, H] each, per layer that owns its keys/values
            (`num_layers // kv_share` of them: the layers of a sharing group read their owner's).
          q_offset, kv_lengths, seq_len, keys_rotated, attend_len: as `layers.Attention.extend`.

        Returns:
          (hidden float32[B, T, D], the updated kvs).
        """
        x = self.embed_tokens(tokens, q_offset=q_offset)
        kvs = list(kvs)
        for i, block in enumerate(self.blocks):
            owner = i // self.cfg.kv_share
            x, kvs[owner] = block.extend(
                x,
                kvs[owner],
                q_offset=q_offset,
                kv_lengths=kv_lengths,
                seq_len=seq_len,
                keys_rotated=keys_rotated,
                attend_len=attend_len,
            )
        return self.final_norm(x).astype(jnp.float32), tuple(kvs)

    def logits(self, h: jax.Array) -> jax.Array:
        """Tied output projection: h[B, T, D] -> logits[B, T, V] in float32."""
        table = self.embed[...][: self.cfg.vocab_size].astype(jnp.float32)
        return layers.dense(h.astype(jnp.float32), table.T)  # (B, T, V)

    def __call__(self, tokens: jax.Array, *, kv_lengths=None) -> jax.Array:
        """Logits float32[B, T, V] for tokens int[B, T] at positions 0..T-1."""
        return self.logits(self.hidden(tokens, kv_lengths=kv_lengths))


def _sinusoidal(pos: jax.Array, dim: int) -> jax.Array:
    if pos.ndim == 1:
        return positions.sinusoidal(pos, dim)  # (T, D)
    return jax.vmap(lambda p: positions.sinusoidal(p, dim))(pos)  # (B, T, D)


def cross_entropy(
    logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None
) -> jax.Array:
    """Mean next-token cross-entropy in nats over the positions with nonzero weight."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[
        ..., 0
    ]  # (B, T)
    if weights is None:
        return jnp.mean(nll)
    weights = weights.astype(jnp.float32)
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)
