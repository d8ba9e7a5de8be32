"""Writes tests/goldens/rope_goldens.json: Hugging Face transformers' RoPE frequencies, attention
factors and rotations for partial rotary, proportional rotary (Gemma 4) and LongRoPE.

Run (needs transformers and torch; the tests read only the committed JSON):
    python tests/goldens/make_rope_goldens.py

Frequencies: `transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[rope_type](config, "cpu",
seq_len=...)` on a `LlamaConfig` whose `rope_parameters` carry the setting (transformers 5 keeps
`partial_rotary_factor` there), and for the default rope with a partial factor
`GPTNeoXRotaryEmbedding.compute_default_rope_parameters(GPTNeoXConfig(...))` (Llama's default
ignores the factor; GPT-NeoX's reads it, as Pythia's `rotary_pct`). Values are HF's float32 results.

Rotations, evaluated in float64 from those float32 frequencies (so the golden is the exact rotation
of the given frequencies):
- "half": `transformers.models.gpt_neox.modeling_gpt_neox.apply_rotary_pos_emb` (rotate_half on the
  first `cos.shape[-1]` dims, the rest concatenated back), cos/sin of cat(freqs, freqs) times the
  attention factor as `GPTNeoXRotaryEmbedding.forward` builds them;
- "interleaved": `transformers.models.gptj.modeling_gptj.apply_rotary_pos_emb` (rotate_every_two)
  on the first `rotary_dim` dims, the rest concatenated back as `GPTJAttention.forward` does;
- "proportional": `transformers.models.gemma4.modeling_gemma4.apply_rotary_pos_emb` on the whole
  head with the proportional frequencies (zeros included).
Inputs are `pseudo_random(shape, seed)`, the same function as in tests/test_rotary.py.
"""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import torch
import transformers
from transformers import GPTNeoXConfig, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gemma4 import modeling_gemma4
from transformers.models.gpt_neox import modeling_gpt_neox
from transformers.models.gptj import modeling_gptj

OUT = pathlib.Path(__file__).with_name("rope_goldens.json")


def pseudo_random(shape, seed):
    n = np.arange(int(np.prod(shape)), dtype=np.uint64)
    h = (n * np.uint64(2654435761) + np.uint64(seed) * np.uint64(40503)) % np.uint64(2**32)
    return ((h >> np.uint64(12)).astype(np.float64) / 2**18 - 2.0).reshape(shape).astype(np.float32)


def f32_list(values):
    # Shortest round-trip decimal of each float32 value.
    return [float(np.format_float_positional(np.float32(v), unique=True)) for v in values]


# LongRoPE factor lists: made-up but Phi-3-shaped (short ~1, long growing with the pair index).
def short_factors(n):
    return [round(1.0 + 0.02 * k, 4) for k in range(n)]


def long_factors(n):
    return [round(1.0 + 0.25 * k**1.5, 4) for k in range(n)]


# name -> (head_dim, base, max_position_embeddings, seq_len, HF rope_parameters without
#          rope_theta, posattn scaling dict or None)
CASES: dict[str, tuple] = {}
for h in (16, 64, 80):
    for p in (0.25, 0.5):
        CASES[f"partial_{p}_h{h}"] = (
            h,
            10000.0,
            2048,
            None,
            {"rope_type": "default", "partial_rotary_factor": p},
            {"rope_type": "default", "partial_rotary_factor": p},
        )
# int(20 * 0.25) = 5: an odd rotary dim; HF takes arange(0, 5, 2) -> 3 frequencies over R = 5.
CASES["partial_odd_h20"] = (
    20,
    10000.0,
    2048,
    None,
    {"rope_type": "default", "partial_rotary_factor": 0.25},
    {"rope_type": "default", "partial_rotary_factor": 0.25},
)
CASES["partial_0.25_linear_h64"] = (
    64,
    10000.0,
    4096,
    None,
    {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.25},
    {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.25},
)
CASES["partial_0.5_yarn_h64"] = (
    64,
    10000.0,
    8192,
    None,
    {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 2048,
        "partial_rotary_factor": 0.5,
    },
    {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 2048,
        "partial_rotary_factor": 0.5,
    },
)
# dynamic: HF reads the original length from config.max_position_embeddings (256 here).
CASES["partial_0.5_dynamic_h64"] = (
    64,
    10000.0,
    256,
    1000,
    {"rope_type": "dynamic", "factor": 2.0, "partial_rotary_factor": 0.5},
    {
        "rope_type": "dynamic",
        "factor": 2.0,
        "original_max_position_embeddings": 256,
        "partial_rotary_factor": 0.5,
    },
)
CASES["partial_0.5_llama3_h128"] = (
    128,
    500000.0,
    131072,
    None,
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "partial_rotary_factor": 0.5,
    },
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "partial_rotary_factor": 0.5,
    },
)
for h in (16, 64, 256):
    for p in (0.25, 0.5):
        CASES[f"proportional_{p}_h{h}"] = (
            h,
            1_000_000.0 if h == 256 else 10000.0,
            2048,
            None,
            {"rope_type": "proportional", "partial_rotary_factor": p},
            {"rope_type": "proportional", "partial_rotary_factor": p},
        )
