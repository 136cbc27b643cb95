"""The test suite's hooks, injected into scaleattn from outside (the package calls none of them), each configured
by an environment variable so that it reaches the CLI processes the tests start:

- ``SCALEATTN_TEST_STOP_AFTER_GROUPS=K``: a fit's statistics build ends the process at once (code
  :data:`CRASH_EXIT`, no cleanup, as a crash would) once K row groups are computed and checkpointed in this run
  (``on_group`` of :func:`scaleattn.distributed.build.build_statistics`).
- ``SCALEATTN_TEST_PAUSE=WHERE:FILE``: the process writes FILE and sleeps (up to a minute) at WHERE: ``import``
  (as the package finishes importing), ``report`` (a fit's report is printed, its cluster still up), ``teardown``
  (as a command's cluster is stopped), ``exit`` (as the ``scaleattn`` command leaves ``main``), ``atexit`` (in the
  interpreter's exit handlers, before scaleattn's last one) or ``finalize`` (in Python's finalisation, as this
  module's globals are cleared), so that a test can send a signal there once FILE exists.
- ``SCALEATTN_TEST_TASK_KILL=SIGNAL[@G]``: every statistics task in a worker process (of row group G and later)
  ends that process with the signal first (``KILL``, as the kernel's OOM killer does).
- ``SCALEATTN_TEST_TASK_MEMORY=BYTES``: every statistics task in a worker process first holds that many bytes
  (touched), to push its worker past its Dask memory limit.
- ``SCALEATTN_TEST_KILL_AFTER_PASSES=K[:mid]``: a streaming fit's process sends itself SIGKILL (no cleanup, no
  line) once its pass journal has recorded K passes in this run; with ``:mid``, while writing the K-th: its
  values written, not yet marked done (:class:`scaleattn.distributed.journal.PassJournal`).

:func:`install` patches modules already imported and, for those not yet imported, hooks their import.
"""
import atexit
import contextlib
import functools
import importlib.abc
import multiprocessing
import os
import signal
import sys
import time

#: exit code of a process stopped by ``SCALEATTN_TEST_STOP_AFTER_GROUPS``
CRASH_EXIT = 75


def pause(where: str) -> None:
    """Write FILE and sleep, where ``SCALEATTN_TEST_PAUSE=WHERE:FILE`` names ``where``."""
    at, _, path = os.environ.get("SCALEATTN_TEST_PAUSE", "").partition(":")
    if at == where and path:
        with open(path, "w"):
            pass
        time.sleep(60)


def _stop_after(k: int):
    def on_group(done: int) -> None:
        if done >= k:
            os._exit(CRASH_EXIT)

    return on_group


def _patch_pipeline(pipeline) -> None:
    """The fit's build, with ``on_group`` stopping it after K groups when the variable says so."""
    build = pipeline.build_statistics

    @functools.wraps(build)
    def build_statistics(*args, **kwargs):
        k = os.environ.get("SCALEATTN_TEST_STOP_AFTER_GROUPS")
        if k:
            kwargs["on_group"] = _stop_after(int(k))
        return build(*args, **kwargs)

    pipeline.build_statistics = build_statistics


def _patch_build(build) -> None:
    """The statistics tasks, with the worker's death or memory the variables ask for (in a worker process only:
    never the test's own process, whose threads may be a cluster's workers)."""
    partial = build._partial

    @functools.wraps(partial)
    def _partial(dataset, gi, *args, **kwargs):
        if multiprocessing.parent_process() is not None:
            kill, _, first = os.environ.get("SCALEATTN_TEST_TASK_KILL", "").partition("@")
            if kill and gi >= int(first or 0):
                os.kill(os.getpid(), getattr(signal, f"SIG{kill}"))
                time.sleep(10)  # (the signal ends the process meanwhile)
            size = int(float(os.environ.get("SCALEATTN_TEST_TASK_MEMORY", 0) or 0))
            if size:
                _held.append(bytearray(b"\1") * size)
                time.sleep(5)  # the nanny's memory monitor sees it
        return partial(dataset, gi, *args, **kwargs)

    build._partial = _partial


_held = []


