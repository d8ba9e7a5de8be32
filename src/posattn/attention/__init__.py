"""The attention core: one public function, several implementations behind one `match`.

Shape legend: B batch, T query length, S key length, N query heads, K key/value heads
(N % K == 0; G = N // K query heads share each key/value head, K = 1 is multi-query), H head dim.

Conventions (docs/attention.md): query positions are `q_offset + arange(T)` (q_offset a scalar or
one per batch row, e.g. a KV-cache decode step), key positions `arange(S)`; logits are
`scale * q.k + bias(i, j)`; `causal` hides keys j > i and `kv_lengths` hides keys j >= length;
a sliding `window` w hides keys with i - j >= w (and j - i >= w when not causal: Hugging Face's
`sliding_window`). Forgetting attention (`log_forget`, FoX) adds `c[i] - c[j]` to the logits, c
the float32 cumulative sum of log_forget over the key positions (docs/attention.md). A
`softcap` c replaces scale * q.k by c * tanh(scale * q.k / c) before the bias (Gemma 2). `far`
(`Far`: two-score attention) scores the pairs at distance `far.window` and beyond with a second
query/key pair (ReRoPE, SelfExtend).
Softmax runs in float32 whatever the input dtype; the output keeps q's dtype; a query row that
sees no key returns zeros, never NaN.

The bias is either a materialised float[N, T, S] array or a `(BiasFn, params)` pair, where
`BiasFn(params, q_pos: int[t], k_pos: int[s]) -> float[N, t, s]` is pure. The pair lets the
blockwise implementation evaluate the bias tile by tile (never holding [N, T, S]) while gradients
still reach `params`. The core never knows which position family produced the bias.

The package:
  masks.py      query positions, visibility masks, materialising a bias
  reference.py  "reference" (the float32 oracle) and "xla" (`jax.nn.dot_product_attention`)
  tiles.py      the FlashAttention-2 tile math (forward and backward equations, the guard for rows
                that see no key, grouped-query reshapes) shared by chunked.py and blockwise.py
  chunked.py    "chunked": each batch row's logits materialised, a few rows at a time, head-major,
                with a hand-written backward: the fast path at training lengths on CPU
  native/       "native": a C++ kernel through XLA's FFI (CPU), compiled on first use: forward and
                backward in one pass per block of query rows, causal keys skipped
  blockwise.py  "blockwise": tiled online softmax, recomputing backward, memory linear in T
  cudnn.py      "cudnn": cuDNN's fused attention on a GPU, for the shapes and dtypes it takes
  pallas.py     "pallas": the fused Pallas kernel evaluating the bias inside (GPU, TPU; interpret
                mode on CPU), when present
  partition.py  under a device mesh, every implementation runs per device over the batch
  rowwise.py    what the two below share: queries mapped in blocks over materialised weights
  stickbreaking.py  `stick_breaking_attention`: no softmax; each query breaks a stick over its
                keys from the nearest back (Tan et al. 2025), in float32, queries in blocks
  cope.py       `cope_attention`: contextual positions (CoPE, Golovneva et al. 2024), keys at
                the count of gates sigmoid(q.k) up to the query, read from a learned table
  path.py       `path_attention`: PaTH (Yang et al. 2025), each key moved to its query through a
                product of data-dependent Householder-like reflections; `path_update_keys` and
                `path_extend_keys` for a decode step's or a chunk's cache

"auto" picks per backend by the rule in `choose_implementation`.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from posattn.attention import blockwise, chunked, cudnn, native, partition
from posattn.attention.cope import cope_attention, cope_positions, cope_weights
from posattn.attention.masks import Far, materialize_bias, query_positions, visibility_mask
from posattn.attention.path import (
    path_attention,
    path_extend_keys,
    path_keys,
    path_update_keys,
    path_weights,
)
from posattn.attention.reference import reference_attention, xla_attention
from posattn.attention.stickbreaking import (
    REMAINDERS as STICK_BREAKING_REMAINDERS,
)
from posattn.attention.stickbreaking import (
    StickBreaking,
    stick_breaking_attention,
    stick_breaking_weights,
)

__all__ = [
    "FAR_IMPLEMENTATIONS",
    "IMPLEMENTATIONS",
    "SOFTCAP_IMPLEMENTATIONS",
    "STICK_BREAKING_REMAINDERS",
    "StickBreaking",
    "Bias",
    "BiasFn",
    "Far",
    "attention",
    "cope_attention",
    "cope_positions",
    "cope_weights",
    "choose_implementation",
    "materialize_bias",
    "path_attention",
    "path_extend_keys",
    "path_keys",
    "path_update_keys",
    "path_weights",
    "query_positions",
    "reference_attention",
    "stick_breaking_attention",
    "stick_breaking_weights",
    "visibility_mask",
    "xla_attention",
]

BiasFn = Callable[[Any, jax.Array, jax.Array], jax.Array]
Bias = jax.Array | tuple[BiasFn, Any] | None

IMPLEMENTATIONS = (
    "auto",
    "reference",
    "xla",
    "chunked",
    "native",
    "blockwise",
    "cudnn",
    "pallas",
)

# "auto" on CPU takes "chunked" while one head's logits T * S stay below
# AUTO_CHUNKED_MAX_HEAD_LOGITS and "blockwise" from there. Measured on the 2-core Xeon of
# docs/attention.md (causal, ALiBi, forward + backward; `benchmarks/train_throughput.py
# --crossover`): chunked is 1.5-3.6x faster than blockwise up to T = S = 768 (4 heads of 32 at
# T 128-512 and B 16-64; 8 heads of 64 at T 512 and 768), blockwise 1.7-2.6x faster from
# T = S = 1024 (its 512-tiles skip the causal upper half, and one head's [T, S] logits, 4 MiB, no
# longer fit the 2 MiB L2).
AUTO_CHUNKED_MAX_HEAD_LOGITS = 1024 * 1024
# With per-row positions or lengths "chunked" materialises the bias for every row, [B, N, T, S]:
# "auto" then also keeps B * N * T * S below this (32 MiB of float32), the limit "xla" had before.
AUTO_BLOCKWISE_MIN_LOGITS = 8 * 1024 * 1024
# On a GPU "auto" hands cuDNN a materialised bias only while it has at most this many elements
# (1 GiB of bfloat16); past it, "blockwise" (which evaluates the bias per tile).
AUTO_CUDNN_MAX_BIAS = 512 * 1024 * 1024

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
    window: int | None = None,
    log_forget: jax.Array | None = None,
    softcap: float | None = None,
    far: Far | None = None,
    implementation: str = "auto",
) -> jax.Array:
    """Multi-head (grouped-query) dot-product attention with an optional additive bias.

    Under a device mesh (`jax.set_mesh`, or Explicit shardings) every implementation runs per
    device on its batch rows (`posattn.attention.partition`).

    Args:
      q: float[B, T, N, H] queries.
      k: float[B, S, K, H] keys, N % K == 0.
      v: float[B, S, K, H] values.
      bias: None, a float[N, T, S] array, or a `(BiasFn, params)` pair (see module docstring).
      causal: hide keys j > i (i the query position q_offset + t).
      q_offset: int or int[B], the position of the first query.
      kv_lengths: int[B] or None; keys j >= kv_lengths[b] are padding.
      scale: logit scale, default 1/sqrt(H) (T5 passes 1.0).
      window: None, or a static int w >= 1: query i sees key j only if i - j < w (and, when not
        causal, j - i < w), Hugging Face's `sliding_window` (Mistral, Gemma 2/3). A decode step
        (q_offset = the cache position) sees the same window as the full sequence.
      log_forget: None, or float[B, S, N] log forget gates (FoX, Lin et al. 2025), per key
        position and query head, e.g. log(sigmoid(.)) <= 0: the logit of (i, j) gains
        sum_{l=j+1..i} log_forget[b, l, h] = c[b, i, h] - c[b, j, h] with c its float32 cumulative
        sum over positions; query i reads c at its own position, so query positions must lie in
        [0, S) (self-attention, a KV cache). Needs causal=True.
      softcap: None, or a static number c > 0: the content logits scale * q.k become
        c * tanh(scale * q.k / c) before the bias, forget term and mask are added (Gemma 2's
        `attn_logit_softcapping`). "reference", "chunked", "native" and "blockwise" compute it;
        "auto" picks among those.
      far: None, or `Far(q, k, window)`: two-score attention. The content logit of query i and
        key j is scale * q_i.k_j while i - j < window (|i - j| < window when not causal) and
        scale * far.q_i.far.k_j from there on (far.q [B, T, N, H], far.k [B, S, K, H]); the
        soft cap, bias, forget term and masks apply to either, and gradients reach both pairs.
        Eval-time RoPE remaps (ReRoPE, SelfExtend: `posattn.rotary.remap_positions`) are this.
        "reference", "chunked" and "blockwise" compute it (FAR_IMPLEMENTATIONS); "auto" takes
        "chunked" or "blockwise" by size.
      implementation: one of IMPLEMENTATIONS.

    Returns:
      float[B, T, N, H] in q's dtype.
    """
    _check_inputs(q, k, v, bias, q_offset, kv_lengths)
    _check_window_and_forget(q, k, window, log_forget, causal, q_offset)
    if window is not None:
        window = int(window)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"attention: unknown implementation {implementation!r}; "
            f"allowed: {', '.join(IMPLEMENTATIONS)}"
        )
    softcap = _check_softcap(softcap, implementation)
    far_window, far_qk = _check_far(q, k, far, implementation)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    # A Python-int offset (training, a prefill) is static: "chunked" then skips the keys above the
    # causal diagonal tile by tile, and "cudnn" uses its own causal mask when it is 0.
    static_offset = int(q_offset) if isinstance(q_offset, (int, np.integer)) else None
    q_offset = jnp.asarray(q_offset, jnp.int32)
    if kv_lengths is not None:
        kv_lengths = jnp.asarray(kv_lengths, jnp.int32)
    run = functools.partial(
        _dispatch,
        implementation=implementation,
        causal=causal,
        static_offset=static_offset,
        window=window,
        softcap=softcap,
        far_window=far_window,
    )
    return partition.over_batch(
        run,
        q,
        k,
        v,
        bias=bias,
        q_offset=q_offset,
        kv_lengths=kv_lengths,
        scale=scale,
        log_forget=log_forget,
        far=far_qk,
    )


def _dispatch(
    q,
    k,
    v,
    bias,
    q_offset,
    kv_lengths,
    scale,
    log_forget,
    far_qk,
    *,
    implementation,
    causal,
    static_offset,
    window,
    softcap=None,
    far_window=None,
):
    """One implementation on (the local rows of) q, k, v."""
    if implementation == "auto":
        per_row = jnp.ndim(q_offset) == 1 or kv_lengths is not None
        implementation = choose_implementation(
            q,
            k,
            bias,
            per_row=per_row,
            causal=causal,
            static_offset=static_offset,
            window=window,
            log_forget=log_forget,
            softcap=softcap,
            far=far_qk is not None,
        )
    kwargs = dict(
        bias=bias,
        causal=causal,
        q_offset=q_offset,
        kv_lengths=kv_lengths,
        scale=scale,
        window=window,
        log_forget=log_forget,
    )
    if softcap is not None:  # _check_softcap let only these through
        kwargs["softcap"] = softcap
    if far_qk is not None:  # _check_far let only these through
        kwargs["far"] = Far(*far_qk, far_window)
    match implementation:
        case "reference":
            return reference_attention(q, k, v, **kwargs)
        case "xla":
            return xla_attention(q, k, v, **kwargs)
        case "chunked":
            return chunked.attention_from_bias(q, k, v, static_offset=static_offset, **kwargs)
        case "native":
            reason = native.supports(q, k)
            if reason is not None:
                raise ValueError(f"attention: implementation='native' cannot run here: {reason}")
            return native.attention_from_bias(q, k, v, static_offset=static_offset, **kwargs)
        case "blockwise":
            return blockwise.blockwise_attention(q, k, v, **kwargs)
        case "cudnn":
            return cudnn.cudnn_attention(q, k, v, static_offset=static_offset, **kwargs)
        case "pallas":
            pallas = _pallas_module()
            if static_offset is not None:
                kwargs["q_offset"] = static_offset
            return pallas.pallas_attention(q, k, v, **kwargs)


def _backend() -> str:
    """The backend "auto" decides for (a function so that tests can stand in another)."""
    return jax.default_backend()


def _pallas_module():
    """posattn.attention.pallas, imported on first use (it pulls in jax.experimental.pallas)."""
    return importlib.import_module("posattn.attention.pallas")


def _pallas_supports(q, k, bias, *, causal, per_row, backend, window, log_forget) -> bool:
    """Whether the fused Pallas kernel takes these inputs on `backend`
    (`pallas.unsupported_reason` says None)."""
    reason = _pallas_module().unsupported_reason(
        q,
        k,
        bias=bias,
        causal=causal,
        per_row=per_row,
        backend=backend,
        window=window,
        log_forget=log_forget,
    )
    return reason is None


def choose_implementation(
    q: jax.Array,
    k: jax.Array,
    bias: Bias,
    *,
    per_row: bool = False,
    causal: bool = False,
    static_offset: int | None = 0,
    backend: str | None = None,
    window: int | None = None,
    log_forget: Any = None,
    softcap: float | None = None,
    far: bool = False,
) -> str:
    """The rule behind implementation="auto", per backend; logs its choice once per input kind.

    CPU: "native" where its kernel built (`posattn.attention.native.supports`) while the logit
    bias it materialises stays within AUTO_BLOCKWISE_MIN_LOGITS elements (none for a static
    causal mask without a bias; [1, N, T, S] for a position bias; a slice per row with per-row
    positions, lengths or forget gates), at every head dim it is built for. Otherwise
    "chunked" while one head's logits T * S stay below AUTO_CHUNKED_MAX_HEAD_LOGITS (and, with
    `per_row` positions or lengths, whose bias it materialises for every row, while B * N * T * S
    stays below AUTO_BLOCKWISE_MIN_LOGITS), and "blockwise", the only implementation whose memory
    stays linear in T, past that. "xla" is never faster than "chunked" in our measurements
    (docs/attention.md).

    GPU and TPU: never a kernel tuned on CPU. On a GPU with no bias, no forget gates, no window
    and a causal mask (if any) from query position 0, "cudnn" where cuDNN takes the shapes and
    dtypes (`posattn.attention.cudnn.unsupported_reason`): it has nothing to materialise and was
    the fastest measured. Otherwise "pallas" (the fused kernel that evaluates the bias inside and
    skips the tiles outside a window) where it exists for the inputs; else, on a GPU, "cudnn"
    where cuDNN takes the inputs and its materialised bias stays at most AUTO_CUDNN_MAX_BIAS
    elements; otherwise "blockwise".

    Windows and forgetting attention: `log_forget` makes the logit bias per batch row (c_i - c_j
    differs per row), so it counts as `per_row` for the materialising kernels ("chunked" on CPU,
    "cudnn"'s bias size). A window leaves the CPU rule as it is: "chunked" still materialises the
    [T, S] bias and mask of every head (its causal tiles skip the keys outside the window, so it
    stays the faster one at short lengths) and past AUTO_CHUNKED_MAX_HEAD_LOGITS "blockwise",
    whose tiles outside the band are skipped, is the one with memory linear in T. On a GPU the
    window and the forget gates go to `pallas.unsupported_reason` and
    `cudnn.unsupported_reason`; cuDNN refuses a window except with its own causal mask at offset
    0, so such calls fall to "blockwise".

    Soft-capped logits (`softcap`): on a CPU the rule above ("native" computes the cap too);
    elsewhere "pallas" where it takes the inputs, else "chunked" or "blockwise" by the CPU rule's
    sizes (cuDNN takes no cap).

    Two-score attention (`far`): "chunked" or "blockwise" by the CPU rule's sizes on every
    backend, the implementations that score two query/key pairs (FAR_IMPLEMENTATIONS).

    q, k: arrays or shape/dtype structs (the rows one device sees); log_forget an array, a
    shape/dtype struct or None. Pass `implementation=` to `attention` to override.
    """
    backend = _backend() if backend is None else backend
    B, T, N, _ = q.shape
    S = k.shape[1]
    # A materialised bias has one slice per batch row with per-row positions or lengths, or with
    # forget gates.
    per_row_bias = per_row or log_forget is not None
    small = T * S < AUTO_CHUNKED_MAX_HEAD_LOGITS and (
        not per_row_bias or B * N * T * S < AUTO_BLOCKWISE_MIN_LOGITS
    )
    choice = "chunked" if small else "blockwise"

    def pallas_takes() -> bool:  # asked off the CPU only: it imports the Pallas module
        return _pallas_supports(
            q,
            k,
            bias,
            causal=causal,
            per_row=per_row,
            backend=backend,
            window=window,
            log_forget=log_forget,
        )

    if far:
        pass  # "chunked" or "blockwise", by the sizes above
    elif backend == "cpu":
        materialised = _native_materialised(
            B, N, T, S, bias, per_row, causal, static_offset, window, log_forget
        )
        if materialised <= AUTO_BLOCKWISE_MIN_LOGITS and native.supports(q, k) is None:
            choice = "native"
    elif softcap is not None:  # cuDNN takes no cap
        choice = "pallas" if pallas_takes() else choice
    else:
        has_bias = bias is not None or log_forget is not None
        cudnn_ok = (
            cudnn.unsupported_reason(
                q,
                k,
                k,
                bias=bias,
                causal=causal,
                static_offset=static_offset,
                backend=backend,
                window=window,
                log_forget=log_forget,
            )
            is None
        )
        offset_mask = causal and static_offset != 0  # cuDNN would materialise it as a bias
        if cudnn_ok and not (has_bias or offset_mask) and window is None:
            # Nothing to materialise: cuDNN's fused kernel (3.9x faster than "pallas" forward and
            # backward at T 8k on an H200, docs/attention.md).
            choice = "cudnn"
        elif pallas_takes():
            choice = "pallas"
        else:
            bias_rows = B if per_row_bias and has_bias else 1
            bias_size = 0 if not has_bias else bias_rows * N * T * S
            choice = "cudnn" if cudnn_ok and bias_size <= AUTO_CUDNN_MAX_BIAS else "blockwise"
    forget = log_forget is not None
    key = (backend, q.shape, k.shape, str(q.dtype), _bias_kind(bias), per_row, causal)
    key += (window, forget, softcap, far)
    if key not in _logged_choices:
        _logged_choices.add(key)
        _log.info(
            "attention(implementation='auto') on %s: q %s, k %s, %s, bias %s%s%s%s%s%s -> %r",
            backend,
            q.shape,
            k.shape,
            q.dtype,
            _bias_kind(bias),
            ", per-row positions/lengths" if per_row else "",
            "" if window is None else f", window {window}",
            ", forget gates" if forget else "",
            "" if softcap is None else f", soft cap {softcap}",
            ", two-score (far=)" if far else "",
            choice,
        )
    return choice


# ----------------------------------------------------------------------------------------------
# Static validation: shapes only, so it runs once at trace time and never on traced values.


def _native_materialised(B, N, T, S, bias, per_row, causal, static_offset, window, log_forget):
    """Elements of the logit bias "native" materialises for these inputs (0: none; the kernel's
    key ranges give a static causal mask and its window)."""
    has_bias = bias is not None or log_forget is not None
    ranged = causal and static_offset is not None
    masked = per_row or (causal and not ranged) or (window is not None and not ranged)
    if not (has_bias or masked):
        return 0
    rows = B if per_row or log_forget is not None else 1
    return rows * (N if has_bias else 1) * T * S


def _bias_kind(bias: Bias) -> str:
    if bias is None:
        return "none"
    return "fn" if isinstance(bias, tuple) else "array"


# The implementations that compute soft-capped logits.
SOFTCAP_IMPLEMENTATIONS = ("auto", "reference", "chunked", "native", "blockwise", "pallas")


def _check_softcap(softcap, implementation: str) -> float | None:
    """`softcap` as a float (None stays None), or ValueError naming the problem."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.number)):
        raise ValueError(
            f"attention: softcap={softcap!r} must be None or a Python number c > 0 (static, "
            "not a traced value)"
        )
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"attention: softcap={softcap!r} must be a finite number > 0, or None")
    if implementation not in SOFTCAP_IMPLEMENTATIONS:
        raise ValueError(
            f"attention: implementation={implementation!r} does not compute soft-capped logits; "
            f"use one of {', '.join(map(repr, SOFTCAP_IMPLEMENTATIONS))}"
        )
    return float(softcap)


