"""Models: shapes for every family, the big config by eval_shape, causality, equivariance, GQA,
KV sharing, remat, scanned layers and parameter dtypes."""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import ROOT, primitive_input_dtypes
from flax import nnx

from posattn import attention, families
from posattn import config as config_lib
from posattn.attention import native
from posattn.nn import decode
from posattn.nn.model import TransformerLM, convert_layout
from posattn.train import steps


def make_cfg(**model):
    config = config_lib.load_config(
        ROOT / "configs" / "tiny.py", [f"--config.model.{k}={v}" for k, v in model.items()]
    )
    return config_lib.validate(config)


def build(cfg, seed=0):
    return TransformerLM(cfg, rngs=nnx.Rngs(params=seed))


# The forward pass as one compiled program: op-by-op dispatch would compile each op separately.
forward = nnx.jit(lambda model, tokens: model(tokens))


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
    a, b = forward(model, tokens), forward(model, changed)
    assert a.shape == (2, 24, 256) and bool(jnp.all(jnp.isfinite(a)))
    np.testing.assert_allclose(a[:, :15], b[:, :15], rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[:, 15:], b[:, 15:])


def test_nope_encoder_is_permutation_equivariant():
    model = build(make_cfg(position="nope", kind="encoder", d_model=32, num_layers=2))
    tokens = jax.random.randint(jax.random.key(1), (1, 20), 0, 256)
    perm = jax.random.permutation(jax.random.key(2), 20)
    np.testing.assert_allclose(
        forward(model, tokens)[:, perm], forward(model, tokens[:, perm]), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("position", ["rope", "alibi", "sinusoidal"])
def test_position_families_break_equivariance(position):
    model = build(make_cfg(position=position, kind="encoder", d_model=32, num_layers=2))
    tokens = jax.random.randint(jax.random.key(1), (1, 20), 0, 256)
    perm = jax.random.permutation(jax.random.key(2), 20)
    # Eager calls (the tests above compile the forward): the model runs op by op as well.
    assert not np.allclose(model(tokens)[:, perm], model(tokens[:, perm]), atol=1e-4)


def test_grouped_query_and_kv_sharing_shrink_parameters():
    def count(cfg):
        return n_params(nnx.state(nnx.eval_shape(lambda: build(cfg)), nnx.Param))

    full = count(make_cfg(num_kv_heads=4))
    gqa = count(make_cfg(num_kv_heads=1))
    shared = count(make_cfg(num_kv_heads=4, kv_share=2))
    D, H = 64, 16
    assert full - gqa == 2 * 2 * D * 3 * H  # 2 layers x (k, v) x 3 fewer kv heads
    assert full - shared == 2 * D * 4 * H  # the upper layer of the pair has no k, v projections
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 256)
    for cfg in (make_cfg(num_kv_heads=1), make_cfg(kv_share=2)):
        assert bool(jnp.all(jnp.isfinite(forward(build(cfg), tokens))))


def test_t5_and_kerple_biases_are_shared_across_layers_unless_kerple_per_layer():
    def count(name, **kw):
        state = nnx.state(nnx.eval_shape(lambda: build(make_cfg(**kw))), nnx.Param)
        return len([p for path, p in nnx.to_flat_state(state) if name in path])

    assert count("table", position="t5") == 1
    for kind in ("kerple_log", "kerple_power"):  # one (r1, r2) for the stack, as the reference
        assert count("r1", position=kind) == count("r2", position=kind) == 1
        assert count("r1", position=kind, kerple_per_layer=True) == 2  # the named variant
        for scan in (False, True):
            cfg = make_cfg(position=kind, scan_layers=scan)
            tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
            assert bool(jnp.all(jnp.isfinite(forward(build(cfg), tokens))))


def test_learned_positions_past_the_table_raise():
    model = build(make_cfg(position="learned", max_len=64))
    model(jnp.zeros((1, 64), jnp.int32))  # eager: the positions are concrete, so it raises
    with pytest.raises(ValueError, match="64"):
        model(jnp.zeros((1, 65), jnp.int32))


