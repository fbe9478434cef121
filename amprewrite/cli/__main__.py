"""``python -m amprewrite.cli``: the ``amprewrite`` command."""

from .main import main

main()
