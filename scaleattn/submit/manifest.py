"""The DaskJob of ``scaleattn submit``: the single source of truth for the manifest.

``deploy/kubernetes`` (kustomize base + cpu/gpu overlays + the gpu-node-selector component) renders the same
object for the same options, which ``tests/test_deploy.py`` checks. Everything here is pure (no cluster, no kr8s).
"""
from __future__ import annotations

import copy
import json
import os
import re
from urllib.parse import urlsplit

from .._params import MAX_SECONDS, storage_option_pairs
from .._version import __version__
from ..errors import ParameterError
from ..store._location import Location
from ..store._outputs import relation

__all__ = ["default_image", "registry_of", "render_daskjob", "to_yaml", "escape", "API_VERSION", "DEFAULT_NAME",
           "DEFAULT_SECRET", "DEFAULT_NAMESPACE", "IMAGE_NAME", "REGISTRY_ENV", "EXAMPLE_REGISTRY", "RUN_AS_USER",
           "SCHEMES", "MAX_NAME_LEN", "SCHEDULER_TIMEOUT", "WORKER_TIMEOUT", "GPU_TOLERATIONS",
           "GPU_FEATURE_DISCOVERY_SELECTOR", "SCHEDULER_RESOURCES", "RUNNER_RESOURCES", "CPU_WORKER_CPUS",
           "CPU_WORKER_MEMORY_GI", "GPU_WORKER_CPUS_PER_GPU", "GPU_WORKER_MEMORY_GI_PER_GPU", "TMP_SIZE"]

