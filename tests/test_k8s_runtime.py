"""Run-time test of deploy/kubernetes: the cpu overlay, rendered by kustomize, turned into the pods the
dask-kubernetes operator creates (its own builder functions) and run as sandboxed processes (``k8s_pods``:
bubblewrap, read-only root, the pods' UID, no capabilities, the RuntimeDefault seccomp profile approximated,
tini as PID 1, one private loopback-only network namespace) against a moto S3 server holding a small generated
dataset. A probe pod first checks that isolation itself.

Scenarios: the happy path; the runner first and the scheduler 60 s later; no workers at all (the runner must
fail within the manifest's bound, with one clear line); SIGTERM to every pod (clean stop, checkpoint kept) and
a rerun of the same manifest that resumes. Needs root, bubblewrap, tini and util-linux, and python3-seccomp for
the seccomp filter (``.ci/run`` installs them); skips with the reason otherwise. About 4 minutes on 2 cores.
"""
from __future__ import annotations

import copy
import json
import re
import sys
import time

import pytest

pytestmark = pytest.mark.slow

yaml = pytest.importorskip("yaml", reason="PyYAML reads the manifests")
pytest.importorskip("moto", reason="moto[server] is the S3 server of the pods (pip install 'moto[server]')")
pytest.importorskip("boto3", reason="boto3 reads the S3 outputs")

from . import k8s_pods  # noqa: E402
from .test_submit import EXAMPLE_DATASET, EXAMPLE_OUT, K8S, rendered_job  # noqa: E402

SECRET = "scaleattn-s3"
BUCKET = EXAMPLE_DATASET.split("/")[2]
N_SAMPLES, LENGTH, D, CHUNK = 8192, 32, 6, 512  # 16 chunks -> 16 row groups (MIN_GROUPS, one chunk each)
# the SIGTERM scenario slows every task down (the package's test hook, env of the worker pods) so that the signal
# lands between the first finished row group and the last: 2 workers x 2 threads, 16 groups -> 4 waves
TASK_DELAY = 4
SCHEDULER_DELAY = 60.0
TEST_WORKER_TIMEOUT = 20  # the no-workers scenario shortens the manifest's bound to this
STARTUP_SLACK = 45.0  # interpreter start-up and the dataset check before the runner starts waiting


# S3 look-ups made inside the network namespace (python -c; argv: endpoint, command, args)
S3_TOOL = """
import json, sys, time, boto3
s3 = boto3.client("s3", endpoint_url=sys.argv[1], region_name="us-east-1",
                  aws_access_key_id="testing", aws_secret_access_key="testing")
cmd, args = sys.argv[2], sys.argv[3:]
def keys(prefix):
    bucket, _, pre = prefix.partition("/")
    out = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=pre):
        out += [o["Key"] for o in page.get("Contents", [])]
    return out
if cmd == "mb":
    s3.create_bucket(Bucket=args[0])
elif cmd == "ls":
    print(json.dumps(keys(args[0])))
elif cmd == "cat":
    bucket, _, key = args[0].partition("/")
    sys.stdout.write(s3.get_object(Bucket=bucket, Key=key)["Body"].read().decode())
elif cmd == "wait":  # until a key under the prefix exists
    deadline = time.monotonic() + float(args[1])
    while not keys(args[0]):
        if time.monotonic() > deadline:
            sys.exit(f"no key under {args[0]} after {args[1]} s")
        time.sleep(0.2)
"""


