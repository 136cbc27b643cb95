"""Test helper: run a rendered DaskJob the way the dask-kubernetes operator and a kubelet would, as sandboxed
local processes (no cluster, no container engine). Used by ``tests/test_k8s_runtime.py``; not part of the package.

* **Operator**: the pods come from dask-kubernetes' own builder functions (``build_scheduler_deployment_spec``,
  ``build_worker_deployment_spec``, ``build_job_pod_spec``, ...), taken from the installed package's
  ``operator/controller/controller.py``. Only those functions are compiled (``ast``), so the operator's runtime
  dependencies (kopf, kubernetes clients) are not needed: CI installs dask-kubernetes with ``--no-deps``.
* **Image**: ``deploy/docker/Dockerfile.cpu`` is read for ``ENV``, ``ENTRYPOINT``, ``CMD`` and ``WORKDIR``.
  The image's ``/opt/scaleattn`` (its virtual environment) is stood in for by this interpreter and the checkout
  under test, bind-mounted read-only at ``/opt/scaleattn``; the Python packages are this machine's.
* **Kubelet**: the container's ``command``/``args`` (else the image's ENTRYPOINT/CMD) with ``$(VAR)`` expanded
  from its environment; environment = image ENV, then ``envFrom`` (the Secret), then ``env``; ``HOSTNAME``.
* **Sandbox** (bubblewrap, started as root): read-only root filesystem, ``/tmp`` a fresh tmpfs of the pod's
  ``emptyDir.sizeLimit`` (mode 1777, like an emptyDir), private PID/IPC/UTS namespaces with the container's
  entrypoint (``tini``) as PID 1, the pod's ``runAsUser``/``runAsGroup``/``fsGroup`` as real host IDs
  (``setpriv``), every capability dropped (also from the bounding set) and no_new_privs
  (``allowPrivilegeEscalation: false``), the ``RuntimeDefault`` seccomp profile approximated by a filter that
  refuses the syscalls outside the runtimes' default allow-list (:data:`RUNTIME_DEFAULT_DENIED`, needs
  python3-seccomp), a cleared environment, ``/etc/hosts`` with the scheduler Service's
  cluster DNS name. All pods of one job share one private network namespace that has only loopback (the
  "cluster network"); the S3 server (moto) runs in it too.

What is NOT reproduced is listed in ``Sandbox.not_enforced`` (the tests print it).
"""
from __future__ import annotations

import ast
import copy
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
IMAGE_PREFIX = "/opt/scaleattn"  # VIRTUAL_ENV of deploy/docker/Dockerfile{,.cpu}
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # PATH of the base images
BUILDERS = ("build_scheduler_deployment_spec", "build_scheduler_service_spec", "build_worker_deployment_spec",
            "build_job_pod_spec", "build_default_worker_group_spec", "build_cluster_spec", "get_job_runner_pod_name")
#: Syscalls outside the allow-list of the container runtimes' default seccomp profile (Docker's default.json,
#: containerd/CRI-O's RuntimeDefault) that exist on x86_64: refused with EPERM in the sandbox.
RUNTIME_DEFAULT_DENIED = (
    "acct", "add_key", "bpf", "clock_adjtime", "clock_settime", "create_module", "delete_module", "finit_module",
    "get_kernel_syms", "get_mempolicy", "init_module", "ioperm", "iopl", "kcmp", "kexec_file_load", "kexec_load",
    "keyctl", "lookup_dcookie", "mbind", "mount", "move_pages", "name_to_handle_at", "nfsservctl",
    "open_by_handle_at", "perf_event_open", "pivot_root", "process_vm_readv", "process_vm_writev", "ptrace",
    "query_module", "quotactl", "reboot", "request_key", "set_mempolicy", "setns", "settimeofday", "swapon",
    "swapoff", "sysfs", "_sysctl", "umount2", "unshare", "uselib", "userfaultfd", "ustat", "fsopen", "fsmount",
    "fsconfig", "move_mount", "open_tree", "fspick")
