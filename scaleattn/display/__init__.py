"""What people read and look at: the report's text, the HTML cards of notebooks, progress bars, and the shared
pieces of the figures. Everything here renders plain records (dicts, dataclasses) that the computing layers
built; nothing here computes a result."""
from ._html import fit_html
from ._progress import ConsoleReporter, NotebookReporter, Reporter, as_reporter
from ._text import fit_summary

__all__ = ["fit_summary", "fit_html", "Reporter", "ConsoleReporter", "NotebookReporter", "as_reporter"]
