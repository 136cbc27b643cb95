"""Progress of long work, for the person waiting (layer L0): named phases, bars counted in rows, lines.

Computation never imports UI: the pipeline hands a :class:`Reporter` down, and the build, the solver step
and the evaluation call ``phase``/``bar``/``line`` on it. :class:`Reporter` itself is silent;
:class:`ConsoleReporter` draws with rich on stderr (so ``--json`` output on stdout stays clean);
:class:`NotebookReporter` updates one HTML line per bar in a Jupyter cell (rows, rows/s, groups done, time
left), whose last state stays in the saved notebook. :func:`as_reporter` turns the API's
``progress=True/False`` into the one that fits where it runs.
"""
from __future__ import annotations

import contextlib
import html
import sys
import threading
import time

__all__ = ["Reporter", "ConsoleReporter", "NotebookReporter", "as_reporter", "in_notebook", "clock"]


def in_notebook() -> bool:
    """True inside a Jupyter (IPython kernel) session."""
    try:
        from IPython import get_ipython

        ip = get_ipython()
        return ip is not None and "IPKernelApp" in ip.config
    except Exception:  # no IPython, or a shell without a config
        return False


def clock(seconds: float | None) -> str:
    """``H:MM:SS`` of a duration (``-:--:--`` when unknown), as rich's time columns print it.

    Examples
    --------
    >>> clock(75.2), clock(None)
    ('0:01:15', '-:--:--')
    """
    if seconds is None or seconds != seconds or seconds < 0:
        return "-:--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Reporter:
    """Silent progress reporter; the base of every reporter (also what ``progress=False`` gives).

    Methods
    -------
    phase(name, detail="")
        Context manager around one step (``"solve"``, ``"heads"``, ``"write"``) yielding ``note(text)``, what the
        step is doing now: reporters show a spinner with the latest note (in a log or a pipe, a line at most every
        :data:`NOTE_EVERY_S`), then ``name: done in X s``.
    bar(name, total, unit="rows", done=0, note="", steps=0, step_unit="groups", steps_done=0, wait_reason="")
        Context manager yielding ``advance(n=1, steps=0)``: a bar of ``total`` units of which ``done`` are
        already finished (resumed); ``steps`` counts the pieces of work (row groups, tasks) of which
        ``steps_done`` are finished, ``advance(n, steps=1)`` marks one more. Reporters show the counts, the
        rate of the units computed in this run (units/s), the steps done and the time left; after
        :data:`PENDING_S` without a first step, what they wait for, with ``wait_reason`` when the caller knows
        one (a statistics build whose kernels are being compiled).
    line(text)
        One line of information (cluster started, checkpoint kept, ...).
    status(text)
        Context manager: a transient spinner (terminals only) for a short wait that leaves no line behind
        (the local cluster stopping after the report).

    Examples
    --------
    >>> r = Reporter()
    >>> with r.bar("statistics", 100, steps=2) as advance:
    ...     advance(50, steps=1)
    ...     advance(50, steps=1)
    """

    enabled = False

    @contextlib.contextmanager
    def phase(self, name: str, detail: str = ""):
        yield lambda text: None

    @contextlib.contextmanager
    def bar(self, name: str, total: int, unit: str = "rows", done: int = 0, note: str = "", steps: int = 0,
            step_unit: str = "groups", steps_done: int = 0, wait_reason: str = ""):
        yield lambda n=1, steps=0: None

    def line(self, text: str) -> None:
        return None

    @contextlib.contextmanager
    def status(self, text: str):
        """Context manager: a transient spinner with ``text`` while it runs (terminals only; nothing stays)."""
        yield


#: seconds between two notes of a phase printed as lines (a log or a pipe): a long head search said nothing for 45 s
NOTE_EVERY_S = 10.0
#: seconds without a finished unit after which a live bar says what it waits for (the first run after an install
#: compiles the kernels, up to ~40 s on 2 busy cores, before any row group is done: the bar sat at 0 rows, no rate)
PENDING_S = 3.0
#: seconds between two redraws of a notebook's bar while no unit is done (the elapsed time moves on)
TICK_S = 1.0


def _stopped(e: BaseException) -> str:
    """How a bar or phase ended early: ``interrupted`` (Ctrl-C, the kernel's stop button) or ``stopped by
    ValueError``."""
    return "interrupted" if isinstance(e, KeyboardInterrupt) else f"stopped by {type(e).__name__}"


