"""Send a DaskJob to the cluster (kr8s, the ``k8s`` extra, imported lazily) and follow it to its end."""
from __future__ import annotations

import copy
import sys
import time

from ..errors import MissingDependencyError, SubmitError
from .manifest import API_VERSION, DEFAULT_NAMESPACE

__all__ = ["apply_daskjob", "runner_exit_code", "FINAL_STATES"]

#: Final values of ``status.jobStatus`` (set by the operator when the runner pod ends).
FINAL_STATES = ("Successful", "Failed")


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
        raise MissingDependencyError.for_extra("scaleattn submit", "k8s", "kr8s") from None

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
                              " (see docs/kubernetes.md) or pass another `secret`") from None
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
            raise SubmitError(f"DaskJob {name!r} already exists in namespace {namespace!r}: pass another `name`"
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


def runner_exit_code(name: str, namespace: str = DEFAULT_NAMESPACE, *, log=None, tail: int = 5) -> int | None:
    """Exit code of the DaskJob's runner container (``<name>-runner``, kept after the job ends), None when the
    pod or its terminated state cannot be read. When it is not 0, the last ``tail`` log lines go to ``log``."""
    def say(msg: str) -> None:
        (log or (lambda m: print(m, file=sys.stderr, flush=True)))(msg)

    try:
        import kr8s
        from kr8s.objects import Pod

        pod = Pod.get(f"{name}-runner", namespace=namespace, api=kr8s.api(namespace=namespace))
    except Exception as e:
        say(f"cannot read the runner pod {name}-runner: {_one_line(e)}")
        return None
    code = None
    for status in (pod.raw.get("status") or {}).get("containerStatuses") or []:
        terminated = (status.get("state") or {}).get("terminated")
        if status.get("name") == "runner" and terminated:
            code = int(terminated.get("exitCode", 1))
    if code:
        try:
            lines = list(pod.logs(container="runner", tail_lines=tail))
        except Exception as e:
            lines = [f"(no logs: {_one_line(e)})"]
        say(f"runner exited with code {code}; its last log lines:")
        for line in lines:
            say(f"  {line}")
    return code
