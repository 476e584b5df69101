#!/usr/bin/env bash
# Container entry point (Dockerfile ENTRYPOINT). Commands:
#   train RECIPE [key=value ...]   train; torchrun with NPROC_PER_NODE ranks (default: auto = one per GPU),
#                                  or a single rank when already inside a distributed launch (RANK is set)
#   validate RECIPE [...]          launchers/run.py RECIPE --validate (no GPU, no download)
#   plan RECIPE [...]              launchers/run.py RECIPE --plan (world layout, per-GPU memory estimate)
#   slurm RECIPE [...]             launchers/slurm.py (render / submit an sbatch script)
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
    exec python launchers/slurm.py "$@"
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
