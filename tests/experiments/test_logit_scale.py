"""experiments/logit_scale.py: the content logits' size per layer at L and 16L."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import experiment_script, small_config
from flax import nnx

from posattn import data as data_lib
from posattn.generate import load_model
from posattn.nn.config import ConfigError
from posattn.train import train_and_evaluate


@pytest.fixture(scope="module")
def script():
    return experiment_script("logit_scale")


def test_each_layers_logits_at_L_and_16L_for_every_row_and_seed(script, tmp_path, capsys):
    for workdir in ("nope", "nope/seed1"):
        config = small_config(
            model__position="nope", train__steps=2, train__checkpoint_every=2, train__seed=7
        )
        train_and_evaluate(config, tmp_path / workdir)
    assert script.main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    L, layers = config.data.seq_len, config.model.num_layers
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [r[:4] for r in rows] == [
        ["nope", str(seed), str(T), str(i)]
        for seed in (0, 1)
        for T in (L, 16 * L)
        for i in range(layers)
    ]
    # Layer 0 at L, seed 0, from the parameters directly: s = scale (h wq) . (h wk) over the
    # causal pairs of the same 8 held-out windows, h the first norm of the embedded tokens.
    _, graphdef, params, constants, _ = load_model(tmp_path / "nope")
    model = nnx.merge(graphdef, params, constants)
    val = np.asarray(data_lib.load_corpus(config.data.corpus).val)
    starts = np.random.default_rng(0).integers(0, val.size - L, 8)
    tokens = jnp.asarray(np.stack([val[s : s + L] for s in starts]), jnp.int32)
    attn = model.blocks[0].attn
    h = model.blocks[0].attn_norm(model.embed_tokens(tokens))
    q = jnp.einsum("btd,dnh->btnh", h, attn.wq[...])
    k = jnp.einsum("btd,dnh->btnh", h, attn.wk[...])  # K heads: query head n reads head n // G
    k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
    s = np.asarray(attn.scale * jnp.einsum("btnh,bsnh->bnts", q, k))
    causal = np.tril(np.ones((L, L), bool))
    a, row_max = np.abs(s[..., causal]), np.where(causal, s, -np.inf).max(-1)
    want = [f"{np.quantile(x, 0.5):.2f} / {np.quantile(x, 0.99):.2f}" for x in (a, row_max)]
    assert rows[0][4:] == want
    with pytest.raises(ConfigError, match="rope"):  # a row the workdir does not hold
        script.main([str(tmp_path), "rope"])
