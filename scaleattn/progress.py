"""Progress of long work, for the person waiting (layer L0): named phases, bars counted in rows, lines.

Computation never imports UI: the pipeline hands a :class:`Reporter` down, and the build, the solver step
and the evaluation call ``phase``/``bar``/``line`` on it. :class:`Reporter` itself is silent;
:class:`ConsoleReporter` draws with rich on stderr (so ``--json`` output on stdout stays clean) or, in a
Jupyter notebook, live in the cell. :func:`as_reporter` turns the API's ``progress=True/False`` into one.
"""
from __future__ import annotations

import contextlib
import sys
import time

__all__ = ["Reporter", "ConsoleReporter", "as_reporter", "in_notebook"]


def in_notebook() -> bool:
    """True inside a Jupyter (IPython kernel) session."""
    try:
        from IPython import get_ipython

        ip = get_ipython()
        return ip is not None and "IPKernelApp" in ip.config
    except Exception:  # no IPython, or a shell without a config
        return False


class Reporter:
    """Silent progress reporter; the base of every reporter (also what ``progress=False`` gives).

    Methods
    -------
    phase(name, detail="")
        Context manager around one step (``"solve"``, ``"heads"``, ``"write"``): reporters show a spinner
        and ``name: done in X s``.
    bar(name, total, unit="rows", done=0, note="")
        Context manager yielding ``advance(n)``: a bar of ``total`` units of which ``done`` are already
        finished (resumed); reporters show counts, the rate in units/s and the time left.
    line(text)
        One line of information (cluster started, checkpoint kept, ...).

    Examples
    --------
    >>> r = Reporter()
    >>> with r.bar("statistics", 100) as advance:
    ...     advance(100)
    """

    enabled = False

    @contextlib.contextmanager
    def phase(self, name: str, detail: str = ""):
        yield

    @contextlib.contextmanager
    def bar(self, name: str, total: int, unit: str = "rows", done: int = 0, note: str = ""):
        yield lambda n=1: None

    def line(self, text: str) -> None:
        return None


class ConsoleReporter(Reporter):
    """rich bars and spinners on stderr (live in a terminal or notebook; the final state once otherwise)."""

    enabled = True

    def __init__(self, file=None):
        from rich.console import Console

        self.console = Console(file=file or sys.stderr, stderr=file is None)

    @contextlib.contextmanager
    def phase(self, name: str, detail: str = ""):
        t0 = time.perf_counter()
        label = f"[bold]{name}[/bold]" + (f" ({detail})" if detail else "")
        if in_notebook() or not self.console.is_terminal:
            yield
        else:
            with self.console.status(f"{label} ..."):
                yield
        self.console.print(f"{label}: done in {time.perf_counter() - t0:.2f} s", highlight=False)

    @contextlib.contextmanager
    def bar(self, name: str, total: int, unit: str = "rows", done: int = 0, note: str = ""):
        from rich.progress import (
            BarColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        columns = [TextColumn("[bold]{task.description}"), BarColumn(),
                   TextColumn("{task.completed:,.0f}/{task.total:,.0f} " + unit),
                   TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn()]
        t0 = time.perf_counter()
        with Progress(*columns, console=self.console, transient=False) as prog:
            task = prog.add_task(name, total=max(int(total), 1), completed=int(done), rate="")
            if note:
                prog.console.print(f"{name}: {note}", highlight=False)
            fresh = [0]

            def advance(n: int = 1) -> None:
                fresh[0] += n
                dt = time.perf_counter() - t0
                rate = f"{fresh[0] / dt:,.0f} {unit}/s" if dt > 0 else ""
                prog.update(task, advance=n, rate=rate)

            yield advance

    def line(self, text: str) -> None:
        self.console.print(text, highlight=False)


def as_reporter(progress) -> Reporter:
    """A reporter for ``progress``: a :class:`Reporter` as is, ``True`` -> :class:`ConsoleReporter`,
    ``False``/``None`` -> the silent :class:`Reporter`."""
    if isinstance(progress, Reporter):
        return progress
    return ConsoleReporter() if progress else Reporter()
