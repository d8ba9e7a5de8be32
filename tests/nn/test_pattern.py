"""Per-layer position settings (`model.layer_pattern`): hybrid stacks, sliding windows with their
ring-buffer caches, length temperatures, FoX. Cached decoding equals the full forward for each;
the default parameter tree is the one every earlier checkpoint holds; bad settings fail before
any compute, naming the key.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import losses, small_config
from flax import nnx

from posattn import config as config_lib
from posattn import positions
from posattn.nn import decode
from posattn.nn.config import ConfigError, ModelConfig
from posattn.nn.model import TransformerLM
from posattn.train import steps

DATA = pathlib.Path(__file__).parent / "data"
TOTAL = 40  # tokens of the test sequences; the cache holds TOTAL - 1
PROMPTS = (11, 6)  # ragged prompts, both longer than the window of 8 below


def make_cfg(pattern, *, num_layers=3, **model):
    base = dict(
        model__d_model=16,
        model__num_heads=2,
        model__num_kv_heads=2,
        model__num_layers=num_layers,
        model__layer_pattern=repr(tuple(pattern)),
    )
    base.update({f"model__{k}": v for k, v in model.items()})
    return config_lib.validate(small_config(**base))


# (pattern, model keys, the rows of each layer's cache: a window's ring, or the capacity TOTAL - 1)
CASES = {
    "hybrid-window": (("rope:window=8", "rope:window=8", "nope"), {}, (8, 8, TOTAL - 1)),
    # ALiBi depends on i - j only: a ring; FIRE reads i itself: a full cache, windowed by the mask
    "alibi-fire-window-mqa": (
        ("alibi:window=7", "fire:window=6"),
        {"num_layers": 2, "num_kv_heads": 1},
        (7, TOTAL - 1),
    ),
    "temperature-fox": (
        ("nope:attn_scale=0.5,floor_scale=4,ssmax=True", "fox:window=8,ssmax=True"),
        {"num_layers": 2},
        (TOTAL - 1, 8),
    ),
}


def _teacher_forced(graphdef, params, constants, cache, tokens, lengths, steps_):
    prompt = tokens[:, : int(np.max(lengths))]
    pad = jnp.arange(prompt.shape[1])[None, :] >= lengths[:, None]
    prompt = jnp.where(pad, (prompt + 101) % 256, prompt)  # padding a row must never read
    logits, cache = decode.prefill(graphdef, params, constants, cache, prompt, lengths)
    feed = jnp.take_along_axis(tokens, lengths[:, None] + jnp.arange(steps_)[None], axis=1)

    def body(cache, tok):
        out, cache = decode.decode_step(graphdef, params, constants, cache, tok)
        return cache, out

    cache, outs = jax.lax.scan(body, cache, feed.T)
    return jnp.concatenate([logits[:, None], outs.transpose(1, 0, 2)], axis=1), cache


@pytest.fixture(scope="module")
def decoded():
    """name -> (cached logits, full-forward logits at the same positions, ring rows), one
    compiled program for every case."""
    cfgs = {name: make_cfg(p, **m) for name, (p, m, _) in CASES.items()}
    models = {name: (cfg, *steps.init_model(cfg, jax.random.key(3))) for name, cfg in cfgs.items()}
    tokens = jax.random.randint(jax.random.key(1), (2, TOTAL), 0, 256)
    lengths = np.array(PROMPTS, np.int32)
    steps_ = TOTAL - 1 - max(PROMPTS)
    want_pos = lengths[:, None] - 1 + jnp.arange(steps_ + 1)[None]
    rows = {}

    def run(states, tokens):
        out = {}
        for name, (cfg, graphdef, _, _) in models.items():
            params, constants = states[name]
            full = nnx.merge(graphdef, params, constants)(tokens)
            cache = decode.init_cache(cfg, batch_size=2, capacity=TOTAL - 1)
            rows[name] = tuple(k.shape[1] for k in cache.k)
            got, _ = _teacher_forced(graphdef, params, constants, cache, tokens, lengths, steps_)
            out[name] = (got, jnp.take_along_axis(full, want_pos[..., None], axis=1))
        return out

    states = {name: (p, c) for name, (_, _, p, c) in models.items()}
    results = jax.device_get(jax.jit(run)(states, tokens))
    return {name: (*results[name], rows[name]) for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_cached_decode_equals_the_full_forward(decoded, name):
    got, want, rows = decoded[name]
    assert rows == CASES[name][2]  # a ring of `window` rows where it applies
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)


def test_a_window_hides_exactly_the_keys_past_it_in_the_full_forward():
    """Same parameters with and without the window: equal logits while every key is inside it,
    different once one falls out (the model really passes the window to the core)."""
    windowed = make_cfg(("rope:window=4",), num_layers=1)
    plain = make_cfg(("rope",), num_layers=1)
    graphdef, params, constants = steps.init_model(windowed, jax.random.key(0))[:3]
    tokens = jax.random.randint(jax.random.key(1), (1, 10), 0, 256)
    got = _logits(nnx.merge(graphdef, params, constants), tokens)
    graphdef2 = steps.init_model(plain, jax.random.key(0))[0]
    want = _logits(nnx.merge(graphdef2, params, constants), tokens)
    np.testing.assert_allclose(got[:, :4], want[:, :4], rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(got[:, 4:] - want[:, 4:])).max(axis=-1).min() > 1e-4


def _logits(model, tokens):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))(state, tokens)


def _tree(cfg, *, values):
    build = lambda: TransformerLM(cfg, rngs=nnx.Rngs(params=jax.random.key(0)))  # noqa: E731
    model = build() if values else nnx.eval_shape(build)
    return [
        ["/".join(map(str, path)), list(v.shape), str(v.dtype)]
        + ([float(np.sum(np.asarray(v)))] if values else [])
        for path, v in nnx.to_flat_state(nnx.state(model))
    ]


def test_the_default_model_keeps_the_parameter_tree_of_earlier_checkpoints():
    """Every family, unrolled and scanned, with an empty pattern and with its one-entry
    equivalent: the tree of tests/nn/data/default_trees.json (made by make_default_trees.py from
    the code before layer patterns), path by path, shapes, dtypes and initial values."""
    golden = json.loads((DATA / "default_trees.json").read_text())
    import make_default_trees  # noqa: PLC0415  (tests/nn is on sys.path under pytest)

    for name, cfg in make_default_trees.configs():
        want = golden[name]
        for variant in (cfg, cfg.replace(layer_pattern=(cfg.position,))):
            if variant.layer_pattern and cfg.family.embedding != "none":
                continue  # an input embedding is model.position's, never an entry
            values = name in ("t5-scan0", "kerple_log-scan1", "fire-scan0") and variant is cfg
            got = _tree(variant.validate(), values=values)
            assert [g[:3] for g in got] == [w[:3] for w in want], (name, variant.layer_pattern)
            if values:  # the same initial values: rngs are drawn in the same order
                np.testing.assert_allclose([g[3] for g in got], [w[3] for w in want], rtol=1e-6)


@pytest.mark.parametrize(
    "model, match",
    [
        (dict(layer_pattern=("rotary",)), r"unknown family 'rotary'; known: nope, .*fox"),
        (dict(layer_pattern=("rope:t5_num_buckets=8",)), r"t5_num_buckets is a setting of t5"),
        (dict(layer_pattern=("rope:bogus=1",)), r"'bogus' is not a setting of rope.*window"),
        (dict(layer_pattern=("rope:window=0",)), r"window=0 is invalid: must be an integer >= 1"),
        (dict(layer_pattern=("rope:window=2.5",)), r"window=2.5 is invalid"),
        (dict(layer_pattern=("nope:ssmax=1",)), r"ssmax=1 is invalid: must be True or False"),
        (dict(layer_pattern=("nope:floor_scale=0",)), r"floor_scale=0 is invalid"),
        (dict(layer_pattern=("rope:rope_base=-1",)), r"entry 'rope:rope_base=-1'.*rope_base"),
        (dict(layer_pattern=("nope",) * 5), r"5 entries but config.model.num_layers=4"),
        (dict(layer_pattern=("learned",)), r"'learned'.*input embedding"),
        (dict(layer_pattern=("nope", "rope"), scan_layers=True), r"scan_layers=True needs"),
        (dict(layer_pattern=("nope", "rope"), kv_share=2), r"kv_share=2: layers 0..1 share"),
        (dict(layer_pattern=("fox",), kind="encoder"), r"'fox'.*model.kind='encoder'"),
        (dict(position="fox", kv_share=2), r"kv_share=2 is not supported with FoX"),
        (dict(position="alibi", layer_pattern=("nope",)), r"model.position='alibi' is not used"),
    ],
)
def test_bad_layer_settings_fail_before_compute_naming_the_key(model, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_keys(model).validate()


def test_patterns_come_from_command_lines_and_config_files_and_cycle_over_the_layers():
    config = config_lib.apply_overrides(
        config_lib.defaults(), ["--config.model.layer_pattern=rope:window=4"]
    )
    assert config.model.layer_pattern == ("rope:window=4",)
    text = "--config.model.layer_pattern=('rope:rope_base=1e4,window=8','rope:rope_base=1e6')"
    config = config_lib.apply_overrides(config_lib.defaults(), [text])
    cfg = config_lib.model_config(config)
    assert [(s.settings.base, s.window) for s in cfg.layers] == [(1e4, 8), (1e6, None)] * 2
    # config.json holds a list; the roundtrip gives the same (hashable) config
    again = ModelConfig.from_keys(json.loads(json.dumps(cfg.keys())))
    assert again == cfg and hash(again) == hash(cfg)
    # an entry of model.position's family starts from model.position's settings
    cfg = ModelConfig.from_keys(rope_base=5e5, layer_pattern=("rope:window=8", "nope")).validate()
    assert cfg.layers[0].settings.base == 5e5
    # a dict value keeps its commas
    entry = "rope:rope_scaling={'rope_type': 'linear', 'factor': 2.0},window=8"
    spec = ModelConfig.from_keys(layer_pattern=(entry,)).validate().layers[0]
    assert spec.settings.scaling_dict == {"rope_type": "linear", "factor": 2.0} and spec.window == 8


def test_a_scanned_pattern_equals_the_unrolled_one():
    """One entry (identical layers) scans; logits and converted states agree."""
    from posattn.nn.model import convert_layout

    pattern = ("rope:window=4,ssmax=True,attn_scale=0.3,floor_scale=2",)
    unrolled = ModelConfig.from_keys(
        d_model=16, num_heads=2, num_kv_heads=1, num_layers=2, layer_pattern=pattern
    ).validate()
    scanned = unrolled.replace(scan_layers=True).validate()
    model = TransformerLM(unrolled, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(TransformerLM(scanned, rngs=nnx.Rngs(0)))
    state = convert_layout(nnx.state(model), unrolled, scan_layers=True)
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 256)
    np.testing.assert_allclose(
        _logits(nnx.merge(graphdef, state), tokens), _logits(model, tokens), rtol=2e-5, atol=2e-5
    )


def test_a_fox_gate_held_at_log_f_minus_m_is_alibi():
    """log f_h = -m_h at every position makes c_i - c_j = -m_h (i - j): ALiBi's bias with slopes
    m_h (docs/families.md#fox)."""
    kw = dict(d_model=16, num_heads=4, num_kv_heads=4, num_layers=2)
    fox = TransformerLM(ModelConfig.from_keys(position="fox", **kw).validate(), rngs=nnx.Rngs(0))
    alibi_cfg = ModelConfig.from_keys(position="alibi", **kw).validate()
    alibi = TransformerLM(alibi_cfg, rngs=nnx.Rngs(0))
    slopes = positions.alibi_slopes(4)
    for fb, ab in zip(fox.blocks, alibi.blocks, strict=True):
        for name in ("wq", "wk", "wv", "wo"):
            getattr(fb.attn, name)[...] = getattr(ab.attn, name)[...]
        fb.mlp.w1[...], fb.mlp.w2[...] = ab.mlp.w1[...], ab.mlp.w2[...]
        fb.attn.forget.w[...] = jnp.zeros_like(fb.attn.forget.w[...])
        fb.attn.forget.b[...] = -jnp.log(jnp.expm1(slopes))  # log_sigmoid(b) = -m
    fox.embed[...] = alibi.embed[...]
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, 256)
    np.testing.assert_allclose(_logits(fox, tokens), _logits(alibi, tokens), rtol=1e-4, atol=1e-4)


