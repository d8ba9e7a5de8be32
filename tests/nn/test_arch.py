"""Architecture switches (`model.head_dim`, `norm*`, `mlp`, `activation`, `bias`,
`parallel_residual`, `post_norms`, `qk_norm`, `query_pre_attn_scalar`, `tie_embeddings`,
`embed_scale`, `embed_norm`, and the eval-time `rope_remap`): the defaults are the model
as it was before the switches existed, and every switch works in training, `scan_layers`,
`remat` and the KV-cache decode."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posattn.nn import decode
from posattn.nn.config import ConfigError, ModelConfig
from posattn.nn.model import TransformerLM, convert_layout
from posattn.train import steps

BASELINE = pathlib.Path(__file__).parent / "data" / "default_model_baseline.json"

# Every switch away from its default, in two combinations.
VARIANTS = {
    "neox": dict(
        head_dim=12,
        norm="layer",
        norm_bias=True,
        norm_eps=1e-5,
        activation="gelu",
        bias="all",
        parallel_residual=True,
        post_norms=True,
        tie_embeddings=False,
        embed_scale="one",
        embed_norm=True,
    ),
    # Gemma 3's block: query/key norms, post-branch norms, its logit scale, 1 + w norms, and
    # a local layer (another RoPE base, a window) under a global one.
    "gemma3": dict(
        head_dim=12,
        mlp="gated",
        norm_unit_offset=True,
        post_norms=True,
        qk_norm=True,
        query_pre_attn_scalar=10.0,
        tie_embeddings=True,
        rope_layout="half",
        layer_pattern=("rope:rope_base=100.0,window=4", "rope"),
    ),
    "gemma3_qk_norm_scanned": dict(mlp="gated", qk_norm=True, post_norms=True, rope_layout="half"),
    # Gemma 2's block: soft-capped attention and output logits, post-branch norms, a window on
    # the first layer of two; and the caps under an ALiBi bias (the cap before the bias).
    "gemma2": dict(
        head_dim=12,
        mlp="gated",
        norm_unit_offset=True,
        post_norms=True,
        query_pre_attn_scalar=10.0,
        attn_logit_softcap=2.0,
        final_logit_softcap=3.0,
        rope_layout="half",
        layer_pattern=("rope:window=4", "rope"),
    ),
    "softcap_alibi_scanned": dict(
        position="alibi", attn_logit_softcap=1.5, final_logit_softcap=4.0
    ),
    # Eval-time RoPE remaps: keys travel and are cached as projected, rotated twice at each use;
    # a sliding-window layer with a remap keeps a full cache.
    "leaky_rerope_scanned": dict(
        num_kv_heads=2, rope_remap={"type": "rerope", "window": 3, "leak": 2}
    ),
    "self_extend_window_layer": dict(
        rope_remap={"type": "self_extend", "window": 4, "group": 2, "log_scale_base": 3},
        layer_pattern=("rope:window=6", "rope"),
    ),
    # Stick-breaking attention: scanned with grouped heads and a window (ring caches, the
    # remainder to the current value); a windowed layer that drops the remainder under a global
    # RoPE layer. (Without a window: tests/nn/test_decode.py.)
    "stick_breaking_scanned": dict(layer_pattern=("stick_breaking:window=3",), num_kv_heads=2),
    "stick_breaking_window_layer": dict(
        layer_pattern=(
            "stick_breaking:window=4,stick_breaking_remainder=none,stick_breaking_logit_bias=-2.0",
            "rope",
        ),
    ),
    # CoPE: scanned with grouped heads, a window (ring caches), a table of 4 positions (the far
    # keys clamped) and gate keys of its own (cached beside k and v); a windowed layer whose
    # position logits are not scaled and whose gates read the values, under RoPE.
    "cope_scanned": dict(
        layer_pattern=("cope:window=4,cope_gates=separate",), num_kv_heads=2, cope_positions=4
    ),
    "cope_window_layer": dict(
        layer_pattern=("cope:window=5,cope_scale_positions=False,cope_gates=values", "rope"),
        max_len=6,
    ),
    # PaTH: scanned with grouped heads, forget gates and a window (a full cache of moved keys
    # and the convolution's inputs); a windowed layer without the convolution, w from a full
    # projection, under RoPE.
    "path_fox_scanned": dict(layer_pattern=("path_fox:window=4",), num_kv_heads=2),
    "path_window_layer": dict(
        layer_pattern=("path:window=5,path_conv=False,path_w_rank=0", "rope")
    ),
    "gated_alibi": dict(
        position="alibi",
        mlp="gated",
        activation="silu",
        bias="qkv",
        norm_unit_offset=True,
        tie_embeddings=False,
    ),
}


def _record():
    """Parameter paths, shapes and dtypes and the first two training losses of two default
    models (as tests/nn/data/default_model_baseline.json was recorded before the switches; its
    scanned entry's losses were recorded again when the scanned layout started from the unrolled
    layout's initial values, stacked)."""
    out = {}
    scan = {"position": "alibi", "num_kv_heads": 2, "scan_layers": True}
    cases = {"rope": {}, "alibi_gqa_scan": scan}
    for name, keys in cases.items():
        cfg = ModelConfig.from_keys(
            dict(d_model=32, num_layers=2, num_heads=4, d_ff=64, **keys)
        ).validate()
        optim = _optim()
        state = steps.init_train_state(cfg, steps.make_optimizer(optim), jax.random.key(0))
        graphdef, _, _ = steps.init_model(cfg, jax.random.key(0))
        step = jax.jit(steps.train_step, static_argnums=(0, 1))
        state, m1 = step(graphdef, optim, state, _batch())
        _, m2 = step(graphdef, optim, state, _batch())
        model = nnx.merge(graphdef, state["params"], state["constants"])
        tree = {
            "/".join(map(str, p)): [list(v.shape), str(v.dtype)]
            for p, v in nnx.to_flat_state(nnx.state(model))
        }
        out[name] = {"tree": tree, "loss_step1": float(m1["loss"]), "loss_step2": float(m2["loss"])}
    return out


def _optim():
    return steps.OptimConfig(
        learning_rate=1e-2,
        total_steps=10,
        warmup_steps=0,
        min_lr_ratio=0.1,
        weight_decay=0.1,
        grad_clip=1.0,
        b1=0.9,
        b2=0.95,
    )


def _batch():
    tokens = np.random.default_rng(0).integers(0, 256, (2, 17))
    return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}


