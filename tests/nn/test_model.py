"""Models: shapes for every family, the big config by eval_shape, causality, equivariance, GQA, KV sharing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, primitive_input_dtypes
from flax import nnx

from posattn import attention, families
from posattn import config as config_lib
from posattn.nn.model import TransformerLM


def make_cfg(**model):
    config = config_lib.load_config(
        ROOT / "configs" / "tiny.py", [f"--config.model.{k}={v}" for k, v in model.items()]
    )
    return config_lib.validate(config)


def build(cfg, seed=0):
    return TransformerLM(cfg, rngs=nnx.Rngs(params=seed))


def n_params(tree):
    return sum(x.size for x in jax.tree.leaves(tree))


def test_gpt2_small_builds_by_eval_shape():
    config = config_lib.load_config(ROOT / "configs" / "gpt2_small.py")
    cfg = config_lib.validate(config)
    abstract = nnx.eval_shape(lambda: build(cfg))
    params = nnx.state(abstract, nnx.Param)
    # 12 layers x (4 D^2 attention + 8 D^2 MLP) + byte embeddings + norms: GPT-2 small's body.
    D = 768
    assert n_params(params) == 12 * (12 * D * D + 2 * D) + D + 256 * D  # 85.2M
    logits = jax.eval_shape(lambda m, t: m(t), abstract, jax.ShapeDtypeStruct((2, 1024), jnp.int32))
    assert logits.shape == (2, 1024, 256) and logits.dtype == jnp.float32


@pytest.mark.parametrize("position", families.names())
def test_every_family_is_causal(position):
    """Changing token j never changes the logits of positions before j."""
    model = build(make_cfg(position=position, d_model=32, num_layers=2))
    tokens = jax.random.randint(jax.random.key(0), (2, 24), 0, 256)
    changed = tokens.at[:, 15].set((tokens[:, 15] + 7) % 256)
    a, b = model(tokens), model(changed)
    assert a.shape == (2, 24, 256) and bool(jnp.all(jnp.isfinite(a)))
    np.testing.assert_allclose(a[:, :15], b[:, :15], rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[:, 15:], b[:, 15:])


def test_nope_encoder_is_permutation_equivariant():
    model = build(make_cfg(position="nope", kind="encoder", d_model=32, num_layers=2))
    tokens = jax.random.randint(jax.random.key(1), (1, 20), 0, 256)
    perm = jax.random.permutation(jax.random.key(2), 20)
    np.testing.assert_allclose(model(tokens)[:, perm], model(tokens[:, perm]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("position", ["rope", "alibi", "sinusoidal"])
def test_position_families_break_equivariance(position):
    model = build(make_cfg(position=position, kind="encoder", d_model=32, num_layers=2))
    tokens = jax.random.randint(jax.random.key(1), (1, 20), 0, 256)
    perm = jax.random.permutation(jax.random.key(2), 20)
    assert not np.allclose(model(tokens)[:, perm], model(tokens[:, perm]), atol=1e-4)


def test_grouped_query_and_kv_sharing_shrink_parameters():
    full = n_params(nnx.state(build(make_cfg(num_kv_heads=4)), nnx.Param))
    gqa = n_params(nnx.state(build(make_cfg(num_kv_heads=1)), nnx.Param))
    shared = n_params(nnx.state(build(make_cfg(num_kv_heads=4, kv_share=2)), nnx.Param))
    D, H = 64, 16
    assert full - gqa == 2 * 2 * D * 3 * H  # 2 layers x (k, v) x 3 fewer kv heads
    assert full - shared == 2 * D * 4 * H  # the upper layer of the pair has no k, v projections
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 256)
    for cfg in (make_cfg(num_kv_heads=1), make_cfg(kv_share=2)):
        assert bool(jnp.all(jnp.isfinite(build(cfg)(tokens))))


def test_t5_bias_is_shared_across_layers_and_kerple_is_not():
    t5 = nnx.state(build(make_cfg(position="t5")), nnx.Param)
    kerple = nnx.state(build(make_cfg(position="kerple_log")), nnx.Param)
    t5_tables = [p for path, p in nnx.to_flat_state(t5) if "table" in path]
    kerple_r1 = [p for path, p in nnx.to_flat_state(kerple) if "r1" in path]
    assert len(t5_tables) == 1 and len(kerple_r1) == 2


def test_learned_positions_past_the_table_raise():
    model = build(make_cfg(position="learned", max_len=64))
    model(jnp.zeros((1, 64), jnp.int32))
    with pytest.raises(ValueError, match="64"):
        model(jnp.zeros((1, 65), jnp.int32))


def test_bfloat16_compute_is_close_to_float32():
    tokens = jax.random.randint(jax.random.key(0), (2, 32), 0, 256)
    f32 = build(make_cfg(position="alibi"))(tokens)
    model = build(make_cfg(position="alibi", dtype="bfloat16"))
    bf16 = model(tokens)
    assert bf16.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(bf16)))
    # The softmax of every layer (and every other exponential) runs in float32, in the forward
    # program and in the gradient of the loss.
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        logits = nnx.merge(graphdef, params, rest)(tokens)
        return jnp.mean(jax.nn.logsumexp(logits, -1))

    for program in (loss, jax.grad(loss)):
        dtypes = primitive_input_dtypes(program, params)
        assert len(dtypes) >= 2 and set(dtypes) == {"float32"}, dtypes
    # Logits within two bfloat16 epsilons (2 * 2^-7) of their scale (measured: 0.2% of it).
    scale = float(jnp.max(jnp.abs(f32)))
    np.testing.assert_allclose(bf16, f32, atol=2 * 2**-7 * scale, rtol=0)


@pytest.mark.parametrize(
    "position, kind",
    [("alibi", "decoder"), ("rope", "decoder"), ("t5", "decoder"), ("kerple_log", "encoder")],
)
def test_auto_attention_gives_the_references_loss_and_gradients(position, kind):
    """ "auto" (the chunked kernel at this size) trains the same model as "reference": loss and
    every parameter gradient agree to float32 rounding (GQA: tiny.py has 4 query / 2 kv heads)."""
    tokens = jax.random.randint(jax.random.key(3), (2, 24), 0, 256)

    def loss_and_grads(impl):
        model = build(
            make_cfg(position=position, kind=kind, d_model=32, num_layers=2, attention_impl=impl)
        )
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params):
            logits = nnx.merge(graphdef, params, rest)(tokens)
            return jnp.mean(
                jax.nn.logsumexp(logits, -1)
                - jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0]
            )

        return jax.jit(jax.value_and_grad(loss))(params)

    shape = jax.ShapeDtypeStruct((2, 24, 4, 8), jnp.float32)
    assert attention.choose_implementation(shape, shape, None) == "chunked"
    (auto_loss, auto_grads), (ref_loss, ref_grads) = (
        loss_and_grads("auto"),
        loss_and_grads("reference"),
    )
    # Separately compiled programs summing in other orders: float32 rounding apart (a loss ~5.5).
    np.testing.assert_allclose(auto_loss, ref_loss, rtol=1e-5, atol=1e-6)
    for (path, w), g in zip(
        jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(auto_grads)
    ):
        err = float(jnp.max(jnp.abs(g - w)))
        assert err <= 1e-5 * float(jnp.max(jnp.abs(w))) + 1e-8, (jax.tree_util.keystr(path), err)
