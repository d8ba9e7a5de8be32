"""Pallas attention: fused FlashAttention-2 kernels that evaluate the position bias inside.

Shape legend: B batch, T query length, S key length, N query heads, K key/value heads, G = N // K
query heads per key/value head, H head dim (Hp: padded to a power of two >= 16); tq/tk the query
and key tile sizes (powers of two >= 16), nq/nk the number of tiles, Tp = nq * tq and Sp = nk * tk
the padded lengths.

Three `pl.pallas_call` kernels, one body each for GPU (Triton lowering), TPU (Mosaic) and CPU
(Pallas interpret mode, chosen automatically when `jax.default_backend() == "cpu"`):

  forward  grid (B, N, nq): program (b, h, i) keeps query tile i of head h in fast memory and loops
           over key tiles with a running max / sum / unnormalised output in float32 (Dao 2023,
           "FlashAttention-2", Alg. 1); it writes the output and the per-row log-sum-exp.
  dK, dV   grid (B, N, nk): program (b, h, j) loops over the query tiles that can see key tile j,
           recomputes the probabilities from the saved log-sum-exp and accumulates dK_j, dV_j
           (Alg. 2). It also accumulates this program's share of the bias-parameter gradient.
  dQ       grid (B, N, nq): program (b, h, i) loops over key tiles again and accumulates dQ_i
           (the split of the backward into a dK/dV and a dQ kernel is the one of Pallas' GPU
           reference kernel, jax/experimental/pallas/ops/gpu/attention.py; it needs no atomics).

The bias is a `(BiasFn, params)` pair, `BiasFn(params, q_pos: int[t], k_pos: int[s]) ->
float[N, t, s]`, called inside the kernel body on each tile's query and key positions, so no
[N, T, S] bias ever exists. Its parameters enter the kernels as whole (small) arrays. The
parameter gradient is a VJP of the BiasFn on the tile, taken inside the dK/dV kernel with the
tile's dS as cotangent: each program (b, h, j) writes its partial sum over the query tiles it
visits to its own slot of a [B, N, nk, *leaf] buffer, and the slots are summed outside the
kernel (deterministic, no atomics; the buffers are linear in S).

A BiasFn returns all N heads; a program works on one head h and evaluates only that head: the
head axis is pushed back through the BiasFn's jaxpr to its small inputs, where row h is picked
(`_HeadSlicer`), so no [N, tq, tk] tile is built for the families here.

Grouped-query heads: the key/value BlockSpecs map query head h to key/value head h // G, so K/V
are never repeated; dK and dV are written per query head in float32 and summed over the G heads
of a group outside the kernel.

Causal skipping: program (b, h, i) loops only up to the last key tile its queries can see (at its
row's q_offset), and program (b, h, j) of the dK/dV kernel starts at the first query tile that
can see key tile j; key tiles wholly at or past the row's kv length are skipped. Masks are
applied inside every visited tile (hidden logits at -inf; a row that sees nothing returns 0).

Sliding windows (`window`, Hugging Face's `sliding_window`: key j visible from query i when
i - j < w, and j - i < w when not causal): the same tile ranges get a start as well as an end, so
a query tile visits only the key tiles of its band and a key tile only the query tiles of its band;
every range is exactly the tiles holding a visible pair, and the work is T x w, not T x S.

Forgetting attention (`log_forget`, FoX: Lin et al., ICLR 2025, "Forgetting Transformer"; the
`zhixuan-lin/forgetting-transformer` and `fla-org/flash-linear-attention` kernels): logit (i, j)
gains c_i - c_j, c = cumsum(log f) over positions in float32, computed outside the kernels along
with its gather at the query positions. The kernels take the two [B, N, 1, L] rows (per query
head: c_q over the query tile, c_k over the key tile) and never a [T, S] bias; the backward
returns d c_q = rowsum(dS) from the dQ kernel and d c_k = -colsum(dS) from the dK/dV kernel, and
JAX differentiates the gather and the cumulative sum (a reverse cumulative sum) outside.

Layout: the wrapper transposes q, k, v to head-major [B, N or K, T or S, Hp] and pads T and S to
whole tiles, so every block's last two dimensions are (tile, Hp): powers of two for Triton, the
full head dimension for Mosaic.

Lowering (checked by exporting the kernels for "cuda" and "tpu" on a CPU machine; no GPU or TPU
has run them, docs/attention.md): every registry family lowers through Triton and Mosaic. Neither
lowers T5's table gather (`table[:, bucket]`: Triton has no gather, Mosaic only take-along-axis
ones), so on those backends a gather that takes whole slices along one axis is evaluated as a
one-hot matrix product (exact); interpret mode keeps the gather. Triton also needs the parameter
leaves' sizes to be powers of two. A materialised [N, T, S] bias is not taken here (use
"blockwise" or "chunked").
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

f32 = jnp.float32

BACKENDS = ("interpret", "gpu", "tpu")
_TRACER = getattr(jax.core, "Tracer", ())  # public in jax 0.10; () if it ever moves

# Default tiles per backend (powers of two >= 16). GPU: 64 x 64 keeps the bias tile, the logits
# and a 128-wide head in registers with 4 warps (Pallas' GPU reference runs 128 x 64 forward and
# 32 x 32 backward without a bias); TPU: 128 x 128, the MXU's native tile.
DEFAULT_TILES = {"interpret": (128, 128), "gpu": (64, 64), "tpu": (128, 128)}


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static facts about one call: shapes, tiling, bias structure and backend."""

    N: int
    G: int
    tq: int
    tk: int
    nq: int
    nk: int
    Hp: int
    causal: bool
    kv_mask: bool  # keys past a length exist (explicit kv_lengths or S padded to Sp)
    scale: float
    bias_fn: Callable | None
    treedef: Any  # of the params pytree
    is_float: tuple[bool, ...]  # per leaf: differentiated (floating) or carried (integer)
    leaf_shapes: tuple[tuple[int, ...], ...]  # original leaf shapes (kernel refs are >= 1-D)
    backend: str
    window: int | None = None  # sliding window: i - j < window (|i - j| < window when not causal)
    forget: bool = False  # FoX: the kernels take cumulative log forget gates of queries and keys
    softcap: float | None = None  # the content logits capped as c tanh(s / c) (Gemma 2)
    num_warps: int | None = None  # Triton (backend "gpu"); None: `_compiler_params`' default
    num_stages: int | None = None  # likewise

    @property
    def n_leaves(self) -> int:
        return len(self.is_float)


def default_backend() -> str:
    """ "gpu" or "tpu" on those platforms, else "interpret" (Pallas interpret mode)."""
    platform = jax.default_backend()
    if platform in ("gpu", "cuda", "rocm"):
        return "gpu"
    if platform == "tpu":
        return "tpu"
    return "interpret"


# Mosaic loads a head's whole K and V into VMEM (16 MiB on TPU v4/v5e scoped by default); past
# this many bytes of whole-sequence blocks per program (K and V in the forward and dQ kernels; Q,
# dO and their float32 rows in the dK/dV kernel) the TPU kernel is not offered by "auto".
TPU_MAX_KV_BYTES = 8 * 1024 * 1024
# A window at least this wide is clipped to it, so that positions +- window stay in int32.
_MAX_WINDOW = 2**30


def _window_error(window) -> str | None:
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        return f"window={window!r}; allowed: None or a Python int >= 1"
    return None


def _tpu_whole_bytes(q, k, *, forget: bool) -> int:
    """The largest VMEM footprint of the blocks that span a whole sequence in one program: K and V
    (forward, dQ) or Q and dO (dK/dV), plus float32 rows (log-sum-exp, delta, the cumulative log
    forget gates), each padded to 8 sublanes as Mosaic lays out a [1, L] block."""
    T, S, H = q.shape[1], k.shape[1], q.shape[3]
    Hp = max(16, pl.next_power_of_2(H))
    row = lambda L: 8 * L * 4  # noqa: E731
    kv = 2 * S * Hp * jnp.dtype(k.dtype).itemsize + (row(S) if forget else 0)
    qdo = 2 * T * Hp * jnp.dtype(q.dtype).itemsize + 2 * row(T) + (row(T) if forget else 0)
    return max(kv, qdo)


def unsupported_reason(
    q, k, *, bias, causal=False, per_row=False, backend=None, window=None, log_forget=None
) -> str | None:
    """Why `pallas_attention` should not run these inputs on this backend (None: it can).

    `posattn.attention.choose_implementation` asks this before "auto" picks "pallas".
    """
    del per_row  # every offset and length form is supported
    backend = default_backend() if backend is None else backend
    if bias is not None and not isinstance(bias, tuple):
        return "a materialised [N, T, S] bias (the kernel takes a (BiasFn, params) pair)"
    if (reason := _window_error(window)) is not None:
        return reason
    if log_forget is not None and not causal:
        return "log_forget with causal=False (forgetting attention is causal)"
    if backend == "gpu" and bias is not None:
        sizes = [int(np.prod(jnp.shape(x))) for x in jax.tree.leaves(bias[1])]
        if any(n & (n - 1) for n in sizes):
            return f"bias parameter sizes {sizes}: Triton loads only power-of-two blocks"
    if backend == "tpu":
        nbytes = _tpu_whole_bytes(q, k, forget=log_forget is not None)
        if nbytes > TPU_MAX_KV_BYTES:
            return (
                f"the whole-sequence blocks of one head (K and V, or Q and dO, with their rows) "
                f"take {nbytes} bytes > {TPU_MAX_KV_BYTES} of VMEM"
            )
    return None


def pallas_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    bias=None,
    causal: bool = False,
    q_offset: int | jax.Array = 0,
    kv_lengths: jax.Array | None = None,
    scale: float | None = None,
    window: int | None = None,
    log_forget: jax.Array | None = None,
    softcap: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    backend: str | None = None,
) -> jax.Array:
    """Same contract as `posattn.attention.attention` (which validates the inputs), fused.

    Args:
      q, k, v, causal, q_offset, kv_lengths, scale: as in `posattn.attention.attention`.
      bias: None or a `(BiasFn, params)` pair (a materialised array is refused: see module doc).
      window: None or a sliding window (Hugging Face's `sliding_window`): query i sees key j only
        if i - j < window (|i - j| < window when not causal). Tiles outside the band are skipped.
      log_forget: None or float[B, S, N] log forget gates (FoX, causal only): logit (i, j) gains
        c[i] - c[j], c = cumsum(log_forget) over positions in float32, query i reading c at its
        position q_offset + t (clipped to [0, S - 1]). Differentiated.
      softcap: None, or c > 0: the content logits scale q.k become c tanh(scale q.k / c) before
        the bias and the forget term (Gemma 2's soft-capping); dq and dk pass through its slope.
      block_q: query tile size, a power of two >= 16 (clipped to T rounded up); default per backend.
      block_k: key tile size, likewise.
      num_warps: Triton's warps per program, 1, 2, 4, 8 or 16 (backend "gpu" only); default 4
        for heads of at most 64, else 8.
      num_stages: Triton's software-pipelining stages, >= 1 (backend "gpu" only); default 2.
      backend: "interpret", "gpu" or "tpu"; default `default_backend()`. Naming "gpu" or "tpu"
        on another machine only makes sense under `jax.export` for that platform.

    Returns:
      float[B, T, N, H] in q's dtype.
    """
    backend = default_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"pallas_attention: backend={backend!r}; allowed: {', '.join(BACKENDS)}")
    for name, block in (("block_q", block_q), ("block_k", block_k)):
        if block is not None and (block < 16 or block & (block - 1)):
            raise ValueError(
                f"pallas_attention: {name}={block}; allowed: a power of two >= 16 "
                "(Triton's block shapes)"
            )
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"pallas_attention: num_warps={num_warps!r}; allowed: 1, 2, 4, 8 or 16")
    if num_stages is not None and (
        isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1
    ):
        raise ValueError(f"pallas_attention: num_stages={num_stages!r}; allowed: an int >= 1")
    if (num_warps is not None or num_stages is not None) and backend != "gpu":
        raise ValueError(
            f"pallas_attention: num_warps and num_stages are Triton's settings (backend 'gpu'); "
            f"got backend={backend!r}: leave them unset there"
        )
    if bias is not None and not isinstance(bias, tuple):
        raise ValueError(
            "pallas_attention: bias must be None or a (BiasFn, params) pair, got an array of "
            f"shape {getattr(bias, 'shape', None)}; the kernel evaluates the bias per tile and "
            "never takes a materialised [N, T, S] one (use implementation='blockwise' or "
            "'chunked' for that)"
        )
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    if (reason := _window_error(window)) is not None:
        raise ValueError(f"pallas_attention: {reason}")
    if log_forget is not None:
        if not causal:
            raise ValueError(
                "pallas_attention: log_forget needs causal=True (forgetting attention adds "
                "c[i] - c[j] for keys j <= i only); got causal=False"
            )
        if tuple(jnp.shape(log_forget)) != (B, S, N):
            raise ValueError(
                f"pallas_attention: log_forget has shape {tuple(jnp.shape(log_forget))}; "
                f"allowed: [B, S, N] = {(B, S, N)} (per key position and query head)"
            )
    if scale is None:
        scale = 1.0 / math.sqrt(H)
    if not isinstance(scale, (int, float, np.number)):
        # A traced scale is folded into q so autodiff outside the custom_vjp carries its
        # gradient; a Python scale stays static inside the kernel.
        q = (q.astype(f32) * scale).astype(q.dtype)
        scale = 1.0

    default_q, default_k = DEFAULT_TILES[backend]
    tq = min(block_q or default_q, max(16, pl.next_power_of_2(T)))
    tk = min(block_k or default_k, max(16, pl.next_power_of_2(S)))
    nq, nk = -(-T // tq), -(-S // tk)
    Tp, Sp = nq * tq, nk * tk
    Hp = max(16, pl.next_power_of_2(H))

    offsets = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (B,))
    if kv_lengths is None:
        kv_len = jnp.full((B,), S, jnp.int32)
    else:
        kv_len = jnp.clip(jnp.asarray(kv_lengths, jnp.int32), 0, S)

    bias_fn, leaves, treedef, n_consts = None, [], None, 0
    if bias is not None:
        # Gathers become one-hot products where the backend cannot lower them.
        bias_fn, leaves, n_consts = _hoist(bias, tq, tk, one_hot_gathers=backend != "interpret")
        treedef = jax.tree.structure(leaves)
    forget = None
    if log_forget is not None:
        # c = cumsum(log f) in float32 (outside the kernels, differentiated by JAX: the gradient
        # of log f is a reverse cumulative sum of the kernels' d c); queries read c at their own
        # positions. Head-major rows (B, N, 1, L) like the log-sum-exp.
        c = jnp.cumsum(jnp.asarray(log_forget).astype(f32), axis=1)  # (B, S, N)
        pos = jnp.clip(offsets[:, None] + jnp.arange(T, dtype=jnp.int32), 0, S - 1)
        c_q = jnp.take_along_axis(c, pos[:, :, None], axis=1)  # (B, T, N)

        def rows(x, L):  # (B, L', N) -> (B, N, 1, L)
            return jnp.pad(x, ((0, 0), (0, L - x.shape[1]), (0, 0))).transpose(0, 2, 1)[:, :, None]

        forget = (rows(c_q, Tp), rows(c, Sp))
    # Floating leaves are differentiated; so are hoisted constants that are traced values (an
    # array the BiasFn closes over, e.g. under jit or grad), whose gradient must not be dropped.
    # True constants (Sandwich's frequencies) ride along undifferentiated, like integer leaves.
    n_params = len(leaves) - n_consts
    is_float = tuple(
        bool(jnp.issubdtype(x.dtype, jnp.inexact)) and (n < n_params or isinstance(x, _TRACER))
        for n, x in enumerate(leaves)
    )
    plan = _Plan(
        N=N,
        G=N // K,
        tq=tq,
        tk=tk,
        nq=nq,
        nk=nk,
        Hp=Hp,
        causal=bool(causal),
        kv_mask=kv_lengths is not None or Sp != S,
        scale=float(scale),
        bias_fn=bias_fn,
        treedef=treedef,
        is_float=is_float,
        leaf_shapes=tuple(tuple(x.shape) for x in leaves),
        backend=backend,
        window=None if window is None else min(int(window), _MAX_WINDOW),
        forget=forget is not None,
        softcap=None if softcap is None else float(softcap),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    floats = [x for x, f in zip(leaves, is_float, strict=True) if f]
    ints = [x for x, f in zip(leaves, is_float, strict=True) if not f]

    def head_major(x, L):  # (B, L', heads, H) -> (B, heads, L, Hp)
        x = jnp.pad(x, ((0, 0), (0, L - x.shape[1]), (0, 0), (0, Hp - H)))
        return x.transpose(0, 2, 1, 3)

    qh, kh, vh = head_major(q, Tp), head_major(k, Sp), head_major(v, Sp)
    out = _flash(plan, qh, kh, vh, floats, ints, offsets, kv_len, forget)  # (B, N, Tp, Hp)
    return out[:, :, :T, :H].transpose(0, 2, 1, 3)


# ----------------------------------------------------------------------------------------------
# The BiasFn, made kernel-ready.


def _hoist(bias, tq, tk, *, one_hot_gathers=False):
    """(fn, leaves, n_consts): the BiasFn traced once at the tile shapes, its closed-over constants
    (e.g. Sandwich's frequencies) hoisted into explicit inputs, since a Pallas kernel may not
    capture arrays. fn(leaves, q_pos, k_pos) -> float[N, tq, tk]; leaves = params leaves (tree
    order) followed by the n_consts constants."""
    user_fn, params = bias
    p_leaves = [jnp.asarray(x) for x in jax.tree.leaves(params)]
    positions = (jax.ShapeDtypeStruct((tq,), jnp.int32), jax.ShapeDtypeStruct((tk,), jnp.int32))
    closed = jax.make_jaxpr(user_fn)(params, *positions)
    consts = [jnp.asarray(c) for c in closed.consts]
    fn = _TracedBias(closed.jaxpr, len(p_leaves), one_hot_gathers)
    return fn, p_leaves + consts, len(consts)


@dataclasses.dataclass(frozen=True, eq=False)
class _TracedBias:
    """Evaluates a BiasFn's jaxpr inside a kernel: (leaves, q_pos, k_pos) -> float[N, t, s].

    The interpreter binds every equation as traced, except that it inlines nested jit calls and
    rewrites a matrix product with a >2-D operand (FIRE's MLP: [t, s, width] @ [width, N]) as a
    2-D one on the flattened tile, because Triton's `dot` takes 2-D operands only.
    """

    jaxpr: Any
    n_params: int
    one_hot_gathers: bool = False

    def __call__(self, leaves, q_pos, k_pos):
        n_in = len(self.jaxpr.invars)
        args = list(leaves[: self.n_params]) + [q_pos, k_pos]
        assert len(args) == n_in, (len(args), n_in)
        return _eval_jaxpr(self.jaxpr, leaves[self.n_params :], args, self.one_hot_gathers)[0]

    def head(self, leaves, h, q_pos, k_pos):
        """float[t, s]: head h (traced) of the bias, computing only what head h needs where the
        jaxpr allows it (`_HeadSlicer`)."""
        args = list(leaves[self.n_params :]) + list(leaves[: self.n_params]) + [q_pos, k_pos]
        slicer = _HeadSlicer(self.jaxpr, args, h, self.one_hot_gathers)
        return slicer.sliced(self.jaxpr.outvars[0], 0)


def _eval_jaxpr(jaxpr, consts, args, one_hot_gathers=False):
    from jax.extend.core import Literal

    env = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for var, x in zip(jaxpr.constvars, consts, strict=True):
        env[var] = x
    for var, x in zip(jaxpr.invars, args, strict=True):
        env[var] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        outvals = _eval_eqn(eqn, invals, one_hot_gathers)
        for var, x in zip(eqn.outvars, outvals, strict=True):
            env[var] = x
    return [read(v) for v in jaxpr.outvars]


def _eval_eqn(eqn, invals, one_hot_gathers):
    """The outputs (a list) of one equation on concrete or traced inputs."""
    if eqn.primitive.name in ("pjit", "jit"):
        inner = eqn.params["jaxpr"]
        return _eval_jaxpr(inner.jaxpr, inner.consts, invals, one_hot_gathers)
    if eqn.primitive is lax.dot_general_p and _needs_2d_dot(eqn, invals):
        return [_dot_as_2d(eqn, *invals)]
    if one_hot_gathers and eqn.primitive is lax.gather_p and _is_take(eqn, invals):
        return [_take_as_one_hot(eqn, *invals)]
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    subfuns = ()
    if isinstance(bind_params, tuple):  # older jax: (subfuns, params)
        subfuns, bind_params = bind_params
    out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return out if eqn.primitive.multiple_results else [out]


_ELEMENTWISE = frozenset(
    "abs add and ceil clamp convert_element_type cos div eq exp exp2 floor ge gt integer_pow le "
    "log log1p logistic lt max min mul ne neg not or pow rem round rsqrt select_n sign sin sqrt "
    "square sub tan tanh".split()
)


class _HeadSlicer:
    """Evaluates `value[..., h, ...]` of a jaxpr's values (h traced, one axis) on demand.

    A program works on one head h, but a BiasFn returns all N. Selecting row h of the output
    would compute N heads per tile; instead the request "axis a at index h" is pushed back through
    the equations that map that axis to one axis of their inputs (elementwise operations,
    broadcasts, reshapes that only add or drop unit axes, transposes, matrix products, sums,
    table takes) down to the small inputs (parameter leaves, constants), where row h is picked by
    a one-hot select: N operations per program, not per logit. Anything else (or an axis mixed
    with others) is computed whole and row h selected from it, which is always correct.
    """

    def __init__(self, jaxpr, args, h, one_hot_gathers, links=None):
        """args: values of constvars + invars; or links: {var: (parent slicer, parent var)}, for
        a nested jaxpr whose inputs the parent computes (whole or sliced) on demand."""
        self.h, self.one_hot_gathers = h, one_hot_gathers
        self.full_env = {}
        if args is not None:
            self.full_env = dict(zip([*jaxpr.constvars, *jaxpr.invars], args, strict=True))
        self.links = links or {}
        self.producer = {v: e for e in jaxpr.eqns for v in e.outvars}
        self.sliced_env = {}

    def full(self, v):
        from jax.extend.core import Literal

        if isinstance(v, Literal):
            return v.val
        if v in self.links:
            parent, outer = self.links[v]
            return parent.full(outer)
        if v not in self.full_env:
            eqn = self.producer[v]
            outs = _eval_eqn(eqn, [self.full(x) for x in eqn.invars], self.one_hot_gathers)
            self.full_env.update(zip(eqn.outvars, outs, strict=True))
        return self.full_env[v]

    def select(self, x, axis):
        """x[..., h, ...] along `axis` by a one-hot reduction (lowers on Triton and Mosaic)."""
        shape = [1] * x.ndim
        shape[axis] = x.shape[axis]
        hit = lax.broadcasted_iota(jnp.int32, tuple(shape), axis) == self.h
        if x.dtype == jnp.bool_:
            return jnp.any(hit & x, axis=axis)
        return jnp.sum(jnp.where(hit, x, jnp.zeros((), x.dtype)), axis=axis).astype(x.dtype)

    def sliced(self, v, axis):
        if v in self.links:
            parent, outer = self.links[v]
            return parent.sliced(outer, axis)
        key = (v, axis)
        if key not in self.sliced_env:
            out = None
            if v in self.producer:
                eqn = self.producer[v]
                rule = getattr(self, "_" + eqn.primitive.name, None)
                if eqn.primitive.name in _ELEMENTWISE:
                    rule = self._elementwise
                if rule is not None and len(eqn.outvars) == 1:
                    out = rule(eqn, axis)
            if out is None:
                out = self.select(self.full(v), axis)
            self.sliced_env[key] = out
        return self.sliced_env[key]

    # Rules: eqn's single output sliced at `axis`, or None (then computed whole).

    def _bind(self, eqn, invals, **params):
        bind_params = eqn.primitive.get_bind_params({**eqn.params, **params})
        if isinstance(bind_params, tuple):
            _, bind_params = bind_params
        return eqn.primitive.bind(*invals, **bind_params)

    def _elementwise(self, eqn, axis):
        n = eqn.outvars[0].aval.shape[axis]
        invals = []
        for x in eqn.invars:
            shape = getattr(x.aval, "shape", ())
            if len(shape) == 0:
                invals.append(self.full(x))
            elif shape[axis] == n and n != 1:
                invals.append(self.sliced(x, axis))
            elif shape[axis] == 1:  # broadcast along the axis: the same for every head
                invals.append(self.full(x).reshape(shape[:axis] + shape[axis + 1 :]))
            else:
                return None
        return self._bind(eqn, invals)

    def _broadcast_in_dim(self, eqn, axis):
        (x,) = eqn.invars
        dims, shape = eqn.params["broadcast_dimensions"], eqn.params["shape"]
        new_shape = shape[:axis] + shape[axis + 1 :]
        if axis in dims:
            d = dims.index(axis)
            if x.aval.shape[d] != shape[axis]:
                val = self.full(x).reshape(x.aval.shape[:d] + x.aval.shape[d + 1 :])  # unit axis
            else:
                val = self.sliced(x, d)
            new_dims = tuple(b - (b > axis) for b in dims if b != axis)
        else:
            val = self.full(x)
            new_dims = tuple(b - (b > axis) for b in dims)
        return lax.broadcast_in_dim(val, new_shape, new_dims)

    def _reshape(self, eqn, axis):
        x = eqn.invars[0]
        if len(eqn.invars) != 1 or eqn.params.get("dimensions") is not None:
            return None
        src, dst = x.aval.shape, eqn.outvars[0].aval.shape
        big_src = [d for d, n in enumerate(src) if n != 1]
        big_dst = [d for d, n in enumerate(dst) if n != 1]
        if [src[d] for d in big_src] != [dst[d] for d in big_dst] or axis not in big_dst:
            return None  # more than unit axes move
        d = big_src[big_dst.index(axis)]
        return self.sliced(x, d).reshape(dst[:axis] + dst[axis + 1 :])

    def _pjit(self, eqn, axis):
        inner = eqn.params["jaxpr"]
        if inner.consts or len(eqn.outvars) != 1:
            return None
        links = {iv: (self, ov) for iv, ov in zip(inner.jaxpr.invars, eqn.invars, strict=True)}
        sub = _HeadSlicer(inner.jaxpr, None, self.h, self.one_hot_gathers, links)
        return sub.sliced(inner.jaxpr.outvars[0], axis)

    _jit = _pjit

    def _transpose(self, eqn, axis):
        perm = eqn.params["permutation"]
        d = perm[axis]
        new_perm = tuple(p - (p > d) for k, p in enumerate(perm) if k != axis)
        return jnp.transpose(self.sliced(eqn.invars[0], d), new_perm)

    def _reduce_sum(self, eqn, axis):
        x = eqn.invars[0]
        axes = tuple(eqn.params["axes"])
        kept = [d for d in range(x.aval.ndim) if d not in axes]
        d = kept[axis]
        return jnp.sum(self.sliced(x, d), axis=tuple(a - (a > d) for a in axes))

    def _dot_general(self, eqn, axis):
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        if lb or rb or len(lc) != 1:
            return None
        lhs, rhs = eqn.invars
        lfree = [d for d in range(lhs.aval.ndim) if d not in lc]
        rfree = [d for d in range(rhs.aval.ndim) if d not in rc]
        if axis < len(lfree):
            d = lfree[axis]
            a, b = self.sliced(lhs, d), self.full(rhs)
            lc = (lc[0] - (lc[0] > d),)
        else:
            d = rfree[axis - len(lfree)]
            a, b = self.full(lhs), self.sliced(rhs, d)
            rc = (rc[0] - (rc[0] > d),)
        if b.ndim == 1 and lc[0] == a.ndim - 1:  # a matrix-vector product: a 2-D dot for Triton
            return jnp.sum(a.astype(f32) * b.astype(f32), axis=-1).astype(eqn.outvars[0].aval.dtype)
        if a.ndim == 1 and b.ndim == 2 and rc[0] == 0:
            out = jnp.sum(a.astype(f32)[:, None] * b.astype(f32), axis=0)
            return out.astype(eqn.outvars[0].aval.dtype)
        return None

    def _gather(self, eqn, axis):
        x, idx = eqn.invars
        dn = eqn.params["dimension_numbers"]
        if not _is_take(eqn, [x.aval, idx.aval]) or axis not in dn.offset_dims:
            return None
        take_axis = dn.start_index_map[0]
        others = [d for d in range(x.aval.ndim) if d != take_axis]
        if len(others) != 1:
            return None  # only [N, n] tables: the head axis is the one offset dim
        d = others[dn.offset_dims.index(axis)]
        row = self.sliced(x, d)  # (n,)
        params = dict(
            dimension_numbers=lax.GatherDimensionNumbers(
                offset_dims=(), collapsed_slice_dims=(0,), start_index_map=(0,)
            ),
            slice_sizes=(1,),
        )
        sub = types.SimpleNamespace(primitive=eqn.primitive, params={**eqn.params, **params})
        ids = self.full(idx)
        if self.one_hot_gathers:
            return _take_as_one_hot(sub, row, ids)
        return self._bind(sub, [row, ids])


def _is_take(eqn, invals):
    """A gather that picks whole slices along one operand axis by one index per output position:
    `jnp.take(x, idx, axis=a)` (T5's `table[:, bucket]`)."""
    dn = eqn.params["dimension_numbers"]
    x, idx = invals
    if len(dn.start_index_map) != 1 or tuple(dn.collapsed_slice_dims) != tuple(dn.start_index_map):
        return False
    if dn.operand_batching_dims or idx.shape[-1] != 1:
        return False
    axis = dn.start_index_map[0]
    full = tuple(1 if d == axis else n for d, n in enumerate(x.shape))
    return tuple(eqn.params["slice_sizes"]) == full


def _take_as_one_hot(eqn, x, idx):
    """The `_is_take` gather as a one-hot matrix product, [prod(batch), n] @ [n, rest] (a one-hot
    select and sum when rest < 16, e.g. one head's row of a table): Triton has no gather and
    Mosaic only take-along-axis ones. Exact (HIGHEST precision, one nonzero term per output);
    out-of-range indices follow the gather's mode."""
    dn = eqn.params["dimension_numbers"]
    axis = dn.start_index_map[0]
    n = x.shape[axis]
    idx = idx[..., 0]
    mode = eqn.params["mode"]
    if mode != lax.GatherScatterMode.FILL_OR_DROP:  # CLIP, and XLA clamps PROMISE_IN_BOUNDS too
        idx = jnp.clip(idx, 0, n - 1)
    rest = jnp.moveaxis(x, axis, 0).reshape(n, -1)  # (n, prod(rest))
    hit = idx.reshape(-1, 1) == lax.broadcasted_iota(jnp.int32, (1, n), 1)  # (prod(batch), n)
    if rest.shape[1] >= 16:  # Triton's dot wants every dimension >= 16
        out = lax.dot_general(
            hit.astype(x.dtype), rest, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST
        ).astype(x.dtype)  # (prod(batch), prod(rest))
    else:  # one head's row of a table: a select and a sum, elementwise
        out = jnp.sum(jnp.where(hit[:, :, None], rest[None], jnp.zeros((), x.dtype)), axis=1)
    rest_shape = tuple(d for a, d in enumerate(x.shape) if a != axis)
    out = out.reshape(*idx.shape, *rest_shape)  # batch dims, then the operand's other dims
    if mode == lax.GatherScatterMode.FILL_OR_DROP:
        fill = eqn.params.get("fill_value")
        if fill is None:
            fill = jnp.nan if jnp.issubdtype(x.dtype, jnp.inexact) else 0
        valid = (idx >= 0) & (idx < n)
        out = jnp.where(valid.reshape(*idx.shape, *(1,) * len(rest_shape)), out, fill)
    # The gather puts the operand's dims at offset_dims and the batch dims in the other places.
    nb, offsets = idx.ndim, tuple(dn.offset_dims)
    batch = iter(range(nb))
    perm = [nb + offsets.index(p) if p in offsets else next(batch) for p in range(out.ndim)]
    return out.transpose(perm)


def _needs_2d_dot(eqn, invals):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    a, b = invals
    return a.ndim > 2 and b.ndim == 2 and not lb and not rb and tuple(lc) == (a.ndim - 1,)


def _dot_as_2d(eqn, a, b):
    """a[..., c] . b (contracting b's dim rc) as a 2-D product on a reshaped to [prod(...), c]."""
    (_, rc), _ = eqn.params["dimension_numbers"]
    out = lax.dot_general(
        a.reshape(-1, a.shape[-1]),
        b,
        (((1,), tuple(rc)), ((), ())),
        precision=eqn.params.get("precision"),
        preferred_element_type=eqn.params.get("preferred_element_type"),
    )
    return out.reshape(*a.shape[:-1], out.shape[-1])


# ----------------------------------------------------------------------------------------------
# Pieces shared by the kernel bodies. Everything here runs inside a kernel, on one tile.


def _dot(a, b, contract):
    """float32 a @ b with contracting dims `contract` = (dim of a, dim of b), no batch dims."""
    return lax.dot_general(
        a, b, ((contract[:1], contract[1:]), ((), ())), preferred_element_type=f32
    )


def _read_params(plan, param_refs):
    """The params pytree, read from the kernel's refs (all leaves) at their original shapes."""
    leaves = [
        ref[...].reshape(shape) for ref, shape in zip(param_refs, plan.leaf_shapes, strict=True)
    ]
    return leaves


def _rebuild(plan, all_leaves, floats):
    it = iter(floats)
    merged = [next(it) if f else x for x, f in zip(all_leaves, plan.is_float, strict=True)]
    return jax.tree.unflatten(plan.treedef, merged)


def _head_bias(plan, params, h, q_pos, k_pos):
    """float32[tq, tk]: head h of BiasFn(params, q_pos, k_pos)."""
    return plan.bias_fn.head(params, h, q_pos, k_pos).astype(f32)


def _visible(plan, q_pos, k_pos, kv_len):
    """bool[tq, tk] (True = visible) or None when nothing can be hidden."""
    mask = None

    def both(a, b):
        return b if a is None else a & b

    if plan.causal:
        mask = k_pos[None, :] <= q_pos[:, None]
    if plan.window is not None:
        d = q_pos[:, None] - k_pos[None, :]
        near = d < plan.window
        if not plan.causal:
            near = near & (d > -plan.window)
        mask = both(mask, near)
    if plan.kv_mask:
        mask = both(mask, jnp.broadcast_to(k_pos[None, :] < kv_len, (plan.tq, plan.tk)))
    return mask


# Tile ranges. A query tile i holds positions off + i tq .. off + i tq + tq - 1, a key tile j
# positions j tk .. j tk + tk - 1 (those below kv_len). Query q sees key k when k <= q (causal),
# q - k < w and, not causal, k - q < w (window w). Each range below is exactly the tiles holding
# at least one visible pair (test_tile_ranges_are_exact), so the work is T x w with a window.


def _ceil_tiles(x, t):
    """ceil(max(x, 0) / t): how many tiles of t hold positions 0 .. x - 1 (lax.div truncates)."""
    return lax.div(jnp.maximum(x, 0) + t - 1, jnp.int32(t))


def _key_tile_start(plan, off, kv_len, i):
    """The first key tile that query tile i (at offset `off`) can see (nk when none can)."""
    if plan.window is None:
        return jnp.int32(0)
    first_k = off + i * plan.tq - (plan.window - 1)  # earliest key the first query sees
    start = jnp.minimum(lax.div(jnp.maximum(first_k, 0), jnp.int32(plan.tk)), plan.nk)
    if plan.kv_mask:
        start = jnp.where(first_k >= kv_len, plan.nk, start)  # every key it could see is past
    return start


def _key_tile_end(plan, off, kv_len, i):
    """One past the last key tile that query tile i (at offset `off`) can see."""
    end = jnp.int32(plan.nk)
    last_q = off + (i + 1) * plan.tq - 1  # latest query position of the tile
    if plan.causal:
        end = jnp.minimum(_ceil_tiles(last_q + 1, plan.tk), plan.nk)
    elif plan.window is not None:
        end = jnp.minimum(_ceil_tiles(last_q + plan.window, plan.tk), plan.nk)
    if plan.kv_mask:
        end = jnp.minimum(end, _ceil_tiles(kv_len, plan.tk))
    return end


def _query_tile_start(plan, off, kv_len, j):
    """The first query tile that can see key tile j (nq when none can)."""
    start = jnp.int32(0)
    first_k = j * plan.tk
    first_q = None  # earliest query position that sees the tile's first key
    if plan.causal:
        first_q = first_k
    elif plan.window is not None:
        first_q = first_k - (plan.window - 1)
    if first_q is not None:
        start = jnp.minimum(lax.div(jnp.maximum(first_q - off, 0), jnp.int32(plan.tq)), plan.nq)
    if plan.kv_mask:
        start = jnp.where(first_k >= kv_len, plan.nq, start)
    return start


def _query_tile_end(plan, off, kv_len, j):
    """One past the last query tile that can see key tile j."""
    if plan.window is None:
        return jnp.int32(plan.nq)
    last_k = (j + 1) * plan.tk - 1
    if plan.kv_mask:
        last_k = jnp.minimum(last_k, kv_len - 1)  # the tile's last key that exists
    last_q = last_k + plan.window - 1  # latest query position that sees it
    return jnp.minimum(_ceil_tiles(last_q - off + 1, plan.tq), plan.nq)


def _positions(plan, off, i, j):
    q_pos = off + i * plan.tq + lax.broadcasted_iota(jnp.int32, (plan.tq,), 0)
    k_pos = j * plan.tk + lax.broadcasted_iota(jnp.int32, (plan.tk,), 0)
    return q_pos, k_pos


def _split(plan, refs):
    """(forget refs: (c_q, c_k) or None, param refs, the rest) of a kernel's trailing refs."""
    nf = 2 if plan.forget else 0
    forget = tuple(refs[:nf]) if nf else None
    return forget, refs[nf : nf + plan.n_leaves], refs[nf + plan.n_leaves :]


# ----------------------------------------------------------------------------------------------
# Kernel bodies. Inputs after q, k, v (and dO, lse, delta in the backward): the cumulative log
# forget gates of the queries (1, tq or Tp) and keys (1, Sp or tk) when plan.forget, then the
# bias parameter leaves; then the outputs.


def _content(plan, qk):
    """(the content logits scale q.k of a tile, soft-capped as c tanh(. / c) with the plan's cap,
    and the cap's slope 1 - tanh^2, None without one)."""
    s = qk * plan.scale
    if plan.softcap is None:
        return s, None
    t = jnp.tanh(s / plan.softcap)
    return plan.softcap * t, 1.0 - t * t


def _forward_kernel(plan, off_ref, len_ref, q_ref, k_ref, v_ref, *refs):
    forget, param_refs, (o_ref, lse_ref) = _split(plan, refs)
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    off, kv_len = off_ref[b], len_ref[b]
    params = None
    if plan.bias_fn is not None:
        leaves = _read_params(plan, param_refs)
        params = jax.tree.unflatten(plan.treedef, leaves)
    q = q_ref[...]  # (tq, Hp)
    c_q = None if forget is None else forget[0][0, :]  # (tq,)

    def body(j, carry):
        m, l_sum, acc = carry
        ks = pl.ds(pl.multiple_of(j * plan.tk, plan.tk), plan.tk)
        k, v = k_ref[ks, :], v_ref[ks, :]  # (tk, Hp)
        s, _ = _content(plan, _dot(q, k, (1, 1)))  # (tq, tk)
        q_pos, k_pos = _positions(plan, off, i, j)
        if params is not None:
            s = s + _head_bias(plan, params, h, q_pos, k_pos)
        if forget is not None:
            s = s + (c_q[:, None] - forget[1][0, ks][None, :])
        mask = _visible(plan, q_pos, k_pos, kv_len)
        if mask is not None:
            s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # all hidden so far: keep 0s
        p = jnp.exp(s - m_safe[:, None])
        alpha = jnp.exp(m - m_safe)
        l_sum = alpha * l_sum + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v, (1, 0))
        return m_new, l_sum, acc

    init = (
        jnp.full((plan.tq,), -jnp.inf, f32),
        jnp.zeros((plan.tq,), f32),
        jnp.zeros((plan.tq, plan.Hp), f32),
    )
    start = _key_tile_start(plan, off, kv_len, i)
    m, l_sum, acc = lax.fori_loop(start, _key_tile_end(plan, off, kv_len, i), body, init)
    seen = l_sum > 0.0
    l_safe = jnp.where(seen, l_sum, 1.0)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)  # a row that saw nothing stays 0
    lse_ref[0, :] = jnp.where(seen, m + jnp.log(l_safe), jnp.inf)


def _dkdv_kernel(plan, off_ref, len_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs):
    forget, param_refs, outs = _split(plan, refs)
    (dk_ref, dv_ref), outs = outs[:2], outs[2:]
    dck_ref, dparam_refs = (outs[0], outs[1:]) if forget is not None else (None, outs)
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    off, kv_len = off_ref[b], len_ref[b]
    k, v = k_ref[...], v_ref[...]  # (tk, Hp)
    c_k = None if forget is None else forget[1][0, :]  # (tk,)
    leaves = floats = None
    if plan.bias_fn is not None:
        leaves = _read_params(plan, param_refs)
        floats = [x for x, f in zip(leaves, plan.is_float, strict=True) if f]

    def body(i, carry):
        dk, dv, dc_k, d_floats = carry
        qs = pl.ds(pl.multiple_of(i * plan.tq, plan.tq), plan.tq)
        q, do = q_ref[qs, :], do_ref[qs, :]  # (tq, Hp)
        lse, delta = lse_ref[0, qs], delta_ref[0, qs]  # (tq,)
        s, slope = _content(plan, _dot(q, k, (1, 1)))
        q_pos, k_pos = _positions(plan, off, i, j)
        pull = None
        if plan.bias_fn is not None:
            bias_h, pull = jax.vjp(
                lambda fl: _head_bias(plan, _rebuild(plan, leaves, fl), h, q_pos, k_pos), floats
            )
            s = s + bias_h
        if forget is not None:
            s = s + (forget[0][0, qs][:, None] - c_k[None, :])
        mask = _visible(plan, q_pos, k_pos, kv_len)
        if mask is not None:
            s = jnp.where(mask, s, -jnp.inf)
        p = jnp.exp(s - lse[:, None])  # hidden keys and empty rows (lse = inf) give exactly 0
        dv = dv + _dot(p.astype(do.dtype), do, (0, 0))  # (tk, Hp)
        dp = _dot(do, v, (1, 1))  # (tq, tk)
        ds = p * (dp - delta[:, None])  # d loss / d logits
        ds_qk = ds if slope is None else ds * slope  # through the cap to scale q.k
        dk = dk + plan.scale * _dot(ds_qk.astype(q.dtype), q, (0, 0))
        if forget is not None:
            dc_k = dc_k - jnp.sum(ds, axis=0)  # logit (i, j) has -c_k[j]
        if pull is not None:
            d_floats = [a + g.astype(f32) for a, g in zip(d_floats, pull(ds)[0], strict=True)]
        return dk, dv, dc_k, d_floats

    zeros = jnp.zeros((plan.tk, plan.Hp), f32)
    d_floats = [] if floats is None else [jnp.zeros(x.shape, f32) for x in floats]
    start = _query_tile_start(plan, off, kv_len, j)
    end = _query_tile_end(plan, off, kv_len, j)
    init = (zeros, zeros, jnp.zeros((plan.tk,), f32), d_floats)
    dk, dv, dc_k, d_floats = lax.fori_loop(start, end, body, init)
    dk_ref[...] = dk
    dv_ref[...] = dv
    if dck_ref is not None:
        dck_ref[0, :] = dc_k
    for ref, g in zip(dparam_refs, d_floats, strict=True):
        ref[...] = g.reshape(ref.shape)


def _dq_kernel(plan, off_ref, len_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs):
    forget, param_refs, outs = _split(plan, refs)
    dq_ref = outs[0]
    dcq_ref = outs[1] if forget is not None else None
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    off, kv_len = off_ref[b], len_ref[b]
    params = None
    if plan.bias_fn is not None:
        params = jax.tree.unflatten(plan.treedef, _read_params(plan, param_refs))
    q, do = q_ref[...], do_ref[...]  # (tq, Hp)
    lse, delta = lse_ref[0, :], delta_ref[0, :]  # (tq,)
    c_q = None if forget is None else forget[0][0, :]  # (tq,)

    def body(j, carry):
        dq, dc_q = carry
        ks = pl.ds(pl.multiple_of(j * plan.tk, plan.tk), plan.tk)
        k, v = k_ref[ks, :], v_ref[ks, :]
        s, slope = _content(plan, _dot(q, k, (1, 1)))
        q_pos, k_pos = _positions(plan, off, i, j)
        if params is not None:
            s = s + _head_bias(plan, params, h, q_pos, k_pos)
        if forget is not None:
            s = s + (c_q[:, None] - forget[1][0, ks][None, :])
        mask = _visible(plan, q_pos, k_pos, kv_len)
        if mask is not None:
            s = jnp.where(mask, s, -jnp.inf)
        p = jnp.exp(s - lse[:, None])
        ds = p * (_dot(do, v, (1, 1)) - delta[:, None])
        if forget is not None:
            dc_q = dc_q + jnp.sum(ds, axis=1)  # logit (i, j) has +c_q[i]
        ds_qk = ds if slope is None else ds * slope  # through the cap to scale q.k
        return dq + plan.scale * _dot(ds_qk.astype(k.dtype), k, (1, 0)), dc_q

    start = _key_tile_start(plan, off, kv_len, i)
    end = _key_tile_end(plan, off, kv_len, i)
    init = (jnp.zeros((plan.tq, plan.Hp), f32), jnp.zeros((plan.tq,), f32))
    dq, dc_q = lax.fori_loop(start, end, body, init)
    dq_ref[...] = dq
    if dcq_ref is not None:
        dcq_ref[0, :] = dc_q


# ----------------------------------------------------------------------------------------------
# pallas_call wiring.


def _compiler_params(plan):
    match plan.backend:
        case "gpu":
            from jax.experimental.pallas import triton as plgpu

            warps = plan.num_warps or (4 if plan.Hp <= 64 else 8)
            return plgpu.CompilerParams(num_warps=warps, num_stages=plan.num_stages or 2)
        case "tpu":
            from jax.experimental.pallas import tpu as pltpu

            return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel"))
    return None


def _scalar_spec(plan):
    """Whole int32[B] arrays read at [b]: in SMEM on TPU (scalar reads), plain refs elsewhere."""
    if plan.backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.BlockSpec()


def _whole(x):
    """A BlockSpec holding all of x (a bias parameter leaf, >= 1-D) in every program."""
    nd = x.ndim
    return pl.BlockSpec(x.shape, lambda *_: (0,) * nd)


def _call(plan, kernel, grid, in_specs, out_specs, out_shape, args, name):
    return pl.pallas_call(
        partial(kernel, plan),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=plan.backend == "interpret",
        compiler_params=_compiler_params(plan),
        name=name,
    )(*args)


def _kernel_leaves(ints, floats, plan):
    """All params leaves in tree order, at least 1-D (Triton and Mosaic refs have a shape)."""
    fi, ii = iter(floats), iter(ints)
    leaves = [next(fi) if f else next(ii) for f in plan.is_float]
    return [x.reshape(x.shape or (1,)) for x in leaves]


def _specs(plan):
    """Block specs over head-major arrays, for grids (b, h, tile)."""
    tq, tk, Hp, G = plan.tq, plan.tk, plan.Hp, plan.G
    return dict(
        q_tile=pl.BlockSpec((None, None, tq, Hp), lambda b, h, i: (b, h, i, 0)),
        q_all=pl.BlockSpec((None, None, plan.nq * tq, Hp), lambda b, h, j: (b, h, 0, 0)),
        kv_tile=pl.BlockSpec((None, None, tk, Hp), lambda b, h, j: (b, lax.div(h, G), j, 0)),
        kv_all=pl.BlockSpec(
            (None, None, plan.nk * tk, Hp), lambda b, h, i: (b, lax.div(h, G), 0, 0)
        ),
        row_tile=pl.BlockSpec((None, None, 1, tq), lambda b, h, i: (b, h, 0, i)),
        row_all=pl.BlockSpec((None, None, 1, plan.nq * tq), lambda b, h, j: (b, h, 0, 0)),
        key_out=pl.BlockSpec((None, None, tk, Hp), lambda b, h, j: (b, h, j, 0)),
        # Per query head, over key positions (the keys' cumulative log forget gates, FoX).
        key_row_tile=pl.BlockSpec((None, None, 1, tk), lambda b, h, j: (b, h, 0, j)),
        key_row_all=pl.BlockSpec((None, None, 1, plan.nk * tk), lambda b, h, i: (b, h, 0, 0)),
    )


def _forward(plan, qh, kh, vh, floats, ints, offsets, kv_len, forget):
    """out (B, N, Tp, Hp) in q's dtype, lse float32 (B, N, 1, Tp)."""
    B, N, Tp, Hp = qh.shape
    leaves = _kernel_leaves(ints, floats, plan)
    sp = _specs(plan)
    scalar = _scalar_spec(plan)
    forget = () if forget is None else tuple(forget)
    forget_specs = [sp["row_tile"], sp["key_row_all"]] if forget else []
    return _call(
        plan,
        _forward_kernel,
        (B, N, plan.nq),
        [scalar, scalar, sp["q_tile"], sp["kv_all"], sp["kv_all"], *forget_specs]
        + list(map(_whole, leaves)),
        [sp["q_tile"], sp["row_tile"]],
        [jax.ShapeDtypeStruct(qh.shape, qh.dtype), jax.ShapeDtypeStruct((B, N, 1, Tp), f32)],
        (offsets, kv_len, qh, kh, vh, *forget, *leaves),
        "posattn_flash_forward",
    )


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(plan, qh, kh, vh, floats, ints, offsets, kv_len, forget):
    """forget: None or (c_q float32 (B, N, 1, Tp), c_k float32 (B, N, 1, Sp)), differentiated."""
    return _forward(plan, qh, kh, vh, floats, ints, offsets, kv_len, forget)[0]


def _flash_fwd(plan, qh, kh, vh, floats, ints, offsets, kv_len, forget):
    out, lse = _forward(plan, qh, kh, vh, floats, ints, offsets, kv_len, forget)
    return out, (qh, kh, vh, floats, ints, offsets, kv_len, forget, out, lse)


def _flash_bwd(plan, res, d_out):
    qh, kh, vh, floats, ints, offsets, kv_len, forget, out, lse = res
    B, N, Tp, Hp = qh.shape
    K, Sp = kh.shape[1], kh.shape[2]
    d_out = d_out.astype(qh.dtype)
    # D_i = rowsum(dO * O), the softmax-Jacobian term of every tile in row i.
    delta = jnp.sum(d_out.astype(f32) * out.astype(f32), axis=-1)[:, :, None]  # (B, N, 1, Tp)
    leaves = _kernel_leaves(ints, floats, plan)
    float_kernel_leaves = [x for x, f in zip(leaves, plan.is_float, strict=True) if f]
    sp = _specs(plan)
    scalar = _scalar_spec(plan)
    c_args = () if forget is None else tuple(forget)
    args = (offsets, kv_len, qh, kh, vh, d_out, lse, delta, *c_args, *leaves)
    # The logits' gradient dS gives d c_q = rowsum(dS) (dQ kernel) and d c_k = -colsum(dS) (dK/dV).
    c_row = [jax.ShapeDtypeStruct((B, N, 1, Tp), f32)] if c_args else []
    c_key = [jax.ShapeDtypeStruct((B, N, 1, Sp), f32)] if c_args else []

    # Per-program parameter partials, each leaf flattened to a (1, size) block: the block's last
    # two dimensions are then the array's (as Mosaic requires).
    partial_specs = [
        pl.BlockSpec((None, None, None, 1, x.size), lambda b, h, j: (b, h, j, 0, 0))
        for x in float_kernel_leaves
    ]
    dk, dv, *rest = _call(
        plan,
        _dkdv_kernel,
        (B, N, plan.nk),
        [scalar, scalar, sp["q_all"], sp["kv_tile"], sp["kv_tile"], sp["q_all"], sp["row_all"]]
        + [sp["row_all"]]
        + ([sp["row_all"], sp["key_row_tile"]] if c_args else [])
        + list(map(_whole, leaves)),
        [sp["key_out"], sp["key_out"]] + ([sp["key_row_tile"]] if c_args else []) + partial_specs,
        [jax.ShapeDtypeStruct((B, N, Sp, Hp), f32)] * 2
        + c_key
        + [jax.ShapeDtypeStruct((B, N, plan.nk, 1, x.size), f32) for x in float_kernel_leaves],
        args,
        "posattn_flash_dkdv",
    )
    dc_k, d_partials = (rest[0], rest[1:]) if c_args else (None, rest)
    dq, *dc_q = _call(
        plan,
        _dq_kernel,
        (B, N, plan.nq),
        [scalar, scalar, sp["q_tile"], sp["kv_all"], sp["kv_all"], sp["q_tile"], sp["row_tile"]]
        + [sp["row_tile"]]
        + ([sp["row_tile"], sp["key_row_all"]] if c_args else [])
        + list(map(_whole, leaves)),
        [sp["q_tile"]] + ([sp["row_tile"]] if c_args else []),
        [jax.ShapeDtypeStruct((B, N, Tp, Hp), f32)] + c_row,
        args,
        "posattn_flash_dq",
    )
    # Sum each key/value head's G query heads, and the per-program parameter partials.
    dk = dk.reshape(B, K, plan.G, Sp, Hp).sum(axis=2)
    dv = dv.reshape(B, K, plan.G, Sp, Hp).sum(axis=2)
    d_floats = [
        jnp.sum(g, axis=(0, 1, 2, 3)).reshape(x.shape).astype(x.dtype)
        for g, x in zip(d_partials, floats, strict=True)
    ]
    return (
        dq.astype(qh.dtype),
        dk.astype(kh.dtype),
        dv.astype(vh.dtype),
        d_floats,
        [None] * len(ints),
        None,
        None,
        None if forget is None else (dc_q[0], dc_k),
    )


_flash.defvjp(_flash_fwd, _flash_bwd)