def test_the_default_model_keeps_its_parameter_paths_and_losses():
    expected = json.loads(BASELINE.read_text())
    got = _record()
    for name in expected:
        assert got[name]["tree"] == expected[name]["tree"], name
        for step in ("loss_step1", "loss_step2"):
            np.testing.assert_allclose(got[name][step], expected[name][step], rtol=1e-5)


def _cfg(**keys):
    base = dict(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=48, vocab_size=64)
    return ModelConfig.from_keys({**base, **keys}).validate()


def _randomised(model):
    """Every parameter drawn at random (zero biases and unit scales would hide a dropped one)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [
        0.3 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)
    ]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves), rest)


def _logits(graphdef, params, constants, tokens):
    return nnx.merge(graphdef, params, constants)(tokens)


def _graphdef(cfg):
    """The model's structure alone (by eval_shape: nothing initialised or compiled)."""
    return nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0))))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_switches_agree_across_layouts_remat_and_the_cache(name):
    cfg = _cfg(**VARIANTS[name])
    model = _randomised(TransformerLM(cfg, rngs=nnx.Rngs(0)))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 9)))
    graphdef, params, constants = nnx.split(model, nnx.Param, ...)
    full = jax.jit(_logits, static_argnums=0)(graphdef, params, constants, tokens)
    assert np.all(np.isfinite(full))

    # scan_layers: the same values stacked give the same logits (a stack of identical layers;
    # a local/global pattern has none).
    if len(set(cfg.layers)) == 1:
        g_s = _graphdef(cfg.replace(scan_layers=True))
        p_s, c_s = convert_layout((params, constants), cfg, scan_layers=True)
        np.testing.assert_allclose(
            jax.jit(_logits, static_argnums=0)(g_s, p_s, c_s, tokens), full, atol=2e-5
        )

    # remat: the same gradients, and every parameter gets one.
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    grad = jax.jit(jax.grad(steps.loss_fn), static_argnums=2)
    grads = grad(params, constants, graphdef, batch)
    g_r = _graphdef(cfg.replace(remat="full"))
    grads_r = grad(params, constants, g_r, batch)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_r), strict=True
    ):
        np.testing.assert_allclose(a, b, atol=1e-5)
        assert float(jnp.abs(a).sum()) > 0, f"{jax.tree_util.keystr(path)} gets no gradient"

    # KV-cache decode: the cached steps' logits equal the full forward's at every position.
    cache = decode.init_cache(cfg, batch_size=2, capacity=9)
    logits, cache = jax.jit(decode.prefill, static_argnums=0)(
        graphdef, params, constants, cache, tokens[:, :5], jnp.array([5, 5], jnp.int32)
    )
    np.testing.assert_allclose(logits, full[:, 4], atol=2e-5)
    step = jax.jit(decode.decode_step, static_argnums=0)
    for t in range(5, 9):
        logits, cache = step(graphdef, params, constants, cache, tokens[:, t])
        np.testing.assert_allclose(logits, full[:, t], atol=2e-5)


