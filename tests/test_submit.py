"""deploy/: Kubernetes manifests (kustomize base + cpu/gpu overlays), ``scaleattn submit`` and the Dockerfiles.

Needs (else the dependent tests skip with the reason): PyYAML, jsonschema, dask-kubernetes (ships the operator's
CRDs), kubernetes-validate (built-in kinds), kubectl (``kubectl kustomize``) or kustomize, kr8s (the
no-cluster error path). No cluster and no Docker engine are needed.

Validation is deliberately stricter than a plain ``jsonschema.validate`` of the CRD: null fields are dropped
first (as the API server does), and unknown fields are errors (``additionalProperties: false`` wherever the
CRD lists properties), like ``kubectl apply --validate=strict``. The pod templates and the scheduler Service
embedded in the DaskJob are also validated as real Pods/Services against the Kubernetes schemas.
"""
from __future__ import annotations

import copy
import functools
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import tomllib

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read the manifests (pip install pyyaml)")

from scaleattn import submit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
DOCKER = ROOT / "deploy" / "docker"
OVERLAYS = {"cpu": 0, "gpu": 1, "gpu-node-selector": 1}  # overlay -> GPUs per worker pod
NODE_SELECTORS = {"gpu-node-selector": submit.GPU_FEATURE_DISCOVERY_SELECTOR}  # overlay -> worker nodeSelector
# the per-run values the overlays carry (kept in step with deploy/kubernetes/overlays/*/kustomization.yaml)
EXAMPLE_DATASET = "s3://scaleattn/datasets/example.zarr"
EXAMPLE_OUT = "s3://scaleattn/runs/example"
EXAMPLE_WORKERS = 2
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# ------------------------------------------------------------------------------------------------ helpers

@pytest.fixture(autouse=True)
def _registry(monkeypatch):
    """The default image needs a registry (there is no public image): the overlays' placeholder one."""
    monkeypatch.setenv(submit.REGISTRY_ENV, submit.EXAMPLE_REGISTRY)


def drop_nulls(obj):
    """Remove None values (and keys holding them) recursively: the API server drops null fields."""
    if isinstance(obj, dict):
        return {k: drop_nulls(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [drop_nulls(v) for v in obj if v is not None]
    return obj


def _strict(schema: dict) -> dict:
    """CRD openAPIV3Schema -> JSON schema that rejects unknown fields (structural schemas prune them silently)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        if schema.get("nullable") and "type" in schema:
            schema["type"] = [schema["type"], "null"]
    elif isinstance(schema, list):
        schema = [_strict(v) for v in schema]
    return schema


@functools.cache
def crd_validator(kind: str):
    """jsonschema validator of the operator's CRD for ``kind`` (DaskJob, DaskCluster), shipped in dask-kubernetes."""
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema validates against the CRDs")
    # only the CRD files are needed: locate the package without importing it (its kubernetes client deps are
    # not needed here, so `pip install --no-deps dask-kubernetes` is enough)
    spec = importlib.util.find_spec("dask_kubernetes")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("dask-kubernetes is not installed: it ships the DaskJob/DaskCluster CRDs"
                    " (pip install --no-deps dask-kubernetes)")
    base = Path(list(spec.submodule_search_locations)[0]) / "operator"
    candidates = [base / "deployment" / "helm" / "dask-kubernetes-operator" / "crds" / f"{kind.lower()}.yaml"]
    for path in candidates:
        if path.is_file():
            crd = yaml.load(path.read_text(), Loader=_Loader)
            break
    else:  # pragma: no cover - layout of another dask-kubernetes release
        pytest.skip(f"no expanded {kind} CRD found under {base}")
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == kind
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = _strict(version["schema"]["openAPIV3Schema"])  # a new tree: the CRD is not modified
    schema["properties"].update({
        "apiVersion": {"type": "string", "enum": [f"{crd['spec']['group']}/v1"]},
        "kind": {"type": "string", "enum": [kind]},
        "metadata": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
            "namespace": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        }, "additionalProperties": False},
    })
    schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata", "spec"})
    # (check_schema of these ~0.5 MB schemas takes seconds; the broken-manifest test shows the schema bites)
    return jsonschema.Draft202012Validator(schema)


def validate_builtin(obj: dict) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate checks built-in kinds")
    try:
        kv.validate(drop_nulls(obj), kv.latest_version(), strict=True)
    except kv.ValidationError as e:  # re-raise as the jsonschema error for one assertion style
        raise AssertionError(str(e).splitlines()[0]) from e


def pods_of(job: dict) -> dict[str, dict]:
    spec = job["spec"]
    return {"runner": spec["job"]["spec"], "worker": spec["cluster"]["spec"]["worker"]["spec"],
            "scheduler": spec["cluster"]["spec"]["scheduler"]["spec"]}


