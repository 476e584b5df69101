"""Hostile inputs and faults of issue 39, rows of the same table as ``tests/test_hostile_cases.py`` (its ``Row``,
its in-process runner and its checks: exit 2, exactly one ``error:`` line holding the file or key, no traceback):

* a model directory whose ``pytorch_model.bin`` is a pickle with code in it, at the four entry points that load a
  model's weights (training with ``model.random_init=false``, ``python -m eval --data-quality`` on it as a run's
  ``final/``, ``--math500`` with the hf backend, AlpacaEval with a reward-model judge ``rm:DIR``): refused before
  any weights load, and the code never ran;
* ``rollout.reward.kind=callable`` with a function of another signature (``os:system``);
* ``--validate`` under a malformed launcher environment (``RANK=abc``: it exited 0).

The disk-full rows (their own exit code) are in ``tests/test_disk_full.py``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Dict

import pytest

from helpers import REPO
from hostile import Row, check_refusal, fill, run_row, weights_dir


@pytest.fixture(autouse=True)
def restored_process():
    """An in-process run leaves the environment as DeepSpeed set it (RANK, LOCAL_RANK, ...), which a later test's
    `--validate` would read as a launch: the environment, threads, generators and process group put back."""
    from launchers.in_process import restored_process_state  # the study workers' own restorer

    with restored_process_state():
        yield


class RunsCode:
    """Pickles to ``os.system(command)``: what a weights-only load must refuse without running."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> Dict[str, str]:
    import torch
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("faults")
    good = weights_dir(root)
    evil = root / "pickled_code"
    shutil.copytree(good, evil)
    tensors = load_file(evil / "model.safetensors")
    (evil / "model.safetensors").unlink()
    torch.save({**tensors, "extra": RunsCode(f"touch {root / 'PWNED'}")}, evil / "pytorch_model.bin")
    # a look-ahead run (k = 3) checkpointed at step_2, inside a window: its stored log-probs replaced by a list (a
    # well-typed pickle of the wrong shape)
    lookahead = root / "lookahead"
    from launchers.in_process import restored_process_state
    from launchers.run import main

    with restored_process_state():
        assert main([fill(a, {"root": str(root)}) for a in LOOKAHEAD + ["train.max_steps=2"]]) == 0
    torch.save([1.0, 2.0], lookahead / "checkpoints" / "step_2" / "reference_logps_rank00000.pt")
    return {"root": str(root), "weights": str(good), "evil": str(evil), "repo": str(REPO)}


R = ["recipes/tiny/offline_dpo.yaml"]
LOOKAHEAD = ["recipes/tiny/humanline_dpo.yaml", "output_dir={root}/lookahead", "logging.progress_bar=false",
             "humanline.sync_every=3", "humanline.reference=lookahead", "checkpoint.save_every=2", "eval.every=null"]
MATH500 = ["--math500", "tests/fixtures/eval/math500_20.jsonl", "--limit", "2", "--max-new-tokens", "2",
           "--backend", "hf", "--offline", "--output", "{root}/eval_out"]
EVIL_BIN = "{evil}/pytorch_model.bin"
CODE = ["`posix.system`", "nothing of it ran"]

ROWS = [
    Row("pickled code: training with model.random_init=false", "run",
        R + ["output_dir={root}/run", "logging.progress_bar=false", "model.name_or_path={evil}",
             "model.random_init=false"], ["model.name_or_path", EVIL_BIN, *CODE]),
    Row("pickled code: --validate", "run", R + ["model.name_or_path={evil}", "model.random_init=false", "--validate"],
        ["model.name_or_path", EVIL_BIN, *CODE]),
    Row("pickled code: data quality of a final/", "eval",
        ["{evil}", "--data-quality", "tests/fixtures/tiny/prefs/train.jsonl", "--offline", "--output", "{root}/dq"],
        [EVIL_BIN, *CODE]),
    Row("pickled code: math500 hf backend", "eval", ["{evil}"] + MATH500, [EVIL_BIN, *CODE]),
    Row("pickled code: alpaca reward-model judge", "eval",
        ["{weights}", "--alpaca", "{repo}/tests/fixtures/eval/alpaca_eval_6.json", "--judge", "rm:{evil}",
         "--offline", "--alpaca-max-new-tokens", "2", "--output", "{root}/alpaca_out"],
        ["reward model", EVIL_BIN, *CODE]),
    Row("reward callable of another signature", "run",
        ["recipes/tiny/online_grpo_math.yaml", "logging.progress_bar=false", "output_dir={root}/os_system",
         "rollout.reward.kind=callable", "rollout.reward.function=os:system"],
        ["`rollout.reward.function: os:system`", "`system(command)`",
         "`fn(prompts, completions, references) -> list of float`", "Nothing was called"]),
    Row("look-ahead store of another shape", "run", LOOKAHEAD + ["train.max_steps=4"],
        ["{root}/lookahead/checkpoints/step_2/reference_logps_rank00000.pt", "a list", "delete that file"]),
    Row("RANK=abc --validate", "run", R + ["--validate"], ["`RANK=abc`", "torchrun"], env={"RANK": "abc"}),
    Row("RANK=1 WORLD_SIZE=1 --validate", "run", R + ["--validate"], ["RANK=1", "WORLD_SIZE=1"],
        env={"RANK": "1", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531"}),
    Row("MASTER_PORT=abc --validate", "run", R + ["--validate"], ["`MASTER_PORT=abc`", "port"],
        env={"MASTER_PORT": "abc"}),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_fault_is_one_paragraph_and_exit_2(row, faults, clean_launch_env, monkeypatch, capsys, caplog):
    monkeypatch.chdir(fill(row.cwd, faults))
    code, output = run_row(row, faults, monkeypatch, capsys, caplog)
    check_refusal(row, code, output, faults)
    assert not (Path(faults["root"]) / "PWNED").exists()  # the pickle's code never ran


def test_weights_only_pickles_still_load(tmp_path):
    """The check refuses code, not weights: a plain state dict saved by torch passes, in either file format."""
    import torch

    from hl_core.models.loading import pickle_problem

    torch.save({"w": torch.ones(2)}, tmp_path / "zip.bin")
    torch.save({"w": torch.ones(2)}, tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    assert pickle_problem(tmp_path / "zip.bin") is None and pickle_problem(tmp_path / "legacy.bin") is None
    torch.save({"x": RunsCode("true")}, tmp_path / "legacy_code.bin", _use_new_zipfile_serialization=False)
    assert "does not load as weights only" in pickle_problem(tmp_path / "legacy_code.bin")


def test_reward_functions_of_the_called_signature_pass():
    from hl_core.errors import RecipeError
    from hl_core.rollout.rewards import check_reward_signature

    for fn in (lambda prompts, completions, references: [], lambda *args: [], lambda p, c, r=None, *, k=1: [], max):
        check_reward_signature(fn, "m:f")  # `max`: a builtin whose signature Python cannot read passes
    for fn in (lambda prompts, completions: [], lambda p, c, r, extra: [], os.system):
        with pytest.raises(RecipeError, match="fn\\(prompts, completions, references\\)"):
            check_reward_signature(fn, "m:f")
