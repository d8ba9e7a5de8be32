"""`python -m posattn.eval`: the command lives in `posattn.evaluate`, an entry point beside
`posattn.generate` (it restores checkpoints through `posattn.train`; nothing in `eval/` does)."""

import sys

from posattn import hostmem

if __name__ == "__main__":
    hostmem.reexec_with_malloc_tunables()  # first, before JAX starts (posattn.hostmem)
    from posattn.evaluate import main

    sys.exit(main())
