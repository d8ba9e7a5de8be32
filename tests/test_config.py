"""Configuration: defaults written once, config files, overrides, and every invalid setting
refused before any compute with a clear message."""

import pathlib
import subprocess
import sys
import time

import pytest

from posattn import config as config_lib
from posattn import families
from posattn.config import ConfigError, ModelConfig
from posattn.nn import config as nn_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.py")


def load(*overrides):
    return config_lib.load_config(TINY, [f"--config.{o}" for o in overrides])


def test_overrides_are_typed():
    config = load(
        "model.position=alibi",
        "train.learning_rate=1",
        "model.rope_base=500000",
        "data.seq_len=32.0",
    )
    assert config.model.position == "alibi"
    assert config.train.learning_rate == 1.0 and isinstance(config.train.learning_rate, float)
    assert config.data.seq_len == 32 and isinstance(config.data.seq_len, int)


def test_rope_scaling_dict_literal():
    config = load(
        "model.rope_scaling={'rope_type': 'yarn', 'factor': 4.0, "
        "'original_max_position_embeddings': 64}"
    )
    cfg = config_lib.validate(config)
    assert cfg.settings.scaling_dict == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    }


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["model.position=rotary"], ["model.position", "rotary", "alibi", "kerple_log"]),
        (["model.num_heads=4", "model.num_kv_heads=3"], ["num_kv_heads", "3", "divide"]),
        (["model.d_model=60", "model.num_heads=8"], ["d_model", "60", "divisible"]),
        (
            ["model.d_model=36", "model.num_heads=4", "model.num_kv_heads=4"],
            ["odd head dim", "RoPE"],
        ),
        (["model.num_layers=0"], ["num_layers", "positive"]),
        (["train.batch_size=-2"], ["batch_size", "positive"]),
        (["train.learning_rate=-1.0"], ["learning_rate", "positive"]),
        (["model.position=t5", "model.t5_max_distance=8"], ["t5_max_distance", "8"]),
        (["model.rope_scaling={'rope_type': 'magic', 'factor': 2.0}"], ["rope_scaling", "magic"]),
        (
            ["model.rope_scaling={'rope_type': 'yarn', 'factor': 4.0}"],
            ["original_max_position_embeddings"],
        ),
        (
            ["model.position=alibi", "model.rope_scaling={'rope_type': 'linear', 'factor': 2.0}"],
            ["model.rope_scaling", "position='alibi' does not read it", "'rope'"],
        ),
        (["model.position=learned", "model.max_len=32"], ["max_len", "seq_len"]),
        (["model.dtype=float16"], ["dtype", "bfloat16"]),
        (["train.warmup_steps=5000"], ["warmup_steps", "steps"]),
        (["data.passkey_fraction=1.5"], ["passkey_fraction", "[0, 1]"]),
        (["data.passkey_fraction=0.1", "model.kind=encoder"], ["passkey_fraction", "encoder"]),
        (["data.probe_weight=-2.0"], ["probe_weight", ">= 0"]),
        (["data.induction_span=3"], ["data.induction_span", "at least 4"]),
        (["data.passkey_digits=(0, 5)"], ["data.passkey_digits", "1 <= shortest <= longest"]),
        (["data.passkey_digits=(6, 5)"], ["data.passkey_digits", "(shortest, longest)"]),
        (
            ["data.induction_fraction=0.2", "data.seq_len=32", "data.induction_span=17"],
            ["data.induction_span", "fit twice", "33 bytes"],
        ),
    ],
)
def test_invalid_settings_name_the_key(overrides, words):
    with pytest.raises(ConfigError) as e:
        load(*overrides)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_unknown_key_is_refused_with_a_suggestion():
    with pytest.raises(
        ConfigError, match=r"unknown config key 'model.num_head'.*did you mean num_heads"
    ):
        load("model.num_head=4")
    with pytest.raises(ConfigError, match="unknown config key 'trian.steps'"):
        load("trian.steps=4")


def test_wrong_type_is_refused():
    with pytest.raises(ConfigError, match="model.num_layers.*expects a int"):
        load("model.num_layers=two")


def test_command_line_fails_fast_before_compute(tmp_path):
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "posattn.train",
            "--config",
            TINY,
            "--workdir",
            str(tmp_path / "w"),
            "--config.model.num_kv_heads=3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "num_kv_heads" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "w").exists(), "nothing may be written for an invalid config"
    assert time.monotonic() - start < 60


