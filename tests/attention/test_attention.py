"""The attention core: the reference against a loop-by-loop NumPy oracle, "xla" against the
reference, validation errors, dtype rules, "cudnn"'s refusals and the "auto" rule per backend.
("chunked" and "blockwise" against the reference, gradients included: test_chunked.py and
test_blockwise.py; under a device mesh: test_partition.py.)"""

import functools
import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import primitive_input_dtypes

from posattn import attention as attn_lib
from posattn.attention import attention, cudnn, native

B, T, S, N, K, H = 2, 5, 7, 4, 2, 8


def _inputs(seed=0, T=T, S=S, N=N, K=K, dtype=jnp.float32):
    kq, kk, kv, kb = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (B, T, N, H), dtype)
    k = jax.random.normal(kk, (B, S, K, H), dtype)
    v = jax.random.normal(kv, (B, S, K, H), dtype)
    bias = jax.random.normal(kb, (N, T, S))
    return q, k, v, bias


def alibi_like(slopes, q_pos, k_pos):
    """-slope * (i - j): float32[N, t, s]."""
    return -slopes[:, None, None] * (q_pos[:, None] - k_pos[None, :]).astype(jnp.float32)


SLOPES = jnp.array([0.5, 0.25, 0.125, 0.0625])


def numpy_attention(q, k, v, *, bias, causal, q_offset, kv_lengths, scale):
    """Loop over every (batch, head, query): the textbook definition, in float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b_, t_, n_, h_ = q.shape
    s_, k_heads = k.shape[1], k.shape[2]
    offsets = np.broadcast_to(np.asarray(q_offset), (b_,))
    out = np.zeros_like(q)
    for b in range(b_):
        for n in range(n_):
            kh = n // (n_ // k_heads)  # query head n reads key/value head n // G
            for t in range(t_):
                i = offsets[b] + t
                logits = scale * k[b, :, kh] @ q[b, t, n]
                if bias is not None:
                    logits = logits + bias(b, n, t, i)
                visible = np.ones(s_, bool)
                if causal:
                    visible &= np.arange(s_) <= i
                if kv_lengths is not None:
                    visible &= np.arange(s_) < kv_lengths[b]
                if not visible.any():
                    continue  # a row with no visible key is zero
                w = np.exp(logits[visible] - logits[visible].max())
                out[b, t, n] = (w / w.sum()) @ v[b, visible, kh]
    return out


CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "causal_offset": dict(causal=True, q_offset=2),
    "causal_per_batch_offset": dict(causal=True, q_offset=np.array([0, 3])),
    "padding": dict(kv_lengths=np.array([7, 4])),
    "fully_masked_rows": dict(causal=True, q_offset=np.array([-2, 1]), kv_lengths=np.array([0, 5])),
}


@pytest.mark.parametrize("bias_kind", ["none", "array", "fn"])
@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_numpy_loops(case, bias_kind):
    q, k, v, bias = _inputs()
    kw = CASES[case]
    np_bias = None
    if bias_kind == "array":

        def np_bias(b, n, t, i):
            return np.asarray(bias)[n, t]

        arg = bias
    elif bias_kind == "fn":

        def np_bias(b, n, t, i):
            return -float(SLOPES[n]) * (i - np.arange(S))

        arg = (alibi_like, SLOPES)
    else:
        arg = None
    got = attention(q, k, v, bias=arg, implementation="reference", **kw)
    want = numpy_attention(
        q,
        k,
        v,
        bias=np_bias,
        causal=kw.get("causal", False),
        q_offset=kw.get("q_offset", 0),
        kv_lengths=kw.get("kv_lengths"),
        scale=1 / np.sqrt(H),
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias_kind", ["none", "array", "fn"])
@pytest.mark.parametrize("case", list(CASES))
def test_xla_matches_reference(case, bias_kind):
    q, k, v, bias = _inputs(1)
    arg = {"none": None, "array": bias, "fn": (alibi_like, SLOPES)}[bias_kind]
    kw = CASES[case]
    want = attention(q, k, v, bias=arg, implementation="reference", **kw)
    got = attention(q, k, v, bias=arg, implementation="xla", **kw)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["reference", "xla", "chunked"])
def test_fully_masked_rows_are_zero_and_gradients_finite(impl):
    q, k, v, _ = _inputs()
    kw = dict(causal=True, q_offset=np.array([-3, 0]), kv_lengths=np.array([7, 0]))
    out = attention(q, k, v, bias=(alibi_like, SLOPES), implementation=impl, **kw)
    np.testing.assert_array_equal(out[0, :3], 0.0)  # positions -3..-1 see no key
    np.testing.assert_array_equal(out[1], 0.0)  # no valid key at all
    grads = jax.grad(
        lambda q, k, v, s: attention(
            q, k, v, bias=(alibi_like, s), implementation=impl, **kw
        ).sum(),
        argnums=(0, 1, 2, 3),
    )(q, k, v, SLOPES)
    assert all(bool(jnp.isfinite(g).all()) for g in grads)


def test_per_batch_offset_equals_rows_run_separately():
    """A per-row q_offset evaluates the bias at each row's own positions (KV-cache decoding)."""
    q, k, v, _ = _inputs(2)
    offsets = np.array([0, 2])
    both = attention(
        q,
        k,
        v,
        bias=(alibi_like, SLOPES),
        causal=True,
        q_offset=offsets,
        implementation="reference",
    )
    for b in range(B):
        row = attention(
            q[b : b + 1],
            k[b : b + 1],
            v[b : b + 1],
            bias=(alibi_like, SLOPES),
            causal=True,
            q_offset=int(offsets[b]),
            implementation="reference",
        )
        # Separately compiled programs (a batch of 2, a batch of 1): float32 rounding apart.
        np.testing.assert_allclose(both[b : b + 1], row, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["reference", "xla", "chunked", "blockwise"])
