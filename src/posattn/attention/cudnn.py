"""cuDNN's fused attention (`jax.nn.dot_product_attention(implementation="cudnn")`) behind the
posattn contract, for the inputs cuDNN accepts.

cuDNN takes the position bias materialised ([B or 1, N, T, S] in the input dtype), a causal mask
aligned at the top-left corner (query t sees keys j <= t, i.e. q_offset = 0) and per-row key
lengths. Any other causal offset is folded into the bias as a boolean mask. Rows that see no key
are zeroed (cuDNN masks with a large finite number, which would average the values instead).

A sliding window w goes to cuDNN's own sliding-window mask (`local_window_size=(w - 1, 0)`, which
jax hands cuDNN as a left window of w keys), which cuDNN applies only with its top-left causal
mask: other windowed calls are refused (`unsupported_reason`), so "auto" picks another kernel.
The forgetting-attention term c_i - c_j joins the materialised bias, one slice per batch row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posattn.attention import tiles
from posattn.attention.masks import (
    forget_cumsum,
    materialize_logit_bias,
    query_positions,
    visibility_mask,
)

DTYPES = (jnp.float16, jnp.bfloat16)


def head_dim_limit() -> int:
    """cuDNN's flash attention takes head dims up to 256 from compute capability 9.0 (Hopper) on,
    up to 128 before."""
    try:
        capability = float(getattr(jax.devices()[0], "compute_capability", "0"))
    except (TypeError, ValueError):
        capability = 0.0
    return 256 if capability >= 9.0 else 128


def unsupported_reason(
    q, k, v, *, bias, causal, static_offset, backend, window=None, log_forget=None
) -> str | None:
    """Why cuDNN cannot run these inputs (a sentence), or None when it can.

    q, k, v: arrays or shape/dtype structs; `static_offset` the query offset when it is a Python
    int (None when traced or per row); `backend` as `jax.default_backend()` names it; `window`
    and `log_forget` as `posattn.attention.attention` takes them.
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
    if window is not None and not (causal and static_offset == 0):
        return (
            f"takes a sliding window (window={window}) only with its causal mask from query "
            f"position 0, got causal={causal} and q_offset "
            f"{'traced or per row' if static_offset is None else static_offset}"
        )
    T, S = q.shape[1], k.shape[1]
    has_bias = bias is not None or log_forget is not None or (causal and static_offset != 0)
    if has_bias and (T % 2 or S % 2):
        return f"takes even query and key lengths with a bias or an offset mask, got T={T}, S={S}"
    return None


def cudnn_attention(
    q,
    k,
    v,
    *,
    bias,
    causal,
    q_offset,
    kv_lengths,
    scale,
    static_offset=None,
    window=None,
    log_forget=None,
):
    """Same contract as `posattn.attention.attention`; raises ValueError where cuDNN cannot run."""
    reason = unsupported_reason(
        q,
        k,
        v,
        bias=bias,
        causal=causal,
        static_offset=static_offset,
        backend=_backend(),
        window=window,
        log_forget=log_forget,
    )
    if reason is not None:
        raise ValueError(
            f"attention: implementation='cudnn' {reason}; use 'blockwise', 'xla' or 'auto' instead"
        )
    T, S = q.shape[1], k.shape[1]
    q, scale = tiles.fold_scale(q, scale)
    q_pos = query_positions(q_offset, T)  # (B or 1, T)
    c = None if log_forget is None else forget_cumsum(log_forget)  # (B, S, N) float32
    bias4 = materialize_logit_bias(bias, c, q_pos, S)  # (B|1, N, T, S) float32 or None
    bias4 = None if bias4 is None else bias4.astype(q.dtype)
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
        local_window_size=None if window is None else (window - 1, 0),
        implementation="cudnn",
    )
    # A causal row sees some key iff its latest candidate key, min(i, length - 1), is >= 0 and
    # (with a window) within the window; a non-causal row iff its length is > 0.
    row_visible = None
    if causal:
        latest = q_pos if kv_lengths is None else jnp.minimum(q_pos, kv_lengths[:, None] - 1)
        row_visible = latest >= 0  # (B|1, T)
        if window is not None:
            row_visible &= q_pos - latest < window
    elif kv_lengths is not None:
        row_visible = (kv_lengths > 0)[:, None]  # (B, 1)
    if row_visible is not None:
        out = jnp.where(row_visible[:, :, None, None], out, jnp.zeros((), out.dtype))
    return out


def _backend() -> str:
    return jax.default_backend()