def test_every_default_is_written_once_in_the_settings_dataclasses():
    """The config defaults are the dataclass defaults: ModelConfig's and each family's."""
    defaults = config_lib.defaults()
    assert ModelConfig.from_keys(defaults.model.to_dict()) == ModelConfig()
    for name in families.names():
        cfg = ModelConfig.from_keys({**defaults.model.to_dict(), "position": name})
        assert cfg.settings == families.get(name).settings()
    assert defaults.model.t5_max_distance == families.T5Settings().max_distance
    assert set(defaults.model.keys()) == set(nn_config.config_keys())


def test_model_config_reads_its_familys_keys_only():
    cfg = config_lib.validate(load("model.position=t5", "model.t5_max_distance=64"))
    assert cfg.settings == families.T5Settings(num_buckets=32, max_distance=64)
    assert cfg.settings.max_distance == 64 and cfg.keys()["t5_max_distance"] == 64
    assert "rope_base" not in cfg.keys()
    # A family's keys are read through `settings` only: no attribute forwarding on the config.
    assert "__getattr__" not in vars(ModelConfig)
    for name in ("t5_max_distance", "rope_base", "max_len"):
        assert not hasattr(cfg, name), name
    assert cfg.max_positions is None
    learned = config_lib.validate(load("model.position=learned", "model.max_len=96"))
    assert learned.max_positions == learned.settings.max_len == 96
    moved = cfg.replace(position="alibi", alibi_slope_scale=0.5, d_model=32)
    assert moved.settings == families.AlibiSettings(slope_scale=0.5) and moved.d_model == 32
    assert hash(moved) == hash(cfg.replace(position="alibi", alibi_slope_scale=0.5, d_model=32))
    with pytest.raises(ConfigError, match=r"config.model.rope_bse.*did you mean rope_base"):
        ModelConfig.from_keys(rope_bse=1.0)


def test_a_config_file_may_leave_keys_out_and_import_its_siblings(tmp_path):
    (tmp_path / "base.py").write_text(
        "import ml_collections\n"
        "def get_config(arg=None):\n"
        "    return ml_collections.ConfigDict({'model': {'position': 'alibi'},\n"
        "        'data': {'seq_len': int(arg or 16)}, 'train': {'steps': 300}})\n"
    )
    (tmp_path / "child.py").write_text(
        "from .base import get_config as base\n"
        "def get_config():\n"
        "    config = base('24')\n"
        "    config.model.d_model = 32\n"
        "    return config\n"
    )
    config = config_lib.load_config(tmp_path / "child.py", ["--config.train.seed=5"])
    assert (config.model.position, config.model.d_model, config.data.seq_len) == ("alibi", 32, 24)
    defaults = config_lib.defaults()
    assert config.train.seed == 5 and config.train.warmup_steps == defaults.train.warmup_steps
    assert config.data.corpus == defaults.data.corpus
    assert config.model.num_heads == defaults.model.num_heads


def test_the_repository_configs_are_plain_modules(monkeypatch):
    import importlib

    monkeypatch.syspath_prepend(str(ROOT))
    sweep_tiny = importlib.import_module("configs.sweep_tiny")
    tiny = importlib.import_module("configs.tiny")
    assert sweep_tiny.get_config().model.to_dict() == tiny.get_config().model.to_dict()
    settings = importlib.import_module("configs.extrapolation_settings")
    for path in sorted((ROOT / "configs").glob("*.py")):
        if path.name == "extrapolation_settings.py":  # needs the family it measures after ':'
            for arg in settings.SETTINGS:
                config_lib.validate(config_lib.load_config(f"{path}:{arg}"))
        elif path.name != "__init__.py":
            config_lib.validate(config_lib.load_config(path))