_SECCOMP_BPF = """
import errno, sys, seccomp
f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
for name in sys.argv[2:]:
    try:
        f.add_rule(seccomp.ERRNO(errno.EPERM), name)
    except Exception:
        pass  # not a syscall of this architecture
with open(sys.argv[1], "wb") as fh:
    f.export_bpf(fh)
"""
NOT_ENFORCED = (
    "resources.limits: not enforced (no cgroup delegation here); requests are not scheduled",
    "readinessProbe/livenessProbe: not run",
    "network: the pods share one loopback interface (no per-pod IP), so the second worker's dashboard port"
    " 8788 falls back to a random port",
    "image filesystem: this machine's Python and packages stand in for the image's /opt/scaleattn",
)


# ------------------------------------------------------------------------------------------------ operator

def _operator_source() -> Path:
    spec = importlib.util.find_spec("dask_kubernetes")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("dask-kubernetes is not installed (pip install --no-deps dask-kubernetes)")
    return Path(list(spec.submodule_search_locations)[0])


def operator_builders() -> dict[str, Any]:
    """The operator's builder functions, compiled from the installed dask-kubernetes sources."""
    pkg = _operator_source()
    path = pkg / "operator" / "controller" / "controller.py"
    tree = ast.parse(path.read_text(), str(path))
    keep = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "__future__"]
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in BUILDERS]
    missing = set(BUILDERS) - {n.name for n in found}
    if missing:
        raise RuntimeError(f"{path} has no {sorted(missing)}: another dask-kubernetes layout")
    constants = {}
    exec(compile((pkg / "constants.py").read_text(), str(pkg / "constants.py"), "exec"), constants)
    namespace: dict[str, Any] = {"copy": copy, "Any": Any, "SCHEDULER_NAME_TEMPLATE":
                                 constants["SCHEDULER_NAME_TEMPLATE"]}
    exec(compile(ast.Module(body=keep + found, type_ignores=[]), str(path), "exec"), namespace)
    return {name: namespace[name] for name in BUILDERS}


def operator_pods(job: dict, namespace: str = "default") -> dict[str, Any]:
    """What the operator creates for a DaskJob: ``{"scheduler": pod, "workers": [pod, ...], "runner": pod,
    "service": Service}``, each pod ``{"metadata": ..., "spec": ...}`` (Deployments reduced to their template)."""
    b = operator_builders()
    name = job["metadata"]["name"]
    labels = dict(job["metadata"].get("labels", {}))
    cluster = b["build_cluster_spec"](name, job["spec"]["cluster"]["spec"]["worker"],
                                      job["spec"]["cluster"]["spec"]["scheduler"], {}, labels)
    cname = cluster["metadata"]["name"]
    scheduler = b["build_scheduler_deployment_spec"](cname, cluster["spec"]["scheduler"]["spec"], {}, labels)
    service = b["build_scheduler_service_spec"](cname, cluster["spec"]["scheduler"]["service"], {}, labels)
    group = b["build_default_worker_group_spec"](cname, cluster["spec"]["worker"], {}, labels)
    workers = [b["build_worker_deployment_spec"](group["metadata"]["name"], namespace, cname, uuid.uuid4().hex[:10],
                                                 group["spec"]["worker"]["spec"], {}, labels)
               for _ in range(int(group["spec"]["worker"].get("replicas", 1)))]
    runner = b["build_job_pod_spec"](name, cname, namespace, job["spec"]["job"]["spec"], {}, labels)
    pod = lambda deployment: deployment["spec"]["template"]  # noqa: E731
    return {"scheduler": pod(scheduler), "workers": [pod(w) for w in workers], "runner": runner, "service": service}


# ------------------------------------------------------------------------------------------------ image + kubelet

