"""Blockwise attention equals the reference: forward and every gradient (q, k, v, bias params).

Tiles are small (8 x 16) and lengths ragged so every path (padding, diagonal tiles, skipped tiles)
is exercised; the inputs and the comparison live in attention_cases.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
    GRID,
    _assert_close,
    _bias,
    _inputs,
    _reference_case,
    _value_and_grads,
    alibi_like,
    check_decode_step,
)

from posattn.attention import attention, chunked
from posattn.attention.blockwise import blockwise_attention


@pytest.mark.parametrize("impl", ["blockwise"])
@pytest.mark.parametrize("bias_kind, case", GRID)
def test_matches_reference(impl, bias_kind, case, monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK_LOGITS", 1)  # chunked: one batch row per chunk
    monkeypatch.setattr(chunked, "TILE_Q", 16)  # chunked: causal query tiles of 16 (static offsets)
    inputs, bias, kw, want = _reference_case(bias_kind, case)
    got = _value_and_grads(impl, *inputs, bias, **kw)
    _assert_close(got, want, rtol=1e-5)
    if case == "fully_masked_rows":
        np.testing.assert_array_equal(got[0][0, :20], 0.0)  # positions -20..-1 see no key
        np.testing.assert_array_equal(got[0][1], 0.0)  # kv_lengths 0


@pytest.mark.parametrize("impl", ["blockwise"])
def test_bfloat16(impl):
    key = jax.random.key(7)
    q, k, v, d_out = _inputs(2, key, jnp.bfloat16)
    bias = _bias("alibi", key)
    out, grads = _value_and_grads(impl, q, k, v, d_out, bias, causal=True)
    assert out.dtype == jnp.bfloat16 and grads[0].dtype == jnp.bfloat16
    # The oracle sees the same bfloat16 values, computed in float32.
    f32 = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
    want = _value_and_grads("reference", *f32, bias, causal=True)
    _assert_close((out, grads), want, rtol=3e-2)


def test_through_attention_and_default_tiles():
    """implementation="blockwise" reaches the same kernel (default tiles, one tile here)."""
    key = jax.random.key(8)
    q, k, v, _ = _inputs(2, key)
    bias = _bias("alibi", key)
    got = attention(q, k, v, bias=bias, causal=True, implementation="blockwise")
    want = attention(q, k, v, bias=bias, causal=True, implementation="reference")
    _assert_close(got, want, rtol=1e-5)


def test_decode_step_jit_vmap_and_traced_scale():
    check_decode_step("blockwise")


def test_causal_tiles_above_the_diagonal_are_never_computed():
    """Count the bias tiles evaluated: with 4 x 4 tiles only the 10 on or below the diagonal
    run, forward and backward, for a causal 64-token self-attention."""
    seen = []

    def counting_bias(slopes, q_pos, k_pos):
        jax.debug.callback(lambda qp, kp: seen.append((int(qp), int(kp))), q_pos[0], k_pos[0])
        return alibi_like(slopes, q_pos, k_pos)

    q, k, v, d_out = _inputs(2, jax.random.key(10), T=64, S=64)
    bias = (counting_bias, jnp.array([0.5, 0.25, 0.125, 0.0625]))
    blockwise_attention(
        q[:1], k[:1], v[:1], bias=bias, causal=True, block_q=16, block_k=16
    ).block_until_ready()
    assert sorted(set(seen)) == [(i, j) for i in range(0, 64, 16) for j in range(0, i + 1, 16)]
    assert len(seen) == 10
    seen.clear()
    jax.grad(
        lambda q: blockwise_attention(
            q, k[:1], v[:1], bias=bias, causal=True, block_q=16, block_k=16
        ).sum()
    )(q[:1]).block_until_ready()
    assert len(seen) == 10 + 10  # forward once, backward once


def test_program_size_and_memory_do_not_grow_quadratically():
    """Same jaxpr size at any T (loops, not unrolled); compiled temporary memory of the forward
    and backward grows linearly with T."""

    def grad_fn(T):
        spec = jax.ShapeDtypeStruct((1, T, 8, 64), jnp.float32)
        f = jax.grad(
            lambda q, k, v: blockwise_attention(
                q,
                k,
                v,
                bias=(alibi_like, jnp.full((8,), 0.1)),
                causal=True,
                block_q=128,
                block_k=128,
            ).sum(),
            argnums=(0, 1, 2),
        )
        return f, spec

    sizes, temps = [], []
    for t in (1024, 2048):
        f, spec = grad_fn(t)
        sizes.append(len(jax.make_jaxpr(f)(spec, spec, spec).eqns))
        temps.append(
            jax.jit(f).lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes
        )
    assert sizes[0] == sizes[1]
    assert temps[1] / temps[0] < 2.5, temps  # quadratic would be 4
