"""cuDNN's fused attention (`jax.nn.dot_product_attention(implementation="cudnn")`) behind the
posattn contract, for the inputs cuDNN accepts.

cuDNN takes the position bias materialised ([B or 1, N, T, S] in the input dtype), a causal mask
aligned at the top-left corner (query t sees keys j <= t, i.e. q_offset = 0) and per-row key
lengths. Any other causal offset is folded into the bias as a boolean mask. Rows that see no key
are zeroed (cuDNN masks with a large finite number, which would average the values instead).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posattn.attention import tiles
from posattn.attention.masks import materialize_bias, query_positions, visibility_mask

DTYPES = (jnp.float16, jnp.bfloat16)


def head_dim_limit() -> int:
    """cuDNN's flash attention takes head dims up to 256 from compute capability 9.0 (Hopper) on,
    up to 128 before."""
    try:
        capability = float(getattr(jax.devices()[0], "compute_capability", "0"))
    except (TypeError, ValueError):
        capability = 0.0
    return 256 if capability >= 9.0 else 128


def unsupported_reason(q, k, v, *, bias, causal, static_offset, backend) -> str | None:
    """Why cuDNN cannot run these inputs (a sentence), or None when it can.

    q, k, v: arrays or shape/dtype structs; `static_offset` the query offset when it is a Python
    int (None when traced or per row); `backend` as `jax.default_backend()` names it.
    """
    if backend != "gpu":
        return f"needs a CUDA GPU, but the default backend is {backend!r}"
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1 or jnp.dtype(q.dtype) not in {jnp.dtype(d) for d in DTYPES}:
        return (
            "takes q, k, v of one dtype, float16 or bfloat16, got "
            f"{', '.join(str(jnp.dtype(x.dtype)) for x in (q, k, v))}"
        )
    H = q.shape[-1]
    if H % 8 or H > head_dim_limit():
        return f"takes a head dim that is a multiple of 8 and at most {head_dim_limit()}, got {H}"
    T, S = q.shape[1], k.shape[1]
    has_bias = bias is not None or (causal and static_offset != 0)
    if has_bias and (T % 2 or S % 2):
        return f"takes even query and key lengths with a bias or an offset mask, got T={T}, S={S}"
    return None


def cudnn_attention(q, k, v, *, bias, causal, q_offset, kv_lengths, scale, static_offset=None):
    """Same contract as `posattn.attention.attention`; raises ValueError where cuDNN cannot run."""
    reason = unsupported_reason(
        q, k, v, bias=bias, causal=causal, static_offset=static_offset, backend=_backend()
    )
    if reason is not None:
        raise ValueError(
            f"attention: implementation='cudnn' {reason}; use 'blockwise', 'xla' or 'auto' instead"
        )
    T, S = q.shape[1], k.shape[1]
    q, scale = tiles.fold_scale(q, scale)
    q_pos = query_positions(q_offset, T)  # (B or 1, T)
    bias4 = None if bias is None else materialize_bias(bias, q_pos, S).astype(q.dtype)
    is_causal = causal and static_offset == 0
    mask = None
    if causal and not is_causal:
        mask = visibility_mask(q_pos, S, causal=True, kv_lengths=None)[:, None]  # (B|1, 1, T, S)
    out = jax.nn.dot_product_attention(
        q,
        k,
        v,
        bias=bias4,
        mask=mask,
        scale=scale,
        is_causal=is_causal,
        key_value_seq_lengths=kv_lengths,
        implementation="cudnn",
    )
    # A row sees some key iff key 0 is visible to it: q_pos >= 0 (causal) and length > 0.
    row_visible = None
    if causal:
        row_visible = q_pos >= 0  # (B|1, T)
    if kv_lengths is not None:
        has_keys = (kv_lengths > 0)[:, None]  # (B, 1)
        row_visible = has_keys if row_visible is None else row_visible & has_keys
    if row_visible is not None:
        out = jnp.where(row_visible[:, :, None, None], out, jnp.zeros((), out.dtype))
    return out


def _backend() -> str:
    return jax.default_backend()