CASES["proportional_1.0_h16"] = (
    16,
    10000.0,
    2048,
    None,
    {"rope_type": "proportional", "partial_rotary_factor": 1.0},
    {"rope_type": "proportional", "partial_rotary_factor": 1.0},
)
CASES["proportional_0.25_factor_h64"] = (
    64,
    10000.0,
    2048,
    None,
    {"rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": 2.0},
    {"rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": 2.0},
)
# LongRoPE, head 32 (16 pairs), original length 256, max_position_embeddings 1024 (factor 4
# inferred as HF does when the dict has no factor).
_LR = {
    "rope_type": "longrope",
    "short_factor": short_factors(16),
    "long_factor": long_factors(16),
    "original_max_position_embeddings": 256,
}
for seq_len in (None, 100, 256, 257, 1000):
    CASES[f"longrope_inferred_{seq_len}"] = (
        32,
        10000.0,
        1024,
        seq_len,
        dict(_LR),
        {**_LR, "max_position_embeddings": 1024},
    )
CASES["longrope_factor_1000"] = (
    32,
    10000.0,
    1024,
    1000,
    {**_LR, "factor": 8.0},
    {**_LR, "factor": 8.0},
)
CASES["longrope_attention_factor_1000"] = (
    32,
    10000.0,
    1024,
    1000,
    {**_LR, "factor": 4.0, "attention_factor": 1.2},
    {**_LR, "factor": 4.0, "attention_factor": 1.2},
)
# Phi-3-mini-128k's lengths (4096 -> 131072), head 96.
_PHI = {
    "rope_type": "longrope",
    "short_factor": short_factors(48),
    "long_factor": long_factors(48),
    "original_max_position_embeddings": 4096,
}
for seq_len in (4096, 4097):
    CASES[f"longrope_phi3_{seq_len}"] = (
        96,
        10000.0,
        131072,
        seq_len,
        dict(_PHI),
        {**_PHI, "max_position_embeddings": 131072},
    )
CASES["partial_0.5_longrope_h32"] = (
    32,
    10000.0,
    1024,
    1000,
    {
        **_LR,
        "short_factor": short_factors(8),
        "long_factor": long_factors(8),
        "partial_rotary_factor": 0.5,
    },
    {
        **_LR,
        "short_factor": short_factors(8),
        "long_factor": long_factors(8),
        "partial_rotary_factor": 0.5,
        "max_position_embeddings": 1024,
    },
)


def hf_frequencies(head_dim, base, max_pos, seq_len, params):
    params = {**params, "rope_theta": base}
    kind = params["rope_type"]
    if kind == "default":
        config = GPTNeoXConfig(
            hidden_size=4 * head_dim,
            num_attention_heads=4,
            max_position_embeddings=max_pos,
            rope_parameters=params,
        )
        inv_freq, factor = modeling_gpt_neox.GPTNeoXRotaryEmbedding.compute_default_rope_parameters(
            config
        )
    else:
        config = LlamaConfig(
            hidden_size=4 * head_dim,
            num_attention_heads=4,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rope_parameters=params,
        )
        inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=seq_len)
    assert inv_freq.dtype == torch.float32, inv_freq.dtype
    return inv_freq.numpy(), float(factor)


def rotate_half_neox(x, inv_freq, positions, factor):
    # x: [B, T, N, H] float64; cos/sin [B, T, 2F] as GPTNeoXRotaryEmbedding.forward.
    freqs = torch.tensor(positions, dtype=torch.float64)[..., None] * torch.tensor(
        inv_freq, dtype=torch.float64
    )
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * factor, emb.sin() * factor
    q = torch.tensor(x, dtype=torch.float64)
    out, _ = modeling_gpt_neox.apply_rotary_pos_emb(q, q, cos, sin, unsqueeze_dim=2)
    return out.numpy()


def rotate_gemma4(x, inv_freq, positions, factor):
    freqs = torch.tensor(positions, dtype=torch.float64)[..., None] * torch.tensor(
        inv_freq, dtype=torch.float64
    )
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * factor, emb.sin() * factor
    q = torch.tensor(x, dtype=torch.float64)
    return modeling_gemma4.apply_rotary_pos_emb(q, cos, sin, unsqueeze_dim=2).numpy()


