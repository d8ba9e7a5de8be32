"""Writes tests/nn/data/default_trees.json: the parameter tree (path, shape, dtype, sum of the
values) of a freshly initialised TransformerLM for every family, unrolled and scanned.

Made from the code before `model.layer_pattern` existed, so that `test_pattern.py` can check that
the default model (an empty pattern) keeps that tree path by path, and its initial values too:
checkpoints written before it still restore. The scanned entries' values ("-scan1") were
written again when the scanned layout started drawing its initial values as the unrolled layout
does (its blocks are the per-layer blocks, stacked): each of their sums is the sum of the unrolled
entry's layers, and the unrolled entries did not change.

    git archive 4616777 src | tar -x -C /tmp/base
    PYTHONPATH=/tmp/base/src python tests/nn/make_default_trees.py
"""

import json
import pathlib

import jax
import numpy as np
from flax import nnx

from posattn import families
from posattn.nn.config import ModelConfig
from posattn.nn.model import TransformerLM

OUT = pathlib.Path(__file__).parent / "data" / "default_trees.json"
NAMES = ("nope", "sinusoidal", "learned", "rope", "t5", "alibi", "kerple_power", "kerple_log",
         "sandwich", "fire")  # fmt: skip


def configs():
    for name in NAMES:
        settings = families.get(name).settings.from_keys({"max_len": 64})
        for scan in (False, True):
            yield f"{name}-scan{int(scan)}", ModelConfig(
                position=name, d_model=16, num_heads=2, num_kv_heads=1, num_layers=2,
                scan_layers=scan, settings=settings,
            )  # fmt: skip


def tree(cfg):
    model = TransformerLM(cfg, rngs=nnx.Rngs(params=jax.random.key(0)))
    return [
        ["/".join(map(str, path)), list(v.shape), str(v.dtype), float(np.sum(np.asarray(v)))]
        for path, v in nnx.to_flat_state(nnx.state(model))
    ]


if __name__ == "__main__":
    OUT.parent.mkdir(exist_ok=True)
    trees = {name: tree(cfg) for name, cfg in configs()}
    lines = [
        f"{json.dumps(name)}: [\n" + ",\n".join("  " + json.dumps(leaf) for leaf in leaves) + "\n]"
        for name, leaves in trees.items()
    ]
    OUT.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    print(f"wrote {OUT}")
