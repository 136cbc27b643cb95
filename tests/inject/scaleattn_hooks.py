"""The test suite's hooks, injected into scaleattn from outside (the package calls none of them), each configured
by an environment variable so that it reaches the CLI processes the tests start:

- ``SCALEATTN_TEST_STOP_AFTER_GROUPS=K``: a fit's statistics build ends the process at once (code
  :data:`CRASH_EXIT`, no cleanup, as a crash would) once K row groups are computed and checkpointed in this run
  (``on_group`` of :func:`scaleattn.distributed.build.build_statistics`).
- ``SCALEATTN_TEST_PAUSE=WHERE:FILE``: the process writes FILE and sleeps (up to a minute) at WHERE: ``import``
  (as the package finishes importing) or ``exit`` (as the ``scaleattn`` command leaves ``main``), so that a test
  can send a signal there once FILE exists.

:func:`install` patches modules already imported and, for those not yet imported, hooks their import.
"""
import functools
import importlib.abc
import os
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


def _patch_cli(cli) -> None:
    """The command's exit, with a pause after it hands the interpreter's exit to its Ctrl-C handler."""
    leave = cli.leave_on_interrupt

    @functools.wraps(leave)
    def leave_on_interrupt(*args, **kwargs):
        leave(*args, **kwargs)
        pause("exit")

    cli.leave_on_interrupt = leave_on_interrupt


def _after_package(package) -> None:
    import scaleattn.pipeline

    _patch_pipeline(scaleattn.pipeline)
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
    if "scaleattn.cli" in sys.modules:
        _patch_cli(sys.modules["scaleattn.cli"])
    sys.meta_path.insert(0, _Finder())
