"""Hugging Face `config.json` -> `ModelConfig`, and back (docs/checkpoints.md).

Every option that changes the computation is either mapped onto a posattn switch or refused
before any compute, naming the key and what is supported; none is ignored. Recomputed constants
(RoPE inverse frequencies, ALiBi slopes) come from the config, never from the weights file.
"""

from __future__ import annotations

import math
from typing import Any

from posattn import rotary
from posattn.nn.config import ConfigError, ModelConfig

__all__ = [
    "ARCHITECTURES",
    "HfConfigError",
    "TRAINING_KEYS",
    "hf_config",
    "init_from_keys",
    "model_config",
]

# model.* keys a fine-tune of a published checkpoint may set: how it computes, not what it holds.
# `rope_scaling` changes the positions' frequencies (position interpolation, YaRN) and keeps
# every tensor's shape.
TRAINING_KEYS = (
    "dtype",
    "param_dtype",
    "remat",
    "scan_layers",
    "attention_impl",
    "rope_scaling",
    "init_scale",
    "init_from",
)

ARCHITECTURES = (
    "llama",
    "mistral",
    "ministral",
    "qwen2",
    "qwen3",
    "phi3",
    "smollm3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "gpt2",
    "bloom",
    "gpt_neox",
    "starcoder2",
    "mpt",
)

# Hugging Face `hidden_act` / `activation_function` -> model.activation.
_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": None,  # a different tanh approximation constant arrangement: refused
    "gelu": "gelu",
    "silu": "silu",
    "swish": "silu",
    "relu": "relu",
}


class HfConfigError(ConfigError):
    """A Hugging Face config that posattn cannot compute exactly; names the key."""


def _refuse(key: str, value: Any, supported: str) -> HfConfigError:
    return HfConfigError(f"config.json {key}={value!r} is not supported: {supported}")


def _activation(key: str, value: Any) -> str:
    name = _ACTIVATIONS.get(value)
    if name is None:
        allowed = ", ".join(repr(k) for k, v in _ACTIVATIONS.items() if v)
        raise _refuse(key, value, f"supported activations are {allowed}")
    return name


def _expect(hf: dict, key: str, allowed: tuple, why: str) -> None:
    if key in hf and hf[key] not in allowed:
        raise _refuse(key, hf[key], f"only {' or '.join(map(repr, allowed))} ({why})")


def _rope(
    hf: dict, head_dim: int, default_theta: float, *, allow_partial: bool = False
) -> dict[str, Any]:
    """model.rope_base and model.rope_scaling from `rope_parameters` (transformers 5) or the older
    `rope_scaling` + `rope_theta` (+ `rotary_pct` / `partial_rotary_factor`)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    theta = params.pop("rope_theta", hf.get("rope_theta", default_theta))
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if "rotary_pct" in hf and "partial_rotary_factor" not in hf:  # GPT-NeoX's older name
        partial = params.get("partial_rotary_factor", hf["rotary_pct"])
    if partial != 1 and not allow_partial:
        raise _refuse(
            f"{key}.partial_rotary_factor",
            partial,
            f"only 1.0 for model_type {hf['model_type']!r} (its attention rotates the whole head)",
        )
    kind = rotary.rope_kind(params)
    for name in ("rope_type", "type"):
        params.pop(name, None)
    if kind == "proportional":
        raise _refuse(f"{key}.rope_type", kind, "proportional RoPE is Gemma 4's, not this model's")
    m_l = hf.get("max_position_embeddings")
    if kind in ("llama3", "yarn", "longrope"):
        # transformers takes the training length from the config when the dict lacks it.
        orig = hf.get("original_max_position_embeddings") or params.get(
            "original_max_position_embeddings"
        )
        params["original_max_position_embeddings"] = orig or m_l
        if kind == "yarn" and params.get("factor") is None:
            params["factor"] = m_l / params["original_max_position_embeddings"]
        if kind == "longrope" and params.get("factor") is None:
            # Its attention factor then comes from max_position_embeddings / original (Phi-3).
            params["max_position_embeddings"] = m_l
    if kind == "dynamic":
        # transformers' dynamic NTK reads config.max_position_embeddings as the training length.
        params["original_max_position_embeddings"] = m_l
    if kind == "linear":
        params.pop("original_max_position_embeddings", None)  # unused by linear scaling
    scaling = None if kind == "default" and not params else {"rope_type": kind, **params}
    if scaling is not None:
        if partial != 1:  # the scaling's factors count the rotated pairs only (LongRoPE's lists)
            scaling[rotary.PARTIAL_KEY] = partial
        try:
            scaling = rotary.validate_rope_scaling(scaling, head_dim)
        except ValueError as e:
            raise HfConfigError(f"config.json {key}: {e}") from None
    return {
        "rope_base": float(theta),
        "rope_scaling": scaling,
        "rope_layout": "half",
        "rope_partial_factor": float(partial),
    }


# transformers' defaults for keys a config.json may leave out, where they are not Llama's
# (num_key_value_heads = num_attention_heads, head_dim = hidden_size / num_attention_heads, RoPE
# base 10000).
_LLAMA_FAMILY_DEFAULTS = {
    "mistral": dict(num_key_value_heads=8),
    "ministral": dict(num_key_value_heads=8),
    "qwen2": dict(num_key_value_heads=32),
    "qwen3": dict(num_key_value_heads=32, head_dim=128),
    "smollm3": dict(num_key_value_heads=4, rope_theta=2_000_000.0),
    "gemma": dict(num_key_value_heads=16, head_dim=256),
}


def _llama(hf: dict, *, allow_partial: bool = False) -> dict[str, Any]:
    kind = hf["model_type"]
    hf = {**_LLAMA_FAMILY_DEFAULTS.get(kind, {}), **hf}
    d, n = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // n
    if hf.get("pretraining_tp", 1) != 1:
        raise _refuse("pretraining_tp", hf["pretraining_tp"], "only 1")
    attention_bias, mlp_bias = hf.get("attention_bias", False), hf.get("mlp_bias", False)
    bias = "qkv" if kind == "qwen2" else "none"
    if attention_bias or mlp_bias:
        key = "attention_bias" if attention_bias else "mlp_bias"
        if kind not in ("llama", "smollm3", "qwen3"):  # Mistral and Qwen2 ignore both
            raise _refuse(key, True, f"only false ({kind}'s projections take no such biases)")
        if not attention_bias:
            raise _refuse(key, True, "only with attention_bias (biases on the MLP alone)")
        bias = "all" if mlp_bias else "attn"  # q, k, v and o (and the MLP's)
    for k in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(k) is not None:
            raise _refuse(k, hf[k], "only null (no logit soft-capping)")
    return dict(
        position="rope",
        vocab_size=hf["vocab_size"],
        d_model=d,
        num_layers=hf["num_hidden_layers"],
        num_heads=n,
        num_kv_heads=hf.get("num_key_value_heads") or n,
        head_dim=head_dim if head_dim * n != d else 0,
        d_ff=hf["intermediate_size"],
        norm="rms",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        mlp="gated",
        activation=_activation("hidden_act", hf.get("hidden_act", "silu")),
        bias=bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        embed_scale="one",
        layer_pattern=_sliding_windows(hf),
        # transformers' default base for each of these types
        **_rope(hf, head_dim, 10000.0, allow_partial=allow_partial),
    )


_SLIDING, _FULL = "sliding_attention", "full_attention"


def _window_size(hf: dict) -> int:
    w = hf.get("sliding_window", 4096)  # transformers' default for Mistral and Qwen2 alike
    if not (isinstance(w, int) and not isinstance(w, bool) and w >= 1):
        raise _refuse("sliding_window", w, "a positive integer (keys i - j < sliding_window)")
    return w


def _layer_types(hf: dict, default: list[str], window: int | None, need: str) -> list[str]:
    """config.json's `layer_types`, or `default` where it has none, checked: one entry per layer,
    each "sliding_attention" or "full_attention", and sliding layers only with a `window` (`need`
    names what gives one)."""
    n = hf["num_hidden_layers"]
    types = default if hf.get("layer_types") is None else hf["layer_types"]
    if len(types) != n or any(t not in (_SLIDING, _FULL) for t in types):
        raise _refuse("layer_types", types, f"{n} entries, each {_SLIDING!r} or {_FULL!r}")
    if _SLIDING in types and window is None:
        raise _refuse("layer_types", types, f"{_SLIDING!r} layers need {need}")
    return types


def _sliding_windows(hf: dict) -> tuple[str, ...]:
    """model.layer_pattern of a Llama-family config's sliding windows, as transformers reads them:
    Mistral puts `sliding_window` on every layer (or none when it is null); Qwen2 puts it on the
    layers `layer_types` names "sliding_attention" (by default those from `max_window_layers` on)
    when `use_sliding_window` is true (Qwen3 alike); Ministral on the layers `layer_types` names
    (by default every layer). () when every layer attends to every earlier key."""
    kind, n = hf["model_type"], hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if kind == "mistral":
        window = None if hf.get("sliding_window", 4096) is None else _window_size(hf)
        want = _SLIDING if window else _FULL
        if types is not None and any(t != want for t in types):
            raise _refuse(
                "layer_types",
                types,
                f"transformers' Mistral ignores layer_types and applies sliding_window="
                f"{window!r} to every layer; only a list that agrees (every layer {want!r})",
            )
        return () if window is None else (f"rope:window={window}",)
    if kind in ("ministral", "qwen2", "qwen3"):
        if kind == "ministral":  # by default every layer
            window = None if hf.get("sliding_window", 4096) is None else _window_size(hf)
            default = [_SLIDING if window else _FULL] * n
            need = "a sliding_window"
        else:  # by default the layers from max_window_layers on
            window = _window_size(hf) if hf.get("use_sliding_window") else None
            first = hf.get("max_window_layers", 28)
            default = [_SLIDING if window and i >= first else _FULL for i in range(n)]
            need = (
                "use_sliding_window true and a sliding_window (transformers cannot run them "
                "without)"
            )
        types = _layer_types(hf, default, window, need)
        if _SLIDING not in types:
            return ()
        return tuple(f"rope:window={window}" if t == _SLIDING else "rope" for t in types)
    return ()


def _qwen3(hf: dict) -> dict[str, Any]:
    """Qwen3: Llama's block with an RMSNorm over each head's query and key before RoPE, a free
    head_dim (128 when config.json is silent), Qwen2's sliding windows; `attention_bias` puts
    biases on q, k, v and o, as Llama's (its MLP has none)."""
    if hf.get("mlp_bias"):
        raise _refuse("mlp_bias", True, "only false (Qwen3's MLP has no biases)")
    keys = _llama(hf)
    keys.update(qk_norm=True)
    return keys


def _phi3(hf: dict) -> dict[str, Any]:
    """Phi-3 (and Phi-4-mini): Llama's block with the q | k | v rows and the gate | up rows each in
    one tensor, partial rotary (`partial_rotary_factor`), LongRoPE (a `rope_scaling` of type
    "su" or "yarn" is read as "longrope", as transformers reads it), and `sliding_window` on every
    layer when it is set."""
    hf = dict(hf)
    for key in ("rope_parameters", "rope_scaling"):
        params = dict(hf.get(key) or {})
        kind = params.get("rope_type", params.get("type"))
        if kind in ("su", "yarn"):
            params.pop("type", None)
            hf[key] = {**params, "rope_type": "longrope"}
        elif kind not in (None, "default", "longrope"):
            raise _refuse(f"{key}.rope_type", kind, "default or longrope (transformers' Phi-3)")
    # transformers' Phi-3 takes LongRoPE's training length from this key (4096 when config.json
    # is silent), whatever the scaling dict says.
    hf["original_max_position_embeddings"] = hf.get("original_max_position_embeddings", 4096)
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key):
            hf[key] = {k: v for k, v in hf[key].items() if k != "original_max_position_embeddings"}
    for k in ("attention_bias", "mlp_bias"):  # not keys of Phi-3: its projections have none
        if hf.get(k):
            raise _refuse(k, hf[k], "only false (Phi-3's projections have no biases)")
    keys = _llama({**hf, "rms_norm_eps": hf.get("rms_norm_eps", 1e-5)}, allow_partial=True)
    window = hf.get("sliding_window")
    keys["layer_pattern"] = () if window is None else (f"rope:window={_window_size(hf)}",)
    return keys


def _smollm3(hf: dict) -> dict[str, Any]:
    """SmolLM3: Llama's block with RoPE left out on the layers `no_rope_layers` marks 0 (by
    default every `no_rope_layer_interval`-th, 4), NoPE layers between RoPE ones; with
    `use_sliding_window`, `sliding_window` on the layers `layer_types` names "sliding_attention"
    (by default the NoPE layers), as transformers reads them. Tied embeddings by default."""
    n = hf["num_hidden_layers"]
    every = hf.get("no_rope_layer_interval", 4)
    rope = hf.get("no_rope_layers")
    if rope is None:
        rope = [int((i + 1) % every != 0) for i in range(n)]
    if len(rope) != n or any(r not in (0, 1) for r in rope):
        raise _refuse("no_rope_layers", rope, f"{n} entries, each 1 (RoPE) or 0 (no RoPE)")
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    default = [_SLIDING if window is not None and not r else _FULL for r in rope]  # NoPE layers
    types = _layer_types(hf, default, window, "use_sliding_window true and a sliding_window")
    keys = _llama({**hf, "tie_word_embeddings": hf.get("tie_word_embeddings", True)})
    entries = [
        ("rope" if r else "nope") + (f":window={_window_size(hf)}" if t == _SLIDING else "")
        for r, t in zip(rope, types, strict=True)
    ]
    keys["layer_pattern"] = () if set(entries) == {"rope"} else tuple(entries)
    return keys


def _gemma(hf: dict, *, legacy_gelu: bool = True) -> dict[str, Any]:
    """Gemma's block. `legacy_gelu`: "gelu" means the tanh approximation, as transformers reads
    Gemma's legacy hidden_act="gelu"; Gemma 2 and 3 (False) take `hidden_activation` as it is,
    "gelu" the exact GELU."""
    if hf.get("use_bidirectional_attention"):
        raise _refuse("use_bidirectional_attention", True, "only causal attention")
    hf = dict(hf)
    if legacy_gelu:
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        hf["hidden_act"] = "gelu_pytorch_tanh" if act == "gelu" else act
    else:  # Gemma2Config and Gemma3TextConfig have no hidden_act; their models read this one
        hf["hidden_act"] = hf.get("hidden_activation") or "gelu_pytorch_tanh"
    hf.setdefault("tie_word_embeddings", True)
    keys = _llama({**_LLAMA_FAMILY_DEFAULTS["gemma"], **hf, "model_type": "llama"})
    keys.update(norm_unit_offset=True, embed_scale="sqrt_d")  # weight 1 + w, embeddings sqrt(D)
    return keys


_SOFTCAPS = (
    ("attn_logit_softcapping", "attn_logit_softcap"),
    ("final_logit_softcapping", "final_logit_softcap"),
)


def _softcaps(hf: dict) -> tuple[dict, dict[str, float]]:
    """(hf without its soft-capping keys, model.attn_logit_softcap and final_logit_softcap):
    Gemma 2's and 3's caps c, computed as c * tanh(x / c); null is no cap (0 here)."""
    caps = {}
    for key, ours in _SOFTCAPS:
        c = hf.get(key)
        number = isinstance(c, (int, float)) and not isinstance(c, bool)
        if c is not None and not (number and math.isfinite(c) and c > 0):
            raise _refuse(key, c, "null (no cap) or a positive number c (c * tanh(x / c))")
        caps[ours] = float(c or 0.0)
    return {k: v for k, v in hf.items() if k not in dict(_SOFTCAPS)}, caps


# transformers' Gemma2Config defaults where they are not Gemma's.
_GEMMA2_DEFAULTS = dict(
    num_key_value_heads=4,
    head_dim=256,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
)


def _gemma2(hf: dict) -> dict[str, Any]:
    """Gemma 2: Gemma's block with a norm on each branch's output before its residual add, logits
    scaled by query_pre_attn_scalar ** -0.5 and soft-capped (the attention's before the mask,
    the output's), and `sliding_window` on the layers `layer_types` names "sliding_attention"
    (by default every other layer from the first); one RoPE for every layer. transformers'
    Gemma2Config defaults fill what config.json leaves out (caps 50 and 30)."""
    if hf.get("attention_bias"):
        raise _refuse("attention_bias", True, "only false (Gemma 2 has no biases)")
    hf, caps = _softcaps({**_GEMMA2_DEFAULTS, **hf})
    n = hf["num_hidden_layers"]
    window = None if hf.get("sliding_window") is None else _window_size(hf)
    default = [_SLIDING if (i + 1) % 2 else _FULL for i in range(n)]
    types = _layer_types(hf, default, window, "a sliding_window")
    keys = _gemma(hf, legacy_gelu=False)
    keys.update(post_norms=True, query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]), **caps)
    keys["layer_pattern"] = ()
    if _SLIDING in types:
        entries = (f"rope:window={window}" if t == _SLIDING else "rope" for t in types)
        keys["layer_pattern"] = tuple(entries)
    return keys


# transformers' Gemma3TextConfig defaults: the Hub's multimodal Gemma 3 files leave most of them
# out of text_config (gemma-3-4b's names six keys).
_GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262_208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131_072,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    query_pre_attn_scalar=256,
    sliding_window=4096,
)


def _gemma3_multimodal(hf: dict) -> dict[str, Any]:
    """The text model of a multimodal Gemma 3 checkpoint (`model_type` "gemma3": text_config
    plus a vision tower, whose tensors are not read): what transformers'
    Gemma3ForConditionalGeneration computes for a text-only input."""
    text = dict(hf.get("text_config") or {})
    text.update(model_type="gemma3_text", tie_word_embeddings=hf.get("tie_word_embeddings", True))
    return _gemma3(text)


def _gemma3(hf: dict) -> dict[str, Any]:
    """Gemma 3 (text): Gemma's block with query/key norms and a norm after each branch, logits
    scaled by query_pre_attn_scalar ** -0.5, and local layers (a sliding window, their own RoPE)
    beside global ones, as `layer_types` (or the older `sliding_window_pattern`) lays them out.
    transformers' Gemma3TextConfig defaults fill what config.json leaves out."""
    if hf.get("attention_bias"):
        raise _refuse("attention_bias", True, "only false (Gemma 3 has no biases)")
    hf = {**_GEMMA3_TEXT_DEFAULTS, **hf}
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        every = hf.get("sliding_window_pattern", 6)
        types = [_SLIDING if (i + 1) % every else _FULL for i in range(n)]
    if len(types) != n or any(t not in (_SLIDING, _FULL) for t in types):
        raise _refuse("layer_types", types, f"{n} entries, each {_SLIDING!r} or {_FULL!r}")
    # RoPE per layer type: transformers 5's rope_parameters {layer type: parameters}, or the
    # older rope_theta (global) + rope_local_base_freq (local) + rope_scaling (global only).
    given = hf.get("rope_parameters") or {}
    by_type = given if (_FULL in given or _SLIDING in given) else {}
    scaling = dict(hf.get("rope_scaling") or ({} if by_type else given))
    if "type" in scaling:  # the oldest spelling of rope_type
        scaling.setdefault("rope_type", scaling.pop("type"))
    full = {"rope_type": "default", **(by_type.get(_FULL) or {}), **scaling}
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local = {"rope_type": "default", **(by_type.get(_SLIDING) or {})}
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    head_dim = hf["head_dim"]
    if hf.get("attn_logit_softcapping") is not None:
        raise _refuse(
            "attn_logit_softcapping",
            hf["attn_logit_softcapping"],
            "only null for Gemma 3 (transformers' Gemma 3 keeps the key but does not cap its "
            "attention logits; final_logit_softcapping is applied)",
        )
    hf, caps = _softcaps(hf)
    plain = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling")}
    keys = _gemma({**plain, "rope_parameters": full}, legacy_gelu=False)
    rope_local = _rope({**plain, "rope_parameters": local}, head_dim, 10_000.0)
    keys.update(
        post_norms=True,
        qk_norm=True,
        query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]),
        **caps,
    )
    if _SLIDING in types:
        local_entry = (
            f"rope:rope_base={rope_local['rope_base']!r},"
            f"rope_scaling={rope_local['rope_scaling']!r},window={_window_size(hf)}"
        )
        keys["layer_pattern"] = tuple(local_entry if t == _SLIDING else "rope" for t in types)
    return keys


def _gpt2(hf: dict) -> dict[str, Any]:
    _expect(hf, "scale_attn_weights", (True,), "logits scaled by 1/sqrt(H)")
    _expect(hf, "scale_attn_by_inverse_layer_idx", (False,), "no per-layer logit scale")
    _expect(hf, "add_cross_attention", (False,), "a decoder without cross-attention")
    d = hf["n_embd"]
    return dict(
        position="learned",
        max_len=hf["n_positions"],
        vocab_size=hf["vocab_size"],
        d_model=d,
        num_layers=hf["n_layer"],
        num_heads=hf["n_head"],
        num_kv_heads=hf["n_head"],
        d_ff=hf.get("n_inner") or 4 * d,
        norm="layer",
        norm_bias=True,
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        activation=_activation("activation_function", hf.get("activation_function", "gelu_new")),
        bias="all",
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        embed_scale="one",
    )


def _bloom(hf: dict) -> dict[str, Any]:
    _expect(hf, "apply_residual_connection_post_layernorm", (False,), "pre-norm residuals")
    d = hf.get("hidden_size") or hf.get("n_embed")
    n = hf.get("n_head") or hf.get("num_attention_heads")
    return dict(
        position="alibi",
        vocab_size=hf["vocab_size"],
        d_model=d,
        num_layers=hf.get("n_layer") or hf.get("num_hidden_layers"),
        num_heads=n,
        num_kv_heads=n,
        d_ff=4 * d,
        norm="layer",
        norm_bias=True,
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        activation="gelu_tanh",  # BLOOM's bloom_gelu_forward is the tanh approximation
        bias="all",
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        embed_scale="one",
        embed_norm=True,
    )


