#!/usr/bin/env bash
# Container entry point (Dockerfile ENTRYPOINT). Commands:
#   train RECIPE [key=value ...]   train; torchrun with NPROC_PER_NODE ranks (default: auto = one per GPU),
#                                  or a single rank when already inside a distributed launch (RANK is set)
#   validate RECIPE [...]          launchers/run.py RECIPE --validate (no GPU, no download)
#   plan RECIPE [...]              launchers/run.py RECIPE --plan (world layout, per-GPU memory estimate)
#   slurm                          (not here: render SLURM scripts on the login node; says how)
#   eval MODULE [args ...]         python -m eval.MODULE, e.g. `eval data_quality --help`
#   lm_eval [args ...]             lm-eval's own command line
#   help                           this text
# Anything else is executed as given (e.g. `bash`, `python -c ...`).
set -euo pipefail

HL_HOME="${HL_HOME:-/workspace/humanline}"
cd "$HL_HOME"

usage() {
  sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
}

cmd="${1:-help}"
if [ "$#" -gt 0 ]; then shift; fi

case "$cmd" in
  train)
    if [ -n "${RANK:-}" ]; then
      exec python launchers/run.py "$@"
    fi
    exec python -m torch.distributed.run --nproc-per-node="${NPROC_PER_NODE:-auto}" launchers/run.py "$@"
    ;;
  validate)
    exec python launchers/run.py "$@" --validate
    ;;
  plan)
    exec python launchers/run.py "$@" --plan
    ;;
  slurm)
    echo "error: SLURM scripts are rendered and submitted on the login node, not in this image (it has no sbatch, and" \
      "its paths are the container's). Fix: on the login node, from a checkout or an install of this package, run" \
      "\`python launchers/slurm.py RECIPE --container IMAGE\` (pyxis: REGISTRY#IMAGE:TAG or a .sqsh file;" \
      "Apptainer: a .sif file); the job then runs this image's code." >&2
    exit 2
    ;;
  eval)
    if [ "$#" -eq 0 ]; then
      echo "usage: eval MODULE [args ...]   (a module under eval/, e.g. data_quality)" >&2
      exit 2
    fi
    module="$1"
    shift
    exec python -m "eval.${module}" "$@"
    ;;
  lm_eval | lm-eval)
    exec lm_eval "$@"
    ;;
  help | -h | --help)
    usage
    ;;
  *)
    exec "$cmd" "$@"
    ;;
esac
