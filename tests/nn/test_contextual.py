"""A CoPE layer: its table (zero, [H, max_len + 1] unless model.cope_positions), and its
output, which is `cope_attention` of its own queries, keys and values with the settings of its
entry (gates from the keys or from the values, the position logits scaled or not)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posattn.attention import cope_attention
from posattn.nn import layers
from posattn.nn.config import ModelConfig
from posattn.nn.model import TransformerLM


def _model(**keys):
    base = dict(position="cope", d_model=32, num_heads=4, num_kv_heads=2, num_layers=1)
    cfg = ModelConfig.from_keys({**base, **keys}).validate()
    return TransformerLM(cfg, rngs=nnx.Rngs(0))


def test_the_table_is_zero_and_sized_by_max_len_or_cope_positions():
    table = _model(max_len=24).blocks[0].attn.cope.table[...]
    assert table.shape == (8, 25)
    np.testing.assert_array_equal(table, 0.0)
    assert _model(max_len=24, cope_positions=7).blocks[0].attn.cope.table.shape == (8, 7)


@pytest.mark.parametrize("gates", ["keys", "values", "separate"])
@pytest.mark.parametrize("scale_positions", [True, False])
def test_the_layer_computes_cope_with_its_settings(gates, scale_positions):
    model = _model(max_len=8, cope_gates=gates, cope_scale_positions=scale_positions)
    attn = model.blocks[0].attn
    assert hasattr(attn, "wg") == (gates == "separate")  # a key projection of their own
    attn.cope.table[...] = jax.random.normal(jax.random.key(1), attn.cope.table.shape)
    x = jax.random.normal(jax.random.key(2), (2, 11, 32))
    got, _ = attn(x)
    q, k, v = attn.project_qkv(x, layers.token_positions(0, 11), seq_len=11)
    g = x @ attn.wg[...].reshape(32, -1) if gates == "separate" else None
    table = attn.cope.table[...]

    def out(gate_keys, scale_positions):
        o = cope_attention(
            q, k, v, table, scale=attn.scale, gate_keys=gate_keys, scale_positions=scale_positions
        )
        return layers.dense(o.reshape(2, 11, -1), attn.wo[...].reshape(-1, 32))

    choices = {"keys": None, "values": v, "separate": None if g is None else g.reshape(k.shape)}
    want = out(choices[gates], scale_positions)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for other in ("keys", "values"):  # the setting is not ignored
        if other != gates:
            assert float(jnp.abs(got - out(choices[other], scale_positions)).max()) > 1e-3
    flipped = out(choices[gates], not scale_positions)
    assert float(jnp.abs(got - flipped).max()) > 1e-3


def test_separate_gate_keys_refuse_kv_sharing():
    with pytest.raises(ValueError, match="kv_share=2 is not supported with CoPE's separate"):
        _model(num_layers=2, kv_share=2, cope_gates="separate")
