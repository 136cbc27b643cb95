"""``python -m scaleattn.cli``: the ``scaleattn`` command."""
import sys

from . import main

sys.exit(main())
