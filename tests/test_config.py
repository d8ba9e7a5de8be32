"""Configuration: overrides, and every invalid setting refused before any compute with a clear message."""

import pathlib
import subprocess
import sys
import time

import pytest

from posattn import config as config_lib
from posattn.config import ConfigError

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
        "model.rope_scaling={'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 64}"
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