def validate_daskjob(job: dict) -> None:
    """The DaskJob against its CRD, its cluster against the DaskCluster CRD, pods/Service as built-in kinds."""
    job = drop_nulls(job)
    crd_validator("DaskJob").validate(job)
    name = job["metadata"]["name"]
    # the operator turns spec.cluster into a DaskCluster of the job's name: that must be valid too
    cluster = {"apiVersion": job["apiVersion"], "kind": "DaskCluster",
               "metadata": {"name": name, "labels": dict(job["metadata"].get("labels", {}))},
               "spec": job["spec"]["cluster"]["spec"]}
    crd_validator("DaskCluster").validate(cluster)
    for role, pod in pods_of(job).items():
        validate_builtin({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{name}-{role}"}, "spec": pod})
    service = job["spec"]["cluster"]["spec"]["scheduler"]["service"]
    validate_builtin({"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"{name}-scheduler"},
                      "spec": service})


def validate_any(doc: dict) -> None:
    if doc.get("kind") == "DaskJob":
        validate_daskjob(doc)
    elif doc.get("kind") == "DaskCluster":
        crd_validator("DaskCluster").validate(drop_nulls(doc))
    else:
        validate_builtin(doc)


@functools.cache
def _kustomize_cmd():
    """(command, None) or (None, why not). The overlays use `patches:` (kustomize >= v4, i.e. kubectl >= 1.21);
    Debian bookworm's kubernetes-client (kubectl 1.20, kustomize v2) is too old."""
    if shutil.which("kubectl"):
        text = subprocess.run(["kubectl", "version", "--client"], capture_output=True, text=True, timeout=60).stdout
        kustomize = re.search(r"Kustomize Version: v(\d+)", text)
        client = re.search(r"v1\.(\d+)", text)
        if (kustomize and int(kustomize.group(1)) < 4) or (not kustomize and client and int(client.group(1)) < 21):
            return None, ("kubectl is too old for the overlays (needs kustomize >= v4, kubectl >= 1.21):"
                          f" {text.strip()!r}")
        return ["kubectl", "kustomize"], None
    if shutil.which("kustomize"):
        return ["kustomize", "build"], None
    return None, ("neither kubectl nor kustomize is on PATH: cannot render deploy/kubernetes"
                  " (install kubectl >= 1.21 or the kustomize binary)")


def kustomize_cmd():
    cmd, why = _kustomize_cmd()
    if cmd is None:
        pytest.skip(why)
    return cmd


@functools.cache
def _render_overlay(overlay: str) -> str:
    proc = subprocess.run([*kustomize_cmd(), str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, f"kustomize {overlay} failed: {proc.stderr}"
    return proc.stdout


def rendered(overlay: str) -> list[dict]:
    return [d for d in yaml.load_all(_render_overlay(overlay), Loader=_Loader) if d]


def rendered_job(overlay: str) -> dict:
    jobs = [d for d in rendered(overlay) if d["kind"] == "DaskJob"]
    assert len(jobs) == 1, f"overlay {overlay} must render exactly one DaskJob"
    return jobs[0]


def cli_main(argv: list[str]) -> int:
    """``scaleattn ARGV`` as the command line runs it (its one error-line format, exit codes)."""
    from scaleattn.cli import main

    return main(argv)


def dry_run(capsys, argv: list[str]) -> dict:
    rc = cli_main(["submit", *argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    docs = [d for d in yaml.load_all(out, Loader=_Loader) if d]
    assert len(docs) == 1
    return docs[0]


# ------------------------------------------------------------------------------------------------ kustomize

@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
@pytest.mark.slow
def test_overlay_renders_and_validates(overlay):
    docs = rendered(overlay)
    assert {d["kind"] for d in docs} == {"DaskJob"}
    for doc in docs:
        validate_any(doc)
    assert "kind: Secret" not in _render_overlay(overlay), "the example Secret must not be part of the kustomization"


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_overlay_equals_submit_rendering(overlay):
    """One source of truth: the kustomize files and render_daskjob agree field for field."""
    job = rendered_job(overlay)
    gpus = OVERLAYS[overlay]
    expected = submit.render_daskjob(EXAMPLE_DATASET, EXAMPLE_OUT, gpus=gpus, workers=EXAMPLE_WORKERS,
                                     image=submit.default_image(gpus, submit.EXAMPLE_REGISTRY),
                                     name=submit.DEFAULT_NAME, node_selector=NODE_SELECTORS.get(overlay))
    expected["metadata"].pop("namespace")  # the overlays leave the namespace to `kubectl apply -n`
    assert drop_nulls(job) == expected


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_overlay_pods_are_hardened(overlay):
    job = rendered_job(overlay)
    for role, pod in pods_of(job).items():
        assert pod["securityContext"]["runAsNonRoot"] is True, role
        assert pod["securityContext"]["runAsUser"] == submit.RUN_AS_USER != 0, role
        assert pod["automountServiceAccountToken"] is False, role
        tmp = {v["name"]: v for v in pod["volumes"]}["tmp"]
        assert "emptyDir" in tmp and tmp["emptyDir"]["sizeLimit"], role
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, role
            assert sc["capabilities"]["drop"] == ["ALL"], role
            assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"], role
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), (role, kind)
            for e in c.get("env", []):  # credentials only through the Secret
                assert not re.search(r"KEY|SECRET|TOKEN|PASSWORD", e["name"]), (role, e["name"])
                assert "valueFrom" in e or not re.search(r"(?i)aws_secret|password", str(e.get("value"))), role
    for role in ("runner", "worker"):
        c = pods_of(job)[role]["containers"][0]
        assert c["envFrom"] == [{"secretRef": {"name": submit.DEFAULT_SECRET}}], role
    assert pods_of(job)["runner"]["restartPolicy"] == "Never"  # a failed fit fails the job (and tears it down)


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_overlay_runner_scheduler_and_workers(overlay):
    job = rendered_job(overlay)
    name = job["metadata"]["name"]
    runner = pods_of(job)["runner"]["containers"][0]
    assert runner["args"] == ["scaleattn", "fit", "$(DATASET)", "--out", "$(OUT)", "--scheduler",
                              "$(DASK_SCHEDULER_ADDRESS)", "--scheduler-timeout", str(submit.SCHEDULER_TIMEOUT),
                              "--worker-timeout", str(submit.WORKER_TIMEOUT), "--resume"]
    assert submit.SCHEDULER_TIMEOUT >= 180  # measured: a 180 s wait makes a scheduler 60 s late harmless
    env = {e["name"]: e["value"] for e in runner["env"]}
    scheduler = pods_of(job)["scheduler"]["containers"][0]
    sched_env = {e["name"]: e["value"] for e in scheduler["env"]}
    assert sched_env["DASK_DISTRIBUTED__SCHEDULER__NO_WORKERS_TIMEOUT"] == f"{submit.WORKER_TIMEOUT}s"
    service = job["spec"]["cluster"]["spec"]["scheduler"]["service"]
    # the operator names the cluster after the job: the Service must select this cluster's scheduler only
    assert service["selector"] == {"dask.org/cluster-name": name, "dask.org/component": "scheduler"}
    assert {p["port"] for p in service["ports"]} == {8786, 8787}
    worker_pod = pods_of(job)["worker"]
    worker = worker_pod["containers"][0]
    assert job["spec"]["cluster"]["spec"]["worker"]["replicas"] == EXAMPLE_WORKERS
    images = {c["image"] for p in pods_of(job).values() for c in p["containers"]}
    assert len(images) == 1 and submit.registry_of(images.pop()) == "registry.example.com"
    if OVERLAYS[overlay]:
        assert env == {"DATASET": EXAMPLE_DATASET, "OUT": EXAMPLE_OUT, "NVIDIA_VISIBLE_DEVICES": "void"}
        assert sched_env["NVIDIA_VISIBLE_DEVICES"] == "void"  # the CUDA image's "all" must not reach them
        assert worker["args"][:3] == ["dask", "cuda", "worker"]
        assert "NVIDIA_VISIBLE_DEVICES" not in str(worker)  # the device plugin sets it for the allocated GPUs
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert worker["resources"]["requests"]["nvidia.com/gpu"] == "1"
        tolerations = worker_pod["tolerations"]
        # any nvidia.com/gpu taint (any value, any effect: NoSchedule and NoExecute) and AKS's sku=gpu
        assert {"key": "nvidia.com/gpu", "operator": "Exists"} in tolerations
        assert {"key": "sku", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"} in tolerations
        # node selection only where asked for: most clusters with only the device plugin lack the GFD label
        assert worker_pod.get("nodeSelector") == NODE_SELECTORS.get(overlay)
        assert all(c["image"].endswith("-gpu") for p in pods_of(job).values() for c in p["containers"])
        for role in ("runner", "scheduler"):  # no GPU held by the pods that do not compute
            assert "nvidia.com/gpu" not in str(pods_of(job)[role])
    else:
        assert env == {"DATASET": EXAMPLE_DATASET, "OUT": EXAMPLE_OUT}
        assert worker["args"][:2] == ["dask", "worker"]
        assert "nvidia.com/gpu" not in str(job) and "NVIDIA" not in str(job)
        assert "nodeSelector" not in worker_pod and "tolerations" not in worker_pod
        assert all(c["image"].endswith("-cpu") for p in pods_of(job).values() for c in p["containers"])


def test_example_secret_is_valid_and_documented():
    path = K8S / "base" / "s3-secret.example.yaml"
    secret = yaml.load(path.read_text(), Loader=_Loader)
    validate_builtin(secret)
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == submit.DEFAULT_SECRET
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(secret["stringData"])
    base = yaml.load((K8S / "base" / "kustomization.yaml").read_text(), Loader=_Loader)
    assert path.name not in str(base), "the example Secret must not be in the kustomization"


# ------------------------------------------------------------------------------------------------ broken input

def _broken_jobs(job: dict):
    def mutate(fn):
        j = copy.deepcopy(job)
        fn(j)
        return j

    yield "replicas is a string", mutate(lambda j: j["spec"]["cluster"]["spec"]["worker"].update(replicas="two"))
    yield "misspelt container field", mutate(
        lambda j: pods_of(j)["worker"]["containers"][0].update(imagePullPolicyy="Always"))
    yield "missing job", mutate(lambda j: j["spec"].pop("job"))
    yield "container without name", mutate(lambda j: pods_of(j)["runner"]["containers"][0].pop("name"))
    yield "GPU limit as integer", mutate(
        lambda j: pods_of(j)["worker"]["containers"][0]["resources"]["limits"].update({"nvidia.com/gpu": 1}))
    yield "unknown top-level field", mutate(lambda j: j.update(specs={}))
    yield "bad name", mutate(lambda j: j["metadata"].update(name="Scaleattn_Fit"))
    yield "wrong kind", mutate(lambda j: j.update(kind="DaskJobs"))


def test_broken_manifests_fail_validation():
    jsonschema = pytest.importorskip("jsonschema")
    job = submit.render_daskjob(EXAMPLE_DATASET, EXAMPLE_OUT, gpus=1)
    validate_daskjob(job)  # the unbroken one passes
    for what, broken in _broken_jobs(job):
        with pytest.raises((jsonschema.ValidationError, AssertionError)):
            validate_daskjob(broken)
            pytest.fail(f"{what}: accepted")
    # the embedded pods are checked as Pods too: an invalid pod field the CRD would not see as such
    bad = copy.deepcopy(job)
    pods_of(bad)["worker"]["securityContext"]["runAsNonRoot"] = "yes"
    with pytest.raises((jsonschema.ValidationError, AssertionError)):
        validate_daskjob(bad)
    secret = yaml.load((K8S / "base" / "s3-secret.example.yaml").read_text(), Loader=_Loader)
    secret["stringData"]["AWS_DEFAULT_REGION"] = 1
    with pytest.raises(AssertionError):
        validate_builtin(secret)


# ------------------------------------------------------------------------------------------------ scaleattn submit

def test_submit_dry_run_validates_and_carries_the_options(capsys):
    job = dry_run(capsys, [
        "s3://data/ds.zarr", "--out", "s3://results/run1", "--gpus", "2", "--workers", "5",
        "--image", "registry.example.com/ml/scaleattn:1.2.3-gpu", "--namespace", "ml-jobs", "--name", "fit-7",
        "--storage-option", "endpoint_url=https://minio.example:9000", "--storage-option", "anon=false",
        "--fit-args", "--heads minimal --resume", "--dry-run"])
    validate_daskjob(job)
    assert job["metadata"] == {"name": "fit-7", "namespace": "ml-jobs",
                               "labels": {"app.kubernetes.io/name": "scaleattn", "app.kubernetes.io/component": "fit"}}
    cluster = job["spec"]["cluster"]["spec"]
    assert cluster["worker"]["replicas"] == 5
    assert cluster["scheduler"]["service"]["selector"]["dask.org/cluster-name"] == "fit-7"
    worker = cluster["worker"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert worker["args"][:3] == ["dask", "cuda", "worker"]
    assert {c["image"] for p in pods_of(job).values() for c in p["containers"]} == {
        "registry.example.com/ml/scaleattn:1.2.3-gpu"}
    runner = pods_of(job)["runner"]["containers"][0]
    assert {e["name"]: e["value"] for e in runner["env"]} == {"DATASET": "s3://data/ds.zarr",
                                                              "OUT": "s3://results/run1",
                                                              "NVIDIA_VISIBLE_DEVICES": "void"}
    assert runner["args"][7:12] == ["--scheduler-timeout", "300", "--worker-timeout", "900", "--resume"]
    assert runner["args"][12:] == ["--storage-option", "endpoint_url=https://minio.example:9000",
                                   "--storage-option", "anon=false", "--heads", "minimal", "--resume"]


def test_submit_dry_run_cpu_defaults(capsys):
    job = dry_run(capsys, ["s3://data/ds.zarr", "--out", "s3://results/run1", "--dry-run"])
    validate_daskjob(job)
    assert re.fullmatch(rf"{submit.DEFAULT_NAME}-[0-9a-f]{{6}}", job["metadata"]["name"])
    assert job["metadata"]["namespace"] == "default"
    assert job["spec"]["cluster"]["spec"]["worker"]["replicas"] == 2
    assert "nvidia.com/gpu" not in str(job)
    assert {c["image"] for p in pods_of(job).values() for c in p["containers"]} == {
        f"registry.example.com/ml/scaleattn:{submit.manifest.__version__}-cpu"}  # from $SCALEATTN_REGISTRY


def test_submit_options_bounds_node_selector_deadline(capsys):
    job = dry_run(capsys, ["s3://data/ds.zarr", "--out", "s3://r/x", "--gpus", "1", "--registry",
                           "localhost:5000/team/", "--node-selector", "nvidia.com/gpu.present=true",
                           "--node-selector", "pool=a100", "--scheduler-timeout", "600", "--worker-timeout", "1200",
                           "--deadline", "86400", "--dry-run"])
    validate_daskjob(job)
    assert {c["image"] for p in pods_of(job).values() for c in p["containers"]} == {
        f"localhost:5000/team/scaleattn:{submit.manifest.__version__}-gpu"}
    worker = pods_of(job)["worker"]
    assert worker["nodeSelector"] == {"nvidia.com/gpu.present": "true", "pool": "a100"}
    runner = pods_of(job)["runner"]
    assert runner["activeDeadlineSeconds"] == 86400
    assert runner["containers"][0]["args"][7:11] == ["--scheduler-timeout", "600", "--worker-timeout", "1200"]
    sched = pods_of(job)["scheduler"]["containers"][0]
    assert {"name": "DASK_DISTRIBUTED__SCHEDULER__NO_WORKERS_TIMEOUT", "value": "1200s"} in sched["env"]


def test_submit_refuses_an_image_without_registry(monkeypatch, capsys):
    monkeypatch.delenv(submit.REGISTRY_ENV)
    rc = cli_main(["submit", *["s3://data/ds.zarr", "--out", "s3://r/x", "--dry-run"]])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "no image given: pass --image REGISTRY/scaleattn:" in err and "--registry" in err
    with pytest.raises(ValueError, match=r"pass `image='REGISTRY/scaleattn:.*` or `registry='REGISTRY'`") as e:
        submit.render_daskjob("s3://data/ds.zarr", "s3://r/x")  # the Python API names its keywords
    assert "--" not in str(e.value)
    for bad in ("scaleattn", "team/images"):  # Docker Hub names, not a registry host
        rc = cli_main(["submit", *["s3://d/ds.zarr", "--out", "s3://r/x", "--registry", bad,
                                                    "--dry-run"]])
        assert rc == 2 and "must start with a registry host" in capsys.readouterr().err
    # an explicit image without a registry is the user's choice (preloaded nodes, a mirror): a clear warning
    job = dry_run(capsys, ["s3://d/ds.zarr", "--out", "s3://r/x", "--image", "scaleattn:dev", "--dry-run"])
    assert pods_of(job)["runner"]["containers"][0]["image"] == "scaleattn:dev"
    rc = cli_main(["submit", *["s3://d/ds.zarr", "--out", "s3://r/x", "--image", "scaleattn:dev",
                                                "--dry-run"]])
    err = capsys.readouterr().err
    assert rc == 0 and "warning: image 'scaleattn:dev' names no registry" in err


@pytest.mark.parametrize("image, registry", [("registry.example.com/ml/scaleattn:1", "registry.example.com"),
                                             ("localhost/scaleattn:1", "localhost"), ("host:5000/x", "host:5000"),
                                             ("scaleattn:1", None), ("library/scaleattn", None)])
def test_registry_of(image, registry):
    assert submit.registry_of(image) == registry


def test_submit_through_the_cli(cli):
    r = cli("submit", "s3://data/ds.zarr", "--out", "s3://results/r", "--gpus", "1", "--workers", "3",
            "--name", "via-cli", "--dry-run")
    assert r.returncode == 0, r.stderr
    job = yaml.load(r.stdout, Loader=_Loader)
    validate_daskjob(job)
    assert job["metadata"]["name"] == "via-cli" and job["spec"]["cluster"]["spec"]["worker"]["replicas"] == 3


@pytest.mark.parametrize("kwargs, match", [
    (dict(workers=0), "workers must be >= 1"),
    (dict(gpus=-1), "gpus must be >= 0"),
    (dict(workers=1.5), "workers must be an integer"),
    (dict(dataset="/data/ds.zarr"), "object-storage URL"),
    (dict(dataset="https://example.com/ds.zarr"), "object-storage URL"),
    (dict(out="s3://bucket"), "bucket root"),
    (dict(out="s3:///path"), "out must name a bucket"),
    (dict(out="s3://b/run 1"), "whitespace"),
    (dict(out="s3://b/ds.zarr/"), r"`out='s3://b/ds\.zarr/'` is the dataset"),
    (dict(out="s3://b/ds.zarr/run"), r"`out='s3://b/ds\.zarr/run'` lies inside the dataset 's3://b/ds\.zarr'"),
    (dict(out="s3://b/x/../ds.zarr"), r"is the dataset"),
    (dict(dataset="s3://b/runs/ds.zarr", out="s3://b/runs"), r"`out='s3://b/runs'` contains the dataset"),
    (dict(name="Fit_1"), "name must be"),
    (dict(name="x" * 54), "name must be"),
    (dict(namespace="ML"), "namespace must be"),
    (dict(storage_options={"secret": "abc"}), "looks like a credential"),
    (dict(storage_options={"key": "AKIA"}), "looks like a credential"),
    (dict(storage_options="endpoint_url=http://x"), "`storage_options` must be a dict or a list of 'KEY=VALUE'"),
    (dict(storage_options=["endpoint_url"]), "`storage_options` expects KEY=VALUE"),
    (dict(storage_options=["secret=abc"]), "looks like a credential"),
    (dict(fit_args=["--scheduler", "tcp://x:8786"]), "set by the DaskJob"),
    (dict(fit_args="--heads 2"), "list of strings"),
    (dict(image="bad image"), "image must be"),
    (dict(scheduler_timeout=0), "scheduler_timeout must be >= 1"),
    (dict(worker_timeout=2.5), "worker_timeout must be an integer"),
    (dict(deadline=0), "deadline must be >= 1"),
    (dict(node_selector={"bad key!": "x"}), "not a valid label key"),
    (dict(node_selector={"pool": "a b"}), "not a valid label value"),
    (dict(fit_args=["--worker-timeout=5"]), "set by the DaskJob"),
    (dict(registry="scaleattn"), "must start with a registry host"),
])
def test_render_rejects_bad_options(kwargs, match):
    args = dict(dataset="s3://b/ds.zarr", out="s3://b/run")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        submit.render_daskjob(args.pop("dataset"), args.pop("out"), **args)


def test_submit_bad_options_exit_2(capsys):
    rc = cli_main(["submit", *["./local.zarr", "--out", "s3://b/r", "--dry-run"]])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.startswith("scaleattn submit: ") and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_submit_without_cluster_is_a_clear_error(tmp_path, monkeypatch, capsys):
    pytest.importorskip("kr8s", reason="kr8s talks to the Kubernetes API (pip install kr8s)")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "nowhere",
        "clusters": [{"name": "nowhere", "cluster": {"server": "https://127.0.0.1:9"}}],
        "contexts": [{"name": "nowhere", "context": {"cluster": "nowhere", "user": "u"}}],
        "users": [{"name": "u", "user": {"token": "t"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    for var in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(var, raising=False)
    job = submit.render_daskjob("s3://b/ds.zarr", "s3://b/run", name="no-cluster")
    with pytest.raises(submit.SubmitError, match="no Kubernetes cluster reachable") as info:
        submit.apply_daskjob(job, follow=False)
    assert "\n" not in str(info.value)
    rc = cli_main(["submit", *["s3://b/ds.zarr", "--out", "s3://b/run", "--name", "no-cluster"]])
    out, err = capsys.readouterr()
    assert rc == 2
    assert "no Kubernetes cluster reachable" in err and len(err.strip().splitlines()) == 1


def _fake_kr8s(monkeypatch, *, secrets=("scaleattn-s3",), create_error=None, statuses=(), runner_exit=None):
    """A stand-in for kr8s (no cluster here): records the created object, replays job statuses."""
    import sys
    import types

    class ServerError(Exception):
        def __init__(self, message, code):
            super().__init__(message)
            self.response = types.SimpleNamespace(status_code=code)

    kr8s = types.ModuleType("kr8s")
    kr8s.NotFoundError = type("NotFoundError", (Exception,), {})
    kr8s.ServerError = ServerError
    kr8s.api = lambda namespace=None: types.SimpleNamespace(version=lambda: {"gitVersion": "v1.33.1"})
    objects = types.ModuleType("kr8s.objects")
    created, replay = [], iter(statuses)

    class Secret:
        @classmethod
        def get(cls, name, namespace=None, api=None):
            if name not in secrets:
                raise kr8s.NotFoundError(name)

    def new_class(kind, version, namespaced=True, plural=None):
        assert (kind, version, plural) == ("DaskJob", "kubernetes.dask.org/v1", "daskjobs")

        class Job:
            def __init__(self, raw, namespace=None, api=None):
                self.raw = raw

            def create(self):
                if create_error:
                    raise ServerError(*create_error)
                created.append(self.raw)

            def refresh(self):
                self.raw = {**self.raw, "status": {"jobStatus": next(replay)}}
        return Job

    class Pod:  # the runner pod, kept after the job ends
        def __init__(self, name):
            self.name = name
            state = {"terminated": {"exitCode": runner_exit}} if runner_exit is not None else {"running": {}}
            self.raw = {"status": {"containerStatuses": [{"name": "runner", "state": state}]}}

        @classmethod
        def get(cls, name, namespace=None, api=None):
            return cls(name)

        def logs(self, container=None, tail_lines=None):
            assert container == "runner"
            yield from ["fitting ...", "scaleattn fit: error: the last line"][-tail_lines:]

    objects.Secret, objects.new_class, objects.Pod = Secret, new_class, Pod
    kr8s.objects = objects
    monkeypatch.setitem(sys.modules, "kr8s", kr8s)
    monkeypatch.setitem(sys.modules, "kr8s.objects", objects)
    return created


def test_apply_creates_and_follows_the_job(monkeypatch, capsys):
    created = _fake_kr8s(monkeypatch, statuses=["JobCreated", "ClusterCreated", "Running", "Running", "Successful"])
    job = submit.render_daskjob("s3://b/ds.zarr", "s3://b/run", name="fit-ok", namespace="ml")
    log = []
    assert submit.apply_daskjob(job, poll=0, log=log.append) == "Successful"
    assert created == [job]
    assert [m.split(" ", 1)[1] for m in log if m[:2].isdigit()] == [
        "fit-ok: JobCreated", "fit-ok: ClusterCreated", "fit-ok: Running", "fit-ok: Successful"]
    assert any("kubectl port-forward -n ml svc/fit-ok-scheduler 8787:8787" in m for m in log)
    assert "daskjob.kubernetes.dask.org/fit-ok created" in capsys.readouterr().out
    _fake_kr8s(monkeypatch, statuses=["Running", "Failed"])
    assert submit.apply_daskjob(job, poll=0, log=log.append) == "Failed"


@pytest.mark.parametrize("setup, match", [
    (dict(secrets=()), "Secret 'scaleattn-s3' not found in namespace 'default'"),
    (dict(create_error=("not found", 404)), "deploy the dask-kubernetes operator"),
    (dict(create_error=("conflict", 409)), "already exists"),
    (dict(create_error=("forbidden", 403)), "refused the DaskJob"),
])
def test_apply_errors_are_one_line(monkeypatch, setup, match):
    _fake_kr8s(monkeypatch, **setup)
    job = submit.render_daskjob("s3://b/ds.zarr", "s3://b/run")
    with pytest.raises(submit.SubmitError, match=match) as info:
        submit.apply_daskjob(job, follow=False, log=lambda m: None)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("final, code", [("Failed", 2), ("Failed", 137), ("Successful", 0)])
def test_submit_wait_exits_with_the_runners_code(monkeypatch, capsys, final, code):
    _fake_kr8s(monkeypatch, statuses=["Running", final], runner_exit=code)
    monkeypatch.setattr(submit.follow.time, "sleep", lambda s: None)
    rc = cli_main(["submit", *["s3://b/ds.zarr", "--out", "s3://b/run", "--name", "w", "--wait"]])
    err = capsys.readouterr().err
    assert rc == code
    assert ("runner exited with code" in err and "scaleattn fit: error: the last line" in err) == bool(code)


def test_submit_wait_refuses_no_follow_and_timeout(capsys):
    for extra in (["--no-follow"], ["--timeout", "60"]):
        rc = cli_main(["submit", *["s3://b/ds.zarr", "--out", "s3://b/run", "--wait", *extra]])
        assert rc == 2 and "--wait follows the job to its end" in capsys.readouterr().err


def test_yaml_round_trip():
    job = submit.render_daskjob("s3://b/ds.zarr", "s3://b/run", gpus=1, storage_options={"anon": True})
    assert yaml.load(submit.to_yaml(job), Loader=_Loader) == job
    assert "--storage-option" in job["spec"]["job"]["spec"]["containers"][0]["args"]
    assert "anon=true" in job["spec"]["job"]["spec"]["containers"][0]["args"]


# ------------------------------------------------------------------------------------------------ Dockerfiles

def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("dockerfile, extras", [("Dockerfile", {"gpu", "s3"}), ("Dockerfile.cpu", {"s3"})])
def test_dockerfile(dockerfile, extras):
    ins = _instructions(DOCKER / dockerfile)
    args = {rest.split("=", 1)[0]: rest.split("=", 1)[1] for w, rest in ins if w == "ARG" and "=" in rest}
    froms = [rest.split()[0] for w, rest in ins if w == "FROM"]
    assert froms, "no FROM"
    for ref in froms:
        ref = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], ref)
        name, _, tag = ref.partition(":")
        assert tag and tag != "latest" and re.search(r"\d+\.\d+\.\d+", tag), f"base image not pinned: {ref}"
        if dockerfile == "Dockerfile":
            assert name == "nvidia/cuda" and tag.startswith("12.") and "runtime" in tag
    users = [rest for w, rest in ins if w == "USER"]
    assert users and users[-1].split(":")[0] == str(submit.RUN_AS_USER), "must end as the non-root UID of the pods"
    # the pip install line of the package uses exactly extras that pyproject.toml defines
    project = _pyproject()
    installs = [rest for w, rest in ins if w == "RUN" and re.search(r'"/src\[', rest)]
    assert len(installs) == 1
    used = set(re.search(r'"/src\[([^\]]*)\]"', installs[0]).group(1).split(","))
    assert used == extras and used <= set(project["optional-dependencies"])
    assert "--constraint /tmp/constraints.txt" in installs[0]
    # the dashboard's /metrics needs prometheus_client; a `# syntax=` directive makes BuildKit fetch a frontend image
    assert re.search(r'"/src\[[^\]]*\]" prometheus_client ', installs[0]), installs[0]
    assert "import scaleattn, s3fs, bokeh, prometheus_client" in (DOCKER / dockerfile).read_text()
    assert not re.search(r"(?im)^#\s*syntax\s*=", (DOCKER / dockerfile).read_text())
    entry = [rest for w, rest in ins if w == "ENTRYPOINT"]
    assert entry and "tini" in entry[-1]
    # what the images copy is in the build context (.dockerignore allow-list)
    allowed = [ln[1:].rstrip("/") for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.startswith("!")]
    for w, rest in ins:
        if w == "COPY" and not rest.startswith("--from"):
            for src in rest.split()[:-1]:
                assert src.rstrip("/") in allowed, f"{src} is excluded by .dockerignore"
                assert (ROOT / src).exists(), f"{src} missing"


def test_constraints_pin_everything_the_images_install():
    packaging = pytest.importorskip("packaging.requirements", reason="packaging parses requirement strings")
    from packaging.version import Version

    pins = {}
    for line in (DOCKER / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints must be exact pins: {line}"
            pins[re.sub(r"[-_.]+", "-", name.lower())] = Version(version)
    project = _pyproject()
    reqs = project["dependencies"] + project["optional-dependencies"]["gpu"] + project["optional-dependencies"]["s3"]
    reqs += ["cuda-bindings>=12,<13", "bokeh>=3.1", "prometheus_client", "pip", "setuptools>=68", "wheel"]
    for text in reqs:
        req = packaging.Requirement(text)
        key = re.sub(r"[-_.]+", "-", req.name.lower())
        assert key in pins, f"{req.name} is not pinned in deploy/docker/constraints.txt"
        assert req.specifier.contains(pins[key], prereleases=True), f"pin {key}=={pins[key]} violates {text}"


def test_operator_version_is_pinned_in_the_docs_and_ci():
    """docs/kubernetes.md installs one operator chart version, CI validates against that release's CRDs."""
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    helm = re.findall(r"helm install[^`]*?dask-kubernetes-operator[^`]*", docs)
    assert helm, "no helm install of the operator in docs/kubernetes.md"
    pins = {m for h in helm for m in re.findall(r"--version\s+(\S+)", h)}
    assert len(pins) == 1 and all(re.fullmatch(r"\d{4}\.\d+\.\d+", p) for p in pins), helm
    (pin,) = pins
    assert f"dask-kubernetes=={pin}" in (ROOT / ".ci" / "run").read_text()
    try:
        from importlib.metadata import version
        installed = version("dask-kubernetes")
    except Exception:
        pytest.skip("dask-kubernetes is not installed")
    assert installed == pin, f"installed dask-kubernetes {installed} (its CRDs are validated) != documented {pin}"


@pytest.mark.parametrize("fit_args, message", [
    ("--heads foo", r"--fit-args '--heads foo': --heads must be 'svd', 'minimal' or a positive integer, got 'foo'"),
    ("--bogus-option", r"--fit-args '--bogus-option': not options `scaleattn fit` takes: unrecognized arguments:"
                       r" --bogus-option"),
    ("--cutoff-rtol x", r"not options `scaleattn fit` takes: argument --cutoff-rtol/--rtol: invalid float value"),
    ("-h", r"--fit-args '-h': not options `scaleattn fit` takes: it asks for help"),
])
def test_fit_args_are_parsed_as_the_runner_s_fit_will(capsys, fit_args, message):
    """A typo in --fit-args fails at submit, in one line, not in the runner pod minutes later (it was accepted)."""
    rc = cli_main(["submit", "s3://b/ds.zarr", "--out", "s3://b/run", "--registry", "r.example.com/ml", "--dry-run",
                   f"--fit-args={fit_args}"])
    out, err = capsys.readouterr()
    assert rc == 2 and not out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scaleattn submit: error: ") and re.search(message, lines[0]), err
    assert lines[0].endswith("(see scaleattn submit --help)")
    assert dry_run(capsys, ["s3://b/ds.zarr", "--out", "s3://b/run", "--registry", "r.example.com/ml", "--dry-run",
                            "--fit-args", "--heads minimal --no-plots"])


# ------------------------------------------------------------------------------------------------ $(VAR) expansion

#: the kubelet expands $(VAR) in a container's args and env values from its environment, which holds the Secret
SECRET_ENV = {"AWS_ACCESS_KEY_ID": "AKIA-TEST", "AWS_SECRET_ACCESS_KEY": "the-secret", "DATASET": "s3://other/x",
              "DASK_SCHEDULER_ADDRESS": "tcp://sched:8786", "HOSTNAME": "runner-0"}
#: values a user may give that hold a $: every one must reach the pods as written
DOLLARS = ["$(AWS_SECRET_ACCESS_KEY)", "$$(AWS_SECRET_ACCESS_KEY)", "$(DATASET)", "$(NOT_DEFINED)", "$(", "$$", "$",
           "a$b", "$(AWS_ACCESS_KEY_ID)$(HOSTNAME)", "$$$(AWS_SECRET_ACCESS_KEY)", "$()"]


def _pod_sees(job: dict) -> tuple[list[str], dict]:
    """The runner's args and env values as the kubelet expands them (tests/k8s_pods.expand: its rule)."""
    from .k8s_pods import expand

    c = pods_of(job)["runner"]["containers"][0]
    env = dict(SECRET_ENV)
    for e in c["env"]:
        env[e["name"]] = expand(e["value"], env)
    return [expand(a, env) for a in c["args"]], env


@pytest.mark.parametrize("dollar", DOLLARS)
@pytest.mark.parametrize("field", ["dataset", "out", "storage_option", "fit_args", "fit_args_joined"])
def test_every_user_value_reaches_the_pod_as_validated(field, dollar):
    dataset, out = "s3://b/data/ds.zarr", "s3://b/runs/r1"
    kw: dict = {}
    if field == "dataset":
        dataset = f"s3://b/data/{dollar}.zarr"
    elif field == "out":
        out = f"s3://b/runs/{dollar}"
    elif field == "storage_option":
        kw["storage_options"] = {"endpoint_url": f"https://minio.example/{dollar}", "anon": "false"}
    elif field == "fit_args":
        kw["fit_args"] = ["--heads", "minimal", "--checkpoint", f"s3://b/ck/{dollar}"]
    else:
        kw["fit_args"] = [f"--checkpoint=s3://b/{dollar}/ck"]
    job = submit.render_daskjob(dataset, out, secret="scaleattn-s3", **kw)
    args, env = _pod_sees(job)
    assert env["DATASET"] == dataset and env["OUT"] == out
    assert args[:5] == ["scaleattn", "fit", dataset, "--out", out]
    assert args[5:7] == ["--scheduler", SECRET_ENV["DASK_SCHEDULER_ADDRESS"]]  # (ours: expanded, as meant)
    tail = args[args.index("--resume") + 1:]
    if field == "storage_option":
        assert tail == ["--storage-option", f"endpoint_url=https://minio.example/{dollar}",
                        "--storage-option", "anon=false"]
    elif field.startswith("fit_args"):
        assert tail == kw["fit_args"]
    else:
        assert tail == []
    assert not any("the-secret" in a for a in args) and "the-secret" not in (env["DATASET"] + env["OUT"])


def test_submit_dry_run_escapes_what_the_kubelet_would_expand(capsys):
    """Through the command line: the YAML carries $$( where the user wrote $(, and the pod sees the user's text."""
    job = dry_run(capsys, ["s3://b/$(AWS_SECRET_ACCESS_KEY).zarr", "--out", "s3://b/out-$(HOSTNAME)",
                           "--storage-option", "endpoint_url=http://$(AWS_ACCESS_KEY_ID).evil:9000",
                           "--fit-args", "--checkpoint s3://b/$(DATASET)/ck --heads minimal", "--dry-run"])
    runner = pods_of(job)["runner"]["containers"][0]
    values = {e["name"]: e["value"] for e in runner["env"]}
    assert values["DATASET"] == "s3://b/$$(AWS_SECRET_ACCESS_KEY).zarr" and values["OUT"] == "s3://b/out-$$(HOSTNAME)"
    args, env = _pod_sees(job)
    assert env["DATASET"] == "s3://b/$(AWS_SECRET_ACCESS_KEY).zarr" and env["OUT"] == "s3://b/out-$(HOSTNAME)"
    assert args[-6:] == ["--storage-option", "endpoint_url=http://$(AWS_ACCESS_KEY_ID).evil:9000", "--checkpoint",
                         "s3://b/$(DATASET)/ck", "--heads", "minimal"]
    # every other string of the manifest that a kubelet expands is the package's own (no user text, no $ but ours)
    ours = {"$(DATASET)", "$(OUT)", "$(DASK_SCHEDULER_ADDRESS)", "$(DASK_WORKER_NAME)"}
    for p in pods_of(job).values():
        for c in p["containers"]:
            for a in c.get("args", []) + [e.get("value", "") for e in c.get("env", [])]:
                assert "$" not in a.replace("$$", "") or a in ours, a


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="fit-$(x)"), "name must be"),
    (dict(namespace="$(NS)"), "namespace must be"),
    (dict(secret="s3-$(X)"), "secret must be"),
    (dict(image="registry.example.com/ml/scaleattn:$(TAG)"), "image must be"),
    (dict(image="$(IMAGE)"), "image must be"),
    (dict(registry="registry.example.com/$(X)"), "registry"),
    (dict(node_selector={"pool": "$(POOL)"}), "not a valid label value"),
    (dict(node_selector={"$(K)": "x"}), "not a valid label key"),
    (dict(storage_options={"$(K)": "x"}), "storage option names must be identifiers"),
])
def test_values_that_cannot_be_escaped_are_refused(kwargs, match):
    """Fields that are not args or env values (names, labels, the image) cannot hold a $: refused, one line."""
    with pytest.raises(ValueError, match=match):
        submit.render_daskjob("s3://b/ds.zarr", "s3://b/run", **kwargs)


def test_submit_refuses_a_dollar_in_a_name_in_one_line(capsys):
    rc = cli_main(["submit", "s3://b/ds.zarr", "--out", "s3://b/r", "--name", "fit-$(X)", "--dry-run"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.startswith("scaleattn submit: error: ") and len(err.strip().splitlines()) == 1
