"""posattn.hf: Hugging Face checkpoints load to transformers' logits (committed goldens, no torch),
refusals name the key, and save_pretrained round-trips (tests/hf/make_goldens.py made the files)."""

import json
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import posattn.hf as hf
from posattn.hf.config import HfConfigError

GOLDENS = pathlib.Path(__file__).parent / "goldens"
LOADED = sorted(p.name for p in GOLDENS.iterdir())
TOL = 5e-5  # log-softmax, float32
# The cases whose layers differ (windows, NoPE layers, Gemma 3's local and global RoPE).
PER_LAYER = [
    "qwen2_layer_types",
    "qwen3_window",
    "phi3_partial",
    "smollm3",
    "smollm3_window",
    "mistral_window",
    "ministral",
    "starcoder2",
    "gemma2",
    "gemma2_legacy",
    "gemma3",
    "gemma3_legacy",
    "gemma3_multimodal",
]


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _check(model, expected):
    got = model(jnp.asarray(expected["tokens"]))
    assert got.dtype == jnp.float32 and got.shape == expected["logits"].shape
    err = np.abs(_log_softmax(got) - _log_softmax(expected["logits"])).max()
    assert err < TOL, err


@pytest.mark.parametrize("case", LOADED)
def test_goldens_give_transformers_logits(case):
    _check(hf.from_pretrained(GOLDENS / case), np.load(GOLDENS / case / "expected.npz"))


def test_the_goldens_cover_each_layout_and_config_form():
    assert (GOLDENS / "llama_sharded" / "model.safetensors.index.json").is_file()
    from safetensors import safe_open

    with safe_open(GOLDENS / "llama_bf16" / "model.safetensors", "numpy") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    legacy = json.loads((GOLDENS / "llama_legacy" / "config.json").read_text())
    assert "rope_parameters" not in legacy and legacy["rope_scaling"]["type"] == "linear"


def _copy(tmp_path, case):
    out = tmp_path / case
    shutil.copytree(GOLDENS / case, out)
    return out


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(model_type="mixtral"), "model_type='mixtral'"),
        (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
        (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "longrope"),
        (dict(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5}), "partial"),
        (dict(mlp_bias=True), "mlp_bias=True.*attention_bias"),
        (dict(model_type="mistral", attention_bias=True), "attention_bias=True"),
        (dict(hidden_act="gelu_fast"), "hidden_act='gelu_fast'"),
        (dict(pretraining_tp=2), "pretraining_tp=2"),
        (dict(model_type="qwen3", head_dim=8, mlp_bias=True), "Qwen3's MLP has no biases"),
        (
            dict(model_type="phi3", rope_parameters={"rope_type": "linear", "factor": 2.0}),
            "default or longrope",
        ),
    ],
)
def test_unsupported_options_are_refused_naming_the_key(tmp_path, changes, named):
    path = _copy(tmp_path, "llama_gqa")
    _edit_config(path, **changes)
    with pytest.raises(HfConfigError, match=named):
        hf.from_pretrained(path)


@pytest.mark.parametrize(
    "case, windows",
    [
        ("mistral_window", [8, 8]),
        ("qwen2_window", [None, 8]),
        ("qwen2_layer_types", [6, None]),
        ("qwen3_window", [6, None]),
        ("phi3_partial", [6, 6]),
        ("ministral", [None, 6]),
        ("starcoder2", [6, 6]),
        ("gemma2", [8, None]),
        ("gemma2_legacy", [6, None, 6]),
        ("gemma3", [8, None]),
        ("gemma3_legacy", [6, None, 6]),
    ],
)
def test_sliding_windows_load_per_layer_and_the_goldens_pin_them(tmp_path, case, windows):
    model = hf.from_pretrained(GOLDENS / case)
    assert [spec.window for spec in model.cfg.layers] == windows
    # The same weights without the windows give other logits: the goldens test the windows.
    path = _copy(tmp_path, case)
    if case in ("mistral_window", "phi3_partial", "starcoder2"):
        _edit_config(path, sliding_window=None)
    elif case == "ministral":
        _edit_config(path, layer_types=["full_attention"] * 2)
    elif case.startswith(("gemma2", "gemma3")):
        _edit_config(path, sliding_window=10**6)
    else:
        _edit_config(path, use_sliding_window=False, layer_types=None)
    expected = np.load(GOLDENS / case / "expected.npz")
    got = _log_softmax(hf.from_pretrained(path)(jnp.asarray(expected["tokens"])))
    assert np.abs(got - _log_softmax(expected["logits"])).max() > 100 * TOL


