"""The ``scaleattn`` commands: each validates its options, opens its inputs, runs, and prints its result.
Errors propagate to :func:`scaleattn.cli.main`, which turns them into one line and an exit code."""
from __future__ import annotations

import sys
import time
import warnings

from .._params import parse_storage_options
from ..errors import Note, ParameterError, StorageError
from ..store._location import check_kind, check_storage_options, options_for

__all__ = ["COMMANDS"]


def _storage_options(pairs, *paths) -> dict | None:
    """``--storage-option KEY=VALUE`` pairs -> fsspec options (:func:`scaleattn._params.parse_storage_options`),
    refused when none of the command's ``paths`` is a URL (:func:`scaleattn.store._location.check_storage_options`)."""
    check_storage_options(pairs, *paths)
    return parse_storage_options(pairs)


def _cluster(args, reporter=None):
    """The client of this command: None with ``--local``, else :func:`scaleattn.distributed.cluster.connect`."""
    import contextlib

    if getattr(args, "local", False):
        return contextlib.nullcontext(None)
    if getattr(args, "solver", None) == "stream" and not (getattr(args, "scheduler", None)
                                                          or getattr(args, "workers", None)):
        return contextlib.nullcontext(None)  # passes over the tokens in this process unless a cluster is asked for
    from ..distributed.cluster import connect, tls_security

    security = tls_security(args.tls_ca_file, args.tls_cert, args.tls_key)
    return connect(args.scheduler, args.workers, args.threads_per_worker or 1, args.gpus, security=security,
                   quiet=args.quiet, progress=reporter, scheduler_timeout=args.scheduler_timeout,
                   worker_timeout=args.worker_timeout, debug=args.debug)


#: the cluster options (dests) that --local, which runs without Dask, would ignore
_CLUSTER_ONLY = ("scheduler", "scheduler_timeout", "worker_timeout", "workers", "threads_per_worker", "gpus",
                 "tls_ca_file", "tls_cert", "tls_key")


def _check_cluster_args(args) -> None:
    """Cluster options that cannot work, refused before anything starts: with --local (no cluster), any of them
    (it was ignored without a word); else too many workers for this machine."""
    from .parser import option_of

    if getattr(args, "local", False):
        given = [option_of(args, dest) for dest in _CLUSTER_ONLY if getattr(args, dest) is not None]
        if given:
            raise ParameterError(f"--local runs in this process without Dask: it cannot be combined with"
                                 f" {', '.join(given)} (cluster option{'s' if len(given) > 1 else ''}): drop"
                                 f" {'them' if len(given) > 1 else 'it'} or --local")
    elif not (args.scheduler or args.gpus):
        from ..distributed.cluster import check_workers

        check_workers(args.workers, args.threads_per_worker or 1)


def _reporter(args):
    """Progress on stderr unless ``--quiet`` or ``--json``."""
    from ..display._progress import as_reporter

    return as_reporter(not (args.quiet or getattr(args, "json", False)))


class StdoutClosed(Exception):
    """Standard output's reader has gone (``| head``): what the command wrote to files is complete."""


def _out(text: str) -> None:
    """Print a result on standard output. A reader that left raises :class:`StdoutClosed` (the CLI exits 141,
    silently); any other failure to write there (a full disk, ``> /dev/full``) one
    :class:`~scaleattn.errors.StorageError` line, not an internal error."""
    try:
        print(text, flush=True)
    except BrokenPipeError as e:
        raise StdoutClosed() from e
    except OSError as e:
        raise StorageError(f"cannot write the result to standard output: {e.strerror or e}") from e


def _emit(args, payload: dict, text: str) -> None:
    """The result on stdout: JSON with ``--json``, else the summary text (``--quiet`` silences stderr only)."""
    from ..store._formats import dumps

    _out(dumps(payload) if args.json else text)


def _wrote(path, ds) -> str:
    """``wrote PATH: N=... T=... d=... d_out=... causal=...`` with the path as the user gave it."""
    return f"wrote {path}: N={ds.n_samples} T={ds.length} d={ds.d} d_out={ds.d_out} causal={ds.causal}"


def _since(t0: float) -> float:
    return time.perf_counter() - t0


def _cmd_generate(args) -> int:
    from .. import generate

    opts = _storage_options(args.storage_option, args.path)
    if args.task == "mhla":
        ds = generate.generate_mhla(args.path, args.d, args.heads, args.length, args.samples, d_out=args.d_out,
                                    noise=args.noise, causal=args.causal, variable_lengths=args.variable_lengths,
                                    seed=args.seed, teacher_seed=args.teacher_seed, chunk_samples=args.chunk_samples,
                                    overwrite=args.overwrite, storage_options=opts)
    else:
        ds = generate.generate_assoc(args.path, args.pairs, args.samples, dim=args.dim, orthogonal=args.orthogonal,
                                     seed=args.seed, chunk_samples=args.chunk_samples, overwrite=args.overwrite,
                                     storage_options=opts)
    args.written = args.path
    _out(_wrote(args.path, ds))
    return 0


