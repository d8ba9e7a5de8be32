"""Chunked attention equals the reference: forward and every gradient (q, k, v, bias params).

The kernel runs one batch row per chunk on the grid (the scan's carried bias gradient) and 2 or 4
rows per chunk in `test_chunked_rows_per_chunk` (the within-chunk sum); the inputs and the
comparison live in attention_cases.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
    CASES,
    GRID,
    N,
    S,
    T,
    _assert_close,
    _bias,
    _inputs,
    _reference_case,
    _value_and_grads,
    check_decode_step,
)

from posattn.attention import chunked


@pytest.mark.parametrize("impl", ["chunked"])
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


@pytest.mark.parametrize(
    "bias_kind, case",
    [("alibi", "causal_gqa"), ("array", "padding"), ("t5", "causal_per_batch_offset")],
)
def test_chunked_rows_per_chunk(bias_kind, case, monkeypatch):
    """4 batch rows in chunks of 1, 2 and 4 rows: same output and gradients as the reference."""
    K, kw = CASES[case]
    kw = {name: np.tile(x, 2) if isinstance(x, np.ndarray) else x for name, x in kw.items()}
    key = jax.random.key(11)
    q, k, v, d_out = (jnp.concatenate([x, 2 * x]) for x in _inputs(K, key))  # (4, ...)
    bias = _bias(bias_kind, key)
    want = _value_and_grads("reference", q, k, v, d_out, bias, **kw)
    for rows in (1, 2, 4):
        monkeypatch.setattr(chunked, "CHUNK_LOGITS", rows * N * T * S)
        _assert_close(
            _value_and_grads("chunked", q, k, v, d_out, bias, **kw),
            want,
            rtol=1e-5,
            name=f"rows={rows} ",
        )


@pytest.mark.parametrize("q_offset", [-20, 5])
def test_chunked_causal_tiles(q_offset, monkeypatch):
    """A static causal offset splits the queries into tiles that skip the keys above the diagonal
    (at -20 the first tile sees no key at all); output and gradients stay the reference's."""
    assert chunked._query_tiles(256, 256, 0, 128) == ((0, 128, 0, 128), (128, 256, 0, 256))
    assert chunked._query_tiles(256, 256, None, 128) == ((0, 256, 0, 256),)
    assert chunked._query_tiles(37, 45, -20, 16) == (
        (0, 16, 0, 1),
        (16, 32, 0, 12),
        (32, 37, 0, 17),
    )
    # a causal window of 8 also skips the keys below each tile's window
    assert chunked._query_tiles(40, 40, 0, 16, 8) == (
        (0, 16, 0, 16),
        (16, 32, 9, 32),
        (32, 40, 25, 40),
    )
    monkeypatch.setattr(chunked, "TILE_Q", 16)
    key = jax.random.key(12)
    q, k, v, d_out = _inputs(2, key)
    bias = _bias("alibi", key)
    want = _value_and_grads("reference", q, k, v, d_out, bias, causal=True, q_offset=q_offset)
    got = _value_and_grads("chunked", q, k, v, d_out, bias, causal=True, q_offset=q_offset)
    _assert_close(got, want, rtol=1e-5)


@pytest.mark.parametrize("impl", ["chunked"])
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


def test_decode_step_jit_vmap_and_traced_scale():
    check_decode_step("chunked")
