"""The length-extrapolation experiment's command (the code: the `length_extrapolation/` package
beside this file).

    python experiments/length_extrapolation.py --workdir runs/extrapolation
"""

import pathlib
import sys

from posattn import hostmem

if __name__ == "__main__":
    hostmem.reexec_with_malloc_tunables()  # first, before JAX starts (posattn.hostmem)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from length_extrapolation import *  # noqa: E402,F403
from length_extrapolation import __all__  # noqa: E402,F401
from length_extrapolation.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