def test_adding_a_family_is_its_function_its_settings_and_one_registry_entry():
    """A family registered here appears in the defaults, the overrides, validation, the model,
    the sweep's continuous keys and the command-line help, with nothing else edited."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from posattn import cli
    from posattn.nn.model import TransformerLM
    from posattn.sweep import plan

    @dataclasses.dataclass(frozen=True)
    class ShiftSettings(families.Settings):
        prefix = "shift_"
        slope: float = families.setting(
            0.5, help="bias per unit of distance", continuous="a Constant in the state"
        )

        def validate(self, ctx):
            if not 0 < self.slope < 10:
                raise ValueError(f"config.model.shift_slope={self.slope!r} must lie in (0, 10)")

    def init(key, ctx, s):
        return {"slope": jnp.full((ctx.num_heads,), s.slope, jnp.float32)}

    def fn(params, q_pos, k_pos, ctx, s):
        d = jnp.abs(q_pos[:, None] - k_pos[None, :]).astype(jnp.float32)
        return -params["slope"][:, None, None] * d

    families.register(
        families.Family("shift", settings=ShiftSettings, bias=families.BiasSpec(init, fn))
    )
    try:
        assert config_lib.defaults().model.shift_slope == 0.5
        config = load(
            "model.position=shift",
            "model.shift_slope=2.0",
            "model.d_model=16",
            "model.num_layers=1",
        )
        cfg = config_lib.validate(config)
        assert cfg.settings == ShiftSettings(slope=2.0)
        with pytest.raises(ConfigError, match=r"shift_slope=20.0 must lie in \(0, 10\)"):
            load("model.position=shift", "model.shift_slope=20")
        # The model wires it in (abstractly: no compute), with the family's own settings.
        model = nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(params=0)))
        bias = model.blocks[0].attn.bias
        assert bias.fn.settings == ShiftSettings(slope=2.0) and bias.values["slope"].shape == (4,)
        logits = jax.eval_shape(lambda m, t: m(t), model, jnp.zeros((1, 8), jnp.int32))
        assert logits.shape == (1, 8, 256)
        spec = families.get("shift").bias
        bound, params = (
            spec.bind(cfg.context, cfg.settings),
            spec.init(None, cfg.context, cfg.settings),
        )
        np.testing.assert_array_equal(
            bound(params, jnp.arange(3), jnp.arange(3))[0, 2], [-4, -2, 0]
        )
        assert "model.shift_slope" in plan.continuous_keys()
        assert "model.shift_slope = 0.5" in cli.help_text(cli.TRAIN)
    finally:
        del families._REGISTRY["shift"]
    assert "shift" not in families.names()


PLUGIN = """
import dataclasses
import jax.numpy as jnp
from posattn import families


@dataclasses.dataclass(frozen=True)
class PlugSettings(families.Settings):
    prefix = "plug_"
    slope: float = families.setting(0.5, help="bias per unit of distance")

    def validate(self, ctx):
        if not 0 < self.slope < 10:
            raise ValueError(f"config.model.plug_slope={self.slope!r} must lie in (0, 10)")


def init(key, ctx, s):
    return {"slope": jnp.full((ctx.num_heads,), s.slope, jnp.float32)}


def fn(params, q_pos, k_pos, ctx, s):
    d = jnp.abs(q_pos[:, None] - k_pos[None, :]).astype(jnp.float32)
    return -params["slope"][:, None, None] * d


families.register(families.Family("plug", settings=PlugSettings, bias=families.BiasSpec(init, fn)))
"""


def test_a_family_registered_outside_the_package_works_in_train_generate_and_eval(tmp_path):
    """`plugins` names the user's module; config.json keeps it, so generate and the evaluation
    find the family."""
    (tmp_path / "user_families.py").write_text(PLUGIN)
    env = dict(
        __import__("os").environ,
        PYTHONPATH=f"{tmp_path}{__import__('os').pathsep}{ROOT / 'src'}",
        JAX_PLATFORMS="cpu",
    )
    workdir = tmp_path / "run"
    small = [
        "--config.model.d_model=16",
        "--config.model.num_layers=1",
        "--config.data.seq_len=16",
        "--config.train.steps=2",
        "--config.train.batch_size=2",
        "--config.train.warmup_steps=1",
        "--config.train.eval_every=0",
    ]
    train = [sys.executable, "-m", "posattn.train", "--config", TINY, "--workdir", str(workdir)]
    plugin = ["--config.plugins=('user_families',)", "--config.model.position=plug"]
    done = subprocess.run(
        train + plugin + ["--config.model.plug_slope=0.25"] + small,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    saved = __import__("json").loads((workdir / "config.json").read_text())
    assert saved["plugins"] == ["user_families"] and saved["model"]["plug_slope"] == 0.25
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "posattn.generate",
            "--workdir",
            str(workdir),
            "--prompt",
            "de",
            "--max_new_tokens",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    evaluate = [sys.executable, "-m", "posattn.eval", "--workdir", str(workdir), "--lengths", "16"]
    done = subprocess.run(evaluate, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert list((workdir / "eval").glob("*.json"))


def test_plugins_that_cannot_be_imported_are_refused_naming_the_module():
    with pytest.raises(ConfigError, match="config.plugins names module 'no_such_mod'"):
        load("plugins=('no_such_mod',)")
    with pytest.raises(ConfigError, match="must be a tuple of module names"):
        config_lib.import_plugins((3,))
