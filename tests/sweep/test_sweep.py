"""vmap sweeps: member k equals its single run; 8 devices equal one; resumption; refusals."""

import json
import os

import jax
import ml_collections
import numpy as np
import pytest
from conftest import ROOT, losses, run_python

from posattn import config as config_lib
from posattn import sweep
from posattn.sweep import plan as sweep_plan
from posattn.train import train_and_evaluate

# The shrink of conftest.small_config (one layer: compilation dominates these tests), on the
# sweep file.
_SMALL = [
    "model.d_model=32",
    "model.num_layers=1",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "data.seq_len=32",
    "train.batch_size=8",
    "train.warmup_steps=2",
    "train.log_every=5",
]


def sweep_config_with(programs=None, *, discrete=None, continuous=None, combine="grid", extra=()):
    config = config_lib.load_config(ROOT / "configs" / "sweep_tiny.py", _SMALL + list(extra))
    config.sweep.discrete = ml_collections.ConfigDict(discrete or {})
    config.sweep.continuous = ml_collections.ConfigDict(continuous or {})
    config.sweep.combine = combine
    if programs is not None:
        config.sweep.programs = programs
    return config


def member_losses(workdir, program, member):
    lines = [
        json.loads(x)
        for x in (workdir / "programs" / f"p{program}" / "metrics.jsonl").read_text().splitlines()
    ]
    return [x["loss"] for x in lines if x["member"] == member and "loss" in x]


def test_member_equals_its_single_run_and_the_sweep_resumes(tmp_path):
    programs = (
        {
            "set": {"model.position": "rope"},
            "continuous": {
                "train.seed": (0, 1),
                "model.rope_base": (10000.0, 500.0),
                "train.learning_rate": (3e-3, 1e-3),
            },
        },
        {
            "set": {"model.position": "alibi"},
            "continuous": {
                "train.seed": (0, 2),
                "model.alibi_slope_scale": (1.0, 0.25),
                "train.b2": (0.95, 0.9),
            },
        },
    )
    extra = ["train.steps=10", "train.checkpoint_every=5", "train.eval_every=10"]
    config = sweep_config_with(programs, combine="zip", extra=extra)
    workdir = tmp_path / "sweep"
    assert sweep.run_sweep(config, workdir, stop_after=6) == []  # preempted inside program 0
    assert not json.loads((workdir / "sweep.json").read_text())["complete"]
    records = sweep.run_sweep(config, workdir)  # resumes program 0 from step 6, then runs program 1
    summary = json.loads((workdir / "sweep.json").read_text())
    assert summary["complete"] and [r["member"] for r in summary["members"]] == [0, 1, 2, 3]
    assert (workdir / "sweep.md").exists() and (workdir / "sweep.png").exists()

    # Member 1 of each program is the interesting one: the program's graphdef is member 0's.
    for record in (records[1], records[3]):
        assert "--config.train.seed=" in summary["members"][record["member"]]["command"]
        strings = [sweep_plan.format_override(k, v) for k, v in record["overrides"].items()]
        single = config_lib.load_config(
            ROOT / "configs" / "sweep_tiny.py", _SMALL + extra + strings
        )
        result = train_and_evaluate(single, tmp_path / f"single{record['member']}")
        ours = member_losses(workdir, record["program"], record["member"])
        assert len(ours) == 10
        np.testing.assert_allclose(
            ours, losses(tmp_path / f"single{record['member']}"), rtol=2e-5, atol=2e-5
        )
        assert record["final_train_loss"] == pytest.approx(result["loss"], rel=2e-5)
        assert record["eval_loss"] == pytest.approx(result["eval_loss"], rel=2e-5)
    # The swept values really differ (a sweep that ignored them would match member 0 instead).
    assert not np.allclose(member_losses(workdir, 0, 0), member_losses(workdir, 0, 1))


# Four members: on 8 devices the sweep axis takes 4 and each member's batch is split over 2.
_CONTINUOUS = {
    "train": {"seed": (0, 1, 2, 3), "learning_rate": (1e-3, 3e-3, 2e-3, 1e-3)},
    "model": {"init_scale": (1.0, 1.0, 1.0, 1e30)},
}  # member 3 overflows at step 1


def device_sweep(workdir: str) -> dict:
    config = sweep_config_with(
        continuous=_CONTINUOUS, combine="zip", extra=["train.steps=6", "train.checkpoint_every=6"]
    )
    records = sweep.run_sweep(config, workdir)
    lines = [json.loads(x) for x in open(f"{workdir}/programs/p0/metrics.jsonl")]
    return {
        "mesh": dict(sweep.sweep_mesh(4, config.train).shape),
        "records": records,
        "lines": lines,
        "devices": jax.device_count(),
    }