def _cmd_import(args) -> int:
    from .. import importers
    from .parser import option_of

    opts = _storage_options(args.storage_option, args.path)
    kw = dict(overwrite=args.overwrite, storage_options=opts)
    given = [option_of(args, dest) for dest in ("length", "horizon", "step", "causal", "columns", "no_standardize")
             if getattr(args, dest) not in (None, False)]
    if given and not args.csv:  # (they were ignored without a word)
        source = "--npz" if args.npz else "--builtin"
        raise ParameterError(f"{', '.join(given)} {'are options' if len(given) > 1 else 'is an option'} of a --csv"
                             f" import (a series cut into windows): not used with {source}")
    for option, path, expected in (("--npz", args.npz, importers.NPZ), ("--csv", args.csv, importers.CSV)):
        if path is not None:  # (named by its option here; the library names the path alone)
            check_kind(path, option, expected, directory=False)
    if args.npz:
        ds = importers.import_arrays(args.path, args.npz, **kw)
    elif args.csv:
        ds = importers.import_csv(args.path, args.csv, length=16 if args.length is None else args.length,
                                  horizon=1 if args.horizon is None else args.horizon,
                                  step=1 if args.step is None else args.step, causal=args.causal,
                                  columns=args.columns, standardize_columns=not args.no_standardize, **kw)
        if not args.no_standardize:  # a change of units the user did not ask for: said, and how to undo it
            warnings.warn("each column was z-scored (its mean and std are in the dataset's attribute 'standardized':"
                          " value * std + mean maps tokens and predictions back); --no-standardize keeps the CSV's"
                          " units", Note, stacklevel=1)
    else:
        ds = importers.load_digits_dataset(args.path, **kw)
    args.written = args.path
    _out(_wrote(args.path, ds))
    return 0


def _cmd_fit(args) -> int:
    from .._backend import check_device
    from .._params import heads_spec, real
    from ..display._text import fit_summary
    from ..linalg._certificate import check_cutoff
    from ..linalg._solver import check_ridge
    from ..pipeline import fit, validation_split
    from ..preflight import holding, preflight, run_locations

    reporter = _reporter(args)
    opts = _storage_options(args.storage_option, args.dataset, args.out, args.checkpoint)
    heads = heads_spec(args.heads)  # bad options and bad input fail before a cluster starts
    check_cutoff(args.cutoff_rtol)
    check_ridge(args.ridge)
    check_device(args.device, need_gpu_here=not (args.scheduler or args.gpus))
    _check_cluster_args(args)
    ds = preflight(args.dataset, args.out, args.overwrite, opts, checkpoint=args.checkpoint, resume=args.resume,
                   fill_absent_chunks=args.fill_absent_chunks)
    validation_split(ds.n_samples, real("validation", args.validation, 0.0, 1.0, high_open=True))
    ckpt = run_locations(ds, args.out, args.checkpoint, opts)[1]
    if args.resume and not args.overwrite and (ckpt is None or not ckpt.exists()):  # (then a whole fit follows)
        where = f"at {args.checkpoint}" if args.checkpoint else f"for {args.out}"
        # a Note: one line ``PROG: note: ...`` (scaleattn.cli's warning lines), not --quiet's to silence
        warnings.warn(f"no checkpoint {where} yet: starting from the beginning", Note, stacklevel=1)
    t = time.perf_counter()
    with holding(ds, args.out, args.checkpoint, opts), _cluster(args, reporter) as client:
        cluster_s = None if client is None else _since(t)
        t = time.perf_counter()
        res = fit(ds, args.out, client=client, heads=heads, cutoff_rtol=args.cutoff_rtol, ridge=args.ridge,
                  solver=args.solver, certificate=args.certificate, exact_mse=not args.no_exact_mse,
                  overwrite=args.overwrite, progress=reporter,
                  storage_options=opts, device=args.device, plots=not args.no_plots, resume=args.resume,
                  checkpoint=args.checkpoint, keep_checkpoint=args.keep_checkpoint, validation=args.validation,
                  **({} if args.heads_budget is None else {"heads_budget": args.heads_budget}))
        args.written = args.out  # complete: an interrupt from here on (printing, closing the cluster) loses nothing
        # the fit's own time ends with its report; writing the run (and rendering the plots) comes after
        command = {"seconds": _since(args.started), "cluster": cluster_s, "write": _since(t) - res.report["seconds"]}
        written = ", ".join(n for n in res.files if not n.endswith(".png"))
        pngs = ", *.png" if any(n.endswith(".png") for n in res.files) else ""
        _emit(args, {**res.report, "command": command},  # before the cluster closes: no silence after the fit
              fit_summary(res.report, command) + f"\nwrote {args.out}/{written}{pngs}")
    return 0


