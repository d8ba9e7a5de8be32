"""`python -m posattn.train --config configs/<name>.py --workdir DIR
[--config.<key>=<value> ...]`."""

import logging
import sys

from posattn.train.loop import main

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
