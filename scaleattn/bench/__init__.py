"""The benchmarks of ``scaleattn bench``, one module per suite, each with ``run(out_dir, quick=False)``.

:data:`SUITES` is the one list of the suites: the CLI's choices, its help and the dispatch are made from it (and
the docs' lists are checked against it by the tests).
"""
from __future__ import annotations

__all__ = ["SUITES", "VERSUS", "QUICK_HELP", "summary"]

#: ``scaleattn bench SUITE``: name -> (module, what it measures); the first is the default
SUITES = {
    "core": ("scaleattn.bench.core", "statistics build and solver vs numpy/dask peers"),
    "tensor": ("scaleattn.bench.tensor", "tensor attention"),
    "gpu": ("scaleattn.bench.gpu", "the same kernels on a CUDA device (needs the gpu extra)"),
    "krylov": ("scaleattn.bench.krylov", "the matrix-free solver against Cholesky at d = 32 and the heads step at"
                                         " d = 44"),
    "solve": ("scaleattn.bench.solve", "the dense solve against psi^3/3 at the DGEMM rate (d = 24, 32) and the"
                                       " d = 32 factorisation with OpenBLAS's own kernel choice (numpy's, scipy's"
                                       " and ours, each in a fresh process)"),
    "stream": ("scaleattn.bench.stream", "the streaming path (passes over the tokens, K-FAC CG) against the Gram route"
                                         " at d = 16, 24, 32, the time of a pass at d = 64, and its passes on"
                                         " 1 and 2 Dask workers at d = 24 (speed-up, bit-identity)"),
    "certified": ("scaleattn.bench.certified", "the certified dense solve (a shifted Cholesky proves the verdict)"
                                               " against cho_factor + cho_solve, and the whole fit against numpy's"
                                               " normal equations on a ready phi (d = 16, 24, 32)"),
}
#: ``scaleattn bench --vs PEER``: name -> (module, what it measures)
VERSUS = {"adamw": ("scaleattn.bench.adamw", "time-to-MSE and final MSE of AdamW-trained MHLA vs our fit (needs the"
                                             " torch extra)")}


#: what ``--quick`` does and takes, as measured (the help said "about 2 minutes for core on 2 cores"; a run under
#: load took 450 s): ``scaleattn bench --quick`` (core) ran 11 min 8 s on 2 cores shared with other work (load
#: average 17-19), 2bce6fa
QUICK_HELP = ("small sizes, a smoke test of the benchmark itself (core: 11 minutes measured on 2 cores shared with"
              " other work; less on idle cores; bench.md gives the run's total)")


def summary() -> str:
    """One line naming every suite, for ``scaleattn --help``.

    Examples
    --------
    >>> summary()
    'benchmarks: core (default), tensor, gpu, krylov, solve, stream; or --vs adamw'
    'benchmarks: core (default), tensor, gpu, krylov, solve, certified; or --vs adamw'
    """
    names = list(SUITES)
    return (f"benchmarks: {names[0]} (default), {', '.join(names[1:])}; or "
            + ", ".join(f"--vs {v}" for v in VERSUS))


def suite_help() -> str:
    """What each suite measures, for ``scaleattn bench --help``."""
    first = next(iter(SUITES))
    return "; ".join(f"{name}: {what}{' (default)' if name == first else ''}" for name, (_, what) in SUITES.items())
