"""The evaluation harnesses with the real SmolLM2-135M-Instruct (issue 46), offline, on sets the project wrote:
MATH-500 through lm-eval (a real accuracy and per-problem verdicts, each re-checked here with math-verify), and
AlpacaEval with a local judge (a fact-checking function): the win rate recomputed by hand from the saved
annotations, and its length-controlled form through alpaca_eval's GLM on a local stand-in for its gamed-baselines
table."""

from __future__ import annotations

import json
import math

import pytest

from helpers import REPO
from real_model import real_model_dir

pytestmark = pytest.mark.usefixtures("real_model", "no_network")
FIXTURES = REPO / "tests" / "fixtures" / "real"
FACTS = {"capital of France": ("paris",), "largest planet": ("jupiter",), "color is the sky": ("blue",),
         "days are in a week": ("seven", "7"), "opposite of hot": ("cold",), "says meow": ("cat",)}


def test_math500_real_accuracy_and_verdicts(tmp_path, monkeypatch):
    from math_verify import parse, verify

    from eval.math500 import run_math500

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = FIXTURES / "math500_easy.jsonl"
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    res = run_math500(real_model_dir(), data=str(data), backend="hf", temperature=0.0, prompt="boxed",
                      max_new_tokens=40, batch_size=8, dtype="float32", output_dir=tmp_path)
    assert res["backend"] == "hf" and res["chat_template"] is True and res["n_problems"] == len(rows)
    samples = [json.loads(line) for line in (tmp_path / "math500_samples.jsonl").read_text().splitlines()]
    assert len(samples) == len(rows)
    assert sorted(s["unique_id"] for s in samples) == sorted(r["unique_id"] for r in rows)
    verdicts = []
    for sample in samples:
        (completion,) = sample["completions"]
        row = next(r for r in rows if r["unique_id"] == sample["unique_id"])
        mine = float(verify(parse(f"${row['answer']}$"), parse(completion)))  # the scorer called here, directly
        assert sample["correct"] == [int(mine)], sample  # one verdict per sample (n = 1)
        verdicts.append(mine)
    assert res["pass@1"] == pytest.approx(sum(verdicts) / len(verdicts))
    assert 0.0 < res["pass@1"] < 1.0, samples  # a real model: some right, some wrong on these problems
    (tmp_path / "verdicts.json").write_text(json.dumps(verdicts))


def fact_judge(instruction, output_1, output_2):
    """AlpacaEval preference (1: the reference ``output_1`` wins, 2: the model's ``output_2``, 1.5: a tie): the
    output that states the fact the instruction asks for wins over one that does not."""
    (words,) = [w for key, w in FACTS.items() if key in instruction]
    has_1, has_2 = (any(w in o.lower() for w in words) for o in (output_1, output_2))
    return 1.5 if has_1 == has_2 else (2.0 if has_2 else 1.0)


def _lc_table(path, n):
    """A local stand-in for alpaca_eval's df_gamed.csv (difficulty + two length-gamed baselines): the GLM's inputs
    are not on this machine, and nothing may be downloaded."""
    import pandas as pd

    recs = [dict(model=model, index=i, instruction_difficulty=0.1 * i - 0.2, std_delta_len=sign * (1.0 + 0.1 * i),
                 preference=0.5 + 0.3 * math.tanh(-sign * (1.0 + 0.1 * i)), not_gamed_baseline=False)
            for model, sign in (("gamed_long", 1.0), ("gamed_short", -1.0)) for i in range(n)]
    pd.DataFrame(recs).to_csv(path, index=False)
    return path


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_alpaca_eval_win_rate_and_length_controlled(tmp_path):
    from eval.alpaca import run_alpaca_eval

    data = FIXTURES / "alpaca_facts.json"
    rows = json.loads(data.read_text())
    res = run_alpaca_eval(real_model_dir(), data=str(data), judge=fact_judge, backend="hf", temperature=0.0,
                          max_new_tokens=24, batch_size=6, dtype="float32", output_dir=tmp_path,
                          lc_data=str(_lc_table(tmp_path / "df_gamed.csv", len(rows))))
    outputs = json.loads((tmp_path / "alpaca_model_outputs.json").read_text())
    assert [o["instruction"] for o in outputs] == [r["instruction"] for r in rows]
    prefs = [fact_judge(r["instruction"], r["output"], o["output"]) for r, o in zip(rows, outputs)]
    annotations = json.loads((tmp_path / "alpaca_annotations.json").read_text())
    assert [a["preference"] for a in annotations] == prefs
    assert res["win_rate"] == pytest.approx(100 * sum(p - 1 for p in prefs) / len(prefs))
    assert "paris" in outputs[0]["output"].lower()  # the model's own answer, greedy: it knows this one
    assert res["computed"] == ["win_rate", "length_controlled_winrate"]
    assert 0.0 <= res["length_controlled_winrate"] <= 100.0 and res["lc_standard_error"] is not None
    (tmp_path / "summary.json").write_text(json.dumps({"prefs": prefs, "win_rate": res["win_rate"],
                                                       "lc": res["length_controlled_winrate"]}))
