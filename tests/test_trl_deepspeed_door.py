"""The resume door under DeepSpeed (ZeRO-2, one process, real ``deepspeed.initialize`` through accelerate,
``tests/distributed/trl_deepspeed_door.py``): a pickle payload planted in each of DeepSpeed's files of a humanline
TRL checkpoint (the model and optimizer states, ``latest``, ``zero_to_fp32.py``) never runs. The adapter's check
refuses each file a resume reads in one paragraph naming it; ``zero_to_fp32.py``, which no resume reads, leaves it
training on. With that check bypassed, DeepSpeed's own ``load_checkpoint`` goes through the weights-only checkpoint
engine the adapter installs, which refuses the payload in one paragraph; the control, DeepSpeed's default engine,
runs it (so the test can fail)."""

import json

import pytest

from helpers import REPO, run_torchrun
from trl_common import weights  # noqa: F401  (the fixture)

pytest.importorskip("trl")
pytest.importorskip("deepspeed")


def test_a_payload_in_deepspeeds_files_never_runs_and_the_engine_loads_weights_only(weights, tmp_path):  # noqa: F811
    report = tmp_path / "report.json"
    run_torchrun(REPO / "tests" / "distributed" / "trl_deepspeed_door.py",
                 [report, "--model", weights, "--work", tmp_path], nproc=1)
    result = json.loads(report.read_text())
    planted = result["planted"]
    assert any(name.endswith("optim_states.pt") for name in planted) and "latest" in planted, result["files"]
    for name, outcome in planted.items():
        assert not outcome["ran"], name
        if name == "zero_to_fp32.py":
            assert outcome["outcome"] == "trained", outcome
        else:
            message = outcome.get("message", "")
            assert outcome["outcome"] == "refused" and name in message and "\n" not in message, (name, outcome)
    engine = result["engine"]
    assert engine["outcome"] == "refused" and not engine["ran"], engine
    assert "DeepSpeed's `" in engine["message"] and "\n" not in engine["message"] and "Fix:" in engine["message"]
    assert result["control"]["ran"], result["control"]  # DeepSpeed's default engine unpickles: the payload runs
