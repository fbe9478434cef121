"""``python -m amprewrite``: the command line (see :mod:`amprewrite.cli`)."""

import sys

from .cli import main

sys.exit(main())
