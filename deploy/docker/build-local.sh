#!/usr/bin/env bash
# Build both images with Debian's podman on a locally made base, then run a fit as containers of the CPU image.
# Not part of every CI run (it downloads a Debian base system and the images' Python packages: ~10 minutes).
#
#   sudo deploy/docker/build-local.sh            # from the repository root; needs root, podman, debootstrap
#   KEEP=1 deploy/docker/build-local.sh          # keep the work directory (default: removed at the end)
#
# The public base images (python:3.12-slim, nvidia/cuda) come from container registries; where those cannot be
# reached, a Debian bookworm minbase made by debootstrap (python3 = CPython 3.11, python3-venv, tini) stands in
# for both, passed as --build-arg PYTHON_IMAGE / CUDA_IMAGE. So the GPU image built here has no CUDA libraries:
# its build checks `import cupy, dask_cuda` (CuPy loads CUDA lazily) and `dask cuda worker --help` only.
#
# Then the job: moto (S3) on loopback, a small dataset, and the pods of the cpu overlay's DaskJob as containers
# of the CPU image: the operator's pod specs (tests/k8s_podman.py) become `podman run` with --read-only, a tmpfs
# /tmp, --user 10001:10001, --cap-drop ALL, no-new-privileges, the pods' env and args, on the host's loopback
# (--network host: the containers share one loopback, like the run-time test). Prints the times and sizes.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
VERSION=$(python3 -c "import tomllib; print(tomllib.load(open('pyproject.toml','rb'))['project']['version'])")
WORK=${WORK:-/var/tmp/scaleattn-build-local}
BASE=localhost/scaleattn-base:bookworm
MIRROR=${MIRROR:-http://deb.debian.org/debian}
PODMAN=(podman ${PODMAN_OPTS:-})
ULIMITS=()
mkdir -p "$WORK"
log() { printf '%s %s\n' "$(date +%T)" "$*" >&2; }
secs() { echo $(( $(date +%s) - $1 )); }
for tool in podman debootstrap; do
  command -v "$tool" >/dev/null || { echo "build-local.sh: $tool not found (apt-get install podman debootstrap)" >&2; exit 2; }
done

# 1. the base: Debian bookworm minbase + CPython (python3, venv), tini, CA certificates; `python` on PATH
t=$(date +%s)
if ! "${PODMAN[@]}" image exists "$BASE"; then
  if [ ! -e "$WORK/rootfs/.debootstrap-done" ]; then
    rm -rf "$WORK/rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv,tini,ca-certificates bookworm "$WORK/rootfs" \
      "$MIRROR" > "$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
    touch "$WORK/rootfs/.debootstrap-done"
  fi
  ln -sf /usr/bin/python3 "$WORK/rootfs/usr/local/bin/python"
  # this machine's extra CAs (a TLS-intercepting proxy between it and PyPI), kept by the images' own
  # `apt-get install ca-certificates` (update-ca-certificates reads /usr/local/share/ca-certificates)
  if compgen -G "/usr/local/share/ca-certificates/*.crt" > /dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$WORK/rootfs/usr/local/share/ca-certificates/"
    chroot "$WORK/rootfs" update-ca-certificates > /dev/null 2>&1
  fi
  rm -rf "$WORK/rootfs/var/lib/apt/lists/"* "$WORK/rootfs/var/cache/apt/"*.bin
  tar -C "$WORK/rootfs" --exclude=./.debootstrap-done -c . | "${PODMAN[@]}" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' --change 'CMD ["/bin/bash"]' \
    - "$BASE" > /dev/null
fi
BASE_S=$(secs "$t")
log "base $BASE ready in ${BASE_S} s"

# 1b. can this machine run a container? Seen on a VM with cgroup v1 + an empty cgroup2 "unified" mount (hybrid)
# and root without CAP_SYS_RESOURCE: crun refuses hybrid cgroups, and both crun and runc fail to raise
# RLIMIT_NOFILE/RLIMIT_NPROC to podman's defaults. Workaround: runc and ulimits below the current hard limits.
if ! out=$("${PODMAN[@]}" run --rm --network host "$BASE" true 2>&1); then
  log "podman run failed with the defaults: ${out//$'\n'/ }"
  PODMAN=(podman --runtime runc ${PODMAN_OPTS:-})
  ULIMITS=(--ulimit "nofile=$(( $(ulimit -Hn) / 2 )):$(( $(ulimit -Hn) / 2 ))" --ulimit "nproc=4096:4096")
  out=$("${PODMAN[@]}" run --rm --network host "${ULIMITS[@]}" "$BASE" true 2>&1) \
    || { echo "build-local.sh: podman cannot run containers here, also with runc and lower ulimits: $out" >&2; exit 1; }
  log "using: ${PODMAN[*]} ${ULIMITS[*]}"
fi

# 2. the images (BuildKit-free: podman's buildah; --network host reaches the package registries)
build() {  # dockerfile tag arg
  local t; t=$(date +%s)
  "${PODMAN[@]}" build --network host --pull=never "${ULIMITS[@]}" -f "deploy/docker/$1" --build-arg "$3=$BASE" -t "$2" . \
    > "$WORK/build-$1.log" 2>&1 || { tail -30 "$WORK/build-$1.log" >&2; echo "build-local.sh: building $1 failed (log: $WORK/build-$1.log)" >&2; return 1; }
  echo $(( $(date +%s) - t ))
}
CPU=localhost/scaleattn:$VERSION-cpu
GPU=localhost/scaleattn:$VERSION-gpu
CPU_S=$(build Dockerfile.cpu "$CPU" PYTHON_IMAGE); log "built $CPU in ${CPU_S} s"
GPU_S=$(build Dockerfile "$GPU" CUDA_IMAGE) || GPU_S=failed; log "built $GPU: ${GPU_S}"
size() { "${PODMAN[@]}" image inspect --format '{{.Size}}' "$1" 2>/dev/null | awk '{printf "%.0f MB", $1/1e6}'; }

# 3. the job as containers of the CPU image
PORT=5557
python3 -m moto.server -H 127.0.0.1 -p $PORT > "$WORK/moto.log" 2>&1 &
MOTO=$!
cleanup() {
  "${PODMAN[@]}" rm -f -t 0 $("${PODMAN[@]}" ps -aq --filter label=scaleattn-build-local) > /dev/null 2>&1 || true
  kill "$MOTO" 2>/dev/null || true
  [ -n "${KEEP:-}" ] || rm -rf "$WORK/rootfs"
}
trap cleanup EXIT
export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_DEFAULT_REGION=us-east-1 \
       AWS_ENDPOINT_URL=http://127.0.0.1:$PORT
python3 - "$PORT" <<'PY'
import socket, sys, time
for _ in range(100):
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[1])), 1).close(); break
    except OSError:
        time.sleep(0.2)
