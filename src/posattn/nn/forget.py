"""FoX's forget gate (Lin et al., ICLR 2025, "Forgetting Transformer"): the module that owns it.

Shape legend: B batch, T length, D d_model, N query heads.

`f_t = sigmoid(w_h . x_t + b_h)` per head from the same normalised input as q, k and v
(zhixuan-lin/forgetting-transformer `ForgettingAttentionLayer`, `fgate_type="full"`: `fgate_proj
= nn.Linear(hidden_size, num_heads, bias=True)` on `hidden_states`, the weight normal, the bias
zero, `log_fgate = logsigmoid(fgate_logit.float())`). The attention core adds `c_i - c_j`,
`c = cumsum(log f)` in float32 (docs/conventions.md#fox); a KV cache keeps the `log f` of its
keys, as the reference's `FgateDynamicCache` does.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["ForgetGate"]


class ForgetGate(nnx.Module):
    """Per-head forget gates of a layer.

    Args:
      d_model: D.
      num_heads: N.
      init_scale: multiplies the weight's std (1/sqrt(D), the model's projection init).
      bias_init: the initial b_h (`families.ForgetSpec.bias_init`).
      param_dtype: storage dtype of the weight.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        init_scale: float,
        bias_init: float = 0.0,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        std = init_scale / math.sqrt(d_model)
        w = std * jax.random.normal(rngs.params(), (d_model, num_heads), jnp.float32)
        self.w = nnx.Param(w.astype(param_dtype))
        self.b = nnx.Param(jnp.full((num_heads,), bias_init, jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        """log f float32[B, T, N] of x[B, T, D] (the attention's normalised input)."""
        logit = x.astype(jnp.float32) @ self.w[...].astype(jnp.float32) + self.b[...]  # (B, T, N)
        return jax.nn.log_sigmoid(logit)
