"""How large the trained models' attention logits are, at L and past it: what a soft cap binds.

    python experiments/logit_scale.py WORKDIR [ROW ...]

For each trained row of a length-extrapolation workdir (every seed), on 8 held-out windows of
each length (the corpus's validation split, fixed draws), each layer's content logits
s = scale * q.k over the causal (query, key) pairs, before any soft cap or position bias: the
median and 99th percentile of |s|, and of each query row's largest s (the logit its sharpest key
gets). Prints a markdown table. A soft cap c (`model.attn_logit_softcap`) bends logits near c and
above: c tanh(s / c) is 0.76 c at s = c.
"""

from __future__ import annotations

import pathlib
import sys

import jax.numpy as jnp
import numpy as np
from flax import nnx

from posattn import data as data_lib
from posattn.nn import layers
from posattn.nn.model import TransformerLM
from posattn.train import restore_trained
from posattn.train import workdir as workdir_lib

WINDOWS = 8


def _run_dirs(workdir: pathlib.Path, rows: list[str]):
    for row in rows or sorted(p.name for p in workdir.iterdir() if (p / "checkpoints").is_dir()):
        base = workdir / row
        yield row, 0, base
        for seed_dir in sorted(base.glob("seed*")):
            yield row, int(seed_dir.name[4:]), seed_dir


def _quantiles(x: np.ndarray) -> str:
    return f"{np.quantile(x, 0.5):.2f} / {np.quantile(x, 0.99):.2f}"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    workdir, rows = pathlib.Path(argv[0]), argv[1:]
    print("| row | seed | T | layer | abs(s): median / p99 | row max of s: median / p99 |")
    print("|---|---:|---:|---:|---:|---:|")
    for row, seed, path in _run_dirs(workdir, rows):
        config = workdir_lib.read_config(path)
        restored = restore_trained(config, path / "checkpoints")
        if restored is None:
            raise SystemExit(f"{path} holds no checkpoint to read")
        cfg, state, _ = restored
        graphdef = nnx.graphdef(nnx.eval_shape(lambda c=cfg: TransformerLM(c, rngs=nnx.Rngs(0))))
        model = nnx.merge(graphdef, state["params"], state["constants"])
        val = np.asarray(data_lib.load_corpus(config.data.corpus).val)
        L = int(config.data.seq_len)
        for T in (L, 16 * L):
            starts = np.random.default_rng(0).integers(0, val.size - T, WINDOWS)
            tokens = jnp.asarray(np.stack([val[s : s + T] for s in starts]), jnp.int32)
            x, pos = model.embed_tokens(tokens), layers.token_positions(0, T)
            causal = np.tril(np.ones((T, T), bool))
            kv = None
            for i, block in enumerate(model.blocks):
                if i % cfg.kv_share == 0:
                    kv = None
                attn = block.attn
                h = block.attn_norm(x)
                own = attn.project_kv(h, pos, seq_len=T) if attn.owns_kv else kv
                q = attn._temper(attn.project_q(h, pos, seq_len=T), pos, T)  # its temperature
                k = jnp.repeat(own[0], q.shape[2] // own[0].shape[2], axis=2)
                s = np.asarray(attn.scale * jnp.einsum("btnh,bsnh->bnts", q, k))
                row_max = np.where(causal, s, -np.inf).max(-1)
                print(
                    f"| {row} | {seed} | {T} | {i} | {_quantiles(np.abs(s[..., causal]))} | "
                    f"{_quantiles(row_max)} |"
                )
                x, kv = block(x, kv=kv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
