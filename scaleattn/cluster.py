"""Deprecated import path (compatibility layer, imported by nothing in the package): Dask clusters now live in
:mod:`scaleattn.distributed.cluster`."""
from .distributed.cluster import connect, default_workers, tls_security  # noqa: F401

__all__ = ["connect", "default_workers", "tls_security"]
