"""Soft-capped attention logits (Gemma 2's `attn_logit_softcapping`): c * tanh(scale q.k / c)
in place of scale q.k, before the bias, the forget term and the mask.

The oracle (`attention_cases.oracle_attention(softcap=)`) writes the cap from that definition,
sharing no code with `posattn.attention`; "reference", "chunked", "native" (where its kernel
builds), "blockwise" and "pallas" (interpret mode; a (BiasFn, params) bias), the ones that
compute it, match its output and every gradient (q, k, v, the bias parameters, log_forget) over
the masking and window grids. "xla" and "cudnn" refuse a cap by name, and "auto" never picks
them for one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
    _assert_close,
    _value_and_grads,
    grid_case,
)

from posattn import attention as attn_lib
from posattn.attention import attention, chunked, native

CAP = 1.5  # q, k ~ N(0, 1) with H 8: logits of ~1, so the cap bends most of them
IMPLEMENTATIONS = ("reference", "chunked", "blockwise") + (
    ("native",) if native.available() else ()
)

POINTS = [
    ("alibi", "causal_gqa"),
    ("fire", "causal_per_batch_offset"),
    ("array", "padding"),
    ("none", "fully_masked_rows"),
    ("t5", "plain_mha"),
    ("alibi", "window_causal_gqa_ragged_per_row_offset"),
    ("none", "forget_gqa"),
    ("alibi", "forget_window_decode_block_mqa"),
]


def _case(bias_kind, case):
    return grid_case(bias_kind, case, seed=300)


@pytest.mark.parametrize("bias_kind, case", POINTS)
def test_every_implementation_matches_the_oracle_and_its_gradients(bias_kind, case, monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK_LOGITS", 1)  # chunked: one batch row per chunk
    monkeypatch.setattr(chunked, "TILE_Q", 16)  # chunked: causal query tiles of 16
    inputs, bias, kw = _case(bias_kind, case)
    want = _value_and_grads("oracle", *inputs, bias, softcap=CAP, **dict(kw))
    uncapped = _value_and_grads("oracle", *inputs, bias, **dict(kw))
    # the cap changes the output and the gradients: the comparison below can fail
    assert np.max(np.abs(np.asarray(want[0]) - np.asarray(uncapped[0]))) > 0.05
    assert np.max(np.abs(np.asarray(want[1][0]) - np.asarray(uncapped[1][0]))) > 0.05
    # "pallas" in interpret mode; it takes a (BiasFn, params) bias only
    pallas = ("pallas",) if bias_kind != "array" else ()
    for impl in IMPLEMENTATIONS + pallas:
        got = _value_and_grads(impl, *inputs, bias, softcap=CAP, **dict(kw))
        _assert_close(got, want, rtol=1e-5, atol=1e-5, name=f"{impl} ")


def test_a_large_cap_is_the_uncapped_attention_and_the_cap_is_the_formula():
    (q, k, v, _), bias, kw = _case("alibi", "causal_gqa")
    plain = attention(q, k, v, bias=bias, implementation="reference", **kw)
    loose = attention(q, k, v, bias=bias, softcap=1e4, implementation="reference", **kw)
    np.testing.assert_allclose(loose, plain, atol=1e-5)
    # One query and two keys, no bias: softmax over c tanh(s / c) by hand.
    q1 = jnp.array([[[[1.0, 2.0]]]])  # (1, 1, 1, 2)
    k1 = jnp.array([[[[3.0, 0.0]], [[0.0, -1.0]]]])  # (1, 2, 1, 2)
    v1 = jnp.array([[[[1.0, 0.0]], [[0.0, 1.0]]]])
    s = np.array([3.0, -2.0]) * 0.5
    capped = 2.0 * np.tanh(s / 2.0)
    p = np.exp(capped - capped.max())
    p /= p.sum()
    for impl in ("reference", "chunked", "blockwise"):  # H 2: not a native head size
        got = attention(q1, k1, v1, scale=0.5, softcap=2.0, implementation=impl)
        np.testing.assert_allclose(got[0, 0, 0], p, rtol=1e-6, err_msg=impl)


@pytest.mark.parametrize("impl", ["xla", "cudnn"])
def test_implementations_without_the_cap_refuse_it_by_name(impl):
    (q, k, v, _), _, _ = _case("none", "causal_gqa")
    with pytest.raises(ValueError, match=f"implementation='{impl}' does not compute soft-capped"):
        attention(q, k, v, causal=True, softcap=CAP, implementation=impl)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), True, "50"])
def test_a_bad_cap_is_refused(bad):
    (q, k, v, _), _, _ = _case("none", "causal_gqa")
    with pytest.raises(ValueError, match="softcap="):
        attention(q, k, v, causal=True, softcap=bad)


def test_auto_keeps_the_cpu_rule_and_elsewhere_never_picks_cudnn():
    q = jax.ShapeDtypeStruct((2, 64, 4, 16), jnp.float32)
    long_q = jax.ShapeDtypeStruct((1, 2048, 4, 16), jnp.float32)
    array_bias = jnp.zeros((4, 64, 64))  # a materialised bias, which the Pallas kernel refuses
    for backend in ("cpu", "gpu", "tpu"):
        for x in (q, long_q):
            pick = attn_lib.choose_implementation(
                x, x, None, causal=True, backend=backend, softcap=CAP
            )
            plain = attn_lib.choose_implementation(x, x, None, causal=True, backend=backend)
            assert pick == (plain if backend == "cpu" else "pallas"), (backend, x.shape)
        pick = attn_lib.choose_implementation(
            q, q, array_bias, causal=True, backend=backend, softcap=CAP
        )
        plain = attn_lib.choose_implementation(q, q, array_bias, causal=True, backend=backend)
        assert pick == (plain if backend == "cpu" else "chunked"), backend
