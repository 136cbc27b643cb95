"""The ``scaleattn`` argument parser: every command's options, with units and defaults."""
from __future__ import annotations

import argparse
import re

from .._backend import DEVICES
from .._params import int_at_least, positive_seconds, seed
from .._version import __version__
from ..linalg._qr import CERTIFICATE_METHODS, QR_MAX_PSI
from ..linalg._stream import FIT_SOLVERS
from ..store._names import one_line

__all__ = ["build_parser"]


_positive_int = int_at_least(1)  # argparse type of --workers, --gpus, ...


def _add_cluster_args(p):
    g = p.add_argument_group("cluster")
    g.add_argument("--scheduler", metavar="ADDRESS",
                   help="join a running Dask scheduler (tcp://HOST:8786 or tls://...); default $DASK_SCHEDULER_ADDRESS,"
                        " else an embedded local cluster")
    g.add_argument("--scheduler-timeout", type=positive_seconds, default=None, metavar="SECONDS",
                   help="keep trying to reach --scheduler this long, also while the connection is refused (default:"
                        " no retry: a refused connection or an unknown host fails at once; no answer at all after"
                        " dask's distributed.comm.timeouts.connect, 30 s); for jobs whose scheduler may start after"
                        " the client")
    g.add_argument("--worker-timeout", type=positive_seconds, default=None, metavar="SECONDS",
                   help="with --scheduler: fail unless a worker joins within this time (default: no wait)")
    g.add_argument("--workers", type=_positive_int, default=None, metavar="N",
                   help="worker processes of the embedded cluster (default: one per core)")
    g.add_argument("--threads-per-worker", type=_positive_int, default=None, metavar="N",  # None: not given
                   help="threads per worker (default 1)")
    g.add_argument("--gpus", type=_positive_int, default=None, metavar="N",
                   help="start a dask-cuda cluster with N GPU workers (needs the gpu extra)")
    g.add_argument("--local", action="store_true", help="run in this process without Dask (small data, debugging)")
    g.add_argument("--tls-ca-file", metavar="PEM", default=None,
                   help="TLS: CA certificate; with --tls-cert/--tls-key all Dask traffic is encrypted (the embedded"
                        " cluster too). Default: the dask config distributed.comm.tls.*")
    g.add_argument("--tls-cert", metavar="PEM", default=None,
                   help="TLS: certificate of this client (and embedded cluster)")
    g.add_argument("--tls-key", metavar="PEM", default=None, help="TLS: private key of --tls-cert")


def _add_absent_arg(p):
    p.add_argument("--absent-chunks-are-fill", dest="fill_absent_chunks", action="store_true",
                   help="for a dataset written by another tool: chunks absent from the store mean the fill value"
                        " (by default they are refused, naming the array and the samples)")


def _add_io_args(p, out=True):
    if out:
        p.add_argument("--overwrite", action="store_true",
                       help="replace the output if it exists (only what scaleattn wrote; never an input)")
    p.add_argument("--storage-option", action="append", metavar="KEY=VALUE", default=None,
                   help="fsspec option for s3:// and other URLs (repeatable), e.g. endpoint_url=http://...")


def _add_solver_args(p):
    """The cutoff, the solver path and the certificate method (fit and certify)."""
    p.add_argument("--cutoff-rtol", "--rtol", dest="cutoff_rtol", type=float, default=None,
                   help="relative eigenvalue cutoff in (0, 1) (default 16*psi*eps; --rtol is its old name)")
    p.add_argument("--solver", choices=list(FIT_SOLVERS), default="auto",
                   help="auto (default): eigh up to psi = 2,000, then Cholesky + Lanczos (extreme eigenvalues only),"
                        " then krylov past psi = 20,000 or when the dense path does not fit in memory, and the dual"
                        " (an N x N kernel) for fewer rows than features past psi = 2,000; eigh: the whole"
                        " spectrum of Lambda_D at any psi (slower); krylov: matrix-free CG and Lanczos on the"
                        " compact Gram, G never formed; stream: no statistics, CG and the certificate from passes"
                        " over the tokens in this process (svd heads, no stats.zarr)")
    _add_certificate_arg(p)


