"""Sharding: every process builds only the batch rows its devices hold, and they assemble to the
global batch (train's rows and a sweep's (members, rows)); fsdp layouts; mesh refusals."""

import inspect
import json

import jax
import numpy as np
import pytest
from conftest import run_python
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from posattn.config import ConfigError
from posattn.train import sharding


def _rows(shape):
    """A builder whose block at `index` is that block of a known global array, and its calls."""
    full = np.arange(np.prod(shape) * 3).reshape(*shape, 3)
    calls = []

    def build(index):
        calls.append(tuple((s.start, s.stop) for s in index))
        return {"x": full[index], "y": full[index].astype(np.float32) / 2}

    return full, calls, build


def test_one_device_builds_the_whole_batch_once():
    full, calls, build = _rows((6,))
    out = sharding.global_batch(build, sharding.batch_sharding(sharding.make_mesh()), (6,))
    np.testing.assert_array_equal(np.asarray(out["x"]), full)
    np.testing.assert_array_equal(np.asarray(out["y"]), full / 2)
    assert calls == [((0, 6),)]


_EIGHT = """
import json
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from posattn.train import sharding

out = {}
mesh = sharding.make_mesh(2)  # data 4 x fsdp 2: a row block per device
full, calls, build = _rows((16,))
batch = sharding.global_batch(build, sharding.batch_sharding(mesh), (16,))
out["rows_equal"] = bool(np.array_equal(np.asarray(batch["x"]), full))
out["rows_calls"] = sorted(calls)
sweep = jax.make_mesh((2, 4, 1), ("sweep", "data", "fsdp"))
full, calls, build = _rows((2, 8))
batch = sharding.global_batch(build, NamedSharding(sweep, P("sweep", ("data", "fsdp"))), (2, 8))
out["sweep_equal"] = bool(np.array_equal(np.asarray(batch["x"]), full))
out["sweep_calls"] = sorted(calls)
abstract = {
    "w": jax.ShapeDtypeStruct((8, 12), np.float32),
    "b": jax.ShapeDtypeStruct((3,), np.float32),
}
specs = sharding.state_shardings(sharding.make_mesh(4), abstract)
out["specs"] = {k: list(v.spec) for k, v in specs.items()}
print("RESULT", json.dumps(out))
"""


def test_eight_devices_each_get_their_block():
    code = "import jax\n" + _EIGHT.replace("out = {}", inspect.getsource(_rows) + "out = {}")
    out = json.loads(run_python(code, devices=8).split("RESULT", 1)[1])
    assert out["rows_equal"] and out["sweep_equal"]
    # One process holds every block: one call, for all of it, cut into the devices' blocks.
    assert out["rows_calls"] == [[[0, 16]]] and out["sweep_calls"] == [[[0, 2], [0, 8]]]
    # fsdp 4: the largest axis that 4 divides is split; what it divides nowhere is replicated.
    assert out["specs"] == {"w": [None, "fsdp"], "b": []}


def test_an_impossible_mesh_is_a_config_error_naming_the_allowed_sizes():
    with pytest.raises(ConfigError, match=r"train.fsdp=3 must divide .*; allowed: 1, 2, 4, 8"):
        sharding.check_fsdp(3, 8)
    with pytest.raises(ConfigError, match="allowed: 1, 2, 4, 8"):
        sharding.check_fsdp(0, 8)
    assert sharding.check_fsdp(4, 8) == 4
    with pytest.raises(ConfigError, match=f"number of devices \\({jax.device_count()}\\)"):
        sharding.make_mesh(jax.device_count() + 1)


def test_one_process_agrees_with_itself():
    assert sharding.any_process(True) and not sharding.any_process(False)
    assert isinstance(sharding.batch_sharding(sharding.make_mesh()), NamedSharding)
    assert sharding.batch_sharding(sharding.make_mesh()).spec == P(("data", "fsdp"))