def test_bfloat16_keeps_dtype_and_softmax_runs_in_float32(impl):
    q, k, v, bias = _inputs(3, dtype=jnp.bfloat16)

    def run(q, k, v):
        return attention(q, k, v, bias=bias, causal=True, implementation=impl)

    out = run(q, k, v)
    assert out.dtype == jnp.bfloat16

    # Every exponential of the forward and backward programs takes float32 logits.
    def loss(q, k, v):
        return run(q, k, v).astype(jnp.float32).sum()

    for program in (run, jax.grad(loss, argnums=(0, 1, 2))):
        dtypes = primitive_input_dtypes(program, q, k, v)
        assert dtypes and set(dtypes) == {"float32"}, dtypes
    # Values: the float32 reference on the same (bfloat16-rounded) inputs, within one bfloat16
    # epsilon (2^-7) of the output's scale; the output's own rounding is half of that.
    want = attention(
        *(x.astype(jnp.float32) for x in (q, k, v)),
        bias=bias,
        causal=True,
        implementation="reference",
    )
    np.testing.assert_allclose(out.astype(jnp.float32), want, atol=2**-7, rtol=2**-7)


def test_scale_default_and_t5_scale():
    q, k, v, _ = _inputs(4)
    default = attention(q, k, v, implementation="reference")
    explicit = attention(q, k, v, scale=1 / np.sqrt(H), implementation="reference")
    np.testing.assert_allclose(default, explicit, rtol=1e-5, atol=1e-6)
    unscaled = attention(q / np.sqrt(H), k, v, scale=1.0, implementation="reference")
    np.testing.assert_allclose(unscaled, default, rtol=1e-5, atol=1e-6)


