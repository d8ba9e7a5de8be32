"""The whole training step partitions under the mesh: per-device FLOPs about 1/D; its weight
gradients are the native library's on one device and XLA's (partitioned) under a mesh.

One subprocess with 8 simulated CPU devices compiles `posattn.train.steps.train_step` exactly as
`posattn.train` jits it (state and batch shardings from `posattn.train.sharding`, donated state)
for one device and for the 8-device meshes `data` = 8 and `data` x `fsdp` = 4 x 2, for RoPE, ALiBi,
T5 and FIRE, and compares the per-device FLOPs of `compiled.cost_analysis()` (a compile-time
check, nothing is timed). The shapes keep every loop of the step at one trip (XLA's cost analysis
counts a loop body once): the batch is one chunk of the attention kernel and one slice of the
loss, on one device and on eight. XLA's cost analysis counts no FFI call, and on one device the
step would run its weight gradients (and attention) as the native library's: the subprocess
runs with the library off (POSATTN_NATIVE=0), so that both sides are XLA's own programs.
"""

import json

import pytest
from conftest import ROOT, run_python

FAMILIES = ("rope", "alibi", "t5", "fire")
D = 8

CODE = r"""
import os
os.environ["POSATTN_NATIVE"] = "0"  # XLA's own products on both sides (see the docstring)
import functools, json
import jax, jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from posattn import config as config_lib
from posattn.nn.model import TransformerLM
from posattn.train import sharding, steps

def compiled_flops(config, mesh):
    cfg = config_lib.validate(config)
    optim = steps.OptimConfig.from_config(config.train)
    tx = steps.make_optimizer(optim)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(params=0))))
    abstract = jax.eval_shape(functools.partial(steps.init_train_state, cfg, tx), jax.random.key(0))
    state_sh = sharding.state_shardings(mesh, abstract)
    batch_sh = sharding.batch_sharding(mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         abstract, state_sh)
    B, T = config.train.batch_size, config.data.seq_len
    tokens = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=batch_sh)
    step = jax.jit(functools.partial(steps.train_step, graphdef, optim),
                   in_shardings=(state_sh, batch_sh),
                   out_shardings=(state_sh, NamedSharding(mesh, P())), donate_argnums=0)
    with jax.set_mesh(mesh):
        compiled = step.lower(state, {"inputs": tokens, "targets": tokens}).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])

auto = (jax.sharding.AxisType.Auto,) * 2
one = jax.make_mesh((1, 1), ("data", "fsdp"), axis_types=auto, devices=jax.devices()[:1])
result = {}
for family in FAMILIES:
    config = config_lib.load_config(ROOT / "configs" / "tiny.py", [
        f"model.position={family}", "model.d_model=64", "model.num_layers=1",
        "model.num_heads=4", "model.num_kv_heads=2", "data.seq_len=32", "train.batch_size=16"])
    base = compiled_flops(config, one)
    for fsdp in (1, 2):
        result[f"{family}/fsdp{fsdp}"] = compiled_flops(config, sharding.make_mesh(fsdp)) / base
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def ratios():
    code = f"FAMILIES = {FAMILIES!r}\nimport pathlib\nROOT = pathlib.Path({str(ROOT)!r})\n" + CODE
    return json.loads(run_python(code, devices=D).strip().splitlines()[-1])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fsdp", [1, 2])
def test_train_step_flops_per_device_are_one_eighth(ratios, family, fsdp):
    ratio = ratios[f"{family}/fsdp{fsdp}"]
    assert ratio <= 1.15 / D, f"{family}, fsdp={fsdp}: per-device FLOPs {ratio:.3f} of one device's"


WEIGHT_GRADIENTS = r"""
import functools
import jax, jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from posattn import config as config_lib
from posattn.attention import native
from posattn.nn.model import TransformerLM
from posattn.train import sharding, steps

print("AVAILABLE", native.available())
config = config_lib.load_config(ROOT / "configs" / "tiny.py", [
    "model.d_model=64", "model.num_layers=1", "data.seq_len=32", "train.batch_size=16"])
cfg = config_lib.validate(config)
optim = steps.OptimConfig.from_config(config.train)
tx = steps.make_optimizer(optim)
graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(params=0))))
abstract = jax.eval_shape(functools.partial(steps.init_train_state, cfg, tx), jax.random.key(0))
auto = (jax.sharding.AxisType.Auto,) * 2
for mesh in (jax.make_mesh((1, 1), ("data", "fsdp"), axis_types=auto, devices=jax.devices()[:1]),
             sharding.make_mesh(1)):
    state_sh = sharding.state_shardings(mesh, abstract)
    batch_sh = sharding.batch_sharding(mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         abstract, state_sh)
    tokens = jax.ShapeDtypeStruct((16, 32), jnp.int32, sharding=batch_sh)
    step = jax.jit(functools.partial(steps.train_step, graphdef, optim),
                   in_shardings=(state_sh, batch_sh),
                   out_shardings=(state_sh, NamedSharding(mesh, P())), donate_argnums=0)
    with jax.set_mesh(mesh):  # as posattn.train compiles its step
        text = step.lower(state, {"inputs": tokens, "targets": tokens}).compile().as_text()
    counts = [text.count(f"posattn_{name}") for name in ("weight_gradient", "product")]
    print("DEVICES", mesh.size, *counts)
"""


def test_weight_gradients_are_the_librarys_on_one_device_and_xlas_under_a_mesh():
    """On one device the step's float32 weight gradients are the native library's product (one
    layer: q/k/v, output, MLP in and out, the tied table), and so are its 512-row dense products
    and their input gradients with AVX-512 (10: the same five forward and backward); under an
    8-device mesh they are all XLA's, which its partitioner splits (an FFI call it would
    gather)."""
    code = f"import pathlib\nROOT = pathlib.Path({str(ROOT)!r})\n" + WEIGHT_GRADIENTS
    lines = run_python(code, devices=D).strip().splitlines()
    if "AVAILABLE False" in lines:
        pytest.skip("the native library did not build here")
    counts = {line.split()[1]: line.split()[2:] for line in lines if line.startswith("DEVICES")}
    from posattn.attention import native

    products = "10" if native.wide_vectors() else "0"  # measured, and used, with AVX-512 only
    assert counts == {"1": ["5", products], "8": ["0", "0"]}
