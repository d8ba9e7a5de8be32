"""PaTH's reflections (Yang et al. 2025): the module a PaTH layer owns to make w and beta.

Shape legend: B batch, T length, D d_model, K key/value heads, H head dim.

As the reference layer (fla-org/flash-linear-attention `fla/layers/path_attn.py`,
`PaTHAttention`), from the same normalised input x as q, k and v:

  * w: a projection to K*H features, low rank (D -> r -> K*H, r = 32) where every query head has
    its own key head and full (D -> K*H) otherwise; then a causal depthwise convolution of width
    3 with SiLU (`ShortConvolution(K*H, 3)`: y_t = silu(c_0 x_{t-2} + c_1 x_{t-1} + c_2 x_t),
    zeros before the first position, no bias); then per head an L2 norm,
    w / sqrt(|w|^2 + 1e-6) (fla's `l2_norm`);
  * beta = 2 sigmoid(x W_beta + b) per key/value head, in (0, 2): the reflection I - beta w w^T
    then has the eigenvalue 1 - beta in (-1, 1) along w.

The attention core (`posattn.attention.path_attention`) takes them. A KV cache keeps the
convolution's last two inputs (the reference's `conv_state`), so that a decode step's w is the one
the full sequence gives. Initialisation follows posattn's projections (normal, std
init_scale / sqrt(fan in); the convolution's fan in is its width 3), the beta bias zero (beta = 1
at x = 0).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["CONV_WIDTH", "Reflections"]

CONV_WIDTH = 3  # the reference's ShortConvolution(kv_dim, 3)
_EPS = 1e-6  # fla's l2_norm: x / sqrt(sum x^2 + eps)


class Reflections(nnx.Module):
    """A PaTH layer's reflection directions w and strengths beta.

    Args:
      d_model, num_heads, num_kv_heads, head_dim: D, N, K, H.
      rank: the inner width of w's low-rank projection when N == K (`model.path_w_rank`); 0, or
        N != K: one D x K*H projection.
      conv: the width-3 causal convolution and SiLU on w (`model.path_conv`).
      init_scale: multiplies the std of every weight initialiser.
      param_dtype: storage dtype of the weights (the beta bias stays float32).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        rank: int,
        conv: bool,
        init_scale: float,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        D, K, H = d_model, num_kv_heads, head_dim

        def normal(shape, fan_in):
            std = init_scale / math.sqrt(fan_in)
            return nnx.Param(
                (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(param_dtype)
            )

        if rank and num_heads == num_kv_heads:
            self.w_down = normal((D, rank), D)
            self.w_up = normal((rank, K * H), rank)
        else:
            self.w_proj = normal((D, K * H), D)
        if conv:
            self.conv = normal((CONV_WIDTH, K * H), CONV_WIDTH)  # row c: the input at t - 2 + c
        self.beta_w = normal((D, K), D)
        self.beta_b = nnx.Param(jnp.zeros((K,), jnp.float32))
        self.num_kv_heads, self.head_dim = K, H

    @property
    def has_conv(self) -> bool:
        return hasattr(self, "conv")

    def project(self, x: jax.Array) -> jax.Array:
        """float32[B, T, K*H]: w's projection of x[B, T, D], before the convolution."""
        x = x.astype(jnp.float32)
        if hasattr(self, "w_proj"):
            return x @ self.w_proj[...].astype(jnp.float32)
        return (x @ self.w_down[...].astype(jnp.float32)) @ self.w_up[...].astype(jnp.float32)

    def beta(self, x: jax.Array) -> jax.Array:
        """float32[B, T, K]: 2 sigmoid(x W_beta + b) of x[B, T, D]."""
        logit = x.astype(jnp.float32) @ self.beta_w[...].astype(jnp.float32) + self.beta_b[...]
        return 2.0 * jax.nn.sigmoid(logit)

    def directions(self, projected: jax.Array, previous: jax.Array | None = None) -> jax.Array:
        """float32[B, T, K, H]: unit w of the projections float32[B, T, K*H] (`project`), through
        the convolution when the layer has one; `previous` [B, 2, K*H] are the two inputs before
        the first (a cache's `conv_state`; None: zeros, the sequence's start)."""
        B, T, F = projected.shape
        if self.has_conv:
            if previous is None:
                previous = jnp.zeros((B, CONV_WIDTH - 1, F), jnp.float32)
            padded = jnp.concatenate([previous.astype(jnp.float32), projected], axis=1)
            taps = self.conv[...].astype(jnp.float32)  # (3, F)
            y = sum(padded[:, c : c + T] * taps[c] for c in range(CONV_WIDTH))
            projected = jax.nn.silu(y)
        w = projected.reshape(B, T, self.num_kv_heads, self.head_dim)
        return w * jax.lax.rsqrt(jnp.sum(w * w, axis=-1, keepdims=True) + _EPS)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(w float32[B, T, K, H], beta float32[B, T, K]) of x[B, T, D] (from the start)."""
        return self.directions(self.project(x)), self.beta(x)
