"""The attention core: one public function, several implementations behind one `match`.

Shape legend: B batch, T query length, S key length, N query heads, K key/value heads
(N % K == 0; G = N // K query heads share each key/value head, K = 1 is multi-query), H head dim.

Conventions (SPEC.md §1): query positions are `q_offset + arange(T)` (q_offset a scalar or one
per batch row, e.g. a KV-cache decode step), key positions `arange(S)`; logits are
`scale * q.k + bias(i, j)`; `causal` hides keys j > i and `kv_lengths` hides keys j >= length.
Softmax runs in float32 whatever the input dtype; the output keeps q's dtype; a query row that
sees no key returns zeros, never NaN.

The bias is either a materialised float[N, T, S] array or a `(BiasFn, params)` pair, where
`BiasFn(params, q_pos: int[t], k_pos: int[s]) -> float[N, t, s]` is pure. The pair lets the
blockwise implementation evaluate the bias tile by tile (never holding [N, T, S]) while gradients
still reach `params`. The core never knows which position family produced the bias.

Implementations:
  "reference"  materialises float32 logits [B, N, T, S]: the oracle, simple and obviously right.
  "xla"        `jax.nn.dot_product_attention` with a materialised bias and an explicit mask.
  "chunked"    each batch row's logits materialised, a few rows at a time, head-major, with a
               hand-written backward (`posattn.attention.chunked`): the fast path at training lengths.
  "blockwise"  tiled online softmax with a recomputing backward, memory linear in T
               (`posattn.attention.blockwise`).
  "auto"       picks "chunked" or "blockwise" by the rule in `choose_implementation`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from posattn.attention import blockwise, chunked

BiasFn = Callable[[Any, jax.Array, jax.Array], jax.Array]
Bias = jax.Array | tuple[BiasFn, Any] | None

IMPLEMENTATIONS = ("auto", "reference", "xla", "chunked", "blockwise", "pallas")

# "auto" takes "chunked" while one head's logits T * S stay below AUTO_CHUNKED_MAX_HEAD_LOGITS and
# "blockwise" from there. Measured on the 2-core Xeon of docs/attention.md (causal, ALiBi, forward
# + backward; `benchmarks/train_throughput.py --crossover`): chunked is 1.5-3.6x faster than
# blockwise up to T = S = 768 (4 heads of 32 at T 128-512 and B 16-64; 8 heads of 64 at T 512 and
# 768), blockwise 1.7-2.6x faster from T = S = 1024 (its 512-tiles skip the causal upper half, and
# one head's [T, S] logits, 4 MiB, no longer fit the 2 MiB L2).
AUTO_CHUNKED_MAX_HEAD_LOGITS = 1024 * 1024
# With per-row positions or lengths "chunked" materialises the bias for every row, [B, N, T, S]:
# "auto" then also keeps B * N * T * S below this (32 MiB of float32), the limit "xla" had before.
AUTO_BLOCKWISE_MIN_LOGITS = 8 * 1024 * 1024

_log = logging.getLogger(__name__)
_logged_choices: set[tuple] = set()


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    bias: Bias = None,
    causal: bool = False,
    q_offset: int | jax.Array = 0,
    kv_lengths: jax.Array | None = None,
    scale: float | None = None,
    implementation: str = "auto",
) -> jax.Array:
    """Multi-head (grouped-query) dot-product attention with an optional additive bias.

    Args:
      q: float[B, T, N, H] queries.
      k: float[B, S, K, H] keys, N % K == 0.
      v: float[B, S, K, H] values.
      bias: None, a float[N, T, S] array, or a `(BiasFn, params)` pair (see module docstring).
      causal: hide keys j > i (i the query position q_offset + t).
      q_offset: int or int[B], the position of the first query.
      kv_lengths: int[B] or None; keys j >= kv_lengths[b] are padding.
      scale: logit scale, default 1/sqrt(H) (T5 passes 1.0).
      implementation: one of IMPLEMENTATIONS.

    Returns:
      float[B, T, N, H] in q's dtype.
    """
    _check_inputs(q, k, v, bias, q_offset, kv_lengths)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    # A Python-int offset (training, a prefill) is static: "chunked" then skips the keys above the
    # causal diagonal tile by tile.
    static_offset = int(q_offset) if isinstance(q_offset, (int, np.integer)) else None
    q_offset = jnp.asarray(q_offset, jnp.int32)
    if kv_lengths is not None:
        kv_lengths = jnp.asarray(kv_lengths, jnp.int32)
    if implementation == "auto":
        per_row = jnp.ndim(q_offset) == 1 or kv_lengths is not None
        implementation = choose_implementation(q, k, bias, per_row=per_row)
    kwargs = dict(bias=bias, causal=causal, q_offset=q_offset, kv_lengths=kv_lengths, scale=scale)
    match implementation:
        case "reference":
            return reference_attention(q, k, v, **kwargs)
        case "xla":
            return xla_attention(q, k, v, **kwargs)
        case "chunked":
            return chunked_path(q, k, v, static_offset=static_offset, **kwargs)
        case "blockwise":
            return blockwise.blockwise_attention(q, k, v, **kwargs)
        case "pallas":
            from posattn.attention import pallas

            return pallas.pallas_attention(q, k, v, **kwargs)
        case _:
            raise ValueError(
                f"attention: unknown implementation {implementation!r}; "
                f"allowed: {', '.join(IMPLEMENTATIONS)}"
            )


def choose_implementation(q: jax.Array, k: jax.Array, bias: Bias, *, per_row: bool = False) -> str:
    """The rule behind implementation="auto"; logs its choice once per shape and bias kind.

    "chunked" while one head's logits T * S stay below AUTO_CHUNKED_MAX_HEAD_LOGITS (and, with
    `per_row` positions or lengths, whose bias it materialises for every row, while B * N * T * S
    stays below AUTO_BLOCKWISE_MIN_LOGITS), otherwise "blockwise", the only implementation whose
    memory stays linear in T. "xla" is never faster than "chunked" in our measurements
    (docs/attention.md). The bias kind does not change the choice. Pass `implementation=` to
    override.
    """
    B, T, N, _ = q.shape
    S = k.shape[1]
    small = T * S < AUTO_CHUNKED_MAX_HEAD_LOGITS and (
        not per_row or B * N * T * S < AUTO_BLOCKWISE_MIN_LOGITS
    )
    choice = "chunked" if small else "blockwise"
    key = (q.shape, k.shape, str(q.dtype), _bias_kind(bias), per_row)
    if key not in _logged_choices:
        _logged_choices.add(key)
        _log.info(
            "attention(implementation='auto'): q %s, k %s, %s, bias %s%s -> %r",
            q.shape,
            k.shape,
            q.dtype,
            _bias_kind(bias),
            ", per-row positions/lengths" if per_row else "",
            choice,
        )
    return choice


# ----------------------------------------------------------------------------------------------
# Materialised implementations.


def reference_attention(q, k, v, *, bias, causal, q_offset, kv_lengths, scale):
    """The oracle: every step written out in float32 on the full [B, N, T, S] logits."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    f32 = jnp.float32
    # Repeat each key/value head for its G query heads: obviously right, costs memory.
    k_rep = jnp.repeat(k.astype(f32), G, axis=2)  # (B, S, N, H)
    v_rep = jnp.repeat(v.astype(f32), G, axis=2)  # (B, S, N, H)
    logits = (
        jnp.einsum("btnh,bsnh->bnts", q.astype(f32), k_rep, precision=jax.lax.Precision.HIGHEST)
        * scale
    )  # (B, N, T, S)
    q_pos = _query_positions(q_offset, T)  # (B or 1, T)
    if bias is not None:
        logits = logits + materialize_bias(bias, q_pos, S)  # (B or 1, N, T, S) broadcasts
    visible = visibility_mask(q_pos, S, causal=causal, kv_lengths=kv_lengths)  # (B|1, T, S)
    logits = jnp.where(visible[:, None], logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    p = jnp.exp(logits - row_max)  # masked keys give exactly 0
    denom = jnp.sum(p, axis=-1, keepdims=True)
    probs = p / jnp.where(denom == 0.0, 1.0, denom)  # a row with no visible key stays all-zero
    out = jnp.einsum("bnts,bsnh->btnh", probs, v_rep, precision=jax.lax.Precision.HIGHEST)
    return out.astype(q.dtype)


def xla_attention(q, k, v, *, bias, causal, q_offset, kv_lengths, scale):
    """`jax.nn.dot_product_attention` with a materialised bias and an explicit boolean mask.

    jax masks with a large finite negative number, so a query row with no visible key would
    average all values; those rows are zeroed here.
    """
    B, T, N, H = q.shape
    S = k.shape[1]
    q_pos = _query_positions(q_offset, T)  # (B or 1, T)
    bias4 = None if bias is None else materialize_bias(bias, q_pos, S)  # (B|1, N, T, S)
    mask = None
    row_visible = None
    if causal or kv_lengths is not None:
        visible = visibility_mask(q_pos, S, causal=causal, kv_lengths=kv_lengths)  # (B|1, T, S)
        mask = visible[:, None]  # (B|1, 1, T, S)
        row_visible = jnp.any(visible, axis=-1)  # (B|1, T)
    dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
    out = jax.nn.dot_product_attention(
        q.astype(dtype), k.astype(dtype), v.astype(dtype), bias=bias4, mask=mask, scale=scale
    )
    if row_visible is not None:
        out = jnp.where(row_visible[:, :, None, None], out, jnp.zeros((), out.dtype))
    return out.astype(q.dtype)


def chunked_path(q, k, v, *, bias, causal, q_offset, kv_lengths, scale, static_offset=None):
    """`posattn.attention.chunked` on the bias materialised [B or 1, N, T, S] with -inf at hidden keys.

    `static_offset`: q_offset as a Python int when it is one (the causal tiles are then static).
    """
    T, S = q.shape[1], k.shape[1]
    q_pos = _query_positions(q_offset, T)  # (B or 1, T)
    logit_bias = None if bias is None else materialize_bias(bias, q_pos, S)  # (B|1, N, T, S)
    if causal or kv_lengths is not None:
        visible = visibility_mask(q_pos, S, causal=causal, kv_lengths=kv_lengths)[
            :, None
        ]  # (B|1, 1, T, S)
        logit_bias = jnp.where(visible, 0.0 if logit_bias is None else logit_bias, -jnp.inf)
    return chunked.chunked_attention(
        q,
        k,
        v,
        logit_bias,
        scale=scale,
        bias_grad=bias is not None,
        causal_offset=static_offset if causal else None,
    )


def materialize_bias(bias: Bias, q_pos: jax.Array, S: int) -> jax.Array:
    """float32[B or 1, N, T, S] from either bias form; q_pos is int[B or 1, T]."""
    if isinstance(bias, tuple):
        fn, params = bias
        k_pos = jnp.arange(S, dtype=jnp.int32)
        per_row = jax.vmap(fn, in_axes=(None, 0, None))(params, q_pos, k_pos)
        return per_row.astype(jnp.float32)  # (B|1, N, T, S)
    return jnp.asarray(bias, jnp.float32)[None]  # (1, N, T, S)


def visibility_mask(q_pos, S, *, causal, kv_lengths):
    """bool[B or 1, T, S]: True where query (row) may attend to key (column)."""
    k_pos = jnp.arange(S, dtype=jnp.int32)
    visible = jnp.ones(q_pos.shape + (S,), bool)  # (B|1, T, S)
    if causal:
        visible = visible & (k_pos[None, None, :] <= q_pos[:, :, None])
    if kv_lengths is not None:
        visible = visible & (k_pos[None, None, :] < kv_lengths[:, None, None])
    return visible


def _query_positions(q_offset: jax.Array, T: int) -> jax.Array:
    """int32[B or 1, T]: q_offset + arange(T), one row per batch element if q_offset is per-row."""
    return jnp.atleast_1d(q_offset)[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]


# ----------------------------------------------------------------------------------------------
# Static validation: shapes only, so it runs once at trace time and never on traced values.


def _bias_kind(bias: Bias) -> str:
    if bias is None:
        return "none"
    return "fn" if isinstance(bias, tuple) else "array"


def _check_inputs(q, k, v, bias, q_offset, kv_lengths) -> None:
    def fail(msg):
        raise ValueError(f"attention: {msg}")

    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            fail(
                f"{name} must be 4-D [B, {'T, N' if name == 'q' else 'S, K'}, H], "
                f"got shape {getattr(x, 'shape', None)}"
            )
    B, T, N, H = q.shape
    if k.shape != v.shape:
        fail(f"k and v must have the same shape [B, S, K, H], got {k.shape} and {v.shape}")
    Bk, S, K, Hk = k.shape
    if Bk != B:
        fail(f"batch size of q ({B}) and k/v ({Bk}) differ")
    if Hk != H:
        fail(f"head dim of q ({H}) and k/v ({Hk}) differ")
    if K == 0 or N % K != 0:
        fail(f"query heads N={N} must be a multiple of key/value heads K={K}")
    if isinstance(bias, tuple):
        if len(bias) != 2 or not callable(bias[0]):
            fail(
                "a tuple bias must be (BiasFn, params) with "
                "BiasFn(params, q_pos: int[t], k_pos: int[s]) -> float[N, t, s]"
            )
    elif bias is not None:
        if getattr(bias, "shape", None) != (N, T, S):
            fail(
                f"an array bias must have shape [N, T, S] = {(N, T, S)}, "
                f"got {getattr(bias, 'shape', None)}"
            )
    offset_shape = jnp.shape(q_offset)
    if offset_shape not in ((), (B,)):
        fail(f"q_offset must be a scalar or int[B] with B={B}, got shape {offset_shape}")
    if kv_lengths is not None and jnp.shape(kv_lengths) != (B,):
        fail(f"kv_lengths must be int[B] with B={B}, got shape {jnp.shape(kv_lengths)}")
