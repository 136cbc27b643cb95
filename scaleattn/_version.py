"""The package version: the one place it is written; modules import it from here, never from the
package root. Also when this process began importing scaleattn (the package root imports this module before any
other but :mod:`._startup`), where the ``scaleattn`` command's clock starts."""
import time

__version__ = "0.1.0"

#: ``time.perf_counter()`` when this process began importing scaleattn: before numpy, dask and the rest
IMPORT_STARTED = time.perf_counter()
