"""The command line of ``scaleattn submit`` (``scaleattn.cli`` adds these options to its sub-parser)."""
from __future__ import annotations

import argparse
import secrets
import shlex
import sys

from .._params import positive_seconds, storage_option_pairs
from .._version import __version__
from ..errors import ParameterError, ScaleattnError
from .follow import apply_daskjob, runner_exit_code
from .manifest import (
    DEFAULT_NAME,
    DEFAULT_NAMESPACE,
    DEFAULT_SECRET,
    IMAGE_NAME,
    REGISTRY_ENV,
    SCHEDULER_TIMEOUT,
    WORKER_TIMEOUT,
    registry_of,
    render_daskjob,
    to_yaml,
)

__all__ = ["add_arguments", "run", "main"]

def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``scaleattn submit`` (``scaleattn.cli`` adds them to its ``submit`` sub-parser)."""
    parser.add_argument("dataset", metavar="DATASET", help="dataset URL, s3://BUCKET/PATH.zarr")
    parser.add_argument("--out", required=True, metavar="URL", help="run directory URL, s3://BUCKET/PATH")
    parser.add_argument("--gpus", type=int, default=0, metavar="N",
                        help="GPUs per worker pod: 0 (default) runs CPU workers, N > 0 runs dask-cuda workers on the"
                             " GPU node pool")
    parser.add_argument("--workers", type=int, default=2, metavar="N", help="worker pods (default 2)")
    parser.add_argument("--image", default=None, metavar="IMAGE",
                        help=f"image of all pods (default REGISTRY/{IMAGE_NAME}:{__version__}-cpu, or -gpu with"
                             " --gpus)")
    parser.add_argument("--registry", default=None, metavar="REGISTRY",
                        help=f"registry of the default image, e.g. registry.example.com/ml (default ${REGISTRY_ENV});"
                             " without --image or a registry submit refuses: there is no public image")
    parser.add_argument("--namespace", default=DEFAULT_NAMESPACE, metavar="NS", help="namespace (default default)")
    parser.add_argument("--name", default=None, metavar="NAME",
                        help=f"DaskJob and Dask cluster name (default {DEFAULT_NAME}-<random>)")
    parser.add_argument("--secret", default=DEFAULT_SECRET, metavar="NAME",
                        help=f"Secret with the S3 credentials/endpoint as env vars (default {DEFAULT_SECRET});"
                             " '' for none")
    parser.add_argument("--storage-option", action="append", default=None, metavar="KEY=VALUE",
                        help="fsspec option passed to `scaleattn fit` (repeatable), e.g. endpoint_url=http://..."
                             " (credentials belong in the Secret)")
    parser.add_argument("--fit-args", default="", metavar="'ARGS'",
                        help="extra `scaleattn fit` options as one quoted string (default none), e.g. '--heads"
                             " minimal --no-plots' (a single option needs the = form: --fit-args=--no-plots); --resume"
                             " is always passed")
    parser.add_argument("--node-selector", action="append", default=None, metavar="KEY=VALUE",
                        help="nodeSelector of the worker pods (repeatable), e.g. nvidia.com/gpu.present=true"
                             " (default none: GPU workers go wherever nvidia.com/gpu is allocatable)")
    parser.add_argument("--scheduler-timeout", type=int, default=SCHEDULER_TIMEOUT, metavar="SECONDS",
                        help=f"how long the runner keeps trying to reach the scheduler (default {SCHEDULER_TIMEOUT})")
    parser.add_argument("--worker-timeout", type=int, default=WORKER_TIMEOUT, metavar="SECONDS",
                        help="the runner fails unless a worker joins within this time; the scheduler fails tasks"
                             f" that have had no worker this long (default {WORKER_TIMEOUT})")
    parser.add_argument("--deadline", type=int, default=None, metavar="SECONDS",
                        help="activeDeadlineSeconds of the runner pod: stop a fit that runs longer (default none)")
    parser.add_argument("--dry-run", action="store_true", help="print the DaskJob as YAML and send nothing")
    parser.add_argument("--no-follow", action="store_true", help="return once the DaskJob is created")
    parser.add_argument("--timeout", type=positive_seconds, default=None, metavar="SECONDS",
                        help="stop following after this long (the job keeps running)")
    parser.add_argument("--wait", action="store_true",
                        help="follow the job to its end and exit with the runner's exit code")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run ``scaleattn submit``; 0 on success or --dry-run, 1 when the job failed (with --wait: the runner's exit
    code), 2 on bad input, a refusal or no cluster."""
    # bad input, a refusal or no cluster raise ScaleattnError: the CLI prints it in its one error-line format
    # (options named as typed) and exits 2
    if args.wait and (args.no_follow or args.timeout is not None):
        raise ParameterError("--wait follows the job to its end: it cannot be combined with --no-follow or"
                             " --timeout")
    try:
        fit_args = shlex.split(args.fit_args or "")
    except ValueError as e:  # an unclosed quote
        raise ParameterError(f"--fit-args: {e} in {args.fit_args!r}") from None
    name = args.name or f"{DEFAULT_NAME}-{secrets.token_hex(3)}"
    manifest = render_daskjob(
        args.dataset, args.out, gpus=args.gpus, workers=args.workers, image=args.image, registry=args.registry,
        namespace=args.namespace, name=name, storage_options=storage_option_pairs(args.storage_option),
        fit_args=fit_args, secret=args.secret or None,
        scheduler_timeout=args.scheduler_timeout, worker_timeout=args.worker_timeout,
        node_selector=storage_option_pairs(args.node_selector, "--node-selector") or None,
        deadline=args.deadline)
    if args.image is not None and registry_of(args.image) is None:
        print(f"scaleattn submit: warning: image {args.image!r} names no registry: the nodes pull it from Docker Hub"
              " (docker.io) unless they already have it", file=sys.stderr)
    if args.dry_run:
        sys.stdout.write(to_yaml(manifest))
        return 0
    try:
        status = apply_daskjob(manifest, follow=not args.no_follow, timeout=args.timeout)
    except KeyboardInterrupt:
        print(f"scaleattn submit: stopped following; the job keeps running (kubectl get daskjob {name}"
              f" -n {args.namespace})", file=sys.stderr)
        return 130
    if args.wait:
        code = runner_exit_code(name, args.namespace)
        if code is not None:
            return code
    return 1 if status == "Failed" else 0


def main(argv=None) -> int:  # pragma: no cover - ``python -m scaleattn.submit`` before the CLI wiring
    try:
        return run(add_arguments(argparse.ArgumentParser(prog="scaleattn submit")).parse_args(argv))
    except ScaleattnError as e:  # as the CLI prints it
        print(f"scaleattn submit: error: {e} (see scaleattn submit --help)", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
