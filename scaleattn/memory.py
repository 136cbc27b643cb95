"""Deprecated import path (compatibility layer, imported by nothing in the package): memory estimates now live
in :mod:`scaleattn.distributed.memory`."""
from .distributed.memory import (  # noqa: F401
    InsufficientMemoryError,
    available_memory,
    check_fit_memory,
    fit_memory,
    parse_bytes,
)

__all__ = ["InsufficientMemoryError", "available_memory", "check_fit_memory", "fit_memory", "parse_bytes"]
