"""CoPE's table of position embeddings (Golovneva et al. 2024): the module a layer owns.

One [H, P] table per layer, shared by its heads and zero at initialisation, as the reference
(facebookresearch/RAM `projects/cope`, `ContextPosSelfAttn.pos_emb`, a zero
[1, head_dim, npos] parameter); the attention core reads it at each key's contextual position
(`posattn.attention.cope_attention`). With a zero table a CoPE layer starts as NoPE.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

__all__ = ["CopeTable"]


class CopeTable(nnx.Module):
    """A layer's CoPE position embeddings.

    Args:
      head_dim: H.
      positions: P (contextual positions are clamped to P - 1).
      scale_positions: the position logits scaled with q.k (the core's `scale_positions`).
      gates: "keys" (sigmoid(scale q.k), the reference's default), "values" (sigmoid(scale
        q.v), its `--cope-val-gates`) or "separate" (sigmoid(scale q.g), g from a key projection
        of the layer's own, `Attention.wg`: its `--cope-sep-key`).
      param_dtype: storage dtype of the table.
    """

    def __init__(
        self,
        head_dim: int,
        positions: int,
        *,
        scale_positions: bool,
        gates: str = "keys",
        param_dtype=jnp.float32,
    ):
        self.table = nnx.Param(jnp.zeros((head_dim, positions), param_dtype))
        self.scale_positions, self.gates = scale_positions, gates

    def settings(self, v, g=None) -> dict:
        """The keyword arguments of `cope_attention` / `cope_weights` besides the table, for a
        layer whose values are v[B, S, K, H] and whose separate gate keys (gates="separate")
        are g[B, S, K, H]."""
        gate_keys = {"keys": None, "values": v, "separate": g}[self.gates]
        if self.gates == "separate" and g is None:
            raise ValueError("a CoPE layer with separate gate keys needs them (g)")
        return {"scale_positions": self.scale_positions, "gate_keys": gate_keys}
