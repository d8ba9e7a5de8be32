"""Pure training and evaluation steps on pytrees (jit and vmap them from outside).

The train state is a plain dict of pytrees:
  params     nnx.State of `nnx.Param`s (what the optimiser updates)
  constants  nnx.State of the model's fixed arrays (RoPE frequencies, ALiBi slopes)
  opt_state  the optax state (its `hyperparams` hold the peak learning rate etc. as arrays, so a
             sweep can give each member its own values)
  step       int32, the number of updates applied
The model's structure (`graphdef`) is static and passed separately.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from posattn.nn.config import ModelConfig
from posattn.nn.model import TransformerLM

__all__ = [
    "OptimConfig",
    "eval_step",
    "init_model",
    "init_train_state",
    "jit_init_train_state",
    "loss_fn",
    "make_optimizer",
    "project_bounds",
    "train_step",
]


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup and cosine decay to `min_lr_ratio * learning_rate`, clipped grads.

    The values come from a config's `train` section (`train.steps` is `total_steps`), whose
    defaults are written in `posattn.config.TRAIN`.
    """

    learning_rate: float
    total_steps: int
    warmup_steps: int
    min_lr_ratio: float
    weight_decay: float
    grad_clip: float
    b1: float
    b2: float

    @classmethod
    def from_config(cls, train) -> OptimConfig:
        fields = {f.name for f in dataclasses.fields(cls)} - {"total_steps"}
        return cls(total_steps=int(train.steps), **{k: train[k] for k in fields})


def lr_shape(o: OptimConfig):
    """The schedule's shape in [0, 1]: linear warmup, then cosine down to `min_lr_ratio`."""

    def shape(count):
        count = jnp.asarray(count, jnp.float32)
        warm = (count + 1.0) / max(o.warmup_steps, 1)
        progress = jnp.clip(
            (count - o.warmup_steps) / max(o.total_steps - o.warmup_steps, 1), 0.0, 1.0
        )
        cosine = o.min_lr_ratio + (1.0 - o.min_lr_ratio) * 0.5 * (1.0 + jnp.cos(math.pi * progress))
        return jnp.where(count < o.warmup_steps, warm, cosine)

    return shape


def _decay_mask(params):
    # Decay matrices only (not norms' scales, bias-family scalars or the T5 table's ... vectors).
    # Under model.scan_layers the blocks' entries ("blocks/<name>", not "blocks/<i>/<name>") carry
    # a leading layer axis that does not count.
    def decays(path, p):
        keys = [getattr(k, "key", None) for k in path]
        stacked = len(keys) > 1 and keys[0] == "blocks" and not isinstance(keys[1], int)
        return p.ndim - int(stacked) >= 2

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(o: OptimConfig) -> optax.GradientTransformation:
    """Clip, AdamW with injected (array-valued, sweepable) hyperparameters, then the schedule."""
    return optax.chain(
        optax.clip_by_global_norm(o.grad_clip),
        # `mask` must be static: inject_hyperparams would otherwise call it as a schedule and
        # store its result (False), silently switching weight decay off.
        optax.inject_hyperparams(optax.adamw, static_args="mask")(
            learning_rate=o.learning_rate,
            b1=o.b1,
            b2=o.b2,
            weight_decay=o.weight_decay,
            mask=_decay_mask,
        ),
        optax.scale_by_schedule(lr_shape(o)),
    )


