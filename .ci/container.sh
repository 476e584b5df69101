#!/usr/bin/env bash
# CI step after the test suite: build the project's real Dockerfile and use the image.
#
# The Dockerfile's default base (a CUDA PyTorch image) is a multi-GB registry pull, so CI builds it on a local
# stand-in base instead: a Debian bookworm root file system made by mmdebstrap, with a venv at /opt/venv first on
# PATH and the CPU torch wheel the suite runs (BASE_IMAGE contract: `python` on PATH, pip may install into its
# environment, torch already installed). Then, inside the image, with outputs on a mounted volume and no network:
#   validate recipes/tiny/humanline_dpo.yaml; a 4-update train; eval data_quality on the run's final/; and the sbatch
#   script launchers/slurm.py renders for pyxis, run with a stub srun that starts the container as pyxis would.
#
# Skips (prints the reason, exits 0) where podman cannot run: not root, no apt-get and no podman, the packages do
# not install, the runtime refuses to start a container, the torch wheel or the Debian archive cannot be fetched.
# Under CI=true each of those is a failure instead (exit 1, naming the missing capability): CI never turns green by
# skipping. Anything that fails after that is a failure (exit 1).
#
# Cache: ${HL_CI_CACHE:-~/.cache/humanline-ci} keeps podman's storage (the base images and the Dockerfile's layers),
# so a rerun after a code change redoes only `COPY . .` and `pip install -e .`. HL_CI_CONTAINER_CLEAN=1 removes
# every image afterwards. HL_TORCH_WHEEL=/path/to/torch-...-cp311-...whl uses that wheel instead of downloading one.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

TORCH_PIN="2.13.0+cpu"            # the suite's torch (.ci/run); the image is tested with this one
SUITE="bookworm"                  # Debian 12: python3.11, so the cp311 wheel
ROOTFS_IMAGE="localhost/hl-rootfs:${SUITE}"
BASE_IMAGE="localhost/hl-base:cpu-torch${TORCH_PIN%%+*}"
IMAGE="localhost/humanline:ci"
CACHE="${HL_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/humanline-ci}"
T0=$SECONDS

skip() {
  if [ "${CI:-}" = true ]; then
    echo "container step FAILED: CI=true and this machine lacks podman and runc able to build and run the image: $*" >&2
    exit 1
  fi
  echo "container step skipped: $*"
  exit 0
}
fail() {
  echo "container step FAILED: $*" >&2
  exit 1
}
step() {
  echo "[container] $* (t=$((SECONDS - T0)) s)"
}

[ "$(id -u)" = 0 ] || skip "not root (rootless podman is not set up by this script)"

# --- podman, buildah, runc, mmdebstrap (Debian packages) -------------------------------------------------------------
need=()
for tool in podman runc mmdebstrap; do command -v "$tool" >/dev/null || need+=("$tool"); done
if [ "${#need[@]}" -gt 0 ]; then
  command -v apt-get >/dev/null || skip "no apt-get to install ${need[*]}"
  step "installing podman buildah runc mmdebstrap"
  if ! (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        podman buildah runc mmdebstrap) >/dev/null 2>&1; then
    skip "apt-get could not install podman buildah runc mmdebstrap"
  fi
fi