def s3(sandbox, *args: str, timeout: float = 120) -> str:
    return sandbox.run_host([sys.executable, "-c", S3_TOOL, sandbox.s3_endpoint, *args], timeout=timeout).stdout


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    why = k8s_pods.missing_tools()
    if why:
        pytest.skip("cannot run the pods in a sandbox: " + "; ".join(why))
    try:
        k8s_pods.operator_builders()
    except RuntimeError as e:
        pytest.skip(str(e))
    box = k8s_pods.Sandbox(tmp_path_factory.mktemp("k8s"))
    try:
        box.start_network()
    except RuntimeError as e:
        box.close()
        if "bwrap --unshare-net failed" in str(e):
            pytest.skip(f"no private network namespace here: {e}")
        raise
    print("\nsandbox does not enforce: " + "; ".join(box.not_enforced), file=sys.stderr)
    example = yaml.safe_load((K8S / "base" / "s3-secret.example.yaml").read_text())["stringData"]
    box.secrets[SECRET] = {**{k: "testing" for k in example}, "AWS_DEFAULT_REGION": "us-east-1",
                           "AWS_ENDPOINT_URL": box.s3_endpoint}
    s3(box, "mb", BUCKET)
    box.run_host([sys.executable, "-m", "scaleattn.cli", "generate", "mhla", EXAMPLE_DATASET, "--d", str(D),
                  "--heads", "2", "--samples", str(N_SAMPLES), "--length", str(LENGTH), "--chunk-samples", str(CHUNK),
                  "--storage-option", f"endpoint_url={box.s3_endpoint}"], env=box.secrets[SECRET])
    try:
        yield box
    finally:
        box.close()


def job_for(scenario: str) -> tuple[dict, str]:
    """The cpu overlay's DaskJob with its own output URL (the per-run value the overlay says to edit)."""
    job = copy.deepcopy(rendered_job("cpu"))
    out = f"{EXAMPLE_OUT}-{scenario}"
    runner = job["spec"]["job"]["spec"]["containers"][0]
    runner["env"] = [dict(e, value=out) if e["name"] == "OUT" else e for e in runner["env"]]
    return job, out


def run_job(box, job, *, scheduler_delay: float = 0.0, workers: bool = True, cap: float = 240.0,
            interrupt_when=None) -> dict:
    """Start the job's pods as the operator would and follow the runner (restartPolicy Never). The scheduler
    and the workers are Deployments: their containers are restarted when they exit (CrashLoopBackOff).
    ``interrupt_when``: a callable run once the pods are up; when it returns, every pod gets SIGTERM (grace
    30 s). When the runner ends the operator deletes the cluster (SIGTERM to the scheduler and workers)."""
    pods = k8s_pods.operator_pods(job)
    svc = pods["service"]["metadata"]["name"]
    box.hosts = {f"{svc}.default.svc.cluster.local": "127.0.0.1", f"{svc}.default": "127.0.0.1", svc: "127.0.0.1"}
    t0 = time.monotonic()
    deployments = []
    if not scheduler_delay:
        deployments.append(k8s_pods.Deployment(box, pods["scheduler"]))
    if workers:
        deployments += [k8s_pods.Deployment(box, p) for p in pods["workers"]]
    runner = box.start(pods["runner"])
    result = {"interrupted": None}

    def follow(until: float) -> None:  # the kubelet's restarts while the runner runs
        while runner.poll() is None and time.monotonic() - t0 < until:
            for d in deployments:
                d.tick()
            time.sleep(0.2)

    try:
        if scheduler_delay:
            follow(scheduler_delay)
            if runner.poll() is None:
                deployments.append(k8s_pods.Deployment(box, pods["scheduler"]))
            result["scheduler_started_after"] = time.monotonic() - t0
        if interrupt_when is not None:
            interrupt_when()
            result["interrupted_after"] = time.monotonic() - t0
            result["interrupted"] = k8s_pods.stop_all([d.proc for d in deployments] + [runner])
        follow(cap)
        result["seconds"] = time.monotonic() - t0
        result["ended"] = runner.poll() is not None
        if not result["ended"]:
            runner.stop(5)
        result["rc"] = runner.poll()
    finally:
        k8s_pods.stop_all([d.proc for d in deployments if d.proc.poll() is None])
    result["log"] = runner.text()
    result["logs"] = {p.log.name: p.text() for d in deployments for p in d.history}
    result["restarts"] = {d.pod["metadata"]["name"]: d.restarts for d in deployments}
    return result


def outputs(box, out: str) -> dict:
    keys = json.loads(s3(box, "ls", out.removeprefix("s3://")))
    report = None
    if f"{out.split('/', 3)[3]}/report.json" in keys:
        report = json.loads(s3(box, "cat", f"{out.removeprefix('s3://')}/report.json"))
    # chunk keys of the done mask (Zarr v3: done/c/<group>/<tile>), written once a row group's partial is stored
    ckpt = json.loads(s3(box, "ls", out.removeprefix("s3://") + ".checkpoint.zarr/done/c/"))
    return {"keys": keys, "report": report, "checkpoint_done": len(ckpt)}