def _patch_journal(journal) -> None:
    """The pass journal, SIGKILLing its process after (or, ``:mid``, inside) the K-th pass it records."""
    k, _, where = os.environ.get("SCALEATTN_TEST_KILL_AFTER_PASSES", "").partition(":")
    if not k:
        return
    cls, k = journal.PassJournal, int(k)
    record, mark = cls.record, cls._mark_done

    def _kill():
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)  # (the signal ends the process meanwhile)

    @functools.wraps(mark)
    def _mark_done(self, *args, **kwargs):
        if where == "mid" and self.computed + 1 >= k:
            _kill()
        return mark(self, *args, **kwargs)

    @functools.wraps(record)
    def record_(self, *args, **kwargs):
        record(self, *args, **kwargs)
        if self.computed >= k:
            _kill()

    cls.record, cls._mark_done = record_, _mark_done


def _patch_cluster(cluster) -> None:
    """A command's cluster, with a pause as it is stopped."""
    connect = cluster.connect

    @functools.wraps(connect)
    @contextlib.contextmanager
    def paused_connect(*args, **kwargs):
        with connect(*args, **kwargs) as client:
            try:
                yield client
            finally:
                pause("teardown")

    cluster.connect = paused_connect


def _patch_commands(commands) -> None:
    """A fit's report, with a pause once it is printed."""
    emit = commands._emit

    @functools.wraps(emit)
    def _emit(args, *rest, **kwargs):
        emit(args, *rest, **kwargs)
        if args.command == "fit":
            pause("report")

    commands._emit = _emit


class _PauseWhenDeleted:
    """Pauses at ``finalize``: deleted as Python's finalisation clears this module's globals (builtins and modules
    may be gone by then: it holds what it calls)."""

    def __init__(self, path):
        self.path, self.calls = path, (os.open, os.close, os.O_WRONLY | os.O_CREAT, time.sleep)

    def __del__(self):
        open_, close, flags, sleep = self.calls
        close(open_(self.path, flags))
        sleep(60)


def _patch_cli(cli) -> None:
    """The command's exit, with a pause after it hands the interpreter's exit to its Ctrl-C handler."""
    leave = cli.leave_on_interrupt

    @functools.wraps(leave)
    def leave_on_interrupt(*args, **kwargs):
        leave(*args, **kwargs)
        pause("exit")

    cli.leave_on_interrupt = leave_on_interrupt


def _after_package(package) -> None:
    import scaleattn.cli.commands
    import scaleattn.distributed.build
    import scaleattn.distributed.cluster
    import scaleattn.distributed.journal
    import scaleattn.pipeline

    _patch_pipeline(scaleattn.pipeline)
    _patch_build(scaleattn.distributed.build)
    _patch_cluster(scaleattn.distributed.cluster)
    _patch_journal(scaleattn.distributed.journal)
    _patch_commands(scaleattn.cli.commands)
    at, _, path = os.environ.get("SCALEATTN_TEST_PAUSE", "").partition(":")
    if at == "atexit":  # (registered after scaleattn._startup's last exit handler: runs before it)
        atexit.register(pause, "atexit")
    if at == "finalize":
        globals()["_deleted_last"] = _PauseWhenDeleted(path)
    pause("import")


#: module -> what runs once it has executed
AFTER = {"scaleattn": _after_package, "scaleattn.cli": _patch_cli}


class _Loader(importlib.abc.Loader):
    """A module's own loader, then the hook."""

    def __init__(self, loader, hook):
        self.loader, self.hook = loader, hook

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader  # (as if never wrapped: resources, reloads)
        self.loader.exec_module(module)
        self.hook(module)

    def __getattr__(self, name):
        return getattr(self.loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the modules of :data:`AFTER` through the other finders and wraps their loaders."""

    def find_spec(self, name, path, target=None):
        if name not in AFTER:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                spec.loader = _Loader(spec.loader, AFTER[name])
                return spec
        return None


def install() -> None:
    """Patch the modules of :data:`AFTER` already imported (no pause then), and hook the import of the others."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    if "scaleattn.pipeline" in sys.modules:
        _patch_pipeline(sys.modules["scaleattn.pipeline"])
    if "scaleattn.distributed.build" in sys.modules:
        _patch_build(sys.modules["scaleattn.distributed.build"])
    if "scaleattn.cli" in sys.modules:
        _patch_cli(sys.modules["scaleattn.cli"])
    sys.meta_path.insert(0, _Finder())
