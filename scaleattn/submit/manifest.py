"""``scaleattn submit``: send a fit to a Kubernetes cluster as a DaskJob of the dask-kubernetes operator.

The DaskJob (``kubernetes.dask.org/v1``) carries the whole Dask cluster: the operator starts the scheduler and
the worker group, runs one runner pod executing ``scaleattn fit DATASET --out OUT --scheduler
$DASK_SCHEDULER_ADDRESS`` and deletes the cluster when the runner pod ends (success or failure). Datasets
and results live in object storage (``s3://``); the S3 credentials and endpoint come from a Secret through
``envFrom`` and never appear in the manifest.

This module is the single source of truth for the manifest. ``deploy/kubernetes`` (kustomize base + cpu/gpu
overlays) renders the same object for the same options, which ``tests/test_deploy.py`` checks.

``render_daskjob`` is pure (no cluster, no kr8s). ``apply_daskjob`` talks to the cluster through kr8s (the
``k8s`` extra), imported lazily.
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import secrets
import shlex
import sys
import time
from urllib.parse import urlsplit

from . import __version__

__all__ = [
    "SubmitError", "render_daskjob", "to_yaml", "apply_daskjob", "add_arguments", "run", "default_image",
    "DEFAULT_NAME", "DEFAULT_SECRET", "IMAGE_REPOSITORY",
]

API_VERSION = "kubernetes.dask.org/v1"
DEFAULT_NAME = "scaleattn-fit"
DEFAULT_SECRET = "scaleattn-s3"
DEFAULT_NAMESPACE = "default"
IMAGE_REPOSITORY = "scaleattn"
#: UID/GID of the non-root user baked into deploy/docker/Dockerfile{,.cpu}.
RUN_AS_USER = 10001
#: URL schemes the images can read and write (they ship s3fs only).
SCHEMES = ("s3",)
#: The operator names the scheduler Service ``<name>-scheduler`` and rejects cluster names longer than 63 - 10.
MAX_NAME_LEN = 53
#: Final values of ``status.jobStatus`` (set by the operator when the runner pod ends).
FINAL_STATES = ("Successful", "Failed")

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# storage options that carry credentials: they belong in the Secret, not in the (readable) manifest
_CREDENTIAL_WORDS = ("key", "secret", "token", "password", "passwd", "credential", "sas", "signature")
# fit options that the DaskJob itself decides
_RESERVED_FIT_ARGS = ("--out", "--scheduler", "--local", "--workers", "--gpus", "--threads-per-worker",
                      "--storage-option", "--tls-ca-file", "--tls-cert", "--tls-key")

# Sizes (per worker pod; GPU workers per GPU). Keep in step with deploy/kubernetes (a test compares them).
SCHEDULER_RESOURCES = {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "1", "memory": "2Gi"}}
RUNNER_RESOURCES = {"requests": {"cpu": "1", "memory": "8Gi"}, "limits": {"cpu": "2", "memory": "8Gi"}}
CPU_WORKER_CPUS = 2
CPU_WORKER_MEMORY_GI = 8
GPU_WORKER_CPUS_PER_GPU = 4
GPU_WORKER_MEMORY_GI_PER_GPU = 32
TMP_SIZE = {"scheduler": "1Gi", "runner": "4Gi", "worker": "20Gi"}


class SubmitError(RuntimeError):
    """The job could not be sent or followed (no cluster reachable, operator missing, ...). One-line message."""


# ----------------------------------------------------------------------------------------------- rendering

def default_image(gpus: int = 0) -> str:
    """``scaleattn:<version>-gpu`` for GPU workers, ``scaleattn:<version>-cpu`` otherwise."""
    return f"{IMAGE_REPOSITORY}:{__version__}-{'gpu' if gpus else 'cpu'}"


def _check_url(what: str, url, need_path: bool) -> str:
    if not isinstance(url, str) or not url:
        raise ValueError(f"{what} must be a non-empty URL, got {url!r}")
    if any(c.isspace() or ord(c) < 32 for c in url):
        raise ValueError(f"{what} must not contain whitespace or control characters: {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"{what} must be an object-storage URL ({', '.join(s + '://' for s in SCHEMES)}BUCKET/PATH):"
                         f" the pods cannot see local paths, got {url!r}")
    if not parts.netloc:
        raise ValueError(f"{what} has no bucket: {url!r}")
    if need_path and not parts.path.strip("/"):
        raise ValueError(f"{what} must name a path inside the bucket, not the bucket root: {url!r}")
    return url


def _check_dns_label(what: str, value, max_len: int = 63) -> str:
    if not isinstance(value, str) or len(value) > max_len or not _DNS_LABEL.match(value):
        raise ValueError(f"{what} must be lowercase letters, digits and '-', start and end with a letter or digit,"
                         f" at most {max_len} characters: got {value!r}")
    return value


def _check_int(what: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value


def _storage_option_args(storage_options: dict | None, secret: str | None) -> list[str]:
    """``{"endpoint_url": "http://..."}`` -> ``["--storage-option", "endpoint_url=http://..."]`` for ``fit``."""
    args: list[str] = []
    for key, value in (storage_options or {}).items():
        if not isinstance(key, str) or not _KEY.match(key):
            raise ValueError(f"storage option names must be identifiers, got {key!r}")
        if any(word in key.lower() for word in _CREDENTIAL_WORDS):
            where = f"the Secret {secret!r}" if secret else "a Secret"
            raise ValueError(f"storage option {key!r} looks like a credential: put credentials in {where}"
                             " (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...), never in the manifest")
        text = value if isinstance(value, str) else json.dumps(value)
        if "\n" in text:
            raise ValueError(f"storage option {key!r} must be one line")
        args += ["--storage-option", f"{key}={text}"]
    return args


def _check_fit_args(fit_args) -> list[str]:
    if fit_args is None:
        return []
    if isinstance(fit_args, str) or not all(isinstance(a, str) for a in fit_args):
        raise ValueError(f"fit_args must be a list of strings, got {fit_args!r}")
    for a in fit_args:
        flag = a.split("=", 1)[0]
        if flag in _RESERVED_FIT_ARGS:
            raise ValueError(f"fit option {flag} is set by the DaskJob itself and cannot be passed through")
    return list(fit_args)


def _pod_security_context() -> dict:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER, "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _container_security_context() -> dict:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def _pod_spec(container: dict, tmp_size: str, **extra) -> dict:
    """A pod around one container: non-root, no API token, no service-link env vars, writable /tmp only."""
    container.setdefault("securityContext", _container_security_context())
    container.setdefault("volumeMounts", [{"name": "tmp", "mountPath": "/tmp"}])
    spec = {
        "automountServiceAccountToken": False,
        # service links inject <SVC>_PORT=... variables; a Service named dask-* would turn into bogus Dask config
        "enableServiceLinks": False,
        "securityContext": _pod_security_context(),
    }
    spec.update(extra)
    spec["containers"] = [container]
    spec["volumes"] = [{"name": "tmp", "emptyDir": {"sizeLimit": tmp_size}}]
    return spec


def _env_from(secret: str | None) -> dict:
    return {"envFrom": [{"secretRef": {"name": secret}}]} if secret else {}


def _worker_container(image: str, gpus: int, secret: str | None) -> dict:
    if gpus:
        args = ["dask", "cuda", "worker", "$(DASK_SCHEDULER_ADDRESS)", "--name", "$(DASK_WORKER_NAME)",
                "--nthreads", "1", "--dashboard-address", "8788"]
        cpus, mem = GPU_WORKER_CPUS_PER_GPU * gpus, GPU_WORKER_MEMORY_GI_PER_GPU * gpus
        res = {"cpu": str(cpus), "memory": f"{mem}Gi", "nvidia.com/gpu": str(gpus)}
    else:
        cpus, mem = CPU_WORKER_CPUS, CPU_WORKER_MEMORY_GI
        args = ["dask", "worker", "$(DASK_SCHEDULER_ADDRESS)", "--name", "$(DASK_WORKER_NAME)",
                "--nthreads", str(cpus), "--memory-limit", f"{mem}GiB", "--dashboard-address", "8788"]
        res = {"cpu": str(cpus), "memory": f"{mem}Gi"}
    return {
        "name": "worker",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "args": args,
        **_env_from(secret),
        "ports": [{"name": "http-dashboard", "containerPort": 8788, "protocol": "TCP"}],
        "resources": {"requests": dict(res), "limits": dict(res)},
    }


def _scheduler_container(image: str) -> dict:
    probe = {"httpGet": {"port": "http-dashboard", "path": "/health"}}
    return {
        "name": "scheduler",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "args": ["dask", "scheduler", "--port", "8786", "--dashboard-address", ":8787"],
        "ports": [{"name": "tcp-comm", "containerPort": 8786, "protocol": "TCP"},
                  {"name": "http-dashboard", "containerPort": 8787, "protocol": "TCP"}],
        "readinessProbe": {**probe, "initialDelaySeconds": 5, "periodSeconds": 10},
        "livenessProbe": {**copy.deepcopy(probe), "initialDelaySeconds": 15, "periodSeconds": 20},
        "resources": copy.deepcopy(SCHEDULER_RESOURCES),
    }


def _runner_container(image: str, dataset: str, out: str, extra_args: list[str], secret: str | None) -> dict:
    # $(VAR) is expanded by the kubelet from the container's environment (no shell needed);
    # the operator adds DASK_SCHEDULER_ADDRESS to the runner's env.
    return {
        "name": "runner",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "args": ["scaleattn", "fit", "$(DATASET)", "--out", "$(OUT)", "--scheduler", "$(DASK_SCHEDULER_ADDRESS)",
                 *extra_args],
        "env": [{"name": "DATASET", "value": dataset}, {"name": "OUT", "value": out}],
        **_env_from(secret),
        "resources": copy.deepcopy(RUNNER_RESOURCES),
    }


def render_daskjob(dataset: str, out: str, *, gpus: int = 0, workers: int = 2, image: str | None = None,
                   namespace: str = DEFAULT_NAMESPACE, name: str | None = None,
                   storage_options: dict | None = None, fit_args: list[str] | None = None,
                   secret: str | None = DEFAULT_SECRET) -> dict:
    """The DaskJob manifest (a plain dict) that fits ``dataset`` into ``out`` on a fresh Dask cluster.

    Parameters
    ----------
    dataset, out : str
        ``s3://bucket/path`` URLs (pods cannot see local paths).
    gpus : int
        GPUs per worker pod; 0 runs CPU workers (``dask worker``), N > 0 runs ``dask cuda worker`` (one worker
        process per GPU) with ``nvidia.com/gpu: N``, the usual GPU toleration and node selector.
    workers : int
        Worker pods (``replicas`` of the worker group), >= 1.
    image : str, optional
        Image of all pods; default :func:`default_image` (``scaleattn:<version>-cpu`` / ``-gpu``).
    namespace, name : str
        Where and under what name; the Dask cluster and its scheduler Service take the job's name
        (``<name>-scheduler``). Default name ``scaleattn-fit``.
    storage_options : dict, optional
        fsspec options passed to ``scaleattn fit --storage-option KEY=VALUE`` (e.g. ``endpoint_url``).
        Credential-like keys are refused: credentials come from ``secret``.
    fit_args : list of str, optional
        Extra ``scaleattn fit`` options, e.g. ``["--heads", "minimal", "--resume"]``.
    secret : str or None
        Secret whose keys become environment variables of the runner and the workers (``envFrom``), e.g.
        AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL. None: no Secret (public buckets).

    Raises
    ------
    ValueError
        On any invalid option, with a message naming it.
    """
    _check_url("DATASET", dataset, need_path=False)
    _check_url("--out", out, need_path=True)
    if dataset.rstrip("/") == out.rstrip("/"):
        raise ValueError(f"--out must differ from DATASET: {out!r}")
    gpus = _check_int("gpus", gpus, 0)
    workers = _check_int("workers", workers, 1)
    name = DEFAULT_NAME if name is None else name
    _check_dns_label("name", name, MAX_NAME_LEN)
    _check_dns_label("namespace", namespace)
    if secret is not None:
        _check_dns_label("secret", secret, 253)
    image = default_image(gpus) if image is None else image
    if not isinstance(image, str) or not image or any(c.isspace() for c in image):
        raise ValueError(f"image must be a non-empty image reference without spaces, got {image!r}")
    extra_args = _storage_option_args(storage_options, secret) + _check_fit_args(fit_args)

    worker_extra: dict = {}
    if gpus:
        worker_extra = {
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
        }
    return {
        "apiVersion": API_VERSION,
        "kind": "DaskJob",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "scaleattn", "app.kubernetes.io/component": "fit"},
        },
        "spec": {
            "job": {
                "spec": _pod_spec(_runner_container(image, dataset, out, extra_args, secret), TMP_SIZE["runner"],
                                  restartPolicy="Never"),
            },
            "cluster": {
                "spec": {
                    "worker": {
                        "replicas": workers,
                        "spec": _pod_spec(_worker_container(image, gpus, secret), TMP_SIZE["worker"],
                                          **worker_extra),
                    },
                    "scheduler": {
                        "spec": _pod_spec(_scheduler_container(image), TMP_SIZE["scheduler"]),
                        "service": {
                            "type": "ClusterIP",
                            "selector": {"dask.org/cluster-name": name, "dask.org/component": "scheduler"},
                            "ports": [
                                {"name": "tcp-comm", "protocol": "TCP", "port": 8786, "targetPort": "tcp-comm"},
                                {"name": "http-dashboard", "protocol": "TCP", "port": 8787,
                                 "targetPort": "http-dashboard"},
                            ],
                        },
                    },
                },
            },
        },
    }


def to_yaml(manifest: dict) -> str:
    """YAML text of a manifest (JSON, which is valid YAML, when PyYAML is not installed)."""
    try:
        import yaml
    except ImportError:  # pragma: no cover - pyyaml comes with the k8s and test extras
        return json.dumps(manifest, indent=2) + "\n"
    return yaml.safe_dump(manifest, sort_keys=False, default_flow_style=False, width=120)


# ----------------------------------------------------------------------------------------------- the cluster

def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _status_code(exc) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def apply_daskjob(manifest: dict, *, follow: bool = True, timeout: float | None = None, poll: float = 5.0,
                  log=None) -> str:
    """Create the DaskJob through the Kubernetes API (kr8s) and, with ``follow``, wait until it ends.

    Returns the last ``status.jobStatus`` seen (``Successful`` or ``Failed`` when followed to the end;
    ``JobCreated`` or similar without ``follow`` or after ``timeout`` seconds). Progress goes to ``log``
    (default: stderr). Raises :class:`SubmitError` with a one-line message when kr8s is missing, no cluster
    is reachable, the operator's CRD is not installed, the Secret is missing or the name is taken.
    """
    def say(msg: str) -> None:
        (log or (lambda m: print(m, file=sys.stderr, flush=True)))(msg)

    try:
        import kr8s
        from kr8s.objects import Secret, new_class
    except ImportError:
        raise SubmitError("scaleattn submit needs kr8s: pip install 'scaleattn[k8s]'") from None

    meta = manifest["metadata"]
    name, namespace = meta["name"], meta.get("namespace", DEFAULT_NAMESPACE)
    try:
        api = kr8s.api(namespace=namespace)
        version = api.version()
    except Exception as e:  # kubeconfig missing or broken, DNS, refused connection, TLS, auth ...
        raise SubmitError(f"no Kubernetes cluster reachable ({_one_line(e)}); check KUBECONFIG and"
                          " `kubectl config current-context`") from None
    say(f"connected to Kubernetes {version.get('gitVersion', '?')}")

    for ref in _secret_refs(manifest):
        try:
            Secret.get(ref, namespace=namespace, api=api)
        except kr8s.NotFoundError:
            raise SubmitError(f"Secret {ref!r} not found in namespace {namespace!r}: create it first"
                              " (see docs/kubernetes.md) or pass another --secret") from None
        except kr8s.ServerError as e:
            if _status_code(e) != 403:  # may not read Secrets: let the pods find out
                raise SubmitError(f"cannot check Secret {ref!r}: {_one_line(e)}") from None

    DaskJob = new_class("DaskJob", API_VERSION, namespaced=True, plural="daskjobs")
    job = DaskJob(copy.deepcopy(manifest), namespace=namespace, api=api)
    try:
        job.create()
    except kr8s.ServerError as e:
        code = _status_code(e)
        if code == 404:
            raise SubmitError("the DaskJob resource is not installed on this cluster: deploy the dask-kubernetes"
                              " operator first (see docs/kubernetes.md)") from None
        if code == 409:
            raise SubmitError(f"DaskJob {name!r} already exists in namespace {namespace!r}: pass another --name"
                              f" or `kubectl delete daskjob {name} -n {namespace}`") from None
        raise SubmitError(f"the API server refused the DaskJob: {_one_line(e)}") from None
    except Exception as e:
        raise SubmitError(f"could not create the DaskJob: {_one_line(e)}") from None
    print(f"daskjob.kubernetes.dask.org/{name} created in namespace {namespace}", flush=True)
    say(f"logs:      kubectl logs -f -n {namespace} {name}-runner")
    say(f"dashboard: kubectl port-forward -n {namespace} svc/{name}-scheduler 8787:8787"
        " -> http://localhost:8787")
    if not follow:
        return "JobCreated"
    return _follow(job, name, timeout, poll, say)


def _secret_refs(manifest: dict) -> list[str]:
    refs: list[str] = []

    def pods(m):
        spec = m["spec"]
        yield spec["job"]["spec"]
        yield spec["cluster"]["spec"]["worker"]["spec"]
        yield spec["cluster"]["spec"]["scheduler"]["spec"]

    for pod in pods(manifest):
        for c in pod.get("containers", []):
            for src in c.get("envFrom", []):
                ref = (src.get("secretRef") or {}).get("name")
                if ref and not (src.get("secretRef") or {}).get("optional") and ref not in refs:
                    refs.append(ref)
    return refs


def _follow(job, name: str, timeout: float | None, poll: float, say) -> str:
    start = time.monotonic()
    last = None
    while True:
        try:
            job.refresh()
        except Exception as e:
            raise SubmitError(f"lost the DaskJob {name!r} while following it: {_one_line(e)}") from None
        status = (job.raw.get("status") or {}).get("jobStatus") or "Pending"
        if status != last:
            say(f"{time.strftime('%H:%M:%S')} {name}: {status}")
            last = status
        if status in FINAL_STATES:
            return status
        if timeout is not None and time.monotonic() - start > timeout:
            say(f"stopped following after {timeout:g} s; the job keeps running")
            return status
        time.sleep(poll)


# ----------------------------------------------------------------------------------------------- command line

def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``scaleattn submit`` (``scaleattn.cli`` adds them to its ``submit`` sub-parser)."""
    parser.add_argument("dataset", metavar="DATASET", help="dataset URL, s3://BUCKET/PATH.zarr")
    parser.add_argument("--out", required=True, metavar="URL", help="run directory URL, s3://BUCKET/PATH")
    parser.add_argument("--gpus", type=int, default=0, metavar="N",
                        help="GPUs per worker pod: 0 (default) runs CPU workers, N > 0 runs dask-cuda workers on the"
                             " GPU node pool")
    parser.add_argument("--workers", type=int, default=2, metavar="N", help="worker pods (default 2)")
    parser.add_argument("--image", default=None, metavar="IMAGE",
                        help=f"image of all pods (default {default_image(0)}, or {default_image(1)} with --gpus)")
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
                        help="extra `scaleattn fit` options as one quoted string, e.g. '--heads minimal --resume'"
                             " (a single option needs the = form: --fit-args=--resume)")
    parser.add_argument("--dry-run", action="store_true", help="print the DaskJob as YAML and send nothing")
    parser.add_argument("--no-follow", action="store_true", help="return once the DaskJob is created")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="stop following after this long (the job keeps running)")
    return parser