def test_bfloat16_compute_is_close_to_float32():
    tokens = jax.random.randint(jax.random.key(0), (2, 32), 0, 256)
    f32 = forward(build(make_cfg(position="alibi")), tokens)
    model = build(make_cfg(position="alibi", dtype="bfloat16"))
    bf16 = forward(model, tokens)
    assert bf16.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(bf16)))
    # The softmax of every layer (and every other exponential) runs in float32, in the forward
    # program and in the gradient of the loss: read from XLA's kernels ("chunked"; the native
    # kernel computes in float32 whatever its inputs, tests/attention/test_native.py).
    model = build(make_cfg(position="alibi", dtype="bfloat16", attention_impl="chunked"))
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
    fast = "native" if native.available() else "chunked"
    assert attention.choose_implementation(shape, shape, None, causal=True) == fast
    (auto_loss, auto_grads), (ref_loss, ref_grads) = (
        loss_and_grads("auto"),
        loss_and_grads("reference"),
    )
    # Separately compiled programs summing in other orders: float32 rounding apart (a loss ~5.5).
    np.testing.assert_allclose(auto_loss, ref_loss, rtol=1e-5, atol=1e-6)
    for (path, w), g in zip(
        jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(auto_grads), strict=True
    ):
        err = float(jnp.max(jnp.abs(g - w)))
        assert err <= 1e-5 * float(jnp.max(jnp.abs(w))) + 1e-8, (jax.tree_util.keystr(path), err)


# ----------------------------------------------------------------------------------------------
# Settings for large models: remat, scanned layers, parameter dtype. None changes the function.

TOKENS = jax.random.randint(jax.random.key(5), (2, 16), 0, 256)
BATCH = {"inputs": TOKENS, "targets": jnp.roll(TOKENS, -1, axis=1)}


def loss_and_grads(cfg, params=None, constants=None, seed=0):
    graphdef, p, c = steps.init_model(cfg, jax.random.key(seed))
    params = p if params is None else params
    constants = c if constants is None else constants
    return jax.jit(jax.value_and_grad(steps.loss_fn), static_argnums=2)(
        params, constants, graphdef, BATCH
    )


def loss_of(cfg, seed=0):
    """The loss alone: no backward pass to compile."""
    graphdef, params, constants = steps.init_model(cfg, jax.random.key(seed))
    return jax.jit(steps.loss_fn, static_argnums=2)(params, constants, graphdef, BATCH)


def assert_trees_close(a, b, rtol=1e-5, atol=1e-7):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True
    ):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_gives_the_same_loss_and_gradients(remat):
    """Rematerialised blocks (here with cross-layer KV sharing, whose keys/values cross blocks)
    give the loss and every gradient of the plain model."""
    common = dict(position="alibi", d_model=32, num_layers=2, kv_share=2)
    loss, grads = loss_and_grads(make_cfg(**common))
    loss_r, grads_r = loss_and_grads(make_cfg(remat=remat, **common))
    np.testing.assert_allclose(loss_r, loss, rtol=1e-6)
    assert_trees_close(grads_r, grads)


@pytest.mark.parametrize(
    "position, extra",
    [("rope", {}), ("t5", {"remat": "dots"}), ("kerple_log", {"kind": "encoder"})],
)
def test_scan_layers_gives_the_loops_loss_and_gradients(position, extra):
    """The loop model's state, stacked by `convert_layout`, is exactly the scanned model's
    layout, and gives the same loss and (unstacked) gradients. RoPE's frequencies and T5's table
    are shared by every layer; Kerple's parameters are per layer."""
    common = dict(position=position, d_model=32, num_layers=3, **extra)
    cfg, scan_cfg = make_cfg(**common), make_cfg(scan_layers=True, **common)
    _, params, constants = steps.init_model(cfg, jax.random.key(0))
    _, scan_params, scan_constants = steps.init_model(scan_cfg, jax.random.key(0))
    stacked = convert_layout((params, constants), cfg, scan_layers=True)
    assert jax.tree.structure(stacked) == jax.tree.structure((scan_params, scan_constants))
    wq = dict(nnx.to_flat_state(stacked[0]))[("blocks", "attn", "wq")][...]
    assert wq.shape == (3, 32, 4, 8)
    loss, grads = loss_and_grads(cfg)
    scan_loss, scan_grads = loss_and_grads(scan_cfg, *stacked)
    np.testing.assert_allclose(scan_loss, loss, rtol=1e-6)
    assert_trees_close(convert_layout(scan_grads, cfg, scan_layers=False), grads)


