"""The CPU kernels' fingerprint the studies record (eval/repro/kernels.py) and the pins keyed by it
(helpers.pinned_for_these_kernels): the same kernels give the same hashes, other kernel settings other hashes, and a
pin is compared only with the machine whose kernels it came from."""

import json
import subprocess
import sys

import pytest

from eval.repro.kernels import KINDS, describe, differing
from eval.repro.runs import child_env
from helpers import REPO, pinned_for_these_kernels


def _fingerprint(**env) -> dict:
    proc = subprocess.run([sys.executable, "-m", "eval.repro.kernels"], cwd=REPO, env={**child_env(), **env},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fingerprint_is_stable_and_tells_other_kernels_apart():
    """Two processes with the studies' settings agree to the bit; ATen without vector code changes the
    vectorised math and the random draws, MKL's SSE2 branch (COMPATIBLE, on every x86-64 CPU) its products."""
    runs = _fingerprint()
    assert _fingerprint() == runs and not differing(runs, runs)
    assert set(KINDS) <= set(runs) and runs["cpu"]
    scalar = _fingerprint(ATEN_CPU_CAPABILITY="default")
    assert {"vector_math", "random"} <= set(differing(runs, scalar))
    assert "blas" in differing(runs, _fingerprint(MKL_CBWR="COMPATIBLE"))


def _kernels(tag: str) -> dict:
    return {**{k: f"{tag}{k}"[:16].ljust(16, "0") for k in KINDS}, "cpu": f"cpu {tag}"}


def test_pins_are_kept_per_kernels(tmp_path):
    """A machine with a pin compares with its own entry; the file written beside the test replaces that entry
    only; a machine without one is skipped with what differs and how to add it (the entry then sits beside)."""
    pin = tmp_path / "pin.json"
    a, b = _kernels("a"), _kernels("b")
    pin.write_text(json.dumps({"pins": [{"kernels": a, "pinned": "2026-01-01", "values": {"x": 1}}]}))
    out = tmp_path / "out"
    out.mkdir()
    values, hint = pinned_for_these_kernels(pin, {"x": 2}, {**a, "cpu": "another cpu"}, out)  # cpu: not compared
    assert values == {"x": 1} and f"cp {out / 'pin.json'} {pin}" in hint
    assert [e["values"] for e in json.loads((out / "pin.json").read_text())["pins"]] == [{"x": 2}]
    with pytest.raises(pytest.skip.Exception, match="blas, vector_math, reductions, random, optimizer") as skipped:
        pinned_for_these_kernels(pin, {"x": 3}, b, out)
    assert describe(a) in str(skipped.value) and describe(b) in str(skipped.value)
    written = json.loads((out / "pin.json").read_text())["pins"]
    assert [(e["kernels"], e["values"]) for e in written] == [(a, {"x": 1}), (b, {"x": 3})]
    assert differing(a, {**a, "optimizer": "other"}) == ["optimizer"] and differing({}, a) == list(KINDS)