def _neox(hf: dict) -> dict[str, Any]:
    if not hf.get("attention_bias", True):
        raise _refuse("attention_bias", False, "only true (GPT-NeoX's projections all have biases)")
    d, n = hf["hidden_size"], hf["num_attention_heads"]
    hf = dict(hf)
    if "rotary_emb_base" in hf and "rope_theta" not in hf:  # the older name
        hf["rope_theta"] = hf["rotary_emb_base"]
    given = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not any("rotary_pct" in x or "partial_rotary_factor" in x for x in (hf, given)):
        hf["partial_rotary_factor"] = 0.25  # transformers' GPTNeoXConfig default (rotary_pct)
    return dict(
        position="rope",
        vocab_size=hf["vocab_size"],
        d_model=d,
        num_layers=hf["num_hidden_layers"],
        num_heads=n,
        num_kv_heads=n,
        d_ff=hf["intermediate_size"],
        norm="layer",
        norm_bias=True,
        norm_eps=float(hf.get("layer_norm_eps", 1e-5)),
        activation=_activation("hidden_act", hf.get("hidden_act", "gelu")),
        bias="all",
        parallel_residual=bool(hf.get("use_parallel_residual", True)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        embed_scale="one",
        **_rope(hf, d // n, 10000.0, allow_partial=True),
    )


def _starcoder2(hf: dict) -> dict[str, Any]:
    """StarCoder2: RoPE, LayerNorm with bias, a plain tanh-GELU MLP (c_fc, c_proj), biases on
    every projection or none (`use_bias`), grouped-query attention, sequential residuals, tied
    embeddings by default, and `sliding_window` on every layer when it is set."""
    d, n = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // n
    k = hf.get("num_key_value_heads", 2)  # Starcoder2Config's default
    window = hf.get("sliding_window")
    return dict(
        position="rope",
        vocab_size=hf["vocab_size"],
        d_model=d,
        num_layers=hf["num_hidden_layers"],
        num_heads=n,
        num_kv_heads=k or n,
        head_dim=head_dim if head_dim * n != d else 0,
        d_ff=hf["intermediate_size"],
        norm="layer",
        norm_bias=True,
        norm_eps=float(hf.get("norm_epsilon", 1e-5)),
        mlp="plain",
        activation=_activation("hidden_act", hf.get("hidden_act", "gelu_pytorch_tanh")),
        bias="all" if hf.get("use_bias", True) else "none",
        parallel_residual=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        embed_scale="one",
        layer_pattern=() if window is None else (f"rope:window={_window_size(hf)}",),
        **_rope(hf, head_dim, 10000.0),
    )


# MPT `attn_config` keys and the values posattn computes exactly as transformers' MptForCausalLM.
_MPT_ATTN = {
    "attn_type": (("multihead_attention",), "multi-head attention (Wqkv holds q, k, v of N heads)"),
    "alibi": ((True,), "ALiBi attention (MPT without ALiBi has no transformers model)"),
    # transformers builds the slopes with alibi_bias_max=8 whatever the config says, and MPT's
    # own code uses the config's value: another value would be two different functions.
    "alibi_bias_max": ((8,), "8, the value transformers computes the slopes with"),
    "clip_qkv": ((None,), "null (no clamping of q, k, v)"),
    "softmax_scale": ((None,), "null (logits scaled by 1/sqrt(head dim))"),
    "qk_ln": ((False,), "false (no LayerNorm on q and k; transformers' MPT has none)"),
    "prefix_lm": ((False,), "false (causal attention)"),
}


def _mpt(hf: dict) -> dict[str, Any]:
    """MPT (MosaicML; transformers' `MptForCausalLM`): ALiBi, LayerNorm without bias, no biases,
    exact GELU, a 4 x d_model MLP, tied embeddings. Options transformers ignores but MPT's own
    code computes (`expansion_ratio`, `no_bias=false`, `logit_scale`, `alibi_bias_max`, `qk_ln`)
    are refused at any value but the one both compute."""
    attn = dict(hf.get("attn_config") or {})
    for key, (allowed, why) in _MPT_ATTN.items():
        if key in attn and attn[key] not in allowed:
            raise _refuse(f"attn_config.{key}", attn[key], f"only {allowed[0]!r}: {why}")
    _expect(hf, "no_bias", (True,), "no biases: transformers' MPT has none")
    _expect(hf, "expansion_ratio", (4,), "an MLP of 4 x d_model, as transformers computes")
    _expect(hf, "logit_scale", (None,), "no scaling of the logits")
    _expect(hf, "norm_type", ("low_precision_layernorm", "layernorm"), "LayerNorm")
    d, n = hf["d_model"], hf["n_heads"]
    return dict(
        position="alibi",
        vocab_size=hf["vocab_size"],
        d_model=d,
        num_layers=hf["n_layers"],
        num_heads=n,
        num_kv_heads=n,
        d_ff=4 * d,
        norm="layer",
        norm_bias=False,
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        activation="gelu",  # nn.GELU(approximate="none")
        bias="none",
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        embed_scale="one",
    )


_PARSERS = {
    "llama": _llama,
    "mistral": _llama,
    "ministral": _llama,
    "qwen2": _llama,
    "qwen3": _qwen3,
    "phi3": _phi3,
    "smollm3": _smollm3,
    "gpt2": _gpt2,
    "bloom": _bloom,
    "gpt_neox": _neox,
    "starcoder2": _starcoder2,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3,
    "gemma3": _gemma3_multimodal,
    "mpt": _mpt,
}


def read_config(path) -> dict:
    """The checkpoint directory `path`'s config.json, as a dict."""
    import json
    import pathlib

    file = pathlib.Path(path) / "config.json"
    if not file.is_file():
        raise HfConfigError(f"{path} has no config.json (a Hugging Face checkpoint directory)")
    return json.loads(file.read_text())


def init_from_keys(keys: dict[str, Any]) -> dict[str, Any]:
    """The `model` section of a run with `model.init_from='hf:PATH'`: the checkpoint's
    architecture, plus the keys of TRAINING_KEYS the config sets. Any other key set away from its
    default that disagrees with the checkpoint is a ConfigError naming it."""
    from posattn.nn.config import defaults

    path = keys["init_from"][3:]
    base = model_config(read_config(path)).keys()
    default = defaults()
    out = dict(base)
    for name, value in keys.items():
        if name in TRAINING_KEYS:
            if name != "rope_scaling" or value is not None:
                out[name] = value
            continue
        if name not in default or value == default[name] or value == base.get(name):
            continue
        raise ConfigError(
            f"config.model.{name}={value!r} disagrees with the checkpoint model.init_from="
            f"{keys['init_from']!r} ({base.get(name, default[name])!r}); a fine-tune takes the "
            f"checkpoint's architecture and may set only {', '.join(TRAINING_KEYS)}"
        )
    return out


def model_config(hf: dict, *, dtype: str | None = None) -> ModelConfig:
    """The `ModelConfig` of a Hugging Face config dict (validated), or HfConfigError."""
    kind = hf.get("model_type")
    if kind not in _PARSERS:
        raise _refuse("model_type", kind, "supported: " + ", ".join(map(repr, _PARSERS)))
    try:
        keys = _PARSERS[kind](hf)
    except KeyError as e:
        raise HfConfigError(
            f"config.json lacks {e.args[0]!r}, which model_type {kind!r} needs"
        ) from None
    if dtype is not None:
        keys.update(dtype=dtype, param_dtype=dtype)
    return ModelConfig.from_keys(keys).validate()


def _hf_rope(settings) -> tuple[dict[str, Any], int]:
    """(rope_parameters, max_position_embeddings) of RoPE settings, as `_rope` reads them back:
    the scaling's keys that are set; the training length from the dict (dynamic NTK's is
    config.max_position_embeddings), or LongRoPE's extended length when its factor is left to
    max_position_embeddings / original_max_position_embeddings."""
    params = {"rope_type": "default"}
    params.update({k: v for k, v in (settings.scaling_dict or {}).items() if v is not None})
    params["rope_theta"] = settings.base
    length = params.pop("max_position_embeddings", None)
    length = length or params.get("original_max_position_embeddings") or 2048
    return params, int(length)


# Config classes whose default pad_token_id is an embedding row (nn.Embedding's padding_idx):
# past a smaller vocabulary, transformers could not build the model.
_DEFAULT_PAD = {"phi3": 32000, "smollm3": 128004}


def hf_config(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """A transformers config.json dict for `cfg` as a `model_type` model (the inverse)."""
    common = dict(model_type=model_type, vocab_size=cfg.vocab_size, dtype="float32")
    common["tie_word_embeddings"] = cfg.tie_embeddings
    if cfg.vocab_size <= _DEFAULT_PAD.get(model_type, -1):
        common["pad_token_id"] = None  # the config class's default would not fit the vocabulary
    # The sizes of the types with separate key/value heads and a free head_dim.
    sizes = dict(
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.ff_dim,
    )
    act = {"gelu_tanh": "gelu_pytorch_tanh"}.get(cfg.activation, cfg.activation)
    llama_like = ("llama", "mistral", "ministral", "qwen2", "qwen3", "smollm3", "gemma")
    if model_type in (*llama_like, "gemma2", "gemma3_text"):
        params, max_positions = _hf_rope(cfg.settings)
        arch = {
            "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM",
            "ministral": "MinistralForCausalLM",
            "gemma": "GemmaForCausalLM",
            "gemma2": "Gemma2ForCausalLM",
            "gemma3_text": "Gemma3ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
            "smollm3": "SmolLM3ForCausalLM",
        }
        out = dict(
            common,
            architectures=[arch.get(model_type, "Qwen2ForCausalLM")],
            **sizes,
            rms_norm_eps=cfg.norm_eps,
            hidden_act=act,
            max_position_embeddings=max_positions,
            rope_parameters=params,
        )
        if model_type in ("llama", "smollm3"):
            out.update(attention_bias=cfg.bias in ("attn", "all"), mlp_bias=cfg.bias == "all")
        if model_type in ("gemma2", "gemma3_text"):
            local = [s for s in cfg.layers if s.window is not None]
            out.update(
                hidden_activation=out.pop("hidden_act"),
                query_pre_attn_scalar=int(cfg.query_pre_attn_scalar or cfg.head_dim),
                layer_types=[_FULL if s.window is None else _SLIDING for s in cfg.layers],
                sliding_window=local[0].window if local else 4096,
                attention_bias=False,
                **{key: getattr(cfg, ours) or None for key, ours in _SOFTCAPS},
            )
            if model_type == "gemma3_text":
                local_params, _ = _hf_rope(local[0].settings if local else cfg.settings)
                out.update(rope_parameters={_FULL: params, _SLIDING: local_params})
            return out
        windows = [spec.window for spec in cfg.layers]
        size = next((w for w in windows if w is not None), None)
        if model_type == "mistral":
            out.update(sliding_window=size)
        if model_type == "ministral":
            out.update(
                sliding_window=size, layer_types=[_FULL if w is None else _SLIDING for w in windows]
            )
        if model_type == "qwen3":
            out.update(attention_bias=cfg.bias == "attn")
        if model_type == "smollm3":
            out.update(
                no_rope_layers=[int(spec.position != "nope") for spec in cfg.layers],
                use_sliding_window=size is not None,
                sliding_window=size,
                layer_types=[_FULL if w is None else _SLIDING for w in windows],
            )
        if model_type in ("qwen2", "qwen3"):
            out.update(use_sliding_window=size is not None)
            if size is not None:
                types = [_FULL if w is None else _SLIDING for w in windows]
                first = types.index(_SLIDING)
                out.update(
                    sliding_window=size,
                    layer_types=types,
                    # transformers reads layer_types; max_window_layers agrees with it when the
                    # windowed layers are the last ones, as Qwen2's own configs have them.
                    max_window_layers=first if _FULL not in types[first:] else cfg.num_layers,
                )
        return out
    if model_type == "gpt2":
        return dict(
            common,
            architectures=["GPT2LMHeadModel"],
            n_embd=cfg.d_model,
            n_layer=cfg.num_layers,
            n_head=cfg.num_heads,
            n_inner=cfg.ff_dim,
            n_positions=cfg.settings.max_len,
            layer_norm_epsilon=cfg.norm_eps,
            activation_function={"gelu_tanh": "gelu_new"}.get(cfg.activation, cfg.activation),
        )
    if model_type == "phi3":
        params, max_positions = _hf_rope(cfg.settings)
        params["partial_rotary_factor"] = cfg.settings.partial_factor
        windows = {spec.window for spec in cfg.layers}
        return dict(
            common,
            architectures=["Phi3ForCausalLM"],
            **sizes,
            rms_norm_eps=cfg.norm_eps,
            hidden_act=act,
            max_position_embeddings=max_positions,
            # Phi3Config's own default (4096) would stand in for a training length left out.
            original_max_position_embeddings=params.get(
                "original_max_position_embeddings", max_positions
            ),
            rope_parameters=params,
            sliding_window=windows.pop(),
        )
    if model_type == "starcoder2":
        params, max_positions = _hf_rope(cfg.settings)
        windows = {spec.window for spec in cfg.layers}
        return dict(
            common,
            architectures=["Starcoder2ForCausalLM"],
            **sizes,
            norm_epsilon=cfg.norm_eps,
            hidden_act=act,
            use_bias=cfg.bias == "all",
            max_position_embeddings=max_positions,
            rope_parameters=params,
            sliding_window=windows.pop(),
        )
    if model_type == "gpt_neox":
        params, max_positions = _hf_rope(cfg.settings)
        params["partial_rotary_factor"] = cfg.settings.partial_factor
        return dict(
            common,
            architectures=["GPTNeoXForCausalLM"],
            hidden_size=cfg.d_model,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            intermediate_size=cfg.ff_dim,
            layer_norm_eps=cfg.norm_eps,
            hidden_act={"gelu_tanh": "gelu_new"}.get(cfg.activation, cfg.activation),
            use_parallel_residual=cfg.parallel_residual,
            attention_bias=True,
            max_position_embeddings=max_positions,
            rope_parameters=params,
        )
    if model_type == "bloom":
        return dict(
            common,
            architectures=["BloomForCausalLM"],
            hidden_size=cfg.d_model,
            n_layer=cfg.num_layers,
            n_head=cfg.num_heads,
            layer_norm_epsilon=cfg.norm_eps,
        )
    if model_type == "mpt":
        return dict(
            common,
            architectures=["MptForCausalLM"],
            d_model=cfg.d_model,
            n_heads=cfg.num_heads,
            n_layers=cfg.num_layers,
            expansion_ratio=4,
            max_seq_len=2048,  # transformers' MPT reads up to this many positions
            layer_norm_epsilon=cfg.norm_eps,
            no_bias=True,
            attn_config={"alibi": True, "alibi_bias_max": 8, "attn_type": "multihead_attention"},
        )
    raise ValueError(f"model_type {model_type!r}: supported " + ", ".join(ARCHITECTURES))
