"""The command line: `python experiments/length_extrapolation.py --workdir W [--reuse]`."""

from __future__ import annotations

import sys

from posattn import cli
from posattn import data as data_lib
from posattn.train import NonFiniteLossError, WorkdirBusyError

from . import pretrained
from .provenance import ROOT, ProducedByOtherCode
from .run import run
from .training import Interrupted
from .workers import WorkerDied

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

    def body() -> int:
        args = cli.parse(COMMAND, argv)
        # A config with pretrained.path set evaluates that checkpoint's rows (pretrained.py).
        runner = pretrained.run if pretrained.enabled(args.config) else run
        runner(args.config, args.workdir, reuse=args.reuse)
        return 0

    return cli.report_errors(
        "length_extrapolation",
        argv,
        body,
        user_errors=(data_lib.DataError,),
        run_errors=(
            Interrupted,
            WorkerDied,
            WorkdirBusyError,
            NonFiniteLossError,
            ProducedByOtherCode,
        ),
    )
