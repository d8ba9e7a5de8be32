"""Flax NNX layers: they own parameters and call the pure functions, nothing more.

Shape legend: B batch, T query length, S key length, D d_model, N query heads, K key/value heads,
H head dim, F feed-forward width, V vocabulary.

The attention layer is handed what the family registry says to do: rotate q/k (a `Rotary`),
hand a `(BiasFn, params)` pair to the attention core (a `PositionBias`: T5, ALiBi, Kerple, Sandwich,
FIRE), or nothing (NoPE and the absolute families, whose embedding the model adds at the input). It
never branches on a name. Layers take plain arguments (sizes, dtypes) or their own small settings
object (`Rotary` a `families.RopeSettings`, `PositionBias` a family's settings), never the model's
whole config: `TransformerLM` is what reads a `ModelConfig`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posattn import attention as attention_lib
from posattn import families, rotary
from posattn.attention import native, partition
from posattn.nn import config as model_config
from posattn.nn import window as window_lib

__all__ = [
    "ACTIVATIONS",
    "Arch",
    "Attention",
    "Block",
    "Constant",
    "Mlp",
    "Norm",
    "PositionBias",
    "RMSNorm",
    "Rotary",
    "compute_dtype",
    "dense",
    "make_norm",
    "token_positions",
    "write_rows",
]


class Constant(nnx.Variable):
    """A fixed array that belongs to the model but is not trained (RoPE frequencies, ALiBi slopes).

    Kept as state rather than a Python constant so that a vmap sweep can stack different values
    (RoPE bases, slope scales) on a leading axis and run them as one program.
    """


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype=jnp.float32) -> jax.Array:
    # Drawn in float32 whatever `dtype`: a bfloat16 model starts from the float32 model, rounded.
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x[..., D] @ w[D, ...] as one 2-D matrix product: [..., D] x [D, F...] -> [..., F...].

    Why 2-D: XLA:CPU sends plain 2-D dots to its fast GEMM kernels, while the dot_generals of a
    batched einsum (and their transposes in the backward) took a slower path: a 2-layer d_model-64
    training step ran 3x faster (benchmarks/train_throughput.py). Accelerators are indifferent.
    """
    lead, out = x.shape[:-1], w.shape[1:]
    y = _matmul(x.reshape(-1, x.shape[-1]), w.reshape(w.shape[0], -1))  # (prod(lead), prod(out))
    return y.reshape(*lead, *out)


_TN = (((0,), (0,)), ((), ()))  # contract the rows of both operands: a^T b

# A stick-breaking or CoPE layer reads its queries in blocks of this many once longer (its
# weights are materialised, [B, N, block, S] at a time): training lengths in one block, 16L in a
# few.
ROWWISE_QUERY_CHUNK = 256


def _path_chunk(length: int) -> int:
    """The chunk a PaTH layer computes `path_attention` in for `length` keys: 32 up to 256, the
    reference kernel's 64 past it. Measured at the length experiment's head shape (4 heads of 16)
    on one core of a Zen 3 (docs/attention.md, "PaTH"): chunks of 32 took 23% less forward +
    backward at T 64 and 14% less at T 256, 6% more at T 1024."""
    return 32 if length <= 256 else 64


@jax.custom_vjp
def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x[M, A] @ w[A, B], whose weight gradient x^T dy is computed wide; on CPU the native
    library's products.

    The product itself and the input gradient dy w^T are, in float32 on one CPU device with
    AVX-512, at least NATIVE_PRODUCT_MIN_ROWS rows and at most NATIVE_PRODUCT_MAX_DEPTH terms,
    the library's `posattn.attention.native.product`: each element one FMA a term in order, the
    same bits for any thread count or vector width, and at the training shapes on the AMX Xeon
    of docs/benchmarks.md the same bits as XLA's own product, in less time ("The dense products
    as the library's"). Otherwise they are XLA's.

    XLA:CPU runs a weight gradient (a product contracting the M rows of both operands) with Eigen,
    which was up to 1.84x as slow when the result has more rows than columns: on a Zen 4 core,
    x^T dy of [4096, 512] x [4096, 128] took 10.3 ms (median) and the same product transposed,
    dy^T x [128, 512], 5.6 ms (docs/benchmarks.md, "The weight gradients' orientation"). So for
    A > B the backward computes dy^T x and transposes it. In float32 on one CPU device, where the
    native library built, that product is `posattn.attention.native.weight_gradient` (sums in
    chunks of 128 rows, the same bits for any thread count or vector width; faster than Eigen's
    at the training shapes: docs/benchmarks.md, "The weight gradients as the library's
    product"); each element is then the same dot product as JAX's, summed in another order,
    within its rounding bound (tests/nn/test_layers.py). Otherwise it is XLA's, behind an
    optimization barrier that keeps XLA from folding the transpose back into the product (and,
    where the caller transposes the gradient itself, as the tied output layer's `table.T` does,
    from folding that one in): JAX's own gradients, the same bits on a Zen 4 (on an AVX2 core a
    square product's last columns can round differently, as JAX's own gradient does there between
    a jitted and an eager program). On other backends the backward is JAX's own.
    """
    return _product(x, w)


# The native library's x @ w runs where it was measured to pay (docs/benchmarks.md, "The dense
# products as the library's"): on a CPU with AVX-512 (`native.wide_vectors`; not measured with
# AVX2's 8-float vectors, where XLA's product stays), with at least this many rows (it packs w once
# a call, which fewer rows would not amortise: a decoding step's are XLA's) and at most this many
# terms a dot product (its tiles read a [K, 64] stripe of w for every 6 rows, kept in the L2 up to
# here).
NATIVE_PRODUCT_MIN_ROWS = 256
NATIVE_PRODUCT_MAX_DEPTH = 1024


def _product(x: jax.Array, w: jax.Array, transposed: bool = False) -> jax.Array:
    """x @ w (x @ w.T when transposed, w [N, K]): the native library's product on CPU for float32
    operands on one device at the shapes it was measured at, else XLA's."""
    rows, depth = x.shape
    if (
        jax.default_backend() == "cpu"
        and rows >= NATIVE_PRODUCT_MIN_ROWS
        and depth <= NATIVE_PRODUCT_MAX_DEPTH
        and _native_product(x, w)
        and native.wide_vectors()
    ):
        return native.product(x, w, transposed=transposed)
    return x @ (w.T if transposed else w)


