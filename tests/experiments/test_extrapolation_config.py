"""The experiment's config: entries, checks before compute, rows, and the code hash its caches
are keyed on (no training here)."""

import sys
import textwrap

import jax
import numpy as np
import pytest
from conftest import ROOT

from posattn import config as config_lib
from posattn import rotary
from posattn.eval import lengths as lengths_lib
from posattn.eval import registry

sys.path.insert(0, str(ROOT / "experiments"))
import length_extrapolation as experiment  # noqa: E402
from length_extrapolation import provenance, settings  # noqa: E402


def _experiment():
    return experiment


def test_bad_settings_fail_before_compute(tmp_path, capsys):
    experiment = _experiment()
    assert experiment.main(["--config.families=('rope','bogus')", "--workdir", str(tmp_path)]) == 2
    assert experiment.main(["--config.passkey.digits=40", "--workdir", str(tmp_path)]) == 2
    assert experiment.main(["--config.eval.attention_impl=flash", "--workdir", str(tmp_path)]) == 2
    assert experiment.main(["--config.model.attention_impl=flash", "--workdir", str(tmp_path)]) == 2
    assert experiment.main(["--config.eval.sliding_stride=65", "--workdir", str(tmp_path)]) == 2
    assert experiment.main(["--config.eval.max_tokens=0", "--workdir", str(tmp_path)]) == 2
    assert experiment.main(["--config.induction.gaps=(2000,)", "--workdir", str(tmp_path)]) == 2
    assert experiment.main(["--config.workers=-1", "--workdir", str(tmp_path)]) == 2
    # The default's training keys (4-8 digits) do not fit rows of 33 bytes: named, not trained.
    capsys.readouterr()
    short = ["--config.data.seq_len=32", "--config.data.induction_span=16"]
    assert experiment.main([*short, "--workdir", str(tmp_path)]) == 2
    assert "data.passkey_digits up to 8 digits" in capsys.readouterr().err
    assert experiment.main(["--config.rope_scalings=('yarn:beta=2',)", "--workdir", str(tmp_path)])
    assert experiment.main(
        ["--config.rope_scalings=('dynamic:factor=0.5',)", "--workdir", str(tmp_path)]
    )
    assert not any(tmp_path.iterdir())


def test_family_entries_carry_their_own_settings_and_directories(tmp_path):
    experiment = _experiment()
    config = config_lib.load_config(ROOT / "configs" / "extrapolation.py", [])
    name, overrides = experiment.family_entry("fire:fire_init_c=3.2,fire_init_L=64", config)
    assert (name, overrides) == ("fire", {"fire_init_c": 3.2, "fire_init_L": 64})
    train = experiment.family_config(config, "fire:fire_init_c=3.2,fire_init_L=64")
    assert train.model.position == "fire" and train.model.fire_init_c == 3.2
    assert experiment.family_config(config, "fire").model.fire_init_c == config.model.fire_init_c
    assert experiment.entry_dir(tmp_path, "fire") == tmp_path / "fire"
    assert experiment.entry_dir(tmp_path, "t5:t5_max_distance=16").name == "t5@t5_max_distance=16"
    for entry, words in (
        ("fire:bogus=1", ["bogus"]),
        ("alibi:fire_init_c=3.2", ["fire_init_c", "fire", "alibi"]),
        ("sandwich:sandwich_dim=3", ["sandwich_dim", "even"]),
        ("rope:position=alibi", ["position"]),
        ("firefly", ["firefly", "unknown"]),
    ):
        config.families = ("alibi", entry)
        with pytest.raises(config_lib.ConfigError) as err:
            experiment.check_experiment(config)
        assert all(w in str(err.value) for w in words), str(err.value)
    for arg in ("fire", "t5", "sandwich", "kerple", "rope"):  # every settings sweep is valid
        experiment.check_experiment(
            config_lib.load_config(f"{ROOT / 'configs' / 'extrapolation_settings.py'}:{arg}", [])
        )