def _why(res: dict) -> str:
    tail = "\n".join(res["log"].strip().splitlines()[-15:])
    return f"runner rc={res.get('rc')} after {res.get('seconds', 0):.0f} s; runner log tail:\n{tail}"


def _assert_complete(box, out: str, res: dict) -> dict:
    assert res["ended"] and res["rc"] == 0, _why(res)
    got = outputs(box, out)
    rep = got["report"]
    assert rep is not None, f"no report.json under {out}: {got['keys'][:10]}"
    assert rep["n_samples"] == N_SAMPLES and rep["d"] == D and rep["identifiable"] is True
    assert rep["relative_train_mse"] < 1e-8, rep["relative_train_mse"]  # realizable data: exact fit
    assert any(k.endswith("model.zarr/zarr.json") for k in got["keys"])
    assert got["checkpoint_done"] == 0, "the checkpoint of a finished fit is removed"
    return rep


_PROBE = r"""
import os, socket, subprocess
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
def fails(fn):
    try:
        fn()
        return False
    except OSError:
        return True
open("/tmp/ok", "w").write("x")
print("uid", os.getuid(), os.getgid(), sorted(os.getgroups()))
print("caps", status["CapEff"].strip(), status["CapBnd"].strip(), "nnp", status["NoNewPrivs"].strip(),
      "seccomp", status["Seccomp"].strip())
print("rofs", fails(lambda: open("/etc/probe", "w")), fails(lambda: open("/opt/scaleattn/probe", "w")))
print("pid1", open("/proc/1/cmdline").read().split("\0")[0])
print("ifaces", sorted(n for _, n in socket.if_nameindex()))
print("unshare", subprocess.run(["unshare", "-U", "true"], capture_output=True).returncode)
print("env", sorted(k for k in os.environ if k.startswith("AWS_")), os.environ["HOME"], os.environ["HOSTNAME"])
print("dns", socket.gethostbyname("scaleattn-fit-scheduler.default.svc.cluster.local"))
"""


def test_sandbox_isolates_the_pods_as_their_manifest_says(sandbox):
    """The harness itself: a runner pod of the overlay with its args replaced by a probe."""
    job, _ = job_for("probe")
    pod = k8s_pods.operator_pods(job)["runner"]
    pod["spec"]["containers"][0]["args"] = ["python", "-c", _PROBE]
    sandbox.hosts = {"scaleattn-fit-scheduler.default.svc.cluster.local": "127.0.0.1"}
    proc = sandbox.start(pod)
    assert k8s_pods.wait_any([proc], 60) and proc.poll() == 0, proc.text()
    got = dict(line.split(" ", 1) for line in proc.text().splitlines() if " " in line)
    assert got["uid"] == "10001 10001 [10001]"
    caps, nnp, seccomp = got["caps"].split(" ", 2)[0], got["caps"].split()[3], got["caps"].split()[5]
    assert caps == "0000000000000000" and got["caps"].split()[1] == "0000000000000000" and nnp == "1"
    assert got["rofs"] == "True True" and got["pid1"] == "tini"
    assert got["ifaces"] == "['lo']"  # the private network namespace: loopback only
    assert got["env"].startswith("['AWS_ACCESS_KEY_ID', 'AWS_DEFAULT_REGION', 'AWS_ENDPOINT_URL',")
    assert got["env"].endswith("/home/scaleattn scaleattn-fit-runner")  # image ENV, the pod's hostname
    assert got["dns"] == "127.0.0.1"
    if any(x.startswith("seccompProfile") for x in sandbox.not_enforced):
        pytest.skip("no seccomp filter here: " + sandbox.not_enforced[0])
    assert seccomp == "2" and got["unshare"] != "0", got  # RuntimeDefault refuses unshare


#: log lines from which a pod is being shut down: the runner's shutdown of the cluster, or the operator's SIGTERM
_SHUTDOWN = ("Reason: scheduler-close", "Received signal SIGTERM")