def _add_certificate_arg(p):
    p.add_argument("--certificate", choices=list(CERTIFICATE_METHODS), default="auto",
                   help="what decides the rank: auto (default; a QR of the features, a second data pass, only when"
                        f" the Gram cannot certify and psi <= {QR_MAX_PSI:,}), gram (the Gram only), qr (always the"
                        " QR)")


def _add_output_args(p):
    p.add_argument("--json", action="store_true",
                   help="print the result as JSON on stdout instead of the summary (nothing else on stderr but errors)")
    p.add_argument("--quiet", action="store_true",
                   help="nothing on stderr but errors and warnings: no cluster lines, progress bars or phase times;"
                        " the result (summary, or JSON with --json) is still printed on stdout")


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line (the command's usage block, 13 lines for ``fit``, came
    before it) naming where the whole usage is; its subcommands' parsers are of this class too. A value with an
    exponent or ``-inf`` (``--ridge -1e-3``) is a negative number, as ``-1`` is, not an option: argparse's own
    pattern answered "expected one argument" instead of the option's check."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$", re.I)

    def error(self, message: str):
        self.exit(2, one_line(f"{self.prog}: error: {message}{_suggestion(message)} (see {self.prog} --help)") + "\n")


def _suggestion(message: str) -> str:
    """`` (did you mean 'fit'?)`` for argparse's "invalid choice: 'fitt' (choose from 'generate', 'fit', ...)"
    (a mistyped command, task or option value), as an unknown option gets its closest match; else empty."""
    import difflib

    m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
    if not m:
        return ""
    choices = [c.strip().strip("'") for c in m.group(2).split(",")]  # quoted (3.11) or not (3.12.8+, 3.13)
    close = difflib.get_close_matches(m.group(1), choices, 1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="scaleattn",
        description="Learn multi-head linear attention by certified least squares on Dask [Yau et al. 2025].",
    )
    parser.add_argument("--version", action="version", version=f"scaleattn {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="write a synthetic dataset (mhla teacher or associative memory)")
    gsub = gen.add_subparsers(dest="task", required=True, metavar="TASK")
    m = gsub.add_parser("mhla", help="realizable data from a random H-head MHLA teacher [Y25 Sec. 4.1]")
    m.add_argument("path", help="output dataset (Zarr group path or URL)")
    m.add_argument("--d", type=int, default=2, help="token dimension d (default 2)")
    m.add_argument("--heads", type=int, default=1, help="teacher heads H (default 1)")
    m.add_argument("--length", type=int, default=100, help="tokens per sequence T (default 100)")
    m.add_argument("--samples", type=int, default=512, help="sequences N (default 512)")
    m.add_argument("--d-out", type=int, default=None, help="output dimension (default d)")
    m.add_argument("--noise", type=float, default=0.0, help="std of Gaussian target noise (default 0)")
    m.add_argument("--causal", action="store_true", help="targets at every prefix (N, T, d_out)")
    m.add_argument("--variable-lengths", action="store_true", help="random lengths in [1, T], zero padded")
    m.add_argument("--seed", type=seed, default=0,
                   help="random seed of the tokens, and of the teacher unless --teacher-seed (default 0)")
    m.add_argument("--teacher-seed", type=seed, default=None, metavar="SEED",
                   help="random seed of the teacher alone (default: --seed): test data of the same teacher on new"
                        " tokens is --teacher-seed S --seed S2 with the training data's S and any other S2")
    m.add_argument("--chunk-samples", type=int, default=None, help="sequences per Zarr chunk (default ~4 MB chunks)")
    _add_io_args(m)
    a = gsub.add_parser("assoc", help="associative memory task [Y25 Sec. 4.2]")
    a.add_argument("path", help="output dataset")
    a.add_argument("--pairs", type=int, default=2, help="key-value pairs K (default 2)")
    a.add_argument("--dim", type=int, default=None, help="key/value dimension (default K); tokens have 2*dim")
    a.add_argument("--samples", type=int, default=2**14, help="sequences (default 16384)")
    a.add_argument("--orthogonal", action="store_true", help="orthogonal keys and values: not identifiable")
    a.add_argument("--seed", type=seed, default=0, help="random seed of the keys, values and queries (default 0)")
    a.add_argument("--chunk-samples", type=int, default=None, help="sequences per Zarr chunk (default ~4 MB chunks)")
    _add_io_args(a)

    imp = sub.add_parser("import",
                         help="turn user arrays or a time-series CSV (or a built-in real dataset) into a dataset")
    imp.add_argument("path", help="output dataset")
    src = imp.add_mutually_exclusive_group(required=True)
    src.add_argument("--npz", metavar="FILE",
                     help=".npz with arrays tokens (N,T,d), targets, optional lengths; or a .npy of tokens")
    src.add_argument("--csv", metavar="FILE", help="CSV of a multivariate time series (header row), cut into windows")
    src.add_argument("--builtin", choices=["digits"],
                     help="digits: scikit-learn's 8x8 digits, 7 pixel rows predict the 8th")
    # (defaults None: not given, so that --npz and --builtin can refuse them; the CSV import fills them in)
    imp.add_argument("--length", type=int, default=None, help="CSV: tokens per window (default 16)")
    imp.add_argument("--horizon", type=int, default=None, help="CSV: steps ahead to predict (default 1)")
    imp.add_argument("--step", type=int, default=None, help="CSV: stride between windows (default 1)")
    imp.add_argument("--causal", action="store_true", help="CSV: predict the next value at every prefix")
    imp.add_argument("--columns", nargs="+", default=None, help="CSV: columns to use (default all)")
    imp.add_argument("--no-standardize", action="store_true",
                     help="CSV: keep the values in the file's units (default: each column z-scored, its mean and std"
                          " kept in the dataset's attribute 'standardized' to map predictions back)")
    _add_io_args(imp)

    f = sub.add_parser("fit", help="fit MHLA by least squares on Dask, certify identifiability, recover heads")
    f.add_argument("dataset", help="dataset (Zarr group path or URL)")
    f.add_argument_group("required").add_argument(
        "--out", required=True, help="run directory: report.json, model.zarr, stats.zarr, spectrum.zarr and PNG plots")
    f.add_argument("--heads", default="svd", help="svd (paper's Alg. 1), minimal, or a head count H (default svd)")
    f.add_argument("--heads-budget", type=positive_seconds, default=None, metavar="SECONDS",
                   help="time budget of the head search for minimal / H (default 60; the report says when it ran"
                        " out)")
    _add_solver_args(f)
    f.add_argument("--ridge", type=float, default=0.0, metavar="LAMBDA",
                   help="ridge on features scaled to unit mean square, for noisy or short data, at most 1e12"
                        " (default 0)")
    f.add_argument("--validation", type=float, default=0.0, metavar="FRACTION",
                   help="hold out the last FRACTION of the samples (whole samples, e.g. 0.2): left out of the fit,"
                        " their MSE is reported as validation MSE next to the train MSE (default 0: fit them all)")
    f.add_argument("--no-exact-mse", action="store_true",
                   help="skip the evaluation pass; train MSE from the statistics (round-off: train_mse_stats_floor;"
                        " the pass still runs where that round-off passes 1e-6 of the mean y^2)")
    f.add_argument("--device", choices=list(DEVICES), default="auto", help="worker array device (default auto)")
    f.add_argument("--resume", action="store_true",
                   help="continue an interrupted fit from its checkpoint: finished row groups (--solver stream: the"
                        " first sweep and the finished data passes) are not recomputed")
    f.add_argument("--checkpoint", metavar="PATH", default=None,
                   help="checkpoint store of the statistics build, or of the data passes with --solver stream"
                        " (default OUT.checkpoint.zarr next to --out)")
    f.add_argument("--keep-checkpoint", action="store_true", help="keep the checkpoint after a successful fit")
    f.add_argument("--no-plots", action="store_true", help="do not write the PNG plots next to report.json")
    _add_absent_arg(f)
    _add_cluster_args(f)
    _add_io_args(f)
    _add_output_args(f)

    c = sub.add_parser("certify", help="identifiability certificate only (Gram matrix, no targets needed)")
    c.add_argument("dataset", help="dataset (Zarr group path or URL)")
    _add_solver_args(c)
    _add_absent_arg(c)
    _add_cluster_args(c)
    _add_io_args(c, out=False)
    _add_output_args(c)

    about = ("distance ||c(A) - c(B)|| of two models and whether they compute the same function (exit 0 same,"
             " 1 different, 2 when they cannot be compared: a store that is no model, different d or d_out, a bad"
             " option; a bug exits 1 too, with its 'internal error' line on stderr)")
    cmp_ = sub.add_parser("compare", help=about, description=about)
    cmp_.add_argument("model_a", metavar="MODEL_A", help="model store (RUN/model.zarr)")
    cmp_.add_argument("model_b", metavar="MODEL_B", help="model store")
    cmp_.add_argument("--rtol", type=float, default=1e-8,
                      help="equivalent when the distance is at most RTOL x the larger coefficient norm (default 1e-8)")
    _add_io_args(cmp_, out=False)
    _add_output_args(cmp_)

    e = sub.add_parser("evaluate", help="mean squared error of a model on a dataset")
    e.add_argument("model", help="model store (RUN/model.zarr)")
    e.add_argument("dataset", help="dataset (Zarr group path or URL) to measure the model's MSE on")
    _add_absent_arg(e)
    _add_cluster_args(e)
    _add_io_args(e, out=False)
    _add_output_args(e)

    pl = sub.add_parser("plot",
                        help="PNG plots of a run: spectrum of Lambda_D, head spectrum, loss vs heads, predictions")
    pl.add_argument("run", metavar="RUN_DIR", help="run directory written by `scaleattn fit`")
    pl.add_argument("--out", default=None, metavar="DIR", help="where to write the PNG files (default RUN_DIR)")
    pl.add_argument("--dataset", default=None,
                    help="dataset for the predictions plot (default: the one recorded in report.json)")
    pl.add_argument("--full-spectrum", action="store_true",
                    help="recompute the whole spectrum from stats.zarr for spectrum.png at any psi (a run without"
                         " spectrum.zarr, psi > 2,000: by default only up to psi = 4,000; eigh, minutes past it)")
    _add_io_args(pl, out=False)

    from .. import bench  # (the one list of the suites)

    b = sub.add_parser("bench", help=bench.summary())
    b.add_argument("suite", nargs="?", default=next(iter(bench.SUITES)), choices=list(bench.SUITES),
                   help=bench.suite_help())
    b.add_argument("--out", default="bench-out", help="directory for the JSON and markdown results (default bench-out)")
    b.add_argument("--quick", action="store_true", help=bench.QUICK_HELP)
    b.add_argument("--only", default=None,
                   choices=["solvers", "heads", "cluster", "fit", "products", "preconditioners"],
                   help="krylov suite: one part (solvers: krylov vs Cholesky at d = 32; heads: the heads step at"
                        " d = 44; cluster: the cluster-side operator; fit: the whole certified fit at d = 44;"
                        " products: one product G X of the operator, numpy path vs compiled kernel, d = 32 and 44;"
                        " preconditioners: passes of block-Jacobi and K-FAC, d = 16, 24, 32)")
    b.add_argument("--vs", choices=list(bench.VERSUS), default=None,
                   help="; ".join(f"{name}: {what}" for name, (_, what) in bench.VERSUS.items()))

    from .. import submit

    s = sub.add_parser("submit", help="send a fit as a DaskJob to a Kubernetes cluster (dask-kubernetes operator)")
    submit.add_arguments(s)
    for command in _commands(parser):  # --debug after the command too ("scaleattn fit ... --debug")
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show tracebacks on errors")
    return parser


def _subcommands(parser: argparse.ArgumentParser) -> tuple[str | None, dict]:
    """The ``dest`` of ``parser``'s subcommands and their parsers by name (None, {} when it has none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.dest, action.choices
    return None, {}


def _commands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every (sub)command's parser below ``parser``, depth first."""
    return [q for p in dict.fromkeys(_subcommands(parser)[1].values())  # (aliases map to the same parser)
            for q in (p, *_commands(p))]


def _reached(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost (sub)command's parser that ``args`` reached (``scaleattn generate mhla``'s, say)."""
    while (sub := _subcommands(parser))[1] and getattr(args, sub[0], None) in sub[1]:
        parser = sub[1][getattr(args, sub[0])]
    return parser


def option_of(args: argparse.Namespace, dest: str) -> str | None:
    """The command line option of ``args``' command that sets ``dest`` (``"cutoff_rtol"`` -> ``"--cutoff-rtol"``),
    or None (a positional argument, or no such option): errors raised by the library name its parameters, the
    CLI names them as its user typed them."""
    action = option_action(args, dest)
    return None if action is None else max(action.option_strings, key=len)


def positional_of(args: argparse.Namespace, dest: str) -> str | None:
    """The name the usage line gives the positional argument ``dest`` of ``args``' command (``DATASET``), or
    None."""
    for action in _reached(build_parser(), args)._actions:
        if action.dest == dest and not action.option_strings:
            return action.metavar if isinstance(action.metavar, str) else dest.upper()
    return None


def option_action(args: argparse.Namespace, dest: str) -> argparse.Action | None:
    """The argparse action of the option of :func:`option_of` (its ``nargs`` 0: a flag), or None."""
    for action in _reached(build_parser(), args)._actions:
        if action.dest == dest and action.option_strings:
            return action
    return None


def _misplaced(parser: argparse.ArgumentParser, argv: list[str]):
    """``(the parser that reports it, the error)`` for the first option given before its (sub)command that the
    parser at that point does not take, or None: argparse read ``scaleattn --local fit ...`` as "--local ...
    did you mean --local?", ``scaleattn generate --seed=3 mhla`` as "did you mean --seed?", and ``scaleattn
    --bogus`` as a missing COMMAND. An option of some commands below is told to go after the command; any other
    is named."""
    import difflib

    level, words, value_next = parser, [], False
    for i, arg in enumerate(argv):
        subs = _subcommands(level)[1]
        if not subs or arg == "--":  # a command's own options: its parse reports them
            return None
        if arg in subs:
            level = subs[arg]
            words.append(arg)
            continue
        option = arg.split("=")[0]
        known = {o: a for a in level._actions for o in a.option_strings}
        if value_next:  # the value of this level's option before it
            value_next = False
            continue
        if not arg.startswith("-"):  # where the (sub)command goes: a mistyped one, whatever options follow it
            dest, _ = _subcommands(level)
            choices = ", ".join(repr(c) for c in subs)
            return level, f"argument {dest.upper()}: invalid choice: {arg!r} (choose from {choices})"
        if option in known:
            value_next = "=" not in arg and known[option].nargs != 0
            continue
        owners = _owners(level, option)
        if not owners:  # the closest option of this level or of a command below (``--hedas fit``: ``--heads``)
            below = {o for q in _commands(level) for a in q._actions for o in a.option_strings}
            close = difflib.get_close_matches(option, sorted(set(known) | below), 1)
            hint = "" if not close else f" (did you mean {close[0]}?)" if close[0] in known else (
                f" (did you mean {close[0]}, an option of {_listed(_owners(level, close[0]))}? put it after the"
                " command)")
            return level, f"unrecognized arguments: {arg}{hint}"
        sub = level
        for a in argv[i + 1:]:  # the command given after it (``generate mhla``), if any
            if a in _subcommands(sub)[1]:
                words.append(a)
                sub = _subcommands(sub)[1][a]
            elif sub is not level:
                break
        if _subcommands(sub)[1]:
            words.append(_subcommands(sub)[0].upper())  # COMMAND, TASK: the one still to choose
        return level, f"{option} is an option of {_listed(owners)}: put it after the command: scaleattn" \
                      f" {' '.join(words)} {arg} ..."
    return None


#: how close (difflib's ratio) an unknown option must be to one of its command's own to be suggested before the
#: options of other commands: ``--cvs``/``--csv`` 0.8, ``--hedas``/``--heads`` 0.86, ``--outt``/``--quiet`` 0.62
OWN_CLOSE = 0.75
#: and to another command's to be named (``--outt``/``--out`` 0.91; ``--nope``/``--noise`` 0.77 is no guess)
OTHER_CLOSE = 0.8


def _closest(parser: argparse.ArgumentParser, command: argparse.ArgumentParser, extra: list[str]) -> str:
    """What the first unknown option of ``command`` was probably meant to be: `` (did you mean --heads?)`` for
    the closest of its own options, or, where the option (or the closest one) belongs to other commands only
    (``certify --out``), `` (--out is an option of the commands (fit, ...), not of scaleattn certify)``: never a
    look-alike of another meaning (``--out`` -> ``--quiet``); empty when nothing is close."""
    import difflib

    own = {o for a in command._actions for o in a.option_strings if o.startswith("--")}
    everywhere = own | {o for q in _commands(parser) for a in q._actions for o in a.option_strings
                        if o.startswith("--")}
    here = command.prog.removeprefix("scaleattn ")
    for e in (e.split("=")[0] for e in extra if e.startswith("-")):
        # a close option of this command first (--cvs: --csv, not bench's --vs); a mere look-alike of it (--outt:
        # --quiet) gives way to another command's much closer one (--out)
        close = [e] if e in everywhere else (difflib.get_close_matches(e, sorted(own), 1, OWN_CLOSE)
                                             or difflib.get_close_matches(e, sorted(everywhere), 1, OTHER_CLOSE))
        if not close:
            continue
        if close[0] in own:
            return f" (did you mean {close[0]}?)"
        owners = [o for o in _owners(parser, close[0]) if o != here]
        said = "" if close[0] == e else f"did you mean {close[0]}? "
        return f" ({said}{close[0]} is an option of {_listed(owners)}, not of {command.prog})"
    return ""


def _owners(level: argparse.ArgumentParser, option: str) -> list[str]:
    """The commands below ``level`` that take ``option`` (``["generate mhla", "generate assoc"]``)."""
    return [q.prog.removeprefix("scaleattn ") for q in _commands(level)
            if any(option in a.option_strings for a in q._actions)]


def _listed(commands: list[str]) -> str:
    """``the command (fit)`` or ``the commands (fit, certify)``."""
    return f"the command{'s' if len(commands) > 1 else ''} ({', '.join(commands)})"


def _lenient(parser: argparse.ArgumentParser, argv):
    """``parser.parse_known_args(argv)`` with no option required: an unknown option (``--outt``) is then said with
    its "did you mean --out?", not as "the following arguments are required: --out". ``--help`` parses as it is:
    its usage line shows the required options without brackets."""
    import sys

    if {"-h", "--help"} & set(sys.argv[1:] if argv is None else argv):
        return parser.parse_known_args(argv)
    actions = [a for q in _commands(parser) for a in q._actions if a.required and a.option_strings]
    groups = [g for q in _commands(parser) for g in q._mutually_exclusive_groups if g.required]
    for x in actions + groups:
        x.required = False
    try:
        return parser.parse_known_args(argv)
    finally:
        for x in actions + groups:
            x.required = True


def parse(argv=None) -> argparse.Namespace:
    """The command line parsed; an unknown option is reported by the command it was given to (its usage, and the
    closest of its options: "--hedas" -> "did you mean --heads?"), not by the top-level parser; one before its
    command by the parser it was given to (:func:`_misplaced`). ``args.prog`` is the command as its errors name it
    (``scaleattn generate mhla``)."""
    import sys

    parser = build_parser()
    misplaced = _misplaced(parser, list(sys.argv[1:] if argv is None else argv))
    if misplaced:
        misplaced[0].error(misplaced[1])
    args, extra = _lenient(parser, argv)
    if not extra:  # again, now saying what a required option lacks
        args, extra = parser.parse_known_args(argv)
    command = _reached(parser, args)
    if extra:
        command.error(f"unrecognized arguments: {' '.join(extra)}{_closest(parser, command, extra)}")
    args.prog = command.prog
    return args