def _parse_storage_options(pairs) -> dict:
    out: dict = {}
    for p in pairs or []:
        if "=" not in p:
            raise ValueError(f"--storage-option expects KEY=VALUE, got {p!r}")
        k, v = p.split("=", 1)
        out[k] = v
    return out


def run(args: argparse.Namespace) -> int:
    """Run ``scaleattn submit``; 0 on success or --dry-run, 1 when the job failed, 2 on bad input/no cluster."""
    try:
        name = args.name or f"{DEFAULT_NAME}-{secrets.token_hex(3)}"
        manifest = render_daskjob(
            args.dataset, args.out, gpus=args.gpus, workers=args.workers, image=args.image,
            namespace=args.namespace, name=name, storage_options=_parse_storage_options(args.storage_option),
            fit_args=shlex.split(args.fit_args or ""), secret=args.secret or None)
    except ValueError as e:
        print(f"scaleattn submit: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        sys.stdout.write(to_yaml(manifest))
        return 0
    try:
        status = apply_daskjob(manifest, follow=not args.no_follow, timeout=args.timeout)
    except SubmitError as e:
        print(f"scaleattn submit: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"scaleattn submit: stopped following; the job keeps running (kubectl get daskjob {name}"
              f" -n {args.namespace})", file=sys.stderr)
        return 130
    return 1 if status == "Failed" else 0


def main(argv=None) -> int:  # pragma: no cover - ``python -m scaleattn.submit`` before the CLI wiring
    return run(add_arguments(argparse.ArgumentParser(prog="scaleattn submit")).parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
