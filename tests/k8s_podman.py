"""``podman run`` lines for the pods of a DaskJob, as the operator builds them (``k8s_pods.operator_pods``) and a
kubelet with a container runtime starts them. Used by ``deploy/docker/build-local.sh``:

    PYTHONPATH=. python tests/k8s_podman.py IMAGE OUT     # one "ROLE ARGV" line per pod; S3 from AWS_* env
"""
from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from k8s_pods import ROOT, _quantity, container_env, expand, operator_pods  # noqa: E402


def podman_argv(pod: dict, image: str, secrets: dict[str, dict[str, str]], hosts: dict[str, str],
                label: str = "scaleattn-build-local") -> list[str]:
    """``podman run`` of a pod's container as a kubelet with a container runtime would start it: the image's
    ENTRYPOINT, the pod's args and env (``$(VAR)`` expanded), its securityContext, emptyDirs and limits."""
    name = pod["metadata"]["name"]
    (c,) = pod["spec"]["containers"]
    env = container_env(c, {"env": {}}, secrets, name)  # podman adds the image's ENV itself
    env.pop("HOSTNAME")
    sec = {**pod["spec"].get("securityContext", {}), **c.get("securityContext", {})}
    uid = sec.get("runAsUser", 0)
    a = ["podman", "run", "--name", name, "--label", label, "--pull", "never", "--network", "host", "--hostname", name,
         "--user", f"{uid}:{sec.get('runAsGroup', uid)}", "--cap-drop", "ALL", "--shm-size", "64m"]
    if "fsGroup" in sec:
        a += ["--group-add", str(sec["fsGroup"])]
    if sec.get("allowPrivilegeEscalation") is False:
        a += ["--security-opt", "no-new-privileges"]
    if sec.get("readOnlyRootFilesystem"):
        a += ["--read-only", "--read-only-tmpfs=false"]
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    for m in c.get("volumeMounts", []):
        size = volumes[m["name"]]["emptyDir"].get("sizeLimit")
        a += ["--tmpfs", f"{m['mountPath']}:rw,mode=1777" + (f",size={_quantity(size)}" if size else "")]
    limits = c.get("resources", {}).get("limits", {})
    if "memory" in limits:
        a += ["--memory", str(_quantity(limits["memory"]))]
    if "cpu" in limits:
        cpu = str(limits["cpu"])
        a += ["--cpus", str(int(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu))]
    for h, ip in hosts.items():
        a += ["--add-host", f"{h}:{ip}"]
    for k, v in env.items():
        a += ["--env", f"{k}={v}"]
    if "command" in c:
        a += ["--entrypoint", json.dumps(c["command"])]
    if pod["metadata"].get("labels", {}).get("dask.org/component") != "job-runner":
        a.append("--detach")
    return a + [image] + [expand(x, env) for x in c.get("args", [])]


def _main(argv: list[str]) -> int:
    """``python tests/k8s_podman.py IMAGE OUT``: one ``ROLE ARGV`` line per pod of the cpu DaskJob
    (scheduler, workers, runner), for deploy/docker/build-local.sh; S3 settings from the AWS_* environment."""
    if len(argv) != 2:
        print(_main.__doc__, file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    from scaleattn import submit

    image, out = argv
    job = submit.render_daskjob("s3://scaleattn/datasets/example.zarr", out, image=image, name="scaleattn-fit",
                                workers=2)
    pods = operator_pods(job)
    svc = pods["service"]["metadata"]["name"]
    hosts = {f"{svc}.default.svc.cluster.local": "127.0.0.1"}
    keys = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")
    secrets = {submit.DEFAULT_SECRET: {k: os.environ[k] for k in keys if k in os.environ}}
    for role, pod in [("scheduler", pods["scheduler"]), *[("worker", p) for p in pods["workers"]],
                      ("runner", pods["runner"])]:
        print(role, shlex.join(podman_argv(pod, image, secrets, hosts)))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
