"""Datasets: a validated, read-only handle on a Zarr group of token sequences and targets (:class:`Dataset`,
:func:`open_dataset`), the checks every array passes before a feature is computed, and the writer of new
datasets (:func:`write_dataset`). Layout: DESIGN §5."""
from ._checks import check_arrays
from ._dataset import Dataset, open_dataset
from ._writer import write_dataset

__all__ = ["Dataset", "open_dataset", "write_dataset", "check_arrays"]
