"""`python -m posattn.train --config configs/<name>.py --workdir DIR
[--config.<key>=<value> ...]`."""

import logging
import sys

from posattn import hostmem

if __name__ == "__main__":
    hostmem.reexec_with_malloc_tunables()  # first, before JAX starts (posattn.hostmem)
    from posattn.train.loop import main

    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