def image_config(dockerfile: Path) -> dict:
    """ENV (in order, ``$VAR`` expanded), ENTRYPOINT, CMD, WORKDIR and USER of the final stage of a Dockerfile."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    env: dict[str, str] = {"PATH": BASE_PATH}
    conf: dict[str, Any] = {"env": env, "entrypoint": [], "cmd": [], "workdir": "/", "user": "0"}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            env.clear()
            env["PATH"] = BASE_PATH
        elif word == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), ""), value)
        elif word in ("ENTRYPOINT", "CMD"):
            conf[word.lower()] = json.loads(rest)
        elif word == "WORKDIR":
            conf["workdir"] = rest
        elif word == "USER":
            conf["user"] = rest
    return conf


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion (``third_party/forked/golang/expansion`` of the kubelet), left to right:
    ``$$`` becomes ``$``; ``$(NAME)`` (NAME: anything up to the first ``)``) becomes the variable's value when it
    is defined and stays as written when not; any other ``$`` (an unclosed ``$(`` too) stays. The replacement is
    not expanded again. The kubelet's variables are the container's ``envFrom`` and earlier ``env`` entries (for
    ``env``), all of them (for ``command``/``args``); here ``env`` also holds the image's ENV (a superset: what
    the kubelet expands is expanded here too)."""
    return re.sub(r"\$\$|\$\(([^)]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def pod_views(job: dict, secrets: dict[str, dict[str, str]],
              dockerfile: Path = ROOT / "deploy" / "docker" / "Dockerfile.cpu") -> dict[str, tuple[list[str], dict]]:
    """What the containers of a DaskJob's pods see once the operator built them and the kubelet expanded them:
    ``{"runner": (argv, env), "scheduler": ..., "worker": ...}`` (:func:`operator_pods`, :func:`container_env`,
    :func:`container_argv`; the first worker)."""
    image = image_config(dockerfile)
    pods = operator_pods(job)
    out = {}
    for role, pod in (("runner", pods["runner"]), ("scheduler", pods["scheduler"]), ("worker", pods["workers"][0])):
        c = pod["spec"]["containers"][0]
        env = container_env(c, image, secrets, f"{role}-0")
        out[role] = (container_argv(c, image, env), env)
    return out


def container_env(container: dict, image: dict, secrets: dict[str, dict[str, str]], hostname: str) -> dict:
    env = dict(image["env"])
    env["HOSTNAME"] = hostname
    for src in container.get("envFrom", []):
        ref = src.get("secretRef") or {}
        if ref:
            if ref["name"] not in secrets and not ref.get("optional"):
                raise RuntimeError(f"Secret {ref['name']!r} not found (the pod would not start)")
            env.update({src.get("prefix", "") + k: v for k, v in secrets.get(ref["name"], {}).items()})
    for e in container.get("env", []):
        if "valueFrom" in e:
            raise RuntimeError(f"env {e['name']}: valueFrom is not supported by this harness")
        env[e["name"]] = expand(e.get("value", ""), env)
    return env


def container_argv(container: dict, image: dict, env: dict) -> list[str]:
    """Docker/Kubernetes rule: ``command`` replaces ENTRYPOINT (and drops CMD), ``args`` replaces CMD."""
    if "command" in container:
        argv = list(container["command"]) + list(container.get("args", []))
    else:
        argv = list(image["entrypoint"]) + list(container.get("args", image["cmd"]))
    return [expand(a, env) for a in argv]


def _quantity(text) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9}
    m = re.fullmatch(r"(\d+)([KMGT]i?)?", str(text))
    return int(m.group(1)) * units.get(m.group(2) or "", 1)


# ------------------------------------------------------------------------------------------------ sandbox

def missing_tools() -> list[str]:
    """Why this machine cannot run the sandbox (empty when it can)."""
    why = [f"{t} not found (apt-get install {pkg})" for t, pkg in
           (("bwrap", "bubblewrap"), ("setpriv", "util-linux"), ("nsenter", "util-linux"), ("tini", "tini"))
           if shutil.which(t) is None]
    if os.geteuid() != 0:
        why.append("must run as root: pods run under their own UID (setpriv) in a shared network namespace")
    return why