def _matmul_fwd(x, w):
    return _product(x, w), (x, w)


def _native_product(a: jax.Array, b: jax.Array) -> bool:
    """Whether a product of a and b may run as the native library's: float32 operands on one
    CPU device (a mesh of several devices splits the rows, which an FFI call cannot follow), the
    library built (`posattn.attention.native.available`)."""
    if a.dtype != jnp.float32 or b.dtype != jnp.float32:
        return False
    mesh = partition.mesh_of(a)
    return (mesh is None or mesh.size == 1) and native.available()


def _matmul_bwd(residuals, dy):
    x, w = residuals
    dx = _product(dy, w, transposed=True)
    if jax.default_backend() != "cpu":  # measured on XLA:CPU only: elsewhere JAX's own product
        return dx, jax.lax.dot_general(x, dy, _TN).astype(w.dtype)
    tall = w.shape[0] > w.shape[1]
    a, b = (dy, x) if tall else (x, dy)  # the product whose result is wide: a^T b
    if _native_product(x, dy):
        dw = native.weight_gradient(a, b)
    else:
        dw = jax.lax.optimization_barrier(jax.lax.dot_general(a, b, _TN))
    return dx, (dw.T if tall else dw).astype(w.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def compute_dtype(name: str):
    """The jnp dtype of `model.dtype` ("float32" or "bfloat16")."""
    return jnp.bfloat16 if name == "bfloat16" else jnp.float32


class RMSNorm(nnx.Module):
    """Root-mean-square normalisation, computed in float32, output in `dtype`."""

    def __init__(self, dim: int, *, dtype=jnp.float32, param_dtype=jnp.float32, eps: float = 1e-6):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.dtype, self.eps = dtype, eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * self.scale[...].astype(jnp.float32)).astype(self.dtype)


# The MLP's activations by name (Hugging Face's `hidden_act` names map onto these in posattn.hf).
ACTIVATIONS = {
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
}
assert tuple(ACTIVATIONS) == model_config.ACTIVATIONS


@dataclasses.dataclass(frozen=True)
class Arch:
    """A block's architecture switches; the defaults are posattn's own block (docs/checkpoints.md).

    norm: "rms" (RMSNorm) or "layer" (LayerNorm); norm_eps its epsilon; norm_bias a learned
    LayerNorm bias; norm_unit_offset scales by 1 + w (Gemma) with w starting at 0.
    mlp: "plain" act(x W1) W2 or "gated" (act(x W1) * x W3) W2; activation: a key of ACTIVATIONS.
    bias: linear-layer biases, "none", "qkv" (the q/k/v projections), "attn" (the attention's
      four, Llama's attention_bias) or "all" (every projection).
    parallel_residual: x + attn(norm1(x)) + mlp(norm2(x)) (GPT-NeoX) instead of two residual steps.
    post_norms: a norm on each branch's output before it is added (Gemma 2 and 3's
      post_attention_layernorm and post_feedforward_layernorm).
    qk_norm: a norm over each head's query and key (H wide) after the projection, before RoPE
      (Gemma 3's and Qwen3's q_norm, k_norm).
    query_pre_attn_scalar: logits scaled by its -1/2 power instead of H's (Gemma); 0: H.
    attn_logit_softcap: c > 0 caps each content logit as c tanh(s / c) before the position bias
      and mask (Gemma 2's attn_logit_softcapping); 0: no cap.
    """

    norm: str = "rms"
    norm_eps: float = 1e-6
    norm_bias: bool = False
    norm_unit_offset: bool = False
    mlp: str = "plain"
    activation: str = "gelu_tanh"
    bias: str = "none"
    parallel_residual: bool = False
    post_norms: bool = False
    qk_norm: bool = False
    query_pre_attn_scalar: float = 0.0
    attn_logit_softcap: float = 0.0


class Norm(nnx.Module):
    """RMSNorm or LayerNorm (optional bias, optional 1 + w scale), in float32, output in `dtype`."""

    def __init__(self, dim: int, arch: Arch, *, dtype=jnp.float32, param_dtype=jnp.float32):
        init = jnp.zeros if arch.norm_unit_offset else jnp.ones
        self.scale = nnx.Param(init((dim,), param_dtype))
        if arch.norm_bias:
            self.bias = nnx.Param(jnp.zeros((dim,), param_dtype))
        self.kind, self.eps, self.unit_offset = arch.norm, arch.norm_eps, arch.norm_unit_offset
        self.has_bias, self.dtype = arch.norm_bias, dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(jnp.float32)
        if self.kind == "layer":
            x = x - jnp.mean(x, axis=-1, keepdims=True)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        w = self.scale[...].astype(jnp.float32)
        x = x * (1.0 + w if self.unit_offset else w)
        if self.has_bias:
            x = x + self.bias[...].astype(jnp.float32)
        return x.astype(self.dtype)