def test_a_missing_sliding_window_is_transformers_default(tmp_path):
    # MistralConfig and Qwen2Config both default sliding_window to 4096 when config.json lacks it.
    for case in ("mistral_window", "qwen2_window"):
        path = _copy(tmp_path, case)
        cfg = json.loads((path / "config.json").read_text())
        del cfg["sliding_window"]
        (path / "config.json").write_text(json.dumps(cfg))
        assert {s.window for s in hf.from_pretrained(path).cfg.layers} - {None} == {4096}


@pytest.mark.parametrize("case", ["qwen2", "neox_sequential"])
def test_rope_settings_missing_from_config_json_take_transformers_defaults(tmp_path, case):
    # Without rope settings, transformers' Qwen2Config reads rope_theta 10000 and GPTNeoXConfig
    # partial_rotary_factor 0.25 (its rotary_pct default): the values these goldens were made with.
    path = _copy(tmp_path, case)
    cfg = json.loads((path / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling", "rope_theta", "rotary_pct"):
        cfg.pop(key, None)
    (path / "config.json").write_text(json.dumps(cfg))
    model = hf.from_pretrained(path)
    assert model.cfg.settings.base == 10000.0
    assert model.cfg.settings.partial_factor == (0.25 if case == "neox_sequential" else 1.0)
    _check(model, np.load(GOLDENS / case / "expected.npz"))


# The smallest config.json of each type: sizes only, everything else transformers' default.
_SIZES = dict(
    hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=48, vocab_size=64
)
MINIMAL = {
    "llama": dict(_SIZES, num_key_value_heads=2),
    "mistral": dict(_SIZES, num_key_value_heads=2),
    "ministral": dict(_SIZES, num_key_value_heads=2, head_dim=8),
    "qwen2": dict(_SIZES, num_key_value_heads=2),
    "qwen3": dict(_SIZES, num_key_value_heads=2),  # head_dim: Qwen3Config's 128
    # Phi3Config's and SmolLM3Config's token ids lie past this vocabulary; SmolLM3's fourth
    # layer is its first NoPE one.
    "phi3": dict(_SIZES, num_key_value_heads=2, pad_token_id=None, eos_token_id=None),
    "smollm3": dict(
        _SIZES, num_hidden_layers=4, pad_token_id=None, bos_token_id=None, eos_token_id=None
    ),
    "gemma": dict(_SIZES, num_key_value_heads=2, head_dim=8),
    "gemma2": dict(_SIZES, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8),
    "gemma3_text": dict(_SIZES, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8),
    "gpt_neox": _SIZES,
    "starcoder2": dict(_SIZES, bos_token_id=None, eos_token_id=None),  # 2 key/value heads
    "gpt2": dict(n_embd=32, n_head=4, n_layer=2, n_positions=64, vocab_size=64),
    "bloom": dict(hidden_size=32, n_head=4, n_layer=2, vocab_size=64),
    "mpt": dict(d_model=32, n_heads=4, n_layers=2, vocab_size=64),
}


# What transformers 5.25's config classes give a config.json of sizes only (hidden 512, 64
# heads): key/value heads, head_dim, RoPE base (the live test below asks transformers itself).
SILENT_DEFAULTS = {
    "llama": (64, 8, 1e4),
    "mistral": (8, 8, 1e4),
    "ministral": (8, 8, 1e4),
    "qwen2": (32, 8, 1e4),
    "qwen3": (32, 128, 1e4),
    "phi3": (64, 8, 1e4),
    "smollm3": (4, 8, 2e6),
    "gemma": (16, 256, 1e4),
    "gemma2": (4, 256, 1e4),
    "gemma3_text": (4, 256, 1e6),
}


@pytest.mark.parametrize("model_type", sorted(SILENT_DEFAULTS))
def test_a_silent_config_json_takes_each_types_defaults(model_type):
    from posattn.hf.config import model_config

    keys = dict(hidden_size=512, num_attention_heads=64, num_hidden_layers=2, vocab_size=64)
    cfg = model_config({"model_type": model_type, "intermediate_size": 48, **keys})
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.settings.base) == SILENT_DEFAULTS[model_type]


@pytest.mark.parametrize("model_type", sorted(SILENT_DEFAULTS))
def test_the_defaults_of_a_silent_config_json_are_transformers_own(model_type):
    """Head counts, head size, RoPE base, norm epsilon and tying read from a config.json that
    gives only the sizes: each type's config class has its own defaults (Mistral's 8 key/value
    heads, Qwen's 32, Gemma's head_dim 256, SmolLM3's base 2e6)."""
    transformers = pytest.importorskip("transformers")
    from posattn.hf.config import model_config

    keys = dict(hidden_size=512, num_attention_heads=64, num_hidden_layers=2, vocab_size=64)
    keys.update(intermediate_size=48)
    ref = transformers.AutoConfig.for_model(model_type, **keys)
    cfg = model_config({"model_type": model_type, **keys})
    rope = ref.rope_parameters.get("full_attention", ref.rope_parameters)
    assert cfg.num_kv_heads == ref.num_key_value_heads
    assert cfg.head_dim == (getattr(ref, "head_dim", None) or 512 // 64)
    assert cfg.settings.base == rope["rope_theta"]
    assert cfg.norm_eps == ref.rms_norm_eps and cfg.tie_embeddings == ref.tie_word_embeddings


@pytest.mark.parametrize("model_type", sorted(MINIMAL))
def test_a_minimal_config_json_reads_as_transformers_reads_it(tmp_path, model_type):
    """Every key config.json leaves out takes the value transformers gives it: the weights of a
    model transformers built from the sizes alone, under a config.json of those sizes alone."""
    pytest.importorskip("transformers")
    import torch
    import transformers

    keys = MINIMAL[model_type]
    config = transformers.AutoConfig.for_model(model_type, **keys)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.3)
    ref.float().eval().save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **keys}))
    tokens = np.random.default_rng(0).integers(0, 64, (2, 24))
    with torch.no_grad():
        want = ref(torch.as_tensor(tokens)).logits.numpy()
    got = hf.from_pretrained(tmp_path)(jnp.asarray(tokens))
    assert np.abs(_log_softmax(got) - _log_softmax(want)).max() < TOL