# The implementations that compute two-score attention (`far`).
FAR_IMPLEMENTATIONS = ("auto", "reference", "chunked", "blockwise")


def _check_far(q, k, far, implementation: str):
    """(window, (far.q, far.k)) of a valid `far`, (None, None) without one; ValueError naming the
    problem otherwise."""
    if far is None:
        return None, None

    def fail(msg):
        raise ValueError(f"attention: {msg}")

    if not isinstance(far, Far):
        fail(f"far must be None or posattn.attention.Far(q, k, window), got {type(far).__name__}")
    window = far.window
    is_int = isinstance(window, (int, np.integer)) and not isinstance(window, (bool, np.bool_))
    if not is_int or window < 1:
        fail(f"far.window must be a static Python int >= 1, got {window!r}")
    for name, x, want in (("far.q", far.q, q), ("far.k", far.k, k)):
        if getattr(x, "shape", None) != want.shape:
            fail(
                f"{name} must have the shape of {name[-1]}, {tuple(want.shape)}, "
                f"got {getattr(x, 'shape', None)}"
            )
    if implementation not in FAR_IMPLEMENTATIONS:
        fail(
            f"implementation={implementation!r} does not compute two-score attention (far=); "
            f"use one of {', '.join(map(repr, FAR_IMPLEMENTATIONS))}"
        )
    return int(window), (far.q, far.k)