def _hidden_ancestors(path: Path) -> list[tuple[str, str]]:
    """(ancestor, child) pairs where a non-root user cannot traverse ``ancestor``: the sandbox mounts a tmpfs
    there and binds the child back, so the pod's UID reaches the interpreter (e.g. a pyenv under /root)."""
    out, parts = [], Path(path).resolve().parts
    for i in range(1, len(parts) - 1):
        anc = Path(*parts[: i + 1])
        if not (anc.stat().st_mode & stat.S_IXOTH):
            out.append((str(anc), str(Path(*parts[: i + 2]))))
            break
    return out


class PodProcess:
    def __init__(self, name: str, popen: subprocess.Popen, pid1: int, log: Path, argv: list[str]):
        self.name, self.popen, self.pid1, self.log, self.argv = name, popen, pid1, log, argv
        self.started = time.monotonic()

    def poll(self):
        return self.popen.poll()

    def signal(self, sig=signal.SIGTERM) -> None:
        """What the kubelet does on deletion: the signal to the container's PID 1."""
        if self.popen.poll() is None:
            try:
                os.kill(self.pid1, sig)
            except ProcessLookupError:
                pass

    def stop(self, grace: float = 30.0, term: bool = True) -> int:
        """SIGTERM (once: ``term=False`` when it was sent already), then SIGKILL after the termination grace
        period (Kubernetes' default 30 s)."""
        if term:
            self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.popen.kill()
            return self.popen.wait()

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class Sandbox:
    """One "cluster": a private network namespace (held by the moto S3 server) and the pods started in it."""

    def __init__(self, workdir: Path, dockerfile: Path = ROOT / "deploy" / "docker" / "Dockerfile.cpu"):
        self.workdir = Path(workdir)
        self.image = image_config(dockerfile)
        self.secrets: dict[str, dict[str, str]] = {}
        self.hosts: dict[str, str] = {}
        self.pods: list[PodProcess] = []
        self.anchor: subprocess.Popen | None = None
        self.s3_port = 5555
        self._image_dir = self.workdir / "image"
        self._make_image()
        self.not_enforced = list(NOT_ENFORCED)
        self._seccomp = self._make_seccomp()

    def _make_seccomp(self) -> Path | None:
        """The RuntimeDefault seccomp profile as a BPF program for bwrap --seccomp (libseccomp's Python binding,
        Debian's python3-seccomp); None, and said in ``not_enforced``, where it cannot be made."""
        path = self.workdir / "runtime-default.bpf"
        proc = subprocess.run(["/usr/bin/python3", "-c", _SECCOMP_BPF, str(path), *RUNTIME_DEFAULT_DENIED],
                              capture_output=True, text=True)
        if proc.returncode or not path.exists():
            why = (proc.stderr.strip().splitlines() or ["?"])[-1]
            self.not_enforced.insert(0, f"seccompProfile RuntimeDefault: no filter loaded (apt-get install"
                                        f" python3-seccomp: {why})")
            return None
        return path

    # the stand-in for the image's /opt/scaleattn
    def _make_image(self) -> None:
        bin_ = self._image_dir / "bin"
        bin_.mkdir(parents=True, exist_ok=True)
        (self._image_dir / "src").mkdir(exist_ok=True)  # mount point of the checkout
        py = Path(os.path.realpath(sys.executable))
        for n in ("python", "python3"):
            (bin_ / n).unlink(missing_ok=True)
            (bin_ / n).symlink_to(py)
        scripts = {"scaleattn": "from scaleattn.cli import main", "dask": "from dask.__main__ import main"}
        for n, imp in scripts.items():
            # as pip writes console scripts (the __main__ guard matters: the nanny spawns from this module)
            (bin_ / n).write_text(f"#!{IMAGE_PREFIX}/bin/python\nimport sys\n{imp}\n"
                                  "if __name__ == '__main__':\n    sys.exit(main())\n")
            (bin_ / n).chmod(0o755)
        self._binds = [a for p in {py, Path(sys.base_prefix), Path(sys.prefix)} for a in _hidden_ancestors(p)]

    def _in_netns(self) -> list[str]:
        return ["nsenter", f"--net={self._netns}", "--"]

    def start_network(self) -> None:
        """The private network namespace (loopback only), held by the S3 server running in it."""
        r, w = os.pipe()
        with open(self.workdir / "moto.log", "wb") as log:
            self.anchor = subprocess.Popen(
                ["bwrap", "--dev-bind", "/", "/", "--unshare-net", "--die-with-parent", "--info-fd", str(w), "--",
                 sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.s3_port)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(w,),
                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        os.close(w)
        info = _read_info(r, self.anchor, timeout=30)
        if info is None:
            raise RuntimeError("bwrap --unshare-net failed: "
                               + (self.workdir / "moto.log").read_text(errors="replace").strip()[-500:])
        self._netns = f"/proc/{info['child-pid']}/ns/net"
        self.run_host([sys.executable, "-c", _WAIT_PORT, str(self.s3_port)], timeout=60)

    @property
    def s3_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def run_host(self, argv: list[str], timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
        """A root process of the test (not a pod) inside the network namespace."""
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        proc = subprocess.run(self._in_netns() + argv, capture_output=True, text=True, timeout=timeout, env=full_env)
        if proc.returncode:
            raise RuntimeError(f"{argv[:4]} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        return proc

    def _bwrap_argv(self, pod: dict, container: dict, env: dict, argv: list[str], info_fd: int,
                    seccomp_fd: int | None) -> list[str]:
        spec = pod["spec"]
        sec = {**spec.get("securityContext", {}), **container.get("securityContext", {})}
        uid = int(sec.get("runAsUser", self.image["user"].split(":")[0]))
        gid = int(sec.get("runAsGroup", uid))
        if sec.get("runAsNonRoot") and uid == 0:
            raise RuntimeError(f"{pod['metadata']['name']}: runAsNonRoot with UID 0 (the kubelet refuses it)")
        groups = [str(spec.get("securityContext", {}).get("fsGroup", gid))]
        name = pod["metadata"]["name"]
        hosts = self.workdir / f"hosts-{name}"
        hosts.write_text("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n"
                         f"127.0.0.1\t{name}\n" + "".join(f"{ip}\t{h}\n" for h, ip in self.hosts.items()))
        a = ["bwrap", "--ro-bind" if sec.get("readOnlyRootFilesystem") else "--bind", "/", "/",
             "--dev", "/dev", "--proc", "/proc",
             # the container runtime's /dev/shm: a 64 MiB tmpfs (multiprocessing locks of the Dask nanny)
             "--perms", "1777", "--size", str(64 * 2**20), "--tmpfs", "/dev/shm"]
        for anc, child in self._binds:
            a += ["--tmpfs", anc, "--ro-bind", child, child]
        # the image's /opt holds only the venv: a tmpfs (root-owned, 0755) with the stand-in bound into it
        a += ["--tmpfs", str(Path(IMAGE_PREFIX).parent), "--ro-bind", str(self._image_dir), IMAGE_PREFIX,
              "--ro-bind", str(ROOT), f"{IMAGE_PREFIX}/src", "--ro-bind", str(hosts), "/etc/hosts"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for m in container.get("volumeMounts", []):
            vol = volumes[m["name"]]
            if "emptyDir" not in vol:
                raise RuntimeError(f"volume {m['name']}: only emptyDir is supported by this harness")
            size = vol["emptyDir"].get("sizeLimit")
            a += ["--perms", "1777"] + (["--size", str(_quantity(size))] if size else []) + ["--tmpfs", m["mountPath"]]
        a += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--hostname", name[:63],
              "--as-pid-1", "--die-with-parent", "--chdir", container.get("workingDir", self.image["workdir"]),
              "--clearenv"]
        for k, v in env.items():
            a += ["--setenv", k, v]
        profile = {**spec.get("securityContext", {}), **container.get("securityContext", {})}.get("seccompProfile")
        if profile and profile.get("type") == "RuntimeDefault" and seccomp_fd is not None:
            a += ["--seccomp", str(seccomp_fd)]
        a += ["--info-fd", str(info_fd), "--", "setpriv", f"--reuid={uid}", f"--regid={gid}",
              f"--groups={','.join(groups)}", "--inh-caps=-all", "--bounding-set=-all"]
        if sec.get("allowPrivilegeEscalation") is False:
            a.append("--no-new-privs")
        return a + ["--"] + argv

    def start(self, pod: dict, attempt: int = 0) -> PodProcess:
        """Start the pod's (single) container as the kubelet would; returns once its PID 1 exists.
        ``attempt``: the container's restart count (a log file of its own)."""
        name = pod["metadata"]["name"]
        (container,) = pod["spec"]["containers"]
        env = container_env(container, self.image, self.secrets, name)
        env["PYTHONPATH"] = f"{IMAGE_PREFIX}/src"  # the checkout under test (the image has it installed)
        argv = container_argv(container, self.image, env)
        log = self.workdir / (f"{name}.log" if not attempt else f"{name}.restart{attempt}.log")
        r, w = os.pipe()
        bpf = os.open(self._seccomp, os.O_RDONLY) if self._seccomp else None
        with open(log, "wb") as out:
            popen = subprocess.Popen(self._in_netns() + self._bwrap_argv(pod, container, env, argv, w, bpf),
                                     stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     pass_fds=(w,) + ((bpf,) if bpf is not None else ()), start_new_session=True)
        os.close(w)
        if bpf is not None:
            os.close(bpf)
        info = _read_info(r, popen, timeout=30)
        if info is None:
            popen.kill()
            popen.wait()
            raise RuntimeError(f"pod {name} did not start: {log.read_text(errors='replace')[-2000:]}")
        proc = PodProcess(name, popen, info["child-pid"], log, argv)
        self.pods.append(proc)
        return proc

    def close(self) -> None:
        for p in self.pods:
            if p.poll() is None:
                p.signal(signal.SIGKILL)
                p.popen.kill()
                p.popen.wait()
        if self.anchor is not None and self.anchor.poll() is None:
            os.killpg(self.anchor.pid, signal.SIGKILL)
            self.anchor.wait()


def _read_info(fd: int, popen: subprocess.Popen, timeout: float) -> dict | None:
    """bwrap's --info-fd JSON (child-pid: the container's PID 1 on this host), or None if bwrap failed."""
    import select

    buf, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                chunk = os.read(fd, 4096)
                buf += chunk
                try:
                    return json.loads(buf)
                except ValueError:
                    if not chunk:
                        return None
            elif popen.poll() is not None:
                return None
        return None
    finally:
        os.close(fd)


_WAIT_PORT = """
import socket, sys, time
deadline = time.monotonic() + 50
while True:
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[1])), 1).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit("S3 server did not start")
        time.sleep(0.2)
"""

class Deployment:
    """A pod of a Deployment (restartPolicy Always): the kubelet restarts its container when it exits, after
    10 s, 20 s, 40 s, ... (at most 300 s; CrashLoopBackOff)."""

    def __init__(self, box: Sandbox, pod: dict):
        self.box, self.pod, self.restarts, self._due = box, pod, 0, None
        self.proc = box.start(pod)
        self.history: list[PodProcess] = [self.proc]

    def tick(self) -> None:
        if self.proc.poll() is None:
            return
        now = time.monotonic()
        if self._due is None:
            self._due = now + min(300.0, 10.0 * 2 ** self.restarts)
        elif now >= self._due:
            self.restarts += 1
            self._due = None
            self.proc = self.box.start(self.pod, attempt=self.restarts)
            self.history.append(self.proc)


def wait_any(procs: list[PodProcess], timeout: float) -> bool:
    """True once every process in ``procs`` has ended, False after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def stop_all(procs: list[PodProcess], grace: float = 30.0) -> dict[str, int]:
    """Delete pods together: SIGTERM to each at once, SIGKILL after ``grace``; name -> exit code."""
    for p in procs:
        p.signal(signal.SIGTERM)
    codes: dict[str, int] = {}

    def one(p):
        codes[p.name] = p.stop(grace, term=False)

    threads = [threading.Thread(target=one, args=(p,)) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes
