"""Deprecated import path (compatibility layer, imported by nothing in the package): the main job now lives
in :mod:`scaleattn.pipeline`, its report text in :mod:`scaleattn.report`."""
from ._params import heads_spec as parse_heads  # noqa: F401
from .model import model_from_statistics, recover_heads  # noqa: F401
from .pipeline import FitResult, certify_dataset, fit  # noqa: F401
from .preflight import preflight  # noqa: F401
from .report import fit_summary as format_report  # noqa: F401

__all__ = ["FitResult", "certify_dataset", "fit", "preflight", "model_from_statistics", "recover_heads",
           "parse_heads", "format_report"]
