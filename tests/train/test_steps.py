"""Training steps: the sliced loss equals the full-logits loss (and never holds those logits),
weight decay and one update agree between the loop and scanned layer layouts, evaluation sums,
and a workdir refuses a layout change by name."""

import functools
import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import ROOT, XLA_DEFAULT_CODEGEN, XLA_DEFAULT_LEVEL
from flax import nnx

from posattn import config as config_lib
from posattn.nn import model as model_lib
from posattn.nn.model import convert_layout, cross_entropy
from posattn.train import steps
from posattn.train import workdir as workdir_lib


def make_cfg(**model):
    config = config_lib.load_config(
        ROOT / "configs" / "tiny.py", [f"--config.model.{k}={v}" for k, v in model.items()]
    )
    return config_lib.validate(config)


def batch_of(B, T, V, seed=0, weights=False):
    tokens = jax.random.randint(jax.random.key(seed), (B, T + 1), 0, V)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    if weights:  # as the encoder's masked positions: some rows count nothing
        w = jax.random.bernoulli(jax.random.key(seed + 1), 0.3, (B, T)).astype(jnp.float32)
        batch["weights"] = w.at[0].set(0.0)
    return batch


def assert_grads_close(grads, want):
    """Float32 rounding of sums in another order: relative to each array's largest entry (the
    tied embedding's gradient sums input and output terms that nearly cancel in places)."""
    for (path, g), w in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want), strict=True
    ):
        scale = float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(
            g, w, rtol=1e-5, atol=1e-5 * scale + 1e-12, err_msg=jax.tree_util.keystr(path)
        )


def full_logits_loss(params, constants, graphdef, batch):
    """The loss as it was computed before slicing: every logit of the batch at once."""
    model = nnx.merge(graphdef, params, constants)
    return cross_entropy(model(batch["inputs"]), batch["targets"], batch.get("weights"))


@pytest.mark.parametrize("weights", [False, True])
def test_sliced_loss_gives_the_full_logits_loss_and_gradients(monkeypatch, weights):
    cfg = make_cfg(position="alibi", d_model=32, num_layers=1)
    graphdef, params, constants = steps.init_model(cfg, jax.random.key(0))
    batch = batch_of(2, 16, 256, weights=weights)
    # 5 positions per slice: 4 slices, the last padded with 4 positions of weight 0.
    monkeypatch.setattr(model_lib, "LOSS_LOGITS_BUDGET", 2 * 256 * 5)
    sliced = jax.jit(jax.value_and_grad(steps.loss_fn), static_argnums=2)
    full = jax.jit(jax.value_and_grad(full_logits_loss), static_argnums=2)
    (loss, grads), (want, want_grads) = (
        sliced(params, constants, graphdef, batch),
        full(params, constants, graphdef, batch),
    )
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    assert_grads_close(grads, want_grads)


def test_a_50k_vocabulary_step_never_holds_the_whole_batchs_logits(monkeypatch):
    """GPT-2's padded vocabulary: the compiled loss+gradient's temporaries stay below the float32
    logits of the batch (what the full-logits loss needs, checked in the same compile setting)."""
    V, B, T = 50304, 2, 64
    cfg = make_cfg(
        position="rope", d_model=16, num_layers=1, num_heads=2, num_kv_heads=2, vocab_size=V
    )
    graphdef, params, constants = steps.init_model(cfg, jax.random.key(0))
    batch = batch_of(B, T, V)
    logits_bytes = B * T * V * 4

    def temp_bytes(fn):
        compiled = (
            jax.jit(jax.value_and_grad(fn), static_argnums=2)
            .lower(params, constants, graphdef, batch)
            .compile()
        )
        return compiled.memory_analysis().temp_size_in_bytes, compiled

    full_temp, full = temp_bytes(full_logits_loss)
    monkeypatch.setattr(model_lib, "LOSS_LOGITS_BUDGET", B * 8 * V)  # 8 positions per slice
    sliced_temp, sliced = temp_bytes(steps.loss_fn)
    assert full_temp >= logits_bytes  # the measurement sees the logits when they are there
    assert sliced_temp < logits_bytes / 2, (sliced_temp, logits_bytes)
    (loss, grads), (want, want_grads) = (
        sliced(params, constants, batch),
        full(params, constants, batch),
    )
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_allclose(loss, np.log(V), rtol=0.05)  # an untrained model is near uniform
    assert_grads_close(grads, want_grads)