def _before_shutdown(log: str) -> str:
    """The part of a pod's log before its shutdown began. Once the scheduler closes, distributed can log the
    CommClosedError of a heartbeat or batched send still in flight (seen 1 in 4 runs on 2 loaded cores); a
    traceback in that window is not a crash."""
    cut = min((i for i in (log.find(m) for m in _SHUTDOWN) if i >= 0), default=len(log))
    return log[:cut]


def test_happy_path(sandbox):
    job, out = job_for("happy")
    res = run_job(sandbox, job)
    rep = _assert_complete(sandbox, out, res)
    assert rep["groups_computed"] == rep["groups"] == N_SAMPLES // CHUNK and rep["groups_resumed"] == 0
    bad = {k: t[max(0, t.index("Traceback") - 300):][:3000] for k, t in res["logs"].items()
           if "Traceback" in _before_shutdown(t)}
    assert not bad, f"a worker or the scheduler crashed: {bad}"
    assert not any(res["restarts"].values()), res["restarts"]


def test_scheduler_starts_60s_after_the_runner(sandbox):
    job, out = job_for("late")
    res = run_job(sandbox, job, scheduler_delay=SCHEDULER_DELAY)
    assert res.get("scheduler_started_after", 0) >= SCHEDULER_DELAY, _why(res)
    _assert_complete(sandbox, out, res)
    # workers that gave up on the absent scheduler were restarted by the kubelet, as on a cluster
    print(f"\nlate scheduler: {res['seconds']:.0f} s, container restarts {res['restarts']}", file=sys.stderr)


def _set_worker_bound(job: dict, seconds: int) -> int | None:
    """Shorten the manifest's bounds on the wait for workers (runner --worker-timeout, scheduler
    no-workers-timeout) for the test; returns the runner's bound, None if the manifest has none."""
    runner = job["spec"]["job"]["spec"]["containers"][0]
    args, bound = runner["args"], None
    for i, a in enumerate(args):
        if a == "--worker-timeout":
            args[i + 1], bound = str(seconds), seconds
        elif a.startswith("--worker-timeout="):
            args[i], bound = f"--worker-timeout={seconds}", seconds
    sched = job["spec"]["cluster"]["spec"]["scheduler"]["spec"]["containers"][0]
    for e in sched.get("env", []):
        if e["name"] == "DASK_DISTRIBUTED__SCHEDULER__NO_WORKERS_TIMEOUT":
            e["value"] = f"{seconds}s"
    return bound