def test_an_entry_may_be_a_layer_pattern(tmp_path):
    """ "a|b" cycles entries over the layers; a per-layer key puts its layer on every layer."""
    experiment = _experiment()
    config = config_lib.load_config(ROOT / "configs" / "extrapolation.py", [])
    hybrid = experiment.family_config(config, "rope:window=32|nope")
    assert hybrid.model.position == "rope"
    assert tuple(hybrid.model.layer_pattern) == ("rope:window=32", "nope")
    ssmax = experiment.family_config(config, "nope:ssmax=True")
    assert tuple(ssmax.model.layer_pattern) == ("nope:ssmax=True",)
    assert settings.is_rotary("rope:window=32|nope")  # its eval-time scalings apply
    for entry, words in (
        ("rope:window=0|nope", ["window", "0"]),
        ("rope|bogus", ["bogus", "unknown"]),
    ):
        config.families = ("alibi", entry)
        with pytest.raises(config_lib.ConfigError) as err:
            experiment.check_experiment(config)
        assert all(w in str(err.value) for w in words), str(err.value)


def test_rope_scaling_entries_keep_hugging_face_meanings():
    experiment = _experiment()
    entry = experiment.rope_scaling_entry
    assert entry("ntk") == ("ntk", {})
    assert entry("dynamic") == ("dynamic", {"factor": 2.0})  # a configured factor, not T / L
    assert entry("yarn:beta_fast=16") == ("yarn", {"beta_fast": 16.0, "beta_slow": 1.0})
    for bad in ("ntk:factor=2", "yarn:beta=3", "yarn:beta_fast", "dynamic:factor=x", "pi"):
        with pytest.raises(ValueError, match="rope_scalings"):
            entry(bad)
    # HF dynamic at T = 16L with its factor 2: the base grows by (2 * 16 - 1)^(d/(d-2)), from the
    # length of the window read, not by the extension ratio's (16^2 - 16 + 1)^(d/(d-2)).
    options = entry("dynamic")[1]
    scaling = lengths_lib.rope_scaling_row("dynamic", train_len=64, eval_len=1024, **options)
    assert scaling["factor"] == 2.0 and scaling["original_max_position_embeddings"] == 64
    d = 16
    got, _ = rotary.rope_frequencies(d, base=10000.0, scaling=scaling, seq_len=1024)
    base = 10000.0 * 31.0 ** (d / (d - 2))
    np.testing.assert_allclose(got, 1.0 / base ** (np.arange(0, d, 2) / d), rtol=1e-5)


def test_paper_config_builds_a_247m_class_model_for_every_family():
    from flax import nnx

    from posattn.nn.model import TransformerLM

    experiment = _experiment()
    config = config_lib.load_config(ROOT / "configs" / "extrapolation_paper.py")
    experiment.check_experiment(config)
    assert experiment.eval_lengths(config) == [512, 1012, 2012, 4012, 8512]
    for family in config.families:
        cfg = config_lib.validate(experiment.family_config(config, family))
        model = nnx.eval_shape(
            lambda cfg=cfg: TransformerLM(cfg, rngs=nnx.Rngs(params=0))
        )  # no compute
        count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        assert 245e6 < count < 260e6, (family, count)
    long = config_lib.load_config(f"{ROOT / 'configs' / 'extrapolation_paper.py'}:1024")
    assert long.data.seq_len == 1024 and experiment.eval_lengths(long)[-1] == 16 * 1024


def test_rows_are_built_once_for_any_rope_entry():
    config = config_lib.load_config(ROOT / "configs" / "extrapolation.py", [])
    config.families = ("alibi", "rope:rope_base=5e5", "rope")
    config.rope_scalings = ("yarn", "dynamic:factor=4")
    config.finetune.kinds = ("linear",)
    experiment.check_experiment(config)
    rows = experiment.build_rows(config)
    assert [r.name for r in rows] == [
        "alibi",
        "rope:rope_base=5e5",
        "rope:rope_base=5e5+yarn",
        "rope:rope_base=5e5+dynamic:factor=4",
        "rope:rope_base=5e5+linear+ft",
        "rope",
        "rope+yarn",
        "rope+dynamic:factor=4",
        "rope+linear+ft",
    ]
    assert rows[2].train_config is rows[1].train_config  # one config per entry, shared
    assert rows[1].train_config.model.rope_base == 5e5
    L = config.data.seq_len
    assert rows[2].reads(config, L) == rows[1].reads(config, L)  # plain RoPE up to L
    assert rows[2].reads(config, 2 * L).scaling_dict()["factor"] == 2.0
    assert rows[4].reads(config, L).scaling_dict()["factor"] == 4.0  # +ft: at every length
    config.families = ("alibi",)
    config.finetune.enabled = False
    with pytest.raises(config_lib.ConfigError, match="RoPE entry"):
        experiment.check_experiment(config)