import boto3; boto3.client("s3").create_bucket(Bucket="scaleattn")
PY
PYTHONPATH=$ROOT python3 -m scaleattn.cli generate mhla s3://scaleattn/datasets/example.zarr --d 6 --heads 2 \
  --samples 8192 --length 32 --chunk-samples 512 --storage-option endpoint_url=$AWS_ENDPOINT_URL > /dev/null
# the operator's pods of the cpu overlay's DaskJob (with this image) as `podman run` lines
PYTHONPATH=$ROOT python3 tests/k8s_podman.py "$CPU" s3://scaleattn/runs/podman > "$WORK/pods.sh"
t=$(date +%s)
RC=0
while read -r role line; do
  line=${line/#podman run/${PODMAN[*]} run ${ULIMITS[*]}}
  if [ "$role" = runner ]; then
    eval "$line" > "$WORK/runner.log" 2>&1 || RC=$?
  else
    eval "$line" > /dev/null
  fi
done < "$WORK/pods.sh"
JOB_S=$(secs "$t")
# the scheduler (still up) serves Prometheus metrics on its dashboard port: prometheus_client is in the image
METRICS=$(python3 -c "
import urllib.request
text = urllib.request.urlopen('http://127.0.0.1:8787/metrics', timeout=10).read().decode()
print(sum(1 for line in text.splitlines() if line.startswith('dask_scheduler')), 'dask_scheduler_* samples')
" 2>&1 | tail -1)
for c in $("${PODMAN[@]}" ps -aq --filter label=scaleattn-build-local); do
  "${PODMAN[@]}" logs "$c" > "$WORK/pod-$c.log" 2>&1 || true
done
REPORT=$(python3 -c "
import boto3, json
r = json.loads(boto3.client('s3').get_object(Bucket='scaleattn', Key='runs/podman/report.json')['Body'].read())
print(f\"groups {r['groups']}, identifiable {r['identifiable']}, relative train MSE {r['relative_train_mse']:.2e}\")
" 2>/dev/null || echo "no report.json")
tail -3 "$WORK/runner.log" >&2

echo "base (debootstrap bookworm minbase + python3): ${BASE_S} s, $(size "$BASE")"
echo "cpu image $CPU: build ${CPU_S} s, $(size "$CPU")"
echo "gpu image $GPU: build ${GPU_S} s, $(size "$GPU")"
echo "job as containers of the cpu image: runner exit code $RC after ${JOB_S} s; $REPORT"
echo "scheduler /metrics: $METRICS"
exit $RC
