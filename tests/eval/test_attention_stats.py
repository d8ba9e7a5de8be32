"""Attention statistics per layer and head against closed forms, and the probabilities against
the layer's own attention output."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config
from flax import nnx

from posattn import config as config_lib
from posattn import positions
from posattn.eval import attention_stats
from posattn.nn import layers
from posattn.train import steps


def _model(position, **extra):
    cfg = config_lib.validate(small_config(model__position=position, model__max_len=64, **extra))
    return cfg, *steps.init_model(cfg, jax.random.key(0))


def _zero_queries(params):
    """Every query 0: logits are the position bias alone (uniform attention without one)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if "wq" in jax.tree_util.keystr(path) else x, params
    )


def _bias_softmax(cfg, position, T):
    """Each head's probabilities float64[T, T] when every query is 0: the causal softmax of the
    bias alone (uniform for NoPE, ALiBi's slopes otherwise)."""
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    if position == "nope":
        slopes = np.zeros(cfg.num_heads)
    else:
        slopes = np.asarray(positions.alibi_slopes(cfg.num_heads), np.float64)
    out = []
    for m in slopes:
        logits = np.where(j <= i, -m * (i - j), -np.inf)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        out.append(p / p.sum(-1, keepdims=True))
    return out


def _closed_form(p, L):
    """entropy, distance, mass beyond L of probabilities p[T, T] over the last min(T, L) rows."""
    T = p.shape[0]
    i = np.arange(T)[:, None]
    j = np.arange(T)[None, :]
    rows = slice(T - min(T, L), T)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(p > 0, p * np.log(p), 0.0).sum(-1)
    dist = (p * np.maximum(i - j, 0)).sum(-1)
    mass = (p * (i - j >= L)).sum(-1)
    return ent[rows].mean(), dist[rows].mean(), mass[rows].mean()