API_VERSION = "kubernetes.dask.org/v1"
DEFAULT_NAME = "scaleattn-fit"
DEFAULT_SECRET = "scaleattn-s3"
DEFAULT_NAMESPACE = "default"
IMAGE_NAME = "scaleattn"
#: Registry of the default image: ``--registry`` or this environment variable (there is no public image).
REGISTRY_ENV = "SCALEATTN_REGISTRY"
#: The placeholder registry of the kustomize overlays (``kustomize edit set image`` replaces it).
EXAMPLE_REGISTRY = "registry.example.com/ml"
#: UID/GID of the non-root user baked into deploy/docker/Dockerfile{,.cpu}.
RUN_AS_USER = 10001
#: URL schemes the images can read and write (they ship s3fs only).
SCHEMES = ("s3",)
#: The operator names the scheduler Service ``<name>-scheduler`` and rejects cluster names longer than 63 - 10.
MAX_NAME_LEN = 53
#: How long the runner keeps trying to reach the scheduler (the pods start in any order; a GPU image takes
#: minutes to pull) and waits for the first worker (a GPU node may have to be provisioned first), seconds.
#: The scheduler fails tasks that have had no worker for the worker timeout (``no-workers-timeout``).
SCHEDULER_TIMEOUT = 300
WORKER_TIMEOUT = 900
#: Tolerations of GPU workers: the taints GPU node pools commonly carry (``nvidia.com/gpu`` with any value and
#: effect: GKE, EKS and NVIDIA's docs; ``sku=gpu:NoSchedule``: AKS's docs).
GPU_TOLERATIONS = ({"key": "nvidia.com/gpu", "operator": "Exists"},
                   {"key": "sku", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"})
#: The node selector of deploy/kubernetes/components/gpu-node-selector (NVIDIA GPU feature discovery's label).
GPU_FEATURE_DISCOVERY_SELECTOR = {"nvidia.com/gpu.present": "true"}

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# the characters of an image reference (registry host and port, path, tag, digest): no space, no $
_IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
# storage options that carry credentials: they belong in the Secret, not in the (readable) manifest
_CREDENTIAL_WORDS = ("key", "secret", "token", "password", "passwd", "credential", "sas", "signature")
# fit options that the DaskJob itself decides
_RESERVED_FIT_ARGS = ("--out", "--scheduler", "--local", "--workers", "--gpus", "--threads-per-worker",
                      "--storage-option", "--tls-ca-file", "--tls-cert", "--tls-key", "--scheduler-timeout",
                      "--worker-timeout")

# Sizes (per worker pod; GPU workers per GPU). Keep in step with deploy/kubernetes (a test compares them).
SCHEDULER_RESOURCES = {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "1", "memory": "2Gi"}}
RUNNER_RESOURCES = {"requests": {"cpu": "1", "memory": "8Gi"}, "limits": {"cpu": "2", "memory": "8Gi"}}
CPU_WORKER_CPUS = 2
CPU_WORKER_MEMORY_GI = 8
GPU_WORKER_CPUS_PER_GPU = 4
GPU_WORKER_MEMORY_GI_PER_GPU = 32
TMP_SIZE = {"scheduler": "1Gi", "runner": "4Gi", "worker": "20Gi"}


# ----------------------------------------------------------------------------------------------- rendering

def default_image(gpus: int = 0, registry: str | None = None) -> str:
    """``REGISTRY/scaleattn:<version>-gpu`` for GPU workers, ``REGISTRY/scaleattn:<version>-cpu`` otherwise.

    ``registry`` defaults to ``$SCALEATTN_REGISTRY``. Raises ``ValueError`` when neither is set: an image
    reference without a registry makes every node pull ``docker.io/library/scaleattn``, which is not ours.
    """
    registry = (registry if registry is not None else os.environ.get(REGISTRY_ENV, "")).strip().rstrip("/")
    if not registry:
        kind = "gpu" if gpus else "cpu"
        raise ParameterError(f"no image given: pass `image='REGISTRY/{IMAGE_NAME}:{__version__}-{kind}'`"
                         f" or `registry='REGISTRY'` (or set {REGISTRY_ENV}): the image you built and pushed"
                         " (docs/kubernetes.md, section 2)")
    if not _IMAGE.match(registry) or registry_of(registry + "/x") is None:
        raise ParameterError(f"registry {registry!r} must start with a registry host (a name with a dot or a port,"
                         " or localhost), e.g. registry.example.com/ml")
    return f"{registry}/{IMAGE_NAME}:{__version__}-{'gpu' if gpus else 'cpu'}"


def registry_of(image: str) -> str | None:
    """The registry host of an image reference (Docker's rule: a first path component with a dot or a port, or
    ``localhost``), None when it has none (then nodes pull from Docker Hub)."""
    first, sep, _ = image.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return first
    return None


def _check_url(what: str, url, need_path: bool) -> str:
    if not isinstance(url, str) or not url:
        raise ParameterError(f"{what} must be a non-empty URL, got {url!r}")
    if any(c.isspace() or ord(c) < 32 for c in url):
        raise ParameterError(f"{what} must not contain whitespace or control characters: {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        schemes = ", ".join(s + "://" for s in SCHEMES)
        raise ParameterError(f"{what} must be an object-storage URL ({schemes}BUCKET/PATH):"
                         f" the pods cannot see local paths, got {url!r}")
    if not parts.netloc:
        raise ParameterError(f"{what} must name a bucket: {url!r}")
    if need_path and not parts.path.strip("/"):
        raise ParameterError(f"{what} must name a path inside the bucket, not the bucket root: {url!r}")
    return url


def escape(value: str) -> str:
    """``value`` as it must be written in a container's ``args`` or ``env`` value for the pod to see ``value``:
    every ``$`` doubled. The kubelet expands ``$(VAR)`` there from the container's environment (which holds the
    ``envFrom`` Secret: ``s3://b/$(AWS_SECRET_ACCESS_KEY)`` would put the secret in the URL the fit reads) and
    turns ``$$`` into ``$``; nothing else is changed.

    Examples
    --------
    >>> escape("s3://b/$(AWS_SECRET_ACCESS_KEY).zarr")
    's3://b/$$(AWS_SECRET_ACCESS_KEY).zarr'
    """
    return value.replace("$", "$$")


def _check_dns_label(what: str, value, max_len: int = 63) -> str:
    if not isinstance(value, str) or len(value) > max_len or not _DNS_LABEL.match(value):
        raise ParameterError(f"{what} must be lowercase letters, digits and '-', start and end with a letter or digit,"
                         f" at most {max_len} characters: got {value!r}")
    return value


def _check_int(what: str, value, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParameterError(f"{what} must be an integer, got {value!r}")
    if value < minimum:
        raise ParameterError(f"{what} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ParameterError(f"{what} must be <= {maximum}, got {value}")
    return value


def _storage_option_args(storage_options: dict | None, secret: str | None) -> list[str]:
    """``{"endpoint_url": "http://..."}`` -> ``["--storage-option", "endpoint_url=http://..."]`` for ``fit``."""
    args: list[str] = []
    if not isinstance(storage_options, dict):  # (as everywhere in the API: a dict, or ["KEY=VALUE", ...])
        if isinstance(storage_options, str):
            raise ParameterError(f"`storage_options` must be a dict or a list of 'KEY=VALUE', got {storage_options!r}")
        storage_options = storage_option_pairs(storage_options)
    for key, value in storage_options.items():
        if not isinstance(key, str) or not _KEY.match(key):
            raise ParameterError(f"storage option names must be identifiers, got {key!r}")
        if any(word in key.lower() for word in _CREDENTIAL_WORDS):
            where = f"the Secret {secret!r}" if secret else "a Secret"
            raise ParameterError(f"storage option {key!r} looks like a credential: put credentials in {where}"
                             " (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...), never in the manifest")
        text = value if isinstance(value, str) else json.dumps(value)
        if "\n" in text:
            raise ParameterError(f"storage option {key!r} must be one line")
        args += ["--storage-option", escape(f"{key}={text}")]
    return args


def _check_fit_args(fit_args) -> list[str]:
    if fit_args is None:
        return []
    if isinstance(fit_args, str) or not all(isinstance(a, str) for a in fit_args):
        raise ParameterError(f"fit_args must be a list of strings, got {fit_args!r}")
    for a in fit_args:
        flag = a.split("=", 1)[0]
        if flag in _RESERVED_FIT_ARGS:
            raise ParameterError(f"fit option {flag} in `fit_args` is set by the DaskJob itself and cannot be"
                                 " passed through")
    return [escape(a) for a in fit_args]


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


def _check_node_selector(node_selector) -> dict:
    if node_selector is None:
        return {}
    if not isinstance(node_selector, dict):
        raise ParameterError(f"node_selector must be a dict of labels, got {node_selector!r}")
    for k, v in node_selector.items():
        if not isinstance(k, str) or len(k) > 316 or not _LABEL_KEY.match(k):
            raise ParameterError(f"node selector key {k!r} is not a valid label key")
        if not isinstance(v, str) or len(v) > 63 or not _LABEL_VALUE.match(v):
            raise ParameterError(f"node selector value {v!r} of {k!r} is not a valid label value")
    return dict(node_selector)


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


def _scheduler_container(image: str, gpus: int, worker_timeout: int) -> dict:
    probe = {"httpGet": {"port": "http-dashboard", "path": "/health"}}
    # tasks that have had no worker for this long fail (the runner then fails with that error)
    env = [{"name": "DASK_DISTRIBUTED__SCHEDULER__NO_WORKERS_TIMEOUT", "value": f"{worker_timeout}s"}]
    return {
        "name": "scheduler",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "args": ["dask", "scheduler", "--port", "8786", "--dashboard-address", ":8787"],
        "env": env + _no_gpu_env(gpus),
        "ports": [{"name": "tcp-comm", "containerPort": 8786, "protocol": "TCP"},
                  {"name": "http-dashboard", "containerPort": 8787, "protocol": "TCP"}],
        "readinessProbe": {**probe, "initialDelaySeconds": 5, "periodSeconds": 10},
        "livenessProbe": {**copy.deepcopy(probe), "initialDelaySeconds": 15, "periodSeconds": 20},
        "resources": copy.deepcopy(SCHEDULER_RESOURCES),
    }


def _no_gpu_env(gpus: int) -> list[dict]:
    """The CUDA base image sets NVIDIA_VISIBLE_DEVICES=all, which makes the NVIDIA container runtime hand every
    GPU of the node to pods that requested none: "void" keeps the scheduler and the runner off the GPUs."""
    return [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}] if gpus else []


def _runner_container(image: str, dataset: str, out: str, extra_args: list[str], secret: str | None,
                      gpus: int, scheduler_timeout: int, worker_timeout: int) -> dict:
    # $(VAR) is expanded by the kubelet from the container's environment (no shell needed);
    # the operator adds DASK_SCHEDULER_ADDRESS to the runner's env. --resume: the same manifest applied again
    # after the pods were stopped (node drain, eviction) continues from the checkpoint.
    return {
        "name": "runner",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "args": ["scaleattn", "fit", "$(DATASET)", "--out", "$(OUT)", "--scheduler", "$(DASK_SCHEDULER_ADDRESS)",
                 "--scheduler-timeout", str(scheduler_timeout), "--worker-timeout", str(worker_timeout), "--resume",
                 *extra_args],
        "env": [{"name": "DATASET", "value": escape(dataset)}, {"name": "OUT", "value": escape(out)}]
        + _no_gpu_env(gpus),
        **_env_from(secret),
        "resources": copy.deepcopy(RUNNER_RESOURCES),
    }


def render_daskjob(dataset: str, out: str, *, gpus: int = 0, workers: int = 2, image: str | None = None,
                   registry: str | None = None, namespace: str = DEFAULT_NAMESPACE, name: str | None = None,
                   storage_options: dict | list[str] | None = None, fit_args: list[str] | None = None,
                   secret: str | None = DEFAULT_SECRET, scheduler_timeout: int = SCHEDULER_TIMEOUT,
                   worker_timeout: int = WORKER_TIMEOUT, node_selector: dict | None = None,
                   deadline: int | None = None) -> dict:
    """The DaskJob manifest (a plain dict) that fits ``dataset`` into ``out`` on a fresh Dask cluster.

    Parameters
    ----------
    dataset, out : str
        ``s3://bucket/path`` URLs (pods cannot see local paths).
    gpus : int
        GPUs per worker pod; 0 runs CPU workers (``dask worker``), N > 0 runs ``dask cuda worker`` (one worker
        process per GPU) requesting ``nvidia.com/gpu: N`` and tolerating the common GPU taints
        (:data:`GPU_TOLERATIONS`). The scheduler and runner get ``NVIDIA_VISIBLE_DEVICES=void``.
    workers : int
        Worker pods (``replicas`` of the worker group), >= 1.
    image, registry : str, optional
        Image of all pods; default :func:`default_image` of ``registry`` (``REGISTRY/scaleattn:<version>-cpu``
        / ``-gpu``). With neither (and no ``$SCALEATTN_REGISTRY``): ``ValueError``.
    namespace, name : str
        Where and under what name; the Dask cluster and its scheduler Service take the job's name
        (``<name>-scheduler``). Default name ``scaleattn-fit``.
    storage_options : dict or list of "KEY=VALUE", optional
        fsspec options passed to ``scaleattn fit --storage-option KEY=VALUE`` (e.g. ``endpoint_url``).
        Credential-like keys are refused: credentials come from ``secret``.
    fit_args : list of str, optional
        Extra ``scaleattn fit`` options, e.g. ``["--heads", "minimal"]`` (``--resume`` is always passed).
    secret : str or None
        Secret whose keys become environment variables of the runner and the workers (``envFrom``), e.g.
        AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL. None: no Secret (public buckets).
    scheduler_timeout, worker_timeout : int
        Seconds the runner keeps trying to reach the scheduler, and waits for the first worker; the scheduler
        fails tasks that have had no worker for ``worker_timeout`` (its ``no-workers-timeout``).
    node_selector : dict, optional
        ``nodeSelector`` of the worker pods, e.g. ``{"nvidia.com/gpu.present": "true"}`` where NVIDIA GPU
        feature discovery labels the nodes (the ``gpu-node-selector`` kustomize component).
    deadline : int, optional
        ``activeDeadlineSeconds`` of the runner pod: the kubelet stops a fit that runs longer.

    Every value given here that reaches a container's ``args`` or ``env`` (``dataset``, ``out``, the storage
    options, ``fit_args``) is written escaped (:func:`escape`): the kubelet's ``$(VAR)`` expansion gives the pods
    exactly the value validated here, never one completed from their environment (the Secret). The other
    values cannot hold a ``$`` (names, labels and the image are refused with one).

    Raises
    ------
    ValueError
        On any invalid option, with a message naming it.
    """
    _check_url("dataset", dataset, need_path=False)
    _check_url("out", out, need_path=True)
    rel = relation(Location(out.rstrip("/")), Location(dataset.rstrip("/")))  # (by prefix, as every output)
    if rel is not None:
        raise ParameterError(f"`out={out!r}` {rel} the dataset {dataset!r}: scaleattn never writes into or removes an"
                             " input; choose a path outside it")
    gpus = _check_int("gpus", gpus, 0)
    workers = _check_int("workers", workers, 1)
    # (the runner's fit takes at most MAX_SECONDS: a longer one would fail in the pod, minutes later)
    scheduler_timeout = _check_int("scheduler_timeout", scheduler_timeout, 1, MAX_SECONDS)
    worker_timeout = _check_int("worker_timeout", worker_timeout, 1, MAX_SECONDS)
    if deadline is not None:
        deadline = _check_int("deadline", deadline, 1)
    name = DEFAULT_NAME if name is None else name
    _check_dns_label("name", name, MAX_NAME_LEN)
    _check_dns_label("namespace", namespace)
    if secret is not None:
        _check_dns_label("secret", secret, 253)
    image = default_image(gpus, registry) if image is None else image
    if not isinstance(image, str) or not image or not _IMAGE.match(image):
        raise ParameterError(f"image must be a non-empty image reference (letters, digits and . _ - / : @), got"
                             f" {image!r}")
    extra_args = _storage_option_args(storage_options, secret) + _check_fit_args(fit_args)

    worker_extra: dict = {}
    if gpus:
        worker_extra["tolerations"] = [dict(t) for t in GPU_TOLERATIONS]
    if node_selector:
        worker_extra["nodeSelector"] = _check_node_selector(node_selector)
    runner_extra = {"restartPolicy": "Never"}
    if deadline is not None:
        runner_extra["activeDeadlineSeconds"] = deadline
    runner = _runner_container(image, dataset, out, extra_args, secret, gpus, scheduler_timeout, worker_timeout)
    return {
        "apiVersion": API_VERSION,
        "kind": "DaskJob",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "scaleattn", "app.kubernetes.io/component": "fit"},
        },
        "spec": {
            "job": {"spec": _pod_spec(runner, TMP_SIZE["runner"], **runner_extra)},
            "cluster": {
                "spec": {
                    "worker": {
                        "replicas": workers,
                        "spec": _pod_spec(_worker_container(image, gpus, secret), TMP_SIZE["worker"],
                                          **worker_extra),
                    },
                    "scheduler": {
                        "spec": _pod_spec(_scheduler_container(image, gpus, worker_timeout), TMP_SIZE["scheduler"]),
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
