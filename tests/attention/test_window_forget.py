"""Sliding windows and forgetting attention (FoX) in every implementation.

The oracle (`attention_cases.oracle_attention`) is written from the definitions: query i sees key
j iff i - j < window (and j <= i when causal, |i - j| < window when not; Hugging Face's
`sliding_window`), and the logit of (i, j) gains sum_{l=j+1..i} log_forget[b, l, h] (Lin et al.
2025), as an explicit masked sum. The reference is also checked against a float64 NumPy loop.
Every implementation matches the oracle's output and every gradient (q, k, v, the bias
parameters, log_forget) over GQA / MQA, ragged lengths, scalar and per-row offsets, a decode-like
query block, windows of 1 and past S, and rows that see no key.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
    WINDOW_CASES,
    WINDOW_GRID,
    _assert_close,
    _inputs,
    _oracle_case,
    _value_and_grads,
    alibi_like,
    log_forget_gates,
    oracle_attention,
    window_case,
)
from conftest import XLA_DEFAULT_LEVEL, primitive_input_dtypes

from posattn import attention as attn_lib
from posattn.attention import attention, blockwise, chunked, cudnn, masks, native
from posattn.attention.blockwise import blockwise_attention
from posattn.positions import alibi_slopes

IMPLEMENTATIONS = ("reference", "xla", "chunked", "blockwise")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("bias_kind, case", WINDOW_GRID)
def test_matches_oracle_forward_and_every_gradient(impl, bias_kind, case, monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK_LOGITS", 1)  # chunked: one batch row per chunk
    monkeypatch.setattr(chunked, "TILE_Q", 16)  # chunked: causal (windowed) query tiles of 16
    inputs, bias, kw = window_case(bias_kind, case)
    want = _oracle_case(bias_kind, case)
    got = _value_and_grads(impl, *inputs, bias, **kw)
    # atol: a gradient that is zero in exact arithmetic (dq under a window of 1) is float32 noise
    _assert_close(got, want, rtol=1e-5, atol=1e-5, name=f"{impl} ")
    if case == "forget_window_one_empty_rows":  # positions -20..-1 and kv_lengths 0 see no key
        np.testing.assert_array_equal(got[0][0, :20], 0.0)
        np.testing.assert_array_equal(got[0][1], 0.0)


def numpy_oracle(q, k, v, *, slopes, causal, q_offset, kv_lengths, window, log_forget):
    """float64 loops over (row, head, query): c = cumsum(log_forget), logit + c_i - c_j."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b_, t_, n_, h_ = q.shape
    s_, kh_ = k.shape[1], k.shape[2]
    c = np.cumsum(np.asarray(log_forget, np.float64), axis=1)
    offsets = np.broadcast_to(np.asarray(q_offset), (b_,))
    out = np.zeros_like(q)
    for b in range(b_):
        for n in range(n_):
            for t in range(t_):
                i = offsets[b] + t
                j = np.arange(s_)
                logits = k[b, :, n // (n_ // kh_)] @ q[b, t, n] / np.sqrt(h_)
                logits += -float(slopes[n]) * (i - j) + c[b, i, n] - c[b, :, n]
                seen = (j <= i) & (i - j < window) if causal else np.abs(i - j) < window
                seen &= j < kv_lengths[b]
                if seen.any():
                    w = np.exp(logits[seen] - logits[seen].max())
                    out[b, t, n] = (w / w.sum()) @ v[b, seen, n // (n_ // kh_)]
    return out


def test_reference_and_oracle_match_float64_loops():
    inputs, bias, kw = window_case("alibi", "forget_window_decode_block_mqa")
    q, k, v, _ = inputs
    want = numpy_oracle(q, k, v, slopes=bias[1], **kw)
    for got in (
        attention(q, k, v, bias=bias, implementation="reference", **kw),
        oracle_attention(q, k, v, bias=bias, **kw),
    ):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@functools.cache
def _bfloat16_oracle():
    """The float32 oracle on the bfloat16 case's (rounded) inputs."""
    inputs, bias, kw = window_case("alibi", "forget_window_decode_block_mqa", jnp.bfloat16)
    f32 = [x.astype(jnp.float32) for x in inputs]
    kw32 = dict(kw, log_forget=kw["log_forget"].astype(jnp.float32))
    return _value_and_grads("oracle", *f32, bias, **kw32)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bfloat16(impl):
    """bfloat16 q, k, v and log_forget: the output keeps bfloat16, the exponentials and the
    cumulative sums run in float32, and the values are the float32 oracle's on the same
    (rounded) inputs within bfloat16 rounding."""
    inputs, bias, kw = window_case("alibi", "forget_window_decode_block_mqa", jnp.bfloat16)
    out, grads = _value_and_grads(impl, *inputs, bias, **kw)
    assert out.dtype == jnp.bfloat16 and grads[0].dtype == jnp.bfloat16
    assert grads[4].dtype == jnp.bfloat16  # d log_forget in log_forget's dtype
    _assert_close((out, grads), _bfloat16_oracle(), rtol=3e-2, name=f"{impl} ")
    q, k, v, _ = inputs

    def loss(q, k, v, log_forget):
        kw_ = dict(kw, log_forget=log_forget)
        return attention(q, k, v, bias=bias, implementation=impl, **kw_).astype(jnp.float32).sum()

    args = (q, k, v, kw["log_forget"])
    for primitive in ("exp", "cumsum"):
        dtypes = primitive_input_dtypes(loss, *args, primitive=primitive)
        grad_dtypes = primitive_input_dtypes(jax.grad(loss, (0, 3)), *args, primitive=primitive)
        assert dtypes and set(dtypes + grad_dtypes) == {"float32"}, (primitive, dtypes)


def test_constant_forget_equals_alibi_exactly():
    """FoX with a constant gate log_forget = -m_h is ALiBi: c_i - c_j = -m_h (i - j), so the
    outputs equal those of the ALiBi bias bit for bit (the slopes are powers of two, so the
    cumulative sums are exact), with and without a window."""
    (q, k, v, _), _, _ = window_case("none", "forget_gqa")
    slopes = alibi_slopes(q.shape[2])
    constant = jnp.broadcast_to(-slopes, (q.shape[0], k.shape[1], q.shape[2]))
    cases = [(impl, window) for impl in IMPLEMENTATIONS for window in (None, 6)]

    # One program for every case, at XLA's default level: the identity is the optimised build's
    # (at LLVM level 0, the suite's, the two round differently).
    @functools.partial(jax.jit, compiler_options=XLA_DEFAULT_LEVEL)
    def outputs(q, k, v, constant, slopes):
        return [
            [
                attention(q, k, v, causal=True, window=window, implementation=impl, **bias)
                for bias in (dict(log_forget=constant), dict(bias=(alibi_like, slopes)))
            ]
            for impl, window in cases
        ]

    for (impl, window), (fox, alibi) in zip(cases, outputs(q, k, v, constant, slopes), strict=True):
        np.testing.assert_array_equal(fox, alibi, err_msg=f"{impl}, window {window}")


def test_decode_step_equals_the_full_sequence():
    """A windowed FoX KV-cache decode step (one query at position p, the cache's keys) gives the
    full sequence's row p, for every implementation under jit."""
    (q, k, v, _), bias, kw = window_case("alibi", "forget_gqa")
    full = attention(q, k, v, bias=bias, window=5, implementation="reference", **kw)
    steps = jnp.array([30, 11], jnp.int32)
    q_step = jnp.take_along_axis(q, steps[:, None, None, None], axis=1)  # (B, 1, N, H)
    for impl in IMPLEMENTATIONS:
        step = jax.jit(
            lambda q, k, v, lf, s, impl=impl: attention(
                q,
                k,
                v,
                bias=bias,
                causal=True,
                window=5,
                q_offset=s,
                kv_lengths=s + 1,
                log_forget=lf,
                implementation=impl,
            )
        )(q_step, k, v, kw["log_forget"], steps)
        want = jnp.take_along_axis(full, steps[:, None, None, None], axis=1)
        np.testing.assert_allclose(step, want, rtol=1e-5, atol=1e-6, err_msg=impl)


def _counting(seen):
    def bias_fn(slopes, q_pos, k_pos):
        jax.debug.callback(lambda qp, kp: seen.append((int(qp), int(kp))), q_pos[0], k_pos[0])
        return alibi_like(slopes, q_pos, k_pos)

    return bias_fn


@pytest.mark.parametrize("causal", [True, False])
def test_blockwise_skips_the_tiles_outside_the_band(causal):
    """Counting the bias tiles evaluated: with a window of 16 and 16 x 16 tiles, forward and
    backward each visit exactly the tiles holding a visible pair, 15 (causal) or 22 (two-sided)
    of 64 at T = 128: the band, whose size grows as T x w, not T^2."""
    counts = []
    for T in (128,):
        seen = []
        q, k, v, _ = _inputs(2, jax.random.key(10), T=T, S=T)
        q, k, v = q[:1], k[:1], v[:1]
        lf = log_forget_gates(jax.random.key(11), B=1, S=T)
        kw = dict(
            bias=(_counting(seen), jnp.array([0.5, 0.25, 0.125, 0.0625])),
            causal=causal,
            window=16,
            log_forget=lf if causal else None,
            block_q=16,
            block_k=16,
        )
        forward = jax.jit(lambda q, k, v, kw=kw: blockwise_attention(q, k, v, **kw))
        forward(q, k, v).block_until_ready()
        i, j = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
        seen_pairs = (i - j < 16) & ((j <= i) if causal else (j - i < 16))
        band = {
            (a, b)
            for a in range(0, T, 16)
            for b in range(0, T, 16)
            if seen_pairs[a : a + 16, b : b + 16].any()
        }
        assert set(seen) == band and len(seen) == len(band)
        forward = len(seen)
        counts.append(forward)
        seen.clear()
        grad = jax.jit(jax.grad(lambda q, k, v, kw=kw: blockwise_attention(q, k, v, **kw).sum()))
        grad(q, k, v).block_until_ready()
        assert set(seen) == band and len(seen) == 2 * forward  # forward once, backward once
    assert counts == ([15] if causal else [22])


def test_blockwise_windowed_program_does_not_grow_and_memory_is_linear():
    """The same jaxpr at any T, and compiled temporary memory of forward + backward linear in T."""

    def grad_fn(T):
        spec = jax.ShapeDtypeStruct((1, T, 4, 32), jnp.float32)
        lf = jax.ShapeDtypeStruct((1, T, 4), jnp.float32)
        f = jax.grad(
            lambda q, k, v, lf: blockwise_attention(
                q, k, v, causal=True, window=64, log_forget=lf, block_q=64, block_k=64
            ).sum(),
            argnums=(0, 1, 2, 3),
        )
        return f, (spec, spec, spec, lf)

    sizes, temps = [], []
    for t in (512, 1024):
        f, specs = grad_fn(t)
        sizes.append(len(jax.make_jaxpr(f)(*specs).eqns))
        temps.append(jax.jit(f).lower(*specs).compile().memory_analysis().temp_size_in_bytes)
    assert sizes[0] == sizes[1]
    assert temps[1] / temps[0] < 2.5, temps  # quadratic would be 4


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(window=0), r"window must be None .* >= 1.*got 0"),
        (dict(window=2.5), r"window .* got 2.5"),
        (dict(window=True), r"window .* got True"),
        (dict(log_forget=jnp.zeros((2, 45, 3))), r"log_forget must have shape \[B, S, N\]"),
        (dict(log_forget=jnp.zeros((2, 45, 4), jnp.int32)), "floating point"),
        (dict(causal=False, log_forget=jnp.zeros((2, 45, 4))), "needs causal=True"),
        (dict(q_offset=20, log_forget=jnp.zeros((2, 45, 4))), r"in \[0, S\)"),
    ],
)
def test_invalid_window_and_forget_raise_clear_errors(bad, message):
    q, k, v, _ = _inputs(2, jax.random.key(0))
    args = dict(causal=True, implementation="reference")
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        attention(q, k, v, **args)


