"""bfloat16 attention on CPU: the kernels run at shapes where XLA:CPU cannot compute a bfloat16 x
bfloat16 -> float32 product by itself, and give the float32 kernel's result on the same values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posattn import attention as attention_lib


def _close(actual, expected, tolerance):
    """Equal up to `tolerance` of the largest magnitude (bfloat16 keeps 8 significant bits)."""
    expected = np.asarray(expected, np.float32)
    atol = tolerance * float(np.abs(expected).max())
    np.testing.assert_allclose(np.asarray(actual, np.float32), expected, rtol=0, atol=atol)


@pytest.mark.parametrize("implementation", ["chunked", "blockwise"])
def test_bfloat16_attention_runs_and_matches_float32(implementation):
    B, T, N, H = 16, 256, 4, 32  # jax 0.10 failed to run the chunked kernel here before
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, d_out = (jax.random.normal(key, (B, T, N, H)).astype(jnp.bfloat16) for key in keys)

    def attend(q, k, v):
        return attention_lib.attention(q, k, v, causal=True, implementation=implementation)

    def grads(q, k, v):
        _, pull = jax.vjp(attend, q, k, v)
        return pull(d_out.astype(q.dtype))

    out, (dq, dk, dv) = jax.jit(attend)(q, k, v), jax.jit(grads)(q, k, v)
    wide = [x.astype(jnp.float32) for x in (q, k, v)]
    expected, expected_grads = jax.jit(attend)(*wide), jax.jit(grads)(*wide)
    assert out.dtype == dq.dtype == dk.dtype == dv.dtype == jnp.bfloat16
    _close(out, expected, 1e-2)
    for g, e in zip((dq, dk, dv), expected_grads, strict=True):
        _close(g, e, 3e-2)