@pytest.mark.parametrize("kind", ["longrope", "su", "yarn"])
def test_phi3_rope_scaling_in_the_hubs_older_forms(tmp_path, kind):
    # The Hub's Phi-3 files: rope_theta and rope_scaling at the top level, "type" (once "su");
    # transformers reads "su" and "yarn" as LongRoPE for Phi-3.
    path = _copy(tmp_path, "phi3_longrope")
    cfg = json.loads((path / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params["rope_theta"]
    cfg["rope_scaling"] = {"type": kind, **{k: params[k] for k in ("short_factor", "long_factor")}}
    (path / "config.json").write_text(json.dumps(cfg))
    model = hf.from_pretrained(path)
    assert model.cfg.settings.scaling_dict["rope_type"] == "longrope"
    _check(model, np.load(GOLDENS / "phi3_longrope" / "expected.npz"))


@pytest.mark.parametrize("top, inner", [(False, True), (False, False), (True, False)])
def test_phi3_longrope_reads_its_training_length_as_transformers_does(tmp_path, top, inner):
    """transformers' Phi-3 takes LongRoPE's original length from the top-level key (4096 when it
    is absent), not from the scaling dict: with only the dict's 16 it switches to the long
    factors past 4096, not past 16."""
    path = _copy(tmp_path, "phi3_longrope")
    cfg = json.loads((path / "config.json").read_text())
    if not top:
        del cfg["original_max_position_embeddings"]
    if not inner:
        del cfg["rope_parameters"]["original_max_position_embeddings"]
    (path / "config.json").write_text(json.dumps(cfg))
    model = hf.from_pretrained(path)
    assert model.cfg.settings.scaling_dict["original_max_position_embeddings"] == (
        16 if top else 4096
    )
    transformers = pytest.importorskip("transformers")
    import torch

    tokens = np.load(GOLDENS / "phi3_longrope" / "expected.npz")["tokens"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        want = ref(torch.as_tensor(tokens)).logits.numpy()
    got = model(jnp.asarray(tokens))
    assert np.abs(_log_softmax(got) - _log_softmax(want)).max() < TOL


def test_smollm3_nope_layers_load_per_layer_and_the_goldens_pin_them(tmp_path):
    layers = hf.from_pretrained(GOLDENS / "smollm3_window").cfg.layers
    assert [(spec.position, spec.window) for spec in layers] == [
        ("rope", None),
        ("nope", 6),
        ("rope", None),
    ]
    model = hf.from_pretrained(GOLDENS / "smollm3")  # no_rope_layer_interval 2: layer 1 NoPE
    assert [spec.position for spec in model.cfg.layers] == ["rope", "nope"]
    # The same weights with RoPE on every layer give other logits: the golden tests the NoPE.
    path = _copy(tmp_path, "smollm3")
    _edit_config(path, no_rope_layers=[1, 1])
    expected = np.load(GOLDENS / "smollm3" / "expected.npz")
    got = _log_softmax(hf.from_pretrained(path)(jnp.asarray(expected["tokens"])))
    assert np.abs(got - _log_softmax(expected["logits"])).max() > 100 * TOL
    _edit_config(path, no_rope_layers=[1, 2])
    with pytest.raises(HfConfigError, match="no_rope_layers"):
        hf.from_pretrained(path)


def test_qwen2_windows_from_max_window_layers_when_layer_types_is_absent(tmp_path):
    path = _copy(tmp_path, "qwen2_window")
    _edit_config(path, layer_types=None)  # as configs written before transformers 5
    model = hf.from_pretrained(path)
    assert [spec.window for spec in model.cfg.layers] == [None, 8]
    _check(model, np.load(GOLDENS / "qwen2_window" / "expected.npz"))


@pytest.mark.parametrize(
    "case, changes, named",
    [
        ("mistral", dict(sliding_window=0), "sliding_window=0"),
        ("mistral_window", dict(layer_types=["full_attention"] * 2), "ignores layer_types"),
        ("qwen2_window", dict(layer_types=["sliding_attention"]), "2 entries"),
        ("qwen2_window", dict(layer_types=["chunked_attention"] * 2), "'full_attention'"),
        ("qwen2_window", dict(use_sliding_window=False), "need use_sliding_window"),
    ],
)
def test_inconsistent_sliding_window_configs_are_refused(tmp_path, case, changes, named):
    path = _copy(tmp_path, case)
    _edit_config(path, **changes)
    with pytest.raises(HfConfigError, match=named):
        hf.from_pretrained(path)


def test_a_multimodal_gemma3_loads_its_text_model_in_either_naming(tmp_path):
    # The golden is written as transformers writes it (the Hub's form: language_model.model.*,
    # vision_tower.*); transformers 5's module names (model.language_model.*,
    # model.vision_tower.*) load too. The vision tower's tensors are not read.
    model = hf.from_pretrained(GOLDENS / "gemma3_multimodal")
    assert [s.window for s in model.cfg.layers] == [8, None] and model.cfg.qk_norm
    path = _copy(tmp_path, "gemma3_multimodal")

    def rename(tensors):
        for name in list(tensors):
            new = name.replace("language_model.model.", "model.language_model.", 1)
            for part in ("vision_tower.", "multi_modal_projector."):
                if new.startswith(part):
                    new = "model." + new
            tensors[new] = tensors.pop(name)

    _rewrite(path, rename)
    _check(hf.from_pretrained(path), np.load(GOLDENS / "gemma3_multimodal" / "expected.npz"))
    # A tensor of the text model that no rule reads is still an error.
    _rewrite(path, lambda t: t.update({"model.language_model.extra.weight": np.zeros(2)}))
    with pytest.raises(ValueError, match=r"does not use: model\.language_model\.extra"):
        hf.from_pretrained(path)


def test_gemma3_layers_take_their_own_rope_and_the_goldens_pin_it(tmp_path):
    # Local layers: their base and no scaling; global: rope_theta with the linear scaling. Read
    # from transformers 5's rope_parameters by layer type and from the older top-level keys.
    for case, local, glob in [("gemma3", 1e4, 1e6), ("gemma3_legacy", 2e3, 5e5)]:
        cfg = hf.from_pretrained(GOLDENS / case).cfg
        assert (cfg.post_norms, cfg.qk_norm, cfg.norm_unit_offset) == (True, True, True)
        assert cfg.query_pre_attn_scalar == {"gemma3": 10, "gemma3_legacy": 8}[case]
        for spec in cfg.layers:
            want = (local, None) if spec.window else (glob, "linear")
            kind = spec.settings.scaling_dict and spec.settings.scaling_dict["rope_type"]
            assert (spec.settings.base, kind) == want, (case, spec)
    # Every layer with the global RoPE: other logits.
    path = _copy(tmp_path, "gemma3")
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"]["sliding_attention"] = cfg["rope_parameters"]["full_attention"]
    (path / "config.json").write_text(json.dumps(cfg))
    expected = np.load(GOLDENS / "gemma3" / "expected.npz")
    got = _log_softmax(hf.from_pretrained(path)(jnp.asarray(expected["tokens"])))
    assert np.abs(got - _log_softmax(expected["logits"])).max() > 100 * TOL


def test_gemma2_soft_caps_are_read_and_the_goldens_pin_each(tmp_path):
    """Gemma 2's caps: the attention's (before the mask) and the output's; Gemma2Config's 50
    and 30 where config.json is silent (the legacy golden names them as the Hub's files do)."""
    expected = np.load(GOLDENS / "gemma2" / "expected.npz")
    for case, caps, scalar in [("gemma2", (4.0, 2.0), 10), ("gemma2_legacy", (50.0, 30.0), 8)]:
        cfg = hf.from_pretrained(GOLDENS / case).cfg
        assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == caps
        assert (cfg.post_norms, cfg.qk_norm, cfg.query_pre_attn_scalar) == (True, False, scalar)
        assert {spec.settings.base for spec in cfg.layers} == {5e3 if case == "gemma2" else 1e4}
    path = _copy(tmp_path, "gemma2")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        _edit_config(path, **{key: None})
        got = _log_softmax(hf.from_pretrained(path)(jnp.asarray(expected["tokens"])))
        assert np.abs(got - _log_softmax(expected["logits"])).max() > 100 * TOL, key
    base = json.loads((GOLDENS / "gemma2" / "config.json").read_text())
    silent = {k: v for k, v in base.items() if not k.endswith("softcapping")}
    (path / "config.json").write_text(json.dumps(silent))
    assert hf.from_pretrained(path).cfg.attn_logit_softcap == 50.0
    assert hf.from_pretrained(path).cfg.final_logit_softcap == 30.0


@pytest.mark.parametrize(
    "case, changes, named",
    [
        ("gemma3", dict(attention_bias=True), "attention_bias=True"),
        ("gemma3", dict(layer_types=["sliding_attention"]), "2 entries"),
        ("gemma3", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        ("gemma3", dict(final_logit_softcapping=0.0), "final_logit_softcapping=0.0"),
        ("gemma3", dict(attn_logit_softcapping=50.0), "does not cap its attention logits"),
        ("gemma2", dict(final_logit_softcapping=-1.0), "final_logit_softcapping=-1.0"),
        ("gemma2", dict(attn_logit_softcapping="50"), "attn_logit_softcapping='50'"),
        ("gemma2", dict(attention_bias=True), "attention_bias=True"),
        ("gemma2", dict(layer_types=["full_attention"] * 3), "2 entries"),
        ("gemma2", dict(layer_types=["local", "full_attention"]), "each 'sliding_attention'"),
        ("gemma2", dict(sliding_window=None), "need a sliding_window"),
        ("gemma2", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ],
)
def test_unsupported_gemma_options_are_refused(tmp_path, case, changes, named):
    path = _copy(tmp_path, case)
    _edit_config(path, **changes)
    with pytest.raises(HfConfigError, match=named):
        hf.from_pretrained(path)


def test_gpt2_inverse_layer_scale_is_refused(tmp_path):
    path = _copy(tmp_path, "gpt2")
    _edit_config(path, scale_attn_by_inverse_layer_idx=True)
    with pytest.raises(HfConfigError, match="scale_attn_by_inverse_layer_idx"):
        hf.from_pretrained(path)


def _rewrite(path, edit):
    from safetensors import safe_open
    from safetensors.numpy import save_file

    file = path / "model.safetensors"
    with safe_open(file, "numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_tensors_are_checked_both_ways_and_by_shape(tmp_path):
    path = _copy(tmp_path, "qwen2")
    _rewrite(path, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": np.zeros(32)}))
    unused = r"does not use: model\.layers\.0\.self_attn\.o_proj\.bias"
    with pytest.raises(ValueError, match=unused):
        hf.from_pretrained(path)
    shutil.rmtree(path)
    shutil.copytree(GOLDENS / "qwen2", path)
    _rewrite(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match=r"absent: model\.layers\.1\.self_attn\.k_proj\.bias"):
        hf.from_pretrained(path)
    shutil.rmtree(path)
    shutil.copytree(GOLDENS / "qwen2", path)
    _rewrite(path, lambda t: t.update({"lm_head.weight": np.zeros((60, 32), np.float32)}))
    with pytest.raises(ValueError, match=r"lm_head\.weight .*\(60, 32\).*\(64, 32\)"):
        hf.from_pretrained(path)


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(attn_config={"clip_qkv": 8.0}), "attn_config.clip_qkv=8.0"),
        (dict(attn_config={"qk_ln": True}), "attn_config.qk_ln=True"),
        (dict(attn_config={"alibi": False}), "attn_config.alibi=False"),
        (dict(attn_config={"alibi_bias_max": 16}), "attn_config.alibi_bias_max=16"),
        (dict(attn_config={"softmax_scale": 0.5}), "attn_config.softmax_scale=0.5"),
        (dict(attn_config={"prefix_lm": True}), "attn_config.prefix_lm=True"),
        (dict(attn_config={"attn_type": "multiquery_attention"}), "attn_config.attn_type"),
        (dict(no_bias=False), "no_bias=False"),
        (dict(expansion_ratio=2), "expansion_ratio=2"),
        (dict(logit_scale=0.5), "logit_scale=0.5"),
        (dict(norm_type="rmsnorm"), "norm_type='rmsnorm'"),
    ],
)
def test_unsupported_mpt_options_are_refused_naming_the_key(tmp_path, changes, named):
    path = _copy(tmp_path, "mpt")
    _edit_config(path, **changes)
    with pytest.raises(HfConfigError, match=named):
        hf.from_pretrained(path)


def _mpt_slopes(num_heads: int, alibi_bias_max: float = 8.0) -> np.ndarray:
    """transformers' `modeling_mpt.build_mpt_alibi_tensor` slopes, in numpy (float32 as torch)."""
    n = 2 ** int(np.ceil(np.log2(num_heads)))
    base = np.arange(1, n + 1, dtype=np.float32) * np.float32(alibi_bias_max / n)
    slopes = np.float32(1.0) / np.power(np.float32(2.0), base)
    if n != num_heads:
        slopes = np.concatenate([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes


@pytest.mark.parametrize("num_heads", list(range(1, 33)) + [48, 71, 96])
def test_mpt_alibi_slopes_are_press_slopes_for_any_head_count(num_heads):
    # MPT pads to the next power of two P and interleaves (slopes of P/2, then the odd ones of
    # P); Press et al. take the largest power below N, then every other slope of twice it: the
    # same slopes in the same head order whenever alibi_bias_max is 8.
    from posattn import positions

    ours = np.asarray(positions.alibi_slopes(num_heads))
    np.testing.assert_allclose(ours, _mpt_slopes(num_heads), rtol=1e-7, atol=0)


def test_mpt_slope_formula_is_transformers_own():
    pytest.importorskip("transformers")
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    for num_heads in (1, 3, 4, 6, 12, 20):
        bias = build_mpt_alibi_tensor(num_heads, 5).numpy()  # [N, 1, 5]: slope * (j - 4)
        np.testing.assert_allclose(-bias[:, 0, 0] / 4, _mpt_slopes(num_heads), rtol=1e-7)


@pytest.mark.parametrize(
    "case",
    [
        "qwen2",
        "qwen3",
        "phi3_longrope",
        *PER_LAYER,
        "gpt2",
        "bloom",
        "llama_mqa_tied",
        "llama_attention_bias",
        "qwen3_attention_bias",
        "smollm3_attention_bias",
        "neox_sequential",
        "starcoder2_nobias",
        "mpt_six_heads",
        "rope_longrope",
    ],
)
def test_save_then_load_gives_the_same_parameters(tmp_path, case):
    model = hf.from_pretrained(GOLDENS / case)
    hf.save_pretrained(model, tmp_path / "out")
    again = hf.from_pretrained(tmp_path / "out")
    a = nnx.to_flat_state(nnx.state(model))
    b = dict(nnx.to_flat_state(nnx.state(again)))
    for path, v in a:
        np.testing.assert_array_equal(np.asarray(v[...]), np.asarray(b[path][...]), str(path))
    assert again.cfg == model.cfg


@pytest.mark.parametrize("activation, written", [("silu", "silu"), ("gelu", "gelu")])
def test_gemma2_and_gemma3_write_any_activation_and_gemma_only_its_own(
    tmp_path, activation, written
):
    """Gemma2Config and Gemma3TextConfig carry `hidden_activation`, which their models read as
    it is ("gelu" the exact GELU); posattn writes Gemma (GemmaConfig reads a legacy "gelu" as
    the tanh approximation) with its tanh GELU only."""
    from posattn.nn.model import TransformerLM

    for case in ("gemma2", "gemma3"):
        cfg = hf.from_pretrained(GOLDENS / case).cfg.replace(activation=activation).validate()
        hf.save_pretrained(TransformerLM(cfg, rngs=nnx.Rngs(0)), tmp_path / case)
        config = json.loads((tmp_path / case / "config.json").read_text())
        assert config["model_type"] == case.replace("gemma3", "gemma3_text")
        assert config["hidden_activation"] == written
        assert hf.from_pretrained(tmp_path / case).cfg == cfg
    gemma = hf.from_pretrained(GOLDENS / "gemma").cfg.replace(activation=activation).validate()
    with pytest.raises(ValueError, match="no Hugging Face architecture"):
        hf.save_pretrained(TransformerLM(gemma, rngs=nnx.Rngs(0)), tmp_path / "gemma")


def test_bfloat16_loading_keeps_bfloat16_parameters():
    model = hf.from_pretrained(GOLDENS / "llama_bf16", dtype="bfloat16")
    assert model.blocks[0].attn.wq[...].dtype == jnp.bfloat16
    expected = np.load(GOLDENS / "llama_bf16" / "expected.npz")
    got = _log_softmax(model(jnp.asarray(expected["tokens"])))
    err = np.abs(got - _log_softmax(expected["logits"]))
    assert err.mean() < 0.05 and err.max() < 0.5  # bfloat16 activations (8-bit mantissa)


def test_a_bfloat16_model_saves_a_bfloat16_file_that_loads_back_equal(tmp_path):
    from safetensors import safe_open

    model = hf.from_pretrained(GOLDENS / "llama_bf16", dtype="bfloat16")
    hf.save_pretrained(model, tmp_path / "out")
    with safe_open(tmp_path / "out" / "model.safetensors", "numpy") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    again = dict(
        nnx.to_flat_state(nnx.state(hf.from_pretrained(tmp_path / "out", dtype="bfloat16")))
    )
    for path, v in nnx.to_flat_state(nnx.state(model)):
        np.testing.assert_array_equal(np.asarray(v[...]), np.asarray(again[path][...]))


def test_a_model_without_a_hugging_face_twin_is_not_saved(tmp_path):
    from posattn.nn.config import ModelConfig
    from posattn.nn.model import TransformerLM

    cfg = ModelConfig.from_keys(dict(d_model=16, num_layers=1, num_heads=2, num_kv_heads=2))
    with pytest.raises(ValueError, match="no Hugging Face architecture"):
        hf.save_pretrained(TransformerLM(cfg.validate(), rngs=nnx.Rngs(0)), tmp_path / "x")
    # GPT-NeoX's block with grouped-query heads: neither GPT-NeoX (its fused qkv holds N heads
    # of each) nor StarCoder2 (sequential residuals) computes it.
    neox = hf.from_pretrained(GOLDENS / "neox_parallel").cfg.replace(num_kv_heads=2).validate()
    with pytest.raises(ValueError, match="no Hugging Face architecture"):
        hf.save_pretrained(TransformerLM(neox, rngs=nnx.Rngs(0)), tmp_path / "x")
    # Per-layer positions that no architecture writes are refused, not dropped: another RoPE
    # base on one layer, a length temperature, windows a Llama cannot hold.
    llama = hf.from_pretrained(GOLDENS / "llama_gqa").cfg
    # An eval-time RoPE remap has no transformers setting: refused, not dropped.
    remapped = llama.replace(rope_remap={"type": "rerope", "window": 4}).validate()
    with pytest.raises(ValueError, match=r"model.rope_remap=.*transformers has no ReRoPE"):
        hf.save_pretrained(TransformerLM(remapped, rngs=nnx.Rngs(0)), tmp_path / "r")
    # Nor has it stick-breaking attention, on any layer of a Llama otherwise.
    breaking = llama.replace(layer_pattern=("rope", "stick_breaking")).validate()
    with pytest.raises(ValueError, match="no stick-breaking attention"):
        hf.save_pretrained(TransformerLM(breaking, rngs=nnx.Rngs(0)), tmp_path / "s")
    contextual = llama.replace(layer_pattern=("cope", "rope")).validate()
    with pytest.raises(ValueError, match="no contextual position encoding"):
        hf.save_pretrained(TransformerLM(contextual, rngs=nnx.Rngs(0)), tmp_path / "c")
    for pattern, named in [
        (("rope", "rope:rope_base=500.0"), "layer 1 has positions of its own"),
        (("rope:attn_scale=0.1",), "layer 0 has positions of its own.*temperature"),
        (("rope:window=8", "rope:window=4"), r"sliding windows \[8, 4\].*one window size"),
    ]:
        cfg = llama.replace(layer_pattern=pattern).validate()
        with pytest.raises(ValueError, match=named):
            hf.save_pretrained(TransformerLM(cfg, rngs=nnx.Rngs(0)), tmp_path / "y")
    # Gemma 3's post-norms on a Llama; Qwen3's query/key norms with biases; soft caps on a
    # Llama; Gemma 3 with two local RoPEs; Gemma 2 with a RoPE of its own on one layer.
    gemma3 = hf.from_pretrained(GOLDENS / "gemma3_legacy").cfg
    gemma2 = hf.from_pretrained(GOLDENS / "gemma2_legacy").cfg
    for cfg, named in [
        (llama.replace(post_norms=True), "written only as Gemma 3's .* or Qwen3's"),
        (llama.replace(qk_norm=True, bias="qkv"), "written only as Gemma 3's .* or Qwen3's"),
        (llama.replace(attn_logit_softcap=50.0), "softcap are written only as Gemma 2's"),
        (llama.replace(final_logit_softcap=30.0), "softcap are written only as Gemma 2's"),
        (gemma3.replace(attn_logit_softcap=50.0), "Gemma 3 does not cap attention logits"),
        (
            gemma2.replace(layer_pattern=("rope:window=6", "rope", "rope:window=6,rope_base=7.0")),
            "layer 2 has positions of its own",
        ),
        (
            gemma3.replace(layer_pattern=("rope:window=6", "rope", "rope:window=6,rope_base=7.0")),
            "neither of Gemma 3's two kinds",
        ),
    ]:
        cfg = cfg.validate()
        with pytest.raises(ValueError, match=named):
            hf.save_pretrained(TransformerLM(cfg, rngs=nnx.Rngs(0)), tmp_path / "y")
    assert not (tmp_path / "y").exists()


# ---- Live tests: transformers in this process (skipped where it is absent, as on CI). ----


def test_gemma3_with_a_final_soft_cap_computes_what_transformers_computes(tmp_path):
    """Gemma3TextConfig's final_logit_softcapping (null in the published files) is applied as
    Gemma 2's; its attn_logit_softcapping is refused, since transformers' Gemma 3 keeps it
    without capping anything."""
    pytest.importorskip("transformers")
    import torch
    import transformers

    path = _copy(tmp_path, "gemma3")
    _edit_config(path, final_logit_softcapping=2.5)
    model = hf.from_pretrained(path)
    assert (model.cfg.attn_logit_softcap, model.cfg.final_logit_softcap) == (0.0, 2.5)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    expected = np.load(GOLDENS / "gemma3" / "expected.npz")
    with torch.no_grad():
        want = ref(torch.as_tensor(expected["tokens"])).logits.numpy()
    assert np.abs(_log_softmax(want) - _log_softmax(expected["logits"])).max() > 100 * TOL
    _check(model, {"tokens": expected["tokens"], "logits": want})
    # What transformers does with the attention's cap: nothing (the same logits).
    _edit_config(path, attn_logit_softcapping=3.0)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        same = ref(torch.as_tensor(expected["tokens"])).logits.numpy()
    np.testing.assert_array_equal(same, want)


@pytest.mark.parametrize(
    "case",
    [
        "qwen2",
        "qwen3",
        "phi3_longrope",
        *PER_LAYER,
        "gpt2",
        "bloom",
        "neox_parallel",
        "gemma",
        "mpt",
        "rope_longrope",
        "rope_yarn",
        "llama_attention_bias",
        "qwen3_attention_bias",
        "smollm3_attention_bias",
    ],
)
def test_transformers_reads_save_pretrained_to_the_same_logits(tmp_path, case):
    pytest.importorskip("transformers")
    import torch
    import transformers

    model = hf.from_pretrained(GOLDENS / case)
    hf.save_pretrained(model, tmp_path / "out")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float32, attn_implementation="eager"
    )
    expected = np.load(GOLDENS / case / "expected.npz")
    with torch.no_grad():
        logits = ref(torch.as_tensor(expected["tokens"])).logits.numpy()
    err = np.abs(_log_softmax(logits) - _log_softmax(expected["logits"])).max()
    assert err < TOL, err


@pytest.mark.parametrize("case", ["rope_yarn", "llama_head_dim", "mpt_six_heads", "qwen2_window"])
def test_goldens_rebuilt_in_process_still_match(tmp_path, case):
    pytest.importorskip("transformers")
    import make_goldens

    make_goldens.write(case, tmp_path / case)
    _check(hf.from_pretrained(tmp_path / case), np.load(tmp_path / case / "expected.npz"))


if __name__ == "__main__":  # the measured errors of docs/checkpoints.md
    for case in LOADED:
        expected = np.load(GOLDENS / case / "expected.npz")
        got = hf.from_pretrained(GOLDENS / case)(jnp.asarray(expected["tokens"]))
        err = np.abs(_log_softmax(got) - _log_softmax(expected["logits"])).max()
        print(f"{case:18s} {err:.1e}")
