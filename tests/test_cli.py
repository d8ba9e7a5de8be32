"""The one command-line parser: flags, config overrides, --help on every entry point, and bad
command lines refused with the usage (exit status 2), never a traceback."""

import errno
import importlib.util
import json
import subprocess
import sys

import pytest
from conftest import ROOT, SMALL_OVERRIDES

from posattn import cli, evaluate, generate
from posattn import sweep as sweep_lib
from posattn import train as train_lib
from posattn.config import ConfigError
from posattn.data import DataError

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
    missing = ["--workdir", str(tmp_path), f"--config.data.corpus={tmp_path / 'none'}"]
    assert _experiment().main(missing) == 2
    assert "length_extrapolation: error: data.corpus=" in capsys.readouterr().err
    with pytest.raises(DataError, match="no such file"):  # --debug: the traceback
        _experiment().main([*missing, "--debug"])
    assert evaluate.main(["--workdir", str(tmp_path), "--nope"]) == 2
    assert "unknown flag --nope" in capsys.readouterr().err
    assert evaluate.main(["--workdir", str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="has no config.json"):  # --debug: the traceback
        evaluate.main(["--workdir", str(tmp_path), "--debug"])
    assert not any(tmp_path.iterdir()), "nothing may be written for a bad command line"


def _config_file(tmp_path, text):
    path = tmp_path / "cfg.py"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "argv, status, words",
    [
        (lambda t: ["--config", _config_file(t, "def get_config(:\n")], 2, ["line 1", "syntax"]),
        (
            lambda t: ["--config", _config_file(t, "def get_config():\n    return None\n")],
            2,
            ["returned NoneType"],
        ),
        (
            lambda t: ["--config", _config_file(t, "def get_config():\n    return nope\n")],
            2,
            ["line 2", "NameError"],
        ),
        (lambda t: ["--config", TINY + ":5"], 2, ["get_config()", "'5'"]),
        (lambda t: ["--config", TINY, "--config.train.seed=" + str(2**70)], 2, ["train.seed"]),
        (lambda t: ["--config", TINY, "--config.train.b2=1.0"], 2, ["train.b2", "[0.0, 1.0)"]),
    ],
    ids=["syntax", "none", "name_error", "arg", "seed", "b2"],
)
@pytest.mark.parametrize("main", [train_lib.main, sweep_lib.main], ids=["train", "sweep"])
def test_config_mistakes_are_one_line(tmp_path, capsys, main, argv, status, words):
    workdir = tmp_path / "w"
    assert main([*argv(tmp_path), "--workdir", str(workdir)]) == status
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
    assert not workdir.exists()


def test_workdir_and_file_system_errors_are_one_line(tmp_path, capsys, monkeypatch):
    from posattn.train import checkpoint as checkpoint_lib

    afile = tmp_path / "afile"
    afile.write_text("")
    small = [f"--config.{o}" for o in SMALL_OVERRIDES]
    assert train_lib.main(["--config", TINY, "--workdir", str(afile), *small]) == 2
    assert "is a file" in capsys.readouterr().err
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "config.json").write_text("{not json")
    assert train_lib.main(["--config", TINY, "--workdir", str(damaged), *small]) == 2
    assert "config.json is damaged" in capsys.readouterr().err
    assert generate.main(["--workdir", str(damaged), "--prompt", "x"]) == 2
    assert "config.json is damaged" in capsys.readouterr().err
    assert generate.main(["--hf", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert "has no config.json (a Hugging Face checkpoint directory)" in capsys.readouterr().err
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    gpt2 = {"n_embd": 8, "n_head": 2, "n_layer": 1, "n_positions": 16, "vocab_size": 256}
    (no_weights / "config.json").write_text(json.dumps({"model_type": "gpt2", **gpt2}))
    assert generate.main(["--hf", str(no_weights), "--prompt", "x"]) == 2
    assert capsys.readouterr().err.count("has neither model.safetensors") == 1

    def full(self, step, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.directory / str(step)))

    monkeypatch.setattr(checkpoint_lib.Checkpointer, "save", full)
    argv = ["--config", TINY, "--workdir", str(tmp_path / "full"), *small]
    assert train_lib.main([*argv, "--config.train.steps=2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no space left on device writing" in err, err
    with pytest.raises(OSError, match="No space left"):  # --debug: the traceback
        train_lib.main([*argv, "--config.train.steps=2", "--debug"])
