"""Training: the step (`steps`), the one loop (`loop`), and what a run needs around it (`data`,
`sharding`, `checkpoint`, `workdir`). `python -m posattn.train` is `posattn.train.main`."""

from posattn.train.checkpoint import IncompatibleCheckpointError
from posattn.train.loop import (
    NonFiniteLossError,
    main,
    restore_for_resume,
    restore_trained,
    train_and_evaluate,
)
from posattn.train.workdir import WorkdirBusyError

__all__ = [
    "IncompatibleCheckpointError",
    "NonFiniteLossError",
    "WorkdirBusyError",
    "main",
    "restore_for_resume",
    "restore_trained",
    "train_and_evaluate",
]