def make_norm(dim: int, arch: Arch, *, dtype=jnp.float32, param_dtype=jnp.float32) -> nnx.Module:
    """posattn's own RMSNorm for the default switches (its parameter paths), else a `Norm`."""
    if arch.norm == "rms" and not (arch.norm_bias or arch.norm_unit_offset):
        return RMSNorm(dim, dtype=dtype, param_dtype=param_dtype, eps=arch.norm_eps)
    return Norm(dim, arch, dtype=dtype, param_dtype=param_dtype)


def _bias(x: jax.Array, module: nnx.Module, name: str, dtype) -> jax.Array:
    """x plus the module's bias `name` when it has one.

    Biases are stored flat ([N * H] for a projection to [..., N, H]), so that they are vectors to
    the optimiser (no weight decay, as norms' scales).
    """
    b = getattr(module, name, None)
    if b is None:
        return x
    b = b[...].astype(dtype)
    return x + (b.reshape(x.shape[-2:]) if x.ndim == 4 else b)


class PositionBias(nnx.Module):
    """Owns a bias family's values and hands the attention core its `(BiasFn, params)` pair.

    Args:
      spec: the family's `BiasSpec`.
      ctx: what the family reads of the model (heads, head dim, direction, init scale).
      settings: the family's own settings (`families.T5Settings`, ...).
    """

    def __init__(
        self,
        spec: families.BiasSpec,
        ctx: families.Context,
        settings: families.Settings,
        *,
        rngs: nnx.Rngs,
    ):
        variable = nnx.Param if spec.trainable else Constant
        values = spec.init(rngs.params(), ctx, settings)
        self.values = nnx.Dict(
            {
                name: variable(value, bounds=spec.bounds[name])
                if name in spec.bounds
                else variable(value)
                for name, value in values.items()
            }
        )
        self.fn = spec.bind(ctx, settings)

    def __call__(self) -> tuple[families.BiasFn, dict[str, jax.Array]]:
        return self.fn, {name: value[...] for name, value in self.values.items()}


class Rotary(nnx.Module):
    """RoPE frequencies for the whole model (one instance, shared by every attention layer).

    Args:
      head_dim: H, the size of one attention head (even).
      settings: the base, Hugging Face scaling and pair layout (`families.RopeSettings`).
    """

    def __init__(self, head_dim: int, settings: families.RopeSettings):
        scaling = settings.rope_parameters  # rope_scaling with the partial / proportional factor
        inv_freq, factor = rotary.rope_frequencies(head_dim, base=settings.base, scaling=scaling)
        self.inv_freq = Constant(jnp.asarray(inv_freq, jnp.float32))
        self.attention_factor = float(factor)
        # The scaling is kept as a tuple of items (hashable, so graphdefs can key jit caches).
        self.head_dim, self.base, self.scaling, self.layout = (
            head_dim,
            settings.base,
            None if scaling is None else tuple(sorted(scaling.items())),
            settings.layout,
        )
        # Frequencies that follow the current length (dynamic NTK, LongRoPE).
        self.dynamic = rotary.rope_kind(scaling) in rotary.LENGTH_DEPENDENT
        # An eval-time remap of the far pairs (ReRoPE, SelfExtend), items (hashable) or None.
        self.remap = settings.remap

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        *,
        seq_len: jax.Array | int,
        frequency_scale: float = 1.0,
    ) -> jax.Array:
        """Rotates x[..., T, N, H] at `positions` ([T] or [B, T]).

        `seq_len` (int, or int[B] for x[B, T, N, H]: one length per sequence) feeds dynamic NTK
        only:
        each sequence's base comes from its own current length, so a padded row or a row of a KV
        cache is rotated exactly as if it were alone at that length. `frequency_scale` (static)
        multiplies the frequencies (Leaky ReRoPE's far rotation: `rotary.remap_frequency_scale`).
        """
        if self.dynamic and jnp.ndim(seq_len) == 1:
            positions = jnp.broadcast_to(positions, x.shape[:-2])  # (B, T)

            def one(xb, pb, lb):  # a sequence at its own length
                return self(xb[None], pb, seq_len=lb, frequency_scale=frequency_scale)[0]

            return jax.vmap(one)(x, positions, seq_len)
        inv_freq = self.inv_freq[...]
        if self.dynamic:
            # Dynamic NTK recomputes the base from the current length (Hugging Face
            # `_compute_dynamic_ntk_parameters`); LongRoPE picks its long factors past m_l.
            inv_freq, _ = rotary.rope_frequencies(
                self.head_dim, base=self.base, scaling=dict(self.scaling), seq_len=seq_len
            )
        if frequency_scale != 1.0:
            inv_freq = inv_freq * frequency_scale
        return rotary.apply_rope(
            x, positions, inv_freq, layout=self.layout, attention_factor=self.attention_factor
        )

    @property
    def remap_window(self) -> int:
        """The remap's window (static): pairs at distance >= window take the far rotations."""
        return int(dict(self.remap)["window"])

    def remap_far(self, positions: jax.Array, k_pos: jax.Array):
        """(far query positions, far key positions, frequency scale, query scale or None) of the
        eval-time remap at query `positions` and key positions `k_pos` (`rotary.remap_*`)."""
        remap = dict(self.remap)
        far_q, far_k = rotary.remap_positions(remap, positions, k_pos)
        scale = rotary.remap_query_scale(remap, positions)
        return far_q, far_k, rotary.remap_frequency_scale(remap), scale