def test_remap_rows_read_rerope_and_self_extend_past_L_and_are_checked_before_compute():
    config = config_lib.load_config(ROOT / "configs" / "extrapolation.py", [])
    config.families = ("rope",)
    config.rope_scalings = (
        "rerope",
        "self_extend",
        "self_extend:group=4,log_scale=1",
        "rerope:leak=16",
    )
    config.finetune.enabled = False
    experiment.check_experiment(config)
    rows = experiment.build_rows(config)
    L = config.data.seq_len  # 64: windows of 32
    assert [r.name for r in rows] == [
        "rope",
        "rope+rerope",
        "rope+self_extend",
        "rope+self_extend:group=4,log_scale=1",
        "rope+rerope:leak=16",
    ]
    assert rows[1].reads(config, L) == rows[0].reads(config, L)  # the trained model up to L
    assert rows[1].reads(config, 2 * L).remap_dict() == {"type": "rerope", "window": 32}
    assert rows[1].reads(config, 2 * L).scaling_dict() is None
    # SelfExtend's group per length: the smallest divisor g of 32 with
    # (T - 1) // g + 32 - 32 // g < 64: 4 at 2L (31 + 24), 32 at 16L (31 + 31)
    groups = [rows[2].reads(config, m * L).remap_dict()["group"] for m in (2, 4, 8, 16)]
    assert groups == [4, 8, 16, 32]
    fixed = rows[3].reads(config, 16 * L).remap_dict()
    assert fixed == {"type": "self_extend", "window": 32, "group": 4, "log_scale_base": 64}
    assert rows[4].reads(config, 2 * L).remap_dict() == {"type": "rerope", "window": 32, "leak": 16}
    for entries, named in [
        (("rerope:window_multiple=1",), "window of 64 tokens"),
        (("self_extend:group=3",), "group=3.0 must be a positive integer dividing window 32"),
        (("self_extend:window_multiple=0.75",), "no SelfExtend group keeps the far distances"),
        (("rerope:group=2",), "allowed: window_multiple, leak, log_scale"),
        (("rerope:log_scale=2",), "log_scale=2.0 must be 0"),
        (("rerope:leak=1",), "leak=1.0 must be an integer >= 2"),
        (("self_extend:leak=2",), "allowed: window_multiple, group, log_scale"),
    ]:
        config.rope_scalings = entries
        with pytest.raises(config_lib.ConfigError, match=named):
            experiment.check_experiment(config)
    config.rope_scalings = ("rerope",)
    config.eval.attention_impl = "native"
    with pytest.raises(config_lib.ConfigError, match="second query/key pair"):
        experiment.check_experiment(config)


def _module(tmp_path, body):
    path = tmp_path / "mine.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_code_hash_ignores_docstrings_and_comments_and_sees_code(tmp_path):
    a = _module(
        tmp_path,
        '''
        """A module."""
        def f(x):
            """Adds one."""
            return x + 1  # one
    ''',
    )
    before = provenance.source_sha256([a])
    a.write_text('''"""Another docstring."""\n\n\ndef f(x):\n    # a comment\n    return x + 1\n''')
    assert provenance.source_sha256([a]) == before
    a.write_text("def f(x):\n    return x + 2\n")
    assert provenance.source_sha256([a]) != before


def test_the_native_kernels_source_is_in_the_code_hash(tmp_path):
    """The C++ the package compiles (the native attention kernel) computes the step and the
    forward pass: both stages' hashes cover it, and any edit of such a file changes the hash."""
    kernel = ROOT / "src" / "posattn" / "attention" / "native" / "attention.cc"
    assert kernel in provenance.code_files("training")
    assert kernel in provenance.code_files("evaluation")
    source = tmp_path / "kernel.cc"
    source.write_text("float f(float x) { return x + 1; }\n")
    before = provenance.source_sha256([source])
    source.write_text("float f(float x) { return x + 1; }  // one\n")
    assert provenance.source_sha256([source]) != before