def _check_window_and_forget(q, k, window, log_forget, causal, q_offset) -> None:
    def fail(msg):
        raise ValueError(f"attention: {msg}")

    if window is not None:
        is_int = isinstance(window, (int, np.integer)) and not isinstance(window, (bool, np.bool_))
        if not is_int or window < 1:
            fail(
                f"window must be None (no window) or a static Python int >= 1 (query i sees key j "
                f"only if i - j < window), got {window!r}"
            )
    if log_forget is None:
        return
    B, T, N, _ = q.shape
    S = k.shape[1]
    shape = getattr(log_forget, "shape", None)
    if shape != (B, S, N):
        fail(
            f"log_forget must have shape [B, S, N] = {(B, S, N)} (per key position and query "
            f"head), got {shape}"
        )
    if not jnp.issubdtype(log_forget.dtype, jnp.floating):
        fail(f"log_forget must be floating point, got dtype {log_forget.dtype}")
    if not causal:
        fail(
            "log_forget needs causal=True: the forget term sum_{l=j+1..i} log_forget[l] is "
            "defined for keys j <= i, got causal=False"
        )
    if isinstance(q_offset, (int, np.integer)) and not 0 <= int(q_offset) <= S - T:
        fail(
            f"log_forget needs query positions q_offset + arange(T) in [0, S) (query i reads the "
            f"cumulative sum at its own position), got q_offset={int(q_offset)}, T={T}, S={S}"
        )


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
