"""`python -m posattn.sweep --config configs/<sweep>.py --workdir DIR
[--config.<key>=<value> ...]`."""

import logging
import sys

from posattn import hostmem

if __name__ == "__main__":
    hostmem.reexec_with_malloc_tunables()  # first, before JAX starts (posattn.hostmem)
    from posattn.sweep.run import main

    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
