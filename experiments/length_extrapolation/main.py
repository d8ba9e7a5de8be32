"""The command line: `python experiments/length_extrapolation.py --workdir W [--reuse]`."""

from __future__ import annotations

import sys

from posattn import cli
from posattn import config as config_lib
from posattn import data as data_lib
from posattn.train import NonFiniteLossError, WorkdirBusyError

from . import pretrained
from .provenance import ROOT, ProducedByOtherCode
from .run import run
from .training import Interrupted

__all__ = ["COMMAND", "DEFAULT_CONFIG", "main"]

DEFAULT_CONFIG = ROOT / "configs" / "extrapolation.py"
COMMAND = cli.Command(
    "python experiments/length_extrapolation.py",
    "Trains every family at length L and evaluates it at multiples of L: results.json, "
    "results.md and plots in the workdir (a rerun reuses the trained families).",
    default_config=DEFAULT_CONFIG,
    flags=(
        cli.WORKDIR,
        cli.Flag(
            "reuse",
            "report finished runs and evaluations made by other code (or on another corpus); "
            "results.json then lists each row's own commit",
            False,
            bool,
        ),
    ),
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = cli.parse(COMMAND, argv)
        # A config with pretrained.path set evaluates that checkpoint's rows (pretrained.py).
        runner = pretrained.run if pretrained.enabled(args.config) else run
        runner(args.config, args.workdir, reuse=args.reuse)
    except (config_lib.ConfigError, data_lib.DataError) as e:
        print(f"length_extrapolation: error: {e}", file=sys.stderr)
        return 2
    except (Interrupted, WorkdirBusyError, NonFiniteLossError, ProducedByOtherCode) as e:
        print(f"length_extrapolation: {e}", file=sys.stderr)
        return 1
    return 0
