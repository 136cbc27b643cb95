"""Command line: ``scaleattn generate | import | fit | certify | compare | evaluate | plot | bench |
submit``.

Errors: any :class:`~scaleattn.errors.ScaleattnError` (bad input, a refusal, an unreachable store) ends with one
line ``scaleattn COMMAND: error: MESSAGE`` and exit code 2, as does a MemoryError (named by the step that ran
out); a usage error (a bad or missing option: argparse's, a :class:`~scaleattn.errors.ParameterError`) adds
``(see scaleattn COMMAND --help)``. Anything else is a bug: one line saying so and exit code 1 (:data:`EXIT_BUG`;
``--debug`` shows the traceback); Ctrl-C exits 130; standard output closed by its reader (``| head``) exits 141 without
a line. The line ends with what was kept and how to continue (a checkpoint and ``--resume``) where that applies. Dask
workers' own logs (task tracebacks) stay out of the terminal unless ``--debug``.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import sys
import time

from .._startup import EXIT_INTERRUPTED, STARTING, exit_with, is_the_command, leave_on_interrupt, release
from .._version import IMPORT_STARTED
from ..errors import Note, ParameterError, ScaleattnError, hint_of
from ..store._locks import file_system_refusal
from ..store._names import one_line
from .commands import COMMANDS, StdoutClosed
from .parser import build_parser, option_of, parse, positional_of

__all__ = ["main", "build_parser", "COMMANDS"]

EXIT_BAD_INPUT = 2
#: an internal error (a bug: an exception scaleattn did not raise on purpose); the exit codes are part of the
#: stable interface (ARCHITECTURE): ``compare``'s "different" is 1 too, told apart by the bug's "internal error" line
EXIT_BUG = 1
#: standard output closed by its reader (``| head``): 128 + SIGPIPE, what a shell reports for a tool that SIGPIPE
#: ended; no line is printed (the files are written)
EXIT_STDOUT_CLOSED = 141


def _command_start(argv) -> float:
    """When this command started, on the ``time.perf_counter`` clock: when run as the ``scaleattn`` program
    (``argv`` None), when the process began importing scaleattn (:data:`scaleattn._version.IMPORT_STARTED`: the
    imports count, as for a stopwatch; the interpreter's own start-up, a few tens of ms, does not), else now.
    Not the process's start: a shell that runs the command last (``bash -c 'a && scaleattn fit ...'``) becomes
    it, start time included (measured: "command 66.48 s" for a 25 s fit after a 40 s install)."""
    return IMPORT_STARTED if argv is None else time.perf_counter()


class Terminated(KeyboardInterrupt):
    """SIGTERM (Kubernetes deletes the pod, a node drains): unwinds like Ctrl-C, not caught by ``except Exception``."""


#: seconds the clean-up after SIGTERM may take before the process leaves anyway (exit 143, the same line): below
#: Kubernetes' default grace of 30 s, after which a pod is killed (exit 137, no line). The clean-up asks the
#: scheduler to cancel the tasks; when the scheduler pod got its SIGTERM first, the client's calls wait for
#: Dask's connect timeouts (30 s and more). The checkpoint holds every finished partial by then, an output is
#: written all or nothing, and the kernel releases the locks
TERM_CLEANUP_S = 20.0


def _stopped_line(args, e: BaseException | None = None) -> str:
    """What a command stopped by SIGTERM says last: what it wrote, or what it kept (the hint on ``e``, as after
    Ctrl-C), or, when its clean-up ran out of time (no ``e``), where a fit's finished row groups would be."""
    if getattr(args, "written", None) or args.command != "fit" or (e is not None and _hint(e, args)):
        tail = _kept(args, e)
    elif e is not None:
        tail = "; no row group was finished: rerun the same command (with or without --resume) to start again"
    else:
        tail = (" (finished row groups are in the fit's checkpoint, if one was kept: rerun the same command with"
                " --resume to continue)")
    return f"{_prog(args)}: stopped by SIGTERM{tail}"


def _kept(args, e: BaseException | None) -> str:
    """What an interrupted command left: its output written in full, what the hint on ``e`` says was kept, or
    nothing."""
    written = getattr(args, "written", None)  # set by a command once its output is complete
    if written:
        return f" after it wrote {written} in full"
    return (_hint(e, args) if e is not None else "") or ("; nothing was written (outputs are written all or nothing)"
                                                   if args.command in WRITERS else "")


def _on_sigterm(signum, frame, args=None, timers=None):
    """SIGTERM: unwind like Ctrl-C (:class:`Terminated`), with a deadline of :data:`TERM_CLEANUP_S` for the
    clean-up and the interpreter's exit (distributed's atexit close of a client whose scheduler is gone waits too),
    after which the process says the same line and leaves with 143. The timer is appended to ``timers`` (the
    caller cancels it when ``main`` ran in its process, not as the ``scaleattn`` program)."""
    import signal
    import threading

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM during the clean-up ends the process

    def leave():  # the clean-up ran out of time: the same line and exit code, never a SIGKILL mid-way
        print(_stopped_line(args), file=sys.stderr, flush=True)
        os._exit(128 + signal.SIGTERM)

    if args is not None and timers is not None:
        timer = threading.Timer(TERM_CLEANUP_S, leave)
        timer.daemon = True  # the interpreter's exit never waits for it
        timer.start()
        timers.append(timer)
    raise Terminated()


#: commands that write an output (all or nothing: an interrupted one leaves none)
WRITERS = ("generate", "import", "fit", "plot")


def _prog(args) -> str:
    """The command as every line of it names it: ``scaleattn generate mhla``, as its usage errors do."""
    return getattr(args, "prog", None) or f"scaleattn {args.command}"


def _error_line(args, message: str, usage: bool = True) -> str:
    """The one error line of the command line, the same for usage errors (:meth:`.parser._Parser.error`) and for
    the errors the commands raise; ``(see PROG --help)`` ends only a usage error's (bad or missing options:
    :attr:`scaleattn.errors.ScaleattnError.usage`), not a refusal of data or outputs, which says what to do.
    Control characters (a path's newline) are escaped: one line, whatever the paths it names hold."""
    return one_line(f"{_prog(args)}: error: {message}" + (f" (see {_prog(args)} --help)" if usage else ""))


def _step(e: BaseException) -> str:
    """The innermost scaleattn function in ``e``'s traceback (``scaleattn.generate.make_teacher``): the step that
    ran out of memory."""
    tb, step = e.__traceback__, "the command"
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        if module.startswith("scaleattn."):
            step = f"{module}.{tb.tb_frame.f_code.co_name}"
        tb = tb.tb_next
    return step


def _hint(e: BaseException, args) -> str:
    h = hint_of(e)
    return f"; {_typed(h, args)}" if h else ""


def _as_typed(e: ScaleattnError, args) -> str:
    """The error's text with the library's parameter names replaced by the command's options for them: a parameter
    check's leading name (``cutoff_rtol must be in (0, 1), got 2``, from :mod:`scaleattn._params`) and every name
    the message quotes in backticks (:func:`_typed`)."""
    text = str(e)
    name = re.match(r"(\w+) must ", text) if isinstance(e, ParameterError) else None
    flag = name and (option_of(args, name.group(1)) or positional_of(args, name.group(1)))
    return _typed(flag + text[name.end(1):] if flag else text, args)


#: parameters of the Python API that the command line spells otherwise (as a whole quote, or by name): the
#: ``dest`` of the option(s) that say the same
_SPELLED = {"storage_options": ("storage_option",), "client=None": ("local",), "ca_file": ("tls_ca_file",),
            "cert": ("tls_cert",), "key": ("tls_key",), "security": ("tls_ca_file", "tls_cert", "tls_key")}


def _typed(text: str, args) -> str:
    """Library text (an error, its hint, a warning) as the command line says it: every parameter it quotes in
    backticks as the Python API spells it (:mod:`scaleattn.errors`) becomes the command's option, ```d_out``` ->
    ``--d-out``, ```solver='krylov'``` -> ``--solver krylov``, ```resume=True``` -> ``--resume`` (a flag takes no
    value), ```storage_options={'key': ...}``` -> ``--storage-option key=...`` (a dict: the option once a
    key); a name the command has no option for stays as it is, and so does a value the option cannot say (a flag
    set otherwise than by giving it, ```overwrite=False```; ``None``; an empty dict)."""
    from .parser import option_action

    def typed(m):
        whole = m.group(0).strip("`") in _SPELLED  # (``client=None``: the value is part of the name)
        dests = _SPELLED.get(m.group(0).strip("`"), _SPELLED.get(m.group(1), (m.group(1),)))
        actions = [option_action(args, d) for d in dests]
        if not all(actions):
            return m.group(0)
        flags = [max(a.option_strings, key=len) for a in actions]
        if m.group(2) is None or whole:
            return f"{', '.join(flags[:-1])} and {flags[-1]}" if len(flags) > 1 else flags[0]
        values = _option_values(m.group(2), actions[0]) if len(flags) == 1 else None
        if values is None:
            return m.group(0)
        return " ".join(f"{flags[0]} {v}" if v else flags[0] for v in values)

    return re.sub(r"`(\w+)(?:=([^`]*))?`", typed, text)


def _option_values(text: str, action) -> list[str] | None:
    """The value(s) of ``action``'s option for a quoted Python value: a string without its quotes (shell-quoted
    where it needs it), a dict as ``KEY=VALUE`` pairs (``...`` for an elided one), anything else as written; for
    a flag, ``[""]`` when the value is the one giving the flag sets (``True``). None where the option cannot say
    it: another value of a flag (``False`` is the flag left out, not given), ``None``, an empty dict."""
    import ast
    import shlex

    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):  # (a placeholder: PATH, ...)
        return None if action.nargs == 0 else [text]
    if action.nargs == 0:
        return [""] if value == action.const else None
    if value is None or value == {}:
        return None
    if isinstance(value, dict):
        return [shlex.quote(f"{k}={'...' if v is Ellipsis else v}") for k, v in value.items()]
    return [shlex.quote(value) if isinstance(value, str) else text]