def test_eight_devices_equal_one_and_a_diverged_member_is_frozen(tmp_path):
    code = (
        "import json; from test_sweep import device_sweep; "
        f"print('RESULT', json.dumps(device_sweep({str(tmp_path / 'd8')!r})))"
    )
    here = os.pathsep.join([str(ROOT / "tests" / "sweep"), str(ROOT / "tests")])
    env = {"PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")}
    results = {8: json.loads(run_python(code, devices=8, env=env).split("RESULT ", 1)[1])}
    if jax.device_count() == 1:  # this process: no second interpreter to start
        results[1] = json.loads(json.dumps(device_sweep(str(tmp_path / "d1"))))
    else:
        code = code.replace("d8", "d1")
        results[1] = json.loads(run_python(code, devices=1, env=env).split("RESULT ", 1)[1])
    assert results[8]["devices"] == 8 and results[1]["devices"] == 1
    assert (
        results[8]["mesh"] == {"sweep": 4, "data": 2, "fsdp": 1}
        and results[1]["mesh"]["sweep"] == 1
    )
    by_devices = {
        d: {(x["member"], x["step"]): x for x in r["lines"] if "loss" in x}
        for d, r in results.items()
    }
    assert by_devices[8].keys() == by_devices[1].keys()
    for key, line in by_devices[1].items():
        if line["loss"] is not None:
            assert by_devices[8][key]["loss"] == pytest.approx(line["loss"], rel=1e-5), key
    for r8, r1 in zip(results[8]["records"], results[1]["records"], strict=True):
        if r1["final_train_loss"] is not None:
            assert r8["final_train_loss"] == pytest.approx(r1["final_train_loss"], rel=1e-5)
            assert r8["eval_loss"] == pytest.approx(r1["eval_loss"], rel=1e-5)
    diverged = results[8]["records"][3]
    assert diverged["diverged_at_step"] == 1 and diverged["final_train_loss"] is None
    assert [r["diverged_at_step"] for r in results[8]["records"][:3]] == [None] * 3
    assert all(np.isfinite(r["final_train_loss"]) for r in results[8]["records"][:3])
    assert not any(k[0] == 3 and k[1] > 1 for k in by_devices[8])  # no lines after it diverged


@pytest.mark.parametrize(
    "continuous, match",
    [
        ({"model": {"rope_bse": (1e3, 1e4)}}, "rope_bse"),
        (
            {"model": {"num_heads": (2, 4)}},
            "model.num_heads cannot be swept inside one compiled program",
        ),
        (
            {"model": {"rope_scaling": (None, {"rope_type": "linear", "factor": 2.0})}},
            "model.rope_scaling",
        ),
        ({"train": {"learning_rate": (1e-3, -1.0)}}, "sweep member 1 .*train.learning_rate"),
    ],
)
def test_bad_sweeps_fail_before_compute_naming_the_key(continuous, match):
    with pytest.raises(config_lib.ConfigError, match=match):
        sweep_plan.plan(sweep_config_with(continuous=continuous))


def test_a_member_the_model_refuses_fails_before_any_program_starts(tmp_path):
    # The second program's member 3 has a RoPE base the frequency function refuses (it must be > 1).
    config = sweep_config_with(
        discrete={"model": {"position": ("alibi", "rope")}},
        continuous={"model": {"rope_base": (1e4, 0.5)}},
    )
    with pytest.raises(config_lib.ConfigError, match=r"sweep member 3 .*base = 0.5"):
        sweep.run_sweep(config, tmp_path / "sweep")
    assert not (tmp_path / "sweep").exists()  # refused before the workdir was made


def test_rope_base_with_dynamic_scaling_is_refused_and_zip_lengths_must_agree():
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 32}
    config = sweep_config_with(
        continuous={"model": {"rope_base": (1e3, 1e4)}}, extra=[f"model.rope_scaling={dynamic!r}"]
    )
    with pytest.raises(config_lib.ConfigError, match="dynamic"):
        sweep_plan.plan(config)
    config = sweep_config_with(
        continuous={"train": {"seed": (0, 1), "learning_rate": (1e-3,)}}, combine="zip"
    )
    with pytest.raises(config_lib.ConfigError, match="same length"):
        sweep_plan.plan(config)


def test_plan_expands_the_grid_and_overrides_round_trip():
    config = sweep_config_with(
        discrete={"model": {"position": ("rope", "alibi"), "num_layers": (1, 2)}},
        continuous={"train": {"seed": (0, 1, 2)}},
        extra=["train.steps=7"],
    )
    programs = sweep_plan.plan(
        config, cli_overrides=["--config.train.steps=7"]
    )  # as the CLI applied it
    assert len(programs) == 4 and [len(p.members) for p in programs] == [3] * 4
    member = programs[3].members[2]
    assert member.index == 11 and member.config.train.steps == 7 and member.config.train.seed == 2
    assert member.overrides == {
        "train.steps": 7,
        "model.num_layers": 2,
        "model.position": "alibi",
        "train.seed": 2,
    }
    strings = [sweep_plan.format_override(k, v) for k, v in member.overrides.items()]
    assert config_lib.apply_overrides(config, strings).to_dict() == member.config.to_dict()
    assert sweep_plan.format_override("data.corpus", "1e3") == "--config.data.corpus='1e3'"


def test_cli_reports_config_errors_with_exit_code_2(tmp_path, capsys):
    code = sweep.main(
        [
            "--config",
            str(ROOT / "configs" / "sweep_tiny.py"),
            "--workdir",
            str(tmp_path),
            "--config.sweep.combine=diagonal",
        ]
    )
    assert code == 2 and "config.sweep.combine='diagonal'" in capsys.readouterr().err


def test_extrapolation_scores_the_experiments_text_checked_before_compute():
    """`sweep.eval_lengths` reads the chunks the length-extrapolation experiment reads with the
    same `eval.max_tokens` and seed (its sliding blocks are drawn after them), and a length no
    held-out file can hold fails before any training."""
    from posattn import data
    from posattn.eval import heldout
    from posattn.sweep import run as sweep_run

    corpus = data.load_corpus("stdlib")
    config = ml_collections.ConfigDict({"sweep": {"eval_max_tokens": 512}})
    text = sweep_run._eval_text(corpus, (64, 128), config)
    experiment = heldout.eval_text(
        corpus, lengths=[64, 128], max_tokens=512, sliding_tokens=4096, stride=64, seed=1234
    )
    np.testing.assert_array_equal(text.plan.chunk_starts, experiment.plan.chunk_starts)
    assert text.plan.block_ends.size == 0 and experiment.plan.block_ends.size > 0
    with pytest.raises(config_lib.ConfigError, match="eval_lengths"):
        sweep_run._eval_text(corpus, (64, 10**7), config)