class _BarState:
    """Counts of one bar (thread-safe: Dask callbacks may advance it from the client's event loop)."""

    def __init__(self, name, total, unit, done, steps, step_unit, steps_done, wait_reason=""):
        self.name, self.unit, self.step_unit, self.wait_reason = name, unit, step_unit, wait_reason
        self.total, self.done, self.fresh = max(int(total), 1), int(done), 0
        self.steps, self.steps_done = int(steps), int(steps_done)
        self.t0 = time.perf_counter()
        self.t_first, self.fresh_first = None, 0  # when the first units of this run were done, and how many
        self.lock = threading.Lock()

    def advance(self, n: int = 1, steps: int = 0) -> None:
        with self.lock:
            self.done += n
            self.fresh += n
            self.steps_done += steps
            if self.t_first is None and self.fresh:
                self.t_first, self.fresh_first = time.perf_counter(), self.fresh

    def _rate(self) -> tuple[float | None, bool]:
        """(units/s, whether it includes the start-up). Measured from the first units done on (the wait for them
        can be a first compile, up to ~40 s: counted, it showed 255 rows/s at first and 3,789 at the end of a run
        whose steady rate was higher still); until more are done, over the time since the bar began."""
        now = time.perf_counter()
        with self.lock:
            if self.t_first is None:
                return None, False
            if self.fresh > self.fresh_first and now > self.t_first:
                return (self.fresh - self.fresh_first) / (now - self.t_first), False
            return (self.fresh / (self.t_first - self.t0) if self.t_first > self.t0 else None), True

    def rate(self) -> float | None:
        return self._rate()[0]

    def rate_text(self) -> str:
        """``52,267 rows/s after the first group`` (said: next to the elapsed time, which has the wait for that
        group, an unlabelled rate read as rows / elapsed, 40x off after a compile), or ``incl. start-up``."""
        r, startup = self._rate()
        if r is None:
            return ""
        return f"{r:,.0f} {self.unit}/s " + ("incl. start-up" if startup else f"after the first {self._one()}")

    def _one(self) -> str:
        return self.step_unit[:-1] if self.step_unit.endswith("s") else self.step_unit

    def pending(self, waited: bool = False) -> bool:
        """Whether nothing of this run is done after :data:`PENDING_S` (``waited``: known to have passed) while
        work is left (what a wait says)."""
        return (not self.fresh and bool(self.steps) and self.done < self.total
                and (waited or time.perf_counter() - self.t0 >= PENDING_S))

    def waiting_text(self, why: bool = True) -> str:
        """``waiting for the first group`` (with ``why``: and the bar's ``wait_reason``, where its caller knows
        one, for the one line a wait prints: said only when it holds, e.g. kernels being compiled)."""
        return f"waiting for the first {self._one()}" + (
            f" ({self.wait_reason})" if why and self.wait_reason else "")

    def live_rate_text(self) -> str:
        """:meth:`rate_text`, or while :meth:`pending`, what is awaited (short: the reason is a line of its own)."""
        return self.waiting_text(why=False) if self.pending() else self.rate_text()

    def steps_text(self) -> str:
        return f"{self.steps_done:,}/{self.steps:,} {self.step_unit}" if self.steps else ""

    def left(self) -> float | None:
        r = self.rate()
        return 0.0 if self.done >= self.total else (None if r is None else (self.total - self.done) / r)

    def text(self, final: bool = False, end: str = "") -> str:
        """One plain line: ``statistics 2,150/5,120 rows  12,300 rows/s after the first group  3/8 groups  0:00:01
        elapsed ...``; a live one (not ``final``) says what it waits for while :meth:`pending` (with the reason:
        a notebook has no line of its own for it), ``end`` closes a final one (``interrupted``)."""
        elapsed = time.perf_counter() - self.t0
        rate = self.waiting_text() if not final and self.pending() else self.rate_text()
        parts = [self.name, f"{round(min(self.done, self.total)):,}/{self.total:,} {self.unit}", rate,
                 self.steps_text(), f"{clock(elapsed)} elapsed", end]
        if not final:
            parts.append(f"{clock(self.left())} left")
        return "  ".join(p for p in parts if p)

    def html(self, final: bool = False, end: str = "") -> str:
        frac = min(self.done / self.total, 1.0)
        bar = ('<span style="display:inline-block;width:14em;height:0.75em;border:1px solid #888;'
               'vertical-align:middle;margin:0 0.6em">'
               f'<span style="display:block;height:100%;width:{100 * frac:.1f}%;background:#4c72b0"></span></span>')
        rest = html.escape(self.text(final, end)[len(self.name):].strip())
        return (f'<div class="scaleattn-progress" data-name="{html.escape(self.name)}" data-done="{round(self.done)}"'
                f' data-total="{self.total}" style="font-family:monospace;font-size:0.9em;line-height:1.6">'
                f"<b>{html.escape(self.name)}</b>{bar}{rest}</div>")