def test_an_evaluators_code_is_in_its_cache_key(tmp_path):
    import importlib.util

    path = _module(
        tmp_path,
        '''
        def run(model, text, length, settings):
            """One per length."""
            return 1.0
    ''',
    )
    spec = importlib.util.spec_from_file_location("mine", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    evaluator = registry.Evaluator("mine", module.run)
    before = provenance.evaluator_code_sha256(evaluator)
    path.write_text(path.read_text().replace("One per length.", "A docstring edit."))
    assert provenance.evaluator_code_sha256(evaluator) == before
    path.write_text(path.read_text().replace("return 1.0", "return 2.0"))
    assert provenance.evaluator_code_sha256(evaluator) != before
    # configs are settings, not code: they are in no hash
    assert not any("configs" in str(p) for p in provenance.code_files("evaluation"))
    assert not any("configs" in str(p) for p in provenance.code_files("training"))


@pytest.mark.parametrize(
    "override, key",
    [
        ("--config.finetune.kinds=('dynamic',)", "config.finetune.kinds"),
        ("--config.finetune.multiple=1", "config.finetune.multiple"),
        ("--config.finetune.steps=0", "config.finetune.steps"),
        ("--config.finetune.learning_rate=0.0", "config.finetune.learning_rate"),
        ("--config.families=('alibi',) --config.rope_scalings=()", "config.finetune"),
    ],
)
def test_bad_finetune_settings_fail_before_compute(tmp_path, capsys, override, key):
    experiment = _experiment()
    assert experiment.main([*override.split(), "--workdir", str(tmp_path)]) == 2
    assert key in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_window_rows_are_checked_before_compute_and_read_the_trained_model_to_L(tmp_path):
    import importlib

    rows_lib = importlib.import_module("length_extrapolation.rows")
    run_lib = importlib.import_module("length_extrapolation.run")  # the package's `run` is run()
    config = config_lib.load_config(ROOT / "configs" / "extrapolation.py", [])
    sha = run_lib.eval_settings_sha(config)
    config.families = ("nope", "rope", "rope:window=16|nope", "learned", "t5:window=32")
    config.window_rows = ("rope", "nope", "rope:window=16|nope")
    experiment.check_experiment(config)
    names = [r.name for r in rows_lib.build_rows(config)]
    assert names[:2] == ["nope", "nope+window"]  # after each entry's own rows
    assert names.index("rope+window") == names.index("rope:window=16|nope") - 1
    assert names.index("rope:window=16|nope+window") == names.index("learned") - 1
    assert "learned+window" not in names and "t5:window=32+window" not in names
    row = next(r for r in rows_lib.build_rows(config) if r.name == "rope+window")
    assert row.kind == "window" and not row.trained and row.settings()["window"] is True
    trained = next(r for r in rows_lib.build_rows(config) if r.name == "rope")
    assert "window" not in trained.settings()  # the trained rows' cache keys are unchanged
    assert row.reads(config, 64) == trained.reads(config, 64)  # at L: one evaluation
    assert row.reads(config, 128).window == 64 and trained.reads(config, 128).window is None
    assert run_lib.eval_settings_sha(config) != sha
    config.window_layers = (1,)  # the layers the window limits: in the key and the hash
    experiment.check_experiment(config)
    row = next(r for r in rows_lib.build_rows(config) if r.name == "rope+window")
    assert row.settings()["window_layers"] == [1] and row.reads(config, 128).window_layers == (1,)
    assert row.reads(config, 64) == trained.reads(config, 64)
    for layers, words in (((2,), ["0 .. 1", "2 layers"]), ((0, 0), ["distinct"])):
        config.window_layers = layers
        with pytest.raises(config_lib.ConfigError) as err:
            experiment.check_experiment(config)
        assert all(w in str(err.value) for w in words), str(err.value)
    config.window_layers = ()
    for rows, words in (
        (("learned",), ["learned", "absolute", "drop it"]),
        (("t5:window=32",), ["already has a window <= L = 64", "drop it"]),
        (("alibi",), ["not an entry of config.families"]),
        (("rope", "rope"), ["repeats"]),
        ((3,), ["tuple of config.families entries"]),
    ):
        config.families = ("nope", "rope", "learned", "t5:window=32")
        config.window_rows = rows
        with pytest.raises(config_lib.ConfigError) as err:
            experiment.check_experiment(config)
        assert all(w in str(err.value) for w in words), str(err.value)
    assert experiment.main(["--config.window_rows=('learned',)", "--workdir", str(tmp_path)]) == 2
    assert experiment.main(["--config.window_layers=(0,)", "--workdir", str(tmp_path)]) == 2
    assert not any(tmp_path.iterdir())