def _enable_faulthandler() -> None:
    """A native crash (SIGSEGV in BLAS, say) prints the Python traceback on stderr: the step that died (the solve:
    ``_finish``, ``cholesky_factor``, ...) instead of nothing. A stderr without a file descriptor (captured in a
    test) cannot take it."""
    import faulthandler

    if not faulthandler.is_enabled():
        try:
            faulthandler.enable(file=sys.stderr)
        except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is an OSError and a ValueError
            pass


def main(argv=None) -> int:
    """Entry point of the ``scaleattn`` command; returns the exit code: 0 ok, 2 our error (bad input, a refusal,
    an unreachable store or cluster), 1 a bug, 130 Ctrl-C, 143 SIGTERM (a clean stop; the checkpoint is kept);
    ``compare`` 0 same, 1 different, 2 not comparable.

    Ctrl-C is one line and 130 at any point: while the package imports and once this function returns, as the
    ``scaleattn`` program (:mod:`scaleattn._startup`), and here while the options are parsed, as in the command."""
    # the scaleattn program, not a program that runs main in its own process and goes on (IPython's %run -m
    # scaleattn, runpy): its Ctrl-C and its exit stay Python's
    program = argv is None and is_the_command()
    release()  # (Ctrl-C while the package imported was scaleattn._startup's)
    started = _command_start(argv)
    args, code = None, None
    try:
        args = parse(argv)
        args.program = program
        code = _command(args, started, argv)
    except KeyboardInterrupt as e:  # before the command ran (its own are _run's) or as it ended
        if args is None:
            if program:  # a second Ctrl-C while this one's line is said ends the process with it
                leave_on_interrupt(STARTING)
            print(STARTING, file=sys.stderr, flush=True)
            code = EXIT_INTERRUPTED
        else:
            code = _stopped(args, e)
    except SystemExit as e:  # argparse's --help, --version and usage errors
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        raise
    finally:
        if program:  # the interpreter's exit is all that is left (clients, threads), then scaleattn._startup's
            if code is not None:  # (None: an exception escaped, a bug: Python's own exit prints it)
                exit_with(code)
            said = code in (EXIT_INTERRUPTED, 128 + 15)  # (the command said it was stopped: no second line)
            leave_on_interrupt("" if said else f"{'scaleattn' if args is None else _prog(args)}: interrupted while"
                                               " exiting (the command had ended)")
    return code


