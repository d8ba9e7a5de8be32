"""Per-architecture tables: Hugging Face tensor names <-> posattn parameter paths + transforms.

A `Rule` ties one or more file tensors to one or more parameters: `load` turns the file's arrays
into the parameters' (transposes, GPT-2's Conv1D [in, out] weights, the fused qkv of BLOOM and
GPT-NeoX with their head-interleaved [N, 3, H] rows, MPT's and Phi-3's stacked q | k | v rows,
Phi-3's gate | up rows), `save` is its inverse. posattn layouts:
embed/head [V, D], wq [D, N, H], wk/wv [D, K, H], wo [N, H, D], biases flat, w1/w3 [D, F],
w2 [F, D], norms scale/bias [D]. torch `nn.Linear` weights are [out, in].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from posattn.nn.config import ModelConfig

__all__ = ["Rule", "base_prefix", "ignored", "rules"]

Path = tuple


@dataclasses.dataclass(frozen=True)
class Rule:
    hf: tuple[str, ...]
    ours: tuple[Path, ...]
    load: Callable[..., list[np.ndarray]]
    save: Callable[..., list[np.ndarray]]


def _same(*xs):
    return list(xs)


def _linear_in(shape):  # torch [out, in] -> ours [in, *shape]
    return lambda w: [w.T.reshape(w.shape[1], *shape) if shape else w.T]


def _linear_out(w):  # ours [in, ...] -> torch [out, in]
    return [w.reshape(w.shape[0], -1).T]


def _out_proj_in(N, H):  # torch [D, N*H] -> wo [N, H, D]
    return lambda w: [w.T.reshape(N, H, -1)]


def _out_proj_out(w):  # wo [N, H, D] -> torch [D, N*H]
    return [w.reshape(-1, w.shape[-1]).T]


def _copy(hf, ours):
    return Rule((hf,), (ours,), _same, _same)


def _linear(hf, ours, *shape):
    return Rule((hf,), (ours,), _linear_in(shape), _linear_out)


def _out_proj(hf, ours, N, H):
    return Rule((hf,), (ours,), _out_proj_in(N, H), _out_proj_out)


def _fused_heads_in(N, H):  # rows [N, 3, H] (BLOOM, GPT-NeoX): weight [3NH, D] -> wq, wk, wv
    def load(w):
        if w.ndim == 1:
            b = w.reshape(N, 3, H)
            return [b[:, j].reshape(-1) for j in range(3)]
        r = w.reshape(N, 3, H, w.shape[-1])
        return [r[:, j].transpose(2, 0, 1) for j in range(3)]

    return load


def _fused_heads_out(N, H):
    def save(q, k, v):
        if q.ndim == 1:
            return [np.stack([x.reshape(N, H) for x in (q, k, v)], axis=1).reshape(-1)]
        rows = np.stack([x.transpose(1, 2, 0) for x in (q, k, v)], axis=1)  # (N, 3, H, D)
        return [rows.reshape(3 * N * H, -1)]

    return save


def _conv_qkv_in(N, H):  # GPT-2 c_attn: weight [D, 3NH] columns q | k | v, bias [3NH]
    def load(w):
        parts = np.split(w, 3, axis=-1)
        return [p if w.ndim == 1 else p.reshape(w.shape[0], N, H) for p in parts]

    return load


def _conv_qkv_out(q, k, v):
    flat = [x.reshape(x.shape[0], -1) if x.ndim == 3 else x for x in (q, k, v)]
    return [np.concatenate(flat, axis=-1)]


def _stacked_in(*shapes):
    """torch [sum of the parts' sizes, D], rows stacked part after part (MPT's and Phi-3's q | k |
    v, each head-major; Phi-3's gate | up) -> ours [D, *shape] for each part's shape."""

    def load(w):
        sizes = np.cumsum([int(np.prod(shape)) for shape in shapes])[:-1]
        parts = np.split(w, sizes, axis=0)
        return [
            part.T.reshape(w.shape[1], *shape) for part, shape in zip(parts, shapes, strict=True)
        ]

    return load


def _stacked_out(*xs):
    return [np.concatenate([x.reshape(x.shape[0], -1).T for x in xs], axis=0)]


def base_prefix(model_type: str) -> str:
    """The prefix of the base model's tensors (files of the bare base model may lack it)."""
    prefixes = {
        "gpt2": "transformer.",
        "bloom": "transformer.",
        "gpt_neox": "gpt_neox.",
        "mpt": "transformer.",
        "gemma3": "model.language_model.",  # the text model of a multimodal checkpoint
    }
    return prefixes.get(model_type, "model.")


def renamed(model_type: str) -> tuple[tuple[str, str], ...]:
    """(prefix, older prefix) pairs: a file written by older transformers (the Hub's multimodal
    Gemma 3 files) names its text model's tensors with the second."""
    if model_type == "gemma3":
        return (
            ("model.language_model.", "language_model.model."),
            ("lm_head.", "language_model.lm_head."),
        )
    return ()


def skipped(model_type: str) -> tuple[str, ...]:
    """Prefixes of tensors posattn does not read: a multimodal checkpoint's vision tower and
    projector (posattn's model is its text model)."""
    if model_type == "gemma3":
        return tuple(
            f"{p}{part}."
            for p in ("model.", "")
            for part in ("vision_tower", "multi_modal_projector")
        )
    return ()


def ignored(model_type: str) -> tuple[str, ...]:
    """Suffixes of buffers older files carry that posattn recomputes from the config."""
    if model_type == "gpt2":
        return (".attn.bias", ".attn.masked_bias")
    if model_type == "gpt_neox":
        return (".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")
    return (".rotary_emb.inv_freq",)


def rules(cfg: ModelConfig, model_type: str) -> list[Rule]:
    """The mapping of `cfg` as a `model_type` checkpoint (names with the base prefix)."""
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    p = base_prefix(model_type)
    out: list[Rule] = []

    def norm(hf, ours):
        out.append(_copy(f"{hf}.weight", (*ours, "scale")))
        if cfg.norm_bias:
            out.append(_copy(f"{hf}.bias", (*ours, "bias")))

    def bias(hf, ours):
        out.append(_copy(f"{hf}.bias", ours))

    llama_like = ("llama", "mistral", "ministral", "qwen2", "qwen3", "smollm3", "gemma")
    llama_like = (*llama_like, "gemma2", "gemma3_text", "gemma3")
    if model_type in llama_like:
        out.append(_copy(f"{p}embed_tokens.weight", ("embed",)))
        norm(f"{p}norm", ("final_norm",))
        for i in range(cfg.num_layers):
            L, b = f"{p}layers.{i}.", ("blocks", i)
            norm(f"{L}input_layernorm", (*b, "attn_norm"))
            a = f"{L}self_attn."
            if model_type in ("gemma2", "gemma3_text", "gemma3"):
                # Gemma 2's and 3's post_attention_layernorm normalises the attention's output;
                # the MLP's input norm is pre_feedforward_layernorm (Llama's
                # post_attention_layernorm).
                norm(f"{L}post_attention_layernorm", (*b, "attn_post_norm"))
                norm(f"{L}pre_feedforward_layernorm", (*b, "mlp_norm"))
                norm(f"{L}post_feedforward_layernorm", (*b, "mlp_post_norm"))
            else:
                norm(f"{L}post_attention_layernorm", (*b, "mlp_norm"))
            if cfg.qk_norm:  # Gemma 3's and Qwen3's, over each head's H features
                norm(f"{a}q_norm", (*b, "attn", "q_norm"))
                norm(f"{a}k_norm", (*b, "attn", "k_norm"))
            out.append(_linear(f"{a}q_proj.weight", (*b, "attn", "wq"), N, H))
            out.append(_linear(f"{a}k_proj.weight", (*b, "attn", "wk"), K, H))
            out.append(_linear(f"{a}v_proj.weight", (*b, "attn", "wv"), K, H))
            out.append(_out_proj(f"{a}o_proj.weight", (*b, "attn", "wo"), N, H))
            if cfg.bias in ("qkv", "attn", "all"):
                for x in "qkv":
                    bias(f"{a}{x}_proj", (*b, "attn", f"b{x}"))
            if cfg.bias in ("attn", "all"):
                bias(f"{a}o_proj", (*b, "attn", "bo"))
            m = f"{L}mlp."
            out.append(_linear(f"{m}gate_proj.weight", (*b, "mlp", "w1")))
            out.append(_linear(f"{m}up_proj.weight", (*b, "mlp", "w3")))
            out.append(_linear(f"{m}down_proj.weight", (*b, "mlp", "w2")))
            if cfg.bias == "all":
                for hf, ours in (("gate_proj", "b1"), ("up_proj", "b3"), ("down_proj", "b2")):
                    bias(f"{m}{hf}", (*b, "mlp", ours))
        if not cfg.tie_embeddings:
            out.append(_copy("lm_head.weight", ("head",)))
        return out
    if model_type == "phi3":
        out.append(_copy(f"{p}embed_tokens.weight", ("embed",)))
        norm(f"{p}norm", ("final_norm",))
        for i in range(cfg.num_layers):
            L, b = f"{p}layers.{i}.", ("blocks", i)
            norm(f"{L}input_layernorm", (*b, "attn_norm"))
            norm(f"{L}post_attention_layernorm", (*b, "mlp_norm"))
            qkv = tuple((*b, "attn", w) for w in ("wq", "wk", "wv"))
            load = _stacked_in((N, H), (K, H), (K, H))
            out.append(Rule((f"{L}self_attn.qkv_proj.weight",), qkv, load, _stacked_out))
            out.append(_out_proj(f"{L}self_attn.o_proj.weight", (*b, "attn", "wo"), N, H))
            gate_up = ((*b, "mlp", "w1"), (*b, "mlp", "w3"))
            load = _stacked_in((cfg.ff_dim,), (cfg.ff_dim,))
            out.append(Rule((f"{L}mlp.gate_up_proj.weight",), gate_up, load, _stacked_out))
            out.append(_linear(f"{L}mlp.down_proj.weight", (*b, "mlp", "w2")))
        if not cfg.tie_embeddings:
            out.append(_copy("lm_head.weight", ("head",)))
        return out
    if model_type == "starcoder2":
        out.append(_copy(f"{p}embed_tokens.weight", ("embed",)))
        norm(f"{p}norm", ("final_norm",))
        for i in range(cfg.num_layers):
            L, b = f"{p}layers.{i}.", ("blocks", i)
            norm(f"{L}input_layernorm", (*b, "attn_norm"))
            norm(f"{L}post_attention_layernorm", (*b, "mlp_norm"))
            a = f"{L}self_attn."
            for x, heads in (("q", N), ("k", K), ("v", K)):
                out.append(_linear(f"{a}{x}_proj.weight", (*b, "attn", f"w{x}"), heads, H))
            out.append(_out_proj(f"{a}o_proj.weight", (*b, "attn", "wo"), N, H))
            out.append(_linear(f"{L}mlp.c_fc.weight", (*b, "mlp", "w1")))
            out.append(_linear(f"{L}mlp.c_proj.weight", (*b, "mlp", "w2")))
            if cfg.bias == "all":
                for x in "qkvo":
                    bias(f"{a}{x}_proj", (*b, "attn", f"b{x}"))
                bias(f"{L}mlp.c_fc", (*b, "mlp", "b1"))
                bias(f"{L}mlp.c_proj", (*b, "mlp", "b2"))
        if not cfg.tie_embeddings:
            out.append(_copy("lm_head.weight", ("head",)))
        return out
    if model_type == "gpt2":
        out.append(_copy(f"{p}wte.weight", ("embed",)))
        out.append(_copy(f"{p}wpe.weight", ("pos_embed",)))
        norm(f"{p}ln_f", ("final_norm",))
        for i in range(cfg.num_layers):
            L, b = f"{p}h.{i}.", ("blocks", i)
            norm(f"{L}ln_1", (*b, "attn_norm"))
            norm(f"{L}ln_2", (*b, "mlp_norm"))
            qkv = tuple((*b, "attn", w) for w in ("wq", "wk", "wv"))
            out.append(Rule((f"{L}attn.c_attn.weight",), qkv, _conv_qkv_in(N, H), _conv_qkv_out))
            bqkv = tuple((*b, "attn", w) for w in ("bq", "bk", "bv"))
            out.append(Rule((f"{L}attn.c_attn.bias",), bqkv, _conv_qkv_in(N, H), _conv_qkv_out))
            out.append(
                Rule(
                    (f"{L}attn.c_proj.weight",),
                    ((*b, "attn", "wo"),),
                    lambda w: [w.reshape(N, H, -1)],
                    lambda w: [w.reshape(N * H, -1)],
                )
            )
            bias(f"{L}attn.c_proj", (*b, "attn", "bo"))
            out.append(_copy(f"{L}mlp.c_fc.weight", (*b, "mlp", "w1")))
            bias(f"{L}mlp.c_fc", (*b, "mlp", "b1"))
            out.append(_copy(f"{L}mlp.c_proj.weight", (*b, "mlp", "w2")))
            bias(f"{L}mlp.c_proj", (*b, "mlp", "b2"))
        if not cfg.tie_embeddings:
            out.append(_copy("lm_head.weight", ("head",)))
        return out
    if model_type == "bloom":
        out.append(_copy(f"{p}word_embeddings.weight", ("embed",)))
        norm(f"{p}word_embeddings_layernorm", ("embed_norm",))
        norm(f"{p}ln_f", ("final_norm",))
        for i in range(cfg.num_layers):
            L, b = f"{p}h.{i}.", ("blocks", i)
            norm(f"{L}input_layernorm", (*b, "attn_norm"))
            norm(f"{L}post_attention_layernorm", (*b, "mlp_norm"))
            a = f"{L}self_attention."
            for suffix, names in (("weight", ("wq", "wk", "wv")), ("bias", ("bq", "bk", "bv"))):
                out.append(
                    Rule(
                        (f"{a}query_key_value.{suffix}",),
                        tuple((*b, "attn", w) for w in names),
                        _fused_heads_in(N, H),
                        _fused_heads_out(N, H),
                    )
                )
            out.append(_out_proj(f"{a}dense.weight", (*b, "attn", "wo"), N, H))
            bias(f"{a}dense", (*b, "attn", "bo"))
            out.append(_linear(f"{L}mlp.dense_h_to_4h.weight", (*b, "mlp", "w1")))
            bias(f"{L}mlp.dense_h_to_4h", (*b, "mlp", "b1"))
            out.append(_linear(f"{L}mlp.dense_4h_to_h.weight", (*b, "mlp", "w2")))
            bias(f"{L}mlp.dense_4h_to_h", (*b, "mlp", "b2"))
        if not cfg.tie_embeddings:
            out.append(_copy("lm_head.weight", ("head",)))
        return out
    if model_type == "gpt_neox":
        out.append(_copy(f"{p}embed_in.weight", ("embed",)))
        norm(f"{p}final_layer_norm", ("final_norm",))
        for i in range(cfg.num_layers):
            L, b = f"{p}layers.{i}.", ("blocks", i)
            norm(f"{L}input_layernorm", (*b, "attn_norm"))
            norm(f"{L}post_attention_layernorm", (*b, "mlp_norm"))
            a = f"{L}attention."
            for suffix, names in (("weight", ("wq", "wk", "wv")), ("bias", ("bq", "bk", "bv"))):
                out.append(
                    Rule(
                        (f"{a}query_key_value.{suffix}",),
                        tuple((*b, "attn", w) for w in names),
                        _fused_heads_in(N, H),
                        _fused_heads_out(N, H),
                    )
                )
            out.append(_out_proj(f"{a}dense.weight", (*b, "attn", "wo"), N, H))
            bias(f"{a}dense", (*b, "attn", "bo"))
            out.append(_linear(f"{L}mlp.dense_h_to_4h.weight", (*b, "mlp", "w1")))
            bias(f"{L}mlp.dense_h_to_4h", (*b, "mlp", "b1"))
            out.append(_linear(f"{L}mlp.dense_4h_to_h.weight", (*b, "mlp", "w2")))
            bias(f"{L}mlp.dense_4h_to_h", (*b, "mlp", "b2"))
        if not cfg.tie_embeddings:
            out.append(_copy("embed_out.weight", ("head",)))
        return out
    if model_type == "mpt":
        out.append(_copy(f"{p}wte.weight", ("embed",)))
        norm(f"{p}norm_f", ("final_norm",))
        for i in range(cfg.num_layers):
            L, b = f"{p}blocks.{i}.", ("blocks", i)
            norm(f"{L}norm_1", (*b, "attn_norm"))
            norm(f"{L}norm_2", (*b, "mlp_norm"))
            qkv = tuple((*b, "attn", w) for w in ("wq", "wk", "wv"))
            wqkv = (f"{L}attn.Wqkv.weight",)
            out.append(Rule(wqkv, qkv, _stacked_in((N, H), (N, H), (N, H)), _stacked_out))
            out.append(_out_proj(f"{L}attn.out_proj.weight", (*b, "attn", "wo"), N, H))
            out.append(_linear(f"{L}ffn.up_proj.weight", (*b, "mlp", "w1")))
            out.append(_linear(f"{L}ffn.down_proj.weight", (*b, "mlp", "w2")))
        if not cfg.tie_embeddings:
            out.append(_copy("lm_head.weight", ("head",)))
        return out
    raise ValueError(f"no tensor mapping for model_type {model_type!r}")