def _cmd_certify(args) -> int:
    from ..display._text import certificate_summary
    from ..linalg._certificate import check_cutoff
    from ..pipeline import certify_dataset
    from ..preflight import open_input

    reporter = _reporter(args)
    opts = _storage_options(args.storage_option, args.dataset)
    check_cutoff(args.cutoff_rtol)
    _check_cluster_args(args)
    ds = open_input(args.dataset, opts, fill_absent_chunks=args.fill_absent_chunks)
    with _cluster(args, reporter) as client:
        cert = certify_dataset(ds, client=client, cutoff_rtol=args.cutoff_rtol, progress=reporter, solver=args.solver,
                               certificate=args.certificate)
        _emit(args, cert.summary(), certificate_summary(cert.summary()))
    return 0


def _cmd_evaluate(args) -> int:
    from ..display._text import evaluation_summary
    from ..distributed.evaluate import evaluate
    from ..model import MHLAModel
    from ..preflight import open_input

    reporter = _reporter(args)
    opts = _storage_options(args.storage_option, args.model, args.dataset)
    _check_cluster_args(args)
    model = MHLAModel.load(args.model, options_for(args.model, opts))
    ds = open_input(args.dataset, opts, fill_absent_chunks=args.fill_absent_chunks)
    with _cluster(args, reporter) as client:
        r = evaluate(model, ds, client, progress=reporter)
        _emit(args, r, evaluation_summary(r))
    return 0


def _cmd_plot(args) -> int:
    import posixpath

    from ..plot import save_run_plots

    # (without --dataset the report's dataset, maybe a URL, is read with them: save_run_plots checks them then)
    opts = _storage_options(args.storage_option, *((args.run, args.out, args.dataset) if args.dataset else ()))
    where = (args.out or args.run).rstrip("/")
    paths = save_run_plots(args.run, args.out, dataset=args.dataset, storage_options=opts,
                           full_spectrum=args.full_spectrum)
    args.written = f"{len(paths)} plots in {where}"
    for p in paths:
        _out(f"wrote {where}/{posixpath.basename(p)}")  # the directory as the user gave it
    return 0


def _cmd_bench(args) -> int:
    import glob
    import importlib
    import os
    import tempfile

    from ..bench import SUITES, VERSUS

    run = importlib.import_module(VERSUS[args.vs][0] if args.vs else SUITES[args.suite][0]).run

    from ..store._location import resolve
    from ..store._outputs import check_output_location

    if args.only is not None and (args.suite != "krylov" or args.vs):
        raise ParameterError("--only chooses a part of the krylov suite: use it with `scaleattn bench krylov`")
    check_output_location(resolve(args.out), "--out", local_only=True, into=True)  # (local files only)
    try:  # before minutes of work, not after: the folder, and a file in it
        os.makedirs(args.out, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=args.out, prefix=".probe-"):
            pass
    except OSError as e:
        raise StorageError(f"cannot write --out {args.out}: {e.strerror or e}") from e
    run(args.out, quick=args.quick, **({} if args.only is None else {"only": args.only}))

    for md in sorted(glob.glob(os.path.join(args.out, "*.md"))):  # the tables, also kept next to the JSON
        with open(md) as f:
            _out(f.read())
    print(f"results in {args.out}/", file=sys.stderr)
    return 0


def _cmd_compare(args) -> int:
    from .._params import real
    from ..display._text import comparison_summary
    from ..heads._algebra import compare_models
    from ..model import MHLAModel

    opts = _storage_options(args.storage_option, args.model_a, args.model_b)
    real("rtol", args.rtol, 0.0, low_open=True)  # compare_models' check, before the models are read
    a, b = (MHLAModel.load(m, options_for(m, opts)) for m in (args.model_a, args.model_b))
    r = compare_models(a, b, args.rtol)
    _emit(args, r, comparison_summary(r))
    return 0 if r["equivalent"] else 1


def _cmd_submit(args) -> int:
    from .. import submit

    _check_fit_args(args.fit_args)
    return submit.run(args)


def _check_fit_args(text: str) -> None:
    """``submit --fit-args`` go to ``scaleattn fit`` in the runner pod: parsed here as that fit will parse them,
    so that a typo fails now, in one line, not in a pod minutes later (an unclosed quote: submit says so)."""
    import contextlib
    import io
    import shlex

    from .._params import heads_spec
    from .parser import parse

    try:
        extra = shlex.split(text or "")
    except ValueError:
        return
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            fit = parse(["fit", "DATASET", "--out", "OUT", *extra])
        heads_spec(fit.heads)  # (the one value fit checks only once it runs)
    except SystemExit as e:
        why = said.getvalue().strip().splitlines()
        why = "it asks for help" if e.code == 0 or not why else why[-1].removeprefix("scaleattn fit: error: ")
        raise ParameterError(f"--fit-args {text!r}: not options `scaleattn fit` takes: {why.rsplit(' (see ', 1)[0]}"
                             ) from None
    except ParameterError as e:
        raise ParameterError(f"--fit-args {text!r}: --{e}") from None


COMMANDS = {"generate": _cmd_generate, "import": _cmd_import, "fit": _cmd_fit, "certify": _cmd_certify,
            "compare": _cmd_compare, "evaluate": _cmd_evaluate, "plot": _cmd_plot, "bench": _cmd_bench,
            "submit": _cmd_submit}