class ConsoleReporter(Reporter):
    """rich bars and spinners on stderr (live in a terminal; the final state once otherwise)."""

    enabled = True

    def __init__(self, file=None):
        from rich.console import Console

        # soft_wrap: a long line (a dashboard link) stays one line in logs and pipes, never cut at 80 columns
        self.console = Console(file=file or sys.stderr, stderr=file is None, soft_wrap=True)

    @contextlib.contextmanager
    def phase(self, name: str, detail: str = ""):
        t0 = time.perf_counter()
        label = f"[bold]{name}[/bold]" + (f" ({detail})" if detail else "")
        if not self.console.is_terminal:  # no spinner in a log or a pipe: the latest note every NOTE_EVERY_S (a
            # timer, as a search may note nothing new for longer), the way a wait of the statistics bar is said
            latest, stop = [None], threading.Event()

            def say():
                while not stop.wait(NOTE_EVERY_S):
                    if latest[0] is not None:
                        self.console.print(f"{label}: {clock(time.perf_counter() - t0)} elapsed, {latest[0]}",
                                           highlight=False)
            ticker = threading.Thread(target=say, daemon=True)
            ticker.start()
            try:
                yield lambda text: latest.__setitem__(0, text)
            finally:
                stop.set()
                ticker.join()
        else:
            with self.console.status(f"{label} ...") as spinner:
                yield lambda text: spinner.update(f"{label} ... {text}")
        self.console.print(f"{label}: done in {time.perf_counter() - t0:.2f} s", highlight=False)

    @contextlib.contextmanager
    def bar(self, name: str, total: int, unit: str = "rows", done: int = 0, note: str = "", steps: int = 0,
            step_unit: str = "groups", steps_done: int = 0, wait_reason: str = ""):
        st = _BarState(name, total, unit, done, steps, step_unit, steps_done, wait_reason)
        if note:
            self.console.print(f"{name}: {note}", highlight=False)

        def say_waiting():  # one line, in a terminal (above the bar) and in a log or a pipe alike
            if st.pending(waited=True):
                self.console.print(f"{name}: {st.waiting_text()}", highlight=False)
        timer = threading.Timer(PENDING_S, say_waiting)
        timer.daemon = True
        timer.start()
        try:
            if not self.console.is_terminal:  # a log or a pipe: the final state once, as one plain line (rich's
                # bar columns at the default 80 columns wrapped its rate onto a second line)
                yield st.advance
                timer.cancel()
                self.console.print(st.text(final=True), highlight=False)
                return
            with self._live_bar(st, unit) as advance:
                yield advance
        finally:
            timer.cancel()

    @contextlib.contextmanager
    def _live_bar(self, st: _BarState, unit: str):
        from rich import progress as rp
        from rich.table import Column
        from rich.text import Text

        class Live(rp.ProgressColumn):  # text read from the bar's counts at every refresh (a wait for the first
            # group shows while it lasts); one line, cut rather than wrapped where the terminal is narrow
            def __init__(self, text):
                super().__init__(table_column=Column(no_wrap=True, overflow="ellipsis"))
                self.text = text

            def render(self, task):
                return Text(self.text(), no_wrap=True, overflow="ellipsis")

        # the bar takes what the text leaves of the terminal's width (a fixed 40 columns wrapped the line at 120)
        columns = [rp.TextColumn("[bold]{task.description}"), rp.BarColumn(bar_width=None),
                   rp.TextColumn("{task.completed:,.0f}/{task.total:,.0f} " + unit),
                   Live(st.live_rate_text), Live(st.steps_text), rp.TimeElapsedColumn(), rp.TimeRemainingColumn()]
        with rp.Progress(*columns, console=self.console, transient=False) as prog:
            task = prog.add_task(st.name, total=st.total, completed=st.done)

            def advance(n: int = 1, steps: int = 0) -> None:
                st.advance(n, steps)
                prog.update(task, advance=n)

            yield advance

    def line(self, text: str) -> None:
        self.console.print(text, highlight=False)

    @contextlib.contextmanager
    def status(self, text: str):
        if not self.console.is_terminal:
            yield
            return
        with self.console.status(f"{text} ..."):
            yield


