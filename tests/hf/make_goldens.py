"""Writes tests/hf/goldens/<case>/: a tiny Hugging Face checkpoint and the logits transformers
computes for it (run with transformers and torch installed; the files are committed, so the tests
need neither).

    PYTHONPATH=src python tests/hf/make_goldens.py [case ...]

Every tensor is randomised (transformers initialises biases to 0 and norm weights to 1, which
would hide a dropped tensor). Each case directory holds config.json, model.safetensors (or shards
with model.safetensors.index.json) and expected.npz (tokens int64[2, T], logits float32[2, T, V],
the transformers version).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

HERE = pathlib.Path(__file__).parent
GOLDENS = HERE / "goldens"
T = 24  # tokens per row; the scaled-RoPE cases train at 16, so T exceeds it

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2)
LLAMA = dict(SMALL, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
SCALED = dict(LLAMA, max_position_embeddings=16)
NO_IDS = dict(LLAMA, bos_token_id=None, eos_token_id=None, pad_token_id=None)  # ids past V


def cases() -> dict[str, tuple[str, dict, dict]]:
    """case -> (transformers config class, its arguments, options for writing)."""
    return {
        "llama_gqa": ("LlamaConfig", dict(LLAMA, tie_word_embeddings=False), {}),
        "llama_mqa_tied": (
            "LlamaConfig",
            dict(LLAMA, num_key_value_heads=1, tie_word_embeddings=True, rope_theta=500.0),
            {},
        ),
        "llama_head_dim": (
            "LlamaConfig",
            dict(LLAMA, head_dim=12, tie_word_embeddings=False, rms_norm_eps=1e-5),
            {},
        ),
        # Llama's attention_bias alone: biases on q, k, v and o, none on the MLP.
        "llama_attention_bias": (
            "LlamaConfig",
            dict(LLAMA, attention_bias=True, mlp_bias=False, tie_word_embeddings=False),
            {},
        ),
        "llama_six_heads": (
            "LlamaConfig",
            dict(LLAMA, hidden_size=36, num_attention_heads=6, num_key_value_heads=3),
            {},
        ),
        "rope_linear": (
            "LlamaConfig",
            dict(SCALED, rope_scaling={"rope_type": "linear", "factor": 4.0}),
            {},
        ),
        "rope_dynamic": (
            "LlamaConfig",
            dict(SCALED, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
            {},
        ),
        "rope_yarn": (
            "LlamaConfig",
            dict(
                SCALED,
                rope_scaling={
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 16,
                    "beta_fast": 8.0,
                    "beta_slow": 1.0,
                },
            ),
            {},
        ),
        "rope_llama3": (
            "LlamaConfig",
            dict(
                SCALED,
                rope_theta=500000.0,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8,
                },
            ),
            {},
        ),
        "rope_longrope": (
            "LlamaConfig",
            dict(
                LLAMA,  # max_position_embeddings 64 over 16: the attention factor's ratio is 4
                rope_scaling={
                    "rope_type": "longrope",
                    "short_factor": [1.0, 1.5, 2.0, 3.0],
                    "long_factor": [1.2, 2.5, 4.0, 6.5],
                    "original_max_position_embeddings": 16,
                },
            ),
            {},
        ),
        "qwen2": (
            "Qwen2Config",
            dict(LLAMA, tie_word_embeddings=False, use_sliding_window=False),
            {},
        ),
        # Qwen3: an RMSNorm over each head's query and key before RoPE; head_dim 12 != D / N.
        "qwen3": ("Qwen3Config", dict(LLAMA, head_dim=12, tie_word_embeddings=False), {}),
        "qwen3_attention_bias": (
            "Qwen3Config",
            dict(LLAMA, head_dim=12, tie_word_embeddings=False, attention_bias=True),
            {},
        ),
        "qwen3_window": (
            "Qwen3Config",
            dict(
                LLAMA,
                head_dim=8,
                rope_theta=1e6,
                tie_word_embeddings=True,
                use_sliding_window=True,
                sliding_window=6,
                layer_types=["sliding_attention", "full_attention"],
            ),
            {},
        ),
        # Phi-3: q | k | v and gate | up rows fused. Phi-3-mini-128k's LongRoPE in the Hub's form
        # (top-level original_max_position_embeddings, type "longrope"), T past it; Phi-4-mini's
        # partial rotary (half the head here) under LongRoPE, with a window on every layer.
        "phi3_longrope": (
            "Phi3Config",
            dict(
                NO_IDS,
                original_max_position_embeddings=16,
                rope_scaling={
                    "type": "longrope",
                    "short_factor": [1.0, 1.2, 1.5, 2.0],
                    "long_factor": [1.5, 2.5, 4.0, 7.0],
                },
                tie_word_embeddings=False,
            ),
            {},
        ),
        "phi3_partial": (
            "Phi3Config",
            dict(
                NO_IDS,
                original_max_position_embeddings=16,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 2e4,
                    "partial_rotary_factor": 0.5,
                    "short_factor": [1.0, 1.5],
                    "long_factor": [2.0, 5.0],
                },
                sliding_window=6,
                tie_word_embeddings=True,
            ),
            {},
        ),
        # SmolLM3: NoPE layers between RoPE ones; by its interval (every 2nd layer here), and
        # listed in no_rope_layers with a window on the NoPE layer and biases everywhere.
        "smollm3": ("SmolLM3Config", dict(NO_IDS, no_rope_layer_interval=2), {}),
        # SmolLM3's attention_bias alone (q, k, v and o; none on the MLP), read by Llama's code.
        "smollm3_attention_bias": (
            "SmolLM3Config",
            dict(
                NO_IDS,
                no_rope_layer_interval=2,
                attention_bias=True,
                mlp_bias=False,
                tie_word_embeddings=False,
            ),
            {},
        ),
        "smollm3_window": (
            "SmolLM3Config",
            dict(
                NO_IDS,
                num_hidden_layers=3,
                no_rope_layers=[1, 0, 1],
                use_sliding_window=True,
                sliding_window=6,
                attention_bias=True,
                mlp_bias=True,
                tie_word_embeddings=False,
            ),
            {},
        ),
        "mistral": ("MistralConfig", dict(LLAMA, sliding_window=None), {}),
        # Sliding windows shorter than T: Mistral's on every layer; Qwen2's on the layers from
        # max_window_layers on, and on the layers layer_types names (here the first, before a
        # full one: a pattern max_window_layers cannot write).
        "mistral_window": ("MistralConfig", dict(LLAMA, sliding_window=8), {}),
        # Ministral: Mistral's block with the window on the layers layer_types names (Ministral
        # 8B interleaves them); here a full layer before a windowed one.
        "ministral": (
            "MinistralConfig",
            dict(
                NO_IDS,  # no eos: greedy decoding is compared token for token with generate
                head_dim=8,  # MinistralConfig leaves it None, which its attention cannot take
                sliding_window=6,
                layer_types=["full_attention", "sliding_attention"],
            ),
            {},
        ),
        "qwen2_window": (
            "Qwen2Config",
            dict(LLAMA, use_sliding_window=True, sliding_window=8, max_window_layers=1),
            {},
        ),
        "qwen2_layer_types": (
            "Qwen2Config",
            dict(
                LLAMA,
                use_sliding_window=True,
                sliding_window=6,
                layer_types=["sliding_attention", "full_attention"],
            ),
            {},
        ),
        "gemma": (
            "GemmaConfig",
            dict(LLAMA, head_dim=8, hidden_act="gelu_pytorch_tanh"),
            {},
        ),
        # Gemma 2: a local layer (window 8 < T) before a global one, one RoPE for both, head_dim
        # 12 != D / N, logits scaled by 10 ** -0.5, and caps small enough (attention 4, output
        # 2) that removing either moves the log-softmax by nats (test_hf.py); and the Hub's
        # older config form (rope_theta, no layer_types: every other layer local from the
        # first) over three layers with Gemma2Config's caps (50 and 30).
        "gemma2": (
            "Gemma2Config",
            dict(
                LLAMA,
                head_dim=12,
                query_pre_attn_scalar=10,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
                attn_logit_softcapping=4.0,
                final_logit_softcapping=2.0,
                rope_parameters={"rope_type": "default", "rope_theta": 5e3},
            ),
            {},
        ),
        "gemma2_legacy": (
            "Gemma2Config",
            dict(LLAMA, num_hidden_layers=3, head_dim=8, query_pre_attn_scalar=8, sliding_window=6),
            {"gemma2_legacy": True},
        ),
        # Gemma 3: a local layer (window 8 < T, RoPE base 1e4) before a global one (base 1e6,
        # linear scaling), head_dim 12 != D / N, logits scaled by 10 ** -0.5; and the older
        # config form of the Hub's Gemma 3 files (rope_theta, rope_local_base_freq,
        # rope_scaling, sliding_window_pattern; no layer_types) over three layers.
        "gemma3": (
            "Gemma3TextConfig",
            dict(
                LLAMA,
                head_dim=12,
                query_pre_attn_scalar=10,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
                rope_parameters={
                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                },
            ),
            {},
        ),
        "gemma3_legacy": (
            "Gemma3TextConfig",
            dict(
                LLAMA,
                num_hidden_layers=3,
                head_dim=8,
                query_pre_attn_scalar=8,
                sliding_window=6,
                sliding_window_pattern=2,
                rope_parameters={
                    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 2e3},
                },
            ),
            {"gemma3_legacy": True},
        ),
        # Multimodal Gemma 3 (model_type "gemma3", as the Hub's 4B-27B files): posattn reads its
        # text model; the logits are Gemma3ForConditionalGeneration's for text-only input. Image
        # token ids past the vocabulary, so no sampled token is one.
        "gemma3_multimodal": (
            "Gemma3Config",
            dict(
                text_config=dict(
                    LLAMA,
                    head_dim=8,
                    query_pre_attn_scalar=8,
                    sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"],
                ),
                vision_config=dict(
                    model_type="siglip_vision_model",
                    hidden_size=16,
                    intermediate_size=16,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    image_size=28,
                    patch_size=14,
                ),
                mm_tokens_per_image=4,
                boi_token_index=1000,
                eoi_token_index=1001,
                image_token_index=1002,
            ),
            {},
        ),
        "gpt2": (
            "GPT2Config",
            dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, n_inner=40),
            {},
        ),
        "bloom": ("BloomConfig", dict(vocab_size=64, hidden_size=32, n_layer=2, n_head=4), {}),
        "bloom_six_heads": (
            "BloomConfig",
            dict(vocab_size=64, hidden_size=36, n_layer=2, n_head=6),
            {},
        ),
        "neox_parallel": (
            "GPTNeoXConfig",
            dict(SMALL, num_attention_heads=4, rotary_pct=0.5, use_parallel_residual=True),
            {},
        ),
        "neox_sequential": (
            "GPTNeoXConfig",
            dict(
                SMALL,
                num_attention_heads=4,
                rotary_pct=0.25,
                use_parallel_residual=False,
                hidden_act="gelu_new",
                tie_word_embeddings=False,
            ),
            {},
        ),
        # StarCoder2: LayerNorm, plain tanh-GELU MLP, grouped-query heads; biases everywhere and
        # a window on every layer, or no biases and no window (untied).
        "starcoder2": (
            "Starcoder2Config",
            dict(LLAMA, bos_token_id=None, eos_token_id=None, sliding_window=6),
            {},
        ),
        "starcoder2_nobias": (
            "Starcoder2Config",
            dict(
                NO_IDS,
                use_bias=False,
                tie_word_embeddings=False,
                norm_epsilon=1e-6,
                rope_theta=1e5,
            ),
            {},
        ),
        # MPT: ALiBi (4 heads, and 6: a head count that is no power of two), no biases,
        # LayerNorm without bias, tied embeddings; T = 24 <= max_seq_len (transformers' MPT
        # builds its ALiBi bias for max_seq_len positions and cannot read more).
        "mpt": (
            "MptConfig",
            dict(vocab_size=64, d_model=32, n_heads=4, n_layers=2, max_seq_len=32),
            {},
        ),
        "mpt_six_heads": (
            "MptConfig",
            dict(
                vocab_size=64,
                d_model=36,
                n_heads=6,
                n_layers=2,
                max_seq_len=24,
                layer_norm_epsilon=1e-6,
                attn_config={"alibi": True, "alibi_bias_max": 8},
            ),
            {},
        ),
        "llama_sharded": ("LlamaConfig", dict(LLAMA, tie_word_embeddings=False), {"shard": "8KB"}),
        "llama_bf16": ("LlamaConfig", dict(LLAMA, tie_word_embeddings=False), {"bf16": True}),
        "llama_legacy": (
            "LlamaConfig",
            dict(SCALED, rope_theta=20000.0, rope_scaling={"rope_type": "linear", "factor": 2.0}),
            {"legacy": True},
        ),
    }


def randomise(model, seed: int) -> None:
    """Every parameter drawn anew: weights ~ N(0, 0.3^2), norm weights 1 + N(0, 0.1^2) (Gemma's,
    applied as 1 + w: N(0, 0.1^2))."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            is_norm = "norm" in name or ".ln" in name or name.startswith("ln")
            if is_norm and name.endswith("weight"):
                # Gemma's norms scale by 1 + weight: its weights sit around 0, the others' around 1.
                gemma = model.config.model_type in ("gemma", "gemma2", "gemma3_text", "gemma3")
                p.copy_((0.0 if gemma else 1.0) + 0.1 * noise)
            else:
                p.copy_(0.3 * noise)