def _command(args, started: float, argv) -> int:
    """:func:`main` once the options are parsed: the command with its warning lines and its SIGTERM handler."""
    import signal
    import threading

    _enable_faulthandler()
    if not args.debug:  # zarr's cancelled reads after an error would print "Task was destroyed" lines
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    args.started = started
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        with _warning_lines(args):
            return _run(args)
    timers = []
    previous = signal.signal(signal.SIGTERM, functools.partial(_on_sigterm, args=args, timers=timers))
    try:
        with _warning_lines(args):
            return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if argv is not None:  # called in a process that goes on (tests, notebooks): no deadline left behind
            for t in timers:
                t.cancel()


@contextlib.contextmanager
def _warning_lines(args):
    """A warning prints as one line, ``PROG: warning: MESSAGE``, as the error lines do (Python's own format adds
    the file, line number and source line of the code that warned), a :class:`~scaleattn.errors.Note` as
    ``PROG: note: MESSAGE``, naming the command's options (:func:`_typed`); with ``--debug`` as Python prints it."""
    import warnings

    if args.debug:
        yield
        return
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        kind = "note" if issubclass(category, Note) else "warning"
        print(one_line(f"{_prog(args)}: {kind}: {_typed(str(message), args)}"), file=file or sys.stderr)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous


def _run(args) -> int:
    try:
        return COMMANDS[args.command](args)
    except ScaleattnError as e:  # bad input, a refusal, a missing optional package, an unreachable store/cluster
        if not _traceback_shown(args):
            print(_error_line(args, f"{_as_typed(e, args)}{_hint(e, args)}", usage=e.usage), file=sys.stderr)
        return EXIT_BAD_INPUT
    except MemoryError as e:  # sizes no up-front check caught: the machine's limit, not a bug
        if not _traceback_shown(args):
            print(_error_line(args, f"out of memory in {_step(e)}: {e or 'MemoryError'}: use smaller sizes or a"
                                    f" machine with more memory{_kept(args, e)}", usage=False), file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as e:  # (and Terminated: SIGTERM)
        return _stopped(args, e)
    except Exception as e:  # anything else is a bug in scaleattn: one line, the traceback only with --debug
        if isinstance(e, StdoutClosed):  # `| head`: the reader left, not a bug
            _quiet_stdout()
            return EXIT_STDOUT_CLOSED
        refused = file_system_refusal(e)  # a full disk, a quota, a read-only place no layer named: not a bug
        if refused is not None:
            if not _traceback_shown(args):
                print(_error_line(args, f"cannot write: {refused}{_left(args, e)}", usage=False), file=sys.stderr)
            return EXIT_BAD_INPUT
        if _traceback_shown(args):
            return EXIT_BUG
        command = _prog(args).removeprefix("scaleattn ")
        print(one_line(f"{_prog(args)}: internal error (this is a bug; please report it with the output of"
                       f" `scaleattn --debug {command} ...`): {type(e).__name__}: {e}{_hint(e, args)}"),
              file=sys.stderr)
        return EXIT_BUG


def _left(args, e: BaseException) -> str:
    """What a command that failed left: the hint on ``e`` (a kept checkpoint), its output if it was complete, or
    that nothing was written (a writer's outputs are all or nothing)."""
    if _hint(e, args):
        return _hint(e, args)
    if getattr(args, "written", None):
        return f"; {args.written} was written in full"
    return "; nothing was written (outputs are written all or nothing)" if args.command in WRITERS else ""


def _quiet_stdout() -> None:
    """Standard output's reader has gone: point it at ``/dev/null`` so that the interpreter's flush at exit does
    not fail a second time (Python's documented recipe for SIGPIPE)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # (a replaced sys.stdout without a file)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _stopped_line_of(args, e: KeyboardInterrupt) -> str:
    """Ctrl-C's or SIGTERM's (:class:`Terminated`) last line."""
    return _stopped_line(args, e) if isinstance(e, Terminated) else f"{_prog(args)}: interrupted{_kept(args, e)}"


def _stopped(args, e: KeyboardInterrupt) -> int:
    """Ctrl-C's or SIGTERM's (:class:`Terminated`) last line and exit code: 130, or 143 (128 + SIGTERM). In the
    scaleattn program a second Ctrl-C meanwhile ends the process with the same line (it would escape ``main``)."""
    import signal

    line = _stopped_line_of(args, e)
    program = getattr(args, "program", False)
    if program:
        leave_on_interrupt(line)
    print(line, file=sys.stderr, flush=True)
    if program:
        leave_on_interrupt("")  # (said)
    return 128 + signal.SIGTERM if isinstance(e, Terminated) else EXIT_INTERRUPTED


def _traceback_shown(args) -> bool:
    """With ``--debug``, print the traceback of the error being handled, in place of its one line: the exit code
    stays the error's (it was Python's 1 for every error, a bad input or a bug, and for ``compare`` "different")."""
    if args.debug:
        import traceback

        traceback.print_exc()
    return args.debug


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