@pytest.mark.parametrize("position", ["nope", "alibi"])
def test_stats_match_closed_forms(position):
    cfg, graphdef, params, constants = _model(position)
    params = _zero_queries(params)
    T, L = 48, 16
    windows = np.random.default_rng(0).integers(0, 256, size=(2, T))
    stats = attention_stats.attention_stats(graphdef, params, constants, windows, train_len=L)
    for head, p in enumerate(_bias_softmax(cfg, position, T)):
        want = _closed_form(p, L)
        for layer in range(cfg.num_layers):
            got = [stats[k][layer][head] for k in ("entropy", "distance", "mass_beyond_L")]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "position, keys",
    [
        ("rope", {}),
        ("alibi", dict(model__attn_logit_softcap=0.05)),  # a cap before the bias
        # RoPE remaps: the far pairs (distance >= 5) score with the far rotations
        ("rope", dict(model__rope_remap={"type": "rerope", "window": 5})),
        ("rope", dict(model__rope_remap={"type": "self_extend", "window": 6, "group": 3})),
        # stick-breaking weights, the remainder on each query's own key; and a windowed layer
        # that drops it under a softmax layer
        ("stick_breaking", {}),
        (
            "stick_breaking",
            dict(
                model__layer_pattern=(
                    "stick_breaking:window=5,stick_breaking_remainder=none",
                    "alibi",
                )
            ),
        ),
        # CoPE's weights, its table drawn at random (zero at initialisation: a plain softmax),
        # 8 positions for 24 keys (the far ones clamped), gate keys of its own; a windowed CoPE
        # layer under RoPE, its gates from the values
        ("cope", dict(model__cope_positions=8, model__cope_gates="separate")),
        (
            "cope",
            dict(
                model__layer_pattern=(
                    "cope:window=6,cope_scale_positions=False,cope_gates=values",
                    "rope",
                )
            ),
        ),
        # PaTH's weights with forget gates (the forget term scaled); a windowed PaTH layer
        # under RoPE
        ("path_fox", {}),
        ("path", dict(model__layer_pattern=("path:window=6", "rope"))),
    ],
)
def test_probabilities_reproduce_each_layers_attention(position, keys):
    cfg, graphdef, params, constants = _model(position, model__num_kv_heads=2, **keys)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: (
            jax.random.normal(jax.random.key(3), x.shape, x.dtype)
            if "cope" in jax.tree_util.keystr(path)
            else x
        ),
        params,
    )
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, size=(2, 24)), jnp.int32)
    probs = attention_stats.attention_probabilities(graphdef, params, constants, tokens)
    model = nnx.merge(graphdef, params, constants)
    x = model.embed_tokens(tokens)
    pos = layers.token_positions(0, 24)
    for layer, block in enumerate(model.blocks):
        h = block.attn_norm(x)
        _, v = block.attn.project_kv(h, pos, seq_len=24)
        want, _ = block.attn(h)  # (B, T, D): the layer's own attention
        v_rep = jnp.repeat(v, cfg.num_heads // cfg.num_kv_heads, axis=2)  # (B, S, N, H)
        out = jnp.einsum("bnts,bsnh->btnh", probs[layer], v_rep)
        got = layers.dense(out.reshape(2, 24, -1), block.attn.wo[...].reshape(-1, cfg.d_model))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        assert probs[layer].shape == (2, cfg.num_heads, 24, 24)
        x, _ = block(x)


@pytest.mark.parametrize("position", ["nope", "alibi"])
def test_head_scores_match_closed_forms(position):
    """With every query 0 the probabilities are the bias's softmax: the scores are its entries
    on the first sub-diagonal and the (period - 1)-th, averaged as defined."""
    cfg, graphdef, params, constants = _model(position)
    params = _zero_queries(params)
    period, T = 7, 20
    string = np.random.default_rng(2).integers(97, 123, size=(3, period))
    tokens = np.tile(string, (1, 3))[:, :T]
    got = attention_stats.head_scores(graphdef, params, constants, tokens, period=period)
    for head, p in enumerate(_bias_softmax(cfg, position, T)):
        prev = np.mean([p[q, q - 1] for q in range(1, T)])
        ind = np.mean([p[q, q - period + 1] for q in range(period, T)])
        for layer in range(cfg.num_layers):
            np.testing.assert_allclose(got["previous_token"][layer][head], prev, rtol=1e-5)
            np.testing.assert_allclose(got["induction"][layer][head], ind, rtol=1e-5)
    if position == "nope":  # uniform over q + 1 keys: the previous token's weight is 1 / (q + 1)
        np.testing.assert_allclose(got["previous_token"][0][0], np.mean(1 / np.arange(2, T + 1)))


@pytest.mark.parametrize("start", [0, 5])
def test_head_scores_read_the_layers_probabilities(start):
    _, graphdef, params, constants = _model("rope", model__num_kv_heads=2)
    period, rng = 8, np.random.default_rng(3)
    tokens = np.concatenate(  # `start` tokens of anything, then a string written twice
        [rng.integers(0, 256, size=(2, start)), np.tile(rng.integers(97, 123, (2, period)), 2)], 1
    )
    T = tokens.shape[1]
    got = attention_stats.head_scores(
        graphdef, params, constants, tokens, period=period, start=start
    )
    probs = attention_stats.attention_probabilities(
        graphdef, params, constants, jnp.asarray(tokens, jnp.int32)
    )
    for layer, p in enumerate(probs):
        p = np.asarray(p, np.float64)  # (B, N, T, T)
        prev = np.mean([p[:, :, q, q - 1] for q in range(start + 1, T)], axis=(0, 1))
        ind = np.mean([p[:, :, q, q - period + 1] for q in range(start + period, T)], axis=(0, 1))
        np.testing.assert_allclose(got["previous_token"][layer], prev, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(got["induction"][layer], ind, rtol=1e-5, atol=1e-7)
        if start:
            early = np.mean([p[:, :, q, :start].sum(-1) for q in range(start + period, T)], (0, 1))
            np.testing.assert_allclose(got["before_start"][layer], early, rtol=1e-5, atol=1e-7)
    assert ("before_start" in got) == (start > 0)


def test_head_scores_in_chunks_equal_one_pass(monkeypatch):
    _, graphdef, params, constants = _model("alibi")
    tokens = np.tile(np.random.default_rng(4).integers(97, 123, size=(5, 8)), (1, 2))
    whole = attention_stats.head_scores(graphdef, params, constants, tokens, period=8)
    # 2 strings a chunk (4 heads x 16 x 16 floats each): chunks of 2, 2 and 1 padded to 2.
    monkeypatch.setattr(attention_stats, "_HEAD_CHUNK_FLOATS", 2 * 4 * 16 * 16)
    chunked = attention_stats.head_scores(graphdef, params, constants, tokens, period=8)
    for key in ("previous_token", "induction"):
        np.testing.assert_allclose(chunked[key], whole[key], rtol=1e-6)
    one = attention_stats.head_scores(graphdef, params, constants, tokens[:1], period=8)
    # The padding repeats string 0, whose scores differ from the mean: counting it would show.
    assert not np.allclose(one["induction"], whole["induction"])


def test_head_scores_refuse_tokens_that_do_not_repeat():
    _, graphdef, params, constants = _model("nope")
    tokens = np.arange(16)[None]
    with pytest.raises(ValueError, match="do not repeat with period 8 from 0 on"):
        attention_stats.head_scores(graphdef, params, constants, tokens, period=8)
    with pytest.raises(ValueError, match="start \\+ period < T"):
        attention_stats.head_scores(graphdef, params, constants, tokens, period=16)
    with pytest.raises(ValueError, match="start \\+ period < T"):
        attention_stats.head_scores(graphdef, params, constants, tokens, period=4, start=12)


def test_bad_train_len():
    _, graphdef, params, constants = _model("nope")
    with pytest.raises(ValueError, match="train_len"):
        attention_stats.attention_stats(graphdef, params, constants, np.zeros((1, 8)), train_len=0)