class Attention(nnx.Module):
    """Multi-head / grouped-query self-attention with the model's position family.

    Args:
      d_model, num_heads, num_kv_heads: D, N and K (K divides N).
      head_dim: H (None: D / N).
      arch: the architecture switches (`Arch`: biases here).
      num_layers: the depth of the stack (the output projection's init std shrinks with it).
      causal: decoder (True) or bidirectional encoder (False).
      scale_free: logits without 1/sqrt(H), carried by the query initialiser instead (T5).
      init_scale: multiplies the std of every weight initialiser.
      implementation: the `posattn.attention` implementation.
      dtype: the compute dtype.
      param_dtype: the storage dtype of the projections (`compute_dtype(model.param_dtype)`).
      owns_kv: False for a layer that reads the keys/values of a lower layer (cross-layer KV
        sharing); it then has no key/value projections.
      rotary_module: the model's shared `Rotary` (RoPE families) or None.
      bias_module: this layer's (or the model's shared) `PositionBias`, or None.

    A layer of a scanned stack (`model.scan_layers`) holds neither shared module: it cannot
    reference a module outside its own slice of the stack. The model then hands them to each call
    as `shared=(rotary, bias)`, each used where the layer's own is None.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        num_layers: int,
        causal: bool,
        scale_free: bool,
        init_scale: float,
        implementation: str,
        dtype,
        param_dtype=jnp.float32,
        owns_kv: bool,
        rotary_module: Rotary | None,
        bias_module: PositionBias | None,
        rngs: nnx.Rngs,
        window: int | None = None,
        temperature: nnx.Module | None = None,
        forget: nnx.Module | None = None,
        stick_breaking: attention_lib.StickBreaking | None = None,
        cope: nnx.Module | None = None,
        path: nnx.Module | None = None,
        head_dim: int | None = None,
        arch: Arch = Arch(),
    ):
        D, N, K, H = d_model, num_heads, num_kv_heads, head_dim or d_model // num_heads
        std = init_scale / math.sqrt(D)
        # T5 keeps 1/sqrt(H) out of the logits and puts it into the query initialiser instead
        # (mesh_tensorflow: query init std (d_model * d_kv) ** -0.5).
        q_std = std / math.sqrt(H) if scale_free else std
        pdt = param_dtype
        self.wq = nnx.Param(_normal(rngs, (D, N, H), q_std, pdt))
        if owns_kv:
            self.wk = nnx.Param(_normal(rngs, (D, K, H), std, pdt))
            self.wv = nnx.Param(_normal(rngs, (D, K, H), std, pdt))
        self.wo = nnx.Param(
            _normal(rngs, (N, H, D), init_scale / math.sqrt(N * H * 2 * num_layers), pdt)
        )
        # CoPE's separate gate keys (the reference's --cope-sep-key): a key projection of their
        # own, drawn after the layer's other projections.
        separate = cope is not None and cope.gates == "separate"
        if separate and owns_kv:
            self.wg = nnx.Param(_normal(rngs, (D, K, H), std, pdt))
        # Biases (arch.bias), zero at initialisation as in GPT-2 and Qwen2.
        if arch.bias in ("qkv", "attn", "all"):
            self.bq = nnx.Param(jnp.zeros((N * H,), pdt))
            if owns_kv:
                self.bk = nnx.Param(jnp.zeros((K * H,), pdt))
                self.bv = nnx.Param(jnp.zeros((K * H,), pdt))
                if separate:
                    self.bg = nnx.Param(jnp.zeros((K * H,), pdt))
        if arch.bias in ("attn", "all"):
            self.bo = nnx.Param(jnp.zeros((D,), pdt))
        if arch.qk_norm:  # over each head's H features (Gemma 3, Qwen3)
            self.q_norm = make_norm(H, arch, dtype=dtype, param_dtype=pdt)
            if owns_kv:
                self.k_norm = make_norm(H, arch, dtype=dtype, param_dtype=pdt)
        self.owns_kv = owns_kv
        self.rotary = rotary_module
        self.bias = bias_module
        self.causal = causal
        self.scale = 1.0 if scale_free else 1.0 / math.sqrt(arch.query_pre_attn_scalar or H)
        self.softcap = float(arch.attn_logit_softcap) or None
        self.implementation = implementation
        self.dtype = dtype
        # Per-layer position settings (posattn.nn.pattern): a sliding window, a query temperature
        # (posattn.nn.temperature), FoX's forget gate (posattn.nn.forget), stick-breaking
        # attention instead of a softmax (its settings, `attention.StickBreaking`), CoPE's table
        # of position embeddings (posattn.nn.contextual), PaTH's reflections (posattn.nn.path).
        # None: absent.
        self.window, self.temperature, self.forget = window, temperature, forget
        self.stick_breaking, self.cope, self.path = stick_breaking, cope, path

    def _rotary(self, shared) -> Rotary | None:
        return self.rotary if self.rotary is not None or shared is None else shared[0]

    def _bias(self, shared) -> PositionBias | None:
        return self.bias if self.bias is not None or shared is None else shared[1]

    def _projections(self, x: jax.Array, names: str) -> list[jax.Array]:
        """x[B, T, D] through the projections `names` (of "q", "k", "v", and "g": CoPE's separate
        gate keys), [B, T, heads, H] each,
        plus their biases, by one matrix product.

        The weights are concatenated into one [D, sum of heads x H] matrix for the product (the
        parameters stay separate), so q, k and v cost one GEMM forward and two backward instead of
        three and six: at the training shapes of docs/benchmarks.md, separate narrow products ran
        well below the rate of one wide one. Each output is the same dot product either way.
        """
        dt = self.dtype
        weights = [getattr(self, f"w{n}")[...] for n in names]  # (D, heads, H) each
        flat = [w.reshape(w.shape[0], -1) for w in weights]
        w = flat[0] if len(flat) == 1 else jnp.concatenate(flat, axis=1)
        y = dense(x, w.astype(dt))  # (B, T, sum of heads x H)
        splits = np.cumsum([f.shape[1] for f in flat])[:-1].tolist()
        out = [
            _bias(part.reshape(*part.shape[:-1], *wt.shape[1:]), self, f"b{n}", dt)
            for part, wt, n in zip(jnp.split(y, splits, axis=-1), weights, names, strict=True)
        ]
        # Query and key norms (arch.qk_norm), before any rotation.
        return [
            getattr(self, f"{n}_norm")(o) if hasattr(self, f"{n}_norm") else o
            for o, n in zip(out, names, strict=True)
        ]

    def project_gate_keys(self, x: jax.Array) -> jax.Array | None:
        """CoPE's separate gate keys [B, S, K, H] of x[B, S, D] (`model.cope_gates="separate"`),
        or None for a layer without them."""
        return self._projections(x, "g")[0] if hasattr(self, "wg") else None

    def project_kv(
        self, x: jax.Array, positions: jax.Array, *, seq_len, rotate: bool = True, shared=None
    ) -> tuple[jax.Array, jax.Array]:
        """Keys and values of x[B, S, D] at `positions` (keys rotated for RoPE when `rotate`)."""
        k, v = self._projections(x, "kv")  # (B, S, K, H) each
        rotary_module = self._rotary(shared)
        if rotary_module is not None and rotate:
            k = rotary_module(k, positions, seq_len=seq_len)
        return k, v

    def project_q(
        self, x: jax.Array, positions: jax.Array, *, seq_len, rotate: bool = True, shared=None
    ) -> jax.Array:
        """Queries of x[B, T, D] at `positions` (rotated for RoPE when `rotate`)."""
        (q,) = self._projections(x, "q")  # (B, T, N, H)
        rotary_module = self._rotary(shared)
        if rotary_module is not None and rotate:
            q = rotary_module(q, positions, seq_len=seq_len)
        return q

    def project_qkv(
        self,
        x: jax.Array,
        positions: jax.Array,
        *,
        seq_len,
        rotate_keys: bool = True,
        rotate_queries: bool = True,
        shared=None,
    ):
        """(q, k, v) of x[B, T, D] at `positions`, as `project_q` and `project_kv` give them, by
        one matrix product (queries and keys rotated for RoPE when `rotate_queries` and
        `rotate_keys`)."""
        q, k, v = self._projections(x, "qkv")
        rotary_module = self._rotary(shared)
        if rotary_module is not None:
            if rotate_queries:
                q = rotary_module(q, positions, seq_len=seq_len)
            if rotate_keys:
                k = rotary_module(k, positions, seq_len=seq_len)
        return q, k, v

    def remapped(self, q, k, positions, *, seq_len, kv_len, shared=None):
        """(q, k, far) of a layer whose RoPE has an eval-time remap (ReRoPE, SelfExtend:
        `rotary.validate_rope_remap`): the projected queries q[B, T, N, H] at `positions` and
        keys k[B, S, K, H] at 0..S-1, each rotated at its own position (q, k) and at its far
        position (`posattn.attention.Far`, with the remap's window), the queries scaled by the
        remap's log-n factor (both references scale q before rotating it) and by the layer's
        temperature."""
        rotary_module = self._rotary(shared)
        k_pos = token_positions(0, k.shape[1])
        far_q_pos, far_k_pos, scale, log_n = rotary_module.remap_far(positions, k_pos)
        if log_n is not None:  # (T,) | (B, T)
            q = (q.astype(jnp.float32) * log_n[..., None, None]).astype(q.dtype)

        def rotated(x, at, frequency_scale=1.0):
            return rotary_module(x, at, seq_len=seq_len, frequency_scale=frequency_scale)

        far = attention_lib.Far(
            self._temper(rotated(q, far_q_pos, scale), positions, kv_len),
            rotated(k, far_k_pos, scale),
            rotary_module.remap_window,
        )
        q = self._temper(rotated(q, positions), positions, kv_len)
        return q, rotated(k, k_pos), far

    def _temper(self, q, positions, kv_len):
        return q if self.temperature is None else self.temperature(q, positions, kv_len=kv_len)

    def attend(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        *,
        q_offset,
        kv_lengths,
        shared=None,
        log_forget=None,
        far=None,
        gate_keys=None,
    ) -> jax.Array:
        """Attention of q[B, T, N, H] over k, v[B, S, K, H], projected back to [B, T, D]
        (log_forget: FoX's float32[B, S, N] of the keys; far: `posattn.attention.Far`, the
        queries and keys of an eval-time RoPE remap's far pairs; gate_keys: CoPE's separate gate
        keys [B, S, K, H])."""
        extra = {} if self.window is None else {"window": self.window}
        # Stick-breaking and CoPE: their own functions, with no bias, cap, forget gate or remap
        # (families.register and pattern.py keep them out), queries in blocks.
        rowwise = dict(
            q_offset=q_offset,
            kv_lengths=kv_lengths,
            scale=self.scale,
            query_chunk=ROWWISE_QUERY_CHUNK,
            **extra,
        )
        if self.stick_breaking is not None:
            return self._project_out(
                attention_lib.stick_breaking_attention(
                    q, k, v, **rowwise, **self.stick_breaking._asdict()
                )
            )
        if self.cope is not None:
            return self._project_out(
                attention_lib.cope_attention(
                    q, k, v, self.cope.table[...], **rowwise, **self.cope.settings(v, gate_keys)
                )
            )
        bias_module = self._bias(shared)
        bias = bias_module() if bias_module is not None else None
        if self.softcap is not None:
            extra["softcap"] = self.softcap
        if log_forget is not None:
            extra["log_forget"] = log_forget
        if far is not None:
            extra["far"] = far
        out = attention_lib.attention(
            q,
            k,
            v,
            bias=bias,
            causal=self.causal,
            q_offset=q_offset,
            kv_lengths=kv_lengths,
            scale=self.scale,
            implementation=self.implementation,
            **extra,
        )  # (B, T, N, H)
        return self._project_out(out)

    def _path_call(self, x, *, cache, q_offset, kv_lengths, attend_len):
        """`__call__` of a PaTH layer (`self.path`): each key reaches its query through the
        reflections of the positions between them (`posattn.attention.path_attention`).

        Without a cache: the chunk at positions q_offset + t over its own keys. With one, its
        entry is (keys, values[, log f][, conv state]): the keys as seen from the row's last
        written position (not as projected: docs/decoding.md), FoX's log f of a PaTH-FoX layer
        and the w convolution's last two inputs [B, 2, K*H]. A one-token step moves the cache on
        by the token's reflection and reads it with the softmax core (log f times the scale, as
        PaTH scales it); a longer chunk runs `path_attention` over the cache, whose rows carry
        no reflection of their own (beta 0) before the chunk's. Either way the chunk's
        reflections then move every key to the chunk's last valid position.
        """
        T = x.shape[1]
        positions = token_positions(q_offset, T)
        q, k, v = self._projections(x, "qkv")  # (B, T, heads, H)
        q = self._temper(q, positions, T if kv_lengths is None else kv_lengths)
        projected, beta = self.path.project(x), self.path.beta(x)  # (B, T, K*H), (B, T, K)
        log_f = None if self.forget is None else self.forget(x)  # (B, T, N)
        if cache is None:
            out = attention_lib.path_attention(
                q,
                k,
                v,
                self.path.directions(projected),
                beta,
                q_offset=q_offset,
                kv_lengths=kv_lengths,
                scale=self.scale,
                log_forget=log_f,
                chunk=_path_chunk(T),
                window=self.window,
            )
            return self._project_out(out), (k, v)
        k_cache, v_cache, *rest = cache
        f_cache = rest.pop(0) if log_f is not None else None
        previous = rest.pop(0) if self.path.has_conv else None  # (B, 2, K*H)
        w = self.path.directions(projected, previous)  # (B, T, K, H)
        keys = write_rows(k_cache, k, q_offset)  # the chunk's rows as projected
        values = write_rows(v_cache, v, q_offset)
        f_all = None if log_f is None else write_rows(f_cache, log_f, q_offset)
        moved = attention_lib.path_extend_keys(keys, w, beta, q_offset, kv_lengths=kv_lengths)

        def visible(a):
            return a if a is None or attend_len is None else a[:, :attend_len]

        if T == 1:  # one reflection moved the cache to the query's position: a softmax reads it
            out = attention_lib.attention(
                q,
                visible(moved),
                visible(values),
                causal=True,
                q_offset=q_offset,
                kv_lengths=kv_lengths,
                scale=self.scale,
                implementation=self.implementation,
                log_forget=None if f_all is None else self.scale * visible(f_all),
                window=self.window,
            )
        else:
            w_all = write_rows(jnp.zeros(k_cache.shape, jnp.float32), w, q_offset)
            beta_all = write_rows(jnp.zeros(k_cache.shape[:3], jnp.float32), beta, q_offset)
            out = attention_lib.path_attention(
                q,
                visible(keys),
                visible(values),
                visible(w_all),
                visible(beta_all),
                q_offset=q_offset,
                kv_lengths=kv_lengths,
                scale=self.scale,
                log_forget=visible(f_all),
                chunk=_path_chunk(k_cache.shape[1] if attend_len is None else attend_len),
                window=self.window,
            )
        entry = (moved, values) + (() if f_all is None else (f_all,))
        if previous is not None:  # the inputs at the last two valid positions L - 2, L - 1
            joined = jnp.concatenate([previous.astype(jnp.float32), projected], axis=1)
            offset = jnp.asarray(q_offset, jnp.int32)
            end = (offset + T if kv_lengths is None else kv_lengths) - offset  # L - p
            at = jnp.broadcast_to(end, (x.shape[0],))[:, None] + jnp.arange(2)  # (B, 2)
            kept = jnp.take_along_axis(joined, jnp.clip(at, 0, T + 1)[..., None], axis=1)
            entry += (kept.astype(previous.dtype),)
        return self._project_out(out), entry

    def _project_out(self, out: jax.Array) -> jax.Array:
        """The heads out[B, T, N, H] projected back to [B, T, D]."""
        B, T, N, H = out.shape
        out = dense(
            out.reshape(B, T, N * H), self.wo[...].astype(self.dtype).reshape(N * H, -1)
        )  # (B, T, D)
        return _bias(out, self, "bo", self.dtype)

    def __call__(
        self,
        x: jax.Array,
        *,
        kv=None,
        cache=None,
        q_offset=0,
        kv_lengths=None,
        seq_len=None,
        keys_rotated: bool = True,
        attend_len: int | None = None,
        shared=None,
    ):
        """Self-attention of x[B, T, D] at positions q_offset + t, with or without a KV cache.

        The one attention path: training and evaluation pass no cache (positions 0..T-1, keys
        and values of the chunk itself); decoding (posattn.nn.decode, `TransformerLM.extend`)
        passes this layer group's cache, which the chunk's keys/values are written into and
        read from. Both run `project_qkv` (`project_q` in a layer that reads a lower layer's keys),
        the temperature and `attend`.

        Args:
          x: the normalised residual stream.
          kv: without a cache, the keys/values of a lower layer, for a layer that does not own
            its own (cross-layer sharing); None otherwise.
          cache: None (nothing kept), or this layer group's cache (k, v), [B, S, K, H] each,
            plus FoX's log f [B, S, N] for a layer with forget gates, or CoPE's separate gate
            keys [B, S, K, H]. A layer that owns its
            keys/values first writes the chunk's into rows q_offset + t (rows past S are
            dropped, never clamped: the caller checks capacity); a sharing layer reads what its
            owner wrote. A sliding-window layer's cache may be a ring buffer of `window` rows
            (posattn.nn.window).
          q_offset: int or int[B], the position of the chunk's first token (the cached length);
            0 without a cache.
          kv_lengths: optional int[B], the valid (unpadded) keys, the cache rows included; it is
            also each row's length for dynamic NTK, so a right-padded row gives the logits it
            would give alone.
          seq_len: int or int[B], each row's current length (dynamic NTK's base); None: the
            `kv_lengths`, or T.
          keys_rotated: True caches keys rotated at their own positions (exact whenever the
            frequencies do not depend on the length); False caches them as projected and rotates
            every cached key at each use with the current frequencies (dynamic NTK:
            docs/decoding.md). Without a cache the keys are always rotated.
          attend_len: static; attend over the first `attend_len` cache rows only (a prefill of
            an empty cache passes T: no later row is visible to a causal query).
          shared: (rotary, bias) modules of a scanned stack's model (see the class docstring).

        Returns:
          (output[B, T, D], kv): without a cache, the keys/values (k, v) this layer used, for
          the layers above; with one, the updated cache.
        """
        if self.path is not None:
            return self._path_call(
                x, cache=cache, q_offset=q_offset, kv_lengths=kv_lengths, attend_len=attend_len
            )
        T = x.shape[1]
        positions = token_positions(q_offset, T)  # (T,) or (B, T)
        kv_len = T if kv_lengths is None else kv_lengths
        seq_len = kv_len if seq_len is None else seq_len
        rotary_module = self._rotary(shared)
        # An eval-time remap (ReRoPE, SelfExtend) rotates each query and key twice, at its own
        # position and at its far position, so keys travel (between layers, in a cache) as
        # projected and both rotations happen here.
        remap = None if rotary_module is None else rotary_module.remap
        # A ring's rows are renumbered at every step, so its keys are cached rotated (a layer
        # whose frequencies follow the length, or with a remap, never gets a ring:
        # posattn.nn.decode).
        ring = (
            cache is not None
            and self.owns_kv
            and self.window is not None
            and cache[0].shape[1] == self.window
        )
        if ring and remap is not None:
            raise ValueError("a RoPE remap needs a full KV cache, not a sliding window's ring")
        rotate = (keys_rotated or ring or cache is None) and remap is None
        if self.owns_kv:
            q, *new = self.project_qkv(
                x,
                positions,
                seq_len=seq_len,
                rotate_keys=rotate,
                rotate_queries=remap is None,
                shared=shared,
            )
            new = tuple(new)
            if self.forget is not None:
                new = (*new, self.forget(x))  # (k, v, log f [B, T, N])
            elif hasattr(self, "wg"):
                new = (*new, self.project_gate_keys(x))  # (k, v, CoPE's gate keys)
        else:
            q = self.project_q(x, positions, seq_len=seq_len, rotate=remap is None, shared=shared)
        offset, lengths = q_offset, kv_lengths
        if cache is None:
            read = new if self.owns_kv else kv
            kv = read[:2]
        elif ring:
            if isinstance(q_offset, int) and q_offset == 0:  # a prefill: no earlier key
                read = new
            else:
                parts = [
                    window_lib.assemble(c, n, q_offset) for c, n in zip(cache, new, strict=True)
                ]
                read, shift = tuple(p[0] for p in parts), parts[0][1]  # row r: position shift + r
                offset, lengths = jnp.asarray(q_offset, jnp.int32) - shift, kv_lengths - shift
            kv = tuple(
                window_lib.write_ring(c, n, q_offset, kv_lengths)
                for c, n in zip(cache, new, strict=True)
            )
        else:
            kv = cache
            if self.owns_kv:
                kv = tuple(write_rows(c, n, q_offset) for c, n in zip(cache, new, strict=True))
            read = kv if attend_len is None else tuple(c[:, :attend_len] for c in kv)
        k, v = read[:2]
        far = None
        if rotary_module is not None and not rotate:  # cached as projected: rotate them now
            if remap is not None:
                q, k, far = self.remapped(
                    q, k, positions, seq_len=seq_len, kv_len=kv_len, shared=shared
                )
            else:
                k = rotary_module(k, token_positions(0, k.shape[1]), seq_len=seq_len)
        if far is None:  # (remapped tempers its queries itself)
            q = self._temper(q, positions, kv_len)
        log_forget = read[2] if self.forget is not None else None
        out = self.attend(
            q,
            k,
            v,
            q_offset=offset,
            kv_lengths=lengths,
            shared=shared,
            log_forget=log_forget,
            far=far,
            gate_keys=read[2] if hasattr(self, "wg") else None,
        )
        return out, kv


def write_rows(cache: jax.Array, chunk: jax.Array, start) -> jax.Array:
    """cache[B, S, ...] with chunk[B, T, ...] written at rows start + t (start int or int[B]).

    A scatter with mode="drop": a row at or past S is not written. `lax.dynamic_update_slice`
    would instead shift the whole chunk back so that it fits, silently overwriting live keys.
    """
    B, T = chunk.shape[:2]
    rows = jnp.broadcast_to(token_positions(start, T), (B, T))  # (B, T)
    batch = jnp.arange(B, dtype=jnp.int32)[:, None]  # (B, 1)
    return cache.at[batch, rows].set(chunk.astype(cache.dtype), mode="drop")


def token_positions(q_offset, length: int) -> jax.Array:
    """Positions [T] (scalar offset) or [B, T] (per-row offsets) of a chunk of `length` tokens."""
    offset = jnp.asarray(q_offset, jnp.int32)
    return offset[..., None] + jnp.arange(length, dtype=jnp.int32)


class Mlp(nnx.Module):
    """Feed-forward D -> F -> D: act(x W1) W2, or gated (act(x W1) * x W3) W2 (`arch.mlp`).

    `num_layers` (the stack's depth) shrinks the output init; biases b1, b3, b2 when
    arch.bias="all".
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        num_layers: int,
        init_scale: float,
        dtype,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
        arch: Arch = Arch(),
    ):
        D, F, pdt = d_model, d_ff, param_dtype
        self.w1 = nnx.Param(_normal(rngs, (D, F), init_scale / math.sqrt(D), pdt))
        self.w2 = nnx.Param(_normal(rngs, (F, D), init_scale / math.sqrt(F * 2 * num_layers), pdt))
        if arch.mlp == "gated":
            self.w3 = nnx.Param(_normal(rngs, (D, F), init_scale / math.sqrt(D), pdt))
        if arch.bias == "all":
            self.b1 = nnx.Param(jnp.zeros((F,), pdt))
            self.b2 = nnx.Param(jnp.zeros((D,), pdt))
            if arch.mlp == "gated":
                self.b3 = nnx.Param(jnp.zeros((F,), pdt))
        self.activation = arch.activation
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        h = ACTIVATIONS[self.activation](_bias(dense(x, self.w1[...].astype(dt)), self, "b1", dt))
        if hasattr(self, "w3"):
            h = h * _bias(dense(x, self.w3[...].astype(dt)), self, "b3", dt)  # (B, T, F)
        return _bias(dense(h, self.w2[...].astype(dt)), self, "b2", dt)  # (B, T, D)


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)) (or both branches on
    x with `arch.parallel_residual`; each branch's output normalised too with `arch.post_norms`).

    Args: as `Attention`, plus d_ff, F, the MLP's width, and `arch`, the switches (`Arch`).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int,
        d_ff: int,
        *,
        num_layers: int,
        causal: bool,
        scale_free: bool,
        init_scale: float,
        implementation: str,
        dtype,
        param_dtype=jnp.float32,
        owns_kv: bool,
        rotary_module: Rotary | None,
        bias_module: PositionBias | None,
        rngs: nnx.Rngs,
        head_dim: int | None = None,
        arch: Arch = Arch(),
        **position_layer,
    ):
        self.attn_norm = make_norm(d_model, arch, dtype=dtype, param_dtype=param_dtype)
        self.attn = Attention(
            d_model,
            num_heads,
            num_kv_heads,
            num_layers=num_layers,
            causal=causal,
            scale_free=scale_free,
            init_scale=init_scale,
            implementation=implementation,
            dtype=dtype,
            param_dtype=param_dtype,
            owns_kv=owns_kv,
            rotary_module=rotary_module,
            bias_module=bias_module,
            rngs=rngs,
            **position_layer,
            head_dim=head_dim,
            arch=arch,
        )
        self.mlp_norm = make_norm(d_model, arch, dtype=dtype, param_dtype=param_dtype)
        self.mlp = Mlp(
            d_model,
            d_ff,
            num_layers=num_layers,
            init_scale=init_scale,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
            arch=arch,
        )
        if arch.post_norms:  # Gemma 2 and 3: each branch's output normalised before it is added
            self.attn_post_norm = make_norm(d_model, arch, dtype=dtype, param_dtype=param_dtype)
            self.mlp_post_norm = make_norm(d_model, arch, dtype=dtype, param_dtype=param_dtype)
        self.parallel_residual = arch.parallel_residual

    def _branch(self, name: str, h: jax.Array) -> jax.Array:
        post = getattr(self, f"{name}_post_norm", None)
        return h if post is None else post(h)

    def _residual(self, x: jax.Array, h: jax.Array) -> jax.Array:
        h = self._branch("attn", h)
        if self.parallel_residual:  # GPT-NeoX: both branches read the block's input
            return x + h + self._branch("mlp", self.mlp(self.mlp_norm(x)))
        x = x + h
        return x + self._branch("mlp", self.mlp(self.mlp_norm(x)))

    def __call__(self, x: jax.Array, **attention_args):
        """The block on x[B, T, D]; `attention_args` (kv, cache, q_offset, kv_lengths, ...) and
        the result's second element as `Attention.__call__`."""
        h, kv = self.attn(self.attn_norm(x), **attention_args)
        return self._residual(x, h), kv