def test_jit_with_traced_offset_and_vmap():
    q, k, v, _ = _inputs(5)
    f = jax.jit(
        lambda q, k, v, off: attention(
            q, k, v, bias=(alibi_like, SLOPES), causal=True, q_offset=off, implementation="xla"
        )
    )
    np.testing.assert_allclose(
        f(q, k, v, jnp.int32(2)),
        attention(
            q, k, v, bias=(alibi_like, SLOPES), causal=True, q_offset=2, implementation="reference"
        ),
        rtol=1e-5,
        atol=1e-6,
    )
    stacked = jax.vmap(lambda q, k, v: attention(q, k, v, causal=True, implementation="reference"))(
        q[None].repeat(3, 0), k[None].repeat(3, 0), v[None].repeat(3, 0)
    )
    unbatched = attention(q, k, v, causal=True, implementation="reference")
    np.testing.assert_allclose(stacked[1], unbatched, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "impl", [i for i in attn_lib.IMPLEMENTATIONS if i not in ("auto", "cudnn")]
)
def test_a_constant_cotangent_gives_the_same_gradients(impl):
    """The gradients of `out.sum()` (its cotangent a constant that XLA sees when it compiles:
    XLA:CPU of jaxlib 0.10.2 computed wrong dq and dk for "chunked" from it) equal those of
    `sum(out * c)` with c = 1 an argument, compiled: with a bias function, a soft cap where the
    implementation takes one, and two-score attention (`Far`) where it does."""
    q, k, v, _ = _inputs(7, T=24, S=24)
    kw = dict(causal=True, bias=(alibi_like, SLOPES), implementation=impl)
    variants = {"bias": kw}
    if impl in attn_lib.SOFTCAP_IMPLEMENTATIONS:
        variants["softcap"] = dict(kw, softcap=5.0)
    if impl in attn_lib.FAR_IMPLEMENTATIONS:
        variants["far"] = dict(kw, far=attn_lib.Far(0.5 * q, k, 5))
    for name, kw in variants.items():

        def loss(q, k, v, c, kw=kw):
            return jnp.sum(attention(q, k, v, **kw) * c)

        grad = jax.grad(loss, argnums=(0, 1, 2))
        want = jax.jit(grad)(q, k, v, jnp.ones(q.shape))
        got = jax.jit(lambda q, k, v, grad=grad: grad(q, k, v, 1.0))(q, k, v)
        for label, x, y in zip("qkv", got, want, strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5, err_msg=f"{name}: d{label}")


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(q=jnp.zeros((B, T, N))), "q must be 4-D"),
        (dict(k=jnp.zeros((B, S, K, H + 1)), v=jnp.zeros((B, S, K, H + 1))), "head dim"),
        (dict(k=jnp.zeros((B, S, 3, H)), v=jnp.zeros((B, S, 3, H))), "multiple of key/value heads"),
        (dict(v=jnp.zeros((B, S + 1, K, H))), "same shape"),
        (dict(k=jnp.zeros((B + 1, S, K, H)), v=jnp.zeros((B + 1, S, K, H))), "batch size"),
        (dict(bias=jnp.zeros((N, T, S + 1))), r"\[N, T, S\]"),
        (dict(bias=(jnp.zeros(3), None)), r"\(BiasFn, params\)"),
        (dict(q_offset=jnp.zeros((B + 1,), jnp.int32)), "q_offset"),
        (dict(kv_lengths=jnp.zeros((B, 1), jnp.int32)), "kv_lengths"),
        (dict(implementation="flash"), "allowed: auto, reference, xla, chunked, native, blockwise"),
    ],
)
def test_invalid_inputs_raise_clear_errors(bad, message):
    q, k, v, _ = _inputs()
    args = dict(q=q, k=k, v=v, implementation="reference")
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_auto_rule_and_logged_once(caplog, monkeypatch):
    # The rule where the native kernel cannot run (test_native.py checks the rule where it can).
    monkeypatch.setattr(native, "supports", lambda q, k: "not built")

    def spec(B, T):
        return jax.ShapeDtypeStruct((B, T, 8, 64), jnp.float32)

    small, big = spec(1, 128), spec(1, 4096)
    assert attn_lib.choose_implementation(small, small, None) == "chunked"
    assert attn_lib.choose_implementation(big, big, None) == "blockwise"
    # One head's logits reach 1Mi at T = S = 1024, whatever the batch: blockwise from there.
    assert attn_lib.choose_implementation(spec(64, 1023), spec(64, 1023), None) == "chunked"
    assert attn_lib.choose_implementation(spec(1, 1024), spec(1, 1024), None) == "blockwise"
    # Per-row positions or lengths: "chunked" materialises [B, N, T, S], so the batch counts too.
    assert (
        attn_lib.choose_implementation(spec(3, 512), spec(3, 512), None, per_row=True) == "chunked"
    )
    assert (
        attn_lib.choose_implementation(spec(4, 512), spec(4, 512), None, per_row=True)
        == "blockwise"
    )
    decode_q, cache = (
        spec(64, 1),
        spec(64, 16384),
    )  # one token per row over a 16k cache: 8 Mi logits
    assert attn_lib.choose_implementation(decode_q, cache, None, per_row=True) == "blockwise"
    fn_bias = (alibi_like, SLOPES)
    attn_lib._logged_choices.clear()
    with caplog.at_level(logging.INFO, logger="posattn.attention"):
        for _ in range(3):
            attn_lib.choose_implementation(big, big, fn_bias)
    assert sum("implementation='auto'" in r.getMessage() for r in caplog.records) == 1
    # "auto" returns what the chosen implementation returns.
    q, k, v, _ = _inputs(6)
    np.testing.assert_allclose(
        attention(q, k, v, causal=True),
        attention(q, k, v, causal=True, implementation="reference"),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.parametrize("impl", ["reference", "xla", "chunked", "blockwise"])
def test_nope_is_permutation_equivariant(impl):
    """With no position signal and no mask, permuting the tokens permutes the output."""
    q, k, v, _ = _inputs(7, T=S)
    perm = np.random.default_rng(0).permutation(S)
    out = attention(q, k, v, implementation=impl)
    permuted = attention(q[:, perm], k[:, perm], v[:, perm], implementation=impl)
    np.testing.assert_allclose(permuted, out[:, perm], rtol=1e-5, atol=1e-6)


def test_cudnn_refuses_what_it_cannot_run():
    """implementation="cudnn" raises a clear ValueError before any compute where cuDNN cannot
    run: on this CPU, and on a GPU for dtypes, head dims and odd lengths it does not take."""
    q, k, v, bias = _inputs()
    with pytest.raises(ValueError, match="implementation='cudnn' needs a CUDA GPU.*'cpu'"):
        attention(q, k, v, causal=True, implementation="cudnn")
    reason = functools.partial(cudnn.unsupported_reason, causal=True, static_offset=0)

    def spec(T=64, H=64, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct((2, T, 4, H), dtype)

    assert reason(spec(), spec(), spec(), bias=None, backend="gpu") is None
    assert reason(spec(), spec(), spec(), bias=None, backend="tpu").startswith("needs a CUDA GPU")
    f32 = spec(dtype=jnp.float32)
    assert "float16 or bfloat16" in reason(f32, f32, f32, bias=None, backend="gpu")
    h12 = spec(H=12)
    assert "head dim" in reason(h12, h12, h12, bias=None, backend="gpu")
    odd = spec(T=63)
    assert reason(odd, odd, odd, bias=None, backend="gpu") is None  # no bias: any length
    assert "even" in reason(odd, odd, odd, bias=(alibi_like, SLOPES), backend="gpu")


def test_auto_decides_per_backend(monkeypatch):
    """CPU without the native kernel: the measured chunked/blockwise rule. GPU and TPU: never
    "chunked" (tuned on CPU); on a GPU "cudnn" where there is nothing to materialise or skip and
    cuDNN takes the inputs; else "pallas" where that kernel exists for the inputs, else "cudnn"
    on a GPU where cuDNN takes the inputs, else "blockwise"."""

    def spec(B=2, T=256, H=64, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct((B, T, 8, H), dtype)

    fn_bias = (alibi_like, SLOPES)
    choose = functools.partial(attn_lib.choose_implementation, causal=True)
    monkeypatch.setattr(native, "supports", lambda q, k: "not built")
    assert choose(spec(), spec(), fn_bias, backend="cpu") == "chunked"
    no_kernel = types.SimpleNamespace(unsupported_reason=lambda q, k, **kw: "no kernel")
    monkeypatch.setattr(attn_lib, "_pallas_module", lambda: no_kernel)
    assert choose(spec(), spec(), fn_bias, backend="gpu") == "cudnn"
    assert choose(spec(), spec(), None, backend="tpu") == "blockwise"
    for bad in (spec(dtype=jnp.float32), spec(H=12), spec(T=255)):
        assert choose(bad, bad, fn_bias, backend="gpu") == "blockwise"
    # A bias cuDNN would need materialised past AUTO_CUDNN_MAX_BIAS elements: blockwise.
    monkeypatch.setattr(attn_lib, "AUTO_CUDNN_MAX_BIAS", 8 * 256 * 256 - 1)
    assert choose(spec(), spec(), fn_bias, backend="gpu") == "blockwise"
    assert choose(spec(), spec(), None, backend="gpu") == "cudnn"  # no bias to materialise
    # The fused kernel first where it exists for the inputs and there is a bias, forget gates or
    # a window for it to handle; with none of them, cuDNN on a GPU (measured faster, H200).
    refuses = {"value": None}
    fake = types.SimpleNamespace(unsupported_reason=lambda q, k, **kw: refuses["value"])
    monkeypatch.setattr(attn_lib, "_pallas_module", lambda: fake)
    assert choose(spec(), spec(), fn_bias, backend="gpu") == "pallas"
    assert choose(spec(), spec(), fn_bias, backend="tpu") == "pallas"
    assert choose(spec(), spec(), None, backend="gpu") == "cudnn"
    assert choose(spec(), spec(), None, backend="gpu", window=64) == "pallas"
    forget = jax.ShapeDtypeStruct((2, 256, 8), jnp.float32)
    assert choose(spec(), spec(), None, backend="gpu", log_forget=forget) == "pallas"
    assert choose(spec(), spec(), None, backend="tpu") == "pallas"
    # A causal offset other than 0 (a decode step, per-row positions) cuDNN would materialise.
    assert choose(spec(), spec(), None, backend="gpu", static_offset=None) == "pallas"
    assert choose(spec(), spec(), None, backend="gpu", static_offset=5) == "pallas"
    bad = spec(H=12)  # no bias, but a head dim cuDNN refuses: the fused kernel
    assert choose(bad, bad, None, backend="gpu") == "pallas"
    refuses["value"] = "not for these inputs"
    assert choose(spec(), spec(), None, backend="gpu") == "cudnn"
    # The backend comes from jax.default_backend() when not given, and "auto" follows it.
    monkeypatch.setattr(attn_lib, "_pallas_module", lambda: no_kernel)
    monkeypatch.setattr(attn_lib, "_backend", lambda: "tpu")
    assert attn_lib.choose_implementation(spec(), spec(), fn_bias) == "blockwise"
    q, k, v, _ = _inputs(3)
    np.testing.assert_allclose(
        attention(q, k, v, bias=fn_bias, causal=True),
        attention(q, k, v, bias=fn_bias, causal=True, implementation="reference"),
        rtol=1e-5,
        atol=1e-6,
    )
