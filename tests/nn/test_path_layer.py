"""A PaTH layer (families 'path' and 'path_fox'): its output is the reference layer's
(fla-org/flash-linear-attention `fla/layers/path_attn.py`) computed in float64 from its own
parameters: w through a low-rank (or full) projection, a causal depthwise convolution of width 3,
SiLU and an L2 norm per head; beta = 2 sigmoid; FoX's gates; then the reference's chunked PaTH
attention (tests/path_reference.py). Then a cache continued by a chunk of several tokens at
per-row positions, and the refusals (the attention statistics: tests/eval)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from path_reference import naive_chunked

from posattn import families, hf
from posattn.nn import decode
from posattn.nn.config import ModelConfig
from posattn.nn.model import TransformerLM
from posattn.train import steps


def _cfg(**keys):
    base = dict(position="path", d_model=32, num_heads=4, num_kv_heads=4, num_layers=1)
    return ModelConfig.from_keys({**base, **keys}).validate()


def _model(**keys):
    return TransformerLM(_cfg(**keys), rngs=nnx.Rngs(0))


def _f64(param):
    return np.asarray(param[...], np.float64)


def _reference_layer(attn, x):
    """float64 output [B, T, D] of the reference layer with the parameters of `attn`."""
    B, T, D = x.shape
    N, H = attn.wq.shape[1:]
    K = attn.wk.shape[1]

    def heads(w, n):
        return (x @ _f64(w).reshape(D, -1)).reshape(B, T, n, H)

    q, k, v = heads(attn.wq, N), heads(attn.wk, K), heads(attn.wv, K)
    r = attn.path
    if hasattr(r, "w_proj"):
        w = x @ _f64(r.w_proj)
    else:
        w = x @ _f64(r.w_down) @ _f64(r.w_up)
    if hasattr(r, "conv"):  # torch's Conv1d(groups=K*H, padding=2), first T outputs, SiLU
        taps = _f64(r.conv)
        padded = np.concatenate([np.zeros((B, 2, w.shape[-1])), w], axis=1)
        w = sum(padded[:, c : c + T] * taps[c] for c in range(3))
        w = w / (1 + np.exp(-w))
    w = w.reshape(B, T, K, H)
    w = w / np.sqrt(np.sum(w * w, -1, keepdims=True) + 1e-6)
    beta = 2 / (1 + np.exp(-(x @ _f64(r.beta_w) + _f64(r.beta_b))))
    if attn.forget is not None:
        g = -np.log1p(np.exp(-(x @ _f64(attn.forget.w) + _f64(attn.forget.b))))
    else:
        g = np.zeros((B, T, N))
    o = naive_chunked(q, k, v, w, beta, g, attn.scale, 4)  # (B, T, N, H)
    return o.reshape(B, T, N * H) @ _f64(attn.wo).reshape(N * H, D)


@pytest.mark.parametrize(
    "keys",
    [
        dict(),  # MHA: w's low-rank projection, the convolution
        dict(position="path_fox", num_kv_heads=2),  # GQA: a full projection; forget gates
        dict(path_conv=False, path_w_rank=0),
        dict(position="path_fox", path_w_rank=8, num_kv_heads=1),  # MQA: full regardless
    ],
)
def test_the_layer_is_the_reference_layer(keys):
    model = _model(**keys)
    attn = model.blocks[0].attn
    r = attn.path
    low_rank = keys.get("num_kv_heads", 4) == 4 and keys.get("path_w_rank", 32) > 0
    assert hasattr(r, "w_down") == low_rank and hasattr(r, "w_proj") == (not low_rank)
    if low_rank:
        assert r.w_down.shape == (32, keys.get("path_w_rank", 32))
    assert hasattr(r, "conv") == keys.get("path_conv", True)
    np.testing.assert_array_equal(r.beta_b[...], 0.0)  # beta = 1 at x = 0
    # a nonzero beta bias, so that the test sees where it enters
    r.beta_b[...] = jax.random.normal(jax.random.key(3), r.beta_b.shape)
    x = jax.random.normal(jax.random.key(2), (2, 11, 32))
    got, _ = nnx.jit(lambda layer, x: layer(x))(attn, x)  # compiled: faster than op by op
    want = _reference_layer(attn, np.asarray(x, np.float64))
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-5)


def test_a_chunk_of_several_tokens_continues_a_cache_at_per_row_positions():
    """Prefill (ragged prompts), two decode steps, then a chunk of 5 tokens per row through
    `extend` (path_attention over the cache, whose rows carry no reflection): the full forward's
    logits, and the cache it leaves continues exactly."""
    cfg = ModelConfig.from_keys(
        dict(
            position="path_fox",
            d_model=16,
            num_heads=4,
            num_kv_heads=2,
            num_layers=2,
            layer_pattern=("path_fox:window=6", "path_fox"),
        )
    ).validate()
    graphdef, params, constants = steps.init_model(cfg, jax.random.key(0))
    model = nnx.merge(graphdef, params, constants)
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, 256)
    full = jax.jit(lambda p, c, t: nnx.merge(graphdef, p, c)(t))(params, constants, tokens)
    prefill = jax.jit(decode.prefill, static_argnums=0)
    step = jax.jit(decode.decode_step, static_argnums=0)

    @jax.jit
    def extend(params, constants, cache, chunk, p):
        h, entries = nnx.merge(graphdef, params, constants).extend(
            chunk, cache.entries(), q_offset=p, kv_lengths=p + 5, seq_len=p + 5
        )
        return model.logits(h), decode._replace(cache, entries, p + 5, None)

    lengths = np.array([6, 3])
    cache = decode.init_cache(cfg, batch_size=2, capacity=24)
    _, cache = prefill(graphdef, params, constants, cache, tokens[:, :6], lengths)
    for _ in range(2):
        _, cache = step(graphdef, params, constants, cache, tokens[np.arange(2), cache.lengths])
    p = np.asarray(cache.lengths)  # [8, 5]
    rows = p[:, None] + np.arange(5)
    logits, cache = extend(
        params, constants, cache, tokens[np.arange(2)[:, None], rows], jnp.asarray(p)
    )
    want = full[np.arange(2)[:, None], rows]
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), atol=2e-5)
    logits, _ = step(graphdef, params, constants, cache, tokens[np.arange(2), p + 5])
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full[np.arange(2), p + 5]), atol=2e-5)
    assert cache.path_conv[0].shape == (2, 2, 2 * 4)  # the convolution's last two inputs


@pytest.mark.parametrize(
    "keys, match",
    [
        (dict(kind="encoder"), "PaTH moves each key .* needs a causal model"),
        (dict(kv_share=2, num_layers=2), "kv_share=2 is not supported with PaTH"),
        (dict(attn_logit_softcap=50.0), "PaTH kernel has no logit soft cap"),
        (dict(path_w_rank=-1), "config.model.path_w_rank=-1 is invalid"),
        (dict(path_conv="yes"), "config.model.path_conv='yes' is invalid"),
    ],
)
def test_what_path_cannot_do_is_refused_before_any_compute(keys, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**keys)


def test_transformers_has_no_path_attention():
    with pytest.raises(ValueError, match="transformers has no PaTH attention"):
        hf.model_type_of(_cfg(position="path_fox"))


def test_a_path_family_takes_no_other_signal():
    with pytest.raises(ValueError, match="a PaTH family carries no position signal"):
        families.register(
            families.Family(
                "path_abs", settings=families.PathSettings, reflections=True, embedding="sinusoidal"
            )
        )
    assert "path_abs" not in families.names()
