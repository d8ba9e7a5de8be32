"""Writes tests/nn/data/llama4_attn_scales.json: the query scales Hugging Face's Llama 4 applies
to a NoPE layer (`Llama4TextAttention.forward`, `attn_temperature_tuning`), captured by running
that module (transformers 5.24, torch CPU) with identity query weights on all-ones inputs, in
float32 and in bfloat16, and once more for a chunk that follows 8190 cached tokens.

    python tests/nn/make_llama4_golden.py     # needs transformers and torch, not the package
"""

import json
import pathlib

import torch
from transformers import Llama4TextConfig
from transformers.cache_utils import DynamicCache
from transformers.modeling_utils import AttentionInterface
from transformers.models.llama4.modeling_llama4 import Llama4TextAttention

OUT = pathlib.Path(__file__).parent / "data" / "llama4_attn_scales.json"
CAPTURED = []


def capture(module, query, key, value, attention_mask, **kwargs):
    CAPTURED.append(query.detach().float().clone())  # (B, N, T, H)
    return torch.zeros_like(query).transpose(1, 2), None


def scales(*, floor_scale, attn_scale, T, dtype, past=0):
    AttentionInterface.register("capture", capture)
    config = Llama4TextConfig(
        hidden_size=4, num_attention_heads=1, num_key_value_heads=1, head_dim=4,
        num_hidden_layers=1, no_rope_layers=[0], attn_temperature_tuning=True,
        floor_scale=floor_scale, attn_scale=attn_scale, attention_bias=False,
    )  # fmt: skip
    config._attn_implementation = "capture"
    layer = Llama4TextAttention(config, layer_idx=0).to(dtype)
    with torch.no_grad():
        layer.q_proj.weight.copy_(torch.eye(4, dtype=dtype))
    cache = None
    if past:
        cache = DynamicCache(config=config)
        with torch.no_grad():
            layer(torch.ones(1, past, 4, dtype=dtype), None, None, cache=cache)
    CAPTURED.clear()
    with torch.no_grad():
        layer(torch.ones(1, T, 4, dtype=dtype), None, None, cache=cache)
    return CAPTURED[-1][0, 0, :, 0].tolist()  # the scale of each query position


if __name__ == "__main__":
    out = {
        "floor_scale": 4.0,
        "attn_scale": 0.1,
        "float32": scales(floor_scale=4, attn_scale=0.1, T=100, dtype=torch.float32),
        "bfloat16": scales(floor_scale=4, attn_scale=0.1, T=100, dtype=torch.bfloat16),
        "llama4_defaults_after_8190": scales(
            floor_scale=8192, attn_scale=0.1, T=20000, dtype=torch.float32, past=8190
        )[::997],
    }
    OUT.write_text(json.dumps(out) + "\n")
    print(f"wrote {OUT}")
