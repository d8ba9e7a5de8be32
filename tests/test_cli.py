"""The one command-line parser: flags, config overrides, --help on every entry point, and bad
command lines refused with the usage (exit status 2), never a traceback."""

import importlib.util
import subprocess
import sys

import pytest
from conftest import ROOT

from posattn import cli, generate
from posattn import sweep as sweep_lib
from posattn import train as train_lib
from posattn.config import ConfigError

TINY = str(ROOT / "configs" / "tiny.py")

COMMAND = cli.Command(
    "prog",
    "A command for the tests.",
    flags=(
        cli.WORKDIR,
        cli.Flag("steps", "how many", 3, int, metavar="N"),
        cli.Flag("mode", "which", "a", choices=("a", "b")),
        cli.Flag("dry", "do nothing", False, bool),
    ),
    takes_config=False,
)


def _experiment():
    spec = importlib.util.spec_from_file_location(
        "length_extrapolation_cli", ROOT / "experiments" / "length_extrapolation.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flags_take_both_spellings_defaults_and_switches():
    args = cli.parse(COMMAND, ["--workdir", "w", "--steps=5", "--dry"])
    assert (args.workdir, args.steps, args.mode, args.dry) == ("w", 5, "a", True)
    args = cli.parse(COMMAND, ["--workdir=w", "--mode", "b", "--dry=false"])
    assert (args.steps, args.mode, args.dry) == (3, "b", False)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--steps", "5"], ["--workdir is required", "usage: prog --workdir DIR"]),
        (["--workdir", "w", "--bogus", "1"], ["unknown flag --bogus"]),
        (["--workdir", "w", "--steps", "five"], ["--steps='five' is not a valid int"]),
        (["--workdir", "w", "--mode", "c"], ["--mode='c' is not allowed", "'a', 'b'"]),
        (["--workdir", "w", "stray"], ["unexpected argument 'stray'"]),
        (["--workdir"], ["--workdir needs a value (DIR)"]),
        (["--workdir", "w", "--config.model.d_model=8"], ["unknown flag --config.model.d_model"]),
    ],
)
def test_bad_command_lines_show_the_usage(argv, words):
    with pytest.raises(cli.UsageError) as e:
        cli.parse(COMMAND, argv)
    assert isinstance(e.value, ConfigError)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_config_commands_load_validate_and_keep_the_overrides():
    argv = ["--config", TINY, "--config.model.position", "alibi", "--workdir", "w"]
    args = cli.parse(cli.TRAIN, argv + ["--config.train.seed=3"])
    assert args.config.model.position == "alibi" and args.config.train.seed == 3
    assert args.overrides == ["--config.model.position=alibi", "--config.train.seed=3"]
    assert (args.config_path, args.workdir) == (TINY, "w")
    with pytest.raises(cli.UsageError, match="--config is required"):
        cli.parse(cli.TRAIN, ["--workdir", "w"])
    with pytest.raises(ConfigError, match="num_kv_heads"):
        cli.parse(cli.TRAIN, argv + ["--config.model.num_kv_heads=3"])


@pytest.mark.parametrize(
    "main, extra, words",
    [
        (train_lib.main, [], ["usage: python -m posattn.train", "model.position = 'rope'"]),
        (
            train_lib.main,
            ["--config", TINY, "--config.model.position=t5"],
            ["model.d_model = 64", "model.position = 't5'", "[t5]", "train.steps = 200"],
        ),
        (sweep_lib.main, [], ["usage: python -m posattn.sweep", "train.learning_rate = 0.001"]),
        (generate.main, [], ["usage: python -m posattn.generate", "--max_new_tokens N", "200"]),
        (None, [], ["usage: python experiments/length_extrapolation.py", "train.steps = 2000"]),
    ],
)
def test_help_prints_the_usage_and_the_config_keys_with_defaults(main, extra, words, capsys):
    main = main or _experiment().main
    with pytest.raises(SystemExit) as e:
        main(["--help", *extra])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for word in words:
        assert word in out, (word, out)


def test_help_from_the_command_line_of_a_fresh_interpreter():
    proc = subprocess.run(
        [sys.executable, "-m", "posattn.train", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--workdir DIR" in proc.stdout and "model.t5_max_distance = 128" in proc.stdout


def test_entry_points_report_usage_errors_with_status_2(tmp_path, capsys):
    assert train_lib.main(["--config", TINY, "--workdir", str(tmp_path), "--bogus"]) == 2
    assert "unknown flag --bogus" in capsys.readouterr().err
    assert generate.main(["--workdir", str(tmp_path)]) == 2
    assert "--prompt is required" in capsys.readouterr().err
    assert _experiment().main(["--workdir", str(tmp_path), "--nope"]) == 2
    assert "unknown flag --nope" in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing may be written for a bad command line"