class NotebookReporter(Reporter):
    """Live progress in a Jupyter cell: one HTML line per bar and per phase, updated in place (at most every
    ``interval`` seconds), with a plain-text twin; the last state is what a saved notebook shows.

    Each bar shows the units done (rows, samples), the rate of this run, the steps done (row groups or
    tasks), the time elapsed and left, redrawn every :data:`TICK_S` while no unit is done (then it says what it
    waits for); each phase shows ``name ...`` while it runs, then ``name: done in X s``. Work that ends early
    (the kernel interrupted, an error) leaves ``interrupted`` / ``stopped by Error`` on its line, not a time left.
    """

    enabled = True

    def __init__(self, interval: float = 0.25):
        self.interval = float(interval)

    @staticmethod
    def _show(text: str, html_text: str, handle=None):
        from IPython.display import display

        bundle = {"text/plain": text, "text/html": html_text}
        if handle is None:
            return display(bundle, raw=True, display_id=True)
        handle.update(bundle, raw=True)
        return handle

    @contextlib.contextmanager
    def phase(self, name: str, detail: str = ""):
        label = name + (f" ({detail})" if detail else "")
        style = 'class="scaleattn-phase" style="font-family:monospace;font-size:0.9em"'
        handle = self._show(f"{label} ...", f"<div {style}><b>{html.escape(label)}</b> ...</div>")
        t0 = last = time.perf_counter()

        def note(text: str) -> None:
            nonlocal last
            if time.perf_counter() - last >= self.interval:
                last = time.perf_counter()
                self._show(f"{label} ... {text}",
                           f"<div {style}><b>{html.escape(label)}</b> ... {html.escape(text)}</div>", handle)
        try:
            yield note
        except BaseException as e:  # the saved cell must not show "solve ..." as if it still ran
            done = f"{_stopped(e)} after {time.perf_counter() - t0:.2f} s"
            self._show(f"{label}: {done}", f"<div {style}><b>{html.escape(label)}</b>: {done}</div>", handle)
            raise
        done = f"done in {time.perf_counter() - t0:.2f} s"
        self._show(f"{label}: {done}", f"<div {style}><b>{html.escape(label)}</b>: {done}</div>", handle)

    @contextlib.contextmanager
    def bar(self, name: str, total: int, unit: str = "rows", done: int = 0, note: str = "", steps: int = 0,
            step_unit: str = "groups", steps_done: int = 0, wait_reason: str = ""):
        st = _BarState(name, total, unit, done, steps, step_unit, steps_done, wait_reason)
        if note:
            self.line(f"{name}: {note}")
        handle = self._show(st.text(), st.html())
        last, lock, stop = [time.perf_counter()], threading.Lock(), threading.Event()

        def show(force: bool = False, final: bool = False, end: str = "") -> None:
            with lock:  # advance runs on the client's event loop, the ticker on its own thread
                now = time.perf_counter()
                if force or now - last[0] >= self.interval:
                    last[0] = now
                    self._show(st.text(final, end), st.html(final, end), handle)

        def advance(n: int = 1, steps: int = 0) -> None:
            st.advance(n, steps)
            show()

        def tick():  # no group done for a while (a first compile, up to ~90 s on busy cores): the line kept
            # 0:00:00 elapsed and never said what it waited for
            while not stop.wait(TICK_S):
                if time.perf_counter() - last[0] >= TICK_S:
                    show(force=True)
        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            yield advance
        except BaseException as e:  # the saved cell must not show a bar with time left as if it still ran
            stop.set()
            ticker.join()
            show(force=True, final=True, end=_stopped(e))
            raise
        stop.set()
        ticker.join()
        show(force=True, final=True)

    def line(self, text: str) -> None:
        print(text, flush=True)


def as_reporter(progress) -> Reporter:
    """A reporter for ``progress``: a :class:`Reporter` as is; ``True`` -> :class:`NotebookReporter` in a
    Jupyter kernel, else :class:`ConsoleReporter`; ``False``/``None`` -> the silent :class:`Reporter`."""
    if isinstance(progress, Reporter):
        return progress
    if not progress:
        return Reporter()
    return NotebookReporter() if in_notebook() else ConsoleReporter()
