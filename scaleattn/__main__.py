"""``python -m scaleattn``: the ``scaleattn`` command (as ``python -m scaleattn.cli``), for an environment whose
console script is not on PATH or belongs to another install."""
import sys

from .cli import main

sys.exit(main())
