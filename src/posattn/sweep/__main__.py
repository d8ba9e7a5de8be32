"""`python -m posattn.sweep --config configs/<sweep>.py --workdir DIR
[--config.<key>=<value> ...]`."""

import logging
import sys

from posattn.sweep.run import main

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
