"""`python -m posattn.eval`: the command lives in `posattn.evaluate`, an entry point beside
`posattn.generate` (it restores checkpoints through `posattn.train`; nothing in `eval/` does)."""

import sys

from posattn.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