def rotate_gptj(x, inv_freq, positions, rotary_dim):
    # GPTJAttention.forward: sincos = embed_positions[position_ids] split into sin | cos, then
    # apply_rotary_pos_emb on the first rotary_dim dims of [B, T, N, H], the rest concatenated.
    freqs = torch.tensor(positions, dtype=torch.float64)[..., None] * torch.tensor(
        inv_freq, dtype=torch.float64
    )
    sin, cos = freqs.sin(), freqs.cos()
    t = torch.tensor(x, dtype=torch.float64)
    rot, rest = t[..., :rotary_dim], t[..., rotary_dim:]
    rot = modeling_gptj.apply_rotary_pos_emb(rot, sin, cos)
    return torch.cat([rot, rest], dim=-1).numpy()


def main():
    frequencies = {}
    for name, (head_dim, base, max_pos, seq_len, params, scaling) in CASES.items():
        inv_freq, factor = hf_frequencies(head_dim, base, max_pos, seq_len, params)
        frequencies[name] = {
            "head_dim": head_dim,
            "base": base,
            "seq_len": seq_len,
            "hf_max_position_embeddings": max_pos,
            "hf_rope_parameters": params,
            "scaling": scaling,
            "inv_freq": f32_list(inv_freq),
            "attention_factor": factor,
        }

    positions = [[0, 1, 7, 300], [5, 1000, 4095, 20000]]
    rotations = {}
    # Partial, half layout (GPT-NeoX): p = 0.25 of head 16 (R = 4), default frequencies.
    x = pseudo_random((2, 4, 2, 16), seed=11)
    inv = np.asarray(frequencies["partial_0.25_h16"]["inv_freq"], np.float32)
    rotations["neox_partial_0.25_h16"] = {
        "layout": "half",
        "shape": [2, 4, 2, 16],
        "seed": 11,
        "positions": positions,
        "inv_freq": f32_list(inv),
        "attention_factor": 1.0,
        "out": rotate_half_neox(x, inv, positions, 1.0).ravel().tolist(),
    }
    # Partial + yarn, half layout: the attention factor scales the rotated dims only.
    x = pseudo_random((2, 4, 2, 64), seed=12)
    case = frequencies["partial_0.5_yarn_h64"]
    inv = np.asarray(case["inv_freq"], np.float32)
    rotations["neox_partial_0.5_yarn_h64"] = {
        "layout": "half",
        "shape": [2, 4, 2, 64],
        "seed": 12,
        "positions": positions,
        "inv_freq": f32_list(inv),
        "attention_factor": case["attention_factor"],
        "out": rotate_half_neox(x, inv, positions, case["attention_factor"]).ravel().tolist(),
    }
    # Odd rotary dim: R = int(20 * 0.25) = 5, 3 frequencies, HF rotates cos.shape[-1] = 6 dims.
    x = pseudo_random((2, 4, 2, 20), seed=13)
    inv = np.asarray(frequencies["partial_odd_h20"]["inv_freq"], np.float32)
    rotations["neox_partial_odd_h20"] = {
        "layout": "half",
        "shape": [2, 4, 2, 20],
        "seed": 13,
        "positions": positions,
        "inv_freq": f32_list(inv),
        "attention_factor": 1.0,
        "out": rotate_half_neox(x, inv, positions, 1.0).ravel().tolist(),
    }
    # Partial, interleaved layout (GPT-J rotary_dim = 8 of head 16): GPT-J's own frequencies
    # 1 / 10000^(arange(0, 8, 2) / 8), i.e. partial_rotary_factor 0.5 of head 16.
    gptj_inv = (
        (1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.int64) / 8))).to(torch.float32).numpy()
    )
    x = pseudo_random((2, 4, 2, 16), seed=14)
    rotations["gptj_rotary_dim_8_h16"] = {
        "layout": "interleaved",
        "shape": [2, 4, 2, 16],
        "seed": 14,
        "positions": positions,
        "inv_freq": f32_list(gptj_inv),
        "attention_factor": 1.0,
        "out": rotate_gptj(x, gptj_inv, positions, 8).ravel().tolist(),
    }
    # Proportional (Gemma 4), half layout over the whole head: p = 0.25 of head 16.
    x = pseudo_random((2, 4, 2, 16), seed=15)
    inv = np.asarray(frequencies["proportional_0.25_h16"]["inv_freq"], np.float32)
    rotations["gemma4_proportional_0.25_h16"] = {
        "layout": "half",
        "shape": [2, 4, 2, 16],
        "seed": 15,
        "positions": positions,
        "inv_freq": f32_list(inv),
        "attention_factor": 1.0,
        "out": rotate_gemma4(x, inv, positions, 1.0).ravel().tolist(),
    }

    OUT.write_text(
        json.dumps(
            {
                "made_by": "tests/goldens/make_rope_goldens.py",
                "versions": {
                    "transformers": transformers.__version__,
                    "torch": torch.__version__,
                    "numpy": np.__version__,
                },
                "frequencies": frequencies,
                "rotations": rotations,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {OUT}: {len(frequencies)} frequency cases, {len(rotations)} rotations")
    assert math.isfinite(sum(c["attention_factor"] for c in frequencies.values()))


if __name__ == "__main__":
    main()