def test_auto_and_cudnn_with_windows_and_forget(monkeypatch):
    """cuDNN takes a window only with its own causal mask at offset 0; forget gates make the
    bias per row (a materialised [B, N, T, S] on GPU, chunked's per-row limit on CPU)."""
    spec = jax.ShapeDtypeStruct((2, 256, 8, 64), jnp.bfloat16)
    lf = jax.ShapeDtypeStruct((2, 256, 8), jnp.float32)
    reason = functools.partial(cudnn.unsupported_reason, backend="gpu")
    assert reason(spec, spec, spec, bias=None, causal=True, static_offset=0, window=8) is None
    refused = reason(spec, spec, spec, bias=None, causal=False, static_offset=0, window=8)
    assert "sliding window" in refused
    assert "sliding window" in reason(
        spec, spec, spec, bias=None, causal=True, static_offset=None, window=8
    )
    odd = jax.ShapeDtypeStruct((2, 255, 8, 64), jnp.bfloat16)
    assert "even" in reason(odd, odd, odd, bias=None, causal=True, static_offset=0, log_forget=lf)
    no_kernel = type("M", (), {"unsupported_reason": staticmethod(lambda q, k, **kw: "no")})
    monkeypatch.setattr(attn_lib, "_pallas_module", lambda: no_kernel)
    choose = functools.partial(attn_lib.choose_implementation, causal=True, backend="gpu")
    assert choose(spec, spec, None, window=8) == "cudnn"
    assert choose(spec, spec, None, window=8, static_offset=None) == "blockwise"
    assert choose(spec, spec, None, log_forget=lf) == "cudnn"
    monkeypatch.setattr(attn_lib, "AUTO_CUDNN_MAX_BIAS", 2 * 8 * 256 * 256 - 1)  # B rows count
    assert choose(spec, spec, None, log_forget=lf) == "blockwise"
    cpu = jax.ShapeDtypeStruct((4, 512, 8, 64), jnp.float32)
    lf_cpu = jax.ShapeDtypeStruct((4, 512, 8), jnp.float32)
    monkeypatch.setattr(native, "supports", lambda q, k: "not built")  # its rule: test_native.py
    assert attn_lib.choose_implementation(cpu, cpu, None, backend="cpu") == "chunked"
    per_row = attn_lib.choose_implementation(cpu, cpu, None, backend="cpu", log_forget=lf_cpu)
    assert per_row == "blockwise"  # B N T S = 8 Mi: the per-row bias limit