# --- podman configuration: storage in the cache, runc, limits this host allows -------------------------------------
WORK="$(mktemp -d)"
mkdir -p "$CACHE/storage" "$CACHE/run"
# crun (podman's default) and podman's raised default limits fail in containers without CAP_SYS_RESOURCE; runc with
# the host's own hard limits works wherever podman can run at all.
nofile="$(ulimit -Hn)"; [ "$nofile" = unlimited ] && nofile=1048576
nproc="$(ulimit -Hu)"; { [ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ]; } && nproc=32768
cat > "$WORK/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=${nofile}:${nofile}", "nproc=${nproc}:${nproc}"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
cat > "$WORK/storage.conf" <<EOF
[storage]
driver = "overlay"
graphroot = "$CACHE/storage"
runroot = "$CACHE/run"
EOF
export CONTAINERS_CONF="$WORK/containers.conf" CONTAINERS_STORAGE_CONF="$WORK/storage.conf"
CONTAINERS=()
cleanup() {
  local name
  for name in "${CONTAINERS[@]}"; do podman rm -f "$name" >/dev/null 2>&1; done
  if [ "${HL_CI_CONTAINER_CLEAN:-0}" = 1 ]; then
    podman rmi -f "$IMAGE" "$BASE_IMAGE" "$ROOTFS_IMAGE" >/dev/null 2>&1
  fi
  podman image prune -f >/dev/null 2>&1  # the layers an earlier build of $IMAGE left untagged
  # podman with cgroupfs leaves empty per-container cgroups under libpod_parent
  find /sys/fs/cgroup -maxdepth 3 -type d -path '*/libpod_parent/*' -empty -delete 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT

podman info >/dev/null 2>&1 || skip "\`podman info\` fails: $(podman info 2>&1 | tail -n 1)"

# A CA bundle for the build steps' downloads (a TLS-inspecting proxy's root must be trusted inside the build);
# the image keeps Debian's own bundle.
CA_MOUNT=()
for bundle in /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt; do
  if [ -f "$bundle" ]; then CA_MOUNT=(-v "$bundle:/etc/ssl/certs/ca-certificates.crt:ro"); break; fi
done
BUILD=(nice -n 10 podman build --format docker --network host "${CA_MOUNT[@]}")

# --- 1. the Debian root file system (cached as an image) -----------------------------------------------------------
if ! podman image exists "$ROOTFS_IMAGE"; then
  step "mmdebstrap $SUITE minbase + python3"
  nice -n 10 mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$SUITE" "$WORK/rootfs.tar" >/dev/null 2>&1 || skip "mmdebstrap could not build a $SUITE root file system (no archive?)"
  podman import --quiet "$WORK/rootfs.tar" "$ROOTFS_IMAGE" >/dev/null || fail "podman import of the root file system"
  rm -f "$WORK/rootfs.tar"
fi
CONTAINERS+=(hl-ci-smoke)
if ! out="$(podman run --rm --name hl-ci-smoke --network none "$ROOTFS_IMAGE" python3 -c 'print(1)' 2>&1)"; then
  skip "the container runtime refused to start a container: $(tail -n 1 <<<"$out")"
fi

# --- 2. the stand-in base: venv + the CPU torch wheel (cached as an image) ------------------------------------------
if ! podman image exists "$BASE_IMAGE"; then
  wheel="${HL_TORCH_WHEEL:-}"
  if [ -z "$wheel" ]; then
    step "fetching the torch==$TORCH_PIN wheel"
    python3 -m pip download -q --no-deps --only-binary :all: --python-version 3.11 \
      --platform manylinux_2_28_x86_64 -d "$WORK/wheels" "torch==$TORCH_PIN" >/dev/null 2>&1 \
      || skip "no torch==$TORCH_PIN wheel (set HL_TORCH_WHEEL, or PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)"
    wheel="$(find "$WORK/wheels" -name "torch-${TORCH_PIN}-cp311-*.whl" | head -n 1)"
  fi
  [ -f "$wheel" ] || skip "the torch wheel \`$wheel\` is not a file"
  step "base image $BASE_IMAGE"
  mkdir -p "$WORK/base/wheels"
  cp "$wheel" "$WORK/base/wheels/"
  cat > "$WORK/base/Containerfile" <<EOF
FROM $ROOTFS_IMAGE
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin PIP_NO_CACHE_DIR=1
COPY wheels /tmp/wheels
RUN python3 -m venv /opt/venv && python -m pip install -q /tmp/wheels/*.whl && rm -rf /tmp/wheels
EOF
  "${BUILD[@]}" -q -t "$BASE_IMAGE" "$WORK/base" >"$WORK/base.log" 2>&1 \
    || { tail -n 20 "$WORK/base.log"; fail "building the base image"; }
fi

# --- 3. the project's Dockerfile, unchanged but for the base ------------------------------------------------------
step "podman build Dockerfile (BASE_IMAGE=$BASE_IMAGE)"
t=$SECONDS
"${BUILD[@]}" --build-arg "BASE_IMAGE=$BASE_IMAGE" -t "$IMAGE" -f Dockerfile . >"$WORK/build.log" 2>&1 \
  || { tail -n 30 "$WORK/build.log"; fail "building the Dockerfile"; }
echo "[container] built $IMAGE in $((SECONDS - t)) s, $(podman image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1/1e9}')"

# --- 4. use it: outputs on a mounted volume, no network ------------------------------------------------------------
OUT="$WORK/out"
mkdir -p "$OUT"
run() {
  local name="hl-ci-$1"
  shift
  CONTAINERS+=("$name")
  nice -n 10 podman run --rm --name "$name" --network none -e NPROC_PER_NODE=1 -e HF_HUB_OFFLINE=1 \
    -v "$OUT:/out" "$IMAGE" "$@"
}
step "validate"
run validate validate recipes/tiny/humanline_dpo.yaml output_dir=/out/run >"$WORK/validate.log" 2>&1 \
  || { cat "$WORK/validate.log"; fail "validate in the image"; }
step "train (4 updates)"
run train train recipes/tiny/humanline_dpo.yaml train.max_steps=4 eval.every=null output_dir=/out/run \
  >"$WORK/train.log" 2>&1 || { tail -n 30 "$WORK/train.log"; fail "train in the image"; }
[ -f "$OUT/run/final/model.safetensors" ] || fail "train wrote no final/model.safetensors on the volume"
updates="$(wc -l < "$OUT/run/metrics.jsonl")"
[ "$updates" = 4 ] || fail "metrics.jsonl on the volume has $updates rows, not 4"
python3 - "$OUT/run/summary.json" <<'PY' || fail "summary.json does not record exit code 0"
import json, sys
sys.exit(json.load(open(sys.argv[1])).get("exit_code") != 0)
PY
step "eval data_quality on final/"
run eval eval data_quality tests/fixtures/tiny/prefs/eval.jsonl --model /out/run/final --output /out/dq --offline \
  >"$WORK/eval.log" 2>&1 || { tail -n 30 "$WORK/eval.log"; fail "eval in the image"; }
[ -f "$OUT/dq/data_quality.json" ] || fail "eval wrote no data_quality.json on the volume"
grep -h -m 1 -i "data quality\|data_quality" "$WORK/eval.log" || true

# --- 5. the SLURM script launchers/slurm.py renders for pyxis, run as pyxis would run it -----------------------------
# A stub `srun` turns --container-image/--container-mounts/--container-workdir into `podman run` (pyxis has no
# podman backend; enroot runs the same image, the same mounts and the job's environment). The job runs the image's
# own launchers/run.py on this checkout's recipe, and must leave final/ in output_dir on the host.
step "pyxis-style SLURM job (rendered by launchers/slurm.py)"
mkdir -p "$WORK/stubs" "$WORK/hf"
cat > "$WORK/stubs/srun" <<'EOF'
#!/usr/bin/env bash
# srun stand-in: pyxis's --container-* options -> podman run (image REGISTRY#IMAGE -> REGISTRY/IMAGE)
set -euo pipefail
image="" mounts="" workdir=""
while [ "$#" -gt 0 ]; do
  case "$1" in
    --container-image=*) image="${1#*=}"; image="${image/\#//}" ;;
    --container-mounts=*) mounts="${1#*=}" ;;
    --container-workdir=*) workdir="${1#*=}" ;;
    --*) ;;
    *) break ;;
  esac
  shift
done
volumes=()
IFS=, read -r -a pairs <<<"$mounts"
for pair in "${pairs[@]}"; do volumes+=(-v "$pair"); done
exec nice -n 10 podman run --rm --name hl-ci-pyxis --network none --entrypoint "$1" "${volumes[@]}" -w "$workdir" \
  -e MASTER_ADDR -e MASTER_PORT -e HF_HOME -e HF_HUB_OFFLINE=1 -e CUDA_VISIBLE_DEVICES "$image" "${@:2}"
EOF
cat > "$WORK/stubs/scontrol" <<'EOF'
#!/usr/bin/env bash
if [ "$1 $2" = "show hostnames" ]; then echo localhost; fi
EOF
chmod +x "$WORK/stubs/srun" "$WORK/stubs/scontrol"
CONTAINERS+=(hl-ci-pyxis)
HF_HOME="$WORK/hf" python3 launchers/slurm.py recipes/tiny/humanline_dpo.yaml --nodes 1 --gpus-per-node 1 --cpu \
  --container "localhost#${IMAGE#localhost/}" --script "$WORK/job.sh" --dry-run \
  train.max_steps=4 eval.every=null "output_dir=$OUT/pyxis" >/dev/null 2>"$WORK/render.log" \
  || { cat "$WORK/render.log"; fail "launchers/slurm.py could not render the pyxis script"; }
grep -q '^RUN_PY=/workspace/humanline/launchers/run.py$' "$WORK/job.sh" || fail "the script does not run the image's code"
PATH="$WORK/stubs:$PATH" SLURM_JOB_ID=4242 SLURM_JOB_NODELIST=localhost SLURM_JOB_NUM_NODES=1 \
  bash "$WORK/job.sh" >"$WORK/pyxis.log" 2>&1 || { tail -n 30 "$WORK/pyxis.log"; fail "the pyxis-style job"; }
[ -f "$OUT/pyxis/final/model.safetensors" ] || fail "the pyxis-style job left no final/ in output_dir on the host"
[ "$(wc -l < "$OUT/pyxis/metrics.jsonl")" = 4 ] || fail "the pyxis-style job's metrics.jsonl does not have 4 rows"

echo "container step passed: validate, train (4 updates, final/ on the volume), eval on final/, and a pyxis-style" \
  "SLURM job (the image's code, output_dir mounted) in $IMAGE (total $((SECONDS - T0)) s)"