def build(name: str, class_name: str, kwargs: dict, seed: int):
    import torch
    import transformers

    config = getattr(transformers, class_name)(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.eval()
    randomise(model, seed)
    return model


def tokens(vocab: int, seed: int):
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab, (2, T))


def write(name: str, out: pathlib.Path | None = None) -> None:
    import numpy as np
    import torch
    import transformers

    class_name, kwargs, opts = cases()[name]
    seed = sorted(cases()).index(name)
    model = build(name, class_name, kwargs, seed)
    out = GOLDENS / name if out is None else out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if opts.get("bf16"):
        model = model.to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size=opts.get("shard", "1GB"))
    if opts.get("legacy"):  # the pre-5 form: rope_scaling and a top-level rope_theta
        path = out / "config.json"
        cfg = json.loads(path.read_text())
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params.pop("rope_theta")
        cfg["rope_scaling"] = {"type": params.pop("rope_type"), **params}
        path.write_text(json.dumps(cfg, indent=2))
    if opts.get("gemma2_legacy"):  # Gemma 2's form before transformers 5, as on the Hub
        path = out / "config.json"
        cfg = json.loads(path.read_text())
        cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
        del cfg["layer_types"]
        path.write_text(json.dumps(cfg, indent=2))
    if opts.get("gemma3_legacy"):  # Gemma 3's form before transformers 5, as on the Hub
        path = out / "config.json"
        cfg = json.loads(path.read_text())
        params = cfg.pop("rope_parameters")
        full, local = params["full_attention"], params["sliding_attention"]
        cfg["rope_theta"] = full.pop("rope_theta")
        cfg["rope_local_base_freq"] = local["rope_theta"]
        cfg["rope_scaling"] = full
        cfg["sliding_window_pattern"] = (
            len(cfg.pop("layer_types")) and kwargs["sliding_window_pattern"]
        )
        path.write_text(json.dumps(cfg, indent=2))
    # The reference logits: the written files read back by transformers, in float32.
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    )
    ref.eval()
    ids = tokens(ref.config.get_text_config().vocab_size, seed)
    with torch.no_grad():
        logits = ref(torch.as_tensor(ids)).logits.float().numpy()
    np.savez(
        out / "expected.npz",
        tokens=ids,
        logits=logits.astype(np.float32),
        transformers=np.asarray(transformers.__version__),
    )
    for extra in ("generation_config.json",):
        (out / extra).unlink(missing_ok=True)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{name}: {size / 1024:.0f} KB")


if __name__ == "__main__":
    for name in sys.argv[1:] or sorted(cases()):
        write(name)
