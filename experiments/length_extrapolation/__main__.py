"""`python -m length_extrapolation` (from experiments/) runs the experiment's command line."""

import sys

from length_extrapolation.main import main

sys.exit(main())