def test_no_workers_fails_within_the_bound(sandbox):
    job, out = job_for("noworkers")
    bound = _set_worker_bound(job, TEST_WORKER_TIMEOUT)
    res = run_job(sandbox, job, workers=False, cap=TEST_WORKER_TIMEOUT + 2 * STARTUP_SLACK)
    assert res["ended"], f"the runner still waits for workers after {res['seconds']:.0f} s: nothing bounds it"
    assert bound is not None, "the runner's wait for workers is not configured in the manifest"
    assert res["seconds"] <= bound + STARTUP_SLACK, _why(res)
    assert res["rc"] not in (0, None), _why(res)
    lines = [ln for ln in res["log"].strip().splitlines() if ln.strip()]
    assert "Traceback" not in res["log"], _why(res)
    errors = [ln for ln in lines if ln.startswith("scaleattn fit: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], _why(res)
    assert re.search(r"no Dask worker.*within 20 s", errors[0]), errors[0]
    assert outputs(sandbox, out)["report"] is None


def test_sigterm_to_every_pod_keeps_the_checkpoint_and_a_rerun_resumes(sandbox):
    job, out = job_for("sigterm")
    worker = job["spec"]["cluster"]["spec"]["worker"]["spec"]["containers"][0]
    worker.setdefault("env", []).append({"name": "SCALEATTN_TEST_TASK_DELAY", "value": str(TASK_DELAY)})
    done_prefix = out.removeprefix("s3://") + ".checkpoint.zarr/done/c/"  # a finished row group
    res = run_job(sandbox, job, interrupt_when=lambda: s3(sandbox, "wait", done_prefix, "150",
                                                                     timeout=200))
    codes = res["interrupted"]
    assert codes is not None and res["ended"], _why(res)
    assert all(rc != -9 and rc != 137 for rc in codes.values()), f"a pod needed SIGKILL: {codes}"
    assert res["rc"] == 143, _why(res)  # 128 + SIGTERM, from the fit itself, not a kill
    last = res["log"].strip().splitlines()[-1]
    # the fit's own line, last; (distributed may log the cancelled client call and its lost scheduler before it)
    assert last.startswith("scaleattn fit: stopped by SIGTERM") and "--resume" in last, _why(res)
    # no traceback of ours (the bucket is also called scaleattn: the stop line names s3://scaleattn/...)
    assert "Terminated" not in res["log"] and not re.search(r'File "[^"]*/scaleattn/', res["log"]), _why(res)
    got = outputs(sandbox, out)
    assert got["report"] is None and 1 <= got["checkpoint_done"] < 8, got  # stopped in the middle of the build
    # the same manifest again (kubectl apply after the DaskJob is deleted): it continues from the checkpoint
    res2 = run_job(sandbox, job)
    rep = _assert_complete(sandbox, out, res2)
    assert rep["groups"] == 16 and rep["groups_resumed"] == got["checkpoint_done"], rep
    assert rep["groups_computed"] == 16 - got["checkpoint_done"], rep


@pytest.mark.parametrize("dollar", ["$(AWS_SECRET_ACCESS_KEY)", "$$(AWS_SECRET_ACCESS_KEY)", "$(DATASET)", "$(OUT)",
                                    "$(DASK_SCHEDULER_ADDRESS)", "$(UNDEFINED)", "$(", "$", "x$$y", "$()"])
def test_the_pods_see_each_user_value_as_submit_validated(dollar, monkeypatch):
    """Every user value of ``scaleattn submit`` that reaches the pods (dataset URL, --out, --storage-option,
    --fit-args), holding a ``$``: the operator's pods (its builders), expanded by the kubelet's rule
    (``k8s_pods.expand``) from an environment holding the Secret, see exactly the value submit validated, and the
    Secret's values appear in no argument and no value the fit reads. Needs no sandbox: this is what the
    sandbox's pods are started with."""
    from scaleattn import submit

    try:
        k8s_pods.operator_builders()
    except RuntimeError as e:
        pytest.skip(str(e))
    monkeypatch.setenv(submit.REGISTRY_ENV, submit.EXAMPLE_REGISTRY)
    dataset, out = f"s3://{BUCKET}/data/{dollar}.zarr", f"s3://{BUCKET}/runs/{dollar}/r1"
    options = {"endpoint_url": f"http://minio.example:9000/{dollar}", "anon": "false"}
    fit_args = ["--heads", "minimal", "--checkpoint", f"s3://{BUCKET}/ck/{dollar}", f"--cutoff-rtol={dollar}"]
    job = submit.render_daskjob(dataset, out, storage_options=options, fit_args=fit_args, secret=SECRET)
    secrets = {SECRET: {"AWS_ACCESS_KEY_ID": "AKIA-TEST", "AWS_SECRET_ACCESS_KEY": "the-secret-value",
                        "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}}
    views = k8s_pods.pod_views(job, secrets)
    argv, env = views["runner"]
    fit = argv[argv.index("scaleattn"):]
    assert fit[:5] == ["scaleattn", "fit", dataset, "--out", out]
    assert env["DATASET"] == dataset and env["OUT"] == out
    address = env["DASK_SCHEDULER_ADDRESS"]  # (the operator's: the one $(VAR) of the args meant to expand)
    assert fit[5:7] == ["--scheduler", address] and address.startswith("tcp://")
    assert fit[fit.index("--resume") + 1:] == [
        "--storage-option", f"endpoint_url=http://minio.example:9000/{dollar}", "--storage-option", "anon=false",
        *fit_args]
    for role, (a, e) in views.items():
        leaked = [x for x in a + [e.get("DATASET", ""), e.get("OUT", "")] if "the-secret-value" in x]
        assert not leaked, (role, leaked)
