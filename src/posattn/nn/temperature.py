"""Length temperatures of a layer's queries: Llama 4's position scaling and scalable softmax.

Shape legend: B batch, T query length, N query heads, H head dim.

Both multiply the queries, after RoPE, so they scale `q . k` (RoPE's rotation included) and
never an additive bias or FoX's forget term: Llama 4 multiplies its query states the same way
(Hugging Face `modeling_llama4.py`), and scalable softmax (Nakanishi 2025) is defined on the
scores of a model whose position signal sits in q and k; a bias family's bias stays as its
reference defines it (docs/families.md#length-temperature). The factors are computed in float32
from the true query positions and the true number of visible keys, so a KV-cache decode step
scales its query as the full forward does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from posattn import positions as positions_lib

__all__ = ["SSMAX_INIT", "QueryTemperature"]

# The initial per-head s of scalable softmax: 0.43, the value of the paper's experiments as the
# public implementation gdevos010/Scalable-Softmax (`ScalableSoftmax(s=0.43)`) gives it.
SSMAX_INIT = 0.43


class QueryTemperature(nnx.Module):
    """Multiplies queries by `llama4_attention_scale(i)` and/or `ssmax_scale(n_i, s)`.

    Args:
      num_heads: N (one learned s per head with ssmax).
      attn_scale, floor_scale: Llama 4's temperature (attn_scale 0: off).
      ssmax: scalable softmax with a learned per-head s.
      window: the layer's sliding window (n_i counts only the keys inside it).
      causal: decoder (n_i counts keys j <= i) or encoder.
    """

    def __init__(
        self,
        num_heads: int,
        *,
        attn_scale: float,
        floor_scale: float,
        ssmax: bool,
        window: int | None,
        causal: bool,
    ):
        self.attn_scale, self.floor_scale = float(attn_scale), float(floor_scale)
        self.window, self.causal = window, causal
        self.s = nnx.Param(jnp.full((num_heads,), SSMAX_INIT, jnp.float32)) if ssmax else None

    def __call__(self, q: jax.Array, positions: jax.Array, *, kv_len) -> jax.Array:
        """q[B, T, N, H] at absolute `positions` ([T] or [B, T]), over `kv_len` (int or int[B])
        valid keys; returns q scaled, in q's dtype."""
        factor = jnp.ones(positions.shape + (1,), jnp.float32)  # (..., T, 1)
        if self.attn_scale:
            factor = (
                factor
                * positions_lib.llama4_attention_scale(
                    positions, floor_scale=self.floor_scale, attn_scale=self.attn_scale
                )[..., None]
            )
        if self.s is not None:
            n = positions_lib.visible_keys(
                positions, kv_len=kv_len, window=self.window, causal=self.causal
            )  # (T,) or (B, T)
            factor = factor * positions_lib.ssmax_scale(n, self.s[...])  # (..., T, N)
        return (q.astype(jnp.float32) * factor[..., None]).astype(q.dtype)