def test_length_temperatures_against_their_formulas():
    # Llama 4 (HF modeling_llama4): 1 + attn_scale log(floor((i + 1) / floor_scale) + 1), float32
    i = np.array([0, 6, 7, 8190, 8191, 20000, 10**6], np.int64)
    want = 1 + 0.1 * np.log(np.floor((i.astype(np.float32) + 1) / 8192) + 1)
    got = positions.llama4_attention_scale(i, floor_scale=8192.0, attn_scale=0.1)
    np.testing.assert_allclose(got, want.astype(np.float32), rtol=1e-6)
    assert got[3] == 1.0 and got[4] > 1.0  # the first step at i + 1 = floor_scale
    # n_i by brute force over the mask, causal and not, windows and lengths
    for causal in (True, False):
        for window in (None, 1, 3):
            for kv in (5, 9):
                q = np.arange(9)
                j = np.arange(kv)
                visible = np.ones((9, kv), bool)
                if causal:
                    visible &= j[None] <= q[:, None]
                if window is not None:
                    visible &= np.abs(q[:, None] - j[None]) < window
                n = positions.visible_keys(q, kv_len=kv, window=window, causal=causal)
                np.testing.assert_array_equal(n, visible.sum(1))
    n = positions.visible_keys(jnp.arange(4), kv_len=jnp.array([2, 4]), window=3)
    np.testing.assert_array_equal(n, [[1, 2, 2, 1], [1, 2, 3, 3]])  # row 0: keys 0, 1 only
    s = jnp.array([0.5, 2.0])
    np.testing.assert_allclose(
        positions.ssmax_scale(jnp.array([0, 1, 8]), s), np.log([1, 1, 8])[:, None] * [0.5, 2.0]
    )