def test_eval_step_sums_the_nll_of_the_weighted_targets():
    cfg = make_cfg(position="t5", d_model=32, num_layers=1)
    graphdef, params, constants = steps.init_model(cfg, jax.random.key(0))
    batch = batch_of(2, 16, 256, weights=True)
    total, count = steps.eval_step(graphdef, params, constants, batch)
    logits = nnx.merge(graphdef, params, constants)(batch["inputs"])
    nll = (
        jax.nn.logsumexp(logits, -1)
        - jnp.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
    )
    np.testing.assert_allclose(total, jnp.sum(nll * batch["weights"]), rtol=1e-5)
    assert float(count) == float(jnp.sum(batch["weights"]))


def test_weight_decay_covers_the_same_weights_in_both_layer_layouts():
    """Matrices decay, vectors do not: a stacked layer axis does not make a norm scale a matrix."""
    common = dict(position="kerple_log", kerple_per_layer=True, d_model=32, num_layers=3)
    _, params, _ = steps.init_model(make_cfg(**common), jax.random.key(0))
    _, scan_params, _ = steps.init_model(make_cfg(scan_layers=True, **common), jax.random.key(0))

    def flat(mask):
        return {path: bool(v.get_value()) for path, v in nnx.to_flat_state(mask)}

    loop_mask, scan_mask = flat(steps._decay_mask(params)), flat(steps._decay_mask(scan_params))
    assert loop_mask[("blocks", 0, "attn", "wq")] and loop_mask[("embed",)]
    assert not loop_mask[("blocks", 0, "attn_norm", "scale")]
    assert not loop_mask[("blocks", 0, "attn", "bias", "values", "r1")]
    for path, decays in scan_mask.items():
        if path[0] != "blocks":
            assert decays == loop_mask[path], path
            continue
        per_layer = {loop_mask[("blocks", i, *path[1:])] for i in range(3)}
        assert per_layer == {decays}, path


def test_a_scanned_train_step_matches_the_loops():
    """One update of the loop model's state, converted to the scanned layout (optimizer moments
    included), gives the loop's metrics and a state of the scanned layout's structure."""
    common = dict(position="fire", d_model=32, num_layers=2)
    cfg, scan_cfg = make_cfg(**common), make_cfg(scan_layers=True, remat="full", **common)
    optim = _optim(learning_rate=1e-2)
    tx = steps.make_optimizer(optim)
    state = steps.init_train_state(cfg, tx, jax.random.key(0))
    scan_state = convert_layout(state, cfg, scan_layers=True)
    want_structure = jax.tree.structure(steps.init_train_state(scan_cfg, tx, jax.random.key(0)))
    assert jax.tree.structure(scan_state) == want_structure
    batch = batch_of(2, 16, 256)
    graphdef = steps.init_model(cfg, jax.random.key(0))[0]
    scan_graphdef = steps.init_model(scan_cfg, jax.random.key(0))[0]
    step = jax.jit(steps.train_step, static_argnums=(0, 1))
    new, metrics = step(graphdef, optim, state, batch)
    scan_new, scan_metrics = step(scan_graphdef, optim, scan_state, batch)
    assert jax.tree.structure(scan_new) == want_structure
    for name in ("loss", "grad_norm", "param_norm"):
        np.testing.assert_allclose(scan_metrics[name], metrics[name], rtol=1e-5, err_msg=name)
    moved = jax.tree.map(
        lambda a, b: float(jnp.max(jnp.abs(a - b))), new["params"], state["params"]
    )
    assert max(jax.tree.leaves(moved)) > 1e-3  # the update did something


