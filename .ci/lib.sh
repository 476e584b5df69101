# Shared by .ci/run and its step scripts (.ci/docs.sh): sourced, not run.
# shellcheck shell=bash
# A capability the tests need beyond Python packages (SLURM's daemons, chromium, podman and runc, the vLLM environment,
# the real model's package): under CI=true its absence fails the run, naming it; a local run warns and the tests that
# need it skip with the reason (tests/capabilities.py, .ci/container.sh).
missing() {  # CAPABILITY WHY
  if [ "${CI:-}" = true ]; then
    echo "error: CI=true and this machine lacks $1: $2" >&2
    exit 1
  fi
  echo "warning: $1 is missing ($2); the tests that need it will be skipped"
}
step_times=()  # "name seconds", printed at the end (docs/contributing.md's table is written from them)
timed() {  # NAME START_SECONDS
  step_times+=("$1 $((SECONDS - $2))")
}
apt_install() {  # PACKAGE...: Debian's packages, as root
  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@") >/dev/null 2>&1
}