def test_a_pattern_trains_through_train_and_evaluate(tmp_path):
    from posattn.train import train_and_evaluate

    pattern = "('rope:rope_base=1e4,window=8', 'nope:attn_scale=0.1,floor_scale=8', 'fox')"
    config = small_config(
        model__num_layers=3,
        model__layer_pattern=pattern,
        model__remat="full",
        train__steps=3,
        train__log_every=1,
    )
    train_and_evaluate(config, tmp_path)
    got = losses(tmp_path)
    assert len(got) == 3 and all(np.isfinite(got))


def test_attention_statistics_see_each_layers_window_temperature_and_forget_gates():
    from posattn.eval import attention_stats
    from posattn.nn import layers

    cfg = make_cfg(("rope:window=5,ssmax=True", "fox:attn_scale=0.5,floor_scale=4"), num_layers=2)
    graphdef, params, constants = steps.init_model(cfg, jax.random.key(0))
    T = 12
    tokens = jax.random.randint(jax.random.key(1), (2, T), 0, 256)

    @jax.jit
    def run(params, constants, tokens):
        probs = attention_stats.attention_probabilities(graphdef, params, constants, tokens)
        model = nnx.merge(graphdef, params, constants)
        x, pairs = model.embed_tokens(tokens), []
        for layer, block in enumerate(model.blocks):
            h = block.attn_norm(x)
            want, (k, v) = block.attn(h)  # (B, T, D)
            out = jnp.einsum("bnts,bsnh->btnh", probs[layer], v)
            wo = block.attn.wo[...].reshape(-1, cfg.d_model)
            pairs.append((layers.dense(out.reshape(2, T, -1), wo), want))
            x, _ = block(x)
        return probs, pairs

    probs, pairs = run(params, constants, tokens)
    for got, want in pairs:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    i, j = np.arange(T)[:, None], np.arange(T)[None]
    assert np.all(np.asarray(probs[0])[..., i - j >= 5] == 0)  # outside the window: exactly 0