def test_bfloat16_parameters_train_with_float32_moments_and_keep_their_dtypes():
    """A step returns the state's dtypes unchanged (donation and checkpoint restore targets rely
    on it): bfloat16 parameters, float32 AdamW moments."""
    cfg = make_cfg(position="t5", d_model=32, num_layers=1, param_dtype="bfloat16")
    optim = _optim()
    tx = steps.make_optimizer(optim)
    state = steps.init_train_state(cfg, tx, jax.random.key(0))
    graphdef = steps.init_model(cfg, jax.random.key(0))[0]
    step = jax.jit(steps.train_step, static_argnums=(0, 1))
    new, metrics = step(graphdef, optim, state, batch_of(2, 16, 256))
    new, metrics = step(graphdef, optim, new, batch_of(2, 16, 256, seed=1))
    assert np.isfinite(float(metrics["loss"]))
    dtypes = lambda tree: jax.tree.map(lambda x: jnp.dtype(x.dtype), tree)  # noqa: E731
    assert dtypes(new) == dtypes(state)
    params = {"/".join(map(str, p)): v[...].dtype for p, v in nnx.to_flat_state(new["params"])}
    assert params["embed"] == params["blocks/0/attn/wq"] == jnp.bfloat16
    assert params["blocks/0/attn/bias/values/table"] == jnp.float32  # T5's table stays float32
    adam = new["opt_state"][1].inner_state[0]
    assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.float32)}


def test_a_workdir_refuses_another_layer_layout_by_name(tmp_path):
    config = config_lib.load_config(ROOT / "configs" / "tiny.py")
    workdir_lib.write_or_check_config(tmp_path, config)
    # Recomputation changes no number: a run may resume with another remat setting.
    workdir_lib.write_or_check_config(
        tmp_path, config_lib.apply_overrides(config, ["model.remat=dots"])
    )
    scanned = config_lib.apply_overrides(config, ["model.scan_layers=True"])
    with pytest.raises(
        config_lib.ConfigError,
        match=r"model.scan_layers=False layout.*"
        r"--config.model.scan_layers=False",
    ):
        workdir_lib.write_or_check_config(tmp_path, scanned)
    # A workdir written before these keys existed resumes with their defaults...
    saved = json.loads((tmp_path / "config.json").read_text())
    for key in ("remat", "scan_layers", "param_dtype"):
        del saved["model"][key]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    workdir_lib.write_or_check_config(tmp_path, config)
    # ...and refuses them changed.
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(config_lib.ConfigError, match="model.param_dtype"):
        workdir_lib.write_or_check_config(
            tmp_path, config_lib.apply_overrides(config, ["model.param_dtype=bfloat16"])
        )


def _optim(**train):
    """The default optimiser (posattn.config.TRAIN) for 10 steps without warmup."""
    defaults = {k: v for k, (v, _) in config_lib.TRAIN.items()}
    train = ml_collections.ConfigDict({**defaults, "steps": 10, "warmup_steps": 0, **train})
    return steps.OptimConfig.from_config(train)


def test_hyperparams_are_found_by_type_not_by_position_in_the_chain():
    """The learning rate and betas are read and replaced wherever `inject_hyperparams` sits."""
    import optax

    params = {"w": jnp.ones((3,))}
    o = steps.OptimConfig(
        learning_rate=0.1,
        total_steps=10,
        warmup_steps=1,
        min_lr_ratio=0.1,
        weight_decay=0.0,
        grad_clip=1.0,
        b1=0.8,
        b2=0.9,
    )
    for tx in (steps.make_optimizer(o), optax.chain(optax.inject_hyperparams(optax.adam)(0.1))):
        state = tx.init(params)
        assert float(steps.hyperparams(state)["learning_rate"]) == pytest.approx(0.1)
        changed = steps.with_hyperparams(state, {"learning_rate": jnp.asarray(0.5)})
        assert float(steps.hyperparams(changed)["learning_rate"]) == 0.5
        assert jax.tree.structure(changed) == jax.tree.structure(state)


