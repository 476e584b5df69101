"""The resume door under DeepSpeed (ZeRO-2, one process, real ``deepspeed.initialize`` through accelerate,
``tests/distributed/trl_deepspeed_door.py``): a pickle payload planted in each of DeepSpeed's files of a humanline
TRL checkpoint (the model and optimizer states, ``latest``, ``zero_to_fp32.py``) never runs. The adapter's check
refuses each file a resume reads in one paragraph naming it; ``zero_to_fp32.py``, which no resume reads, leaves it
training on. With that check bypassed, DeepSpeed's own ``load_checkpoint`` goes through the weights-only checkpoint
engine the adapter installs, which refuses the payload in one paragraph; the control, DeepSpeed's default engine,
runs it (so the test can fail)."""

import json
from pathlib import Path

import pytest

from helpers import REPO, run_torchrun

pytest.importorskip("trl")
pytest.importorskip("deepspeed")


def test_a_payload_in_deepspeeds_files_never_runs_and_the_engine_loads_weights_only(weights, tmp_path):
    report = tmp_path / "report"
    results = {}
    for mode in ("planted", "script", "engine", "control"):
        run_torchrun(REPO / "tests" / "distributed" / "trl_deepspeed_door.py",
                     [report, "--model", weights, "--work", tmp_path, "--mode", mode], nproc=1)
        results.update(json.loads(Path(f"{report}.{mode}.json").read_text()))
    planted = results["planted"]
    print(f"DeepSpeed's files: {results['files']}")
    assert any(name.endswith("optim_states.pt") for name in planted) and "latest" in planted, results["files"]
    for name, outcome in planted.items():
        message = outcome.get("message", "")
        assert outcome["outcome"] == "refused" and not outcome["ran"], (name, outcome)
        assert name in message and "\n" not in message and "Fix:" in message, (name, outcome)
    assert results["script"]["outcome"] == "trained" and not results["script"]["ran"], results["script"]
    engine = results["engine"]
    assert engine["outcome"] == "refused" and not engine["ran"], engine
    assert "Refused to load checkpoint file" in engine["message"] and "model_states.pt" in engine["message"]
    assert "\n" not in engine["message"] and "Fix:" in engine["message"]
    assert results["control"]["ran"], results["control"]  # DeepSpeed's default engine unpickles: the payload runs
