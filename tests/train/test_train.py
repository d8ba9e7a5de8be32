"""Training: the encoder trains; exact resumption; metrics, MFU and profiles; the schedule.
(Loss falling for every family: test_train_families.py; 1 and 8 devices and 2 processes:
test_train_devices.py. Three modules, so that xdist's loadscope spreads them over workers.)"""

import json

import numpy as np
import pytest
from conftest import losses, read_metrics, small_config

from posattn.train import train_and_evaluate


def test_encoder_with_bidirectional_t5_trains(tmp_path):
    config = small_config(
        model__position="t5",
        model__kind="encoder",
        train__steps=30,
        train__learning_rate=3e-3,
        train__eval_every=30,
    )
    result = train_and_evaluate(config, tmp_path)
    values = losses(tmp_path)
    assert np.mean(values[-5:]) < np.mean(values[:5]) - 0.3
    assert np.isfinite(result["eval_loss"])


def test_metrics_file_schema_step_time_mfu_and_profile(tmp_path):
    config = small_config(
        train__steps=10, train__eval_every=5, train__profile_steps=(3, 2), train__peak_flops=1e12
    )
    train_and_evaluate(config, tmp_path)
    train_lines, eval_lines = read_metrics(tmp_path)
    assert [x["step"] for x in train_lines] == list(range(1, 11))
    for line in train_lines:
        assert {
            "step",
            "loss",
            "grad_norm",
            "param_norm",
            "learning_rate",
            "tokens_per_sec",
            "step_time",
            "mfu",
        } <= set(line)
        assert line["step_time"] > 0
        # tokens/s is the batch's tokens over the step time; MFU the compiled step's FLOPs over
        # the step time and the given peak (1e12 FLOP/s): positive, and below 1 on a CPU.
        assert line["tokens_per_sec"] == pytest.approx(8 * 32 / line["step_time"], rel=1e-6)
        assert 0 < line["mfu"] < 1
    assert [x["step"] for x in eval_lines] == [5, 10]
    assert all("loss" not in x and x["eval_loss"] > 0 for x in eval_lines)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model"]["position"] == "rope"
    traces = list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0


def test_mfu_is_null_where_the_peak_is_unknown_and_the_table_knows_accelerators():
    from posattn.train import loop

    on_this_cpu = loop._timing(0.5, 1000, flops=2e9, peak_flops=None)
    assert on_this_cpu == {"step_time": 0.5, "tokens_per_sec": 2000.0, "mfu": None}
    assert loop._timing(0.5, 1000, flops=2e9, peak_flops=1e10)["mfu"] == pytest.approx(0.4)
    assert loop._timing(0.5, 1000, flops=None, peak_flops=1e10)["mfu"] is None
    assert loop.device_peak_flops("cpu") is None
    assert loop.device_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert loop.device_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert loop.device_peak_flops("NVIDIA H200") == 989e12
    assert loop.device_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert loop.device_peak_flops("TPU v4") == 275e12
    assert loop.device_peak_flops("TPU v5 lite") == 197e12
    assert loop.device_peak_flops("TPU v5p") == 459e12
    assert loop.device_peak_flops("TPU v6 lite") == 918e12


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"train__profile_steps": (9, 3)}, r"train.profile_steps=\(9, 3\).*past the last step"),
        ({"train__profile_steps": (0, 2)}, r"train.profile_steps.*\(first, count\)"),
        ({"train__peak_flops": -1.0}, "train.peak_flops"),
        ({"train__fsdp": 3}, r"train.fsdp=3 must divide .*allowed: 1"),
    ],
)
def test_bad_observability_and_mesh_settings_fail_before_any_compute(tmp_path, overrides, match):
    from posattn.config import ConfigError

    with pytest.raises(ConfigError, match=match):
        train_and_evaluate(small_config(train__steps=10, **overrides), tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("position", ["kerple_power", "t5"])
def test_resume_gives_exactly_the_uninterrupted_losses(tmp_path, position):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    config = small_config(model__position=position, train__steps=20, train__checkpoint_every=5)
    train_and_evaluate(config, straight)
    first = train_and_evaluate(
        config, interrupted, stop_after=12
    )  # a checkpoint at 12, lines to 12
    assert not first["finished"] and first["step"] == 12
    train_and_evaluate(config, interrupted)  # resumes from 12
    assert losses(interrupted) == losses(
        straight
    )  # bitwise: batches and state are restored exactly


def test_resuming_with_another_config_is_refused(tmp_path):
    from posattn.config import ConfigError

    train_and_evaluate(small_config(train__steps=5), tmp_path)
    with pytest.raises(ConfigError, match="model.position"):
        train_and_evaluate(small_config(train__steps=5, model__position="alibi"), tmp_path)


def test_the_schedule_evaluates_and_agrees_on_sigterm_at_the_steps_it_says():
    from posattn.train.loop import Schedule

    run = Schedule(total=20, log_every=5, checkpoint_every=8, eval_every=6)
    assert [s for s in range(1, 21) if run.evaluates(s)] == [6, 12, 18, 20]
    assert [s for s in range(1, 21) if run.agrees(s)] == [5, 8, 10, 15, 16, 20]
    sweep = Schedule(total=20, log_every=5, checkpoint_every=8, eval_at_end=True)
    assert [s for s in range(1, 21) if sweep.evaluates(s)] == [20]
    config = small_config(train__profile_steps=(3, 2), train__eval_every=4)
    assert Schedule.from_config(config.train, stop_after=7) == Schedule(
        total=20, log_every=5, checkpoint_every=10, eval_every=4, stop_after=7, profile_steps=(3, 2)
    )