def test_a_run_started_before_layer_patterns_resumes(tmp_path):
    """Its config.json has no model.layer_pattern: the default (a tuple, a list once written)
    counts as unchanged."""
    from posattn.train import workdir

    config = small_config()
    workdir.write_or_check_config(tmp_path, config)
    old = json.loads((tmp_path / "config.json").read_text())
    del old["model"]["layer_pattern"]
    (tmp_path / "config.json").write_text(json.dumps(old))
    workdir.write_or_check_config(tmp_path, config)  # no error
    changed = config_lib.apply_overrides(config, ["--config.model.layer_pattern=nope"])
    with pytest.raises(ConfigError, match="layer_pattern"):
        workdir.write_or_check_config(tmp_path, changed)


def test_layer_pattern_is_a_discrete_sweep_key():
    from posattn.sweep import plan

    config = small_config()
    config.sweep = {
        "discrete": {"model": {"layer_pattern": (("rope:window=8", "nope"), ("rope",))}}
    }
    programs = plan.plan(config)
    patterns = [config_lib.model_config(p.members[0].config).layer_pattern for p in programs]
    assert patterns == [("rope:window=8", "nope"), ("rope",)]
    with pytest.raises(ConfigError, match="layer_pattern"):
        config.sweep = {"continuous": {"model": {"layer_pattern": (("nope",), ("rope",))}}}
        plan.plan(config)