def project_bounds(params: nnx.State) -> nnx.State:
    """Clamps every parameter declared with `bounds=(low, high)` into its range.

    The Kerple reference clamps its parameters' data in place before each use (>= 0.01, and the
    power exponent <= 2); applying the same projection after every optimiser step is equivalent.
    """

    def clamp(v):
        bounds = v.get_metadata().get("bounds") if isinstance(v, nnx.Variable) else None
        if bounds is None:
            return v
        return v.replace(jnp.clip(v[...], bounds[0], bounds[1]))

    return jax.tree.map(clamp, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def init_model(cfg: ModelConfig, key: jax.Array) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, params, constants) of a freshly initialised model."""
    model = TransformerLM(cfg, rngs=nnx.Rngs(params=key))
    graphdef, params, constants = nnx.split(model, nnx.Param, ...)
    return graphdef, project_bounds(params), constants


def init_train_state(
    cfg: ModelConfig, tx: optax.GradientTransformation, key: jax.Array, params=None
) -> dict[str, Any]:
    """A run's first state: the model initialised from `key`, AdamW's moments at 0, step 0.

    `params`: the parameters to start from instead (another run's, a published checkpoint's),
    of the model's structure. The random ones are then unused, so a jitted initialisation never
    computes them (XLA drops them: no random-number kernels compiled or run, no second copy of a
    large model's weights); the constants and moments are what they would be."""
    _, drawn, constants = init_model(cfg, key)
    params = drawn if params is None else params
    # AdamW's moments are float32 whatever model.param_dtype: its updates mix them with float32
    # hyperparameter arrays, so bfloat16 moments would come back float32 after the first step
    # (changing the state's dtypes under jit, and against a checkpoint's restore targets).
    moments_like = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    return {
        "params": params,
        "constants": constants,
        "opt_state": tx.init(moments_like),
        "step": jnp.zeros((), jnp.int32),
    }


# XLA:CPU spends most of an initialisation's compile in LLVM optimising its random-number kernels
# (threefry): seconds for a 0.1M-parameter model, more than its train step. At backend
# optimisation level 1 the same program compiles 1.6-2.7x faster a family and gives bitwise the
# same arrays (every family at two shapes, `benchmarks/init_compile.py`; tests/train/test_steps.py
# checks a model mixing them); the program runs once a run, so its own speed does not matter.
# Other backends keep their default, and so does a CPU whose XLA_FLAGS name a level: that level is
# the user's choice (the test suite's, for one, compiles everything at level 0).
_CPU_INIT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1}


def _init_compiler_options(platform: str) -> dict[str, Any] | None:
    if platform != "cpu" or "--xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""):
        return None
    return _CPU_INIT_COMPILER_OPTIONS


def jit_init_train_state(
    cfg: ModelConfig, tx: optax.GradientTransformation, *, out_shardings=None, platform=None
):
    """`init_train_state(cfg, tx, key[, params])` jitted (called with the key, and the starting
    parameters if any), compiled the fast way on a CPU (`platform`, default JAX's backend) to
    the same values, unless XLA_FLAGS names a backend optimisation level."""
    platform = platform or jax.default_backend()
    return jax.jit(
        functools.partial(init_train_state, cfg, tx),
        out_shardings=out_shardings,
        compiler_options=_init_compiler_options(platform),
    )


def _injected(x) -> bool:
    return isinstance(x, (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState))


def hyperparams(opt_state) -> dict[str, jax.Array]:
    """The optimiser's injected hyperparameters (learning rate, b1, b2, weight decay), wherever
    `make_optimizer` puts them in the state."""
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=_injected) if _injected(x)]
    if len(found) != 1:
        raise ValueError(
            f"expected one inject_hyperparams state in the optimiser, found {len(found)}"
        )
    return dict(found[0].hyperparams)


def with_hyperparams(opt_state, values: dict[str, Any]):
    """`opt_state` with those injected hyperparameters replaced (the moments and count kept)."""

    def replace(x):
        if not _injected(x):
            return x
        return x._replace(hyperparams={**x.hyperparams, **values})

    return jax.tree.map(replace, opt_state, is_leaf=_injected)


def loss_fn(params, constants, graphdef, batch) -> jax.Array:
    """Mean target NLL in nats over positions of nonzero weight (as `model.cross_entropy` of the
    logits, without ever holding the whole batch's logits: `TransformerLM.nll_sums`)."""
    model = nnx.merge(graphdef, params, constants)
    h = model.hidden(batch["inputs"])  # (B, T, D)
    total, count = model.nll_sums(h, batch["targets"], batch.get("weights"))
    return total / jnp.maximum(count, 1.0)


def _global_norm(tree) -> jax.Array:
    return optax.tree.norm(tree)


def train_step(graphdef, optim: OptimConfig, state: dict, batch: dict) -> tuple[dict, dict]:
    """One optimiser update; returns the new state and this step's metrics (`loss`: pre-update)."""
    tx = make_optimizer(optim)
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], state["constants"], graphdef, batch)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = project_bounds(optax.apply_updates(state["params"], updates))
    peak = hyperparams(opt_state)["learning_rate"]
    metrics = {
        "loss": loss,
        "grad_norm": _global_norm(grads),
        "param_norm": _global_norm(params),
        "learning_rate": peak * lr_shape(optim)(state["step"]),
    }
    new_state = {
        "params": params,
        "constants": state["constants"],
        "opt_state": opt_state,
        "step": state["step"] + 1,
    }
    return new_state, metrics


def eval_step(graphdef, params, constants, batch) -> tuple[jax.Array, jax.Array]:
    """(sum of target NLL in nats, number of targets) of one batch, for exact averaging."""
    model = nnx.merge(graphdef, params, constants)
    h = model.hidden(batch["inputs"])  # (B, T, D)
    return model.nll_sums(h, batch["targets"], batch.get("weights"))
