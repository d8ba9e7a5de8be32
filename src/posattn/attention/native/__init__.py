"""The "native" implementation: a C++ attention kernel for CPUs, called through XLA's FFI.

Shape legend: B batch, T query length, S key length, N query heads, K key/value heads, H head dim.

XLA:CPU runs attention at training lengths as many small batched products and elementwise passes
over [B, N, T, S] logits (the "chunked" kernel arranges them as well as XLA allows); this kernel
does the whole softmax(scale q k^T + bias) v of a (batch row, key/value head) in one pass per row
block, with the keys packed once and the logits in L1, and skips the keys that a causal (or
sliding-window) query cannot see. Its math is "chunked"'s (`posattn.attention.tiles`: whole-row
softmax, the same residuals and backward equations); `tests/attention/test_native.py` checks both
against the float32 reference, values and gradients, bias gradient included.

The kernel (`attention.cc`, beside this file) is compiled on first use with the machine's C++
compiler (`$CXX`, else `c++`/`g++`) for the machine's own CPU (`-march=native`) against the FFI
headers of the installed jaxlib, and cached in `$POSATTN_CACHE_DIR` (default
`$XDG_CACHE_HOME/posattn` or `~/.cache/posattn`), keyed by the source, the compiler, its flags,
jaxlib's version and the CPU's flags, so a cached library is never used on another CPU.
`available()` says whether it built; when it cannot (no compiler, `POSATTN_NATIVE=0`), "auto"
keeps "chunked" and says why once in the log. Head dims 8, 16, 32, 64 and 128; float32 inside
(other dtypes are widened and the output cast back).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from posattn.attention import masks

__all__ = [
    "HEAD_DIMS",
    "attention_from_bias",
    "available",
    "build_in_background",
    "native_attention",
    "product",
    "supports",
    "weight_gradient",
    "why_unavailable",
    "wide_vectors",
]

HEAD_DIMS = (8, 16, 32, 64, 128)
_SOURCE = pathlib.Path(__file__).with_name("attention.cc")
_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-std=gnu++17", "-shared", "-fPIC")
_FORWARD, _BACKWARD = "posattn_attention_forward", "posattn_attention_backward"
_WEIGHT_GRADIENT = "posattn_weight_gradient"
_PRODUCT = "posattn_product"
_log = logging.getLogger(__name__)
f32 = jnp.float32


def _cache_dir() -> pathlib.Path:
    if os.environ.get("POSATTN_CACHE_DIR"):
        return pathlib.Path(os.environ["POSATTN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "posattn"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiled for), or its model where none."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(compiler: str) -> pathlib.Path:
    """The compiled library, from the cache or built now. Processes that need it at once (test
    workers, the experiment's workers) wait on a lock for the first to build it, and the file is
    renamed into place whole, so no process loads a partial library."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout.splitlines()[:1]
    key = hashlib.sha256(
        "\0".join([_SOURCE.read_text(), *version, *_FLAGS, jax.__version__, _cpu_flags()]).encode()
    ).hexdigest()[:16]
    directory = _cache_dir()
    target = directory / f"attention-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with _locked(directory / f"attention-{key}.lock"):
        if target.exists():  # built by another process while this one waited
            return target
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            built = pathlib.Path(scratch) / target.name
            command = [
                compiler,
                *_FLAGS,
                f"-I{jax.ffi.include_dir()}",
                str(_SOURCE),
                "-o",
                str(built),
            ]
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise RuntimeError(
                    f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-2000:]}"
                )
            os.replace(built, target)
    return target


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    """An exclusive lock on `path` while the block runs (POSIX; elsewhere no lock: concurrent
    builds then each rename a whole file into place)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


@functools.cache
def _load() -> str | None:
    """Builds and registers the kernel once a process; None if it worked, else why not."""
    if os.environ.get("POSATTN_NATIVE", "1") == "0":
        return "POSATTN_NATIVE=0"
    compiler = _compiler()
    if compiler is None:
        return "no C++ compiler found (set CXX, or install g++)"
    try:
        library = ctypes.CDLL(str(_build(compiler)))
        for name, symbol in (
            (_FORWARD, library.PosattnAttentionForward),
            (_BACKWARD, library.PosattnAttentionBackward),
            (_WEIGHT_GRADIENT, library.PosattnWeightGradient),
            (_PRODUCT, library.PosattnProduct),
        ):
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(symbol), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        return f"building it failed: {e}"
    return None


def build_in_background() -> threading.Thread | None:
    """Starts building the library in a thread of this process, for other processes about to
    load it (the experiment's workers: they find it built, or wait on its lock for this build
    rather than one of them building while the others wait). Nothing is registered here, and a
    failure is left for the loading process to report. None (nothing started) where the kernel
    is switched off or no compiler is found."""
    compiler = _compiler()
    if os.environ.get("POSATTN_NATIVE", "1") == "0" or compiler is None:
        return None

    def build():
        try:
            _build(compiler)
        except (OSError, RuntimeError):
            pass

    thread = threading.Thread(target=build, name="posattn-native-build", daemon=True)
    thread.start()
    return thread


@functools.cache
def wide_vectors() -> bool:
    """Whether the library runs 16-float vectors here: built for this CPU (`-march=native`), it
    does where the CPU has AVX-512 (read once a process: `dense` asks at every trace)."""
    return "avx512f" in _cpu_flags().split()


def why_unavailable() -> str | None:
    """None when the kernel is built and registered in this process, else the reason."""
    reason = _load()
    if reason is not None:
        _log_once(reason)
    return reason


def available() -> bool:
    """Whether the native kernel can run in this process (built and registered on first call)."""
    return why_unavailable() is None


@functools.cache
def _log_once(reason: str) -> None:
    _log.warning(
        "posattn's native CPU attention kernel is unavailable: %s; using 'chunked'", reason
    )


def supports(q, k) -> str | None:
    """None when the kernel takes q, k (shapes/dtypes), else why not."""
    if q.shape[-1] not in HEAD_DIMS:
        return f"head dim {q.shape[-1]} not in {HEAD_DIMS}"
    return why_unavailable()


# ----------------------------------------------------------------------------------------------
# The kernel as a differentiable function.


@dataclasses.dataclass(frozen=True)
class _Plan:
    scale: float
    causal: bool
    offset: int  # the static position of query 0 (causal only)
    window: int  # 0: none (a causal window otherwise)
    bias_grad: bool
    softcap: float = 0.0  # 0: none; else the content logits become softcap * tanh(s / softcap)

    def attrs(self) -> dict:
        return dict(
            scale=np.float32(self.scale),
            softcap=np.float32(self.softcap),
            causal=np.int64(self.causal),
            offset=np.int64(self.offset),
            window=np.int64(self.window),
        )


def native_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    logit_bias: jax.Array | None,
    *,
    scale: float,
    bias_grad: bool,
    causal_offset: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """softmax(scale q k^T + logit_bias) v by the C++ kernel: "chunked"'s contract
    (`posattn.attention.chunked.chunked_attention`).

    Args:
      q: float[B, T, N, H]; k, v: float[B, S, K, H], N % K == 0, H in HEAD_DIMS.
      logit_bias: None or float[B or 1, N or 1, T, S] added to the logits, -inf hides a key.
      scale: the logit scale (a Python float; a traced scale is folded into q).
      bias_grad: whether `logit_bias` may need its gradient (False: a constant mask). Even
        when True, the backward computes it only where the bias is being differentiated.
      causal_offset: a static int when the attention is causal with that position of query 0:
        the kernel then skips (and hides) keys j > causal_offset + t itself, so the bias need not
        hide them. None: every key is visible up to the bias.
      window: with `causal_offset`, a causal sliding window w: keys j <= i - w are skipped too.
      softcap: None, or c > 0: the content logits scale q.k become c tanh(scale q.k / c) before
        `logit_bias` is added (Gemma 2's soft-capping).

    Returns:
      float[B, T, N, H] in q's dtype.
    """
    if not isinstance(scale, (int, float, np.number)):
        q, scale = (q.astype(f32) * scale).astype(q.dtype), 1.0
    plan = _Plan(
        scale=float(scale),
        causal=causal_offset is not None,
        offset=0 if causal_offset is None else int(causal_offset),
        window=0 if window is None or causal_offset is None else int(window),
        bias_grad=bool(bias_grad) and logit_bias is not None,
        softcap=0.0 if softcap is None else float(softcap),
    )
    bias = jnp.zeros((0,), f32) if logit_bias is None else logit_bias.astype(f32)
    out = _attend(plan, q.astype(f32), k.astype(f32), v.astype(f32), bias)
    return out.astype(q.dtype)


def _forward_call(plan, q, k, v, bias):
    B, T, N, _ = q.shape
    stats = jax.ShapeDtypeStruct((B, N, T), f32)
    call = jax.ffi.ffi_call(
        _FORWARD,
        (jax.ShapeDtypeStruct(q.shape, f32), stats, stats),
        vmap_method="sequential",
    )
    return call(q, k, v, bias, **plan.attrs())


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(plan, q, k, v, bias):
    return _forward_call(plan, q, k, v, bias)[0]


def _attend_fwd(plan, q, k, v, bias):
    # symbolic_zeros: the primals come with whether they carry a tangent. The bias gradient is
    # computed only when asked for (plan.bias_grad) and the bias is being differentiated: ALiBi's
    # slopes, say, are a constant of the model, so its training step needs no bias gradient.
    bias_grad = plan.bias_grad and bias.perturbed
    q, k, v, bias = q.value, k.value, v.value, bias.value
    out, m, inv_l = _forward_call(plan, q, k, v, bias)
    # The residuals' tree says whether to compute the bias gradient (None: no).
    return out, (q, k, v, bias, m, inv_l, () if bias_grad else None)


def _attend_bwd(plan, res, d_out):
    q, k, v, bias, m, inv_l, bias_grad = res
    bias_grad = bias_grad is not None
    if isinstance(d_out, SymbolicZero):
        d_out = jnp.zeros(q.shape, f32)
    grad_shape = bias.shape if bias_grad else (0,)
    call = jax.ffi.ffi_call(
        _BACKWARD,
        (
            jax.ShapeDtypeStruct(q.shape, f32),
            jax.ShapeDtypeStruct(k.shape, f32),
            jax.ShapeDtypeStruct(v.shape, f32),
            jax.ShapeDtypeStruct(grad_shape, f32),
        ),
        vmap_method="sequential",
    )
    dq, dk, dv, d_bias = call(
        q, k, v, bias, d_out.astype(f32), m, inv_l, bias_grad=np.int64(bias_grad),
        **plan.attrs(),
    )  # fmt: skip
    if not bias_grad:
        d_bias = jnp.zeros(bias.shape, f32)
    return dq, dk, dv, d_bias


_attend.defvjp(_attend_fwd, _attend_bwd, symbolic_zeros=True)


def attention_from_bias(
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
    softcap=None,
) -> jax.Array:
    """The kernel on `posattn.attention.attention`'s inputs: the position bias and the forget
    term materialised [B or 1, N, T, S] (as "chunked" does), the visibility mask added as -inf
    only where the kernel's own key ranges do not already give it (per-row offsets or lengths,
    a window without a static causal offset)."""
    ranged = causal and static_offset is not None  # the kernel hides j > i (and the window)
    logit_bias, bias_grad = masks.masked_logit_bias(
        bias,
        log_forget,
        q_offset,
        q.shape[1],
        k.shape[1],
        causal=causal,
        kv_lengths=kv_lengths,
        window=window,
        ranged=ranged,
    )
    return native_attention(
        q,
        k,
        v,
        logit_bias,
        scale=scale,
        bias_grad=bias_grad,
        causal_offset=static_offset if ranged else None,
        window=window if ranged else None,
        softcap=softcap,
    )


def weight_gradient(x: jax.Array, dy: jax.Array) -> jax.Array:
    """x[M, A]^T dy[M, B] -> [A, B] in float32 by the library's product (a dense layer's weight
    gradient: `posattn.nn.layers` uses it on CPU where `available()`). Each element sums its M
    products in chunks of 128 rows, each chunk's in order, the chunks in order: the same bits
    for any number of threads. Not differentiable (it is itself a gradient)."""
    if not available():
        raise ValueError(f"the native library is unavailable here: {why_unavailable()}")
    call = jax.ffi.ffi_call(
        _WEIGHT_GRADIENT,
        jax.ShapeDtypeStruct((x.shape[1], dy.shape[1]), f32),
        vmap_method="sequential",
    )
    return call(x.astype(f32), dy.astype(f32))


def product(x: jax.Array, w: jax.Array, *, transposed: bool = False) -> jax.Array:
    """x[M, K] @ w[K, N] (transposed: x @ w^T for w [N, K]) in float32 by the library's product
    (a dense layer's forward and its input gradient: `posattn.nn.layers` uses it on CPU where
    `available()`). Each element is one FMA a term, in order from 0: the same bits for any number
    of threads or vector width. Not differentiable (`dense` gives it its gradient)."""
    if not available():
        raise ValueError(f"the native library is unavailable here: {why_unavailable()}")
    n = w.shape[0] if transposed else w.shape[1]
    call = jax.ffi.ffi_call(
        _PRODUCT, jax.ShapeDtypeStruct((x.shape[0], n), f32), vmap_method="sequential"
    )
    return call(x.astype(f32), w.astype(f32), transposed=np.int64(transposed))
