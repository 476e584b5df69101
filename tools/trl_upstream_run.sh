#!/usr/bin/env bash
# TRL's DPO, KTO and GRPO trainer test files (tests/trl_upstream/vendored), whole, with TRL's own trainers (the
# control) and with ours swapped in, then the comparison (tools/trl_upstream_report.py). One pytest process per
# file and mode, in turn; each writes its JSON summary and log into OUT.
# Usage: bash tools/trl_upstream_run.sh [OUT]   (OUT defaults to /tmp/hl-trl-upstream; docs/howto/trl-upstream-tests.md)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-/tmp/hl-trl-upstream}"
mkdir -p "$out"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HL_TRL_STANDINS="${HL_TRL_STANDINS:-$out/standins}"
python="${PYTHON:-python3}"
timeout=()  # 300 s a test where pytest-timeout is installed (a hung test then fails instead of stopping the run)
"$python" -c "import pytest_timeout" 2>/dev/null && timeout=(--timeout 300)
python3 tools/trl_standins.py --out "$HL_TRL_STANDINS" >/dev/null
for mode in trl humanline; do
  for file in dpo kto grpo; do
    start=$SECONDS
    HL_TRL_UPSTREAM=$mode HL_TRL_UPSTREAM_REPORT="$out/$mode-$file.json" "$python" -m pytest -q -p no:cacheprovider \
      "${timeout[@]}" -rfEx tests/trl_upstream/vendored/test_${file}_trainer.py > "$out/$mode-$file.log" 2>&1
    echo "$mode $file: $(tail -n 1 "$out/$mode-$file.log") [wall $((SECONDS - start)) s]"
  done
done
python3 tools/trl_upstream_report.py --control "$out"/trl-*.json --ours "$out"/humanline-*.json \
  --json "$out/comparison.json" | tee "$out/comparison.md"