@pytest.mark.parametrize(
    "position, extra",
    [
        ("rope", {}),
        ("alibi", {}),
        ("t5", {}),  # one table for the stack: the model's shared_bias
        ("kerple_log", {}),  # shared (r1, r2)
        ("kerple_power", {"kerple_per_layer": True}),
        ("fire", {}),  # an MLP per layer, drawn before its block
        ("learned", {"max_len": 64}),
        ("fox", {}),  # a forget gate per layer
        ("rope", {"tie_embeddings": False, "mlp": "gated", "bias": "all", "kind": "encoder"}),
    ],
)
def test_one_seed_gives_one_model_in_both_layer_layouts(position, extra):
    """The scanned layout's initial state is the unrolled layout's, stacked, bit for bit (its
    blocks draw their values in the unrolled order), so both start from the same loss."""
    common = dict(position=position, d_model=32, num_layers=3, **extra)
    cfg, scan_cfg = make_cfg(**common), make_cfg(scan_layers=True, **common)
    _, params, constants = steps.init_model(cfg, jax.random.key(3))
    _, scan_params, scan_constants = steps.init_model(scan_cfg, jax.random.key(3))
    stacked = convert_layout((params, constants), cfg, scan_layers=True)
    assert_trees_close(stacked, (scan_params, scan_constants), rtol=0, atol=0)
    loss, scan_loss = loss_of(cfg, seed=3), loss_of(scan_cfg, seed=3)
    np.testing.assert_allclose(scan_loss, loss, rtol=1e-6)


def test_convert_layout_round_trips_and_refuses_a_converted_state():
    cfg = make_cfg(position="t5", d_model=32, num_layers=3)
    _, params, _ = steps.init_model(cfg, jax.random.key(0))
    stacked = convert_layout(params, cfg, scan_layers=True)
    assert_trees_close(convert_layout(stacked, cfg, scan_layers=False), params, rtol=0, atol=0)
    with pytest.raises(ValueError, match="already stacked.*scan_layers=True"):
        convert_layout(stacked, cfg, scan_layers=True)
    with pytest.raises(ValueError, match="already per layer.*scan_layers=False"):
        convert_layout(params, cfg, scan_layers=False)
    with pytest.raises(ValueError, match="num_layers=4"):
        convert_layout(
            stacked, make_cfg(position="t5", d_model=32, num_layers=4), scan_layers=False
        )


def test_scan_layers_decodes_as_the_loop():
    """Prefill and a cached step (`extend` scans the stacked cache) give the loop's logits."""
    cfg = make_cfg(position="rope", d_model=32, num_layers=2)
    scan_cfg = make_cfg(position="rope", d_model=32, num_layers=2, scan_layers=True)
    graphdef, params, constants = steps.init_model(cfg, jax.random.key(0))
    scan_graphdef = steps.init_model(scan_cfg, jax.random.key(0))[0]
    scan_state = convert_layout((params, constants), cfg, scan_layers=True)
    lengths = jnp.array([5, 3])

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def run(cfg, graphdef, params, constants):
        cache = decode.init_cache(cfg, batch_size=2, capacity=8)
        first, cache = decode.prefill(graphdef, params, constants, cache, TOKENS[:, :5], lengths)
        second, _ = decode.decode_step(graphdef, params, constants, cache, TOKENS[:, 6])
        return first, second

    for got, want in zip(
        run(scan_cfg, scan_graphdef, *scan_state),
        run(cfg, graphdef, params, constants),
        strict=True,
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bfloat16_parameters_are_stored_as_bfloat16_and_give_close_logits():
    f32 = make_cfg(position="kerple_log", d_model=32, num_layers=2)
    bf16 = make_cfg(position="kerple_log", d_model=32, num_layers=2, param_dtype="bfloat16")
    _, params, _ = steps.init_model(bf16, jax.random.key(0))
    dtypes = {"/".join(map(str, p)): v[...].dtype for p, v in nnx.to_flat_state(params)}
    bias_values = {k for k in dtypes if "/bias/" in k}
    assert bias_values and all(dtypes[k] == jnp.float32 for k in bias_values)  # few, kept exact
    assert all(dtype == jnp.bfloat16 for k, dtype in dtypes.items() if k not in bias_values)
    # The bfloat16 model is the float32 model's initial values rounded.
    a, b = forward(build(f32), TOKENS), forward(build(bf16), TOKENS)
    assert b.dtype == jnp.float32
    np.testing.assert_allclose(jax.nn.softmax(b), jax.nn.softmax(a), atol=1e-2)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("remat", "half", r"model.remat='half'.*'none', 'full'"),
        ("param_dtype", "float16", r"model.param_dtype='float16'.*'float32', 'bfloat16'"),
        ("scan_layers", 1, r"model.scan_layers=1.*must be True or False"),
    ],
)
def test_large_model_settings_are_validated(key, value, match):
    config = config_lib.load_config(ROOT / "configs" / "tiny.py").to_dict()
    config["model"][key] = value  # as a config file could set it (overrides are coerced first)
    with pytest.raises(config_lib.ConfigError, match=match):
        config_lib.validate(ml_collections.ConfigDict(config))


def test_scan_layers_refuses_kv_sharing_before_any_compute():
    with pytest.raises(config_lib.ConfigError, match=r"kv_share=2.*scan_layers=True.*kv_share=1"):
        make_cfg(scan_layers=True, kv_share=2)