def test_the_fast_compiled_init_gives_bitwise_the_default_compiles_state(monkeypatch):
    """`jit_init_train_state` compiles the initialisation at XLA:CPU's backend optimisation level
    1 (faster): every array of the state must be bitwise what the default level gives, for a
    model whose layers hold every per-layer family's parameters (the others have none beyond a
    layer's own), under a learned table."""
    pattern = ("t5", "kerple_power", "kerple_log", "fire", "fox")
    cfg = make_cfg(position="learned", layer_pattern=repr(pattern), num_layers=len(pattern))
    tx = steps.make_optimizer(
        steps.OptimConfig.from_config(config_lib.load_config(ROOT / "configs" / "tiny.py").train)
    )
    key = jax.random.key(3)
    default = jax.jit(
        lambda k: steps.init_train_state(cfg, tx, k), compiler_options=XLA_DEFAULT_LEVEL
    )(key)
    # compiled as users compile it (the suite's emitters are not theirs), at its own level: their
    # XLA_FLAGS name no level (the suite's do; this process's flags were read at its start)
    monkeypatch.setenv("XLA_FLAGS", "")
    fast_options = {**steps._CPU_INIT_COMPILER_OPTIONS, **XLA_DEFAULT_CODEGEN}
    monkeypatch.setattr(steps, "_CPU_INIT_COMPILER_OPTIONS", fast_options)
    fast = steps.jit_init_train_state(cfg, tx, platform="cpu")(key)
    assert len(fast["params"]["blocks"]) == len(pattern)
    assert jax.tree.structure(fast) == jax.tree.structure(default)
    for a, b in zip(jax.tree.leaves(default), jax.tree.leaves(fast), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_level_named_in_xla_flags_is_the_inits_level(monkeypatch):
    """With a backend optimisation level in XLA_FLAGS, `jit_init_train_state` compiles as any jit
    does, at that level: the suite's level 0, whose last bits differ from level 1's."""
    cfg = make_cfg(position="t5")
    tx = steps.make_optimizer(
        steps.OptimConfig.from_config(config_lib.load_config(ROOT / "configs" / "tiny.py").train)
    )
    key = jax.random.key(3)
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    assert steps._init_compiler_options("cpu") is None
    named = steps.jit_init_train_state(cfg, tx, platform="cpu")(key)
    plain = jax.jit(functools.partial(steps.init_train_state, cfg, tx))(key)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(named), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    assert steps._init_compiler_options("cpu") == steps._CPU_INIT_COMPILER_OPTIONS
    assert steps._init_compiler_options("gpu") is None


def test_starting_parameters_replace_the_drawn_ones_which_are_never_computed():
    """`init_train_state(..., params)` (a fine-tune's, a published checkpoint's start): the state
    is the drawn one's with those parameters (constants, zero moments and step bitwise the
    same), and its compiled program holds no random-number kernel: the drawn parameters, unused,
    are never computed."""
    cfg = make_cfg(position="kerple_log")
    tx = steps.make_optimizer(
        steps.OptimConfig.from_config(config_lib.load_config(ROOT / "configs" / "tiny.py").train)
    )
    key = jax.random.key(5)
    init = steps.jit_init_train_state(cfg, tx, platform="cpu")
    drawn = init(key)
    start = jax.tree.map(lambda p: p * 2.0 + 1.0, drawn["params"])
    started = init(key, start)
    assert jax.tree.structure(started) == jax.tree.structure(drawn)
    for name in ("params", "constants", "opt_state", "step"):
        expected = start if name == "params" else drawn[name]
        for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(started[name]), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert "threefry" in init.lower(key).compile().as_text()
    assert "threefry" not in init.lower(key, start).compile().as_text()
