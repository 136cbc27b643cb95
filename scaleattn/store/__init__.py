"""Where data lives and how it is kept safe: locations (local paths and URLs), output names, on-disk formats,
integrity manifests, locks, and outputs written atomically beside (never over) their inputs.

The rest of the package reads and writes stores only through these modules: a path is resolved once into a
:class:`Location`, checked against every input before anything is written (:func:`check_output_location`),
held by a lock while it is used (:func:`hold`, :func:`reading`), and written by :func:`atomic_output`.
"""
from ._location import Location, resolve
from ._locks import hold, reading
from ._outputs import atomic_output, check_output_location

__all__ = ["Location", "resolve", "atomic_output", "check_output_location", "hold", "reading"]