def test_auto_asks_the_fused_kernel_for_the_backend_window_and_gates_it_decides_for(monkeypatch):
    """ "auto" off CPU passes the backend, the window and the forget gates to
    `pallas.unsupported_reason`, and `implementation="pallas"` runs the kernel with them."""
    from posattn.attention import pallas

    got = {}

    def reason(q, k, *, bias, causal=False, per_row=False, backend=None, **extra):
        got.update(backend=backend, **extra)
        return "refused" if extra.get("window") == 3 else None

    monkeypatch.setattr(pallas, "unsupported_reason", reason)
    q, k, v, _ = _inputs(2, jax.random.key(0))
    spec = jax.ShapeDtypeStruct(q.shape, q.dtype)
    assert attn_lib.choose_implementation(spec, spec, None, backend="tpu", window=4) == "pallas"
    assert got["backend"] == "tpu" and got["window"] == 4 and got["log_forget"] is None
    assert attn_lib.choose_implementation(spec, spec, None, backend="gpu", window=3) != "pallas"
    monkeypatch.undo()
    lf = -0.1 * jax.random.uniform(jax.random.key(1), (q.shape[0], k.shape[1], q.shape[2]))
    run = functools.partial(attention, q, k, v, causal=True, window=5, log_forget=lf)
    np.testing.assert_allclose(
        run(implementation="pallas"), run(implementation="reference"), atol=2e-6, rtol=1e-5
    )


def test_forget_helpers_are_float32_and_the_cases_are_meaningful():
    lf = log_forget_gates(jax.random.key(3), dtype=jnp.bfloat16)
    assert masks.forget_cumsum(lf).dtype == jnp.float32
    assert blockwise.DEFAULT_BLOCK_Q >= 16  # the grid's tiles (16 x 8) are smaller: several tiles
    assert {kw.get("window") for _, _, kw in WINDOW_CASES.values()} >= {1, 64}