def test_families_shared_across_layers_stay_shared_inside_a_pattern():
    """T5's table (and Kerple's (r1, r2) unless per layer) is one for all the layers of one entry
    setting, as the reference shares it across the stack; another setting is another table."""

    def paths(pattern, **kw):
        cfg = ModelConfig.from_keys(num_layers=6, layer_pattern=pattern, **kw).validate()
        model = nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0)))
        return [
            "/".join(map(str, p))
            for p, _ in nnx.to_flat_state(nnx.state(model))
            if "bias" in p or "rotary" in p
        ]

    assert paths(("t5", "rope", "t5:t5_max_distance=64")) == [
        "blocks/0/attn/bias/values/table",
        "blocks/1/attn/rotary/inv_freq",
        "blocks/2/attn/bias/values/table",
    ]
    assert paths(("kerple_log", "nope")) == [
        "blocks/0/attn/bias/values/r1",
        "blocks/0/attn/bias/values/r2",
    ]
    per_layer = paths(("kerple_log:kerple_per_layer=True", "nope"))
    assert [p.split("/")[1] for p in per_layer] == ["0", "0", "2", "2", "4", "4"]


def test_llama4_temperature_equals_hugging_faces_captured_queries():
    """tests/nn/data/llama4_attn_scales.json: the queries Hugging Face's Llama4TextAttention
    hands its attention function (identity projection, inputs of ones), captured by
    make_llama4_golden.py, in float32 and bfloat16, and after 8190 cached tokens."""
    from posattn.nn.temperature import QueryTemperature

    golden = json.loads((DATA / "llama4_attn_scales.json").read_text())

    def scaled(dtype, positions, floor_scale):
        t = QueryTemperature(
            1, attn_scale=0.1, floor_scale=floor_scale, ssmax=False, window=None, causal=True
        )
        q = jnp.ones((1, positions.shape[0], 1, 4), dtype)
        out = t(q, positions, kv_len=int(positions[-1]) + 1)
        assert out.dtype == dtype
        return np.asarray(out[0, :, 0, 0].astype(jnp.float32))

    T = len(golden["float32"])
    np.testing.assert_array_equal(scaled(jnp.float32, jnp.arange(T), 4.0), golden["float32"])
    np.testing.assert_array_equal(scaled(jnp.bfloat16, jnp.arange(T), 4.0), golden["bfloat16"])
    after = scaled(jnp.float32, 8190 + jnp.arange(20000), 8192.0)[::997]
    np.testing.assert_allclose(after, golden["llama4_defaults_after_8190"], rtol=1e-6)