def test_an_untied_head_is_its_own_parameter_and_head_dim_is_free():
    cfg = _cfg(tie_embeddings=False, head_dim=24)
    state = nnx.state(nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    assert state["head"].shape == (64, 32)
    assert state["blocks"][0]["attn"]["wq"].shape == (32, 4, 24)
    assert state["blocks"][0]["attn"]["wk"].shape == (32, 2, 24)
    assert cfg.keys()["head_dim"] == 24 and _cfg().keys()["head_dim"] == 0
    assert _cfg().head_dim == 8 and _cfg().replace(d_model=64).head_dim == 16
    # head_dim frees d_model from being a multiple of num_heads.
    assert _cfg(d_model=30, head_dim=8).head_dim == 8


@pytest.mark.parametrize(
    "keys, named",
    [
        (dict(norm="batch"), "model.norm='batch'"),
        (dict(mlp="moe"), "model.mlp='moe'"),
        (dict(activation="gelu_new"), "model.activation='gelu_new'"),
        (dict(bias="qkvo"), "model.bias='qkvo'"),
        (dict(embed_scale="2"), "model.embed_scale='2'"),
        (dict(norm_eps=0.0), "model.norm_eps=0.0"),
        (dict(norm_bias=True), "model.norm_bias=True"),
        (dict(parallel_residual=1), "model.parallel_residual=1"),
        (dict(qk_norm="yes"), "model.qk_norm='yes'"),
        (dict(query_pre_attn_scalar=-1.0), "model.query_pre_attn_scalar=-1.0"),
        (dict(attn_logit_softcap=-1.0), "model.attn_logit_softcap=-1.0"),
        (dict(final_logit_softcap=float("inf")), "model.final_logit_softcap=inf"),
        (dict(final_logit_softcap="30"), "model.final_logit_softcap='30'"),
        (
            dict(attn_logit_softcap=5.0, attention_impl="xla"),
            "model.attention_impl='xla' is invalid: soft-capped attention logits",
        ),
        (dict(head_dim=-2), "model.head_dim=-2"),
        (dict(d_model=30), "model.d_model=30"),
        (dict(init_from="/x"), "model.init_from='/x'"),
        (
            dict(position="stick_breaking", attn_logit_softcap=5.0),
            "stick-breaking attention has no softmax logits to cap, but "
            "config.model.attn_logit_softcap=5.0",
        ),
        (dict(position="stick_breaking", kind="encoder"), "needs a causal model"),
        (dict(position="cope", attn_logit_softcap=5.0), "the CoPE kernel has no logit soft cap"),
        (dict(position="cope", kind="encoder"), "CoPE counts each query's gates"),
        (dict(position="cope", cope_positions=-3), "model.cope_positions=-3"),
        (
            dict(position="stick_breaking", stick_breaking_remainder="value"),
            "model.stick_breaking_remainder='value'",
        ),
        (
            dict(position="stick_breaking", stick_breaking_logit_bias=float("inf")),
            "model.stick_breaking_logit_bias=inf",
        ),
    ],
)
def test_bad_switches_fail_before_compute_naming_the_key(keys, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(".", r"\.")):
        _cfg(**keys)
